"""precision = "bf16": the constant weights of float32 products that run on the GEMM kernel
stored as bfloat16 in the bf16 kernel's layouts (kernels/bf16_gemm.py), so that those
products compute in bf16 with float32 sums where the CPU has AMX or AVX-512 BF16, and in
float32 on the same weights elsewhere (float32 panels derived from them at the first run).

Runs last, on the weights pack_gemm_weights and fully_connected_convs packed for the float
kernel (`PACKED_WEIGHTS`): Conv weights become `pack_l` per group, Gemm and MatMul weights
`pack_r`, and so do the W^T of convolutions over small maps, whose products run transposed
(`TRANSPOSED`: on the bf16 kernel's side "bt", 7x7 maps 1.2x faster than W @ X', which wastes
15 of 64 lanes on 49 positions). Winograd F(2x2) convolutions of small images store their
transformed weights U^T in bf16 instead of the 3x3 kernels (ops/_conv_winograd.py
`runs_in_bf16`, `bf16_weight_transform`: their point products run on the bf16 kernel); other
Winograd ones, depthwise convolutions (whose kernel reads float32 weights) and products of two
activations stay float32. The packed bits are stored as a float32-typed 1-D constant (two bf16
per element, so dtype checks hold); the node's `BF16_WEIGHTS` attribute keeps the weight's
shape for its shape rule (ops/gemm.py `logical_weight`).
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node
from cuvil.compiler.kernels.bf16_gemm import pack_l, pack_r
from cuvil.compiler.kernels.gemm import PACK_COLS, PACK_ROWS
from cuvil.compiler.ops.conv import (
    TRANSPOSED,
    U_STORED,
    WINOGRAD_TILE,
    bf16_weight_transform,
    runs_in_bf16,
)
from cuvil.compiler.ops.gemm import BF16_WEIGHTS, PACKED_WEIGHTS


def bf16_weights(graph: Graph) -> Graph:
    if graph.precision != "bf16":
        return graph
    for node in graph.nodes:
        if node.op_type == "Conv" and WINOGRAD_TILE in node.attrs and runs_in_bf16(node):
            _store(graph, node, bf16_weight_transform(node))
            node.attrs = {key: value for key, value in node.attrs.items() if key != U_STORED}
            continue
        if (node.op_type not in ("Conv", "Gemm", "MatMul") or node.domain
                or not node.attrs.get(PACKED_WEIGHTS) or node.attrs.get("transB", 0)
                or node.outputs[0].type.dtype != np.float32):
            continue
        w = node.inputs[1]
        assert w is not None and w.const is not None and w.const.dtype == np.float32
        if node.op_type == "Conv" and node.attrs.get(TRANSPOSED):
            packed = pack_r(unpack_b(w.const.reshape(-1, w.const.shape[0])))
        elif node.op_type == "Conv":
            group = int(node.attrs.get("group", 1))
            mats = w.const.reshape(group, w.const.shape[0] // group, -1)
            packed = np.stack([pack_l(unpack_a(m)) for m in mats])
        else:
            packed = pack_r(unpack_b(w.const.reshape(w.const.shape[-2:])))
        _store(graph, node, packed)
        node.attrs = {key: value for key, value in node.attrs.items() if key != PACKED_WEIGHTS}
    return graph


def _store(graph: Graph, node: Node, packed: np.ndarray) -> None:
    """The node's weight replaced by the packed bf16 bits; `BF16_WEIGHTS` keeps its shape."""
    w = node.inputs[1]
    assert w is not None
    graph.set_input(node, 1, graph.constant(packed.reshape(-1).view(np.float32),
                                            f"{w.name}_bf16"))
    node.attrs = {**node.attrs, BF16_WEIGHTS: tuple(int(d) for d in w.type.shape)}


def unpack_a(packed: np.ndarray) -> np.ndarray:
    """The [M, K] matrix kernels.gemm.pack_a stored (panels of PACK_ROWS rows)."""
    m = packed.shape[0]
    flat = packed.reshape(-1)
    kk = flat.size // max(m, 1)
    rows, at = [], 0
    for i in range(0, m, PACK_ROWS):
        h = min(PACK_ROWS, m - i)
        rows.append(flat[at:at + h * kk].reshape(kk, h).T)
        at += h * kk
    return np.concatenate(rows) if rows else packed.reshape(m, kk)


def unpack_b(packed: np.ndarray) -> np.ndarray:
    """The [K, N] matrix kernels.gemm.pack_b stored (panels of PACK_COLS columns)."""
    kk, n = packed.shape
    flat = packed.reshape(-1)
    cols, at = [], 0
    for j in range(0, n, PACK_COLS):
        w = min(PACK_COLS, n - j)
        cols.append(flat[at:at + kk * w].reshape(kk, w))
        at += kk * w
    return np.concatenate(cols, axis=1) if cols else packed
