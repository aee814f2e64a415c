"""Elementwise ops: binary arithmetic with broadcasting, activations, and identities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, ClassVar

import numpy as np
from llvmlite import ir

from cuvil.compiler.codegen.emitter import Emitter, View
from cuvil.compiler.ir import Dim, Node, TensorType, Value
from cuvil.compiler.ops import InferContext, Op, broadcast_shapes, const_input, register
from cuvil.errors import ModelError


def _collapse(out_shape: Sequence[Dim], in_shapes: Sequence[Sequence[Dim]]) -> list[list[int]]:
    """Group output axes that every operand walks contiguously, so loops can be merged.

    Axes a and a+1 merge when each input either broadcasts along both or along neither.
    Returns the groups of axis indices; axes of size 1 are dropped.
    """
    rank = len(out_shape)
    flags = []
    for shape in in_shapes:
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        flags.append([padded[a] == 1 and out_shape[a] != 1 for a in range(rank)])
    groups: list[list[int]] = []
    for a in range(rank):
        if out_shape[a] == 1:
            continue
        if groups and all(f[groups[-1][-1]] == f[a] for f in flags):
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def emit_elementwise(
    k: Emitter, out: Value, inputs: Sequence[Value],
    fn: Callable[[Emitter, list[ir.Value]], ir.Value],
) -> None:
    """out[i] = fn(inputs[0][i], inputs[1][i], ...) under numpy broadcasting."""
    shape = out.type.shape
    groups = _collapse(shape, [v.type.shape for v in inputs])
    rank = len(shape)

    def merged(value: Value) -> View:
        padded = (1,) * (rank - value.type.rank) + tuple(value.type.shape)
        dims = [_product([padded[a] for a in g]) for g in groups]
        full = [_product([shape[a] for a in g]) for g in groups]
        flat = Value(value.name, TensorType(value.type.dtype, tuple(dims)))
        k.buffers[flat] = k.buffers[value]
        return k.broadcast_to(k.view(flat), full)

    out_view = merged(out)
    in_views = [merged(v) for v in inputs]
    with k.loops(out_view.dims) as idx:
        values = [k.load(v, idx) for v in in_views]
        k.store(out_view, idx, fn(k, values))


def _product(dims: Sequence[Dim]) -> Dim:
    p: Dim = 1
    for d in dims:
        p = p * d
    return p


def _is_float(v: ir.Value) -> bool:
    return isinstance(v.type, (ir.FloatType, ir.DoubleType, ir.HalfType))


class Elementwise(Op):
    """Shape rule shared by elementwise ops: broadcast the inputs, keep input 0's dtype."""

    arity: ClassVar[int] = 1

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        ins = [v for v in node.inputs[: self.arity] if v is not None]
        for v in ins[1:]:
            if v.type.dtype != ins[0].type.dtype:
                raise ModelError(
                    f"{node.describe()}: inputs have different dtypes "
                    f"({ins[0].type.dtype.name} and {v.type.dtype.name})"
                )
        shape = broadcast_shapes(node, ctx, *(v.type.shape for v in ins))
        return [TensorType(ins[0].type.dtype, shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        ins = [v for v in node.inputs[: self.arity] if v is not None]
        emit_elementwise(k, node.outputs[0], ins, lambda k, xs: self.compute(k, node, xs))

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        raise NotImplementedError


# -- binary arithmetic ------------------------------------------------------------------------


class Binary(Elementwise):
    arity = 2
    float_op: ClassVar[str]

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        return getattr(k.b, self.float_op)(xs[0], xs[1])


@register
class Add(Binary):
    op_type = "Add"
    float_op = "fadd"


@register
class Sub(Binary):
    op_type = "Sub"
    float_op = "fsub"


@register
class Mul(Binary):
    op_type = "Mul"
    float_op = "fmul"


@register
class Div(Binary):
    op_type = "Div"
    float_op = "fdiv"


# -- activations ------------------------------------------------------------------------------


@register
class Relu(Elementwise):
    op_type = "Relu"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        return k.fmax(xs[0], k.const(np.float32, 0.0))


@register
class Sigmoid(Elementwise):
    op_type = "Sigmoid"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        one = ir.Constant(xs[0].type, 1.0)
        e = k.intrinsic("llvm.exp", [k.b.fneg(xs[0])])
        return k.b.fdiv(one, k.b.fadd(one, e))


@register
class Tanh(Elementwise):
    op_type = "Tanh"

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        return k.intrinsic("llvm.tanh", xs)


@register
class Clip(Elementwise):
    """Clip: bounds are attributes up to opset 6 and optional constant inputs from 11 on."""

    op_type = "Clip"

    def bounds(self, node: Node) -> tuple[float | None, float | None]:
        if node.opset < 11:
            return node.attrs.get("min"), node.attrs.get("max")
        lo = const_input(node, 1, "min")
        hi = const_input(node, 2, "max")
        return (None if lo is None else float(lo)), (None if hi is None else float(hi))

    def compute(self, k: Emitter, node: Node, xs: list[ir.Value]) -> ir.Value:
        lo, hi = self.bounds(node)
        x = xs[0]
        if lo is not None:
            x = k.fmax(x, ir.Constant(x.type, lo))
        if hi is not None:
            x = k.fmin(x, ir.Constant(x.type, hi))
        return x


# -- identities -------------------------------------------------------------------------------


class Copy(Op):
    """Ops whose output 0 is input 0 unchanged; lowered as a copy when not aliased away."""

    is_view = True
    dtypes = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = node.inputs[0]
        assert x is not None
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        emit_copy(k, node.inputs[0], node.outputs[0])


def emit_copy(k: Emitter, src: Value | None, dst: Value) -> None:
    assert src is not None
    if k.buffers[src] is k.buffers[dst]:
        return
    k.memcpy(k.buffers[dst], k.buffers[src], k.dim(dst.type.nbytes))


@register
class Identity(Copy):
    op_type = "Identity"


@register
class Dropout(Copy):
    """Inference-mode Dropout: the data passes through; the optional mask is all true."""

    op_type = "Dropout"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        training = node.input(2)
        if training is not None and (training.const is None or bool(training.const)):
            raise ModelError(
                f"{node.describe()}: training_mode must be a constant false for inference; "
                "export the model in eval mode"
            )
        x = node.inputs[0]
        assert x is not None
        types = [x.type]
        if len(node.outputs) > 1:
            types.append(TensorType(np.bool_, x.type.shape))
        return types

    def lower(self, node: Node, k: Emitter) -> None:
        emit_copy(k, node.inputs[0], node.outputs[0])
        if len(node.outputs) > 1:
            mask = node.outputs[1]
            k.memset(k.buffers[mask], 1, k.dim(mask.type.nbytes))
