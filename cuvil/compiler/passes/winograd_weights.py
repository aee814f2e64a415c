"""Mark the Convs that run as Winograd convolutions.

`ops/_conv_winograd.winograd_tile` decides which Convs qualify (3x3, stride 1, enough
channels and tiles); the node records the tile in `WINOGRAD_TILE`, which Conv's lowering, its
derived weights (U = G g G^T, computed at the library's first run from the 3x3 weights the
library keeps) and the profiler's label read. Runs after the passes that edit weights
(batch-norm folding), which must leave a marked node's weight as it is.
"""

from __future__ import annotations

from cuvil.compiler.ir import Graph
from cuvil.compiler.ops.conv import WINOGRAD_TILE, winograd_tile


def winograd_weights(graph: Graph) -> Graph:
    for node in graph.nodes:
        m = winograd_tile(node)
        if m is not None:
            node.attrs = {**node.attrs, WINOGRAD_TILE: m}
    return graph
