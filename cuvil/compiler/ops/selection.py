"""Ops whose output size the data decides: NonZero, Compress, Unique.

Each makes a data-dependent dim (`InferContext.data_dim`, see `ir.DataDim`) bounded by its
input's size: memory is planned for the bound, and the lowering stores the actual size
(`Emitter.set_dim`) once it has counted it, for the nodes after it and for the caller. The
outputs are written densely in their actual shape, so a lowering computes their offsets
from the count it holds, never through `k.dim` of its own data-dependent dim (which reads
the slot before the store).

Unique sorts with `heapsort` (O(n log n)); NonMaxSuppression (`detection.py`) pops the boxes
of a heap (`heapify`, `heap_pop`) in score order until it has kept enough.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, llvm_type
from cuvil.compiler.ops import InferContext, Op, attr, normalize_axis, register, required_input
from cuvil.compiler.ops.indexing import _break_if, _entry_alloca, _forever
from cuvil.errors import ModelError, UnsupportedOpError

__all__ = ["heap_pop", "heapify", "heapsort", "nonzero_flag"]

INT64 = np.dtype(np.int64)


def nonzero_flag(k: Emitter, dtype: np.dtype, v: ir.Value) -> ir.Value:
    """An i1: the element is not zero (NaN counts as non-zero, as in numpy)."""
    if dtype.kind == "f":
        return k.b.fcmp_unordered("!=", v, ir.Constant(v.type, 0.0))
    return k.b.icmp_unsigned("!=", v, ir.Constant(v.type, 0))


def _at(k: Emitter, ptr: ir.Value, dtype: np.dtype | str, offset: ir.Value) -> ir.Value:
    return k.b.gep(ptr, [offset], source_etype=llvm_type(dtype), inbounds=True)


def _load(k: Emitter, ptr: ir.Value, dtype: np.dtype | str, offset: ir.Value) -> ir.Value:
    return k.b.load(_at(k, ptr, dtype, offset), typ=llvm_type(dtype))


def _store(k: Emitter, ptr: ir.Value, dtype: np.dtype | str, offset: ir.Value,
           value: ir.Value) -> None:
    k.b.store(value, _at(k, ptr, dtype, offset))


def _counter(k: Emitter, name: str) -> ir.Value:
    slot = _entry_alloca(k, I64, name)
    k.b.store(k.i64(0), slot)
    return slot


def _bump(k: Emitter, slot: ir.Value) -> None:
    k.b.store(k.b.add(k.b.load(slot), k.i64(1)), slot)


def _sift_down(k: Emitter, items: ir.Value, start: ir.Value, size: ir.Value,
               above: Callable[[ir.Value, ir.Value], ir.Value]) -> None:
    """Move items[start] down the heap items[0 .. size) until no child belongs above it."""
    pos = _entry_alloca(k, I64, "heap.pos")
    k.b.store(start, pos)
    with _forever(k, "sift") as done:
        p = k.b.load(pos)
        c = k.b.add(k.b.mul(p, k.i64(2)), k.i64(1))
        _break_if(k, k.b.icmp_signed(">=", c, size), done)
        r = k.b.add(c, k.i64(1))
        r = k.b.select(k.b.icmp_signed("<", r, size), r, c)
        cv, rv = _load(k, items, INT64, c), _load(k, items, INT64, r)
        take_r = above(rv, cv)
        w, wv = k.b.select(take_r, r, c), k.b.select(take_r, rv, cv)
        pv = _load(k, items, INT64, p)
        _break_if(k, k.b.not_(above(wv, pv)), done)
        _store(k, items, INT64, p, wv)
        _store(k, items, INT64, w, pv)
        k.b.store(w, pos)


def heapify(k: Emitter, items: ir.Value, n: ir.Value,
            above: Callable[[ir.Value, ir.Value], ir.Value]) -> None:
    """Make the i64 array items[0 .. n) a binary heap: above(a, b) (an i1, a strict order)
    says that item a belongs nearer the root than item b; the root is one no item is above."""
    half = k.b.sdiv(n, k.i64(2))
    with k.loop(half, name="heapify") as t:
        _sift_down(k, items, k.b.sub(k.b.sub(half, k.i64(1)), t), n, above)


def heap_pop(k: Emitter, items: ir.Value, size: ir.Value,
             above: Callable[[ir.Value, ir.Value], ir.Value]) -> ir.Value:
    """Take the root of the heap items[0 .. size) (size > 0), which then holds size - 1 items
    and keeps the root's old place (items[size - 1]) for it."""
    last = k.b.sub(size, k.i64(1))
    root, moved = _load(k, items, INT64, k.i64(0)), _load(k, items, INT64, last)
    _store(k, items, INT64, k.i64(0), moved)
    _store(k, items, INT64, last, root)
    _sift_down(k, items, k.i64(0), last, above)
    return root


def heapsort(k: Emitter, items: ir.Value, n: ir.Value,
             worse: Callable[[ir.Value, ir.Value], ir.Value]) -> None:
    """Sort the i64 array items[0 .. n) best first, where worse(a, b) (an i1, a strict order)
    says that item a goes after item b: a heap with the worst item at its root, popped into
    the end of the shrinking heap."""
    heapify(k, items, n, worse)
    with k.loop(k.b.sub(n, k.i64(1)), name="heapsort") as t:
        heap_pop(k, items, k.b.sub(n, t), worse)


def _bounded_dim(shape: Sequence[Dim], axis: int | None) -> Dim:
    return numel(shape) if axis is None else shape[axis]


# -- NonZero --------------------------------------------------------------------------------


@register
class NonZero(Op):
    """The indices of the non-zero elements, one row per axis: int64 [rank, n], n at most the
    input's element count."""

    op_type = "NonZero"
    since = 9
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank == 0:
            raise UnsupportedOpError(f"{node.describe()}: NonZero of a scalar is not supported; "
                                     "Reshape the input to [1] first")
        n = ctx.data_dim(node, 0, 1, x.type.numel)
        return [TensorType(INT64, (x.type.rank, n))]

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        xv = k.view(x)
        dtype = x.type.dtype
        count = _counter(k, "count")
        with k.loops(xv.dims) as idx, k.if_then(nonzero_flag(k, dtype, k.load(xv, idx))):
            _bump(k, count)
        n = k.b.load(count)
        k.set_dim(out.type.shape[1], n)
        at = _counter(k, "at")
        y = k.buffers[out]
        with k.loops(xv.dims) as idx, k.if_then(nonzero_flag(k, dtype, k.load(xv, idx))):
            j = k.b.load(at)
            for axis, i in enumerate(idx):
                _store(k, y, INT64, k.b.add(k.b.mul(k.i64(axis), n), j), i)
            _bump(k, at)


# -- Compress -------------------------------------------------------------------------------


@register
class Compress(Op):
    """The slices along `axis` (the elements of the flattened input, without one) whose
    condition is true; a condition shorter than the axis drops the slices past its end."""

    op_type = "Compress"
    since = 9
    dtypes = DTYPES

    def _axis(self, node: Node) -> int | None:
        a = attr(node, "axis")
        x = required_input(node, 0)
        return None if a is None else normalize_axis(node, int(a), x.type.rank)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, cond = required_input(node, 0), required_input(node, 1)
        if cond.type.dtype.name != "bool" or cond.type.rank != 1:
            raise ModelError(f"{node.describe()}: condition {cond.name!r} must be a 1-D bool "
                             f"tensor, got {cond.type}")
        axis = self._axis(node)
        length = _bounded_dim(x.type.shape, axis)
        ctx.require(node, sympy.Le(cond.type.shape[0], length),
                    f"the condition ({cond.type.shape[0]} values) is longer than the axis "
                    f"({length})")
        bound = sympy.Min(cond.type.shape[0], length)
        if axis is None:
            return [TensorType(x.type.dtype, (ctx.data_dim(node, 0, 0, bound),))]
        shape = list(x.type.shape)
        shape[axis] = ctx.data_dim(node, 0, axis, bound)
        return [TensorType(x.type.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        x, cond, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        axis = self._axis(node)
        shape = x.type.shape
        outer = 1 if axis is None else numel(shape[:axis])
        inner = 1 if axis is None else numel(shape[axis + 1:])
        length = _bounded_dim(shape, axis)
        cv = k.view(cond)
        used = k.dim(simplify_dim(sympy.Min(cond.type.shape[0], length)))
        count = _counter(k, "count")
        with k.loop(used, name="c") as j, k.if_then(nonzero_flag(k, cond.type.dtype,
                                                                 k.load(cv, [j]))):
            _bump(k, count)
        n = k.b.load(count)
        k.set_dim(out.type.shape[0 if axis is None else axis], n)
        dtype = x.type.dtype
        size = k.dim(simplify_dim(inner * dtype.itemsize))
        inner_v, length_v = k.dim(inner), k.dim(length)
        at = _counter(k, "at")
        with k.loop(k.dim(outer), name="o") as o:
            k.b.store(k.i64(0), at)
            with k.loop(used, name="j") as j, k.if_then(nonzero_flag(k, cond.type.dtype,
                                                                     k.load(cv, [j]))):
                src = k.b.mul(k.b.add(k.b.mul(o, length_v), j), inner_v)
                dst = k.b.mul(k.b.add(k.b.mul(o, n), k.b.load(at)), inner_v)
                k.memcpy(_at(k, k.buffers[out], dtype, dst), _at(k, k.buffers[x], dtype, src),
                         size)
                _bump(k, at)


# -- Unique ---------------------------------------------------------------------------------


@register
class Unique(Op):
    """The distinct elements (or slices along `axis`), sorted or in order of first occurrence,
    with each one's first index, the inverse map and the counts. Slices are sorted with
    their index as the tie-break (O(n log n) comparisons of slices), then runs of equal ones
    merge."""

    op_type = "Unique"
    since = 11
    dtypes = DTYPES

    def _geometry(self, node: Node) -> tuple[int | None, Dim, Dim, Dim]:
        """(axis, outer, slices, inner): the input as [outer, slices, inner]."""
        x = required_input(node, 0)
        a = attr(node, "axis")
        if a is None:
            return None, 1, x.type.numel, 1
        axis = normalize_axis(node, int(a), x.type.rank)
        shape = x.type.shape
        return axis, numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        axis, _, slices, _ = self._geometry(node)
        n = ctx.data_dim(node, 0, 0 if axis is None else axis, slices)
        shape = (n,) if axis is None else (*x.type.shape[:axis], n, *x.type.shape[axis + 1:])
        return [TensorType(x.type.dtype, shape), TensorType(INT64, (n,)),
                TensorType(INT64, (slices,)), TensorType(INT64, (n,))]

    def scratch_bytes(self, node: Node) -> Dim:
        # order, first index and count per sorted distinct slice, the inverse map, positions
        return simplify_dim(5 * 8 * self._geometry(node)[2])

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        axis, outer, slices, inner = self._geometry(node)
        dtype = x.type.dtype
        xp = k.buffers[x]
        count_l = k.dim(slices)
        assert k.scratch is not None
        parts = [k.b.gep(k.scratch, [k.b.mul(k.i64(8 * i), count_l)], source_etype=ir.IntType(8),
                         inbounds=True) for i in range(5)]
        order, first, counts, inverse, place = parts
        outer_v, inner_v = k.dim(outer), k.dim(inner)
        sign = _counter(k, "cmp")

        def compare(a: ir.Value, b: ir.Value) -> ir.Value:
            """-1, 0 or 1 (i64): slice a against slice b, lexicographically."""
            k.b.store(k.i64(0), sign)
            with k.loop(outer_v, name="co") as o, k.loop(inner_v, name="ci") as i:
                base = k.b.mul(o, count_l)
                va = _load(k, xp, dtype, k.b.add(k.b.mul(k.b.add(base, a), inner_v), i))
                vb = _load(k, xp, dtype, k.b.add(k.b.mul(k.b.add(base, b), inner_v), i))
                now = k.b.select(k.less(dtype, va, vb), k.i64(-1),
                                 k.b.select(k.less(dtype, vb, va), k.i64(1), k.i64(0)))
                old = k.b.load(sign)
                k.b.store(k.b.select(k.b.icmp_signed("==", old, k.i64(0)), now, old), sign)
            return k.b.load(sign)

        def later(a: ir.Value, b: ir.Value) -> ir.Value:
            c = compare(a, b)
            return k.b.or_(k.b.icmp_signed(">", c, k.i64(0)),
                           k.b.and_(k.b.icmp_signed("==", c, k.i64(0)),
                                    k.b.icmp_signed(">", a, b)))

        with k.loop(count_l, name="init") as i:
            _store(k, order, INT64, i, i)
        heapsort(k, order, count_l, later)
        # runs of equal slices: the first of each (the lowest index) represents them
        distinct = _counter(k, "distinct")
        with k.loop(count_l, name="run") as p:
            i = _load(k, order, INT64, p)
            prev = _load(k, order, INT64, k.b.select(k.b.icmp_signed(">", p, k.i64(0)),
                                                     k.b.sub(p, k.i64(1)), p))
            fresh = k.b.or_(k.b.icmp_signed("==", p, k.i64(0)),
                            k.b.icmp_signed("!=", compare(i, prev), k.i64(0)))
            with k.if_then(fresh):
                u = k.b.load(distinct)
                _store(k, first, INT64, u, i)
                _store(k, counts, INT64, u, k.i64(0))
                _bump(k, distinct)
            u = k.b.sub(k.b.load(distinct), k.i64(1))
            _store(k, counts, INT64, u, k.b.add(_load(k, counts, INT64, u), k.i64(1)))
            _store(k, inverse, INT64, i, u)
        n = k.b.load(distinct)
        k.set_dim(node.outputs[0].type.shape[0 if axis is None else axis], n)
        # where each sorted distinct slice goes: its rank, or (sorted = 0) the rank of its
        # first index among the first indices
        with k.loop(n, name="ident") as u:
            _store(k, order, INT64, u, u)
        if not attr(node, "sorted"):
            heapsort(k, order, n, lambda a, b: k.b.icmp_signed(
                ">", _load(k, first, INT64, a), _load(k, first, INT64, b)))
        with k.loop(n, name="place") as p:
            _store(k, place, INT64, _load(k, order, INT64, p), p)
        self._write(node, k, n, (outer_v, count_l, inner_v), (first, counts, inverse, place))

    def _write(self, node: Node, k: Emitter, n: ir.Value, geometry: tuple[ir.Value, ...],
               tables: tuple[ir.Value, ...]) -> None:
        x = required_input(node, 0)
        dtype = x.type.dtype
        outer_v, count_l, inner_v = geometry
        first, counts, inverse, place = tables
        outs = node.outputs
        y = k.buffers[outs[0]]
        row = k.b.mul(inner_v, k.i64(dtype.itemsize))
        with k.loop(n, name="y") as u:
            p, f = _load(k, place, INT64, u), _load(k, first, INT64, u)
            with k.loop(outer_v, name="yo") as o:
                dst = k.b.mul(k.b.add(k.b.mul(o, n), p), inner_v)
                src = k.b.mul(k.b.add(k.b.mul(o, count_l), f), inner_v)
                k.memcpy(_at(k, y, dtype, dst), _at(k, k.buffers[x], dtype, src), row)
            if len(outs) > 1:
                _store(k, k.buffers[outs[1]], INT64, p, f)
            if len(outs) > 3:
                _store(k, k.buffers[outs[3]], INT64, p, _load(k, counts, INT64, u))
        if len(outs) > 2:
            with k.loop(count_l, name="inv") as i:
                u = _load(k, inverse, INT64, i)
                _store(k, k.buffers[outs[2]], INT64, i, _load(k, place, INT64, u))

