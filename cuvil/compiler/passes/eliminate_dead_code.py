"""Remove nodes none of whose outputs reach a graph output."""

from __future__ import annotations

from cuvil.compiler.ir import Graph, Value


def eliminate_dead_code(graph: Graph) -> Graph:
    live: set[Value] = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(v in live for v in node.outputs):
            kept.append(node)
            live.update(v for v in node.inputs if v is not None)
        else:
            for v in node.inputs:
                if v is not None and node in v.users:
                    v.users.remove(node)
    graph.nodes = kept[::-1]
    return graph
