"""uint16, uint32 and uint64 near their limits, where a signed instruction gives another answer.

Values at and above 2**(bits-1) read as negative through signed division, comparison,
max/min, widening (sext), int -> float and float -> int conversions, right shifts and
integer means. Each dtype compiles two models holding many ops at once: elementwise ones
checked against onnxruntime, and the ones onnxruntime has no unsigned kernels for
(reductions, ArgMax/ArgMin, TopK, CumSum, ScatterElements with max/min; Max, Min, Clip and
Where of uint16) checked against onnx's reference evaluator.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from oracle import run_ort

import cuvil

OPSET = 18
UNSIGNED = ("uint16", "uint32", "uint64")
N = 16  # elements of the elementwise operands


def _tensor_type(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _model(nodes, inputs, outputs, inits=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "unsigned",
        [helper.make_tensor_value_info(n, _tensor_type(a.dtype), list(a.shape)) for n, a in inputs.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], oracle: str) -> None:
    """Compile once, run, and compare every output exactly with the oracle's."""
    compiled = cuvil.compile(model)
    got = compiled.run(feeds)
    expected = run_ort(model, feeds) if oracle == "ort" else ReferenceEvaluator(model).run(None, feeds)
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, expected):
        want = np.asarray(want)
        have = got[name]
        assert have.dtype == want.dtype, f"{name}: dtype {have.dtype} != {want.dtype}"
        assert have.shape == want.shape, f"{name}: shape {have.shape} != {want.shape}"
        np.testing.assert_array_equal(have, want, err_msg=f"{name} ({oracle})")


def _edge_values(dtype: str, n: int, seed: int) -> np.ndarray:
    """The limits of the type and values either side of 2**(bits-1), then random ones over the
    whole range."""
    info = np.iinfo(dtype)
    top, half = int(info.max), int(info.max) // 2 + 1
    edges = [top, top - 1, half, half - 1, half + 1, 0, 1, 3 * (half // 2), top - 7, 7]
    rng = np.random.default_rng(seed)
    rest = rng.integers(0, top, size=n - len(edges), dtype=dtype, endpoint=True)
    return np.concatenate([np.array(edges, dtype=dtype), rest]).astype(dtype)


def _floats_in_range(dtype: str) -> np.ndarray:
    """float64 values whose cast to `dtype` onnxruntime defines the same way in all its loops:
    the whole unsigned range, and small negatives (which wrap: -1.0 -> all ones)."""
    bits = np.dtype(dtype).itemsize * 8
    top = 2.0 ** bits
    vals = [0.0, 1.5, 2.0 ** (bits - 1), 2.0 ** (bits - 1) + 0.5 * (bits < 64), 0.75 * top,
            top - 2.0 ** max(bits - 53, 0) * 2, 2.0 ** (bits - 1) - 2.0 ** max(bits - 53, 0) * 4,
            -1.0, -2.5, 12345.75, 0.9 * top, 0.6 * top, 3.0, 2.0 ** (bits - 2) + 0.25]
    vals += [0.3 * top] * (N - len(vals))
    return np.array(vals[:N], np.float64)


# -- elementwise, against onnxruntime ----------------------------------------------------------


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_elementwise_near_the_limits_match_onnxruntime(dtype):
    a = _edge_values(dtype, N, seed=1)
    b = _edge_values(dtype, N, seed=2)[::-1].copy()
    b[b == 0] = 3  # x / 0 is undefined (onnxruntime crashes)
    bits = np.dtype(dtype).itemsize * 8
    shift = (np.arange(N) % bits).astype(dtype)
    f64 = _floats_in_range(dtype)
    f32 = f64.astype(np.float32)
    # float32 rounding may push a value to 2**bits, which is out of range
    f32[f32.astype(np.float64) >= 2.0 ** bits] = 1.0
    half = np.iinfo(dtype).max // 2 + 1
    lo, hi = np.array(half - 5, dtype), np.array(np.iinfo(dtype).max - 3, dtype)
    to = {name: _tensor_type(name) for name in ("float32", "float64", "int64", "uint64", dtype)}
    nodes = [
        helper.make_node("Div", ["a", "b"], ["div"]),
        helper.make_node("Mod", ["a", "b"], ["mod"]),
        helper.make_node("Mod", ["a", "b"], ["fmod"], fmod=1),
        helper.make_node("Less", ["a", "b"], ["less"]),
        helper.make_node("Greater", ["a", "b"], ["greater"]),
        helper.make_node("LessOrEqual", ["a", "b"], ["less_equal"]),
        helper.make_node("GreaterOrEqual", ["a", "b"], ["greater_equal"]),
        helper.make_node("BitShift", ["a", "shift"], ["shr"], direction="RIGHT"),
        helper.make_node("Sign", ["a"], ["sign"]),
        helper.make_node("Abs", ["a"], ["abs"]),
        helper.make_node("Cast", ["a"], ["to_f32"], to=to["float32"]),
        helper.make_node("Cast", ["a"], ["to_f64"], to=to["float64"]),
        helper.make_node("Cast", ["a"], ["to_i64"], to=to["int64"]),
        helper.make_node("Cast", ["a"], ["to_u64"], to=to["uint64"]),
        helper.make_node("Cast", ["f64"], ["from_f64"], to=to[dtype]),
        helper.make_node("Cast", ["f32"], ["from_f32"], to=to[dtype]),
    ]
    if dtype != "uint16":  # onnxruntime has no uint16 Max, Min, Clip or Where
        nodes += [helper.make_node("Max", ["a", "b"], ["max"]),
                  helper.make_node("Min", ["a", "b"], ["min"]),
                  helper.make_node("Clip", ["a", "lo", "hi"], ["clip"]),
                  helper.make_node("Clip", ["a", "", "hi"], ["clip_hi"])]
    if dtype == "uint32":  # nor uint64 Where
        nodes += [helper.make_node("Where", ["less", "a", "b"], ["where"])]
    outputs = [o for n in nodes for o in n.output]
    model = _model(nodes, {"a": a, "b": b, "shift": shift, "f64": f64, "f32": f32}, outputs,
                   {"lo": lo, "hi": hi})
    _check(model, {"a": a, "b": b, "shift": shift, "f64": f64, "f32": f32}, "ort")


# -- reductions and selections, against the reference evaluator --------------------------------


def _rows(dtype: str) -> np.ndarray:
    """[4, 6]: one value at or above 2**(bits-1) per row among small distinct ones, so row
    sums stay in range and orders have no ties. uint64 values are multiples of 4096 and row
    sums multiples of 6 * 4096, so the reference evaluator's float64 mean is exact."""
    top = int(np.iinfo(dtype).max)
    half = top // 2 + 1
    step = 4096 if dtype == "uint64" else 1
    big = [half, top - 256 * step + 1 - step, half + 3 * step, (top // 4 * 3) // step * step]
    rows = []
    for r, col in enumerate((0, 5, 2, 3)):
        row = [(6 * r + c + 1) * step for c in range(6)]
        row[col] = big[r]
        last = 4 if col == 5 else 5
        row[last] += step * (-(sum(row) // step) % 6)
        rows.append(row)
    return np.array(rows, dtype=dtype)


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_reductions_and_selections_near_the_limits_match_the_reference(dtype):
    x = _rows(dtype)
    y = _edge_values(dtype, 24, seed=3).reshape(4, 6)
    axes1, axes0 = np.array([1], np.int64), np.array([0], np.int64)
    nodes = [
        helper.make_node("ArgMax", ["x"], ["argmax"], axis=1),
        helper.make_node("ArgMin", ["x"], ["argmin"], axis=1, keepdims=0),
        helper.make_node("ArgMax", ["y"], ["argmax_y"], axis=0, select_last_index=1),
        helper.make_node("TopK", ["x", "k"], ["top_v", "top_i"], axis=1),
        helper.make_node("TopK", ["y", "k"], ["bottom_v", "bottom_i"], axis=0, largest=0),
    ]
    inits = {"k": np.array([3], np.int64)}
    if dtype == "uint16":  # onnxruntime has no uint16 Max/Min/Clip/Where: checked here instead
        half = np.iinfo(dtype).max // 2 + 1
        inits.update({"lo": np.array(half - 5, dtype), "hi": np.array(65530, dtype)})
        nodes += [helper.make_node("Max", ["x", "y"], ["max"]),
                  helper.make_node("Min", ["x", "y"], ["min"]),
                  helper.make_node("Clip", ["y", "lo", "hi"], ["clip"]),
                  helper.make_node("Clip", ["y", "lo"], ["clip_lo"]),
                  helper.make_node("Less", ["x", "y"], ["less"]),
                  helper.make_node("Where", ["less", "x", "y"], ["where"])]
    else:  # the spec allows reductions and CumSum of uint32/uint64 only
        inits.update({"axes1": axes1, "axes0": axes0, "col": np.array(1, np.int64),
                      "idx": np.array([[5, 0, 2], [1, 1, 4]], np.int64)})
        nodes += [
            helper.make_node("ReduceMax", ["x", "axes1"], ["rmax"]),
            helper.make_node("ReduceMin", ["y", "axes0"], ["rmin"], keepdims=0),
            helper.make_node("ReduceMax", ["y"], ["rmax_all"], keepdims=0),
            helper.make_node("ReduceSum", ["x", "axes1"], ["rsum"]),
            helper.make_node("ReduceMean", ["x", "axes1"], ["rmean"]),
            helper.make_node("ReduceL1", ["x", "axes1"], ["rl1"]),
            helper.make_node("CumSum", ["x", "col"], ["cumsum"]),
            helper.make_node("Slice", ["x", "s0", "s1", "s2"], ["x2"]),
            helper.make_node("ScatterElements", ["y", "idx", "x2"], ["scatter_max"], axis=1,
                             reduction="max"),
            helper.make_node("ScatterElements", ["y", "idx", "x2"], ["scatter_min"], axis=1,
                             reduction="min"),
        ]
        inits.update({"s0": np.array([0, 0], np.int64), "s1": np.array([2, 3], np.int64),
                      "s2": np.array([0, 1], np.int64)})
    outputs = [o for n in nodes for o in n.output if o not in ("less", "x2")]
    model = _model(nodes, {"x": x, "y": y}, outputs, inits)
    _check(model, {"x": x, "y": y}, "reference")


def test_unsigned_inputs_and_outputs_cross_the_runtime_boundary():
    """Arrays of each width go in and come out bit for bit, and a wrong dtype is refused."""
    nodes = [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(3)]
    feeds = {f"x{i}": _edge_values(dt, 12, seed=i) for i, dt in enumerate(UNSIGNED)}
    model = _model(nodes, feeds, [f"y{i}" for i in range(3)])
    compiled = cuvil.compile(model)
    assert [t.dtype.name for t in compiled.inputs] == list(UNSIGNED)
    got = compiled.run(feeds)
    for i, dt in enumerate(UNSIGNED):
        assert got[f"y{i}"].dtype == np.dtype(dt)
        np.testing.assert_array_equal(got[f"y{i}"], feeds[f"x{i}"])
    wrong = dict(feeds, x2=feeds["x2"].astype(np.int64))
    with pytest.raises(ValueError, match="uint64"):
        compiled.run(wrong)
