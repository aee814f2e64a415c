"""TensorScatter (KV-cache update) against onnxruntime: linear and circular modes, sequence
axes other than -2, no write_indices, several dtypes, symbolic batch and sequence dims at
several sizes; the reference evaluator for wrapped negative indices (onnxruntime rejects
them); a linear write past the cache failing the run; errors a model can cause."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from batch_oracle import Case, build, check_cases
from onnx import helper
from oracle import assert_matches_ort

import cuvil
from cuvil.errors import ModelError

OPSET = 24


def scatter_case(past, update, *, mode="linear", axis=None, indices=True, dtype="float32",
                 low=0, oracle="ort"):
    """A case whose write indices fit the cache in linear mode (any values in circular)."""
    attrs = {"mode": mode}
    if axis is not None:
        attrs["axis"] = axis
    a = -2 if axis is None else axis

    def data(rng, dt, shape):
        if np.dtype(dt) == np.int64 and len(shape) == 1 and indices:
            n, s = shape_of(past, a), shape_of(update, a)
            high = n - s + 1 if mode == "linear" else 3 * n
            return rng.integers(low, high, size=shape).astype(np.int64)
        if np.dtype(dt) == np.bool_:
            return rng.random(shape) < 0.5
        return (rng.standard_normal(shape) * 10).astype(dt)

    feeds = {"past": (dtype, past), "update": (dtype, update)}
    if indices:
        feeds["wi"] = ("int64", [past[0]])
    return Case("TensorScatter", ["past", "update", "wi" if indices else ""], attrs, feeds=feeds,
                data=data, oracle=oracle)


#: the run's current size of each symbolic dim (set by the test before it runs)
SIZE: dict[str, int] = {}


def shape_of(shape, axis):
    d = shape[axis]
    return SIZE[d] if isinstance(d, str) else d


def test_modes_axes_dtypes() -> None:
    SIZE.clear()
    cases = [
        scatter_case([2, 3, 8, 4], [2, 3, 1, 4]),
        scatter_case([2, 3, 8, 4], [2, 3, 5, 4], mode="circular"),
        scatter_case([3, 6, 5], [3, 2, 5], axis=1),
        scatter_case([2, 4, 7, 3], [2, 4, 7, 2], axis=3, mode="circular"),
        scatter_case([2, 5, 4], [2, 5, 4], axis=1),               # the whole cache
        scatter_case([2, 6, 3], [2, 2, 3], indices=False),
        scatter_case([2, 6, 3], [2, 4, 3], indices=False, mode="circular"),
        scatter_case([2, 2, 6, 8], [2, 2, 3, 8], dtype="float16"),
        scatter_case([3, 9, 2], [3, 4, 2], dtype="int64", mode="circular"),
        scatter_case([2, 6, 2], [2, 3, 2], dtype="bool"),
        scatter_case([2, 6, 2], [2, 3, 2], dtype="uint8"),
    ]
    check_cases(cases, opset=OPSET)


def test_symbolic_batch_and_sequence_dims() -> None:
    cases = [
        scatter_case(["b", 2, "max", 4], ["b", 2, "seq", 4]),
        scatter_case(["b", 2, "max", 4], ["b", 2, "seq", 4], mode="circular"),
        scatter_case(["b", "max", 3], ["b", 1, 3], axis=1),
    ]
    model = build(cases, OPSET)
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(2)
    for size in ({"b": 1, "max": 8, "seq": 3}, {"b": 3, "max": 5, "seq": 5}, {"b": 2, "max": 16, "seq": 1}):
        SIZE.clear()
        SIZE.update(size)
        feeds = {f"c{i}_{n}": c.data(rng, dt, [size.get(d, d) for d in shape])
                 for i, c in enumerate(cases) for n, (dt, shape) in c.feeds.items()}
        assert_matches_ort(model, feeds, compiled=compiled)


def test_negative_circular_indices_wrap_as_the_reference() -> None:
    SIZE.clear()
    check_cases([scatter_case([3, 7, 2], [3, 4, 2], mode="circular", low=-20, oracle="reference")],
                opset=OPSET)


def _model(past, update, wi, **attrs) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info("past", onnx.TensorProto.FLOAT, past),
              helper.make_tensor_value_info("update", onnx.TensorProto.FLOAT, update)]
    if wi is not None:
        inputs.append(helper.make_tensor_value_info("wi", wi, [past[0]]))
    g = helper.make_graph(
        [helper.make_node("TensorScatter", ["past", "update"] + (["wi"] if wi is not None else []),
                          ["y"], name="kv", **attrs)], "g", inputs,
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, past)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 10
    return m


def test_linear_write_past_the_cache_fails_the_run() -> None:
    compiled = cuvil.compile(_model([2, 6, 3], [2, 2, 3], onnx.TensorProto.INT64))
    past, upd = np.zeros((2, 6, 3), np.float32), np.ones((2, 2, 3), np.float32)
    ok = compiled.run({"past": past, "update": upd, "wi": np.array([4, 0])})["y"]
    assert ok[0, 4:].all() and ok[1, :2].all() and not ok[0, :4].any()
    for bad in ([5, 0], [0, -1]):
        with pytest.raises(ValueError, match="kv"):
            compiled.run({"past": past, "update": upd, "wi": np.array(bad)})


@pytest.mark.parametrize("past,update,wi,attrs,message", [
    ([2, 6, 3], [2, 7, 3], onnx.TensorProto.INT64, {}, "exceeds the cache's 6"),
    ([2, 6, 3], [2, 2, 4], onnx.TensorProto.INT64, {}, "update dim 2"),
    ([2, 6, 3], [2, 2, 3], onnx.TensorProto.INT64, {"axis": 0}, "batch axis"),
    ([2, 6, 3], [2, 2, 3], onnx.TensorProto.INT64, {"mode": "ring"}, "mode 'ring'"),
    ([2, 6, 3], [2, 2, 3], onnx.TensorProto.INT32, {}, "write_indices .* must be int64"),
    ([2, 6, 3], [2, 2], onnx.TensorProto.INT64, {}, "same rank"),
])
def test_errors_name_the_node(past, update, wi, attrs, message) -> None:
    with pytest.raises(ModelError, match=message) as info:
        cuvil.compile(_model(past, update, wi, **attrs))
    assert "'kv'" in str(info.value)
