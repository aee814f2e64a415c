"""precision = "bf16": models whose products compute in bfloat16 agree with onnxruntime (float32)
within the bound docs/precision.md documents, take the bf16 paths (and only for the products it
covers), keep a symbolic batch working, classify held-out digits as float32 does; the setting
is read from the project and checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from oracle import make_model, run_ort

import cuvil
from cuvil.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
#: docs/precision.md: an output is within this fraction of the largest output of its tensor;
#: a probability after a softmax within this much of float32's
BOUND = 2e-2
PROBABILITY_BOUND = 5e-2


def _mixed_model():
    """A strided 3x3 conv (im2col), a 1x1 conv with a residual, a grouped conv, a Winograd-size
    3x3 conv (stays float32), Gemm (transB) and MatMul with constant weights, batch symbolic."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"]),
        helper.make_node("Add", ["c2", "r1"], ["a2"]),
        helper.make_node("Conv", ["a2", "w3"], ["c3"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c3", "w4"], ["c4"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c4"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "wm"], ["y"]),
    ]
    weights = {"w1": w(40, 3, 3, 3), "b1": w(40), "w2": w(40, 40, 1, 1), "w3": w(40, 10, 3, 3),
               "w4": w(64, 40, 3, 3), "wg": w(50, 64), "bg": w(50), "wm": w(50, 37)}
    return make_model(nodes, {"x": (np.float32, ["batch", 3, 33, 33])}, {"y": np.float32},
                      weights)


@pytest.fixture(scope="module")
def mixed():
    model = _mixed_model()
    return model, cuvil.compile(model, precision="bf16")


def test_bf16_model_matches_onnxruntime_within_the_bound(mixed) -> None:
    model, compiled = mixed
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 33, 33)).astype(np.float32)
        want = run_ort(model, {"x": x})[0]
        got = compiled(x)
        err = np.abs(got - want).max() / np.abs(want).max()
        # within the bound, and not float32's result: the products did run in bf16
        assert 1e-5 < err < BOUND, err


def test_bf16_paths_are_the_products_it_covers(mixed) -> None:
    _, compiled = mixed
    x = np.zeros((2, 3, 33, 33), np.float32)
    ops = [row.op for row in compiled.profile({"x": x}, runs=1).nodes]
    assert sum("Conv(bf16)" in op for op in ops) == 3, ops
    assert any(op.startswith("Conv(winograd)") for op in ops), ops
    assert any(op.startswith("Gemm(bf16)") for op in ops) and "MatMul(bf16)" in ops, ops


def test_digits_cnn_classifies_held_out_digits_as_float32_does() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    _, x_test, _, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                            stratify=digits.target)
    path = ROOT / "examples" / "digits" / "models" / "classifier.onnx"
    f32 = cuvil.compile(path)(x_test)
    bf16 = cuvil.compile(path, precision="bf16")(x_test)
    agree = np.mean(f32.argmax(1) == bf16.argmax(1))
    accuracy = {name: float(np.mean(p.argmax(1) == y_test)) for name, p in
                (("float32", f32), ("bf16", bf16))}
    assert agree >= 0.99 and abs(accuracy["bf16"] - accuracy["float32"]) <= 0.005, \
        (agree, accuracy)
    assert np.abs(bf16 - f32).max() < PROBABILITY_BOUND


def test_precision_is_checked() -> None:
    with pytest.raises(ConfigError, match="precision = 'fp8' is not one of 'float32', 'bf16'"):
        cuvil.compile(_mixed_model(), precision="fp8")


def test_precision_from_the_project(tmp_path: Path) -> None:
    from cuvil.config import load_project

    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "1"\n[tool.cuvil.models.m]\nsource = "m.onnx"\n'
        'precision = "bf16"\n')
    assert load_project(tmp_path).models[0].precision == "bf16"
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "p"\nversion = "1"\n[tool.cuvil.models.m]\nsource = "m.onnx"\n'
        'precision = "half"\n')
    with pytest.raises(ConfigError, match=r'precision.*one of "float32", "bf16"'):
        load_project(tmp_path)
