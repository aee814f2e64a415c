"""Run passes over the bodies of If, Loop and Scan nodes, innermost first.

A body is a graph of its own whose node reads, as extra inputs, the values of enclosing
scopes and the constants the body uses (`SubgraphOp.attach`). Once the passes have rewritten
a body (dead nodes gone, packed constants in, unpacked ones out), the node's captured inputs
are taken again, so that liveness, dead-code elimination and the weights blob of the graph
around it see what the body reads now.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cuvil.compiler.ir import Graph, Node
from cuvil.compiler.ops import lookup
from cuvil.compiler.ops.control import SubgraphOp


def rewrite_bodies(graph: Graph, passes: Sequence[Callable[[Graph], Graph]]) -> Graph:
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset)
        if not isinstance(op, SubgraphOp):
            continue
        for attr in op.graph_attrs:
            body = rewrite_bodies(node.attrs[attr], passes)
            for p in passes:
                body = p(body)
            node.attrs[attr] = body
        _recapture(graph, node, op)
    return graph


def _recapture(graph: Graph, node: Node, op: SubgraphOp) -> None:
    graph.set_inputs(node, [*op.formal(node), *op.captures(node)])
