"""Normalizations: BatchNormalization, LayerNormalization, InstanceNormalization,
GroupNormalization, MeanVarianceNormalization, LpNormalization, LRN, and the softmax family
(Softmax, LogSoftmax, Hardmax).

float16 tensors are computed in float32 and rounded once on the way out. Statistics use two
passes (mean, then the mean of squared deviations): as cheap as one pass here and without
its cancellation. Every reduction's inner loop runs over contiguous memory: rows are summed
in reassociated registers, and reductions over an axis that is not innermost accumulate a
tile of neighbouring lanes side by side (see `_Lanes`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Callable, ClassVar

import numpy as np
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, TensorType, Value, numel
from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import Emitter, View, llvm_type
from cuvil.compiler.ops import (
    FLOATS,
    InferContext,
    Op,
    attr,
    compute_dtype,
    normalize_axis,
    register,
    required_input,
)
from cuvil.compiler.ops._softmax_kernel import emit_softmax_row
from cuvil.compiler.ops.reduce import (
    binary_intrinsic,
    entry_alloca,
    interleave,
    split_groups,
    stack_array,
    tile_width,
    tiles,
    vexp,
)
from cuvil.errors import ModelError, UnsupportedOpError

#: work per element of a row normalization (passes over it, an exp), in multiply-adds, for
#: the runtime's decision to split the rows over threads
ROW_COST = 8
#: ONNX TensorProto codes of stash_type
_STASH: dict[int, np.dtype] = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


# -- building blocks ------------------------------------------------------------------------


class _Acc:
    """A scalar accumulator in a stack slot (promoted to a register by LLVM)."""

    def __init__(self, k: Emitter, dtype: np.dtype, name: str = "acc") -> None:
        self.k = k
        self.dtype = np.dtype(dtype)
        self.slot = entry_alloca(k, llvm_type(self.dtype), name=name)

    def set(self, v: ir.Value) -> None:
        self.k.b.store(v, self.slot)

    def get(self) -> ir.Value:
        return self.k.b.load(self.slot)


def moments(k: Emitter, dims: Sequence[ir.Value], load: Callable[[list[ir.Value]], ir.Value],
            comp: np.dtype) -> tuple[ir.Value, ir.Value]:
    """Mean and (population) variance of load(idx) over the index space `dims`."""
    b = k.b
    count: ir.Value = k.i64(1)
    for d in dims:
        count = b.mul(count, d)
    n = b.sitofp(count, llvm_type(comp))
    acc = _Acc(k, comp)
    acc.set(k.const(comp, 0.0))
    with k.loops(list(dims), name="m") as idx:
        acc.set(k.fadd_reduce(acc.get(), load(idx)))
    mean = b.fdiv(acc.get(), n)
    acc.set(k.const(comp, 0.0))
    with k.loops(list(dims), name="v") as idx:
        d = b.fsub(load(idx), mean)
        acc.set(k.fmul_add(d, d, acc.get()))
    return mean, b.fdiv(acc.get(), n)


def inv_std(k: Emitter, var: ir.Value, eps: float) -> ir.Value:
    one = ir.Constant(var.type, 1.0)
    return k.b.fdiv(one, k.intrinsic("llvm.sqrt", [k.b.fadd(var, ir.Constant(var.type, eps))]))


def _loader(k: Emitter, view: View, comp: np.dtype) -> Callable[[list[ir.Value]], ir.Value]:
    return lambda idx: k.convert(k.load(view, idx), view.dtype, comp)


def _param(k: Emitter, node: Node, i: int, comp: np.dtype, index: ir.Value) -> ir.Value:
    """Element `index` of a 1-D parameter input, converted to the compute dtype."""
    v = k.view(required_input(node, i))
    return k.convert(k.load_at(v, index), v.dtype, comp)


def _check_param(node: Node, ctx: InferContext, i: int, what: str, size: Dim) -> None:
    v = node.input(i)
    if v is None or v.type.rank != 1:
        shape = None if v is None else list(v.type.shape)
        raise ModelError(f"{node.describe()}: {what} must be a 1-D tensor of size {size}, got "
                         f"{'nothing' if shape is None else shape}")
    if v.type.dtype.kind != "f":
        raise UnsupportedOpError(f"{node.describe()}: {what} has dtype {v.type.dtype.name}; "
                                 "cuvil expects a float dtype")
    ctx.dims_equal(node, v.type.shape[0], size, f"{what} size")


class _Lanes:
    """The lanes of an [outer, axis, inner] walk that reduce along `axis` side by side.

    With inner == 1 a single lane walks each contiguous row; otherwise a tile of
    neighbouring inner positions is processed together, so inner loops are contiguous
    either way. Per-lane state lives in small stack arrays.
    """

    def __init__(self, k: Emitter, x: View, y: View, o: ir.Value, t: ir.Value, n: ir.Value,
                 width: int) -> None:
        self.k, self.x, self.y, self.o, self.t, self.n = k, x, y, o, t, n
        self.width = width
        self.tiled = width > 1

    def state(self, dtype: np.dtype | str, name: str) -> View:
        return stack_array(self.k, dtype, self.width, name)

    @contextmanager
    def each(self, name: str = "j") -> Iterator[ir.Value]:
        if self.tiled:
            with self.k.loop(self.n, name=name) as j:
                yield j
        else:
            yield self.k.i64(0)

    def index(self, r: ir.Value, j: ir.Value) -> list[ir.Value]:
        return [self.o, r, self.k.b.add(self.t, j) if self.tiled else self.t]

    def load_x(self, r: ir.Value, j: ir.Value, comp: np.dtype) -> ir.Value:
        return self.k.convert(self.k.load(self.x, self.index(r, j)), self.x.dtype, comp)

    def store_y(self, r: ir.Value, j: ir.Value, v: ir.Value, comp: np.dtype) -> None:
        self.k.store(self.y, self.index(r, j), self.k.convert(v, comp, self.y.dtype))

    def fill(self, s: View, value: ir.Value) -> None:
        with self.each("jf") as j:
            self.k.store(s, [j], value)


def emit_axis_kernel(k: Emitter, x_val: Value, y_val: Value, dims3: tuple[Dim, Dim, Dim],
                     body: Callable[[_Lanes, ir.Value], None]) -> None:
    """Call body(lanes, axis_size) for every lane group of x viewed as [outer, axis, inner],
    the outer positions spread over the threads (`body` runs inside the parallel loop: it
    takes its views there)."""
    width = tile_width(dims3[2])
    with k.parallel_loop(dims3[0], cost=ROW_COST * dims3[1] * dims3[2], name="o") as o:
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims3)
        y = k.contiguous(k.buffers[y_val], y_val.type.dtype, dims3)
        with tiles(k, dims3[2]) as (t, n):
            body(_Lanes(k, x, y, o, t, n, width), x.dims[1])


def _axis_dims(node: Node, shape: Sequence[Dim], axis: int, flatten: bool) -> tuple[Dim, Dim, Dim]:
    """[outer, axis, inner]; before opset 13 the softmax family flattens at `axis` to 2-D."""
    if flatten:
        return numel(shape[:axis]), numel(shape[axis:]), 1
    return numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])


class _Float(Op):
    """Shape rule of ops whose output is input 0's type, float dtypes only."""

    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        return [required_input(node, 0).type]


# -- softmax family -----------------------------------------------------------------------


class SoftmaxBase(_Float):
    """Softmax, LogSoftmax and Hardmax along one axis (opset >= 13) or, before opset 13,
    over the input flattened to 2-D at `axis`. Softmax subtracts the row max first."""

    mode: ClassVar[str]

    def geometry(self, node: Node) -> tuple[Dim, Dim, Dim]:
        x = required_input(node, 0)
        new = node.opset >= 13
        axis = normalize_axis(node, int(attr(node, "axis")), x.type.rank)
        return _axis_dims(node, x.type.shape, axis, flatten=not new)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        self.geometry(node)
        return [required_input(node, 0).type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        comp = compute_dtype(x_val.type.dtype)
        dims3 = self.geometry(node)
        if self.mode == "softmax" and x_val.type.dtype == np.float32 and dims3[2] == 1:
            _softmax_rows(k, x_val, node.outputs[0], dims3[0], dims3[1])
            return
        emit = {"softmax": _softmax, "logsoftmax": _softmax, "hardmax": _hardmax}[self.mode]
        emit_axis_kernel(k, x_val, node.outputs[0], dims3,
                         lambda lanes, size: emit(k, lanes, size, comp, self.mode))


def _softmax_rows(k: Emitter, x_val: Value, y_val: Value, rows: Dim, size: Dim) -> None:
    """float32 softmax over contiguous rows (the innermost axis, as attention's): one row at a
    time on the vector kernel, the rows spread over the threads."""
    with k.parallel_loop(rows, cost=ROW_COST * size, name="row") as r:
        n = k.dim(size)
        start = k.b.mul(r, n)
        f32 = llvm_type("float32")
        x = k.b.gep(k.buffers[x_val], [start], source_etype=f32, inbounds=True)
        y = k.b.gep(k.buffers[y_val], [start], source_etype=f32, inbounds=True)
        emit_softmax_row(k, x, y, n)


def _softmax(k: Emitter, L: _Lanes, size: ir.Value, comp: np.dtype, mode: str) -> None:
    b = k.b
    log = mode == "logsoftmax"
    # keep exp(x - max) in y between passes unless y is narrower than the arithmetic
    keep = not log and L.y.dtype == comp
    mx = L.state(comp, "max")
    total = L.state(comp, "sum")
    L.fill(mx, k.const(comp, float("-inf")))
    L.fill(total, k.const(comp, 0.0))
    with k.loop(size, name="r0") as r, L.each() as j:
        k.store(mx, [j], binary_intrinsic(k, "llvm.maximum", k.load(mx, [j]), L.load_x(r, j, comp)))
    with k.loop(size, name="r1") as r, L.each() as j:
        e = vexp(k, b.fsub(L.load_x(r, j, comp), k.load(mx, [j])))
        if keep:
            L.store_y(r, j, e, comp)
        k.store(total, [j], k.fadd_reduce(k.load(total, [j]), e))
    with L.each() as j:
        t = k.load(total, [j])
        if log:  # y = (x - max) - log(sum): no cancellation against a large max
            k.store(total, [j], k.intrinsic("llvm.log", [t]))
        else:
            k.store(total, [j], b.fdiv(k.const(comp, 1.0), t))
    with k.loop(size, name="r2") as r, L.each() as j:
        if log:
            v = b.fsub(b.fsub(L.load_x(r, j, comp), k.load(mx, [j])), k.load(total, [j]))
        elif keep:
            v = b.fmul(k.load(L.y, L.index(r, j)), k.load(total, [j]))
        else:
            e = vexp(k, b.fsub(L.load_x(r, j, comp), k.load(mx, [j])))
            v = b.fmul(e, k.load(total, [j]))
        L.store_y(r, j, v, comp)


def _hardmax(k: Emitter, L: _Lanes, size: ir.Value, comp: np.dtype, mode: str) -> None:
    b = k.b
    best = L.state(comp, "best")
    where = L.state(np.dtype(np.int64), "argmax")
    L.fill(best, k.const(comp, float("-inf")))
    L.fill(where, k.i64(0))
    with k.loop(size, name="r0") as r, L.each() as j:
        v = L.load_x(r, j, comp)
        # strictly greater: the first of equal maxima wins, as in onnxruntime
        gt = b.fcmp_ordered(">", v, k.load(best, [j]))
        k.store(best, [j], b.select(gt, v, k.load(best, [j])))
        k.store(where, [j], b.select(gt, r, k.load(where, [j])))
    one, zero = k.const(comp, 1.0), k.const(comp, 0.0)
    with k.loop(size, name="r1") as r, L.each() as j:
        L.store_y(r, j, b.select(b.icmp_signed("==", r, k.load(where, [j])), one, zero), comp)


@register
class Softmax(SoftmaxBase):
    op_type = "Softmax"
    mode = "softmax"


@register
class LogSoftmax(SoftmaxBase):
    op_type = "LogSoftmax"
    mode = "logsoftmax"


@register
class Hardmax(SoftmaxBase):
    op_type = "Hardmax"
    mode = "hardmax"


# -- LpNormalization ----------------------------------------------------------------------


@register
class LpNormalization(_Float):
    """y = x / ||x||_p along `axis` (p = 1 or 2); a zero norm gives zeros, as in onnxruntime."""

    op_type = "LpNormalization"

    def geometry(self, node: Node) -> tuple[Dim, Dim, Dim]:
        x = required_input(node, 0)
        p = int(attr(node, "p"))
        if p not in (1, 2):
            raise ModelError(f"{node.describe()}: p must be 1 or 2, got {p}")
        axis = normalize_axis(node, int(attr(node, "axis")), x.type.rank)
        return _axis_dims(node, x.type.shape, axis, flatten=False)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        self.geometry(node)
        return [required_input(node, 0).type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        comp = compute_dtype(x_val.type.dtype)
        p = int(attr(node, "p"))

        def body(L: _Lanes, size: ir.Value) -> None:
            b = k.b  # the parallel loop body's builder
            acc = L.state(comp, "norm")
            L.fill(acc, k.const(comp, 0.0))
            with k.loop(size, name="r0") as r, L.each() as j:
                v = L.load_x(r, j, comp)
                a = k.load(acc, [j])
                k.store(acc, [j], k.fmul_add(v, v, a) if p == 2
                        else k.fadd_reduce(a, k.intrinsic("llvm.fabs", [v])))
            with L.each() as j:
                norm = k.load(acc, [j])
                if p == 2:
                    norm = k.intrinsic("llvm.sqrt", [norm])
                zero = b.fcmp_ordered("==", norm, k.const(comp, 0.0))
                inv = b.fdiv(k.const(comp, 1.0), norm)
                k.store(acc, [j], b.select(zero, k.const(comp, 0.0), inv))
            with k.loop(size, name="r1") as r, L.each() as j:
                L.store_y(r, j, b.fmul(L.load_x(r, j, comp), k.load(acc, [j])), comp)

        emit_axis_kernel(k, x_val, node.outputs[0], self.geometry(node), body)


# -- LRN ----------------------------------------------------------------------------------


@register
class LRN(_Float):
    """y = x / (bias + alpha/size * sum of x^2 over `size` neighbouring channels)^beta."""

    op_type = "LRN"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input {x.type} needs N x C x ... dims")
        size = attr(node, "size")
        if int(size) < 1:
            raise ModelError(f"{node.describe()}: attribute size must be a positive integer, "
                             f"got {size}")
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        comp = compute_dtype(x_val.type.dtype)
        shape = x_val.type.shape
        dims3 = (shape[0], shape[1], numel(shape[2:]))
        size = int(node.attrs["size"])
        alpha = float(attr(node, "alpha"))
        beta = float(attr(node, "beta"))
        bias = float(attr(node, "bias"))
        before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
        # one task per (image, channel): each reads its `size` neighbouring channels
        count = dims3[0] * dims3[1]
        with k.parallel_loop(count, cost=(size + 16) * dims3[2], name="lrn") as nc:
            x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims3)
            y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, dims3)
            b = k.b
            tile = stack_array(k, comp, tile_width(dims3[2]), "sq")
            channels = x.dims[1]
            n = b.sdiv(nc, channels)
            c = b.sub(nc, b.mul(n, channels))
            with tiles(k, dims3[2]) as (t, cnt):
                lo = b.sub(c, k.i64(before))
                lo = b.select(b.icmp_signed("<", lo, k.i64(0)), k.i64(0), lo)
                hi = b.add(c, k.i64(after + 1))
                hi = b.select(b.icmp_signed(">", hi, channels), channels, hi)
                with k.loop(cnt, name="j0") as j:
                    k.store(tile, [j], k.const(comp, 0.0))
                with k.loop(hi, start=lo, name="cc") as cc, k.loop(cnt, name="j1") as j:
                    v = k.convert(k.load(x, [n, cc, b.add(t, j)]), x.dtype, comp)
                    k.store(tile, [j], k.fmul_add(v, v, k.load(tile, [j])))
                with k.loop(cnt, name="j2") as j:
                    base = b.fadd(k.const(comp, bias),
                                  b.fmul(k.const(comp, alpha / size), k.load(tile, [j])))
                    # base^-beta as exp(-beta * log(base)), both vectorizable (libm pow is not)
                    scale = vexp(k, b.fmul(k.const(comp, -beta), vecmath.log(b, base)))
                    idx = [n, c, b.add(t, j)]
                    v = b.fmul(k.convert(k.load(x, idx), x.dtype, comp), scale)
                    k.store(y, idx, k.convert(v, comp, y.dtype))


# -- BatchNormalization --------------------------------------------------------------------


@register
class BatchNormalization(_Float):
    """Per channel (axis 1): y = (x - mean) / sqrt(var + eps) * scale + B.

    Inference uses the given mean and var. With training_mode=1 (opset 14 on) the batch's
    own statistics normalize x, and the optional outputs are the updated running
    statistics. Opset 7's spatial=0 takes per-activation parameters of shape [C, D1, ...].
    """

    op_type = "BatchNormalization"

    @staticmethod
    def training(node: Node) -> bool:
        return node.opset >= 14 and bool(attr(node, "training_mode"))

    @staticmethod
    def per_activation(node: Node) -> bool:
        return node.opset < 9 and not attr(node, "spatial")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input {x.type} needs N x C x ... dims")
        if len(node.outputs) > 1 and not self.training(node):
            raise UnsupportedOpError(
                f"{node.describe()}: BatchNormalization with training outputs (mean, var, "
                f"saved_mean, saved_var) at opset {node.opset} is not supported; export the "
                "model in eval mode, or with opset 14+ and training_mode=1"
            )
        c = x.type.shape[1]
        names = ("scale", "B", "mean", "var")
        if self.per_activation(node):
            want = x.type.shape[1:]
            for i, what in enumerate(names, start=1):
                v = node.input(i)
                if v is None or v.type.rank != len(want):
                    raise ModelError(f"{node.describe()}: with spatial=0, {what} must have shape "
                                     f"{list(want)} (C x D1 x ...)")
                for a, (have, need) in enumerate(zip(v.type.shape, want)):
                    ctx.dims_equal(node, have, need, f"{what} dim {a}")
        else:
            for i, what in enumerate(names, start=1):
                _check_param(node, ctx, i, what, c)
        types = [x.type]
        if self.training(node):
            types += [required_input(node, 3).type, required_input(node, 4).type]
        return types

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        shape = x_val.type.shape
        comp = compute_dtype(x_val.type.dtype)
        dims3 = (shape[0], shape[1], numel(shape[2:]))
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims3)
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, dims3)
        eps = float(attr(node, "epsilon"))
        b = k.b
        if self.per_activation(node):
            with k.loop(x.dims[1], name="c") as ch, k.loop(x.dims[2], name="s") as s:
                p = b.add(b.mul(ch, x.dims[2]), s)
                a, shift = self.affine(k, node, comp, p, eps, None)
                with k.loop(x.dims[0], name="n") as i:
                    v = k.convert(k.load(x, [i, ch, s]), x.dtype, comp)
                    k.store(y, [i, ch, s], k.convert(b.fadd(b.fmul(v, a), shift), comp, y.dtype))
            return
        with k.loop(x.dims[1], name="c") as ch:
            stats = None
            if self.training(node):
                dims = [x.dims[0], x.dims[2]]
                stats = moments(k, dims, lambda idx: k.convert(k.load(x, [idx[0], ch, idx[1]]),
                                                               x.dtype, comp), comp)
                self.running_stats(k, node, ch, stats, comp)
            # fold the per-channel affine map once: y = x * a + shift
            a, shift = self.affine(k, node, comp, ch, eps, stats)
            with k.loop(x.dims[0], name="n") as i, k.loop(x.dims[2], name="s") as j:
                v = k.convert(k.load(x, [i, ch, j]), x.dtype, comp)
                k.store(y, [i, ch, j], k.convert(b.fadd(b.fmul(v, a), shift), comp, y.dtype))

    @staticmethod
    def affine(k: Emitter, node: Node, comp: np.dtype, p: ir.Value, eps: float,
               stats: tuple[ir.Value, ir.Value] | None) -> tuple[ir.Value, ir.Value]:
        b = k.b
        mean, var = stats if stats is not None else (_param(k, node, 3, comp, p),
                                                     _param(k, node, 4, comp, p))
        a = b.fmul(_param(k, node, 1, comp, p), inv_std(k, var, eps))
        return a, b.fsub(_param(k, node, 2, comp, p), b.fmul(mean, a))

    @staticmethod
    def running_stats(k: Emitter, node: Node, ch: ir.Value, stats: tuple[ir.Value, ir.Value],
                      comp: np.dtype) -> None:
        """running = given * momentum + batch * (1 - momentum), for the outputs present."""
        momentum = float(attr(node, "momentum"))
        b = k.b
        for out_index, in_index, batch in ((1, 3, stats[0]), (2, 4, stats[1])):
            if len(node.outputs) <= out_index:
                continue
            out = k.view(node.outputs[out_index])
            given = _param(k, node, in_index, comp, ch)
            v = b.fadd(b.fmul(given, k.const(comp, momentum)),
                       b.fmul(batch, k.const(comp, 1.0 - momentum)))
            k.store_at(out, ch, k.convert(v, comp, out.dtype))


# -- statistics over a block: Instance, Group, Layer, MeanVariance -------------------------


@register
class InstanceNormalization(_Float):
    """Per sample and channel, over the spatial dims: y = (x - mean) / sqrt(var + eps) * s + B."""

    op_type = "InstanceNormalization"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 3:
            raise ModelError(f"{node.describe()}: input {x.type} needs N x C x D1 x ... dims")
        for i, what in ((1, "scale"), (2, "B")):
            _check_param(node, ctx, i, what, x.type.shape[1])
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        shape = x_val.type.shape
        comp = compute_dtype(x_val.type.dtype)
        dims3 = (shape[0], shape[1], numel(shape[2:]))
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims3)
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, dims3)
        b = k.b
        eps = float(attr(node, "epsilon"))
        with k.loop(x.dims[0], name="n") as n, k.loop(x.dims[1], name="c") as c:
            mean, var = moments(k, [x.dims[2]], lambda idx: k.convert(
                k.load(x, [n, c, idx[0]]), x.dtype, comp), comp)
            a = b.fmul(_param(k, node, 1, comp, c), inv_std(k, var, eps))
            shift = b.fsub(_param(k, node, 2, comp, c), b.fmul(mean, a))
            with k.loop(x.dims[2], name="s") as s:
                v = k.convert(k.load(x, [n, c, s]), x.dtype, comp)
                k.store(y, [n, c, s], k.convert(b.fadd(b.fmul(v, a), shift), comp, y.dtype))


@register
class GroupNormalization(_Float):
    """Channels split into num_groups groups normalized together per sample. Opset 18 takes
    scale and bias per group, opset 21 per channel."""

    op_type = "GroupNormalization"
    since = 18

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input {x.type} needs N x C x ... dims")
        groups = int(attr(node, "num_groups"))
        if groups < 1:
            raise ModelError(f"{node.describe()}: attribute num_groups must be positive")
        c = x.type.shape[1]
        if isinstance(c, int):
            if c % groups:
                raise ModelError(f"{node.describe()}: {c} channels do not split into {groups} groups")
        else:
            raise UnsupportedOpError(f"{node.describe()}: the channel dim must be static, got {c}")
        size = c if node.opset >= 21 else groups
        for i, what in ((1, "scale"), (2, "bias")):
            _check_param(node, ctx, i, what, size)
        self.stash(node)
        return [x.type]

    @staticmethod
    def stash(node: Node) -> np.dtype:
        code = int(attr(node, "stash_type"))
        if code not in _STASH:
            raise UnsupportedOpError(f"{node.describe()}: stash_type {code} is not supported; "
                                     "use 1 (float32) or 11 (float64)")
        return _STASH[code]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        shape = x_val.type.shape
        comp = compute_dtype(x_val.type.dtype)
        if self.stash(node) == np.float64:
            comp = np.dtype(np.float64)
        groups = int(node.attrs["num_groups"])
        per = int(shape[1]) // groups
        dims4 = (shape[0], groups, per, numel(shape[2:]))
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, dims4)
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, dims4)
        b = k.b
        eps = float(attr(node, "epsilon"))
        per_channel = node.opset >= 21
        with k.loop(x.dims[0], name="n") as n, k.loop(groups, name="g") as g:
            mean, var = moments(k, [x.dims[2], x.dims[3]], lambda idx: k.convert(
                k.load(x, [n, g, *idx]), x.dtype, comp), comp)
            inv = inv_std(k, var, eps)
            with k.loop(per, name="cc") as cc:
                p = b.add(b.mul(g, k.i64(per)), cc) if per_channel else g
                a = b.fmul(_param(k, node, 1, comp, p), inv)
                shift = b.fsub(_param(k, node, 2, comp, p), b.fmul(mean, a))
                with k.loop(x.dims[3], name="s") as s:
                    idx = [n, g, cc, s]
                    v = k.convert(k.load(x, idx), x.dtype, comp)
                    k.store(y, idx, k.convert(b.fadd(b.fmul(v, a), shift), comp, y.dtype))


@register
class LayerNormalization(_Float):
    """Over the axes from `axis` on: y = (x - mean) * InvStdDev * Scale + B, with Scale and B
    broadcast to the normalized shape; the optional Mean and InvStdDev outputs have the
    stash_type dtype and shape x.shape[:axis] + [1, ...]."""

    op_type = "LayerNormalization"
    since = 17

    def geometry(self, node: Node) -> int:
        x = required_input(node, 0)
        return normalize_axis(node, int(attr(node, "axis")), x.type.rank)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        axis = self.geometry(node)
        stash = GroupNormalization.stash(node)
        norm = x.type.shape[axis:]
        for i, what in ((1, "Scale"), (2, "B")):
            v = node.input(i)
            if v is None:
                if i == 1:
                    raise ModelError(f"{node.describe()}: input Scale is required")
                continue
            if v.type.dtype.kind != "f":
                raise UnsupportedOpError(f"{node.describe()}: {what} has dtype {v.type.dtype.name}; "
                                         "cuvil expects a float dtype")
            if v.type.rank > len(norm):
                raise UnsupportedOpError(
                    f"{node.describe()}: {what} {v.type} has more dims than the normalized shape "
                    f"{list(norm)}; cuvil broadcasts Scale and B over the normalized axes only")
            for a, d in enumerate(v.type.shape):
                target = norm[len(norm) - v.type.rank + a]
                if not (isinstance(d, int) and d == 1):
                    ctx.dims_equal(node, d, target, f"{what} dim {a} vs normalized dim")
        stat = TensorType(stash, (*x.type.shape[:axis], *([1] * len(norm))))
        return [x.type, stat, stat]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        shape = x_val.type.shape
        axis = self.geometry(node)
        comp = compute_dtype(x_val.type.dtype)
        if GroupNormalization.stash(node) == np.float64:
            comp = np.dtype(np.float64)
        norm = tuple(shape[axis:])
        outer, size = numel(shape[:axis]), numel(norm)
        params = [node.input(i) for i in (1, 2)]
        # parameters that cover the whole normalized shape are read with the row index;
        # broadcast ones through a view with zero strides over the normalized dims
        flat = all(v is None or numel(v.type.shape) == size for v in params)
        inner_shape = (size,) if flat else norm
        eps = float(attr(node, "epsilon"))
        with k.parallel_loop(outer, cost=ROW_COST * size, name="o") as o:
            x2 = k.contiguous(k.buffers[x_val], x_val.type.dtype, (outer, size))
            x = k.contiguous(x2.ptr, x2.dtype, (outer, *inner_shape))
            y = k.contiguous(k.buffers[node.outputs[0]], x2.dtype, (outer, *inner_shape))
            pviews: list[View | None] = []
            for v in params:
                if v is None:
                    pviews.append(None)
                elif flat:
                    pviews.append(k.contiguous(k.buffers[v], v.type.dtype, (size,)))
                else:
                    pviews.append(k.broadcast_to(k.view(v), norm))
            stats = [k.view(v) for v in node.outputs[1:3]]
            b = k.b
            mean, var = moments(k, [x2.dims[1]], lambda idx: k.convert(
                k.load(x2, [o, idx[0]]), x2.dtype, comp), comp)
            inv = inv_std(k, var, eps)
            for view, value in zip(stats, (mean, inv)):
                k.store_at(view, o, k.convert(value, comp, view.dtype))
            with k.loops(list(x.dims[1:]), name="s") as idx:
                v = k.convert(k.load(x, [o, *idx]), x.dtype, comp)
                v = b.fmul(b.fsub(v, mean), inv)
                scale, bias = pviews
                assert scale is not None
                v = b.fmul(v, k.convert(k.load(scale, idx), scale.dtype, comp))
                if bias is not None:
                    v = b.fadd(v, k.convert(k.load(bias, idx), bias.dtype, comp))
                k.store(y, [o, *idx], k.convert(v, comp, y.dtype))


@register
class MeanVarianceNormalization(_Float):
    """y = (x - mean) / (sqrt(var) + 1e-9) over `axes` (default N, H, W), as the ONNX function
    body defines it."""

    op_type = "MeanVarianceNormalization"
    since = 9

    def axes(self, node: Node) -> set[int]:
        x = required_input(node, 0)
        raw = [int(a) for a in attr(node, "axes")]
        axes = {normalize_axis(node, a, x.type.rank) for a in raw}
        if len(axes) != len(raw):
            raise ModelError(f"{node.describe()}: axes {raw} name an axis twice")
        return axes

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        self.axes(node)
        return [required_input(node, 0).type]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        comp = compute_dtype(x_val.type.dtype)
        groups = split_groups(x_val.type.shape, self.axes(node))
        x = k.contiguous(k.buffers[x_val], x_val.type.dtype, [d for d, _ in groups])
        y = k.contiguous(k.buffers[node.outputs[0]], x_val.type.dtype, [d for d, _ in groups])
        kept = [x.dims[i] for i, (_, r) in enumerate(groups) if not r]
        red = [x.dims[i] for i, (_, r) in enumerate(groups) if r]
        b = k.b
        with k.loops(kept, name="k") as kidx:
            mean, var = moments(k, red, lambda ridx: k.convert(
                k.load(x, interleave(groups, kidx, ridx)), x.dtype, comp), comp)
            std = b.fadd(k.intrinsic("llvm.sqrt", [var]), k.const(comp, 1e-9))
            inv = b.fdiv(k.const(comp, 1.0), std)
            with k.loops(red, name="r") as ridx:
                idx = interleave(groups, kidx, ridx)
                v = b.fmul(b.fsub(k.convert(k.load(x, idx), x.dtype, comp), mean), inv)
                k.store(y, idx, k.convert(v, comp, y.dtype))
