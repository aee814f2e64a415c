"""Indexing ops: Gather, GatherElements, GatherND, Scatter, ScatterElements, ScatterND,
OneHot, TopK, ArgMax, ArgMin, CumSum, CumProd, ReverseSequence, Trilu (NonZero, whose output
size the data decides, is in `selection.py`).

Index inputs read at run time are checked: a negative index counts from the end of its axis
(as in numpy); one outside the axis makes the node return `STATUS_INDEX_OUT_OF_RANGE`, which
stops the run and reaches the caller as a ValueError naming the node. Constant indices are
checked at compile time instead. Rows of data are moved with memcpy, so these ops handle
every dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, Value, numel, simplify_dim
from cuvil.compiler.kernels.emitter import I64, Emitter, View, llvm_type
from cuvil.compiler.ops import (
    InferContext,
    Op,
    attr,
    const_input,
    const_or_symbolic_input,
    normalize_axis,
    register,
    required_input,
)
from cuvil.errors import ModelError, UnsupportedOpError

NUMERIC = tuple(d for d in DTYPES if d != "bool")
INDEX_DTYPES = ("int32", "int64")


# -- helpers --------------------------------------------------------------------------------


def _check_index_dtype(node: Node, v: Value, what: str, allowed: Sequence[str] = INDEX_DTYPES) -> None:
    if v.type.dtype.name not in allowed:
        raise ModelError(f"{node.describe()}: {what} {v.name!r} must be {' or '.join(allowed)}, "
                         f"got {v.type.dtype.name}")


def _check_const_indices(node: Node, v: Value, n: Dim, what: str) -> bool:
    """Check constant indices against a static axis length now; True when checked."""
    if v.const is None or not isinstance(n, int):
        return False
    flat = np.asarray(v.const).reshape(-1).astype(np.int64)
    bad = flat[(flat < -n) | (flat >= n)]
    if bad.size:
        raise ModelError(f"{node.describe()}: {what} {v.name!r} holds {int(bad[0])}, outside "
                         f"[{-n}, {n - 1}] for an axis of length {n}")
    return True


def _as_i64(k: Emitter, v: ir.Value) -> ir.Value:
    return v if v.type == I64 else k.b.sext(v, I64)


def _wrap(k: Emitter, i: ir.Value, n: ir.Value, check: bool = True) -> ir.Value:
    """A possibly negative index into an axis of length n, made non-negative; with `check`,
    an index outside [-n, n) makes the node fail."""
    i = _as_i64(k, i)
    j = k.b.select(k.b.icmp_signed("<", i, k.i64(0)), k.b.add(i, n), i)
    if check:
        k.fail_if(k.b.icmp_unsigned(">=", j, n))  # unsigned: negative results count as huge
    return j


def _flat(k: Emitter, v: Value, shape: Sequence[Dim]) -> View:
    """`v`'s buffer seen as a row-major tensor of `shape` (same element count)."""
    return k.contiguous(k.buffers[v], v.type.dtype, tuple(simplify_dim(d) for d in shape))


def _copy_elements(k: Emitter, dst: View, dst_off: ir.Value, src: View, src_off: ir.Value,
                   count: Dim) -> None:
    if isinstance(count, int) and count == 1:
        k.store_at(dst, dst_off, k.load_at(src, src_off))
    elif not (isinstance(count, int) and count == 0):
        k.memcpy(k.element_ptr(dst, dst_off), k.element_ptr(src, src_off),
                 k.dim(simplify_dim(count * src.dtype.itemsize)))


def _copy_input(k: Emitter, src: Value, dst: Value) -> None:
    if k.buffers[src] is not k.buffers[dst]:
        k.memcpy(k.buffers[dst], k.buffers[src], k.dim(src.type.nbytes))


def _entry_alloca(k: Emitter, ty: ir.Type, name: str) -> ir.Value:
    """A stack slot in the entry block (LLVM promotes it to a register)."""
    with k.b.goto_block(k.function.entry_basic_block):
        return k.b.alloca(ty, name=name)


@contextmanager
def _forever(k: Emitter, name: str) -> Iterator[ir.Block]:
    """`while True:` — the body leaves by branching to the yielded exit block."""
    head = k.function.append_basic_block(f"{name}.head")
    done = k.function.append_basic_block(f"{name}.done")
    k.b.branch(head)
    k.b.position_at_end(head)
    yield done
    if k.b.block.terminator is None:
        k.b.branch(head)
    k.b.position_at_end(done)


def _break_if(k: Emitter, cond: ir.Value, done: ir.Block) -> None:
    cont = k.function.append_basic_block("cont")
    k.b.cbranch(cond, done, cont)
    k.b.position_at_end(cont)


def _reduction(node: Node, dtype: np.dtype):  # type: ignore[no-untyped-def]
    """The combine function of ScatterElements/ScatterND's `reduction` (None for "none")."""
    red = attr(node, "reduction")
    if red in (None, "none"):  # None: Scatter, which has no reductions
        return None
    allowed = {"add", "mul"} if node.opset < 18 else {"add", "mul", "max", "min"}
    if red not in allowed:
        raise ModelError(f"{node.describe()}: reduction {red!r} is not one of "
                         f"{sorted(allowed | {'none'})} (opset {node.opset})")
    if dtype.name == "bool":
        raise UnsupportedOpError(f"{node.describe()}: reduction {red!r} on bool tensors is not "
                                 "supported; cast to an integer type first")

    def combine(k: Emitter, old: ir.Value, new: ir.Value) -> ir.Value:
        if red == "add":
            return k.add(dtype, old, new)
        if red == "mul":
            return k.mul(dtype, old, new)
        if red == "max":
            return k.maximum(dtype, old, new)
        return k.minimum(dtype, old, new)

    return combine


def _scalar(node: Node, i: int, what: str) -> Dim | None:
    values = const_or_symbolic_input(node, i, what)
    if values is None:
        return None
    if len(values) != 1:
        raise ModelError(f"{node.describe()}: {what} must hold one value, got {len(values)}")
    return values[0]


def _int_scalar(node: Node, i: int, what: str) -> int | None:
    v = const_input(node, i, what)
    if v is None:
        return None
    flat = np.asarray(v).reshape(-1)
    if flat.size != 1:
        raise ModelError(f"{node.describe()}: {what} must hold one value, got {flat.size}")
    return int(flat[0])


# -- gathers --------------------------------------------------------------------------------


@register
class Gather(Op):
    op_type = "Gather"
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        data, idx = required_input(node, 0), required_input(node, 1)
        _check_index_dtype(node, idx, "indices")
        if data.type.rank < 1:
            raise ModelError(f"{node.describe()}: data must have rank >= 1, got a scalar")
        axis = normalize_axis(node, int(attr(node, "axis")), data.type.rank)
        _check_const_indices(node, idx, data.type.shape[axis], "indices")
        shape = data.type.shape
        return [TensorType(data.type.dtype, (*shape[:axis], *idx.type.shape, *shape[axis + 1:]))]

    def lower(self, node: Node, k: Emitter) -> None:
        data, idx, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        shape = data.type.shape
        axis = normalize_axis(node, int(attr(node, "axis")), len(shape))
        outer, n, inner = numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])
        m = idx.type.numel
        d = _flat(k, data, (outer, n, inner))
        y = _flat(k, out, (outer, m, inner))
        iv = _flat(k, idx, (m,))
        nv = k.dim(n)
        if not _check_const_indices(node, idx, n, "indices"):
            # checked up front, so a bad index leaves the output untouched
            with k.loop(iv.dims[0], name="chk") as j:
                _wrap(k, k.load(iv, [j]), nv)
        zero = k.i64(0)
        with k.loop(d.dims[0], name="o") as o, k.loop(iv.dims[0], name="j") as j:
            i = _wrap(k, k.load(iv, [j]), nv, check=False)
            _copy_elements(k, y, k.offset(y, [o, j, zero]), d, k.offset(d, [o, i, zero]), inner)


@register
class GatherElements(Op):
    op_type = "GatherElements"
    since = 11
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        data, idx = required_input(node, 0), required_input(node, 1)
        _check_index_dtype(node, idx, "indices")
        r = data.type.rank
        if idx.type.rank != r or r < 1:
            raise ModelError(f"{node.describe()}: data ({data.type}) and indices ({idx.type}) "
                             "must have the same rank >= 1")
        axis = normalize_axis(node, int(attr(node, "axis")), r)
        _within(node, ctx, idx.type.shape, data.type.shape, skip=axis)
        _check_const_indices(node, idx, data.type.shape[axis], "indices")
        return [TensorType(data.type.dtype, idx.type.shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        data, idx, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        axis = normalize_axis(node, int(attr(node, "axis")), data.type.rank)
        d, iv, y = k.view(data), k.view(idx), k.view(out)
        with k.loops(iv.dims) as ix:
            src = list(ix)
            src[axis] = _wrap(k, k.load(iv, ix), d.dims[axis])
            k.store(y, ix, k.load(d, src))


def _within(node: Node, ctx: InferContext, small: Sequence[Dim], big: Sequence[Dim],
            skip: int | None = None) -> None:
    """Each dim of the indices must fit in the data's dim (except the indexed axis)."""
    for a, (s, b) in enumerate(zip(small, big)):
        if a == skip:
            continue
        # static dims are checked now (require raises when the condition is already false)
        ctx.require(node, sympy.Le(s, b), f"indices dim {a} ({s}) exceeds the data's dim {a} ({b})")


def _nd_geometry(node: Node, ctx: InferContext, data: Value, idx: Value,
                 batch_dims: int) -> int:
    """GatherND/ScatterND: the length m of an index tuple (checked against the ranks)."""
    r, q = data.type.rank, idx.type.rank
    if r < 1 or q < 1:
        raise ModelError(f"{node.describe()}: data and indices must have rank >= 1 "
                         f"(got {data.type} and {idx.type})")
    m = idx.type.shape[-1]
    if not isinstance(m, int):
        raise UnsupportedOpError(f"{node.describe()}: the last dim of indices ({m}) must be known "
                                 "at compile time; pin it in the model's `inputs`")
    if not 0 <= batch_dims < min(r, q):
        raise ModelError(f"{node.describe()}: batch_dims {batch_dims} must be below the ranks of "
                         f"data ({r}) and indices ({q})")
    if not 1 <= m <= r - batch_dims:
        raise ModelError(f"{node.describe()}: indices' last dim is {m}; it must be between 1 and "
                         f"rank(data) - batch_dims = {r - batch_dims}")
    for a in range(batch_dims):
        ctx.dims_equal(node, data.type.shape[a], idx.type.shape[a], f"batch dim {a}")
    return m


@register
class GatherND(Op):
    op_type = "GatherND"
    since = 11
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        data, idx = required_input(node, 0), required_input(node, 1)
        _check_index_dtype(node, idx, "indices")
        b = int(attr(node, "batch_dims"))
        m = _nd_geometry(node, ctx, data, idx, b)
        shape = (*idx.type.shape[:-1], *data.type.shape[b + m:])
        return [TensorType(data.type.dtype, shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        data, idx, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        b = int(attr(node, "batch_dims"))
        shape = data.type.shape
        m = int(idx.type.shape[-1])
        batch, cell = numel(shape[:b]), numel(shape[b + m:])
        count = numel(idx.type.shape[b:-1])
        d = _flat(k, data, (batch, numel(shape[b:b + m]), cell))
        iv = _flat(k, idx, (batch, count, m))
        y = _flat(k, out, (batch, count, cell))
        lengths = [k.dim(shape[b + t]) for t in range(m)]
        zero = k.i64(0)
        with k.loop(d.dims[0], name="b") as bb, k.loop(iv.dims[1], name="j") as j:
            off: ir.Value = zero
            for t in range(m):
                i = _wrap(k, k.load(iv, [bb, j, k.i64(t)]), lengths[t])
                off = k.b.add(k.b.mul(off, lengths[t]), i)
            _copy_elements(k, y, k.offset(y, [bb, j, zero]), d, k.offset(d, [bb, off, zero]), cell)


# -- scatters -------------------------------------------------------------------------------


@register
class ScatterElements(Op):
    op_type = "ScatterElements"
    since = 11
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        data, idx, upd = (required_input(node, i) for i in range(3))
        _check_index_dtype(node, idx, "indices")
        _reduction(node, data.type.dtype)
        r = data.type.rank
        if idx.type.rank != r or upd.type.rank != r or r < 1:
            raise ModelError(f"{node.describe()}: data ({data.type}), indices ({idx.type}) and "
                             f"updates ({upd.type}) must have the same rank >= 1")
        if upd.type.dtype != data.type.dtype:
            raise ModelError(f"{node.describe()}: updates have dtype {upd.type.dtype.name}, data "
                             f"{data.type.dtype.name}")
        for a in range(r):
            ctx.dims_equal(node, idx.type.shape[a], upd.type.shape[a], f"indices/updates dim {a}")
        axis = normalize_axis(node, int(attr(node, "axis")), r)
        _within(node, ctx, idx.type.shape, data.type.shape, skip=axis)
        _check_const_indices(node, idx, data.type.shape[axis], "indices")
        return [data.type]

    def lower(self, node: Node, k: Emitter) -> None:
        data, idx, upd = (required_input(node, i) for i in range(3))
        out = node.outputs[0]
        axis = normalize_axis(node, int(attr(node, "axis")), data.type.rank)
        combine = _reduction(node, data.type.dtype)
        _copy_input(k, data, out)
        y, iv, uv = k.view(out), k.view(idx), k.view(upd)
        with k.loops(iv.dims) as ix:
            dst = list(ix)
            dst[axis] = _wrap(k, k.load(iv, ix), y.dims[axis])
            value = k.load(uv, ix)
            if combine is not None:
                value = combine(k, k.load(y, dst), value)
            k.store(y, dst, value)


@register
class Scatter(ScatterElements):
    """Scatter (opsets 9-10): ScatterElements without reductions, under its deprecated name."""

    op_type = "Scatter"
    since = 9

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        if attr(node, "reduction") not in (None, "none"):
            raise ModelError(f"{node.describe()}: Scatter has no reduction attribute")
        return super().infer(node, ctx)


@register
class ScatterND(Op):
    op_type = "ScatterND"
    since = 11
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        data, idx, upd = (required_input(node, i) for i in range(3))
        _check_index_dtype(node, idx, "indices")
        _reduction(node, data.type.dtype)
        if upd.type.dtype != data.type.dtype:
            raise ModelError(f"{node.describe()}: updates have dtype {upd.type.dtype.name}, data "
                             f"{data.type.dtype.name}")
        m = _nd_geometry(node, ctx, data, idx, 0)
        want = (*idx.type.shape[:-1], *data.type.shape[m:])
        if upd.type.rank != len(want):
            raise ModelError(f"{node.describe()}: updates must have shape {list(want)}, got "
                             f"{upd.type}")
        for a, (u, w) in enumerate(zip(upd.type.shape, want)):
            ctx.dims_equal(node, u, w, f"updates dim {a}")
        return [data.type]

    def lower(self, node: Node, k: Emitter) -> None:
        data, idx, upd = (required_input(node, i) for i in range(3))
        out = node.outputs[0]
        combine = _reduction(node, data.type.dtype)
        shape = data.type.shape
        m = int(idx.type.shape[-1])
        cell = numel(shape[m:])
        count = numel(idx.type.shape[:-1])
        _copy_input(k, data, out)
        y = _flat(k, out, (numel(shape[:m]), cell))
        iv = _flat(k, idx, (count, m))
        uv = _flat(k, upd, (count, cell))
        lengths = [k.dim(shape[t]) for t in range(m)]
        zero = k.i64(0)
        with k.loop(iv.dims[0], name="j") as j:
            off: ir.Value = zero
            for t in range(m):
                i = _wrap(k, k.load(iv, [j, k.i64(t)]), lengths[t])
                off = k.b.add(k.b.mul(off, lengths[t]), i)
            if combine is None:
                _copy_elements(k, y, k.offset(y, [off, zero]), uv, k.offset(uv, [j, zero]), cell)
            else:
                with k.loop(y.dims[1], name="s") as s:
                    old = k.load(y, [off, s])
                    k.store(y, [off, s], combine(k, old, k.load(uv, [j, s])))


@register
class TensorScatter(Op):
    """A KV-cache update: the past cache with, for each batch entry b, the update's rows written
    along `axis` from write_indices[b] on (0 without write_indices); "circular" wraps them
    around the axis. In "linear" mode a write past the axis fails the run."""

    op_type = "TensorScatter"
    since = 24
    dtypes = DTYPES

    def _geometry(self, node: Node) -> tuple[int, bool]:
        past = required_input(node, 0)
        r = past.type.rank
        if r < 2:
            raise ModelError(f"{node.describe()}: past_cache {past.type} must have rank >= 2 "
                             "(batch, ..., sequence, ...)")
        axis = normalize_axis(node, int(attr(node, "axis")), r)
        if axis == 0:
            raise ModelError(f"{node.describe()}: axis {attr(node, 'axis')} is the batch axis; "
                             "the sequence axis must be another one")
        mode = attr(node, "mode")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        if mode not in ("linear", "circular"):
            raise ModelError(f"{node.describe()}: mode {mode!r} is not 'linear' or 'circular'")
        return axis, mode == "circular"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        past, upd = required_input(node, 0), required_input(node, 1)
        axis, _ = self._geometry(node)
        if upd.type.dtype != past.type.dtype:
            raise ModelError(f"{node.describe()}: update has dtype {upd.type.dtype.name}, "
                             f"past_cache {past.type.dtype.name}")
        if upd.type.rank != past.type.rank:
            raise ModelError(f"{node.describe()}: update {upd.type} and past_cache {past.type} "
                             "must have the same rank")
        for a, (u, p) in enumerate(zip(upd.type.shape, past.type.shape)):
            if a != axis:
                ctx.dims_equal(node, u, p, f"update dim {a} vs past_cache dim {a}")
        seq, max_seq = upd.type.shape[axis], past.type.shape[axis]
        ctx.require(node, sympy.Le(seq, max_seq), f"the update's sequence length {seq} exceeds "
                    f"the cache's {max_seq} (axis {axis})")
        wi = node.input(2)
        if wi is not None:
            _check_index_dtype(node, wi, "write_indices", ("int64",))
            if wi.type.rank != 1:
                raise ModelError(f"{node.describe()}: write_indices {wi.type} must be 1-D "
                                 "(one index per batch entry)")
            ctx.dims_equal(node, wi.type.shape[0], past.type.shape[0],
                           "write_indices length vs the batch size")
        return [past.type]

    def lower(self, node: Node, k: Emitter) -> None:
        past, upd, wi, out = required_input(node, 0), required_input(node, 1), node.input(2), node.outputs[0]
        axis, circular = self._geometry(node)
        shape = past.type.shape
        per_batch, inner = numel(shape[1:axis]), numel(shape[axis + 1:])
        seq = upd.type.shape[axis]
        y = _flat(k, out, (shape[0], per_batch, shape[axis], inner))
        uv = _flat(k, upd, (shape[0], per_batch, seq, inner))
        iv = _flat(k, wi, (shape[0],)) if wi is not None else None
        n, seq_v = y.dims[2], uv.dims[2]
        if iv is not None and not circular:
            # checked before writing: a write past the cache stops the run
            with k.loop(iv.dims[0], name="chk") as bb:
                start = _as_i64(k, k.load(iv, [bb]))
                past_end = k.b.icmp_signed(">", k.b.add(start, seq_v), n)
                k.fail_if(k.b.or_(k.b.icmp_signed("<", start, k.i64(0)), past_end))
        _copy_input(k, past, out)
        zero = k.i64(0)
        with k.loop(y.dims[0], name="b") as bb:
            start = _as_i64(k, k.load(iv, [bb])) if iv is not None else zero
            with k.loop(y.dims[1], name="o") as o, k.loop(seq_v, name="s") as s:
                at = k.b.add(start, s)
                if circular:
                    at = k.b.sub(at, k.b.mul(k.floordiv(at, n), n))
                _copy_elements(k, y, k.offset(y, [bb, o, at, zero]), uv, k.offset(uv, [bb, o, s, zero]),
                               inner)


# -- encodings and selections -----------------------------------------------------------------


@register
class OneHot(Op):
    op_type = "OneHot"
    since = 9
    dtypes = NUMERIC

    def _depth(self, node: Node) -> Dim:
        d = _scalar(node, 1, "depth")
        assert d is not None
        d = simplify_dim(sympy.floor(d) if not isinstance(d, int) and d.is_number else d)
        if isinstance(d, int) and d < 1:
            raise ModelError(f"{node.describe()}: depth must be positive, got {d}")
        return d

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        idx, values = required_input(node, 0), required_input(node, 2)
        depth = self._depth(node)
        if values.type.dtype.name not in DTYPES:
            raise UnsupportedOpError(f"{node.describe()}: values have dtype "
                                     f"{values.type.dtype.name}; cuvil compiles OneHot for "
                                     f"{', '.join(DTYPES)} values")
        if not isinstance(values.type.numel, int) or values.type.numel != 2:
            raise ModelError(f"{node.describe()}: values must hold two elements [off, on], got "
                             f"{values.type}")
        r = idx.type.rank
        axis = normalize_axis(node, int(attr(node, "axis")), r + 1)
        shape = idx.type.shape
        return [TensorType(values.type.dtype, (*shape[:axis], depth, *shape[axis:]))]

    def lower(self, node: Node, k: Emitter) -> None:
        idx, values, out = required_input(node, 0), required_input(node, 2), node.outputs[0]
        depth = self._depth(node)
        shape = idx.type.shape
        axis = normalize_axis(node, int(attr(node, "axis")), len(shape) + 1)
        outer, inner = numel(shape[:axis]), numel(shape[axis:])
        iv = _flat(k, idx, (outer, inner))
        y = _flat(k, out, (outer, depth, inner))
        vv = _flat(k, values, (2,))
        off, on = k.load(vv, [k.i64(0)]), k.load(vv, [k.i64(1)])
        dv = k.dim(depth)
        with k.loop(iv.dims[0], name="o") as o, k.loop(dv, name="d") as d, \
                k.loop(iv.dims[1], name="i") as i:
            # like onnxruntime: truncate to an integer, then count negatives from the end
            pos = k.convert(k.load(iv, [o, i]), idx.type.dtype, np.dtype(np.int64))
            pos = k.b.select(k.b.icmp_signed("<", pos, k.i64(0)), k.b.add(pos, dv), pos)
            k.store(y, [o, d, i], k.b.select(k.b.icmp_signed("==", pos, d), on, off))


def _better(k: Emitter, dtype: np.dtype, largest: bool, va: ir.Value, ia: ir.Value,
            vb: ir.Value, ib: ir.Value) -> ir.Value:
    """TopK's order: a comes before b (larger/smaller value; ties: lower index first). As in
    onnxruntime, NaN counts as larger than every number (first when largest, last when not)
    and NaNs tie with each other."""
    if dtype.kind == "f":
        nan_a = k.b.fcmp_unordered("uno", va, va)
        nan_b = k.b.fcmp_unordered("uno", vb, vb)
        if largest:  # (a > b or a is NaN) and b is not NaN
            strict = k.b.and_(k.b.fcmp_unordered(">", va, vb), k.b.not_(nan_b))
        else:  # (a < b or b is NaN) and a is not NaN
            strict = k.b.and_(k.b.fcmp_unordered("<", va, vb), k.b.not_(nan_a))
        equal = k.b.or_(k.b.fcmp_ordered("==", va, vb), k.b.and_(nan_a, nan_b))
    else:
        cmp = k.b.icmp_unsigned if dtype.kind in "ub" else k.b.icmp_signed
        strict = cmp(">" if largest else "<", va, vb)
        equal = cmp("==", va, vb)
    return k.b.or_(strict, k.b.and_(equal, k.b.icmp_signed("<", ia, ib)))


def _beats(k: Emitter, dtype: np.dtype, largest: bool, va: ir.Value, vb: ir.Value) -> ir.Value:
    """The value-only part of `_better`: a strictly before b."""
    if dtype.kind == "f":
        if largest:
            return k.b.and_(k.b.fcmp_unordered(">", va, vb), k.b.fcmp_ordered("ord", vb, vb))
        return k.b.and_(k.b.fcmp_unordered("<", va, vb), k.b.fcmp_ordered("ord", va, va))
    cmp = k.b.icmp_unsigned if dtype.kind in "ub" else k.b.icmp_signed
    return cmp(">" if largest else "<", va, vb)


@register
class TopK(Op):
    """TopK with a compile-time k; rows are selected with a bounded heap kept in the outputs
    (O(n log k)), then heap-sorted in place."""

    op_type = "TopK"
    dtypes = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64")

    def _k(self, node: Node) -> Dim:
        if node.opset < 10:
            kk: Dim = attr(node, "k")
        else:
            kk = _scalar(node, 1, "K")
            assert kk is not None
        kk = simplify_dim(kk)
        if isinstance(kk, int) and kk < 0:
            raise ModelError(f"{node.describe()}: k must not be negative, got {kk}")
        return kk

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 1:
            raise ModelError(f"{node.describe()}: input must have rank >= 1")
        axis = normalize_axis(node, int(attr(node, "axis")), x.type.rank)
        kk = self._k(node)
        n = x.type.shape[axis]
        ctx.require(node, sympy.Le(kk, n), f"k = {kk} exceeds the axis length {n}")
        shape = list(x.type.shape)
        shape[axis] = kk
        return [TensorType(x.type.dtype, tuple(shape)), TensorType(np.dtype(np.int64), tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        vals, idxs = node.outputs[0], node.outputs[1]
        shape = x.type.shape
        axis = normalize_axis(node, int(attr(node, "axis")), len(shape))
        kk = self._k(node)
        if isinstance(kk, int) and kk == 0:
            return
        largest = bool(attr(node, "largest"))
        dtype = x.type.dtype
        outer, n, inner = numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])
        xv = _flat(k, x, (outer, n, inner))
        vv = _flat(k, vals, (outer, kk, inner))
        iv = _flat(k, idxs, (outer, kk, inner))
        kv = k.dim(kk)
        worst = _entry_alloca(k, llvm_type(dtype), "worst")
        pos_slot = _entry_alloca(k, I64, "pos")

        def better(a: tuple[ir.Value, ir.Value], b: tuple[ir.Value, ir.Value]) -> ir.Value:
            return _better(k, dtype, largest, a[0], a[1], b[0], b[1])

        with k.loop(xv.dims[0], name="o") as o, k.loop(xv.dims[2], name="in") as i:
            def slot(p: ir.Value) -> ir.Value:
                return k.offset(vv, [o, p, i])

            def get(p: ir.Value) -> tuple[ir.Value, ir.Value]:
                off = slot(p)
                return k.load_at(vv, off), k.load_at(iv, off)

            def put(p: ir.Value, item: tuple[ir.Value, ir.Value]) -> None:
                off = slot(p)
                k.store_at(vv, off, item[0])
                k.store_at(iv, off, item[1])

            def sift_down(item: tuple[ir.Value, ir.Value], size: ir.Value) -> None:
                # the heap keeps its worst element at the root; `item` replaces the root
                k.b.store(k.i64(0), pos_slot)
                with _forever(k, "down") as done:
                    p = k.b.load(pos_slot)
                    c = k.b.add(k.b.mul(p, k.i64(2)), k.i64(1))
                    _break_if(k, k.b.icmp_signed(">=", c, size), done)
                    r = k.b.add(c, k.i64(1))
                    r = k.b.select(k.b.icmp_signed("<", r, size), r, c)
                    cv, rv = get(c), get(r)
                    take_r = better(cv, rv)  # the right child is the worse one
                    w = k.b.select(take_r, r, c)
                    wv = (k.b.select(take_r, rv[0], cv[0]), k.b.select(take_r, rv[1], cv[1]))
                    _break_if(k, k.b.not_(better(item, wv)), done)
                    put(p, wv)
                    k.b.store(w, pos_slot)
                put(k.b.load(pos_slot), item)

            def sift_up(item: tuple[ir.Value, ir.Value], start: ir.Value) -> None:
                k.b.store(start, pos_slot)
                with _forever(k, "up") as done:
                    p = k.b.load(pos_slot)
                    _break_if(k, k.b.icmp_signed("==", p, k.i64(0)), done)
                    parent = k.b.lshr(k.b.sub(p, k.i64(1)), k.i64(1))
                    pv = get(parent)
                    _break_if(k, k.b.not_(better(pv, item)), done)
                    put(p, pv)
                    k.b.store(parent, pos_slot)
                put(k.b.load(pos_slot), item)

            with k.if_then(k.b.icmp_signed(">", kv, k.i64(0))):
                with k.loop(kv, name="fill") as j:
                    sift_up((k.load(xv, [o, j, i]), j), j)
                k.b.store(get(k.i64(0))[0], worst)
                with k.loop(xv.dims[1], start=kv, name="j") as j:
                    # a later element with an equal value loses the tie: compare values only
                    v = k.load(xv, [o, j, i])
                    with k.b.if_then(_beats(k, dtype, largest, v, k.b.load(worst)), likely=False):
                        sift_down((v, j), kv)
                        k.b.store(get(k.i64(0))[0], worst)
                # heap sort: move the worst to the end, repeatedly
                with k.loop(k.b.sub(kv, k.i64(1)), name="sort") as t:
                    end = k.b.sub(k.b.sub(kv, k.i64(1)), t)
                    last = get(end)
                    put(end, get(k.i64(0)))
                    sift_down(last, end)


class _ArgExtreme(Op):
    dtypes = ("float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64")
    largest: bool

    def _axis(self, node: Node, rank: int) -> int:
        return normalize_axis(node, int(attr(node, "axis")), rank)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 1:
            raise ModelError(f"{node.describe()}: input must have rank >= 1")
        axis = self._axis(node, x.type.rank)
        shape = list(x.type.shape)
        if int(attr(node, "keepdims")):
            shape[axis] = 1
        else:
            del shape[axis]
        return [TensorType(np.dtype(np.int64), tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        shape = x.type.shape
        axis = self._axis(node, len(shape))
        last = bool(attr(node, "select_last_index"))
        dtype = x.type.dtype
        outer, n, inner = numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])
        xv = _flat(k, x, (outer, n, inner))
        y = _flat(k, out, (outer, inner))
        best_v = _entry_alloca(k, llvm_type(dtype), "best")
        best_i = _entry_alloca(k, I64, "best_i")
        if dtype.kind == "f":
            op = (">=" if last else ">") if self.largest else ("<=" if last else "<")
            def wins(a: ir.Value, b: ir.Value) -> ir.Value:
                return k.b.fcmp_ordered(op, a, b)
        else:
            op = (">=" if last else ">") if self.largest else ("<=" if last else "<")
            cmp = k.b.icmp_unsigned if dtype.kind in "ub" else k.b.icmp_signed
            def wins(a: ir.Value, b: ir.Value) -> ir.Value:
                return cmp(op, a, b)
        zero = k.i64(0)
        with k.loop(xv.dims[0], name="o") as o, k.loop(xv.dims[2], name="in") as i:
            k.b.store(k.load(xv, [o, zero, i]), best_v)
            k.b.store(zero, best_i)
            with k.loop(xv.dims[1], start=1, name="j") as j:
                v = k.load(xv, [o, j, i])
                take = wins(v, k.b.load(best_v))
                k.b.store(k.b.select(take, v, k.b.load(best_v)), best_v)
                k.b.store(k.b.select(take, j, k.b.load(best_i)), best_i)
            k.store(y, [o, i], k.b.load(best_i))


@register
class ArgMax(_ArgExtreme):
    op_type = "ArgMax"
    largest = True


@register
class ArgMin(_ArgExtreme):
    op_type = "ArgMin"
    largest = False


# -- scans and masks ------------------------------------------------------------------------


@register
class CumSum(Op):
    """Running sums along an axis, inclusive or exclusive (starting from the identity), forward
    or reverse. CumProd is the same scan with another combining step and identity."""

    op_type = "CumSum"
    since = 11
    dtypes = ("float32", "float64", "int32", "int64", "float16", "int8", "int16", "uint8", "uint16",
              "uint32", "uint64")
    #: the first output of an exclusive scan
    identity = 0

    def combine(self, k: Emitter, dtype: np.dtype, acc: ir.Value, x: ir.Value) -> ir.Value:
        return k.add(dtype, acc, x)

    def _axis(self, node: Node, rank: int) -> int:
        values = const_or_symbolic_input(node, 1, "axis")
        if values is None or len(values) != 1 or not isinstance(values[0], int):
            raise ModelError(f"{node.describe()}: axis must be one integer")
        return normalize_axis(node, values[0], rank)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 1:
            raise ModelError(f"{node.describe()}: input must have rank >= 1")
        self._axis(node, x.type.rank)
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        shape = x.type.shape
        axis = self._axis(node, len(shape))
        exclusive = bool(attr(node, "exclusive"))
        reverse = bool(attr(node, "reverse"))
        dtype = x.type.dtype
        outer, n, inner = numel(shape[:axis]), shape[axis], numel(shape[axis + 1:])
        if isinstance(n, int) and n == 0:
            return
        xv = _flat(k, x, (outer, n, inner))
        y = _flat(k, out, (outer, n, inner))
        nv = k.dim(n)
        last = k.b.sub(nv, k.i64(1))
        first = last if reverse else k.i64(0)
        with k.loop(xv.dims[0], name="o") as o:
            with k.loop(xv.dims[2], name="i0") as i:
                k.store(y, [o, first, i],
                        k.const(dtype, self.identity) if exclusive else k.load(xv, [o, first, i]))
            with k.loop(nv, start=1, name="t") as t:
                j = k.b.sub(last, t) if reverse else t
                prev = k.b.add(j, k.i64(1)) if reverse else k.b.sub(j, k.i64(1))
                src = prev if exclusive else j
                with k.loop(xv.dims[2], name="i") as i:
                    k.store(y, [o, j, i], self.combine(k, dtype, k.load(y, [o, prev, i]),
                                                       k.load(xv, [o, src, i])))


@register
class CumProd(CumSum):
    op_type = "CumProd"
    since = 26
    identity = 1

    def combine(self, k: Emitter, dtype: np.dtype, acc: ir.Value, x: ir.Value) -> ir.Value:
        return k.mul(dtype, acc, x)


@register
class ReverseSequence(Op):
    """Reverses the first sequence_lens[b] steps of each batch entry b along the time axis
    (time_axis and batch_axis are 0 and 1, either way round); later steps are copied. A
    length outside [0, time steps] fails the call before anything is written."""

    op_type = "ReverseSequence"
    since = 10
    dtypes = DTYPES

    def _axes(self, node: Node) -> tuple[int, int]:
        time_axis = int(attr(node, "time_axis"))
        batch_axis = int(attr(node, "batch_axis"))
        if {time_axis, batch_axis} != {0, 1}:
            raise ModelError(f"{node.describe()}: time_axis ({time_axis}) and batch_axis "
                             f"({batch_axis}) must be 0 and 1, one each")
        return time_axis, batch_axis

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x, lens = required_input(node, 0), required_input(node, 1)
        _, batch_axis = self._axes(node)
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input must have rank >= 2, got {x.type}")
        _check_index_dtype(node, lens, "sequence_lens", ("int64",))
        if lens.type.rank != 1:
            raise ModelError(f"{node.describe()}: sequence_lens must be 1-D (one length per batch "
                             f"entry), got {lens.type}")
        ctx.dims_equal(node, lens.type.shape[0], x.type.shape[batch_axis],
                       "sequence_lens' length and the batch dim")
        if lens.const is not None and isinstance(x.type.shape[1 - batch_axis], int):
            steps = x.type.shape[1 - batch_axis]
            flat = np.asarray(lens.const).reshape(-1)
            bad = flat[(flat < 0) | (flat > steps)]
            if bad.size:
                raise ModelError(f"{node.describe()}: sequence_lens holds {int(bad[0])}, outside "
                                 f"[0, {steps}] (the time steps)")
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x, lens, out = required_input(node, 0), required_input(node, 1), node.outputs[0]
        time_axis, batch_axis = self._axes(node)
        shape = x.type.shape
        inner = numel(shape[2:])
        xv = _flat(k, x, (shape[0], shape[1], inner))
        y = _flat(k, out, (shape[0], shape[1], inner))
        lv = _flat(k, lens, (shape[batch_axis],))
        steps, batch = xv.dims[time_axis], xv.dims[batch_axis]
        b = k.b
        with k.loop(batch, name="chk") as bb:
            # unsigned: negative lengths count as huge
            k.fail_if(b.icmp_unsigned(">", k.load(lv, [bb]), steps))
        zero = k.i64(0)
        with k.loop(batch, name="b") as bb:
            n = k.load(lv, [bb])
            with k.loop(steps, name="t") as t:
                src = b.select(b.icmp_signed("<", t, n), b.sub(b.sub(n, k.i64(1)), t), t)

                def at(step: ir.Value) -> list[ir.Value]:
                    return [step, bb, zero] if time_axis == 0 else [bb, step, zero]

                _copy_elements(k, y, k.offset(y, at(t)), xv, k.offset(xv, at(src)), inner)


@register
class Trilu(Op):
    op_type = "Trilu"
    since = 14
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank < 2:
            raise ModelError(f"{node.describe()}: input must have rank >= 2, got {x.type}")
        kv = node.input(1)
        if kv is not None:
            _check_index_dtype(node, kv, "k", ("int64",))
            if not isinstance(kv.type.numel, int) or kv.type.numel != 1:
                raise ModelError(f"{node.describe()}: k must hold one value, got {kv.type}")
        return [x.type]

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        shape = x.type.shape
        upper = bool(attr(node, "upper"))
        kv = node.input(1)
        if kv is None:
            diag: ir.Value = k.i64(0)
        elif kv.const is not None:
            diag = k.i64(int(np.asarray(kv.const).reshape(-1)[0]))
        else:
            diag = k.load(_flat(k, kv, (1,)), [k.i64(0)])
        xv = _flat(k, x, (numel(shape[:-2]), shape[-2], shape[-1]))
        y = _flat(k, out, (numel(shape[:-2]), shape[-2], shape[-1]))
        zero = k.const(x.type.dtype, 0)
        with k.loops(xv.dims) as (b, r, c):
            d = k.b.sub(c, r)
            keep = k.b.icmp_signed(">=" if upper else "<=", d, diag)
            k.store(y, [b, r, c], k.b.select(keep, k.load(xv, [b, r, c]), zero))
