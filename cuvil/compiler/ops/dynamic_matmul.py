"""cuvil's own DynamicQuantizeMatMul: a float32 activation quantized at run time times a
constant int8 weight, float32 out, in one node.

It is what onnxruntime's `quantize_dynamic` writes for every MatMul with a constant B (and
what its contrib DynamicQuantizeMatMul and MatMulIntegerToFloat expand to):

    q, a_scale, a_zero = DynamicQuantizeLinear(x)
    y = float(MatMulInteger(q, B, a_zero, b_zero)) * (a_scale * b_scale) + bias

passes/fuse_dynamic_quantize.py rewrites that chain into this node. The lowering quantizes x
once into scratch (`_dynamic_quantize_kernel`, vectorized), then runs the int8 GEMM kernel
on the weight packed at compile time, whose float32 epilogue scales the int32 sums, adds the
bias, applies an activation passes/fuse_epilogue.py fused (the Gelu after a transformer's
first feed-forward product) and stores y while the tile is in registers: no int32 tensor, no
separate Cast, Mul, Add or activation pass. The arithmetic is that of the chain (the same
float32 products, in the same order).

Inputs: x (float32 [..., K]), B (the packed blob, `INT8_PACKED` as the integer products
have it: [B's dtype, row_sums, K, N]), scale (float32 [N]: b_scale per column), bias
(float32 [N], optional).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, numel
from cuvil.compiler.kernels.emitter import Emitter
from cuvil.compiler.kernels.int8_gemm import QEpilogue, QOperands, emit_parallel_int8_gemm
from cuvil.compiler.ops import InferContext, Op, register, required_input
from cuvil.compiler.ops._dynamic_quantize_kernel import emit_dynamic_quantize
from cuvil.compiler.ops._window import entry_alloca
from cuvil.compiler.ops.gemm import ACTIVATION_PARAMS, FUSED_ACTIVATION
from cuvil.compiler.ops.quantize import INT8_PACKED
from cuvil.errors import ModelError

__all__ = ["DynamicQuantizeMatMul"]


@register
class DynamicQuantizeMatMul(Op):
    op_type = "DynamicQuantizeMatMul"
    domain = "cuvil"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        kk, n = (int(d) for d in node.attrs[INT8_PACKED][-2:])
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: x must be [..., K], not {x.type}")
        ctx.dims_equal(node, x.type.shape[-1], kk, "x's last dim vs the weight's rows")
        for slot in (2, 3):
            v = node.input(slot)
            if v is not None and (v.type.dtype.name != "float32" or v.type.numel != n):
                raise ModelError(f"{node.describe()}: input {slot} must be float32 [{n}], "
                                 f"not {v.type}")
        return [TensorType(np.dtype("float32"), (*x.type.shape[:-1], n))]

    def scratch_bytes(self, node: Node) -> Dim:
        return required_input(node, 0).type.numel  # x quantized, one byte each

    def path(self, node: Node) -> str:
        return "int8 kernel"

    def lower(self, node: Node, k: Emitter) -> None:
        x, y = required_input(node, 0), node.outputs[0]
        _, row_sums, kk, n = node.attrs[INT8_PACKED]
        bias = node.input(3)
        assert k.scratch is not None
        b = k.b
        scale_slot = entry_alloca(k, ir.FloatType(), "a_scale")
        zero_slot = entry_alloca(k, ir.IntType(8), "a_zero")
        emit_dynamic_quantize(k, k.buffers[x], k.dim(x.type.numel), k.scratch, scale_slot,
                              zero_slot)
        activation = node.attrs.get(FUSED_ACTIVATION)
        epilogue = QEpilogue("float32", "float32" if bias is not None else "none",
                             activation=activation,
                             params=tuple(node.attrs.get(ACTIVATION_PARAMS, ())))
        emit_parallel_int8_gemm(
            k, k.dim(numel(x.type.shape[:-1])), k.i64(int(n)), k.i64(int(kk)), k.scratch,
            k.i64(int(kk)), b.zext(b.load(zero_slot), ir.IntType(32)),
            k.buffers[required_input(node, 1)], k.buffers[y], k.i64(int(n)), a_signed=False,
            row_sums=bool(row_sums),
            out=QOperands(epilogue, scale=k.buffers[required_input(node, 2)],
                          a_scale=b.load(scale_slot),
                          bias=k.buffers[bias] if bias is not None else None))
