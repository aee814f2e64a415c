"""Indexing ops against onnxruntime: Gather, GatherElements, GatherND, Scatter(Elements),
ScatterND, OneHot, TopK, ArgMax/ArgMin, CumSum, CumProd, ReverseSequence, Trilu; run-time
index errors; NonZero's backend test (the rest of it: tests/ops/test_selection.py).

Many single-node cases share one model (one compile): each case has its own inputs and
outputs, and onnxruntime runs the same model as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

RNG = np.random.default_rng(20261130)


@dataclass
class Const:
    """An input stored in the model (initializer) rather than fed at run time."""

    value: np.ndarray


@dataclass
class Case:
    op: str
    #: one entry per input: an array (fed), Const (initializer) or None (absent)
    ins: list[Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    outs: int = 1
    #: input position -> declared shape (str entries are symbolic dims)
    shapes: dict[int, list[Any]] = field(default_factory=dict)
    #: applied to each output (cuvil's and onnxruntime's) before comparing
    normalize: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None

    def __str__(self) -> str:
        shapes = [None if a is None else list(np.shape(getattr(a, "value", a))) for a in self.ins]
        return f"{self.op} {self.attrs} inputs {shapes}"


def build(cases: list[Case], opset: int = 17) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    nodes, inputs, inits, outputs, feeds = [], [], [], [], {}
    for c_i, c in enumerate(cases):
        names = []
        for j, a in enumerate(c.ins):
            name = f"c{c_i}_in{j}"
            if a is None:
                names.append("")
            elif isinstance(a, Const):
                inits.append(numpy_helper.from_array(np.asarray(a.value), name))
                names.append(name)
            else:
                a = np.asarray(a)
                shape = c.shapes.get(j, list(a.shape))
                inputs.append(helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(a.dtype), shape))
                feeds[name] = a
                names.append(name)
        outs = [f"c{c_i}_out{j}" for j in range(c.outs)]
        nodes.append(helper.make_node(c.op, names, outs, name=f"case{c_i}", **c.attrs))
        outputs += [helper.make_empty_tensor_value_info(o) for o in outs]
    graph = helper.make_graph(nodes, "cases", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    for out in model.graph.output:
        if out.type.tensor_type.elem_type and not out.type.tensor_type.HasField("shape"):
            out.type.tensor_type.shape.SetInParent()  # a scalar
    onnx.checker.check_model(model)
    return model, feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def compare(cases: list[Case], model: onnx.ModelProto, feeds: dict[str, np.ndarray],
            compiled: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for c_i, c in enumerate(cases):
        names = [f"c{c_i}_out{j}" for j in range(c.outs)]
        w, g = [want[n] for n in names], [got[n] for n in names]
        if c.normalize is not None:
            w, g = c.normalize(w), c.normalize(g)
        for n, a, b in zip(names, g, w):
            assert a.shape == b.shape, f"case {c_i} ({c}) {n}: shape {a.shape} != {b.shape}"
            assert a.dtype == b.dtype, f"case {c_i} ({c}) {n}: dtype {a.dtype} != {b.dtype}"
            if b.dtype.kind == "f":
                np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"case {c_i}: {c}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"case {c_i}: {c}")


def check(cases: list[Case], opset: int = 17, **tol: float) -> Any:
    model, feeds = build(cases, opset)
    compiled = cuvil.compile(model)
    compare(cases, model, feeds, compiled, **tol)
    return compiled


def rand(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return RNG.random(shape) < 0.5
    if dtype.kind in "iu":
        return RNG.integers(0 if dtype.kind == "u" else -50, 50, shape).astype(dtype)
    return RNG.standard_normal(shape).astype(dtype)


def indices(n: int, shape: tuple[int, ...], dtype: Any = np.int64) -> np.ndarray:
    """Valid indices into an axis of length n, negative ones included."""
    return RNG.integers(-n, n, shape).astype(dtype)


def distinct_indices(n: int, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Indices that never repeat along `axis` (scatter without reduction is then defined)."""
    out = np.empty(shape, dtype=np.int64)
    moved = np.moveaxis(out, axis, -1)
    for pos in np.ndindex(moved.shape[:-1]):
        moved[pos] = RNG.permutation(n)[: moved.shape[-1]] - RNG.integers(0, 2) * n
    return out


# -- gathers ---------------------------------------------------------------------------------


def test_gather_axes_dtypes_and_index_kinds() -> None:
    cases = []
    for i, axis in enumerate((0, 1, 2, -1, -3)):
        for j, ishape in enumerate(((), (4,), (2, 3))):
            data = rand((5, 4, 3))
            idt = (np.int64, np.int32)[(i + j) % 2]
            cases.append(Case("Gather", [data, indices(data.shape[axis], ishape, idt)],
                              {"axis": axis}))
    for dtype in (np.int64, np.int8, np.float64, np.float16, np.bool_, np.uint8):
        cases.append(Case("Gather", [rand((6, 5), dtype), indices(5, (7,))], {"axis": 1}))
    # constant indices (an embedding lookup) and a large row
    cases.append(Case("Gather", [rand((9, 33)), Const(np.array([[0, 8], [-1, 3]]))]))
    cases.append(Case("Gather", [Const(rand((11, 4))), indices(11, (3, 2))]))
    check(cases)


def test_gather_elements() -> None:
    cases = []
    for axis in (0, 1, -1):
        data = rand((4, 5, 3))
        ishape = [3, 4, 2]
        ishape[axis] = 6  # the indexed axis may be longer than the data's
        cases.append(Case("GatherElements", [data, indices(data.shape[axis], tuple(ishape))],
                          {"axis": axis}))
    cases.append(Case("GatherElements", [rand((7,), np.int64), indices(7, (7,), np.int32)]))
    check(cases)


def test_gather_nd_batch_dims() -> None:
    cases = []
    for b, data_shape, ishape in [
        (0, (4, 5), (3, 2)), (0, (4, 5, 3), (2, 1)), (0, (4, 5, 3), (2, 2, 3)),
        (1, (2, 5, 3), (2, 4, 1)), (1, (2, 5, 3), (2, 2)), (2, (2, 3, 4, 5), (2, 3, 1, 2)),
        (0, (6,), (1,)),
    ]:
        data = rand(data_shape)
        m = ishape[-1]
        idx = np.stack([indices(data_shape[b + t], ishape[:-1]) for t in range(m)], axis=-1)
        cases.append(Case("GatherND", [data, idx], {"batch_dims": b}))
    cases.append(Case("GatherND", [rand((3, 4), np.int32), np.array([[1, -1], [0, 2]])]))
    check(cases, opset=13)


# -- scatters --------------------------------------------------------------------------------


def test_scatter_elements_reductions() -> None:
    cases = []
    for axis in (0, 1, -1):
        data = rand((5, 6, 4))
        ishape = [3, 4, 2]
        ishape[axis] = 3
        n = data.shape[axis]
        for reduction in ("none", "add", "mul", "max", "min"):
            idx = (distinct_indices(n, tuple(ishape), axis) if reduction == "none"
                   else indices(n, tuple(ishape)))  # repeated positions accumulate
            cases.append(Case("ScatterElements", [data, idx, rand(tuple(ishape))],
                              {"axis": axis, "reduction": reduction}))
    cases.append(Case("ScatterElements", [rand((6,), np.int64), distinct_indices(6, (4,), 0)
                                          .astype(np.int32), rand((4,), np.int64)]))
    cases.append(Case("ScatterElements", [rand((3, 4), np.int32), indices(4, (3, 5)),
                                          rand((3, 5), np.int32)], {"axis": 1, "reduction": "add"}))
    check(cases, opset=18)


def test_scatter_opset_10() -> None:
    data = rand((4, 5))
    check([Case("Scatter", [data, distinct_indices(5, (4, 3), 1), rand((4, 3))], {"axis": 1}),
           Case("Scatter", [data, distinct_indices(4, (2, 5), 0), rand((2, 5))])], opset=10)


def test_scatter_nd_reductions() -> None:
    cases = []
    for data_shape, m, count in [((6, 5), 1, 3), ((6, 5), 2, 4), ((4, 3, 5), 2, (2, 2)),
                                 ((7,), 1, 5)]:
        count = count if isinstance(count, tuple) else (count,)
        for reduction in ("none", "add", "mul", "max", "min"):
            n = int(np.prod(count))
            if reduction == "none":  # distinct index tuples
                flat = RNG.permutation(int(np.prod(data_shape[:m])))[:n]
                idx = np.stack(np.unravel_index(flat, data_shape[:m]), axis=-1).reshape(*count, m)
                idx = idx - (RNG.random(idx.shape) < 0.3) * np.array(data_shape[:m])
            else:
                idx = np.stack([indices(data_shape[t], count) for t in range(m)], axis=-1)
            upd = rand((*count, *data_shape[m:]))
            cases.append(Case("ScatterND", [rand(data_shape), idx.astype(np.int64), upd],
                              {"reduction": reduction}))
    check(cases, opset=18)


# -- one-hot, top-k, arg-extremes --------------------------------------------------------------


def test_one_hot() -> None:
    cases = []
    for axis in (-1, 0, 1, -2):
        # (indices, values, depth) dtypes onnxruntime implements
        for idt, vdt, ddt in ((np.int64, np.float32, np.int64), (np.float32, np.int64, np.int64),
                              (np.int32, np.float32, np.int32), (np.int64, np.int32, np.float32),
                              (np.float32, np.float32, np.float32)):
            idx = RNG.integers(-8, 8, (3, 4)).astype(idt)  # some outside [-depth, depth)
            if np.dtype(idt).kind == "f":
                idx = idx + RNG.choice([0.0, 0.25, -0.5], idx.shape).astype(idt)
            cases.append(Case("OneHot", [idx, Const(np.array(5, ddt)),
                                         np.array([2, 7], dtype=vdt)], {"axis": axis}))
    cases.append(Case("OneHot", [np.array([0, 2, -1], np.int64), Const(np.array([3.0], np.float32)),
                                 Const(np.array([0.0, 1.0], np.float32))]))
    check(cases, opset=11)


def _sorted_by_index(axis: int) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """TopK with sorted=0 may return the k elements in any order: compare them by index."""

    def normalize(outs: list[np.ndarray]) -> list[np.ndarray]:
        values, idx = outs
        order = np.argsort(idx, axis=axis, kind="stable")
        return [np.take_along_axis(values, order, axis), np.take_along_axis(idx, order, axis)]

    return normalize


def test_top_k() -> None:
    cases = []
    for axis in (-1, 0, 1):
        for largest in (1, 0):
            x = RNG.integers(0, 6, (7, 9, 5)).astype(np.float32)  # many ties
            n = x.shape[axis]
            for kk in (1, 3, n):
                cases.append(Case("TopK", [x, Const(np.array([kk]))],
                                  {"axis": axis, "largest": largest}, outs=2))
    x = rand((4, 30))
    cases.append(Case("TopK", [x, Const(np.array([6]))], {"sorted": 0}, outs=2,
                      normalize=_sorted_by_index(-1)))
    for dtype in (np.int32, np.int64, np.float64, np.uint8):
        cases.append(Case("TopK", [RNG.integers(0, 9, (3, 40)).astype(dtype), Const(np.array([7]))],
                          {"largest": 0}, outs=2))
    # NaN sorts above every number, as in onnxruntime
    x = RNG.integers(0, 5, (3, 12)).astype(np.float32)
    x[RNG.random(x.shape) < 0.3] = np.nan
    for largest in (0, 1):
        cases.append(Case("TopK", [x, Const(np.array([9]))], {"largest": largest}, outs=2))
    # a long row: the heap path that replaces the root most
    cases.append(Case("TopK", [np.arange(500, dtype=np.float32)[None], Const(np.array([50]))],
                      outs=2))
    check(cases, opset=11)


def test_top_k_opset_1_attribute() -> None:
    check([Case("TopK", [rand((3, 8))], {"k": 3}, outs=2)], opset=9)


def test_arg_max_min() -> None:
    cases = []
    for op in ("ArgMax", "ArgMin"):
        for axis in (0, 1, -1):
            for keepdims in (0, 1):
                for last in (0, 1):
                    x = RNG.integers(0, 4, (5, 6, 7)).astype(np.float32)  # ties
                    cases.append(Case(op, [x], {"axis": axis, "keepdims": keepdims,
                                                "select_last_index": last}))
        for dtype in (np.int32, np.float64, np.int8, np.uint8):
            cases.append(Case(op, [rand((4, 9), dtype)], {"axis": 1}))
        x = rand((5, 6))
        x[RNG.random(x.shape) < 0.3] = np.nan  # NaN is skipped unless it comes first
        x[0, 0] = np.nan
        cases.append(Case(op, [x], {"axis": 1}))
    check(cases, opset=13)


# -- scans and masks -------------------------------------------------------------------------


def test_cum_sum() -> None:
    cases = []
    for axis in (1, -3):
        for exclusive in (0, 1):
            for reverse in (0, 1):
                cases.append(Case("CumSum", [rand((4, 5, 6)), Const(np.array(axis, np.int64))],
                                  {"exclusive": exclusive, "reverse": reverse}))
    for dtype in (np.int32, np.int64, np.float64):
        cases.append(Case("CumSum", [rand((3, 7), dtype), Const(np.array([1], np.int32))],
                          {"reverse": 1}))
    check(cases, opset=14)


def test_cum_prod() -> None:
    import batch_oracle as bo

    def small_ints(rng: np.random.Generator, dtype: Any, shape: Any) -> np.ndarray:
        return rng.integers(-3, 4, shape).astype(dtype)  # products stay well inside int32

    def near_one(rng: np.random.Generator, dtype: Any, shape: Any) -> np.ndarray:
        return (rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)).astype(dtype)

    cases = []
    for axis in (0, 1, -1, -3):
        for exclusive in (0, 1):
            for reverse in (0, 1):
                cases.append(bo.Case("CumProd", ["x", "axis"],
                                     {"exclusive": exclusive, "reverse": reverse},
                                     feeds={"x": ("float32", ["n", 5, "_m"])},
                                     consts={"axis": np.array(axis, np.int64)}, data=near_one))
    for dtype in ("int32", "int64", "float64"):
        cases.append(bo.Case("CumProd", ["x", "axis"], {"exclusive": 1},
                             feeds={"x": (dtype, [3, "_m"])},
                             consts={"axis": np.array([1], np.int32)}, data=small_ints))
    bo.check_cases(cases, sizes=[{"n": 1, "_m": 7}, {"n": 4, "_m": 1}, {"n": 2, "_m": 3}],
                   opset=26)
    tests = [baked(t, {"CumProd": [1]}) for t in bo.backend_cases("cumprod", ["CumProd"])]
    assert len(tests) == 9
    bo.check_backend_cases(tests)


def test_cum_prod_rejects_a_bad_axis() -> None:
    import batch_oracle as bo

    model = bo.build([bo.Case("CumProd", ["x", "axis"], {}, feeds={"x": ("float32", [3, 4])},
                              consts={"axis": np.array([0, 1], np.int64)})], opset=26)
    with pytest.raises(ModelError, match=r"case0.*CumProd.*axis must be one integer"):
        cuvil.compile(model)
    model = bo.build([bo.Case("CumProd", ["x", "axis"], {}, feeds={"x": ("float32", [3, 4])},
                              consts={"axis": np.array(2, np.int64)})], opset=26)
    with pytest.raises(ModelError, match=r"case0.*CumProd.*axis 2 is out of range"):
        cuvil.compile(model)


def _lengths_up_to(steps: int) -> Callable[..., np.ndarray]:
    def make(rng: np.random.Generator, dtype: Any, shape: Any) -> np.ndarray:
        if np.dtype(dtype) == np.int64 and len(shape) == 1:  # sequence_lens, ends included
            return rng.choice([0, 1, steps, *range(steps + 1)], shape).astype(dtype)
        return (rng.integers(-50, 50, shape) if np.dtype(dtype).kind in "iu"
                else rng.standard_normal(shape)).astype(dtype)
    return make


def test_reverse_sequence() -> None:
    import batch_oracle as bo

    cases = []
    for time_axis, dtype, rest in ((0, "float32", []), (1, "float32", ["_m"]),
                                   (0, "int64", [2, "_m"]), (1, "float64", [3]),
                                   (0, "uint8", ["_m"])):
        batch_axis = 1 - time_axis
        shape: list[Any] = [0, 0, *rest]
        shape[time_axis], shape[batch_axis] = 6, "n"
        cases.append(bo.Case("ReverseSequence", ["x", "lens"],
                             {"time_axis": time_axis, "batch_axis": batch_axis},
                             feeds={"x": (dtype, shape), "lens": ("int64", ["n"])},
                             data=_lengths_up_to(6)))
    bo.check_cases(cases, sizes=[{"n": 5, "_m": 3}, {"n": 1, "_m": 1}, {"n": 9, "_m": 4}],
                   opset=10)
    tests = [t for t in bo.backend_cases("reversesequence", ["ReverseSequence"])
             if "bfloat16" not in t.name]
    assert len(tests) == 2
    bo.check_backend_cases(tests)


def test_reverse_sequence_errors() -> None:
    import batch_oracle as bo

    model = bo.build([bo.Case("ReverseSequence", ["x", "lens"], {"time_axis": 1},
                              feeds={"x": ("float32", [3, 4]), "lens": ("int64", [4])})], opset=10)
    with pytest.raises(ModelError, match=r"case0.*time_axis \(1\) and batch_axis \(1\)"):
        cuvil.compile(model)
    model = bo.build([bo.Case("ReverseSequence", ["x", "lens"], {},
                              feeds={"x": ("float32", [3, 4]), "lens": ("int64", [4])})], opset=10)
    compiled = cuvil.compile(model, name="rev")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for bad in ([0, 1, 4, 2], [0, -1, 1, 1]):
        with pytest.raises(ValueError, match=r"model rev: node 'case0' \(ReverseSequence\)"):
            compiled.run({"c0_x": x, "c0_lens": np.array(bad, np.int64)})
    good = {"c0_x": x, "c0_lens": np.array([3, 0, 1, 2], np.int64)}
    np.testing.assert_array_equal(compiled.run(good)["c0_y"], run_ort(model, good)["c0_y"])


def test_trilu() -> None:
    cases = []
    for upper in (0, 1):
        for kk in (None, 0, 2, -1, -7, 9):
            ins = [rand((2, 5, 7)), None if kk is None else Const(np.array(kk, np.int64))]
            cases.append(Case("Trilu", ins if kk is not None else ins[:1], {"upper": upper}))
        cases.append(Case("Trilu", [rand((6, 4), np.int32), np.array(1, np.int64)],
                          {"upper": upper}))  # k fed at run time
    cases.append(Case("Trilu", [rand((3, 3), np.bool_)]))
    check(cases, opset=14)


# -- symbolic dims ---------------------------------------------------------------------------


def test_symbolic_dims_one_compile_several_sizes() -> None:
    def cases_for(batch: int, n: int) -> list[Case]:
        return [
            Case("Gather", [rand((batch, 7)), indices(7, (n,))], {"axis": 1},
                 shapes={0: ["batch", 7], 1: ["n"]}),
            Case("Gather", [rand((batch, 3)), indices(batch, (2,))], shapes={0: ["batch", 3]}),
            Case("TopK", [rand((batch, 12)), Const(np.array([4]))], outs=2,
                 shapes={0: ["batch", 12]}),
            Case("CumSum", [rand((batch, 5)), Const(np.array(0))], {"reverse": 1},
                 shapes={0: ["batch", 5]}),
            Case("ArgMax", [rand((3, batch))], {"axis": 1}, shapes={0: [3, "batch"]}),
            Case("Trilu", [rand((batch, n))], shapes={0: ["batch", "n"]}),
        ]

    model, feeds = build(cases_for(3, 4), opset=14)
    compiled = cuvil.compile(model)
    compare(cases_for(3, 4), model, feeds, compiled)
    for batch, n in ((1, 1), (6, 9)):
        cases = cases_for(batch, n)
        _, feeds = build(cases, opset=14)
        compare(cases, model, feeds, compiled)


# -- errors ----------------------------------------------------------------------------------


def test_out_of_range_indices_raise_a_clear_error() -> None:
    cases = [
        Case("Gather", [rand((4, 5)), np.array([0, 1], np.int64)], {"axis": 1}),
        Case("GatherElements", [rand((4, 5)), np.zeros((2, 5), np.int64)]),
        Case("GatherND", [rand((4, 5)), np.zeros((3, 2), np.int64)]),
        Case("ScatterElements", [rand((4, 5)), np.zeros((1, 5), np.int64), rand((1, 5))]),
        Case("ScatterND", [rand((4, 5)), np.zeros((2, 1), np.int64), rand((2, 5))]),
    ]
    model, feeds = build(cases, opset=13)
    compiled = cuvil.compile(model, name="lookup")
    compare(cases, model, feeds, compiled)
    for c_i, bad in enumerate([np.array([0, 5]), np.full((2, 5), -5), np.array([[0, 0], [4, 0],
                               [0, 0]]), np.full((1, 5), 9), np.array([[1], [-5]])]):
        broken = dict(feeds)
        broken[f"c{c_i}_in1"] = bad.astype(np.int64)
        with pytest.raises(ValueError, match=rf"model lookup: node 'case{c_i}' \("
                                             rf"{cases[c_i].op}\): index out of range"):
            compiled.run(broken)
    compare(cases, model, feeds, compiled)  # still usable afterwards


def test_constant_out_of_range_indices_fail_at_compile_time() -> None:
    model, _ = build([Case("Gather", [rand((4, 5)), Const(np.array([1, 5]))], {"axis": 1})])
    with pytest.raises(ModelError, match=r"case0.*holds 5, outside \[-5, 4\]"):
        cuvil.compile(model)


def test_run_time_k_is_rejected_with_a_reason() -> None:
    model, _ = build([Case("TopK", [rand((3, 8)), np.array([2])], outs=2)], opset=11)
    with pytest.raises(UnsupportedOpError, match=r"case0.*K.*must be known at compile time"):
        cuvil.compile(model)


# -- onnx's backend node tests ---------------------------------------------------------------


def baked(test: Any, positions: dict[str, list[int]]) -> Any:
    """A backend test whose inputs at `positions` (by op type: the inputs cuvil needs at
    compile time, such as TopK's K) are stored in the model instead of fed; the backend tests
    feed them, with the same value in every data set."""
    from types import SimpleNamespace

    model = onnx.ModelProto()
    model.CopyFrom(test.model)
    g = model.graph
    node = g.node[0]
    bake = {node.input[i] for i in positions.get(node.op_type, []) if i < len(node.input)} - {""}
    init_names = {x.name for x in g.initializer}
    fed = [vi.name for vi in g.input if vi.name not in init_names]
    as_array = [[numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else np.asarray(a)
                 for a in inputs] for inputs, _ in test.data_sets]
    keep = [i for i, n in enumerate(fed) if n not in bake]
    for i, n in enumerate(fed):
        if n in bake:
            assert all(np.array_equal(a[i], as_array[0][i]) for a in as_array), n
            g.initializer.append(numpy_helper.from_array(as_array[0][i], n))
    inputs = [vi for vi in g.input if vi.name not in bake]
    del g.input[:]
    g.input.extend(inputs)
    data_sets = [([a[i] for i in keep], outputs) for a, (_, outputs) in zip(as_array, test.data_sets)]
    return SimpleNamespace(name=test.name, model=model, data_sets=data_sets, rtol=test.rtol,
                           atol=test.atol)


@pytest.mark.slow
def test_onnx_backend_node_tests() -> None:
    from batch_oracle import backend_cases, check_backend_cases

    modules = {"gather": ["Gather"], "gatherelements": ["GatherElements"],
               "gathernd": ["GatherND"], "scatter": ["Scatter"],
               "scatterelements": ["ScatterElements"], "scatternd": ["ScatterND"],
               "onehot": ["OneHot"], "topk": ["TopK"], "argmax": ["ArgMax"], "argmin": ["ArgMin"],
               "cumsum": ["CumSum"], "trilu": ["Trilu"], "nonzero": ["NonZero"]}
    tests = [baked(t, {"TopK": [1], "CumSum": [1], "OneHot": [1]})
             for module, ops in modules.items() for t in backend_cases(module, ops)]
    unsupported = {"test_onehot_with_bfloat16_values": "bfloat16"}
    for t in tests:
        if t.name in unsupported:
            with pytest.raises(UnsupportedOpError, match=unsupported[t.name]):
                cuvil.compile(t.model)
    runnable = [t for t in tests if t.name not in unsupported]
    assert len(runnable) >= 90
    check_backend_cases(runnable)
