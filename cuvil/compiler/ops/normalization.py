"""Normalizations: BatchNormalization (inference) and Softmax / LogSoftmax."""

from __future__ import annotations

from typing import ClassVar

from llvmlite import ir

from cuvil.compiler.codegen.emitter import Emitter
from cuvil.compiler.ir import Node, TensorType, numel
from cuvil.compiler.ops import InferContext, Op, normalize_axis, register
from cuvil.errors import ModelError, UnsupportedOpError


@register
class BatchNormalization(Op):
    """y = (x - mean) / sqrt(var + eps) * scale + bias, per channel (axis 1)."""

    op_type = "BatchNormalization"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = node.inputs[0]
        assert x is not None
        if node.attrs.get("training_mode", 0) or len(node.outputs) > 1:
            raise UnsupportedOpError(
                f"{node.describe()}: training-mode BatchNormalization is not supported; "
                "export the model in eval mode"
            )
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input {x.type} needs a channel axis")
        c = x.type.shape[1]
        for i, what in enumerate(("scale", "B", "mean", "var"), start=1):
            v = node.input(i)
            if v is None or v.type.rank != 1:
                raise ModelError(f"{node.describe()}: {what} must be a 1-D tensor of size {c}")
            ctx.dims_equal(node, v.type.shape[0], c, f"{what} size vs channels")
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = node.inputs[0]
        assert x_val is not None
        n, c = x_val.type.shape[:2]
        inner = numel(x_val.type.shape[2:])
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, (n, c, inner))
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, (n, c, inner))
        scale, bias, mean, var = (k.view(node.inputs[i]) for i in range(1, 5))  # type: ignore[arg-type]
        eps = float(node.attrs.get("epsilon", 1e-5))
        b = k.b
        ty = x.elem
        with k.loop(x.dims[1], name="c") as ch:
            # fold the per-channel affine map once: y = x * a + s
            inv = b.fdiv(ir.Constant(ty, 1.0),
                         k.intrinsic("llvm.sqrt", [b.fadd(k.load(var, [ch]), ir.Constant(ty, eps))]))
            a = b.fmul(k.load(scale, [ch]), inv)
            s = b.fsub(k.load(bias, [ch]), b.fmul(k.load(mean, [ch]), a))
            with k.loop(x.dims[0], name="n") as i, k.loop(x.dims[2], name="s") as j:
                v = k.load(x, [i, ch, j])
                k.store(y, [i, ch, j], b.fadd(b.fmul(v, a), s))


class SoftmaxBase(Op):
    log: ClassVar[bool]

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = node.inputs[0]
        assert x is not None
        default = -1 if node.opset >= 13 else 1
        normalize_axis(node, int(node.attrs.get("axis", default)), x.type.rank)
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = node.inputs[0]
        assert x_val is not None
        shape = x_val.type.shape
        rank = len(shape)
        default = -1 if node.opset >= 13 else 1
        axis = normalize_axis(node, int(node.attrs.get("axis", default)), rank)
        # before opset 13 the input is flattened to 2-D at `axis`; from 13 on only `axis` is
        # reduced. Both become [outer, reduced, inner] here.
        if node.opset >= 13:
            dims3 = (numel(shape[:axis]), shape[axis], numel(shape[axis + 1:]))
        else:
            dims3 = (numel(shape[:axis]), numel(shape[axis:]), 1)
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims3)
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, dims3)
        b = k.b
        ty = x.elem
        with k.loop(x.dims[0], name="o") as o, k.loop(x.dims[2], name="in") as j:
            mx = b.alloca(ty)
            b.store(ir.Constant(ty, float("-inf")), mx)
            with k.loop(x.dims[1], name="r") as r:
                b.store(k.fmax(b.load(mx), k.load(x, [o, r, j])), mx)
            m = b.load(mx)
            total = b.alloca(ty)
            b.store(ir.Constant(ty, 0.0), total)
            with k.loop(x.dims[1], name="r") as r:
                e = k.intrinsic("llvm.exp", [b.fsub(k.load(x, [o, r, j]), m)])
                if not self.log:
                    k.store(y, [o, r, j], e)
                b.store(k.fadd_reduce(b.load(total), e), total)
            t = b.load(total)
            if self.log:
                lt = b.fadd(m, k.intrinsic("llvm.log", [t]))
                with k.loop(x.dims[1], name="r") as r:
                    k.store(y, [o, r, j], b.fsub(k.load(x, [o, r, j]), lt))
            else:
                inv = b.fdiv(ir.Constant(ty, 1.0), t)
                with k.loop(x.dims[1], name="r") as r:
                    k.store(y, [o, r, j], b.fmul(k.load(y, [o, r, j]), inv))


@register
class Softmax(SoftmaxBase):
    op_type = "Softmax"
    log = False


@register
class LogSoftmax(SoftmaxBase):
    op_type = "LogSoftmax"
    log = True
