"""Store the weights of the Convs that run as Winograd convolutions already transformed.

`ops/_conv_winograd.winograd_tile` decides which Convs qualify (3x3, stride 1, enough
channels and tiles); for those the constant weight [M, C, 3, 3] becomes U = G g G^T laid out
[alpha^2, M, C] (one GEMM operand per point) and the node records the tile in
`WINOGRAD_TILE`, which Conv's shape rule and lowering read. Runs after the passes that edit
weights (batch-norm folding).
"""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.ops.conv import WINOGRAD_TILE, transform_weights, winograd_tile


def winograd_weights(graph: Graph) -> Graph:
    for node in graph.nodes:
        m = winograd_tile(node)
        w = node.inputs[1] if m is not None else None
        if m is None or w is None or w.const is None:
            continue
        graph.set_input(node, 1, graph.constant(transform_weights(w.const, m), f"{w.name}_winograd"))
        node.attrs = {**node.attrs, WINOGRAD_TILE: m}
    return graph
