"""Export the small PyTorch models that `tests/frontend/test_dynamic_shapes.py` compiles.

Each model computes shapes inside the graph the way `torch.onnx.export(..., dynamic_axes=...)`
writes them (Shape -> Gather -> Unsqueeze -> Concat -> Reshape, Range over a dim, Slice by a
dim divided by 2, ConstantOfShape, Expand with -1...). The tests need only the .onnx files;
re-run this script (with torch installed) to remake them:

    python tests/data/make_dynamic_models.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

HERE = Path(__file__).parent
OPSET = 17


class FlattenView(nn.Module):
    """x.view(batch, -1) before a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x.view(x.size(0), -1)))


class Heads(nn.Module):
    """Multi-head self-attention reshapes: view(b, s, heads, d).transpose(1, 2) and back."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(16, dim=-1)
        q = q.reshape(b, s, 4, 4).transpose(1, 2)
        k = k.reshape(b, s, 4, 4).transpose(1, 2)
        v = v.reshape(b, s, 4, 4).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, s, 16))


class Positions(nn.Module):
    """Position embeddings from arange(seq), a half-length slice, zeros of a computed shape."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(64, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = x.size(1)
        y = x + self.pos(torch.arange(seq)).unsqueeze(0)
        half = y[:, : seq // 2]
        pad = torch.zeros(x.size(0), 1, x.size(2))
        return torch.cat([pad, half], dim=1), y.reshape(x.size(0), -1)


class ExpandPad(nn.Module):
    """expand(-1, 3, -1, -1), reflect padding, a tail slice, a flatten."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.expand(-1, 3, -1, -1)
        y = F.pad(y, (1, 2, 0, 1), mode="reflect")
        y = y[:, :, 1:, : y.size(3) - 1]
        return torch.flatten(y, start_dim=1) * 2.0


class PairsView(nn.Module):
    """view(b, -1, 16): valid only when seq * 8 is a multiple of 16 (seq even)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1, 16).transpose(1, 2)


class TwoInputs(nn.Module):
    """An image and a sequence sharing the batch dim: every dim symbolic."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b = image.size(0)
        feat = torch.relu(self.conv(image)).reshape(b, 4, -1).mean(dim=2)
        seq = self.fc(tokens).mean(dim=1)
        return torch.cat([feat, seq], dim=1).unsqueeze(1).expand(-1, tokens.size(1), -1)


class UpsampleTo(nn.Module):
    """Resize to another input's spatial size (a U-Net skip connection)."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=skip.shape[-2:], mode="nearest") + skip


def export(model: nn.Module, args: tuple[torch.Tensor, ...], name: str,
           inputs: dict[str, dict[int, str]], outputs: list[str]) -> None:
    torch.manual_seed(0)
    path = HERE / f"{name}.onnx"
    model.eval()
    torch.onnx.export(model, args, str(path), dynamo=False, opset_version=OPSET,
                      input_names=list(inputs), output_names=outputs,
                      dynamic_axes={**inputs, **{o: {0: "batch"} for o in outputs}})
    size = path.stat().st_size
    assert size < 200_000, f"{path} is {size} bytes"
    print(f"wrote {path.name} ({size} bytes)")


def main() -> None:
    torch.manual_seed(0)
    export(FlattenView(), (torch.randn(2, 4, 6),), "flatten_view",
           {"x": {0: "batch"}}, ["y"])
    export(Heads(), (torch.randn(2, 5, 16),), "heads",
           {"x": {0: "batch", 1: "seq"}}, ["y"])
    export(Positions(), (torch.randn(2, 6, 8),), "positions",
           {"x": {0: "batch", 1: "seq"}}, ["head", "flat"])
    export(ExpandPad(), (torch.randn(2, 1, 5, 7),), "expand_pad",
           {"x": {0: "batch", 2: "height", 3: "width"}}, ["y"])
    export(PairsView(), (torch.randn(2, 6, 8),), "pairs_view",
           {"x": {0: "batch", 1: "seq"}}, ["y"])
    export(TwoInputs(), (torch.randn(2, 3, 5, 7), torch.randn(2, 6, 8)), "two_inputs",
           {"image": {0: "batch", 2: "height", 3: "width"}, "tokens": {0: "batch", 1: "seq"}},
           ["y"])
    export(UpsampleTo(), (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 8)), "upsample_to",
           {"x": {0: "batch", 2: "height", 3: "width"},
            "skip": {0: "batch", 2: "skip_height", 3: "skip_width"}}, ["y"])


if __name__ == "__main__":
    main()
