"""Store constant weights of products on the GEMM kernel in the layouts it reads fastest.

- Gemm with transB=1 and constant B ([N, K], how PyTorch exports Linear layers): transposed
  once at compile time to [K, N] (transB=0), so every call reads B's rows contiguously.
- Constant B of a float32 Gemm or MatMul that runs on the kernel (a Linear layer, [K, N]):
  stored as `pack_b` panels, so no call copies B into panels (kernels/gemm.py).
- Constant weights of float32 Conv ([M, C/group, kernel...], the A of each group's product
  W[M/group, K] @ X'): stored as `pack_a` panels per group, so each step of the kernel's K
  loop reads a tile's rows as consecutive floats; those of convs over small maps, whose
  products run transposed (ops/_conv_gemm.py `transposed_product`), as `pack_b` panels of
  W^T [C/group * kernel, M] (the node's `TRANSPOSED` attribute says so; in a bf16 model,
  passes/bf16_weights.py makes the bf16 kernel's panels of them). Not those of Winograd and
  depthwise convolutions, whose kernels read ONNX's layout, nor of convs over 1x1 maps (made
  Gemm by passes/fully_connected_convs.py, which packs them itself).

Packed constants keep their shape (the layouts only reorder elements); the node's
`PACKED_WEIGHTS` attribute tells the lowering (ops/gemm.py, ops/_conv_gemm.py) how to read
them. Both layouts are the same for every CPU variant of a library.
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node
from cuvil.compiler.kernels.gemm import pack_a, pack_b
from cuvil.compiler.ops import UNCHECKED
from cuvil.compiler.ops.conv import (
    TRANSPOSED,
    WINOGRAD_TILE,
    conv_window,
    transposed_product,
    uses_direct_depthwise,
    winograd_tile,
)
from cuvil.compiler.ops.gemm import PACKED_WEIGHTS, on_one_gemm
from cuvil.compiler.passes.fully_connected_convs import is_fully_connected


def pack_gemm_weights(graph: Graph) -> Graph:
    for node in graph.nodes:
        if node.op_type == "Gemm" and node.attrs.get("transB", 0):
            b = node.inputs[1]
            if b is None or b.const is None:
                continue
            graph.set_input(node, 1, graph.constant(np.ascontiguousarray(b.const.T),
                                                    f"{b.name}_packed"))
            node.attrs = {**node.attrs, "transB": 0}
        if node.op_type not in ("Conv", "Gemm", "MatMul") or PACKED_WEIGHTS in node.attrs:
            continue
        w = node.input(1)
        if w is None or w.const is None or w.const.dtype != np.float32 \
                or node.outputs[0].type.dtype != np.float32:
            continue
        if node.op_type == "Conv":
            if runs_off_the_gemm_kernel(node, graph.precision):
                continue
            if transposed_product(node, conv_window(node, UNCHECKED)):
                _set_packed(graph, node, pack_b(w.const.reshape(w.const.shape[0], -1).T))
                node.attrs = {**node.attrs, TRANSPOSED: 1}
                continue
            group = int(node.attrs.get("group", 1))
            mats = w.const.reshape(group, w.const.shape[0] // group, -1)
            _set_packed(graph, node, np.stack([pack_a(m) for m in mats]))
        elif (node.op_type == "Gemm" and _gemm_on_kernel(node)) or \
                (node.op_type == "MatMul" and on_one_gemm(node)):
            _set_packed(graph, node, pack_b(w.const.reshape(w.const.shape[-2:])))
    return graph


def runs_off_the_gemm_kernel(conv: Node, precision: str) -> bool:
    """Winograd and depthwise convolutions read their weights in ONNX's layout; so do convs
    of 1x1 maps, which become Gemm later (passes/fully_connected_convs.py)."""
    return (WINOGRAD_TILE in conv.attrs or winograd_tile(conv, precision) is not None
            or uses_direct_depthwise(conv) or is_fully_connected(conv))


def _gemm_on_kernel(node: Node) -> bool:
    """The Gemm lowering's kernel path: alpha = 1 and A read row by row."""
    return float(node.attrs.get("alpha", 1.0)) == 1.0 and not node.attrs.get("transA", 0)


def _set_packed(graph: Graph, node: Node, data: np.ndarray) -> None:
    w = node.inputs[1]
    assert w is not None and w.const is not None
    graph.set_input(node, 1, graph.constant(data.reshape(w.const.shape), f"{w.name}_panels"))
    node.attrs = {**node.attrs, PACKED_WEIGHTS: 1}
