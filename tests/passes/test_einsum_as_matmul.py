"""einsum_as_matmul alone: the graph after the pass against the graph expected, for the
equations exporters write (attention, projections with a weight, matrix-vector), those that
keep the Einsum lowering. Compiled models are checked against onnxruntime by
tests/ops/test_gemm.py: every equation of its table goes through this pass where it applies, and
`test_einsum_as_matmul_batch_axes` checks the rewrites made here at run-time sizes."""

from __future__ import annotations

import numpy as np
import pytest
from irbuild import build, structure
from onnx import helper
from oracle import make_model

from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.einsum_as_matmul import einsum_as_matmul

W = np.ones((4, 3), np.float32)


def _after(text: str, **consts: np.ndarray) -> list[str]:
    g = build(text, opset=12, **consts)
    einsum_as_matmul(g)
    g.verify()
    return structure(g)


def test_attention_scores_transpose_the_keys() -> None:
    assert _after("""
        q: float32[b, 2, s, 4]
        k: float32[b, 2, t, 4]
        y = Einsum(q, k, equation="bhqd,bhkd->bhqk")
        return y
    """) == ["%0 = Transpose(k) {'perm': [0, 1, 3, 2]}", "%1 = MatMul(q, %0)", "return %1"]


def test_attention_values_are_a_matmul() -> None:
    assert _after("""
        p: float32[b, 2, s, t]
        v: float32[b, 2, t, 4]
        y = Einsum(p, v, equation="bhqk,bhkd->bhqd")
        return y
    """) == ["%0 = MatMul(p, v)", "return %0"]


def test_a_weight_stays_a_constant_for_pack_gemm_weights() -> None:
    # the rows label b becomes a batch axis that the weight gets by broadcasting
    assert _after("""
        x: float32[b, s, 4]
        y = Einsum(x, w, equation="bld,dn->bln")
        return y
    """, w=W) == ["%0 = MatMul(x, const[4, 3])", "return %0"]


def test_matrix_vector_unsqueezes_and_squeezes() -> None:
    assert _after("""
        a: float32[3, 4]
        v: float32[4]
        y = Einsum(a, v, equation="ij,j->i")
        return y
    """) == ["%0 = Unsqueeze(v, const[1])", "%1 = MatMul(a, %0)", "%2 = Squeeze(%1, const[1])",
             "return %2"]


def test_output_order_and_extra_column_labels() -> None:
    # columns e, f of the second operand: e a batch axis, for which the first gets an axis of 1
    assert _after("""
        x: float32[2, 3, 4]
        y: float32[2, 4, 5, 6]
        z = Einsum(x, y, equation="bik,bkef->ebif")
        return z
    """) == ["%0 = Unsqueeze(x, const[1])", "%1 = Transpose(y) {'perm': [0, 2, 1, 3]}",
             "%2 = MatMul(%0, %1)", "%3 = Transpose(%2) {'perm': [1, 0, 2, 3]}", "return %3"]


@pytest.mark.parametrize("equation, shapes", [
    ("abcd,cdef->abef", ([2, 3, 4, 5], [4, 5, 2, 3])),  # two summed labels
    ("i,j->ij", ([3], [4])),  # outer product
    ("ii,ij->j", ([3, 3], [3, 4])),  # a diagonal
    ("ij,jk,kl->il", ([2, 3], [3, 4], [4, 5])),  # three operands
    ("bsd->bd", ([2, 3, 4],)),  # a reduction
])
def test_other_equations_keep_the_einsum(equation: str, shapes: tuple[list[int], ...]) -> None:
    names = [f"x{i}" for i in range(len(shapes))]
    lines = [f"x{i}: float32[{', '.join(map(str, s))}]" for i, s in enumerate(shapes)]
    text = "\n".join([*lines, f'y = Einsum({", ".join(names)}, equation="{equation}")',
                      "return y"])
    assert [line.split(" = ")[1].split("(")[0] for line in _after(text)[:-1]] == ["Einsum"]


def test_einsum_attention_becomes_one_attention_node() -> None:
    # a diffusion U-Net's attention as exporters write it: after this pass, fuse_attention
    # finds its MatMul -> Mul -> Softmax -> MatMul (the keys transposed once, for k_t)
    nodes = [helper.make_node("Einsum", ["q", "k"], ["s"], equation="bhqd,bhkd->bhqk"),
             helper.make_node("Mul", ["s", "c"], ["t"]),
             helper.make_node("Softmax", ["t"], ["p"], axis=-1),
             helper.make_node("Einsum", ["p", "v"], ["o"], equation="bhqk,bhkd->bhqd")]
    x = (np.float32, [1, 4, 64, 16])
    model = make_model(nodes, {"q": x, "k": x, "v": x}, {"o": np.float32},
                       {"c": np.array(0.25, np.float32)}, opset=13)
    assert [n.op_type for n in run_passes(import_model(model)).nodes] == ["Transpose", "Attention"]
