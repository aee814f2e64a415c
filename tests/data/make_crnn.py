"""Export the small CRNN that `tests/ops/test_recurrent.py` compiles (`crnn.onnx`).

A text-line recognizer's shape: Conv -> ReLU -> MaxPool (twice) over a [batch, 1, 32, width]
image, the feature map turned into a sequence along the width (permute + reshape, which the
exporter writes as Shape/Gather/Concat/Reshape for the dynamic dims), a bidirectional LSTM,
and a per-step linear classifier. Weights are random (seeded): the test compares cuvil with
onnxruntime, not with labels. The test needs only the .onnx file; re-run this script (with
torch installed) to remake it:

    python tests/data/make_crnn.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent
OPSET = 17


class CRNN(nn.Module):
    def __init__(self, classes: int = 11, hidden: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.rnn = nn.LSTM(16 * 8, hidden, bidirectional=True)
        self.classify = nn.Linear(2 * hidden, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        f = self.features(image)  # [batch, 16, 8, width/4]
        b, c, h, w = f.shape
        seq = f.permute(3, 0, 1, 2).reshape(w, b, c * h)  # [width/4, batch, 128]
        out, _ = self.rnn(seq)
        return self.classify(out)  # [width/4, batch, classes]


def main() -> None:
    torch.manual_seed(0)
    model = CRNN().eval()
    example = torch.randn(2, 1, 32, 40)
    torch.onnx.export(
        model, (example,), str(HERE / "crnn.onnx"), dynamo=False, opset_version=OPSET,
        input_names=["image"], output_names=["logits"],
        dynamic_axes={"image": {0: "batch", 3: "width"}, "logits": {0: "steps", 1: "batch"}},
    )


if __name__ == "__main__":
    main()
