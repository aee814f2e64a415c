"""Dynamic shapes: shape arithmetic inside the graph resolved at compile time, one library
for every size, pins, and clear errors for sizes that break a model's constraints.

The PyTorch-exported models under tests/data/ come from tests/data/make_dynamic_models.py
(torch is not needed to run these tests). onnxruntime is the oracle throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracle import run_ort

import cuvil
from cuvil.compiler.frontend import import_model
from cuvil.compiler.ir import symbol
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.errors import UnsupportedOpError

DATA = Path(__file__).parents[1] / "data"


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list[Any]]],
           outputs: list[Any], inits: dict[str, np.ndarray] | None = None,
           opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "dyn", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_tensor_value_info(*o) if isinstance(o, tuple)
         else helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _compare(compiled: Any, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for info, expected in zip(compiled.outputs, want):
        have = got[info.name]
        assert have.shape == expected.shape, f"{info.name}: {have.shape} != {expected.shape}"
        assert have.dtype == expected.dtype, f"{info.name}: {have.dtype} != {expected.dtype}"
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(have, expected, rtol=1e-4, atol=1e-5, err_msg=info.name)
        else:
            np.testing.assert_array_equal(have, expected, err_msg=info.name)


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


# -- compile-time resolution -----------------------------------------------------------------

def test_reshape_of_computed_shape_types_symbolically() -> None:
    """Reshape(x, Concat(Shape(x)[0:1], [-1])) on [batch, 3, 4] is [batch, 12], with no
    Shape, Slice or Concat left in the graph."""
    n = helper.make_node
    model = _model([n("Shape", ["x"], ["s"]), n("Slice", ["s", "zero", "one"], ["s0"]),
                    n("Concat", ["s0", "minus_one"], ["target"], axis=0),
                    n("Reshape", ["x", "target"], ["y"])],
                   {"x": (TensorProto.FLOAT, ["batch", 3, 4])}, ["y"],
                   {"zero": _i64(0), "one": _i64(1), "minus_one": _i64(-1)})
    graph = eliminate_dead_code(import_model(model))
    # the target is a value known as dims (computed from the dims if the code reads it)
    assert [node.op_type for node in graph.nodes] == ["SymbolicValue", "Reshape"]
    assert graph.outputs[0].type.shape == (symbol("batch"), 12)
    assert graph.nodes[1].inputs[1].sym_value == (symbol("batch"), -1)
    compiled = cuvil.compile(model)
    for batch in (1, 5):
        _compare(compiled, model, {"x": np.random.rand(batch, 3, 4).astype(np.float32)})


def _shape_arithmetic_model() -> onnx.ModelProto:
    """Chains exporters write, each ending in an op that reads the computed values."""
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["shape"]),
        n("Gather", ["shape", "i0"], ["b"]),
        n("Gather", ["shape", "i1"], ["h"]),
        n("Gather", ["shape", "i2"], ["w"]),
        # h // 2 through int32 and back; Mul, Sub, Max
        n("Cast", ["h"], ["h32"], to=TensorProto.INT32),
        n("Div", ["h32", "two32"], ["half32"]),
        n("Cast", ["half32"], ["half"], to=TensorProto.INT64),
        n("Mul", ["half", "two"], ["even_h"]),
        n("Unsqueeze", ["even_h", "ax0"], ["even_h1"]),
        n("Slice", ["x", "zero1", "even_h1", "ax1"], ["x_even_rows"]),
        # Reshape to [b, w, -1] from gathered dims
        n("Unsqueeze", ["b", "ax0"], ["b1"]),
        n("Unsqueeze", ["w", "ax0"], ["w1"]),
        n("Concat", ["b1", "w1", "minus_one"], ["target"], axis=0),
        n("Reshape", ["x", "target"], ["x_bw"]),
        # TF-style "SAME" padding: pad = (3 - w % 3) % 3 at the end of the last axis
        n("Mod", ["w", "three"], ["w_mod"]),
        n("Sub", ["three", "w_mod"], ["pad_raw"]),
        n("Mod", ["pad_raw", "three"], ["pad_w"]),
        n("Unsqueeze", ["pad_w", "ax0"], ["pad_w1"]),
        n("Concat", ["zeros5", "pad_w1"], ["pads"], axis=0),
        n("Pad", ["x", "pads"], ["x_same"]),
        # expand(-1, 2, -1, -1) the way torch writes it: Where(Equal(shape, -1), 1, shape)
        n("Concat", ["b1", "two1", "h_1", "w1"], ["want"], axis=0),
        n("Equal", ["want", "minus_ones"], ["is_any"]),
        n("Where", ["is_any", "ones4", "want"], ["expand_to"]),
        n("Unsqueeze", ["x", "ax1"], ["x4"]),
        n("Expand", ["x4", "expand_to"], ["x_expanded"]),
        # positions, zeros of the input's shape, a tile by a computed count
        n("Range", ["zero", "w", "one"], ["positions"]),
        n("ConstantOfShape", ["shape"], ["zeros_like"],
          value=numpy_helper.from_array(np.array([1.5], np.float32))),
        n("Max", ["half", "one"], ["reps0"]),
        n("Unsqueeze", ["reps0", "ax0"], ["reps01"]),
        n("Concat", ["reps01", "one1", "one1"], ["reps"], axis=0),
        n("Tile", ["x", "reps"], ["x_tiled"]),
        # floor(h * 0.5) in float, as interpolate-style code computes sizes
        n("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        n("Mul", ["hf", "halff"], ["hf_half"]),
        n("Floor", ["hf_half"], ["hf_floor"]),
        n("Cast", ["hf_floor"], ["h_floor"], to=TensorProto.INT64),
        n("Unsqueeze", ["h_floor", "ax0"], ["h_floor1"]),
        n("Slice", ["x", "h_floor1", "big", "ax1"], ["x_bottom"]),
        # the computed shape itself as an output (materialized from the dims at run time)
        n("Size", ["x"], ["numel"]),
        n("Identity", ["target"], ["target_out"]),
    ]
    inits = {
        "i0": np.int64(0), "i1": np.int64(1), "i2": np.int64(2), "two32": np.int32(2),
        "two": np.int64(2), "three": np.int64(3), "zero": np.int64(0), "one": np.int64(1),
        "ax0": _i64(0), "ax1": _i64(1), "zero1": _i64(0), "one1": _i64(1), "two1": _i64(2),
        "h_1": _i64(-1), "minus_one": _i64(-1), "minus_ones": _i64(-1, -1, -1, -1),
        "ones4": _i64(1, 1, 1, 1), "zeros5": _i64(0, 0, 0, 0, 0), "halff": np.float32(0.5),
        "big": _i64(2**62),
    }
    outputs = ["x_even_rows", "x_bw", "x_same", "x_expanded", "positions", "zeros_like",
               "x_tiled", "x_bottom", "numel", "target_out"]
    return _model(nodes, {"x": (TensorProto.FLOAT, ["batch", "height", "width"])}, outputs,
                  inits)


def test_shape_arithmetic_chains_compile_once_and_run_at_every_size() -> None:
    model = _shape_arithmetic_model()
    graph = eliminate_dead_code(import_model(model))
    computed = {"Shape", "Gather", "Cast", "Div", "Mul", "Sub", "Mod", "Equal", "Where", "Max",
                "Floor", "Size"}
    assert not computed & {node.op_type for node in graph.nodes}
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(0)
    for shape in ((2, 5, 7), (1, 1, 1), (3, 8, 9), (2, 3, 2)):
        _compare(compiled, model, {"x": rng.standard_normal(shape).astype(np.float32)})


def test_tensorflow_style_int32_shape_chain() -> None:
    """tf2onnx computes shapes in int32: Cast, Slice, ReduceProd, Concat, Cast back, Range."""
    n = helper.make_node
    model = _model([
        n("Shape", ["x"], ["s64"]),
        n("Cast", ["s64"], ["s"], to=TensorProto.INT32),
        n("Slice", ["s", "one", "three"], ["hw"]),
        n("ReduceProd", ["hw"], ["hw_prod"], keepdims=1),
        n("Slice", ["s", "zero", "one"], ["b"]),
        n("Concat", ["b", "hw_prod", "c"], ["target32"], axis=0),
        n("Cast", ["target32"], ["target"], to=TensorProto.INT64),
        n("Reshape", ["x", "target"], ["flat"]),
        n("Squeeze", ["hw_prod", "zero"], ["count"]),
        n("Range", ["zero_s", "count", "one_s"], ["positions"]),
    ], {"x": (TensorProto.FLOAT, ["batch", "height", "width", 3])},
        [("flat", TensorProto.FLOAT, ["batch", "hw", 3]), ("positions", TensorProto.INT32, ["hw"])],
        {"zero": _i64(0), "one": _i64(1), "three": _i64(3), "c": np.array([3], np.int32),
         "zero_s": np.int32(0), "one_s": np.int32(1)}, opset=13)
    compiled = cuvil.compile(model)
    assert compiled.outputs[0].shape == ("batch", "height*width", 3)
    for shape in ((2, 3, 5, 3), (1, 1, 1, 3)):
        _compare(compiled, model, {"x": np.random.rand(*shape).astype(np.float32)})


# -- PyTorch exports -------------------------------------------------------------------------

EXPORTS = {
    "flatten_view": [{"x": (3, 4, 6)}, {"x": (1, 4, 6)}],
    "heads": [{"x": (2, 5, 16)}, {"x": (3, 7, 16)}, {"x": (1, 1, 16)}],
    "positions": [{"x": (2, 6, 8)}, {"x": (1, 9, 8)}, {"x": (4, 1, 8)}],
    "expand_pad": [{"x": (2, 1, 5, 7)}, {"x": (1, 1, 3, 4)}, {"x": (3, 1, 2, 9)}],
    "pairs_view": [{"x": (2, 6, 8)}, {"x": (3, 4, 8)}],
    "two_inputs": [{"image": (2, 3, 5, 7), "tokens": (2, 6, 8)},
                   {"image": (1, 3, 8, 3), "tokens": (1, 2, 8)},
                   {"image": (3, 3, 1, 1), "tokens": (3, 11, 8)}],
    "upsample_to": [{"x": (1, 2, 3, 4), "skip": (1, 2, 6, 8)},
                    {"x": (2, 2, 5, 3), "skip": (2, 2, 7, 9)}],
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_pytorch_export_matches_onnxruntime_at_several_sizes(name: str) -> None:
    path = DATA / f"{name}.onnx"
    model = onnx.load(str(path))
    compiled = cuvil.compile(path)
    assert all(isinstance(d, str) for t in compiled.inputs for d in t.shape
               if t.shape.index(d) == 0), "the batch dim stays symbolic"
    rng = np.random.default_rng(1)
    for sizes in EXPORTS[name]:
        feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in sizes.items()}
        _compare(compiled, model, feeds)


def test_all_symbolic_model_signature() -> None:
    """batch, height, width and seq all symbolic; batch shared by both inputs."""
    compiled = cuvil.compile(DATA / "two_inputs.onnx")
    assert [t.shape for t in compiled.inputs] == [("batch", 3, "height", "width"),
                                                  ("batch", "seq", 8)]
    assert compiled.outputs[0].shape == ("batch", "seq", 8)
    with pytest.raises(ValueError, match="batch"):
        compiled.run({"image": np.zeros((2, 3, 4, 4), np.float32),
                      "tokens": np.zeros((3, 5, 8), np.float32)})


# -- constraints checked at call time ----------------------------------------------------------

def test_reshape_that_does_not_divide_names_the_dim() -> None:
    compiled = cuvil.compile(DATA / "pairs_view.onnx")
    compiled(np.zeros((2, 4, 8), np.float32))
    with pytest.raises(ValueError, match=r"(?s)Reshape.*seq = 5 \(input 'x' dim 1\)"):
        compiled(np.zeros((2, 5, 8), np.float32))


def test_broadcast_of_two_symbolic_dims_names_both() -> None:
    model = _model([helper.make_node("Add", ["a", "b"], ["y"], name="add_them")],
                   {"a": (TensorProto.FLOAT, ["n", 4]), "b": (TensorProto.FLOAT, ["m", 4])},
                   ["y"])
    compiled = cuvil.compile(model)
    _compare(compiled, model, {"a": np.ones((3, 4), np.float32),
                               "b": np.full((3, 4), 2, np.float32)})
    with pytest.raises(ValueError, match=r"(?s)add_them.*n = 2 \(input 'a' dim 0\).*"
                                         r"m = 3 \(input 'b' dim 0\)"):
        compiled.run({"a": np.ones((2, 4), np.float32), "b": np.ones((3, 4), np.float32)})


# -- pins ------------------------------------------------------------------------------------

def test_pinned_dims_make_shapes_static() -> None:
    model = onnx.load(str(DATA / "heads.onnx"))
    compiled = cuvil.compile(model, inputs={"x": [2, 7, 16]})
    assert compiled.inputs[0].shape == (2, 7, 16)
    assert compiled.outputs[0].shape == (2, 7, 16)
    _compare(compiled, model, {"x": np.random.rand(2, 7, 16).astype(np.float32)})
    graph = eliminate_dead_code(import_model(model, {"x": [2, 7, 16]}))
    assert not any(node.op_type == "SymbolicValue" for node in graph.nodes)


def test_named_pins_share_a_symbol_across_inputs() -> None:
    model = _model([helper.make_node("Add", ["a", "b"], ["y"])],
                   {"a": (TensorProto.FLOAT, ["p", 4]), "b": (TensorProto.FLOAT, ["q", 4])},
                   ["y"])
    compiled = cuvil.compile(model, inputs={"a": ["rows", 4], "b": ["rows", 4]})
    assert compiled.inputs[0].shape == compiled.inputs[1].shape == ("rows", 4)
    assert compiled.outputs[0].shape == ("rows", 4)
    _compare(compiled, model, {"a": np.ones((5, 4), np.float32), "b": np.ones((5, 4), np.float32)})
    with pytest.raises(ValueError, match="rows"):
        compiled.run({"a": np.ones((2, 4), np.float32), "b": np.ones((3, 4), np.float32)})


# -- what cannot be resolved -------------------------------------------------------------------

def test_shape_from_tensor_data_is_an_error_naming_the_node_and_pins() -> None:
    n = helper.make_node
    model = _model([n("ReduceMax", ["sizes"], ["m"], keepdims=1),
                    n("Concat", ["m", "minus_one"], ["target"], axis=0),
                    n("Reshape", ["x", "target"], ["y"], name="data_reshape")],
                   {"x": (TensorProto.FLOAT, [4, 6]), "sizes": (TensorProto.INT64, [3])},
                   ["y"], {"minus_one": _i64(-1)})
    with pytest.raises(UnsupportedOpError,
                       match=r"(?s)'data_reshape' \(Reshape\).*target.*\[tool\.cuvil\.models"):
        cuvil.compile(model)


def test_slice_start_of_unknown_sign_is_an_error() -> None:
    """h - 4 may be negative or not: Slice cannot tell whether it counts from the end."""
    n = helper.make_node
    model = _model([n("Shape", ["x"], ["s"]), n("Gather", ["s", "i0"], ["h"]),
                    n("Sub", ["h", "four"], ["start"]), n("Unsqueeze", ["start", "ax"], ["st"]),
                    n("Slice", ["x", "st", "big", "ax"], ["y"], name="tail")],
                   {"x": (TensorProto.FLOAT, ["h", 3])}, ["y"],
                   {"i0": np.int64(0), "four": np.int64(4), "ax": _i64(0), "big": _i64(100)})
    with pytest.raises(UnsupportedOpError, match=r"(?s)'tail'.*sign.*inputs"):
        cuvil.compile(model)
    compiled = cuvil.compile(model, inputs={"x": [6, 3]})
    _compare(compiled, model, {"x": np.random.rand(6, 3).astype(np.float32)})
