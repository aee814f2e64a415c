"""Remove nodes none of whose outputs reach a graph output."""

from __future__ import annotations

from cuvil.compiler.ir import Graph, Node, Value


def eliminate_dead_code(graph: Graph) -> Graph:
    live: set[Value] = set(graph.outputs)
    dead: list[Node] = []
    for node in reversed(graph.nodes):
        if any(v in live for v in node.outputs):
            live.update(v for v in node.inputs if v is not None)
        else:
            dead.append(node)
    graph.remove_nodes(dead)
    return graph
