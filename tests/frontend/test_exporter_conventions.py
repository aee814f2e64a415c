"""Unknown dims as exporters write them: each is a dim of its own, free at run time unless the
config pins it. The models come from the real exporters (tests/data/exporters/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from oracle import run_ort

import cuvil

DATA = Path(__file__).resolve().parent.parent / "data" / "exporters"
RNG = np.random.default_rng(0)


def assert_matches_ort(path: Path, compiled: cuvil.Model, shapes: dict[str, tuple[int, ...]]) -> None:
    model = onnx.load(str(path))
    feeds = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for out, expected in zip(model.graph.output, want):
        np.testing.assert_allclose(got[out.name], expected, rtol=1e-4, atol=1e-5)


# model file -> input name, how many of its dims are free, shapes to run it at
EXPORTS = {
    "paddle_classifier.onnx": ("x", 3, [(1, 3, 48, 192), (3, 3, 32, 20)]),  # "DynamicDimension.N"
    "paddle_legacy_classifier.onnx": ("x", 3, [(1, 3, 48, 192), (2, 3, 17, 40)]),  # -1 and "?"
    "tf_classifier.onnx": ("image", 3, [(1, 24, 24, 3), (2, 15, 31, 3)]),  # "unk__N", NHWC
    "torch_sequence.onnx": ("signal", 2, [(1, 4, 16), (5, 4, 7)]),  # named dynamic axes
}


@pytest.mark.parametrize("name", EXPORTS)
def test_exported_models_run_at_any_size(name: str) -> None:
    path = DATA / name
    compiled = cuvil.compile(path)
    inp, free, shapes = EXPORTS[name]
    (info,) = compiled.inputs
    assert sum(isinstance(d, str) for d in info.shape) == free
    for shape in shapes:
        assert_matches_ort(path, compiled, {inp: shape})


def test_legacy_paddle_dims_are_separate_symbols() -> None:
    # -1 is not a size, and the two "?" dims are different dims: height 17 and width 40
    compiled = cuvil.compile(DATA / "paddle_legacy_classifier.onnx")
    (info,) = compiled.inputs
    batch, channels, height, width = info.shape
    assert channels == 3 and len({batch, height, width}) == 3
    assert all(isinstance(d, str) for d in (batch, height, width))


def test_legacy_paddle_dims_can_be_pinned() -> None:
    path = DATA / "paddle_legacy_classifier.onnx"
    fixed = cuvil.compile(path, inputs={"x": [1, 3, 48, 192]})
    assert fixed.inputs[0].shape == (1, 3, 48, 192)
    assert_matches_ort(path, fixed, {"x": (1, 3, 48, 192)})
    batched = cuvil.compile(path, inputs={"x": ["batch", 3, 48, 192]})
    assert batched.inputs[0].shape == ("batch", 3, 48, 192)
    assert_matches_ort(path, batched, {"x": (4, 3, 48, 192)})
    with pytest.raises(ValueError, match="dim 2"):
        batched.run({"x": np.zeros((4, 3, 32, 192), np.float32)})


def test_zero_dim_is_empty_unless_pinned() -> None:
    # ONNX's 0 is an empty dim (onnxruntime agrees); some exporters mean "unknown" by it,
    # which a pin says
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "zero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [0, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [0, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert cuvil.compile(model).inputs[0].shape == (0, 3)
    pinned = cuvil.compile(model, inputs={"x": ["n", 3]})
    x = RNG.standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_array_equal(pinned.run({"x": x})["y"], np.maximum(x, 0))


def test_two_inputs_with_unknown_batches_meet_at_run_time() -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])], "add",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [-1, 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["?", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    compiled = cuvil.compile(model)
    a, b = (RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(compiled.run({"a": a, "b": b})["y"], run_ort(model, {"a": a, "b": b})[0])
    # cuvil's code assumes two free dims an op lines up are equal: a batch of 1 against one of
    # 3 is refused with the reason (onnxruntime would broadcast it)
    with pytest.raises(ValueError, match="broadcast axis 0"):
        compiled.run({"a": a, "b": b[:1]})
