"""Recognize scaled dot-product attention and compile it as cuvil's Attention node
(ops/attention.py): one parallel loop over blocks of query rows instead of a loop per step
over the whole scores tensor.

The pattern, anchored on the second product, in float32:

    scores = MatMul(q, k_t)
    scores = Mul(scores, c) or Div(scores, c)     optional; c a constant of one element
    scores = Add(scores, mask) or Add(mask, scores)  optional; mask broadcasts to scores
    probs  = Softmax(scores) over the last axis
    out    = MatMul(probs, v)

as torch's exports, onnxruntime's contrib Attention (cuvil expands it so) and Hugging Face's
encoders write it. Every intermediate must be read by the next step alone and not be a graph
output; the heads may be any batch dims that broadcast. A Transpose that makes q, k_t or v, or
that reads the result, and keeps the last axis last (the heads split from and merged into
[b, s, h, d]) is folded into the node: it reads and writes through strides instead.
"""

from __future__ import annotations

from cuvil.compiler.ir import Graph, Node
from cuvil.compiler.ops import attr
from cuvil.compiler.ops.attention import K_T, OUT, PERMS, SCALE, SCALE_OP, Q, V
from cuvil.compiler.passes.rewrite import Rule, apply_rules, pattern, producer, scalar_operand

_MATMUL = pattern("MatMul", where=lambda n: all(v is not None and v.type.rank >= 2
                                                for v in n.inputs[:2]))
_SCALE = pattern("Mul", "Div")
_ADD = pattern("Add")
_SOFTMAX = pattern("Softmax")
_TRANSPOSE = pattern("Transpose")


def _last_axis_softmax(node: Node) -> bool:
    rank = node.outputs[0].type.rank
    axis = int(attr(node, "axis", -1 if node.opset >= 13 else 1))
    return axis in (-1, rank - 1)


def fuse_attention(graph: Graph) -> Graph:
    return apply_rules(graph, RULES)


def recognize_attention(graph: Graph, second: Node) -> Node | None:
    probs, v = second.inputs[0], second.inputs[1]
    softmax = producer(graph, probs, _SOFTMAX, second)
    if softmax is None or not _last_axis_softmax(softmax):
        return None
    inner = [softmax]
    scores = softmax.inputs[0]
    mask = None
    add = producer(graph, scores, _ADD, softmax)
    if add is not None:
        # the scores: the operand of the sum's own shape that the steps before made (a mask
        # may have that shape too)
        found = [(x, m) for x, m in (add.inputs, add.inputs[::-1])
                 if x is not None and m is not None and x.type.shape == add.outputs[0].type.shape
                 and (producer(graph, x, _SCALE, add) or producer(graph, x, _MATMUL, add))]
        if not found:
            return None
        inner.append(add)
        scores, mask = found[0]
    scale = None
    scaling = producer(graph, scores, _SCALE, inner[-1])
    if scaling is not None:
        x, c = scaling.inputs[0], scalar_operand(scaling.inputs[1])
        if c is None and scaling.op_type == "Mul":  # the constant first
            x, c = scaling.inputs[1], scalar_operand(scaling.inputs[0])
        if c is not None and x is not None and x.type.shape == scaling.outputs[0].type.shape:
            inner.append(scaling)
            scores, scale = x, (scaling.op_type, c)
    first = producer(graph, scores, _MATMUL, inner[-1])
    if first is None or v is None:
        return None
    q, k_t = first.inputs[0], first.inputs[1]
    head = q.type.shape[-1] if q is not None else 0
    # an empty sum (d = 0) leaves the kernel's scores unwritten: such a product stays unfused
    if not (isinstance(head, int) and head > 0) or (
            mask is not None and mask.type.rank > first.outputs[0].type.rank):
        return None
    attrs = {SCALE_OP: scale[0], SCALE: scale[1]} if scale is not None else {}
    fused = Node("Attention", [q, k_t, v, mask] if mask is not None else [q, k_t, v], [], attrs,
                 name=second.name, domain="cuvil", opset=1)
    graph.replace_node(second, fused)
    graph.remove_nodes([*inner, first])
    _fold_transposes(graph, fused)
    return fused


def _row_preserving(node: Node | None) -> tuple[int, ...] | None:
    """The perm of a Transpose that keeps the last axis last (rows stay contiguous)."""
    if node is None or node.op_type != "Transpose" or node.domain:
        return None
    rank = node.outputs[0].type.rank
    perm = tuple(int(a) for a in attr(node, "perm", list(range(rank))[::-1]))
    return perm if rank >= 2 and perm[-1] == rank - 1 else None


def _fold_transposes(graph: Graph, node: Node) -> None:
    """The Transposes that split heads into q, k_t, v and merge them after (each the only
    reader or writer of what it moves) become the node's strides (ops/attention.py PERMS)."""
    perms: list[tuple[int, ...] | None] = [None] * 4
    for slot in (Q, K_T, V):
        transpose = producer(graph, node.inputs[slot], _TRANSPOSE, node)
        perms[slot] = _row_preserving(transpose)
        if transpose is not None and perms[slot] is not None:
            graph.set_input(node, slot, transpose.inputs[0])
            graph.remove_nodes([transpose])
    out = node.outputs[0]
    if len(out.users) == 1 and out not in graph.outputs and out.users[0] in graph.nodes:
        perms[OUT] = _row_preserving(out.users[0])
        if perms[OUT] is not None:
            graph.absorb(node, out.users[0])
    if any(p is not None for p in perms):
        node.attrs[PERMS] = tuple(perms)


RULES = (Rule("attention", _MATMUL, recognize_attention),)
