"""Reductions against onnxruntime: every Reduce op over random ranks, axes (negative ones
too), keepdims on and off, symbolic dims, each dtype onnxruntime supports, axes as attribute
(old opsets) and as input (new ones), empty axes and noop_with_empty_axes.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
       "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
INT_OPS = tuple(op for op in OPS if op not in ("ReduceLogSum", "ReduceLogSumExp"))
#: symbolic dims and the sizes each test runs them at (odd sizes, 1, and past the tile of 256)
SIZES = ({"n": 3, "m": 5}, {"n": 1, "m": 300}, {"n": 7, "m": 2})


def axes_input_since(op: str) -> int:
    return 13 if op == "ReduceSum" else 18


def data_for(op: str):
    """Inputs that keep each reduction well-conditioned (log of a positive sum, products
    near 1, no integer overflow)."""

    def make(rng: np.random.Generator, dtype, shape):
        dtype = np.dtype(dtype)
        if dtype == np.bool_:
            return rng.integers(0, 2, size=shape).astype(bool)
        if dtype.kind in "iu":
            lo, hi = {"ReduceProd": (-2, 3), "ReduceLogSum": (1, 5),
                      "ReduceLogSumExp": (-3, 4)}.get(op, (-9, 10))
            if dtype.kind == "u":
                lo = max(lo, 0)
            return rng.integers(lo, hi, size=shape).astype(dtype)
        if op == "ReduceLogSum":
            return rng.uniform(0.1, 2.0, size=shape).astype(dtype)
        if op == "ReduceProd":
            return (rng.uniform(0.7, 1.4, size=shape) * rng.choice([-1, 1], size=shape)).astype(dtype)
        if op == "ReduceLogSumExp":
            return (rng.standard_normal(shape) * 4).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)

    return make


def random_shape(rng: np.random.Generator, rank: int) -> list[int | str]:
    choices: list[int | str] = [1, 2, 3, 4, 5, 7, 9, "n", "m"]
    return [choices[i] for i in rng.integers(0, len(choices), size=rank)]


def reduce_case(op: str, dtype, shape, axes, keepdims: int, opset: int, *, noop: int | None = None,
                axes_as_empty_input: bool = False) -> Case:
    """A node reducing `axes` (None: no axes at all) the way `opset` spells it."""
    attrs: dict = {"keepdims": keepdims}
    inputs: list[str | None] = ["x"]
    consts = {}
    if opset >= axes_input_since(op):
        if axes is not None or axes_as_empty_input:
            inputs.append("axes")
            consts["axes"] = np.array(axes if axes is not None else [], dtype=np.int64)
        if noop is not None:
            attrs["noop_with_empty_axes"] = noop
    elif axes is not None:
        attrs["axes"] = list(axes)
    return Case(op, inputs, attrs, feeds={"x": (dtype, shape)}, consts=consts, data=data_for(op),
                label=f"{op} {np.dtype(dtype).name} axes={axes}")


def random_cases(seed: int, opset: int, dtype, ops=OPS, count: int = 30) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        op = ops[i % len(ops)]
        rank = int(rng.integers(1, 5))
        shape = random_shape(rng, rank)
        n_axes = int(rng.integers(0, rank + 1))
        picked = sorted(rng.choice(rank, size=n_axes, replace=False).tolist())
        # spell some axes negatively
        axes = [a - rank if rng.random() < 0.4 else a for a in picked] if picked else None
        cases.append(reduce_case(op, dtype, shape, axes, int(rng.integers(0, 2)), opset))
    return cases


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_float32_random_axes_and_shapes(opset):
    check_cases(random_cases(opset, opset, np.float32), sizes=SIZES, opset=opset,
                rtol=2e-5, atol=2e-5)


def test_every_layout_of_a_4d_input():
    """All 16 axis subsets of a rank-4 input: inner, outer, middle and interleaved
    reductions, each hitting the tiled (innermost kept) or the row path."""
    cases = []
    for mask in range(16):
        axes = [a for a in range(4) if mask >> a & 1] or None
        cases.append(reduce_case("ReduceSum", np.float32, ["n", 3, 5, "m"], axes, mask % 2, 18))
    # the two-pass log-sum-exp on each path: rows, tiles, interleaved, everything
    for axes in ([3], [0], [1, 3], [0, 2], [0, 1, 2, 3]):
        cases.append(reduce_case("ReduceLogSumExp", np.float32, ["n", 3, 5, "m"], axes, 0, 18))
    check_cases(cases, sizes=SIZES, opset=18, rtol=2e-5, atol=2e-5)


def test_float64():
    check_cases(random_cases(64, 18, np.float64, count=20), sizes=SIZES[:2], opset=18,
                rtol=1e-10, atol=1e-10)


def test_float16_accumulates_in_float32():
    cases = random_cases(16, 18, np.float16, count=20)
    # a long sum that float16 accumulation would get badly wrong
    cases.append(reduce_case("ReduceSum", np.float16, [4, 3000], [1], 0, 18))
    cases.append(reduce_case("ReduceMean", np.float16, [3000, "n"], [0], 1, 18))
    check_cases(cases, sizes=SIZES[:2], opset=18, rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integers(dtype):
    check_cases(random_cases(int(np.dtype(dtype).itemsize), 18, dtype, INT_OPS, count=20),
                sizes=SIZES[:2], opset=18)


def test_small_integers_and_bool_for_max_and_min():
    cases = []
    for dtype in (np.int8, np.uint8, np.bool_):
        for op in ("ReduceMax", "ReduceMin"):
            cases.append(reduce_case(op, dtype, ["n", 5, "m"], [1], 0, 20))
            cases.append(reduce_case(op, dtype, [3, "m"], [0], 1, 20))
            cases.append(reduce_case(op, dtype, [3, "m"], None, 0, 20))
    check_cases(cases, sizes=SIZES, opset=20)


def test_empty_axes_reduce_everything_or_nothing():
    cases = []
    for op in OPS:
        cases.append(reduce_case(op, np.float32, ["n", 3, 4], None, 1, 18))
        cases.append(reduce_case(op, np.float32, ["n", 3, 4], None, 0, 18))
        cases.append(reduce_case(op, np.float32, [2, "n", 3], None, 1, 18, noop=1))
        cases.append(reduce_case(op, np.float32, [5], None, 0, 11))
    check_cases(cases, sizes=SIZES, opset=18, rtol=2e-5, atol=2e-5)


def test_empty_axes_input_tensor():
    cases = [reduce_case(op, np.float32, [3, "n"], None, 1, 18, noop=noop, axes_as_empty_input=True)
             for op in ("ReduceSum", "ReduceL2") for noop in (0, 1)]
    check_cases(cases, sizes=SIZES, opset=18)


def test_reductions_over_empty_sets():
    """A reduced axis of size 0 gives each reduction's identity (onnxruntime's values)."""
    cases = [reduce_case(op, np.float32, [2, 0, 4], [1], 1, 18) for op in OPS]
    cases.append(reduce_case("ReduceSum", np.float32, [0, 3], [1], 0, 18))
    check_cases(cases, opset=18)


def test_one_compiled_model_serves_many_sizes():
    model = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "t", 8])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 8])],
        [onnx.numpy_helper.from_array(np.array([-2], np.int64), "axes")]),
        opset_imports=[helper.make_opsetid("", 18)])
    m = cuvil.compile(model)
    rng = np.random.default_rng(0)
    for b, t in ((1, 1), (2, 513), (3, 7)):
        x = rng.standard_normal((b, t, 8)).astype(np.float32)
        np.testing.assert_allclose(m(x), x.sum(axis=1), rtol=1e-5, atol=1e-5)
    assert list(m.outputs[0].shape) == ["b", 8]


# -- onnx's backend node tests ---------------------------------------------------------------


def with_axes_bound(test):
    """A backend test whose axes graph input becomes an initializer (cuvil needs axes at compile
    time), with the data sets' axes dropped from the feeds."""
    model = onnx.ModelProto()
    model.CopyFrom(test.model)
    node = model.graph.node[0]
    init_names = {t.name for t in model.graph.initializer}
    inputs = [vi.name for vi in model.graph.input if vi.name not in init_names]
    if len(node.input) < 2 or node.input[1] not in inputs:
        return test
    pos = inputs.index(node.input[1])
    first_inputs = test.data_sets[0][0]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(first_inputs[pos]),
                                                                node.input[1]))
    kept = [vi for vi in model.graph.input if vi.name != node.input[1]]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    data = [([a for i, a in enumerate(ins) if i != pos], outs) for ins, outs in test.data_sets]
    return SimpleNamespace(name=test.name, model=model, data_sets=data, rtol=test.rtol, atol=test.atol)


def test_onnx_backend_node_cases():
    modules = {"ReduceLogSum": "reduce_log_sum", "ReduceLogSumExp": "reduce_log_sum_exp"}
    tests = [with_axes_bound(t) for op in OPS
             for t in backend_cases(modules.get(op, op.lower()), [op])]
    assert len(tests) >= 90
    check_backend_cases(tests)


# -- errors ---------------------------------------------------------------------------------


def _model(op, axes_attr=None, axes_input=None, dtype=onnx.TensorProto.FLOAT, opset=18,
           runtime_axes=False):
    inputs = [helper.make_tensor_value_info("x", dtype, [2, 3, 4])]
    inits = []
    names = ["x"]
    if axes_input is not None:
        names.append("axes")
        inits.append(onnx.numpy_helper.from_array(np.array(axes_input, np.int64), "axes"))
    if runtime_axes:
        names.append("axes")
        inputs.append(helper.make_tensor_value_info("axes", onnx.TensorProto.INT64, [1]))
    attrs = {} if axes_attr is None else {"axes": axes_attr}
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g", inputs,
                              [helper.make_tensor_value_info("y", dtype, ["d0", "d1"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_axis_out_of_range_names_the_node():
    with pytest.raises(ModelError, match=r"ReduceMax.*axis 3 is out of range"):
        cuvil.compile(_model("ReduceMax", axes_input=[3]))


def test_repeated_axis_is_an_error():
    with pytest.raises(ModelError, match=r"ReduceL1.*name an axis twice"):
        cuvil.compile(_model("ReduceL1", axes_attr=[1, -2], opset=13))


def test_axes_computed_at_run_time_are_unsupported():
    with pytest.raises(UnsupportedOpError, match=r"ReduceMean.*axes.*compile time"):
        cuvil.compile(_model("ReduceMean", runtime_axes=True))


def test_unsupported_dtype_is_reported():
    with pytest.raises(UnsupportedOpError, match=r"ReduceSum.*int8"):
        cuvil.compile(_model("ReduceSum", axes_input=[1], dtype=onnx.TensorProto.INT8))
    # onnx gives integer log-sum-exp no meaning (the types leave the schema in opset 28)
    with pytest.raises(UnsupportedOpError, match=r"ReduceLogSumExp.*int32"):
        cuvil.compile(_model("ReduceLogSumExp", axes_input=[1], dtype=onnx.TensorProto.INT32))
