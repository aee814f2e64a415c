"""Mark the Convs that run as Winograd convolutions.

`ops/_conv_winograd.winograd_tile` decides which Convs qualify (3x3, stride 1, enough
channels and tiles); the node records the tile in `WINOGRAD_TILE`, which Conv's lowering, its
transformed weights (U = G g G^T) and the profiler's label read. With the model's
transformed-weights setting "library" (`Graph.transformed_weights`) the node is also marked
`U_STORED`: the compiler computes U and the library stores it instead of the 3x3 weights;
with "first-run" the library keeps the 3x3 weights and derives U at its first run. Runs after
the passes that edit weights (batch-norm folding), which must leave a marked node's weight as
it is. In a bf16 model the choice weighs bf16 products (passes/bf16_weights.py then stores
the F(2x2) convs' U as bf16, whatever the transformed-weights setting).
"""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.ops.conv import U_STORED, WINOGRAD_TILE, winograd_tile


def winograd_weights(graph: Graph) -> Graph:
    stored = {U_STORED: 1} if graph.transformed_weights == "library" else {}
    for node in graph.nodes:
        m = winograd_tile(node, graph.precision)
        if m is not None:
            node.attrs = {**node.attrs, WINOGRAD_TILE: m, **stored}
    return graph
