"""Ops whose output size the data decides (NonZero, Compress, Unique) and chains after them,
against onnxruntime on inputs that keep nothing, one element and many; the ABI and metadata
of such outputs (buffers sized by the bound, the actual shape returned).

One model holds every case (one compile); onnx's node tests of these ops run in the
conformance suite.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from oracle import run_ort

import cuvil
from cuvil.errors import UnsupportedOpError

RNG = np.random.default_rng(20261204)


def _model(nodes, inputs, outputs, inits=None, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "selection", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _all_ops_model() -> onnx.ModelProto:
    n = helper.make_node
    nodes = [
        # NonZero of a symbolic-size int64 tensor, and the values it picks, doubled
        n("NonZero", ["x"], ["nz"]),
        n("Transpose", ["nz"], ["nz_t"]),
        n("GatherND", ["x", "nz_t"], ["picked"]),
        n("Add", ["picked", "picked"], ["picked2"]),
        # Compress with and without an axis, then a Slice and a ReduceSum after it
        n("Compress", ["f", "cond"], ["comp_axis"], axis=1),
        n("Compress", ["f", "cond"], ["comp_flat"]),
        n("Slice", ["comp_axis", "s0", "s1", "s_axes"], ["comp_cut"]),
        n("ReduceSum", ["comp_axis", "s_axes"], ["comp_sum"], keepdims=0),
        # Unique, sorted and not, every output; along an axis; of what NonZero picked
        n("Unique", ["u"], ["uy", "ui", "uinv", "uc"], sorted=1),
        n("Unique", ["u"], ["vy", "vi", "vinv", "vc"], sorted=0),
        n("Unique", ["rows"], ["ry", "ri", "rinv", "rc"], sorted=1, axis=0),
        n("Unique", ["picked"], ["py"], sorted=1),
    ]
    inputs = {"x": (T.INT64, ["n", 3]), "f": (T.FLOAT, [2, 5]), "cond": (T.BOOL, [4]),
              "u": (T.FLOAT, ["m"]), "rows": (T.INT64, [6, 2])}
    outputs = ["nz", "picked2", "comp_axis", "comp_flat", "comp_cut", "comp_sum", "uy", "ui",
               "uinv", "uc", "vy", "vi", "vinv", "vc", "ry", "ri", "rinv", "rc", "py"]
    inits = {"s0": np.array([0], np.int64), "s1": np.array([1], np.int64),
             "s_axes": np.array([1], np.int64)}
    return _model(nodes, inputs, outputs, inits)


@pytest.fixture(scope="module")
def all_ops():
    model = _all_ops_model()
    return model, cuvil.compile(model)


FEEDS = {
    "none": {"x": np.zeros((2, 3), np.int64), "cond": np.zeros(4, bool),
             "u": np.array([7.0], np.float32), "rows": np.zeros((6, 2), np.int64)},
    "one": {"x": np.array([[0, 0, 5]], np.int64), "cond": np.array([0, 0, 1, 0], bool),
            "u": np.array([2.0, 2.0], np.float32),
            "rows": np.array([[1, 2]] * 6, np.int64)},
    "many": {"x": RNG.integers(-2, 3, (7, 3)),
             "cond": np.array([1, 0, 1, 1], bool),
             "u": RNG.integers(-3, 4, 11).astype(np.float32),
             "rows": RNG.integers(0, 2, (6, 2)).astype(np.int64)},
}


@pytest.mark.parametrize("which", sorted(FEEDS))
def test_outputs_sized_by_the_data_match_onnxruntime(all_ops, which) -> None:
    model, compiled = all_ops
    feeds = {"f": RNG.standard_normal((2, 5)).astype(np.float32), **FEEDS[which]}
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for info, w in zip(compiled.outputs, want):
        have = got[info.name]
        assert have.shape == w.shape and have.dtype == w.dtype, (info.name, have.shape, w.shape)
        np.testing.assert_allclose(have, w, rtol=1e-6, err_msg=info.name)


def test_outputs_describe_their_bounds(all_ops) -> None:
    _, compiled = all_ops
    by_name = {t.name: t for t in compiled.outputs}
    nz = by_name["nz"]
    assert nz.data_dependent == (1,) and nz.max_shape == (2, "3*n")
    assert by_name["comp_axis"].max_shape == (2, 4) and by_name["comp_axis"].data_dependent == (1,)
    assert by_name["uinv"].data_dependent == () and by_name["uinv"].shape == ("m",)
    assert "max_shape=[2, 3*n]" in repr(nz)


def test_out_buffers_take_the_largest_shape_and_come_back_as_views(all_ops) -> None:
    model, compiled = all_ops
    feeds = {"f": np.ones((2, 5), np.float32), **FEEDS["many"]}
    n = feeds["x"].shape[0]
    buffer = np.full((2, 3 * n), -1, np.int64)
    got = compiled.run(feeds, out={"nz": buffer})
    want = run_ort(model, feeds)[0]
    np.testing.assert_array_equal(got["nz"], want)
    assert np.shares_memory(got["nz"], buffer)


def test_the_library_writes_the_data_dependent_dims_after_the_input_dims(tmp_path) -> None:
    """Through the C ABI alone: dims[] holds the input dims, run() appends the counts. The
    output twice: the second is copied after the run, as many bytes as the count gives."""
    y_info = helper.make_tensor_value_info("y", T.INT64, [1, "k"])
    model = helper.make_model(helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["y"])], "nz",
        [helper.make_tensor_value_info("x", T.FLOAT, ["n"])], [y_info, y_info]),
        opset_imports=[helper.make_opsetid("", 17)])
    compiled = cuvil.compile(model, name="nz")
    lib = ctypes.CDLL(compiled._path)
    x = np.array([0, 3, 0, 4, 5], np.float32)
    y = np.full(5, -1, np.int64)  # the buffer for [1, n], the bound
    y2 = np.full(5, -1, np.int64)
    dims = (ctypes.c_int64 * 2)(5, -1)
    lib.cuvil_nz_workspace_size.restype = ctypes.c_int64
    workspace = np.zeros(max(lib.cuvil_nz_workspace_size(dims), 1) + 64, np.uint8)
    ptrs = lambda *arrays: (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])  # noqa: E731
    ws = workspace.ctypes.data + (-workspace.ctypes.data) % 64
    assert lib.cuvil_nz_run(ptrs(x), ptrs(y, y2), dims, ctypes.c_void_p(ws)) == 0
    assert dims[1] == 3
    np.testing.assert_array_equal(y, [1, 3, 4, -1, -1])
    np.testing.assert_array_equal(y2, [1, 3, 4, -1, -1])


def test_sizes_decided_by_different_data_cannot_be_combined() -> None:
    n = helper.make_node
    model = _model([n("NonZero", ["a"], ["ia"]), n("NonZero", ["b"], ["ib"]),
                    n("Add", ["ia", "ib"], ["s"])],
                   {"a": (T.FLOAT, [4]), "b": (T.FLOAT, [4])}, ["s"])
    with pytest.raises(UnsupportedOpError, match="depend on the data"):
        cuvil.compile(model)
