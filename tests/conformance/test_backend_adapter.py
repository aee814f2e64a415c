"""`cuvil.onnx_backend` as onnx's backend interface expects it, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from oracle import make_model, run_ort

from cuvil.errors import CuvilError, ModelError, UnsupportedOpError
from cuvil.onnx_backend import CuvilBackend, bind_inputs

RNG = np.random.default_rng(3)


@pytest.fixture(scope="module")
def two_in_two_out():
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("Relu", ["sum"], ["relu"])]
    model = make_model(nodes, {"a": (np.float32, [2, 3]), "b": (np.float32, [2, 3])},
                       {"relu": np.float32, "sum": np.float32})
    return model, CuvilBackend.prepare(model)


def test_run_returns_outputs_in_graph_order_by_position_and_name(two_in_two_out):
    model, rep = two_in_two_out
    a, b = (RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    want = run_ort(model, {"a": a, "b": b})
    for got in (rep.run([a, b]), rep.run({"b": b, "a": a}), CuvilBackend.run_model(model, [a, b])):
        assert len(got) == 2
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got["sum"], want[1], rtol=1e-6)
        np.testing.assert_allclose(got.relu, want[0], rtol=1e-6)


def test_run_rejects_wrong_inputs(two_in_two_out):
    _, rep = two_in_two_out
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        rep.run([a])
    with pytest.raises(ValueError, match="unknown inputs"):
        rep.run({"a": a, "b": a, "c": a})


def test_prepare_takes_bytes_and_paths(two_in_two_out, tmp_path):
    model, _ = two_in_two_out
    a, b = (RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    want = run_ort(model, {"a": a, "b": b})
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path))
    for source in (model.SerializeToString(), str(path), path):
        np.testing.assert_allclose(CuvilBackend.prepare(source).run([a, b])[0], want[0], rtol=1e-6)
    with pytest.raises(ModelError, match="not a serialized ONNX model"):
        CuvilBackend.prepare(b"\xff\xff\xff")


def test_devices():
    assert CuvilBackend.supports_device("CPU")
    assert not CuvilBackend.supports_device("CUDA")
    assert not CuvilBackend.supports_device("CUDA:1")
    assert not CuvilBackend.supports_device("TPU")
    with pytest.raises(ValueError, match="CPU only"):
        CuvilBackend.prepare(onnx.ModelProto(), "CUDA")


def test_run_node_builds_a_one_node_model():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    node = helper.make_node("Relu", ["x"], ["y"])
    (y,) = CuvilBackend.run_node(node, [x])
    want = run_ort(make_model([node], {"x": (np.float32, [3, 4])}, {"y": np.float32}), {"x": x})
    np.testing.assert_array_equal(y, want[0])


def test_bound_inputs_become_initializers():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, [2, 6]), "shape": (np.int64, [2])},
                       {"y": np.float32})
    shape = np.array([3, 4], np.int64)
    bound = bind_inputs(model, {"shape": shape})
    assert [vi.name for vi in bound.graph.input] == ["x"]
    assert [i.name for i in bound.graph.initializer] == ["shape"]
    with pytest.raises(ModelError, match="not inputs"):
        bind_inputs(model, {"nope": shape})
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    rep = CuvilBackend.prepare(model, bind={"shape": shape})
    assert rep.input_names == ("x",)
    np.testing.assert_array_equal(rep.run([x])[0], run_ort(model, {"x": x, "shape": shape})[0])


def test_unsupported_ops_raise_unsupported_op_error():
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [2])],
                              [helper.make_tensor_value_info("y", 1, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOpError, match="Frobnicate") as info:
        CuvilBackend.prepare(model)
    assert isinstance(info.value, CuvilError)


def test_opt_level_from_the_environment(two_in_two_out, monkeypatch):
    model, _ = two_in_two_out
    a, b = (RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    monkeypatch.setenv("CUVIL_OPT_LEVEL", "0")
    np.testing.assert_allclose(CuvilBackend.prepare(model).run([a, b])[1], a + b, rtol=1e-6)
    monkeypatch.setenv("CUVIL_OPT_LEVEL", "7")
    with pytest.raises(ValueError, match="CUVIL_OPT_LEVEL"):
        CuvilBackend.prepare(model)


@pytest.mark.slow
def test_onnx_backend_test_runner_drives_the_adapter():
    """onnx's own harness (BackendTest) runs cases through the adapter and they pass."""
    import unittest

    import onnx.backend.test

    bt = onnx.backend.test.BackendTest(CuvilBackend, __name__)
    bt.include(r"^test_relu_cpu$").include(r"^test_add_bcast_cpu$").include(
        r"^test_single_relu_model_cpu$")
    suite = unittest.TestSuite()
    for case in bt.test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    # everything else is skipped by the include patterns, and CUDA by supports_device
    ran = result.testsRun - len(result.skipped)
    assert ran == 3, (result.testsRun, len(result.skipped))
    assert result.wasSuccessful(), result.failures + result.errors
