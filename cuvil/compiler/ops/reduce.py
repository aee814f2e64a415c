"""Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL1, ReduceL2,
ReduceLogSum, ReduceLogSumExp and ReduceSumSquare.

The input's axes are merged into alternating groups of kept and reduced axes (size-1 axes
dropped), so any reduction is a walk over a few contiguous blocks. When the innermost group
is reduced, each output element sums a contiguous run in a register (reassociated, so it
vectorizes). When the innermost group is kept, a tile of outputs is accumulated side by
side on the stack, so the inner loop runs over contiguous inputs and contiguous accumulators
without reassociating anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, simplify_dim
from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import REDUCE_FLAGS, Emitter, View, llvm_type
from cuvil.compiler.ops import (
    FLOATS,
    InferContext,
    Op,
    attr,
    const_input,
    normalize_axis,
    register,
    required_input,
)
from cuvil.errors import ModelError

__all__ = ["TILE", "Reducer", "binary_intrinsic", "emit_reduce", "entry_alloca", "interleave",
           "split_groups", "stack_array", "tile_width", "tiles", "vexp"]

#: outputs accumulated side by side when the innermost axis is kept
TILE = 256


# -- helpers shared with the normalization ops --------------------------------------------


def entry_alloca(k: Emitter, ty: ir.Type, count: int = 1, name: str = "") -> ir.Value:
    """Stack memory allocated once in the entry block (so LLVM promotes scalars to registers;
    an alloca inside a loop would grow the stack on every iteration)."""
    with k.b.goto_block(k.function.entry_basic_block):
        return k.b.alloca(ty, size=None if count == 1 else ir.Constant(ir.IntType(64), count),
                          name=name)


def binary_intrinsic(k: Emitter, name: str, a: ir.Value, b: ir.Value) -> ir.Value:
    """A two-operand LLVM intrinsic such as llvm.maximum (`Emitter.intrinsic` declares
    one-operand ones)."""
    fn = k.module.declare_intrinsic(name, [a.type], ir.FunctionType(a.type, [a.type, a.type]))
    return k.b.call(fn, [a, b])


def vexp(k: Emitter, x: ir.Value) -> ir.Value:
    """exp written with arithmetic only (`vecmath`), so loops around it vectorize; a libm
    call per element would keep them scalar."""
    return vecmath.exp(k.b, x)


def tile_width(inner: Dim) -> int:
    """Lanes per tile over an inner extent: all of it when it is static and small."""
    return inner if isinstance(inner, int) and 0 < inner <= TILE else TILE


def stack_array(k: Emitter, dtype: np.dtype | str, width: int, name: str) -> View:
    """A 1-D array of `width` elements on the stack (allocated once in the entry block)."""
    dtype = np.dtype(dtype)
    ptr = entry_alloca(k, llvm_type(dtype), width, name=name)
    return View(ptr, dtype, (k.i64(width),), (k.i64(1),), (width,))


@contextmanager
def tiles(k: Emitter, inner: Dim, name: str = "t") -> Iterator[tuple[ir.Value, ir.Value]]:
    """(start, count) of each tile of `inner` lanes; a single tile without a loop when the
    extent is static and fits (so LLVM sees constant trip counts)."""
    width = tile_width(inner)
    if isinstance(inner, int) and inner == width:
        yield k.i64(0), k.i64(width)
        return
    b = k.b
    stop = k.dim(inner)
    with k.loop(stop, step=width, name=name) as t:
        rest = b.sub(stop, t)
        yield t, b.select(b.icmp_signed("<", rest, k.i64(width)), rest, k.i64(width))


def split_groups(shape: Sequence[Dim], axes: set[int]) -> list[tuple[Dim, bool]]:
    """`shape` as merged groups (size, reduced?): neighbours of the same kind are merged and
    static size-1 axes dropped, so a row-major tensor is a row-major tensor of the groups."""
    groups: list[tuple[Dim, bool]] = []
    for a, d in enumerate(shape):
        if isinstance(d, int) and d == 1:
            continue
        red = a in axes
        if groups and groups[-1][1] == red:
            groups[-1] = (simplify_dim(groups[-1][0] * d), red)
        else:
            groups.append((d, red))
    return groups


def interleave(groups: Sequence[tuple[Dim, bool]], kept: Sequence[ir.Value],
               reduced: Sequence[ir.Value]) -> list[ir.Value]:
    """The full group index from the kept and the reduced indices, in group order."""
    ki, ri = iter(kept), iter(reduced)
    return [next(ri) if red else next(ki) for _, red in groups]


def _minmax_identity(dtype: np.dtype, want_max: bool) -> float | int:
    if dtype.kind == "f":
        return float("-inf") if want_max else float("inf")
    if dtype.kind == "b":
        return 0 if want_max else 1
    info = np.iinfo(dtype)
    return int(info.min) if want_max else int(info.max)


# -- what each reduction computes ---------------------------------------------------------


@dataclass(frozen=True)
class Reducer:
    """acc = combine over the reduced elements of pre(x); y = post(acc).

    combine: "sum" | "prod" | "max" | "min" | "lse" (log-sum-exp, two passes);
    pre: "id" | "abs" | "square"; post: "id" | "mean" | "sqrt" | "log".
    """

    combine: str
    pre: str = "id"
    post: str = "id"
    #: integer inputs accumulate in float64 (sqrt, log and exp need a float)
    float_acc: bool = False

    def acc_dtype(self, dtype: np.dtype) -> np.dtype:
        if dtype.kind == "f":
            # float16 accumulates in float32, as onnxruntime does
            return np.dtype(np.float64) if dtype.itemsize == 8 else np.dtype(np.float32)
        if self.float_acc or self.combine == "lse":
            return np.dtype(np.float64)
        return dtype

    def identity(self, acc: np.dtype) -> float | int:
        if self.combine in ("sum",):
            return 0
        if self.combine == "prod":
            return 1
        return _minmax_identity(acc, self.combine in ("max", "lse"))

    def prepare(self, k: Emitter, x: ir.Value, dtype: np.dtype, acc: np.dtype) -> ir.Value:
        v = k.convert(x, dtype, acc)
        if self.pre == "abs":
            if acc.kind == "f":
                return k.intrinsic("llvm.fabs", [v])
            if acc.kind == "i":
                return k.b.select(k.b.icmp_signed("<", v, ir.Constant(v.type, 0)), k.b.neg(v), v)
        return v

    def step(self, k: Emitter, acc: ir.Value, v: ir.Value, acc_dtype: np.dtype) -> ir.Value:
        """One reduction step (the first pass of lse is a max)."""
        f = acc_dtype.kind == "f"
        b = k.b
        if self.combine == "sum":
            if self.pre == "square":
                return k.fmul_add(v, v, acc) if f else b.add(acc, b.mul(v, v))
            return k.fadd_reduce(acc, v) if f else b.add(acc, v)
        if self.combine == "prod":
            if not f:
                return b.mul(acc, v)
            m = b.fmul(acc, v)
            m.flags.extend(REDUCE_FLAGS)
            return m
        want_max = self.combine in ("max", "lse")
        if f:
            # IEEE maximum/minimum: a NaN anywhere makes the result NaN, as in onnxruntime
            return binary_intrinsic(k, "llvm.maximum" if want_max else "llvm.minimum", acc, v)
        return k.maximum(acc_dtype, acc, v) if want_max else k.minimum(acc_dtype, acc, v)

    def finish(self, k: Emitter, acc: ir.Value, count: ir.Value, acc_dtype: np.dtype,
               out: np.dtype) -> ir.Value:
        b = k.b
        if self.post == "mean":
            # an empty reduction has mean 0 in onnxruntime (the sum over a count of at least 1)
            one = k.i64(1)
            count = b.select(b.icmp_signed("<", count, one), one, count)
            if acc_dtype.kind == "f":
                acc = b.fdiv(acc, b.sitofp(count, acc.type))
            else:
                n = b.trunc(count, acc.type) if acc.type.width < 64 else count
                acc = b.udiv(acc, n) if acc_dtype.kind == "u" else b.sdiv(acc, n)
        elif self.post == "sqrt":
            acc = k.intrinsic("llvm.sqrt", [acc])
        elif self.post == "log":
            acc = k.intrinsic("llvm.log", [acc])
        return k.convert(acc, acc_dtype, out)


def lse_shift(k: Emitter, m: ir.Value) -> ir.Value:
    """The max used to shift exponents: 0 when the max is infinite or NaN (so that an all
    -inf or empty input gives -inf rather than NaN)."""
    finite = k.b.fcmp_ordered("<", k.intrinsic("llvm.fabs", [m]), ir.Constant(m.type, float("inf")))
    return k.b.select(finite, m, ir.Constant(m.type, 0.0))


# -- the kernel -----------------------------------------------------------------------------


@contextmanager
def _each(k: Emitter, dims: Sequence[ir.Value], name: str) -> Iterator[list[ir.Value]]:
    with k.loops(list(dims), name=name) as idx:
        yield idx


def emit_reduce(k: Emitter, x_val: Value, out_ptr: ir.Value, out_dtype: np.dtype, axes: set[int],
                red: Reducer) -> None:
    """out[kept...] = red over the axes `axes` of x; out is row-major over the kept axes."""
    dtype = x_val.type.dtype
    acc = red.acc_dtype(dtype)
    acc_ty = llvm_type(acc)
    groups = split_groups(x_val.type.shape, axes)
    x = k.contiguous(k.buffers[x_val], dtype, [d for d, _ in groups])
    kept_dims = [x.dims[i] for i, (_, r) in enumerate(groups) if not r]
    red_dims = [x.dims[i] for i, (_, r) in enumerate(groups) if r]
    out = k.contiguous(out_ptr, out_dtype, [d for d, r in groups if not r])
    count: ir.Value = k.i64(1)
    for d in red_dims:
        count = k.b.mul(count, d)
    init = k.const(acc, red.identity(acc))

    def load(kidx: list[ir.Value], ridx: list[ir.Value]) -> ir.Value:
        return red.prepare(k, k.load(x, interleave(groups, kidx, ridx)), dtype, acc)

    if not groups or groups[-1][1]:
        # innermost group reduced: one register accumulator per output element
        slot = entry_alloca(k, acc_ty, name="acc")
        with _each(k, kept_dims, "k") as kidx:
            k.b.store(init, slot)
            with _each(k, red_dims, "r") as ridx:
                k.b.store(red.step(k, k.b.load(slot), load(kidx, ridx), acc), slot)
            result = k.b.load(slot)
            if red.combine == "lse":
                shift = lse_shift(k, result)
                k.b.store(k.const(acc, 0.0), slot)
                with _each(k, red_dims, "r") as ridx:
                    e = vexp(k, k.b.fsub(load(kidx, ridx), shift))
                    k.b.store(k.fadd_reduce(k.b.load(slot), e), slot)
                result = k.b.fadd(shift, k.intrinsic("llvm.log", [k.b.load(slot)]))
            k.store(out, kidx, red.finish(k, result, count, acc, out_dtype))
        return

    # innermost group kept: accumulate a tile of outputs at once
    inner_dim = [d for d, r in groups if not r][-1]
    width = tile_width(inner_dim)
    tile = stack_array(k, acc, width, "tile")
    tile2 = stack_array(k, acc, width, "tile_sum") if red.combine == "lse" else None
    b = k.b
    with _each(k, kept_dims[:-1], "k") as kidx, tiles(k, inner_dim) as (t, n):

        def sweep(body: Callable[[ir.Value, ir.Value], None]) -> None:
            # body(j, loaded x) over every reduced index and every j of the tile
            with _each(k, red_dims, "r") as ridx, k.loop(n, name="j") as j:
                body(j, load([*kidx, b.add(t, j)], ridx))

        with k.loop(n, name="j0") as j:
            k.store(tile, [j], init)
        sweep(lambda j, v: k.store(tile, [j], red.step(k, k.load(tile, [j]), v, acc)))
        if tile2 is not None:
            with k.loop(n, name="j1") as j:
                k.store(tile, [j], lse_shift(k, k.load(tile, [j])))
                k.store(tile2, [j], k.const(acc, 0.0))

            def add_exp(j: ir.Value, v: ir.Value) -> None:
                e = vexp(k, b.fsub(v, k.load(tile, [j])))
                k.store(tile2, [j], k.fadd_reduce(k.load(tile2, [j]), e))

            sweep(add_exp)
        with k.loop(n, name="j2") as j:
            a = k.load(tile, [j])
            if tile2 is not None:
                a = b.fadd(a, k.intrinsic("llvm.log", [k.load(tile2, [j])]))
            k.store(out, [*kidx, b.add(t, j)], red.finish(k, a, count, acc, out_dtype))


# -- the ops ------------------------------------------------------------------------------


_NUMERIC = (*FLOATS, "int32", "int64", "uint32", "uint64")


class Reduce(Op):
    reducer: ClassVar[Reducer]
    #: from this opset on, axes come as an optional input (and noop_with_empty_axes exists)
    axes_input_since: ClassVar[int] = 18
    dtypes: ClassVar[tuple[str, ...]] = _NUMERIC

    def axes(self, node: Node) -> set[int]:
        x = required_input(node, 0)
        rank = x.type.rank
        if node.opset >= self.axes_input_since:
            arr = const_input(node, 1, "axes")
            raw = [] if arr is None else [int(a) for a in np.asarray(arr).reshape(-1)]
            noop = bool(attr(node, "noop_with_empty_axes"))
        else:
            if node.input(1) is not None:
                raise ModelError(f"{node.describe()}: {node.op_type} takes axes as an attribute "
                                 f"before opset {self.axes_input_since}; this node has a second input")
            raw = [int(a) for a in node.attrs.get("axes", [])]
            noop = False
        if not raw:
            return set() if noop else set(range(rank))
        axes = {normalize_axis(node, a, rank) for a in raw}
        if len(axes) != len(raw):
            raise ModelError(f"{node.describe()}: axes {raw} name an axis twice")
        return axes

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        axes = self.axes(node)
        keep = bool(attr(node, "keepdims"))
        shape = [1 if a in axes else d for a, d in enumerate(x.type.shape)
                 if keep or a not in axes]
        return [TensorType(x.type.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        y = node.outputs[0]
        emit_reduce(k, x, k.buffers[y], y.type.dtype, self.axes(node), self.reducer)


@register
class ReduceSum(Reduce):
    op_type = "ReduceSum"
    reducer = Reducer("sum")
    axes_input_since = 13


@register
class ReduceMean(Reduce):
    op_type = "ReduceMean"
    reducer = Reducer("sum", post="mean")


@register
class ReduceMax(Reduce):
    op_type = "ReduceMax"
    reducer = Reducer("max")
    dtypes = (*_NUMERIC, "int8", "uint8", "bool")


@register
class ReduceMin(Reduce):
    op_type = "ReduceMin"
    reducer = Reducer("min")
    dtypes = (*_NUMERIC, "int8", "uint8", "bool")


@register
class ReduceProd(Reduce):
    op_type = "ReduceProd"
    reducer = Reducer("prod")


@register
class ReduceL1(Reduce):
    op_type = "ReduceL1"
    reducer = Reducer("sum", pre="abs")


@register
class ReduceL2(Reduce):
    op_type = "ReduceL2"
    reducer = Reducer("sum", pre="square", post="sqrt", float_acc=True)


@register
class ReduceLogSum(Reduce):
    op_type = "ReduceLogSum"
    reducer = Reducer("sum", post="log")
    # integer inputs have no defined meaning (onnx drops them from the schema in opset 28)
    dtypes = FLOATS


@register
class ReduceLogSumExp(Reduce):
    op_type = "ReduceLogSumExp"
    reducer = Reducer("lse")
    dtypes = FLOATS


@register
class ReduceSumSquare(Reduce):
    op_type = "ReduceSumSquare"
    reducer = Reducer("sum", pre="square")
