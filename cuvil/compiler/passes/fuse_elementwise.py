"""Compute chains of elementwise nodes in one loop (cuvil's Fused, ops/fused.py).

A node joins the chain of the nodes that read its output when it is elementwise
(`Op.fusable`: arithmetic, math and activations, casts, per-tensor and per-axis
Quantize/DequantizeLinear, QuantizedAdd), everything that reads its output is in that one
chain, the output is not a graph output, and it has the shape of the chain's last output (so
that no element is computed twice), up to `MAX_STEPS` nodes. Walking the graph backwards,
each node meets its readers' chains already formed; a chain of two nodes or more becomes one
Fused node in its last node's place. What a chain reads from outside stays in memory; what
it passes between its members never leaves the registers.

Runs after the passes that fuse elementwise ops into products and convolutions
(fuse_epilogue, fuse_qdq's integer products), which take them first.
"""

from __future__ import annotations

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.ops import lookup
from cuvil.compiler.ops.fused import STEPS

#: members of one chain at most: a longer one starts another (the loop body, which LLVM
#: vectorizes and interleaves, stays of a bounded size)
MAX_STEPS = 64


def fuse_elementwise(graph: Graph) -> Graph:
    chain_of: dict[int, list[Node]] = {}  # node -> its chain, the last node first
    for node in reversed(graph.nodes):
        if not _fusable(node):
            continue
        out = node.outputs[0]
        readers = {id(chain_of.get(id(u))) for u in out.users}
        chain = chain_of.get(id(out.users[0])) if out.users else None
        if (chain is not None and readers == {id(chain)} and out not in graph.outputs
                and out.type.shape == chain[0].outputs[0].type.shape
                and len(chain) < MAX_STEPS):
            chain.append(node)
        else:
            chain = [node]
        chain_of[id(node)] = chain
    chains = {id(c): c for c in chain_of.values() if len(c) > 1}
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    for chain in chains.values():
        _replace(graph, sorted(chain, key=lambda n: order[id(n)]))
    return graph


def _fusable(node: Node) -> bool:
    op = lookup(node.domain, node.op_type, node.opset)
    return len(node.outputs) == 1 and op is not None and op.fusable(node)


def _replace(graph: Graph, chain: list[Node]) -> None:
    """One Fused node for `chain` (in graph order), in its last node's place."""
    results = {id(n.outputs[0]): j for j, n in enumerate(chain)}
    inputs: list[Value] = []
    slots: dict[int, int] = {}
    steps = []
    for n in chain:
        refs: list[int | None] = []
        for v in n.inputs:
            if v is None:
                refs.append(None)
            elif id(v) in results:
                refs.append(-results[id(v)] - 1)
            else:
                if id(v) not in slots:
                    slots[id(v)] = len(inputs)
                    inputs.append(v)
                refs.append(slots[id(v)])
        steps.append((n.op_type, n.domain, n.opset, dict(n.attrs), tuple(refs)))
    last = chain[-1]
    fused = Node("Fused", list(inputs), [], {STEPS: tuple(steps)}, name=last.name,
                 domain="cuvil", opset=1)
    graph.replace_node(last, fused)
    graph.remove_nodes(chain[:-1])
