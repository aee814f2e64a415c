"""Fold `Add(MatMul(x, W), bias)` into the MatMul, the bias added in the GEMM kernel's epilogue.

PyTorch exports a Linear layer on a [batch, seq, features] tensor as MatMul then Add of a
[N] bias; the Add would read and write the whole product once more. The MatMul keeps its
operands and gets the bias as input 2, flagged by `FUSED_BIAS` (its lowering adds it per
column of the one GEMM it runs).
"""

from __future__ import annotations

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.ops.gemm import FUSED_BIAS, on_one_gemm


def _bias_of(add: Node, product: Value) -> Value | None:
    """The Add's other operand when it is a constant of one value per column of `product`."""
    other = add.inputs[1] if add.inputs[0] is product else add.inputs[0]
    if other is None or other.const is None or other is product:
        return None
    n = product.type.shape[-1]
    shape = other.type.shape
    if (not isinstance(n, int) or other.type.dtype != product.type.dtype or not shape
            or len(shape) > product.type.rank or shape[-1] != n or any(d != 1 for d in shape[:-1])):
        return None
    return other


def fuse_matmul_bias(graph: Graph) -> Graph:
    for add in list(graph.nodes):
        if add.op_type != "Add" or add.domain or len(add.inputs) != 2:
            continue
        for product in add.inputs:
            matmul = product.producer if product is not None else None
            if (product is None or matmul is None or matmul.op_type != "MatMul" or matmul.domain
                    or matmul not in graph.nodes or FUSED_BIAS in matmul.attrs
                    or not on_one_gemm(matmul) or len(product.users) != 1
                    or product in graph.outputs):
                continue
            kk = matmul.inputs[1].type.shape[-2]  # type: ignore[union-attr]
            bias = _bias_of(add, product)
            # an empty sum (K = 0) would need the bias broadcast without a product
            if bias is None or not (isinstance(kk, int) and kk > 0):
                continue
            if bias.type.rank != 1:
                assert bias.const is not None
                bias = graph.constant(np.ascontiguousarray(bias.const.reshape(-1)),
                                      f"{bias.name}_flat")
            y = add.outputs[0]
            graph.remove_node(add)
            matmul.inputs = [*matmul.inputs[:2], bias]
            bias.users.append(matmul)
            matmul.attrs = {**matmul.attrs, FUSED_BIAS: 1}
            matmul.outputs = [y]
            y.producer = matmul
            product.producer = None
            break
    return graph
