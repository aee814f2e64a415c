"""Recognize exact GELU written out as `x * 0.5 * (1 + Erf(x / sqrt(2)))` and make it one Gelu.

PyTorch exports nn.GELU (before opset 20) as Div, Erf, Add, Mul, Mul: five passes over a
tensor as large as a transformer's feed-forward layer. The Gelu node computes the same
formula in one. Accepted spellings: x / sqrt(2) or x * (1 / sqrt(2)); the 0.5 applied to
x * (1 + erf) or to x (or to 1 + erf) first; any operand order.
"""

from __future__ import annotations

import math

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value

#: the opset that defines Gelu (the node gets it whatever the model's opset)
GELU_OPSET = 20


def _scalar(v: Value | None) -> float | None:
    if v is None or v.const is None or v.const.size != 1:
        return None
    return float(np.asarray(v.const).reshape(()))


def _close(x: float | None, want: float) -> bool:
    return x is not None and math.isclose(x, want, rel_tol=1e-6)


def _only(graph: Graph, v: Value, op_type: str) -> Node | None:
    """The node that produces `v` if it is an `op_type` whose output nothing else reads."""
    p = v.producer
    if (p is None or p.op_type != op_type or p.domain or p not in graph.nodes
            or len(v.users) != 1 or v in graph.outputs):
        return None
    return p


def _split(node: Node) -> list[tuple[Value, Value]]:
    """(operand, other operand) pairs of a binary node, both orders."""
    a, b = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    if a is None or b is None:
        return []
    return [(a, b), (b, a)]


def _erf_of_scaled(graph: Graph, v: Value) -> tuple[Value, list[Node]] | None:
    """x when v = Erf(x / sqrt 2) or Erf(x * (1 / sqrt 2)); with the nodes matched."""
    erf = _only(graph, v, "Erf")
    if erf is None or erf.inputs[0] is None:
        return None
    scaled = erf.inputs[0]
    for op_type, want in (("Div", math.sqrt(2.0)), ("Mul", math.sqrt(0.5))):
        node = _only(graph, scaled, op_type)
        if node is None:
            continue
        pairs = _split(node)[:1] if op_type == "Div" else _split(node)
        for x, c in pairs:
            if _close(_scalar(c), want):
                return x, [node, erf]
    return None


def _one_plus_erf(graph: Graph, v: Value) -> tuple[Value, list[Node]] | None:
    """x when v = 1 + Erf(x / sqrt 2), in either order."""
    add = _only(graph, v, "Add")
    if add is None:
        return None
    for e, c in _split(add):
        if _close(_scalar(c), 1.0):
            found = _erf_of_scaled(graph, e)
            if found is not None:
                return found[0], [*found[1], add]
    return None


def _half_of(graph: Graph, v: Value) -> Value | None:
    """u when v = u * 0.5 (or u / 2) and nothing else reads v."""
    for op_type, want in (("Mul", 0.5), ("Div", 2.0)):
        node = _only(graph, v, op_type)
        if node is None:
            continue
        pairs = _split(node)[:1] if op_type == "Div" else _split(node)
        for u, c in pairs:
            if _close(_scalar(c), want):
                return u
    return None


def _match(graph: Graph, out: Node) -> tuple[Value, list[Node]] | None:
    """(x, nodes to remove) when `out` (a Mul or Div) computes GELU(x)."""
    if out.op_type not in ("Mul", "Div") or out.domain:
        return None
    # (x * (1 + erf)) * 0.5, or (1 + erf) * 0.5 * x... : peel the half off the final node
    for u, c in _split(out) if out.op_type == "Mul" else _split(out)[:1]:
        if _close(_scalar(c), 0.5 if out.op_type == "Mul" else 2.0):
            inner = _only(graph, u, "Mul")
            if inner is None:
                continue
            for x, w in _split(inner):
                found = _one_plus_erf(graph, w)
                if found is not None and found[0] is x:
                    return x, [*found[1], inner]
    if out.op_type != "Mul":
        return None
    # (x * 0.5) * (1 + erf) or x * ((1 + erf) * 0.5)
    for p, q in _split(out):
        halved = _half_of(graph, p)
        if halved is not None:
            found = _one_plus_erf(graph, q)
            if found is not None and found[0] is halved:
                return halved, [*found[1], p.producer]  # type: ignore[list-item]
        half = _half_of(graph, q)
        if half is not None:
            found = _one_plus_erf(graph, half)
            if found is not None and found[0] is p:
                return p, [*found[1], q.producer]  # type: ignore[list-item]
    return None


def fuse_gelu(graph: Graph) -> Graph:
    for out in list(graph.nodes):
        if out not in graph.nodes:
            continue
        found = _match(graph, out)
        if found is None:
            continue
        x, inner = found
        y = out.outputs[0]
        if x.type.dtype.kind != "f" or x.type.shape != y.type.shape or x.type.dtype != y.type.dtype:
            continue
        index = graph.nodes.index(out)
        for node in (*inner, out):
            graph.remove_node(node)
        gelu = Node("Gelu", [x], [y], {}, name=out.name or graph.unique_name("gelu"),
                    opset=GELU_OPSET)
        graph.add_node(gelu, index=index - len(inner))
    return graph
