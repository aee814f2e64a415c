"""Store the constant weights of integer products in the int8 GEMM kernel's packed layout
(kernels/int8_gemm.py `pack_b_int8`), so they run on it (ops/quantize.py).

- MatMulInteger and QLinearMatMul with a constant 2-D B ([K, N]) and a per-tensor a zero point;
- ConvInteger and QLinearConv of one group with constant weights [M, C, kernel...]: B is the
  weight as [taps * C, M] (channels last), the product of the image's columns [P, taps * C]
  with it.

The weight's zero point is folded into the blob; the node's `INT8_PACKED` attribute keeps the
weight's ONNX dtype and shape for its shape rule. The kernel writes int32 sums, or for the
QLinear ops (float32 scales) the requantized bytes from its epilogue (ops/quantize.py).
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.kernels.int8_gemm import pack_b_int8
from cuvil.compiler.ops.quantize import INT8_PACKED, weight_slot

__all__ = ["pack_int8_weights"]

PRODUCTS = ("MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv")


def _const(v: Value | None) -> np.ndarray | None:
    return v.const if v is not None and v.const is not None else None


def _matrix(node: Node, w: np.ndarray) -> np.ndarray | None:
    """B[K, N] of the product, or None when the kernel does not take it."""
    if node.op_type.endswith("MatMul") or node.op_type == "MatMulInteger":
        a = node.inputs[0]
        if w.ndim != 2 or a is None or a.type.rank < 2:
            return None
        return w
    if int(node.attrs.get("group", 1)) != 1:
        return None
    # K in (kernel..., C) order: a column row is then runs of whole channels (ops/quantize.py)
    return np.ascontiguousarray(np.moveaxis(w, 1, -1).reshape(w.shape[0], -1).T)


def pack_int8_weights(graph: Graph) -> Graph:
    for node in graph.nodes:
        if node.op_type not in PRODUCTS or node.domain or INT8_PACKED in node.attrs:
            continue
        slot = weight_slot(node)
        w_val = node.inputs[slot]
        w = _const(w_val)
        zero_slot = slot + 2  # B's (the weight's) zero point
        zero_val = node.input(zero_slot)
        zero = _const(zero_val)
        a_zero = node.input(2)
        if (w is None or w_val is None or (zero_val is not None and zero is None)
                or (a_zero is not None and a_zero.type.numel != 1)):
            continue
        b = _matrix(node, w)
        if b is None:
            continue
        packed = pack_b_int8(b, zero if zero is not None else 0)
        graph.set_input(node, slot, graph.constant(packed.data, f"{w_val.name}_int8_panels"))
        node.attrs = {**node.attrs,
                      INT8_PACKED: [w.dtype.name, int(packed.row_sums), *w.shape]}
    return graph
