"""Rewrite float32 two-operand Einsum contractions over one summed label (attention's
"bhqd,bhkd->bhqk" and "bhqk,bhkd->bhqd", a projection "bld,dn->bln") as MatMul between
Transposes, as onnxruntime does: the MatMul then runs on the GEMM kernel, split over the
threads, its constant weights packed (pack_gemm_weights) and attention fused (fuse_attention),
where the Einsum lowering walked its batch labels one product at a time on one thread.

Labels in both operands and the output are MatMul's batch axes; those of one operand and the
output its rows (A) or columns (B), the last of each being the matrix's and the others more
batch axes, for which the other operand gets axes of size 1 (Unsqueeze, a view); the summed
label is the contraction. A missing row or column label becomes an axis of size 1, squeezed
from the product. Contractions over several labels (a Reshape that merges them) and outer
products (no summed label) keep the Einsum lowering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cuvil.compiler.ir import Dim, Graph, Node, TensorType, Value
from cuvil.compiler.ops import UNCHECKED
from cuvil.compiler.ops.einsum import label_sizes, parse_equation
from cuvil.compiler.passes.rewrite import Rule, apply_rules, pattern

#: opset the new nodes are read at (Unsqueeze and Squeeze take their axes as an input)
OPSET = 13


def einsum_as_matmul(graph: Graph) -> Graph:
    return apply_rules(graph, RULES)


def _rewrite(graph: Graph, node: Node) -> Node | None:
    if len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return None
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    eq = parse_equation(node, [a.type.rank, b.type.rank])
    ta, tb = eq.inputs
    if len(set(ta)) != len(ta) or len(set(tb)) != len(tb):
        return None  # a diagonal
    summed = eq.summed
    if len(summed) != 1 or summed[0] not in ta or summed[0] not in tb:
        return None
    if any(lab not in eq.output for lab in ta + tb if lab not in summed):
        return None  # a label summed within one operand
    batch = [lab for lab in eq.output if lab in ta and lab in tb]
    rows = [lab for lab in eq.output if lab in ta and lab not in tb]
    cols = [lab for lab in eq.output if lab in tb and lab not in ta]
    sizes = label_sizes(node, UNCHECKED, eq)
    k = summed[0]
    # the operands' axes, None for an axis of size 1 they gain
    a_axes = [*batch, *rows[:-1], *[None] * len(cols[:-1]), rows[-1] if rows else None, k]
    b_axes = [*batch, *[None] * len(rows[:-1]), *cols[:-1], k, cols[-1] if cols else None]
    name = node.name or node.outputs[0].name
    a2 = _arrange(graph, node, a, ta, a_axes, f"{name}_a")
    b2 = _arrange(graph, node, b, tb, b_axes, f"{name}_b")
    # the product's axes: batch, the extra rows and columns, then the matrix's
    p_axes = [*batch, *rows[:-1], *cols[:-1], rows[-1] if rows else None,
              cols[-1] if cols else None]
    kept = [lab for lab in p_axes if lab is not None]
    missing = [i for i, lab in enumerate(p_axes) if lab is None]
    perm = [kept.index(lab) for lab in eq.output]
    # MatMul, then Squeeze and Transpose where needed; the last of them replaces the Einsum
    steps: list[tuple[str, list[Value], dict[str, Any], Sequence[str | None]]] = [
        ("MatMul", [b2], {}, p_axes)]
    if missing:
        axes = graph.constant(np.array(missing, np.int64), f"{name}_squeeze_axes")
        steps.append(("Squeeze", [axes], {}, kept))
    if perm != list(range(len(perm))):
        steps.append(("Transpose", [], {"perm": perm}, eq.output))
    v = a2
    for i, (op, operands, attrs, axes_after) in enumerate(steps):
        if i == len(steps) - 1:
            return graph.replace_node(node, Node(op, [v, *operands], [], attrs, name=name,
                                                 opset=OPSET))
        out = graph.value(f"{name}_{op.lower()}", TensorType(v.type.dtype, _shape(axes_after,
                                                                                  sizes)))
        graph.insert_before(node, Node(op, [v, *operands], [out], attrs,
                                       name=f"{name}_{op.lower()}", opset=OPSET))
        v = out
    raise AssertionError("unreachable: the steps end in a return")


def _shape(axes: Sequence[str | None], sizes: dict[str, Dim]) -> tuple[Dim, ...]:
    return tuple(1 if lab is None else sizes[lab] for lab in axes)


def _arrange(graph: Graph, before: Node, v: Value, labels: tuple[str, ...],
             axes: list[str | None], name: str) -> Value:
    """`v` (axes `labels`) with its axes in the order of `axes`, gaining the None ones but
    the leading batch ones, which MatMul's broadcasting implies (a weight stays a constant)."""
    while len(axes) > 2 and axes[0] is None:
        axes = axes[1:]
    order = [lab for lab in axes if lab is not None]
    perm = [labels.index(lab) for lab in order]
    dims = {lab: v.type.shape[labels.index(lab)] for lab in labels}
    if perm != list(range(len(perm))):
        moved = graph.value(f"{name}_t", TensorType(v.type.dtype, tuple(dims[lab] for lab in order)))
        graph.insert_before(before, Node("Transpose", [v], [moved], {"perm": perm},
                                         name=f"{name}_transpose", opset=OPSET))
        v = moved
    new = [i for i, lab in enumerate(axes) if lab is None]
    if not new:
        return v
    grown = graph.value(f"{name}_u", TensorType(v.type.dtype, tuple(
        1 if lab is None else dims[lab] for lab in axes)))
    graph.insert_before(before, Node("Unsqueeze", [v, graph.constant(np.array(new, np.int64),
                                                                     f"{name}_axes")],
                                     [grown], {}, name=f"{name}_unsqueeze", opset=OPSET))
    return grown


RULES = (Rule("einsum-matmul", pattern("Einsum"), _rewrite),)

__all__ = ["einsum_as_matmul"]
