"""fold_constants: a node on constant inputs evaluated at compile time (against numpy), what
it refuses to fold, and a model whose constant subexpressions import as constants (the
compiled model against onnxruntime)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.frontend import fold_constants, import_model
from cuvil.compiler.frontend.fold_constants import fold_node

OPSETS = {"": 17}
A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.linspace(-1, 1, 3, dtype=np.float32)


def fold(node, *inputs):
    return fold_node(node, list(inputs), OPSETS, 8)


@pytest.mark.parametrize(("node", "inputs", "expected"), [
    (helper.make_node("Add", ["a", "b"], ["y"]), (A, B), A + B),
    (helper.make_node("MatMul", ["a", "t"], ["y"]), (A, A.T.copy()), A @ A.T),
    (helper.make_node("Transpose", ["a"], ["y"], perm=[1, 0]), (A,), A.T),
    (helper.make_node("Reshape", ["a", "s"], ["y"]), (A, np.array([3, -1])), A.reshape(3, 2)),
    (helper.make_node("ReduceSum", ["a", "ax"], ["y"], keepdims=0), (A, np.array([1])), A.sum(1)),
    (helper.make_node("Cast", ["a"], ["y"], to=7), (A,), A.astype(np.int64)),
    (helper.make_node("Shape", ["a"], ["y"]), (A,), np.array([2, 3])),
    (helper.make_node("Sum", ["a", "a"], ["y"]), (A, A), 2 * A),  # one input read twice
    (helper.make_node("Clip", ["a", "", "hi"], ["y"]), (A, None, np.float32(2)),
     np.minimum(A, 2)),  # an absent optional input
])
def test_folds_like_numpy(node, inputs, expected) -> None:
    out = fold(node, *inputs)
    assert out is not None and len(out) == 1
    assert out[0].dtype == expected.dtype and out[0].shape == expected.shape
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def test_zero_d_results_stay_zero_d() -> None:
    out = fold(helper.make_node("ReduceMax", ["a"], ["y"], keepdims=0), A)
    assert out is not None and out[0].shape == () and out[0] == A.max()


def test_several_outputs() -> None:
    out = fold(helper.make_node("Split", ["a"], ["p", "q", "r"], axis=1), A)
    assert out is not None and [o.tolist() for o in out] == [A[:, i:i + 1].tolist() for i in range(3)]


@pytest.mark.parametrize("node", [
    helper.make_node("RandomUniformLike", ["a"], ["y"]),
    helper.make_node("If", ["c"], ["y"], then_branch=helper.make_graph([], "t", [], []),
                     else_branch=helper.make_graph([], "e", [], [])),
    helper.make_node("Reshape", ["a", "s"], ["y"]),  # 6 elements into [4]: invalid
], ids=["nondeterministic", "subgraph", "invalid"])
def test_refuses(node) -> None:
    inputs = {"RandomUniformLike": (A,), "If": (np.array(True),), "Reshape": (A, np.array([4]))}
    assert fold(node, *inputs[node.op_type]) is None


def test_refuses_results_too_large_to_store(monkeypatch) -> None:
    monkeypatch.setattr(fold_constants, "MAX_FOLDED_ELEMENTS", 5)
    assert fold(helper.make_node("Add", ["a", "b"], ["y"]), A, B) is None
    assert fold(helper.make_node("ReduceSum", ["a"], ["y"]), A) is not None


def test_constant_subexpressions_import_as_constants() -> None:
    """w2 = Transpose(w) * 2 and the reshape target are folded: only the run-time ops stay."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    model = make_model([helper.make_node("Transpose", ["w"], ["wt"]),
                        helper.make_node("Mul", ["wt", "two"], ["w2"]),
                        helper.make_node("Concat", ["m1", "four"], ["shape"], axis=0),
                        helper.make_node("Reshape", ["x", "shape"], ["xr"]),
                        helper.make_node("MatMul", ["xr", "w2"], ["y"])],
                       {"x": (np.float32, [2, 2, 4])}, {"y": np.float32},
                       {"w": w, "two": np.float32(2), "m1": np.array([-1]), "four": np.array([4])})
    g = import_model(model)
    assert [n.op_type for n in g.nodes] == ["Reshape", "MatMul"]
    w2 = g.nodes[1].inputs[1]
    assert w2 is not None and w2.const is not None
    np.testing.assert_array_equal(w2.const, w.T * 2)
    assert_matches_ort(model, {"x": np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 2, 4)})
