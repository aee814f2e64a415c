"""Store constant Gemm weights as [K, N] so the product's inner loop reads them contiguously.

PyTorch exports Linear layers as Gemm with transB=1 ([N, K] weights); transposing the constant
once at compile time turns every call's strided reads into unit-stride ones.
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph


def pack_gemm_weights(graph: Graph) -> Graph:
    for node in graph.nodes:
        if node.op_type != "Gemm" or not node.attrs.get("transB", 0):
            continue
        b = node.inputs[1]
        if b is None or b.const is None:
            continue
        graph.set_input(node, 1, graph.constant(np.ascontiguousarray(b.const.T), f"{b.name}_packed"))
        node.attrs = {**node.attrs, "transB": 0}
    return graph
