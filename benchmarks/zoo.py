"""The models the suite measures, each an ONNX file plus the sizes to pin its free dims to.

The nine `light_*` models come from the onnx package (fixed batch 1), whose weights are
ConstantOfShape splats: the suite runs copies with dense seeded random weights in their place
(tests/light_models.py makes them, for the conformance tests too; cached under
build/bench/models/). The others are made here with random, seeded weights,
exported by PyTorch's TorchScript exporter (opset 17, as tests/data/make_*.py do, whose
module definitions they reuse), and cached there too. Without torch the older ones fall back
to the small committed models in tests/data/ or to graphs built with onnx.helper, and
`Bench.source` says so; the newer ones (unet, vit_saliency, vocoder, bert_qdq) raise
`Unavailable`, which the suite reports and skips.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = ROOT / "tests" / "data"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
OPSET = 17


@dataclass
class Bench:
    name: str
    path: Path
    source: str  # where the file came from, for the table
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic dim name -> value

    def data_inputs(self, model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
        inits = {t.name for t in model.graph.initializer}  # old exporters list weights as inputs
        return [vi for vi in model.graph.input if vi.name not in inits]

    def pins(self, model: onnx.ModelProto) -> dict[str, list[int | str]]:
        """Input dims for cuvil: a free leading dim stays the symbol "batch", others pinned."""
        pins: dict[str, list[int | str]] = {}
        for vi in self.data_inputs(model):
            dims: list[int | str] = []
            for axis, d in enumerate(vi.type.tensor_type.shape.dim):
                if d.HasField("dim_value"):
                    dims.append(d.dim_value)
                elif axis == 0:
                    dims.append("batch")
                elif d.dim_param in self.sizes:
                    dims.append(self.sizes[d.dim_param])
                else:
                    raise ValueError(f"{self.path}: input {vi.name!r} dim {axis} is free "
                                     f"({d.dim_param or 'unnamed'}); pin it with --sizes NAME=VALUE")
            pins[vi.name] = dims
        return pins

    def feeds(self, model: onnx.ModelProto, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds = {}
        for vi in self.data_inputs(model):
            shape = [batch if d == "batch" else int(d) for d in self.pins(model)[vi.name]]
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
            if dtype == np.bool_:
                feeds[vi.name] = np.zeros(shape, dtype)  # masks: attend everywhere
            elif dtype.kind in "iu":
                feeds[vi.name] = rng.integers(0, 1000, shape).astype(dtype)  # token ids
            else:
                feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        return feeds


# --- the onnx package's light models, with dense weights ---------------------------------------


def _light(name: str) -> Callable[[Path], Bench]:
    def make(cache: Path) -> Bench:
        path = cache / f"light_{name}_dense.onnx"
        source = "onnx package, dense random weights"
        if path.exists():
            return Bench(f"light_{name}", path, f"{source} (cached)")
        light_models = _test_module("light_models", ROOT / "tests")
        light_models.dense_copy(LIGHT / f"{light_models.MODELS[name]}.onnx", path)
        return Bench(f"light_{name}", path, source)
    return make


def _digits(cache: Path) -> Bench:
    return Bench("digits", ROOT / "examples" / "digits" / "models" / "classifier.onnx", "examples/digits")


# --- PyTorch models ---------------------------------------------------------------------------


class Unavailable(Exception):
    """A model this machine cannot make (a missing package): the suite says why and goes on."""


_NO_TORCH = "needs torch (a CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _test_module(name: str, folder: Path = TEST_DATA) -> Any:
    """tests/data/<name>.py (it defines the modules the tests' models use), or another
    folder's, as a module."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _export(model: Any, args: tuple, path: Path, inputs: dict[str, dict[int, str]],
            outputs: dict[str, dict[int, str]]) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with torch.no_grad():
        torch.onnx.export(model.eval(), args, str(partial), dynamo=False, opset_version=OPSET,
                          input_names=list(inputs), output_names=list(outputs),
                          dynamic_axes={**inputs, **outputs})
    partial.replace(path)  # a killed export leaves no half-written cache entry


def _mobilenet_v3() -> Any:
    """MobileNetV3-Small's widths and strides, built from the tests' inverted residual block."""
    import torch
    from torch import nn

    arch = _test_module("make_architectures")
    # (in, expand, out, stride) as in MobileNetV3-Small; every block has SE and HardSwish
    blocks = [(16, 16, 16, 2), (16, 72, 24, 2), (24, 88, 24, 1), (24, 96, 40, 2),
              (40, 240, 40, 1), (40, 240, 40, 1), (40, 120, 48, 1), (48, 144, 48, 1),
              (48, 288, 96, 2), (96, 576, 96, 1), (96, 576, 96, 1)]

    class MobileNetV3(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(arch._conv_bn(3, 16, 3, 2), nn.Hardswish())
            self.blocks = nn.Sequential(*[arch.InvertedResidual(*b) for b in blocks])
            self.last = nn.Sequential(arch._conv_bn(96, 576, 1), nn.Hardswish())
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, 1000))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            x = self.last(self.blocks(self.stem(image)))
            return self.classifier(torch.flatten(self.pool(x), 1))

    torch.manual_seed(0)
    model = MobileNetV3()
    arch._randomize_batchnorm(model)
    return model


def _yolo() -> Any:
    """The tests' YOLO neck and head over a wider backbone, 80 classes, at 320x320."""
    import torch
    from torch import nn

    arch = _test_module("make_architectures")
    conv = arch._conv_silu

    class YoloDetector(arch.YoloHead):
        classes = 80

        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.down = nn.Sequential(  # stride 16 (p4)
                conv(3, 16, 3, 2), conv(16, 32, 3, 2), conv(32, 32), conv(32, 64, 3, 2), conv(64, 64),
                conv(64, 128, 3, 2), conv(128, 128))
            self.p5 = nn.Sequential(conv(128, 256, 3, 2), conv(256, 256))
            self.lateral = conv(256, 128, 1)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.fuse = conv(256, 128)
            outs = self.anchors * (5 + self.classes)
            self.head4 = nn.Conv2d(128, outs, 1)
            self.head5 = nn.Conv2d(128, outs, 1)

    torch.manual_seed(1)
    return YoloDetector()


class _Speech:
    """A GRU acoustic model: strided Conv1d over 80 mel bins, two GRU layers, per-frame classes."""

    @staticmethod
    def make() -> Any:
        import torch
        from torch import nn

        class GruSpeech(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.subsample = nn.Sequential(nn.Conv1d(80, 256, 3, stride=2, padding=1), nn.ReLU())
                self.rnn = nn.GRU(256, 256, num_layers=2, batch_first=True)
                self.classify = nn.Linear(256, 29)

            def forward(self, mels: torch.Tensor) -> torch.Tensor:  # [batch, frames, 80]
                x = self.subsample(mels.transpose(1, 2)).transpose(1, 2)
                out, _ = self.rnn(x)
                return self.classify(out)

        torch.manual_seed(2)
        return GruSpeech()


def _bert() -> Any:
    """A BERT-style encoder: token + position embeddings, 6 post-norm layers, 384 wide, 12 heads."""
    import torch
    from torch import nn

    class Bert(nn.Module):
        def __init__(self, vocab: int = 8192, hidden: int = 384, layers: int = 6) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            self.positions = nn.Parameter(torch.randn(512, hidden) * 0.02)
            self.norm = nn.LayerNorm(hidden)
            layer = nn.TransformerEncoderLayer(hidden, 12, 4 * hidden, dropout=0.0, activation="gelu",
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.tokens(input_ids) + self.positions[: input_ids.shape[1]]
            return self.encoder(self.norm(x))

    torch.manual_seed(3)
    return Bert()


def _unet() -> Any:
    """A small U-Net for segmentation: four 2x poolings (16, 32, 64, 128 channels, 256 at the
    bottom), back up by ConvTranspose2d, 4x4 stride 2 padding 1 and 2x2 stride 2 in turn, each
    output concatenated with the encoder's map of that size; 21 classes per pixel."""
    import torch
    from torch import nn

    arch = _test_module("make_architectures")

    def double(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(arch._conv_bn(cin, cout, 3), nn.ReLU(), arch._conv_bn(cout, cout, 3), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128), classes: int = 21) -> None:
            super().__init__()
            ins = (3, *widths[:-1])
            self.down = nn.ModuleList(double(cin, cout) for cin, cout in zip(ins, widths))
            self.pool = nn.MaxPool2d(2)
            self.bottom = double(widths[-1], 2 * widths[-1])
            self.up = nn.ModuleList(
                nn.ConvTranspose2d(2 * w, w, 4, stride=2, padding=1) if i % 2 == 0
                else nn.ConvTranspose2d(2 * w, w, 2, stride=2)
                for i, w in enumerate(reversed(widths)))
            self.fuse = nn.ModuleList(double(2 * w, w) for w in reversed(widths))
            self.head = nn.Conv2d(widths[0], classes, 1)

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            skips = []
            x = image
            for down in self.down:
                x = down(x)
                skips.append(x)
                x = self.pool(x)
            x = self.bottom(x)
            for up, fuse, skip in zip(self.up, self.fuse, reversed(skips)):
                x = fuse(torch.cat([up(x), skip], 1))
            return self.head(x)

    torch.manual_seed(5)
    model = UNet()
    arch._randomize_batchnorm(model)
    return model


def _vit_saliency() -> Any:
    """A small ViT (16x16 patches of a 224x224 image, 6 pre-norm layers, 384 wide, 6 heads)
    whose head turns the 14x14 tokens back into a map with three ConvTranspose2d 4x4 stride 2
    (to 112x112) and a 1x1 conv: a saliency or depth decoder's shape. Each layer has its own
    random weights (nn.TransformerEncoder would copy one layer's)."""
    import torch
    from torch import nn

    class VitSaliency(nn.Module):
        def __init__(self, hidden: int = 384, heads: int = 6, layers: int = 6, grid: int = 14) -> None:
            super().__init__()
            self.hidden, self.grid = hidden, grid
            self.patches = nn.Conv2d(3, hidden, 16, stride=16)
            self.positions = nn.Parameter(torch.randn(1, grid * grid, hidden) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True) for _ in range(layers))
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Sequential(
                nn.ConvTranspose2d(hidden, 192, 4, stride=2, padding=1), nn.ReLU(),
                nn.ConvTranspose2d(192, 96, 4, stride=2, padding=1), nn.ReLU(),
                nn.ConvTranspose2d(96, 48, 4, stride=2, padding=1), nn.ReLU(), nn.Conv2d(48, 1, 1))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            x = self.patches(image).flatten(2).transpose(1, 2) + self.positions
            for layer in self.layers:
                x = layer(x)
            x = self.norm(x).transpose(1, 2).reshape(-1, self.hidden, self.grid, self.grid)
            return self.head(x)

    torch.manual_seed(6)
    return VitSaliency()


def _vocoder() -> Any:
    """A HiFi-GAN-like vocoder: mel frames [batch, 80, frames] -> 256 samples per frame through
    four ConvTranspose1d (256 -> 128 -> 64 -> 32 -> 16 channels, kernels 16/16/4/4, strides
    8/8/2/2), each followed by a residual block of two dilated Conv1d (kernel 3, dilations 1
    and 3, HiFi-GAN's ResBlock2), LeakyReLU 0.1 before every conv."""
    import torch
    from torch import nn

    class ResBlock(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            self.convs = nn.ModuleList(nn.Conv1d(channels, channels, 3, dilation=d, padding=d)
                                       for d in (1, 3))
            self.act = nn.LeakyReLU(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for conv in self.convs:
                x = x + conv(self.act(x))
            return x

    class Vocoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Conv1d(80, 256, 7, padding=3)
            stages = [(256, 128, 16, 8), (128, 64, 16, 8), (64, 32, 4, 2), (32, 16, 4, 2)]
            self.ups = nn.ModuleList(nn.ConvTranspose1d(cin, cout, k, stride=s, padding=(k - s) // 2)
                                     for cin, cout, k, s in stages)
            self.blocks = nn.ModuleList(ResBlock(cout) for _, cout, _, _ in stages)
            self.post = nn.Conv1d(16, 1, 7, padding=3)
            self.act = nn.LeakyReLU(0.1)

        def forward(self, mels: torch.Tensor) -> torch.Tensor:
            x = self.pre(mels)
            for up, block in zip(self.ups, self.blocks):
                x = block(up(self.act(x)))
            return torch.tanh(self.post(self.act(x)))

    torch.manual_seed(7)
    return Vocoder()


def _torch_only(name: str, export: Callable[[Path], None], sizes: dict[str, int]) -> Callable[[Path], Bench]:
    def make(cache: Path) -> Bench:
        path = cache / f"{name}.onnx"
        if path.exists():
            return Bench(name, path, "torch export (cached)", sizes)
        if not _has_torch():
            raise Unavailable(_NO_TORCH)
        export(path)
        return Bench(name, path, "torch export", sizes)
    return make


def _torch_or_fallback(name: str, export: Callable[[Path], None], sizes: dict[str, int],
                       fallback: Callable[[Path], Path], fallback_sizes: dict[str, int],
                       fallback_source: str) -> Callable[[Path], Bench]:
    def make(cache: Path) -> Bench:
        path = cache / f"{name}.onnx"
        if path.exists():
            return Bench(name, path, "torch export (cached)", sizes)
        if _has_torch():
            export(path)
            return Bench(name, path, "torch export", sizes)
        return Bench(name, fallback(cache), f"{fallback_source} (no torch)", fallback_sizes)
    return make


def _export_mobilenet(path: Path) -> None:
    import torch

    _export(_mobilenet_v3(), (torch.randn(1, 3, 224, 224),), path, {"image": {0: "batch"}},
            {"logits": {0: "batch"}})


def _export_yolo(path: Path) -> None:
    import torch

    _export(_yolo(), (torch.randn(1, 3, 320, 320),), path, {"image": {0: "batch"}},
            {"detections": {0: "batch"}})


def _export_crnn(path: Path) -> None:
    import torch

    torch.manual_seed(4)
    model = _test_module("make_crnn").CRNN(classes=37, hidden=128)
    _export(model, (torch.randn(1, 1, 32, 256),), path, {"image": {0: "batch", 3: "width"}},
            {"logits": {0: "steps", 1: "batch"}})


def _export_gru(path: Path) -> None:
    import torch

    _export(_Speech.make(), (torch.randn(1, 200, 80),), path, {"mels": {0: "batch", 1: "frames"}},
            {"logits": {0: "batch", 1: "steps"}})


def _export_bert(path: Path) -> None:
    import torch

    _transformer_export_setup()
    _export(_bert(), (torch.randint(0, 8192, (1, 128)),), path, {"input_ids": {0: "batch", 1: "seq"}},
            {"encoded": {0: "batch", 1: "seq"}})


def _transformer_export_setup() -> None:
    """As the tests' encoder export: no fused attention kernel, a Reshape-based unflatten."""
    import torch

    torch.backends.mha.set_fastpath_enabled(False)
    torch.onnx.register_custom_op_symbolic("aten::unflatten", _test_module("make_architectures")._unflatten,
                                           OPSET)


def _export_unet(path: Path) -> None:
    import torch

    _export(_unet(), (torch.randn(1, 3, 128, 128),), path, {"image": {0: "batch"}}, {"classes": {0: "batch"}})


def _export_vit(path: Path) -> None:
    import torch

    _transformer_export_setup()
    _export(_vit_saliency(), (torch.randn(1, 3, 224, 224),), path, {"image": {0: "batch"}},
            {"saliency": {0: "batch"}})


def _export_vocoder(path: Path) -> None:
    import torch

    _export(_vocoder(), (torch.randn(1, 80, 32),), path, {"mels": {0: "batch", 2: "frames"}},
            {"audio": {0: "batch", 2: "samples"}})


def unshare_weights(source: Path, out: Path) -> Path:
    """The model with each Identity of an initializer replaced by a copy of it. The zoo's
    encoder layers start as copies of one layer, and torch's exporter writes their equal
    weights once, read through Identity nodes; onnxruntime's quantizers take only
    initializers as weights, so they would quantize the first layer's products alone. The
    copies make the graph that of a trained model (one set of weights per layer)."""
    if out.exists():
        return out
    model = onnx.load(str(source))
    inits = {t.name: t for t in model.graph.initializer}
    kept = []
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input[0] in inits:
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[node.input[0]])
            copy.name = node.output[0]
            model.graph.initializer.append(copy)
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.onnx")
    onnx.save(model, str(partial))
    partial.replace(out)
    return out


def quantize_qdq(bench: Bench, model: onnx.ModelProto, out: Path, count: int) -> Path:
    """`quantize_static` in QDQ format on `count` random feeds (token ids 0..999, batch 1):
    per-channel int8 weights, int8 activations, min-max ranges, onnxruntime's default ops.
    The pre-processing skips symbolic shape inference, which does not complete on the torch
    export (cuvil's `quantize = "int8"` runs it, and fails there)."""
    from onnxruntime import quantization
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if not out.exists():
        feeds = iter([bench.feeds(model, 1, seed=100 + i) for i in range(count)])

        class Reader(quantization.CalibrationDataReader):
            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(feeds, None)

        prepared = out.with_suffix(".pre.onnx")
        quant_pre_process(str(bench.path), str(prepared), skip_symbolic_shape=True)
        partial = out.with_suffix(".partial.onnx")
        quantization.quantize_static(str(prepared), str(partial), Reader(),
                                     quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                     activation_type=quantization.QuantType.QInt8,
                                     weight_type=quantization.QuantType.QInt8)
        partial.replace(out)
        prepared.unlink()
    return out


def _bert_qdq(cache: Path) -> Bench:
    """The suite's `bert` as onnxruntime's static quantizer makes it: QDQ format, per-channel
    int8 weights, int8 activations calibrated on 4 batches of random token ids; each layer's
    weights unshared first (unshare_weights), so that every layer is quantized."""
    path = cache / "bert_qdq.onnx"
    source = "bert + onnxruntime quantize_static (QDQ, per-channel int8)"
    if path.exists():
        return Bench("bert_qdq", path, f"{source} (cached)", {"seq": 128})
    if not _has_torch() and not (cache / "bert.onnx").exists():
        raise Unavailable(_NO_TORCH + " for the float bert it quantizes")
    bert = MODELS["bert"](cache)
    unshared = Bench("bert", unshare_weights(bert.path, cache / "bert_unshared.onnx"), bert.source,
                     bert.sizes)
    quantize_qdq(unshared, onnx.load(str(unshared.path)), path, 4)
    return Bench("bert_qdq", path, source, {"seq": 128})


def _helper_gru(cache: Path) -> Path:
    """Without torch: one GRU layer (80 -> 256 over 200 frames) and a per-frame MatMul."""
    from onnx import TensorProto, helper, numpy_helper

    path = cache / "gru_speech-helper.onnx"
    if path.exists():
        return path
    rng = np.random.default_rng(2)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    nodes = [
        helper.make_node("Transpose", ["mels"], ["steps_first"], perm=[1, 0, 2]),
        helper.make_node("GRU", ["steps_first", "W", "R", "B"], ["states"], hidden_size=256),
        helper.make_node("Squeeze", ["states", "axis1"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "classes"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "gru_speech",
        [helper.make_tensor_value_info("mels", TensorProto.FLOAT, ["batch", "frames", 80])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["frames", "batch", 29])],
        [weight("W", 1, 768, 80), weight("R", 1, 768, 256), weight("B", 1, 1536),
         weight("classes", 256, 29), numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]), str(path))
    return path


def _bert_optimized(cache: Path) -> Bench:
    """The suite's BERT shape (6 layers, 384 wide, 12 heads, 8192 words) built with onnx.helper
    in Hugging Face's export form (tests/data/make_bert.py), then fused into com.microsoft ops
    by onnxruntime's transformer optimizer: EmbedLayerNormalization, Attention,
    SkipLayerNormalization, BiasGelu. 1000 token types, so that the suite's random ids
    (0..999) index every embedding table."""
    path = cache / "bert_optimized.onnx"
    if not path.exists():
        bert = _test_module("make_bert")
        path.parent.mkdir(parents=True, exist_ok=True)
        source = cache / "bert_unoptimized.onnx"
        onnx.save(bert.bert_model(layers=6, hidden=384, heads=12, vocab=8192, gelu=("erf",),
                                  token_types=1000), str(source))
        partial = path.with_suffix(".partial")
        bert.optimized_bert(str(source), str(partial), 12, 384)
        partial.replace(path)
    return Bench("bert_optimized", path, "onnx.helper + onnxruntime transformer optimizer", {"seq": 128})


def _committed(file: str) -> Callable[[Path], Path]:
    return lambda cache: TEST_DATA / file


MODELS: dict[str, Callable[[Path], Bench]] = {
    **{f"light_{name}": _light(name) for name in _test_module("light_models", ROOT / "tests").MODELS},
    "digits": _digits,
    "mobilenet_v3": _torch_or_fallback("mobilenet_v3", _export_mobilenet, {}, _committed(
        "mobilenet_block.onnx"), {"height": 224, "width": 224}, "tests/data/mobilenet_block.onnx"),
    "yolo": _torch_or_fallback("yolo", _export_yolo, {}, _committed("yolo_head.onnx"),
                               {"height": 320, "width": 320}, "tests/data/yolo_head.onnx"),
    "crnn": _torch_or_fallback("crnn", _export_crnn, {"width": 256}, _committed("crnn.onnx"),
                               {"width": 256}, "tests/data/crnn.onnx"),
    "gru_speech": _torch_or_fallback("gru_speech", _export_gru, {"frames": 200}, _helper_gru,
                                     {"frames": 200}, "onnx.helper GRU"),
    "bert": _torch_or_fallback("bert", _export_bert, {"seq": 128}, _committed(
        "transformer_encoder.onnx"), {"seq": 64}, "tests/data/transformer_encoder.onnx (seq 64)"),
    "bert_optimized": _bert_optimized,
    "bert_qdq": _bert_qdq,
    "unet": _torch_only("unet", _export_unet, {}),
    "vit_saliency": _torch_only("vit_saliency", _export_vit, {}),
    "vocoder": _torch_only("vocoder", _export_vocoder, {"frames": 32}),
}


def get(name: str, cache: Path, sizes: dict[str, int] | None = None) -> Bench:
    """A model by its suite name, or any .onnx file by path (its free non-batch dims pinned
    to `sizes`, by dim name)."""
    if name in MODELS:
        return MODELS[name](cache)
    path = Path(name)
    if path.suffix == ".onnx" and path.is_file():
        return Bench(path.stem, path.resolve(), str(path), dict(sizes or {}))
    raise ValueError(unknown(name))


def unknown(name: str) -> str:
    return f"unknown model {name!r}: pick from {', '.join(MODELS)} or give the path of a .onnx file"


def exists(name: str) -> bool:
    return name in MODELS or (name.endswith(".onnx") and Path(name).is_file())
