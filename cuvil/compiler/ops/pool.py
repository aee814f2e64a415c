"""Pooling over any number of spatial dims: MaxPool (with its Indices output), AveragePool,
LpPool, the global variants GlobalMaxPool, GlobalAveragePool and GlobalLpPool, MaxRoiPool,
and MaxUnpool.

float16 is computed in float32 and rounded once per output. Each output's window is walked
over its in-bounds kernel positions only (computed per axis), so padding costs no branches;
2-D pools compute the inner columns of an output row (all taps inside the input row) in
vector passes over the row instead (`_vector_row` for unit strides, `_strided_row` else);
a padded integer MaxPool without Indices goes tap by tap along rows instead (measured 2.3x
faster for 3x3/2 with padding 1; 40x slower than the window walk without padding, which
LLVM unrolls and vectorizes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, numel, simplify_dim
from cuvil.compiler.kernels.emitter import (
    I64,
    Emitter,
    View,
    llvm_type,
    masked_intrinsic,
    splat,
    store_lanes,
)
from cuvil.compiler.ops import (
    FLOATS,
    UNCHECKED,
    InferContext,
    Op,
    attr,
    compute_dtype,
    const_or_symbolic_input,
    register,
    required_input,
)
from cuvil.compiler.ops._window import (
    Window,
    ceil_div,
    clamp,
    entry_alloca,
    kernel_range,
    window,
)
from cuvil.compiler.ops.conv import _walk_taps
from cuvil.errors import ModelError


def _pool_window(node: Node, ctx: InferContext) -> Window:
    x = required_input(node, 0)
    if "kernel_shape" not in node.attrs:
        raise ModelError(f"{node.describe()}: the kernel_shape attribute is required")
    return window(node, ctx, x.type.shape[2:], node.attrs["kernel_shape"],
                  ceil_mode=bool(attr(node, "ceil_mode")))


def _lp_order(node: Node) -> float:
    p = attr(node, "p")
    if p <= 0:
        raise ModelError(f"{node.describe()}: p = {p} must be positive")
    return float(p)


def _check_input(op: Op, node: Node) -> TensorType:
    op.check_dtypes(node)
    x = required_input(node, 0)
    if x.type.rank < 3:
        raise ModelError(f"{node.describe()}: input {x.type} must be N x C x spatial...")
    return x.type


class _Reduction:
    """How a pool folds its window: start value, step, and the final value from the count."""

    def __init__(self, k: Emitter, kind: str, dtype: np.dtype, p: float = 2.0) -> None:
        self.k, self.kind, self.dtype, self.p = k, kind, np.dtype(dtype), p
        self.ty = llvm_type(dtype)

    def initial(self) -> ir.Value:
        if self.kind != "max":
            return ir.Constant(self.ty, 0.0)
        if self.dtype.kind == "f":
            return ir.Constant(self.ty, float("-inf"))
        return ir.Constant(self.ty, int(np.iinfo(self.dtype).min))

    def step(self, acc: ir.Value, v: ir.Value, reassoc: bool = False) -> ir.Value:
        k = self.k
        if self.kind == "max":
            return k.maximum(self.dtype, acc, v)
        if self.kind == "lp":
            v = self._power(v)
        return k.fadd_reduce(acc, v) if reassoc else k.b.fadd(acc, v)

    def _power(self, v: ir.Value) -> ir.Value:
        k = self.k
        if self.p == 2.0:
            return k.b.fmul(v, v)
        a = k.intrinsic("llvm.fabs", [v])
        if self.p == 1.0:
            return a
        return _pow(k, a, ir.Constant(self.ty, self.p))

    def final(self, acc: ir.Value, count: ir.Value | None) -> ir.Value:
        k = self.k
        if self.kind == "avg":
            assert count is not None
            return k.b.fdiv(acc, k.b.sitofp(count, self.ty))
        if self.kind == "lp":
            if self.p == 2.0:
                return k.intrinsic("llvm.sqrt", [acc])
            if self.p != 1.0:
                return _pow(k, acc, ir.Constant(self.ty, 1.0 / self.p))
        return acc


def _pow(k: Emitter, a: ir.Value, b: ir.Value) -> ir.Value:
    fn = k.module.declare_intrinsic("llvm.pow", [a.type])
    return k.b.call(fn, [a, b])


class Pool(Op):
    kind: ClassVar[str]  # "max" | "avg" | "lp"
    dtypes: ClassVar[tuple[str, ...]] = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        xt = _check_input(self, node)
        if self.kind == "lp":
            _lp_order(node)
        win = _pool_window(node, ctx)
        return [TensorType(xt.dtype, (*xt.shape[:2], *win.out))]

    def lower(self, node: Node, k: Emitter) -> None:
        y_val = node.outputs[0]
        win = _pool_window(node, UNCHECKED)
        planes = simplify_dim(y_val.type.shape[0] * y_val.type.shape[1])
        window_size = 1
        for w in win.kernel:
            window_size *= w
        # the (image, channel) planes spread over the threads
        with k.parallel_loop(planes, cost=simplify_dim(numel(win.out) * window_size),
                             name="nc") as plane:
            self._lower_plane(node, k, win, plane)

    def _lower_plane(self, node: Node, k: Emitter, win: Window, plane: ir.Value) -> None:
        x_val = required_input(node, 0)
        x, y = k.view(x_val), k.view(node.outputs[0])
        dtype = x_val.type.dtype
        ct = compute_dtype(dtype)
        red = _Reduction(k, self.kind, ct, _lp_order(node) if self.kind == "lp" else 2.0)
        indices = k.view(node.outputs[1]) if len(node.outputs) > 1 else None
        column_major = attr(node, "storage_order") == 1
        count_pad = bool(attr(node, "count_include_pad"))
        b = k.b
        r = len(win.kernel)
        acc = entry_alloca(k, red.ty, "acc")
        best = entry_alloca(k, I64, "best") if indices is not None else None
        channels = y.dims[1]
        nc = [k.b.sdiv(plane, channels), k.b.srem(plane, channels)]
        padded = any(p != 0 for p in (*win.pads_begin, *win.pads_end))
        if self.kind == "max" and indices is None and dtype.kind in "iu" and padded:
            _max_by_taps(k, win, x, y, nc, dtype)
            return

        def start_of(a: int, o: ir.Value) -> ir.Value:
            return b.sub(b.mul(o, k.i64(win.strides[a])), k.dim(win.pads_begin[a]))

        def window_count(a: int, start: ir.Value, rng: tuple[ir.Value, ir.Value]) -> ir.Value:
            """Positions of axis a that an average divides by."""
            if count_pad:
                # padded positions count too, up to the end of the right padding (a
                # window never starts before the left padding)
                limit = b.add(x.dims[2 + a], k.dim(win.pads_end[a]))
                return clamp(k, ceil_div(k, b.sub(limit, start), win.dilations[a]),
                             k.i64(0), k.i64(win.kernel[a]))
            return b.sub(rng[1], rng[0])

        def one(o: list[ir.Value]) -> None:
            start = [start_of(a, o[a]) for a in range(r)]
            ranges = [kernel_range(k, start[a], x.dims[2 + a], win.dilations[a], win.kernel[a])
                      for a in range(r)]
            b.store(red.initial(), acc)
            if best is not None:
                b.store(k.i64(-1), best)
            with _kernel_loops(k, ranges) as kp:
                pos = [b.add(start[a], b.mul(kp[a], k.i64(win.dilations[a]))) for a in range(r)]
                v = k.convert(k.load(x, [*nc, *pos]), dtype, ct)
                cur = b.load(acc)
                if best is not None:
                    assert indices is not None
                    greater = (b.fcmp_ordered(">", v, cur) if ct.kind == "f"
                               else k.less(ct, cur, v))
                    flat = _flat_index(k, x.dims, nc, pos, column_major)
                    b.store(b.select(greater, v, cur), acc)
                    b.store(b.select(greater, flat, b.load(best)), best)
                else:
                    b.store(red.step(cur, v), acc)
            count = None
            if self.kind == "avg":
                count = k.i64(1)
                for a in range(r):
                    count = b.mul(count, window_count(a, start[a], ranges[a]))
            result = red.final(b.load(acc), count)
            k.store(y, [*nc, *o], k.convert(result, ct, dtype))
            if indices is not None:
                assert best is not None
                k.store(indices, [*nc, *o], b.load(best))

        if indices is None and self.kind != "lp" and _vector_rows(win, dtype):
            with k.loop(y.dims[2], name="oh") as oh:
                first = start_of(0, oh)
                rows = kernel_range(k, first, x.dims[2], 1, win.kernel[0])
                row_count = window_count(0, first, rows) if self.kind == "avg" else None
                _vector_row(k, red, (x, y), (*nc, oh), (first, rows, row_count), win, count_pad)
            return
        if indices is None and self.kind != "lp" and r == 2 and ct == dtype:
            with k.loop(y.dims[2], name="oh") as oh:
                first = start_of(0, oh)
                rows = kernel_range(k, first, x.dims[2], win.dilations[0], win.kernel[0])
                row_count = window_count(0, first, rows) if self.kind == "avg" else None
                # the columns whose every tap lies inside the row, between the edges' ones
                s, d, kw = win.strides[1], win.dilations[1], win.kernel[1]
                pad, out_w = k.dim(win.pads_begin[1]), y.dims[3]
                lo = clamp(k, ceil_div(k, pad, s), k.i64(0), out_w)
                last = b.sub(b.add(x.dims[3], pad), k.i64((kw - 1) * d + 1))
                hi = clamp(k, b.add(k.floordiv(last, k.i64(s)), k.i64(1)), lo, out_w)
                with k.loop(lo, name="owl") as ow:
                    one([oh, ow])
                _strided_row(k, red, (x, y), (*nc, oh), (first, rows, row_count), win, (lo, hi))
                with k.loop(out_w, start=hi, name="owr") as ow:
                    one([oh, ow])
            return
        with k.loops(y.dims[2:], name="o") as o:
            one(o)


#: widest kernel row the vector path (`_vector_row`) unrolls
MAX_VECTOR_KERNEL = 16


def _vector_rows(win: Window, dtype: np.dtype) -> bool:
    """2-D float32 pooling with unit strides and dilations: a row of outputs reads rows of
    the input at consecutive offsets, so whole vectors of outputs compute at once."""
    return (len(win.kernel) == 2 and np.dtype(dtype) == np.float32
            and all(s == 1 for s in win.strides) and all(d == 1 for d in win.dilations)
            and win.kernel[1] <= MAX_VECTOR_KERNEL)


def _vector_row(k: Emitter, red: _Reduction, views: tuple[View, ...], at: tuple[ir.Value, ...],
                rows: tuple[ir.Value, tuple[ir.Value, ir.Value], ir.Value | None], win: Window,
                count_pad: bool) -> None:
    """Output row `at` = (image, channel, row) of a `_vector_rows` pool, a vector of columns
    at a time, the kernel's rows from `rows` = (first input row, in-bounds kernel rows, their
    count for an average). A tap's load is masked to the lanes whose input column lies in the
    row (the others read as the reduction's start value), so padded edges need no scalar
    loop: 7x7 and 14x14 maps are mostly edge. Each lane folds its window in the scalar
    path's order, so the results are the same bits."""
    x, y = views
    n, c, oh = at
    first, (kh_lo, kh_hi), row_count = rows
    b = k.b
    width = k.target.isa.vector
    vt = ir.VectorType(F32, width)
    it = ir.VectorType(I64, width)
    kw = win.kernel[1]
    pad = k.dim(win.pads_begin[1])
    out_w, in_w = y.dims[3], x.dims[3]
    acc = entry_alloca(k, vt, "vacc")
    lanes = ir.Constant(it, list(range(width)))
    zero = ir.Constant(it, [0] * width)
    start = splat(b, red.initial(), width)
    with k.loop(out_w, step=width, name="owv") as ow:
        cols = b.add(lanes, splat(b, ow, width))
        stored = b.icmp_signed("<", cols, splat(b, out_w, width))
        # input column of tap j: cols - pad + j
        first_col = b.sub(cols, splat(b, pad, width))
        masks = []
        for j in range(kw):
            col = b.add(first_col, ir.Constant(it, [j] * width))
            inside = b.and_(b.icmp_signed(">=", col, zero),
                            b.icmp_signed("<", col, splat(b, in_w, width)))
            masks.append(b.and_(inside, stored))
        b.store(start, acc)
        with k.loop(kh_hi, start=kh_lo, name="kh") as kh:
            row = k.element_ptr(x, k.offset(x, [n, c, b.add(first, kh), k.i64(0)]))
            src = b.gep(row, [b.sub(ow, pad)], source_etype=F32)  # may point before the row
            total = b.load(acc)
            for j in range(kw):
                v = b.call(masked_intrinsic(k.module, "load", vt),
                           [b.gep(src, [k.i64(j)], source_etype=F32), _ALIGN4, masks[j], start])
                total = red.step(total, v)
            b.store(total, acc)
        result = b.load(acc)
        if row_count is not None:
            if count_pad:  # up to the end of the right padding, as the scalar path counts
                limit = splat(b, b.add(in_w, k.dim(win.pads_end[1])), width)
                taps = b.sub(limit, first_col)
                taps = b.select(b.icmp_signed("<", taps, zero), zero, taps)
                kv = ir.Constant(it, [kw] * width)
                taps = b.select(b.icmp_signed(">", taps, kv), kv, taps)
            else:
                taps = zero
                for m in masks:
                    taps = b.add(taps, b.zext(m, it))
            count = b.mul(taps, splat(b, row_count, width))
            result = b.fdiv(result, b.sitofp(count, vt))
        store_lanes(b, result, k.element_ptr(y, k.offset(y, [n, c, oh, ow])), stored,
                    b.icmp_signed("<=", b.add(ow, k.i64(width)), out_w))


def _strided_row(k: Emitter, red: _Reduction, views: tuple[View, ...], at: tuple[ir.Value, ...],
                 rows: tuple[ir.Value, tuple[ir.Value, ir.Value], ir.Value | None], win: Window,
                 columns: tuple[ir.Value, ir.Value]) -> None:
    """Output row `at` of a 2-D pool (any stride, the output in the compute dtype), columns
    [lo, hi) of `columns`, whose taps all lie inside the input row: a row whose kernel rows
    all lie inside the input takes each window in registers, an edge row accumulates in
    itself, a branch-free pass per kernel row (strided loads, which LLVM vectorizes); both in
    the window order of the general path, so the results are its bits. The general path
    computes each output's window bounds, which with a symbolic width made CRNN's 2 x 2 / 2
    MaxPool 16x slower than with a static one."""
    x, y = views
    n, c, oh = at
    first, (kh_lo, kh_hi), row_count = rows
    lo, hi = columns
    b = k.b
    s, d, kw = win.strides[1], win.dilations[1], win.kernel[1]
    pad = k.dim(win.pads_begin[1])

    def taps(acc: ir.Value, ow: ir.Value, ih: ir.Value) -> ir.Value:
        base = b.sub(b.mul(ow, k.i64(s)), pad)
        for j in range(kw):
            acc = red.step(acc, k.load(x, [n, c, ih, b.add(base, k.i64(j * d))]))
        return acc

    kh_all = win.kernel[0]
    whole = b.and_(b.icmp_signed("==", kh_lo, k.i64(0)),
                   b.icmp_signed("==", kh_hi, k.i64(kh_all)))
    with b.if_else(whole) as (inner_row, edge_row):
        # every kernel row inside: the whole window in registers
        with inner_row, k.loop(hi, start=lo, name="ow") as ow:
            acc = red.initial()
            for i in range(kh_all):
                acc = taps(acc, ow, b.add(first, k.i64(i * win.dilations[0])))
            count = k.i64(kh_all * kw) if row_count is not None else None
            k.store(y, [n, c, oh, ow], red.final(acc, count))
        with edge_row:  # the row is the accumulator, a pass per kernel row
            with k.loop(hi, start=lo, name="owi") as ow:
                k.store(y, [n, c, oh, ow], red.initial())
            with k.loop(kh_hi, start=kh_lo, name="khs") as kh:
                ih = b.add(first, b.mul(kh, k.i64(win.dilations[0])))
                with k.loop(hi, start=lo, name="ows") as ow:
                    k.store(y, [n, c, oh, ow], taps(k.load(y, [n, c, oh, ow]), ow, ih))
            if row_count is not None:
                count = b.mul(row_count, k.i64(kw))
                with k.loop(hi, start=lo, name="owa") as ow:
                    k.store(y, [n, c, oh, ow], red.final(k.load(y, [n, c, oh, ow]), count))


_ALIGN4 = ir.Constant(ir.IntType(32), 4)
F32 = ir.FloatType()


def _max_by_taps(k: Emitter, win: Window, x: View, y: View, nc: list[ir.Value],
                 dtype: np.dtype) -> None:
    """An integer MaxPool plane tap by tap: y = max(y, x shifted by the tap) along rows, the
    bounds computed once per row and tap rather than per output.
    Every window holds an input (ceil_mode drops those starting in the padding), so y starts
    at the dtype's minimum."""
    lowest = ir.Constant(llvm_type(dtype), int(np.iinfo(dtype).min))
    with k.loops(y.dims[2:], name="o") as o:
        k.store(y, [*nc, *o], lowest)

    def tap(o: list[ir.Value], i: list[ir.Value]) -> None:
        k.store(y, [*nc, *o], k.maximum(dtype, k.load(y, [*nc, *o]), k.load(x, [*nc, *i])))

    with k.loops(win.kernel, name="kpos") as kpos:
        _walk_taps(k, win, kpos, y.dims[2:], x.dims[2:], tap)


@contextmanager
def _kernel_loops(k: Emitter, ranges: Sequence[tuple[ir.Value, ir.Value]]) -> Iterator[list[ir.Value]]:
    if not ranges:
        yield []
        return
    lo, hi = ranges[0]
    with k.loop(hi, start=lo, name="kp") as i, _kernel_loops(k, ranges[1:]) as rest:
        yield [i, *rest]


def _flat_index(k: Emitter, dims: Sequence[ir.Value], nc: Sequence[ir.Value],
                pos: Sequence[ir.Value], column_major: bool) -> ir.Value:
    """The Indices value of element x[n, c, pos...]: a flat offset into x, with the spatial
    part in row-major (storage_order 0) or column-major (1) order."""
    b = k.b
    spatial = list(dims[2:])
    size = k.i64(1)
    for d in spatial:
        size = b.mul(size, d)
    base = b.mul(b.add(b.mul(nc[0], dims[1]), nc[1]), size)
    off = k.i64(0)
    axes = range(len(pos)) if not column_major else reversed(range(len(pos)))
    for a in axes:
        off = b.add(b.mul(off, spatial[a]), pos[a])
    return b.add(base, off)


@register
class MaxPool(Pool):
    op_type = "MaxPool"
    kind = "max"
    dtypes = (*FLOATS, "int8", "uint8")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        (y,) = super().infer(node, ctx)
        if len(node.outputs) < 2:
            return [y]
        # Indices: flat offsets into the input of each maximum
        return [y, TensorType(np.dtype(np.int64), y.shape)]


@register
class AveragePool(Pool):
    op_type = "AveragePool"
    kind = "avg"


@register
class LpPool(Pool):
    op_type = "LpPool"
    kind = "lp"
    since = 2  # LpPool-1 took a float p and is not supported


class GlobalPool(Op):
    kind: ClassVar[str]
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        xt = _check_input(self, node)
        if self.kind == "lp":
            _lp_order(node)
        return [TensorType(xt.dtype, (*xt.shape[:2], *([1] * (xt.rank - 2))))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        dtype = x_val.type.dtype
        ct = compute_dtype(dtype)
        shape = x_val.type.shape
        planes, size = simplify_dim(shape[0] * shape[1]), _product(shape[2:])
        # the (image, channel) planes spread over the threads
        with k.parallel_loop(planes, cost=size, name="nc") as i:
            red = _Reduction(k, self.kind, ct, _lp_order(node) if self.kind == "lp" else 2.0)
            x = k.contiguous(k.buffers[x_val], dtype, (planes, size))
            y = k.contiguous(k.buffers[node.outputs[0]], dtype, (planes,))
            b = k.b
            acc = entry_alloca(k, red.ty, "acc")
            b.store(red.initial(), acc)
            with k.loop(x.dims[1], name="s") as s:
                v = k.convert(k.load(x, [i, s]), dtype, ct)
                b.store(red.step(b.load(acc), v, reassoc=True), acc)
            result = red.final(b.load(acc), x.dims[1])
            k.store(y, [i], k.convert(result, ct, dtype))


def _product(dims: Sequence[Dim]) -> object:
    out = 1
    for d in dims:
        out = out * d
    return out


@register
class GlobalAveragePool(GlobalPool):
    op_type = "GlobalAveragePool"
    kind = "avg"


@register
class GlobalMaxPool(GlobalPool):
    op_type = "GlobalMaxPool"
    kind = "max"


@register
class GlobalLpPool(GlobalPool):
    op_type = "GlobalLpPool"
    kind = "lp"
    since = 2


@register
class MaxRoiPool(Op):
    """Max over each region of interest split into pooled_shape bins (Fast R-CNN's RoI pooling).

    rois rows are (batch index, x1, y1, x2, y2) in input coordinates times spatial_scale,
    rounded half away from zero; bins are floor/ceil of equal fractions of the region, as in
    onnxruntime. An empty bin is 0. A batch index outside the input fails the call.
    """

    op_type = "MaxRoiPool"
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, rois = node.inputs[0], node.input(1)
        assert x is not None
        if rois is None or x.type.rank != 4 or rois.type.rank != 2:
            raise ModelError(f"{node.describe()}: needs X [N, C, H, W] and rois [num_rois, 5]")
        if rois.type.dtype != x.type.dtype:
            raise ModelError(f"{node.describe()}: rois dtype {rois.type.dtype} differs from X's "
                             f"{x.type.dtype}")
        ctx.dims_equal(node, rois.type.shape[1], 5, "rois columns (batch index, x1, y1, x2, y2)")
        pooled = _pooled_shape(node)
        return [TensorType(x.type.dtype, (rois.type.shape[0], x.type.shape[1], *pooled))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, r_val = node.inputs[0], node.input(1)
        assert x_val is not None and r_val is not None
        x, rois, y = k.view(x_val), k.view(r_val), k.view(node.outputs[0])
        dtype = x_val.type.dtype
        ct = compute_dtype(dtype)
        fty = llvm_type(ct)
        b = k.b
        scale = ir.Constant(fty, float(attr(node, "spatial_scale")))
        pooled = _pooled_shape(node)
        acc = entry_alloca(k, fty, "acc")

        def coord(r: ir.Value, col: int) -> ir.Value:
            v = b.fmul(k.convert(k.load(rois, [r, k.i64(col)]), dtype, ct), scale)
            return b.fptosi(k.intrinsic("llvm.round", [v]), I64)

        def bin_edges(i: ir.Value, size: ir.Value, start: ir.Value, limit: ir.Value,
                      bins: int) -> tuple[ir.Value, ir.Value]:
            step = b.fdiv(b.sitofp(size, fty), ir.Constant(fty, float(bins)))
            lo = b.fptosi(k.intrinsic("llvm.floor", [b.fmul(b.sitofp(i, fty), step)]), I64)
            hi = b.fptosi(k.intrinsic("llvm.ceil", [
                b.fmul(b.sitofp(b.add(i, k.i64(1)), fty), step)]), I64)
            return (clamp(k, b.add(lo, start), k.i64(0), limit),
                    clamp(k, b.add(hi, start), k.i64(0), limit))

        with k.loop(y.dims[0], name="roi") as r:
            batch = b.fptosi(k.convert(k.load(rois, [r, k.i64(0)]), dtype, ct), I64)
            k.fail_if(b.icmp_unsigned(">=", batch, x.dims[0]))  # negative ones count as huge
            w0, h0, w1, h1 = (coord(r, col) for col in (1, 2, 3, 4))
            one = k.i64(1)
            height = b.sub(h1, h0)
            height = b.add(b.select(b.icmp_signed(">", height, k.i64(0)), height, k.i64(0)), one)
            width = b.sub(w1, w0)
            width = b.add(b.select(b.icmp_signed(">", width, k.i64(0)), width, k.i64(0)), one)
            with k.loop(y.dims[1], name="c") as c, k.loop(pooled[0], name="ph") as ph, \
                    k.loop(pooled[1], name="pw") as pw:
                hs, he = bin_edges(ph, height, h0, x.dims[2], pooled[0])
                ws, we = bin_edges(pw, width, w0, x.dims[3], pooled[1])
                b.store(ir.Constant(fty, float("-inf")), acc)
                with k.loop(he, start=hs, name="h") as h, k.loop(we, start=ws, name="w") as w:
                    v = k.convert(k.load(x, [batch, c, h, w]), dtype, ct)
                    b.store(k.fmax(b.load(acc), v), acc)
                empty = b.or_(b.icmp_signed("<=", he, hs), b.icmp_signed("<=", we, ws))
                result = b.select(empty, ir.Constant(fty, 0.0), b.load(acc))
                k.store(y, [r, c, ph, pw], k.convert(result, ct, dtype))


def _pooled_shape(node: Node) -> tuple[int, int]:
    pooled = [int(v) for v in node.attrs.get("pooled_shape", [])]
    if len(pooled) != 2 or min(pooled) < 1:
        raise ModelError(f"{node.describe()}: pooled_shape {pooled} must be two positive ints "
                         "(height, width)")
    return pooled[0], pooled[1]


@register
class MaxUnpool(Op):
    """The inverse of MaxPool with Indices: a zero tensor with X's values written at the
    indices, which are flat offsets into the unpooled tensor (N, C, (d - 1) * stride - pads +
    kernel...), as MaxPool's Indices are into its input.

    With output_shape (known at compile time, as constants or from the input dims), that
    tensor is the top-left corner of a larger zero output, as in onnx's reference and its
    backend tests (onnxruntime instead reads the indices as offsets into output_shape). An
    index outside the unpooled tensor fails the call before anything is written.
    """

    op_type = "MaxUnpool"
    since = 9
    dtypes = FLOATS

    def _shapes(self, node: Node, ctx: InferContext) -> tuple[tuple[Dim, ...], tuple[Dim, ...]]:
        """(the unpooled shape the indices address, the output shape)."""
        x, ind = node.inputs[0], node.input(1)
        assert x is not None
        if ind is None:
            raise ModelError(f"{node.describe()}: input 1 (I, the indices) is required")
        shape = x.type.shape
        r = len(shape) - 2
        if r < 1:
            raise ModelError(f"{node.describe()}: X {x.type} must be N x C x spatial...")
        if ind.type.dtype.name != "int64" or ind.type.rank != len(shape):
            raise ModelError(f"{node.describe()}: I must be int64 of X's shape, got {ind.type}")
        for a in range(len(shape)):
            ctx.dims_equal(node, shape[a], ind.type.shape[a], f"dim {a} of X and I")
        kernel = [int(v) for v in attr(node, "kernel_shape")]
        strides = [int(v) for v in node.attrs.get("strides", [1] * r)]
        pads = [int(v) for v in node.attrs.get("pads", [0] * (2 * r))]
        if len(kernel) != r or min(kernel) < 1:
            raise ModelError(f"{node.describe()}: kernel_shape {kernel} must be {r} positive ints "
                             "(one per spatial dim)")
        if len(strides) != r or min(strides) < 1:
            raise ModelError(f"{node.describe()}: strides {strides} must be {r} positive ints")
        if len(pads) != 2 * r or min(pads) < 0:
            raise ModelError(f"{node.describe()}: pads {pads} must be {2 * r} non-negative ints "
                             "(begins, then ends)")
        unpooled: list[Dim] = [shape[0], shape[1]]
        for a in range(r):
            d = simplify_dim((shape[2 + a] - 1) * strides[a] - pads[a] - pads[r + a] + kernel[a])
            if isinstance(d, int) and d < 1:
                raise ModelError(f"{node.describe()}: spatial dim {a} unpools to {d}; the pads "
                                 f"{pads} are too large for kernel {kernel}")
            if not isinstance(d, int):
                ctx.require(node, sympy.Ge(d, 1), f"spatial dim {a} unpools to {d} < 1")
            unpooled.append(d)
        given = const_or_symbolic_input(node, 2, "output_shape")
        if given is None:
            return tuple(unpooled), tuple(unpooled)
        out = [simplify_dim(d) for d in given]
        if len(out) != len(shape):
            raise ModelError(f"{node.describe()}: output_shape {list(given)} must have "
                             f"{len(shape)} entries (N, C, spatial...)")
        for a, (want, least) in enumerate(zip(out, unpooled)):
            if a < 2:
                ctx.dims_equal(node, want, least, f"output_shape[{a}] and X's dim {a}")
            elif isinstance(want, int) and isinstance(least, int):
                if want < least:
                    raise ModelError(f"{node.describe()}: output_shape[{a}] = {want} is smaller "
                                     f"than the unpooled dim {least}")
            else:
                ctx.require(node, sympy.Ge(want, least), f"output_shape[{a}] ({want}) must be at "
                            f"least the unpooled dim ({least})")
        return tuple(unpooled), tuple(out)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        _, out = self._shapes(node, ctx)
        return [TensorType(x.type.dtype, out)]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val, i_val, out = node.inputs[0], node.input(1), node.outputs[0]
        assert x_val is not None and i_val is not None
        unpooled, _ = self._shapes(node, UNCHECKED)
        b = k.b
        total = x_val.type.numel
        xv = k.contiguous(k.buffers[x_val], x_val.type.dtype, (total,))
        iv = k.contiguous(k.buffers[i_val], i_val.type.dtype, (total,))
        size = k.dim(numel(unpooled))
        with k.loop(xv.dims[0], name="chk") as i:
            k.fail_if(b.icmp_unsigned(">=", k.load(iv, [i]), size))  # negative ones count as huge
        k.memset(k.buffers[out], 0, k.dim(out.type.nbytes))
        same = all(sympy.simplify(sympy.sympify(a) - c) == 0
                   for a, c in zip(unpooled, out.type.shape))
        if same:
            y = k.contiguous(k.buffers[out], out.type.dtype, (out.type.numel,))
            with k.loop(xv.dims[0], name="x") as i:
                k.store(y, [k.load(iv, [i])], k.load(xv, [i]))
            return
        # the unpooled tensor is the output's top-left corner: split each index by its dims
        y = k.view(out)
        dims = [k.dim(d) for d in unpooled]
        with k.loop(xv.dims[0], name="x") as i:
            rest = k.load(iv, [i])
            index: list[ir.Value] = []
            for d in reversed(dims):
                q = b.udiv(rest, d)
                index.append(b.sub(rest, b.mul(q, d)))
                rest = q
            k.store(y, index[::-1], k.load(xv, [i]))
