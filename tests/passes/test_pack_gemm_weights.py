"""pack_gemm_weights alone: a Gemm with constant transposed weights reads them transposed
once at compile time (transB=0); the compiled model against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from irbuild import build, structure
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.passes.pack_gemm_weights import pack_gemm_weights

rng = np.random.default_rng(3)
W = rng.standard_normal((6, 11)).astype(np.float32)  # [N, K]
B = rng.standard_normal(6).astype(np.float32)


def test_constant_transposed_weights_are_packed() -> None:
    g = build("""
        x: float32[batch, 11]
        y = Gemm(x, w, b, transB=1, alpha=0.5)
        return y
    """, w=W, b=B)
    w = g.nodes[0].inputs[1]
    pack_gemm_weights(g)
    g.verify()
    assert structure(g) == ["%0 = Gemm(x, const[11, 6], const[6]) {'alpha': 0.5, 'transB': 0}",
                            "return %0"]
    packed = g.nodes[0].inputs[1]
    assert packed is not None and packed.const is not None
    np.testing.assert_array_equal(packed.const, W.T)
    assert packed.const.flags.c_contiguous
    assert w is not None and w.users == [] and packed.users == [g.nodes[0]]


def test_shared_weights_are_packed_for_each_reader() -> None:
    g = build("""
        x: float32[2, 11]
        y = Gemm(x, w, transB=1)
        z = Gemm(x, w, transB=1)
        s = Add(y, z)
        return s
    """, w=W)
    pack_gemm_weights(g)
    g.verify()
    assert [n.attrs for n in g.nodes[:2]] == [{"transB": 0}] * 2
    assert all(n.inputs[1].const.shape == (11, 6) for n in g.nodes[:2])  # type: ignore[union-attr]


@pytest.mark.parametrize("case", ["runtime-weights", "not-transposed", "matmul"])
def test_other_gemms_are_left_alone(case) -> None:
    text = {
        "runtime-weights": "x: float32[2, 11]\nw: float32[6, 11]\ny = Gemm(x, w, transB=1)",
        "not-transposed": "x: float32[2, 6]\ny = Gemm(x, w)",
        "matmul": "x: float32[2, 6]\ny = MatMul(x, w)",
    }[case] + "\nreturn y"
    g = build(text, w=W)
    before = structure(g)
    pack_gemm_weights(g)
    g.verify()
    assert structure(g) == before


def test_packed_model_matches_onnxruntime() -> None:
    model = make_model([helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, alpha=0.7,
                                         beta=0.3)],
                       {"x": (np.float32, ["batch", 11])}, {"y": np.float32}, {"w": W, "b": B})
    compiled = assert_matches_ort(model, {"x": rng.standard_normal((5, 11)).astype(np.float32)})
    assert_matches_ort(model, {"x": rng.standard_normal((1, 11)).astype(np.float32)},
                       compiled=compiled)
