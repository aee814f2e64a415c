"""Export the small architectures that `tests/test_architectures.py` compiles.

Four shapes of network a user is likely to bring, each small (random, seeded weights; a few
thousand parameters) so the .onnx files stay in the repository:

- `resnet_small.onnx`: stem Conv3x3+BN+ReLU, three stages of two BasicBlocks (the first of
  stages 2 and 3 downsamples with stride 2 and a 1x1 Conv+BN shortcut), global average pool,
  Linear. Input `image` [batch, 3, height, width].
- `mobilenet_block.onnx`: MobileNetV3-style inverted residual blocks: 1x1 expand Conv+BN+
  HardSwish, depthwise 3x3 (stride 1 and 2) + BN + HardSwish, squeeze-excite (global average
  pool, 1x1 Conv, ReLU, 1x1 Conv, HardSigmoid, Mul), 1x1 project Conv+BN, residual Add.
  Input `image` [batch, 3, height, width].
- `yolo_head.onnx`: a tiny conv backbone giving stride-16 and stride-32 maps, an FPN-style
  neck (nearest Upsample x2 = Resize, Concat, Conv+SiLU), per-level detection convs whose
  outputs are reshaped/permuted to [batch, anchors*cells, 5+classes], split into box /
  objectness / class parts (Split), squashed with Sigmoid and concatenated back. Input
  `image` [batch, 3, height, width] with height and width multiples of 32.
- `transformer_encoder.onnx`: a token embedding projection plus learned positions (sliced to
  the sequence length), one nn.TransformerEncoderLayer (d_model 32, 4 heads, GELU, pre-norm),
  and a final LayerNorm. Inputs `features` [batch, seq, 12] and `padding` [batch, seq] (bool
  key padding mask: True = ignore that position).

BatchNorm layers get random running statistics so that the BN arithmetic is exercised (fresh
layers have mean 0, var 1). The ResNet is exported with its BatchNormalization nodes kept;
the other models have them folded into the convolutions by the exporter, as usual.

The test needs only the .onnx files; re-run this script (with torch installed) to remake
them and print each model's size and op histogram:

    python tests/data/make_architectures.py
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent
OPSET = 17


def _randomize_batchnorm(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n) * 0.1)
            m.running_var.copy_(torch.rand(n) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(n) * 0.1)


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


# --- ResNet -----------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = _conv_bn(cin, cout, 3, stride)
        self.conv2 = _conv_bn(cout, cout, 3)
        self.relu = nn.ReLU()
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.relu(self.conv1(x)))
        s = x if self.shortcut is None else self.shortcut(x)
        return self.relu(y + s)


class ResNetSmall(nn.Module):
    def __init__(self, classes: int = 10, widths: tuple[int, ...] = (8, 16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, widths[0], 3), nn.ReLU())
        layers = []
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, w, stride), BasicBlock(w, w, 1)]
            cin = w
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(image))
        return self.fc(torch.flatten(self.pool(x), 1))


# --- MobileNetV3 blocks -----------------------------------------------------------------------


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeeze: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, expand: int, cout: int, stride: int) -> None:
        super().__init__()
        self.expand = nn.Sequential(_conv_bn(cin, expand, 1), nn.Hardswish())
        self.depthwise = nn.Sequential(_conv_bn(expand, expand, 3, stride, groups=expand), nn.Hardswish())
        self.se = SqueezeExcite(expand, max(expand // 4, 4))
        self.project = _conv_bn(expand, cout, 1)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class MobileNetBlocks(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 8, 3, 2), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(8, 16, 8, 1),   # residual
            InvertedResidual(8, 24, 16, 2),  # downsampling depthwise
            InvertedResidual(16, 32, 16, 1),  # residual
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(image))
        return self.fc(torch.flatten(self.pool(x), 1))


# --- YOLO-style neck and head -----------------------------------------------------------------


def _conv_silu(cin: int, cout: int, k: int = 3, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2), nn.SiLU())


class YoloHead(nn.Module):
    anchors = 3
    classes = 4

    def __init__(self) -> None:
        super().__init__()
        # backbone: stride 2, 4, 8, 16 (p4), 32 (p5)
        self.down = nn.Sequential(
            _conv_silu(3, 8, 3, 2), _conv_silu(8, 8, 3, 2), _conv_silu(8, 16, 3, 2), _conv_silu(16, 16, 3, 2),
        )
        self.p5 = _conv_silu(16, 24, 3, 2)
        # neck
        self.lateral = _conv_silu(24, 16, 1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.fuse = _conv_silu(32, 16, 3)
        # heads
        outs = self.anchors * (5 + self.classes)
        self.head4 = nn.Conv2d(16, outs, 1)
        self.head5 = nn.Conv2d(16, outs, 1)

    def _detections(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        x = x.view(b, self.anchors, 5 + self.classes, h, w).permute(0, 1, 3, 4, 2)
        x = x.reshape(b, self.anchors * h * w, 5 + self.classes)
        box, obj, cls = torch.split(x, [4, 1, self.classes], dim=-1)
        xy, wh = box.chunk(2, dim=-1)
        return torch.cat([torch.sigmoid(xy) * 2 - 0.5, torch.exp(wh.clamp(max=4.0)),
                          torch.sigmoid(obj), torch.sigmoid(cls)], dim=-1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        p4 = self.down(image)
        p5 = self.lateral(self.p5(p4))
        n4 = self.fuse(torch.cat([self.up(p5), p4], dim=1))
        return torch.cat([self._detections(self.head4(n4)), self._detections(self.head5(p5))], dim=1)


# --- Transformer encoder ----------------------------------------------------------------------


class TinyEncoder(nn.Module):
    def __init__(self, features: int = 12, d_model: int = 32, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        self.positions = nn.Parameter(torch.randn(max_len, d_model) * 0.1)
        self.layer = nn.TransformerEncoderLayer(
            d_model=d_model, nhead=4, dim_feedforward=64, activation="gelu", batch_first=True,
            norm_first=True, dropout=0.0,
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, features: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.embed(features) + self.positions[: features.shape[1]]
        return self.norm(self.layer(x, src_key_padding_mask=padding))


# --- export -----------------------------------------------------------------------------------


def _unflatten(g, input, dim, unflattened_size):
    """aten::unflatten as one Reshape that copies the kept dims (0) from the input.

    The TorchScript exporter's own unflatten writes the kept dims as Slices of Shape whose
    bounds it computes with Mod; its shape inference then takes the traced sizes for them, so
    a later `k.shape[0]` in nn.MultiheadAttention is written as the constant sequence length
    of the example input and the exported model fails (in onnxruntime too) for any other.
    """
    from torch.onnx import symbolic_helper

    rank = symbolic_helper._get_tensor_rank(input)
    dim = symbolic_helper._get_const(dim, "i", "dim") % rank
    # MultiheadAttention passes (3, E) with E traced from a size: that one becomes -1
    sizes = [symbolic_helper._maybe_get_const(v, "i") for v in symbolic_helper._unpack_list(unflattened_size)]
    sizes = [v if isinstance(v, int) else -1 for v in sizes]
    assert sizes.count(-1) <= 1, sizes
    shape = [0] * dim + sizes + [0] * (rank - dim - 1)
    if 0 in shape and -1 not in shape:  # the exporter's shape inference wants a -1 beside 0s
        shape[len(shape) - 1 - shape[::-1].index(0)] = -1
    return g.op("Reshape", input, g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)))



def _export(model: nn.Module, args: tuple, name: str, inputs: dict[str, dict[int, str]],
            outputs: dict[str, dict[int, str]], fold_batchnorm: bool = True) -> None:
    path = HERE / name
    # In EVAL mode the exporter folds each BatchNorm into the Conv before it (what users'
    # exports usually hold); PRESERVE with an eval-mode model keeps BatchNormalization nodes
    # (training_mode=0), so one model checks cuvil's own handling of them.
    training = torch.onnx.TrainingMode.EVAL if fold_batchnorm else torch.onnx.TrainingMode.PRESERVE
    with torch.no_grad():
        torch.onnx.export(
            model, args, str(path), dynamo=False, opset_version=OPSET, training=training,
            input_names=list(inputs), output_names=list(outputs),
            dynamic_axes={**inputs, **outputs},
        )
    import onnx

    proto = onnx.load(str(path))
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    print(f"{name}: {path.stat().st_size / 1024:.1f} KB, {len(proto.graph.node)} nodes")
    print("   ", ", ".join(f"{op} {n}" for op, n in sorted(ops.items())))


def main() -> None:
    image_axes = {0: "batch", 2: "height", 3: "width"}

    torch.manual_seed(0)
    resnet = ResNetSmall()
    _randomize_batchnorm(resnet)
    _export(resnet.eval(), (torch.randn(2, 3, 32, 32),), "resnet_small.onnx",
            {"image": image_axes}, {"logits": {0: "batch"}}, fold_batchnorm=False)

    torch.manual_seed(1)
    mobilenet = MobileNetBlocks()
    _randomize_batchnorm(mobilenet)
    _export(mobilenet.eval(), (torch.randn(2, 3, 32, 32),), "mobilenet_block.onnx",
            {"image": image_axes}, {"logits": {0: "batch"}})

    torch.manual_seed(2)
    _export(YoloHead().eval(), (torch.randn(2, 3, 64, 96),), "yolo_head.onnx",
            {"image": image_axes}, {"detections": {0: "batch", 1: "boxes"}})

    torch.manual_seed(3)
    encoder = TinyEncoder().eval()
    features = torch.randn(2, 10, 12)
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 7:] = True
    # nn.TransformerEncoderLayer's fused inference kernel has no ONNX export: turn it off so
    # the layer is traced as its plain ops (LayerNormalization, MatMul, Softmax, Gelu, ...)
    torch.backends.mha.set_fastpath_enabled(False)
    torch.onnx.register_custom_op_symbolic("aten::unflatten", _unflatten, OPSET)
    _export(encoder, (features, padding), "transformer_encoder.onnx",
            {"features": {0: "batch", 1: "seq"}, "padding": {0: "batch", 1: "seq"}},
            {"encoded": {0: "batch", 1: "seq"}})


if __name__ == "__main__":
    main()
