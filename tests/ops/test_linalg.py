"""Det against onnxruntime (float32), onnx's reference (float64) and numpy (float16): random and
singular matrices, pivoting, batches, symbolic batch and matrix dims; errors.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError


def _matrices(rng, dtype, shape):
    """Random matrices; in a batch, also one with two equal rows, one with a zero column and
    one whose first pivot is 0 (so rows must be swapped)."""
    x = rng.standard_normal(shape)
    m = shape[-1]
    flat = x.reshape(-1, m, m)
    if flat.shape[0] >= 4 and m >= 2:
        flat[1, 1] = flat[1, 0]
        flat[2, :, m - 1] = 0
        flat[3, 0, 0] = 0
    return flat.reshape(shape).astype(dtype)


def det(shape, dtype="float32", oracle="ort"):
    return Case("Det", ["x"], {}, feeds={"x": (dtype, shape)}, data=_matrices, oracle=oracle)


def test_det():
    cases = [det([m, m]) for m in (1, 2, 3, 4, 5, 8)]
    cases += [det([6, 3, 3]), det(["n", "m", "m"]), det([2, "n", 4, 4])]
    # (onnxruntime has Det for float32 only)
    cases += [det(shape, dtype, oracle="reference")
              for shape, dtype in (([5, 2, 2], "float64"), (["n", "m", "m"], "float64"))]
    check_cases(cases, sizes=[{"n": 4, "m": 3}, {"n": 1, "m": 1}, {"n": 5, "m": 6}],
                opset=11, rtol=1e-3, atol=1e-4)
    tests = backend_cases("det", ["Det"])
    assert len(tests) == 2
    check_backend_cases(tests)


def test_det_needs_square_matrices():
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det")], "bad",
                              [helper.make_tensor_value_info("x", 1, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", 1, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    with pytest.raises(ModelError, match=r"'det' \(Det\): X's matrices must be square"):
        cuvil.compile(model)
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det")], "bad",
                              [helper.make_tensor_value_info("x", 1, [4])],
                              [helper.make_tensor_value_info("y", 1, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    with pytest.raises(ModelError, match=r"'det' \(Det\): X must be \[\.\.\., M, M\]"):
        cuvil.compile(model)


def test_det_symbolic_matrices_must_be_square_at_run_time():
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det")], "sym",
                              [helper.make_tensor_value_info("x", 1, ["a", "b"])],
                              [helper.make_tensor_value_info("y", 1, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    compiled = cuvil.compile(model)
    x = np.array([[2, 1], [4, 3]], np.float32)
    np.testing.assert_allclose(compiled(x), np.linalg.det(x.astype(np.float64)), rtol=1e-6)
    with pytest.raises(ValueError, match="must be square"):
        compiled(np.ones((2, 3), np.float32))


def test_det_float16():
    # neither onnxruntime nor the reference has float16 Det: numpy's, on the same values
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "half",
                              [helper.make_tensor_value_info("x", 10, [4, 3, 3])],
                              [helper.make_tensor_value_info("y", 10, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    x = _matrices(np.random.default_rng(2), np.float16, (4, 3, 3))
    got = cuvil.compile(model)(x)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, np.linalg.det(x.astype(np.float64)), rtol=5e-3, atol=5e-3)
