"""Pooling: MaxPool, AveragePool and the global variants, over any number of spatial dims."""

from __future__ import annotations

from typing import ClassVar

from llvmlite import ir

from cuvil.compiler.codegen.emitter import Emitter
from cuvil.compiler.ir import Node, TensorType
from cuvil.compiler.ops import UNCHECKED, InferContext, Op, register
from cuvil.compiler.ops._window import Window, window
from cuvil.errors import ModelError, UnsupportedOpError


def _pool_window(node: Node, ctx: InferContext) -> Window:
    x = node.inputs[0]
    assert x is not None
    if "kernel_shape" not in node.attrs:
        raise ModelError(f"{node.describe()}: the kernel_shape attribute is required")
    return window(node, ctx, x.type.shape[2:], node.attrs["kernel_shape"],
                  ceil_mode=bool(node.attrs.get("ceil_mode", 0)))


class Pool(Op):
    kind: ClassVar[str]  # "max" | "avg"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = node.inputs[0]
        assert x is not None
        if x.type.rank < 3:
            raise ModelError(f"{node.describe()}: input {x.type} must be N x C x spatial...")
        if len(node.outputs) > 1:
            raise UnsupportedOpError(f"{node.describe()}: the Indices output is not supported")
        win = _pool_window(node, ctx)
        return [TensorType(x.type.dtype, (*x.type.shape[:2], *win.out))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = node.inputs[0]
        assert x_val is not None
        win = _pool_window(node, UNCHECKED)
        x, y = k.view(x_val), k.view(node.outputs[0])
        b = k.b
        r = len(win.kernel)
        count_pad = bool(node.attrs.get("count_include_pad", 0))
        ty = x.elem
        with k.loops(y.dims[:2], name="nc") as nc, k.loops(y.dims[2:], name="o") as o:
            start = [b.sub(b.mul(o[a], k.i64(win.strides[a])), k.dim(win.pads_begin[a]))
                     for a in range(r)]
            acc = k.b.alloca(ty)  # promoted to a register by LLVM
            cnt = k.b.alloca(ir.IntType(64))
            b.store(ir.Constant(ty, float("-inf") if self.kind == "max" else 0.0), acc)
            b.store(k.i64(0), cnt)
            with k.loops(win.kernel, name="kp") as kp:
                i = [b.add(start[a], b.mul(kp[a], k.i64(win.dilations[a]))) for a in range(r)]
                inside = ir.Constant(ir.IntType(1), 1)
                for a in range(r):
                    inside = b.and_(inside, b.and_(b.icmp_signed(">=", i[a], k.i64(0)),
                                                   b.icmp_signed("<", i[a], x.dims[2 + a])))
                if count_pad:
                    # padded positions count when they lie within the padded input
                    padded = ir.Constant(ir.IntType(1), 1)
                    for a in range(r):
                        hi = b.add(x.dims[2 + a], k.dim(win.pads_end[a]))
                        padded = b.and_(padded, b.icmp_signed("<", i[a], hi))
                    with k.if_then(padded):
                        b.store(b.add(b.load(cnt), k.i64(1)), cnt)
                with k.if_then(inside):
                    v = k.load(x, [*nc, *i])
                    cur = b.load(acc)
                    b.store(k.fmax(cur, v) if self.kind == "max" else b.fadd(cur, v), acc)
                    if not count_pad:
                        b.store(b.add(b.load(cnt), k.i64(1)), cnt)
            result = b.load(acc)
            if self.kind == "avg":
                result = b.fdiv(result, b.sitofp(b.load(cnt), ty))
            k.store(y, [*nc, *o], result)


@register
class MaxPool(Pool):
    op_type = "MaxPool"
    kind = "max"


@register
class AveragePool(Pool):
    op_type = "AveragePool"
    kind = "avg"


class GlobalPool(Op):
    kind: ClassVar[str]

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = node.inputs[0]
        assert x is not None
        if x.type.rank < 3:
            raise ModelError(f"{node.describe()}: input {x.type} must be N x C x spatial...")
        return [TensorType(x.type.dtype, (*x.type.shape[:2], *([1] * (x.type.rank - 2))))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = node.inputs[0]
        assert x_val is not None
        n, c = x_val.type.shape[:2]
        spatial = x_val.type.numel / (n * c)
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, (n * c, spatial))
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, (n * c,))
        b = k.b
        ty = x.elem
        with k.loop(x.dims[0], name="nc") as i:
            acc = b.alloca(ty)
            b.store(ir.Constant(ty, float("-inf") if self.kind == "max" else 0.0), acc)
            with k.loop(x.dims[1], name="s") as s:
                v = k.load(x, [i, s])
                cur = b.load(acc)
                b.store(k.fmax(cur, v) if self.kind == "max" else k.fadd_reduce(cur, v), acc)
            result = b.load(acc)
            if self.kind == "avg":
                result = b.fdiv(result, b.sitofp(x.dims[1], ty))
            k.store(y, [i], result)


@register
class GlobalAveragePool(GlobalPool):
    op_type = "GlobalAveragePool"
    kind = "avg"


@register
class GlobalMaxPool(GlobalPool):
    op_type = "GlobalMaxPool"
    kind = "max"
