"""Whole networks exported from PyTorch, against onnxruntime, at several sizes per compile.

The models (tests/data/make_architectures.py makes them; CI needs only the .onnx files):
a small ResNet (BatchNormalization kept), MobileNetV3 blocks (depthwise convs, HardSwish,
squeeze-excite), a YOLO-style neck and head (Resize, Concat, Split, Sigmoid, detection
reshapes) and a transformer encoder layer with a key padding mask (LayerNormalization, Erf
GELU, attention as MatMul/Softmax, the exporter's Shape/Gather/Concat/Reshape arithmetic).
Each is compiled once with its exported symbolic dims and then run at several batch sizes and
image sizes or sequence lengths; every output must match onnxruntime's.

Tolerances: float32 with rtol 1e-4 and atol 1e-5 (the oracle's default) for all models. The
measured worst differences are ~1e-7 absolute (outputs of order 1), so the margin is wide
without hiding a wrong tap, channel or position, which would show as errors of order 1e-1.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from oracle import assert_matches_ort, run_ort

import cuvil

DATA = Path(__file__).parent / "data"
IMAGE_DIMS = ("batch", 3, "height", "width")


@functools.cache
def _model(name: str) -> onnx.ModelProto:
    return onnx.load(str(DATA / f"{name}.onnx"))


@functools.cache
def _compiled(name: str) -> Any:
    """Compiled once per test session, with the model's own symbolic dims (no pins)."""
    return cuvil.compile(_model(name))


def _image(rng: np.random.Generator, batch: int, height: int, width: int) -> dict[str, np.ndarray]:
    return {"image": rng.standard_normal((batch, 3, height, width)).astype(np.float32)}


def _check(name: str, feeds: dict[str, np.ndarray]) -> None:
    # outputs that vary across the batch: a model that ignored its input would fail here,
    # not pass the comparison with a constant
    (want,) = run_ort(_model(name), feeds)
    if want.shape[0] > 1:
        assert np.ptp(want, axis=0).max() > 1e-3, f"{name}: degenerate test inputs"
    assert_matches_ort(_model(name), feeds, rtol=1e-4, atol=1e-5, compiled=_compiled(name))


@pytest.mark.parametrize("name", ["resnet_small", "mobilenet_block", "yolo_head"])
def test_image_models_keep_symbolic_dims(name: str) -> None:
    compiled = _compiled(name)
    assert [(i.name, i.shape) for i in compiled.inputs] == [("image", IMAGE_DIMS)]
    assert compiled.inputs[0].dtype == np.float32


def test_encoder_keeps_symbolic_dims() -> None:
    compiled = _compiled("transformer_encoder")
    assert [(i.name, i.shape, i.dtype) for i in compiled.inputs] == [
        ("features", ("batch", "seq", 12), np.dtype(np.float32)),
        ("padding", ("batch", "seq"), np.dtype(np.bool_)),
    ]
    assert compiled.outputs[0].shape[0] == "batch" and compiled.outputs[0].shape[2] == 32


# sizes: odd ones (the stride-2 convs round), non-square, and batch 1 and 3
@pytest.mark.parametrize("batch,height,width", [(1, 32, 32), (3, 45, 61), (2, 64, 24)])
def test_resnet_small(batch: int, height: int, width: int) -> None:
    _check("resnet_small", _image(np.random.default_rng(height), batch, height, width))
    assert _compiled("resnet_small").outputs[0].shape == ("batch", 10)


@pytest.mark.parametrize("batch,height,width", [(1, 32, 32), (3, 57, 40), (2, 96, 17)])
def test_mobilenet_block(batch: int, height: int, width: int) -> None:
    _check("mobilenet_block", _image(np.random.default_rng(height), batch, height, width))


@pytest.mark.parametrize("batch,height,width", [(1, 64, 96), (3, 32, 32), (2, 128, 64)])
def test_yolo_head(batch: int, height: int, width: int) -> None:
    feeds = _image(np.random.default_rng(height), batch, height, width)
    _check("yolo_head", feeds)
    # three anchors per cell of the stride-16 and stride-32 maps, 4 box + 1 objectness + 4 classes
    cells = (height // 16) * (width // 16) + (height // 32) * (width // 32)
    assert _compiled("yolo_head")(feeds["image"]).shape == (batch, 3 * cells, 9)


def test_yolo_head_refuses_sizes_its_concat_cannot_take() -> None:
    """Height 48: the upsampled stride-32 map has 4 rows and the stride-16 map 3, so the
    neck's Concat has no valid shape. onnxruntime fails; cuvil must refuse too,
    naming the node, instead of reading past a buffer."""
    feeds = _image(np.random.default_rng(0), 1, 48, 64)
    with pytest.raises(Exception, match="Concat node"):  # onnxruntime's Fail
        run_ort(_model("yolo_head"), feeds)
    with pytest.raises(ValueError, match="Concat"):
        _compiled("yolo_head")(feeds["image"])


def _encoder_feeds(rng: np.random.Generator, batch: int, seq: int) -> dict[str, np.ndarray]:
    padding = rng.random((batch, seq)) < 0.3
    # a row padded everywhere gives NaN (softmax over nothing) in both; keep one token per row
    padding[:, 0] = False
    return {"features": rng.standard_normal((batch, seq, 12)).astype(np.float32), "padding": padding}


@pytest.mark.parametrize("batch,seq", [(1, 1), (3, 7), (2, 33), (1, 64)])
def test_transformer_encoder(batch: int, seq: int) -> None:
    _check("transformer_encoder", _encoder_feeds(np.random.default_rng(seq), batch, seq))


def test_transformer_encoder_without_padding() -> None:
    feeds = _encoder_feeds(np.random.default_rng(5), 3, 12)
    feeds["padding"][:] = False
    _check("transformer_encoder", feeds)


def test_transformer_encoder_refuses_more_positions_than_it_has() -> None:
    """The learned positions hold 64 rows; a 65-token input cannot be added to them."""
    feeds = _encoder_feeds(np.random.default_rng(0), 1, 65)
    with pytest.raises(Exception, match="Add node"):
        run_ort(_model("transformer_encoder"), feeds)
    with pytest.raises(ValueError, match="Add"):
        _compiled("transformer_encoder").run(feeds)
