"""Ops that move data without arithmetic: views (Flatten, Reshape, Squeeze, Unsqueeze),
permutations (Transpose, DepthToSpace, SpaceToDepth), joins and cuts (Concat, Split, Slice,
Pad, Expand, Tile), and tensors made from shapes (Shape, Size, Range, ConstantOfShape, EyeLike,
Constant, and cuvil's SymbolicValue).

Shape inputs (Reshape's shape, Slice's starts, Expand's shape...) are read with
`const_or_symbolic_input`, so they may be constants or values computed from the input dims
inside the graph (see `cuvil.compiler.frontend.shape_values`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import sympy
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, Value, dim_str, numel, simplify_dim
from cuvil.compiler.kernels.emitter import Emitter, View
from cuvil.compiler.ops import (
    UNCHECKED,
    InferContext,
    Op,
    attr,
    broadcast_shapes,
    const_or_symbolic_input,
    normalize_axis,
    register,
    required_input,
)
from cuvil.compiler.ops.elementwise import Copy, emit_elementwise
from cuvil.errors import ModelError, UnsupportedOpError

#: a static start/end at least this large means "to the end" (dims never get this big)
_HUGE = 1 << 31


def _shape_text(dims: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(dim_str(simplify_dim(d))) for d in dims) + "]"


def _int_values(node: Node, i: int, what: str) -> list[int] | None:
    """Input i as static ints (axes, steps...): symbolic values are an error."""
    values = const_or_symbolic_input(node, i, what)
    if values is None:
        return None
    if not all(isinstance(v, int) for v in values):
        raise UnsupportedOpError(f"{node.describe()}: input {i} ({what}) must be a constant; it is "
                                 f"{_shape_text(values)}")
    return [int(v) for v in values]


def _dim_values(node: Node, i: int, what: str) -> list[Dim] | None:
    """Input i as dims (ints or integer expressions of the input dims)."""
    values = const_or_symbolic_input(node, i, what)
    if values is None:
        return None
    out = []
    for v in values:
        v = simplify_dim(v)
        if not isinstance(v, int) and v.is_integer is not True:
            raise ModelError(f"{node.describe()}: input {i} ({what}) holds the non-integer {v}")
        out.append(v)
    return out


def _sign(node: Node, x: Dim, what: str) -> int:
    """-1 for negative, 1 for non-negative; an error when the sign depends on the dims."""
    if isinstance(x, int):
        return -1 if x < 0 else 1
    if x.is_nonnegative:
        return 1
    if x.is_negative:
        return -1
    raise UnsupportedOpError(
        f"{node.describe()}: {what} is {x}, whose sign depends on the input dims; cuvil needs to "
        "know whether it counts from the start or the end. Pin the dims in the model's `inputs`."
    )


# -- views ----------------------------------------------------------------------------------


@register
class Flatten(Copy):
    op_type = "Flatten"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        rank = x.type.rank
        axis = int(attr(node, "axis"))
        if not -rank <= axis <= rank:
            raise ModelError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
        axis = axis + rank if axis < 0 else axis
        shape = x.type.shape
        return [TensorType(x.type.dtype, (numel(shape[:axis]), numel(shape[axis:])))]


@register
class Reshape(Copy):
    op_type = "Reshape"
    since = 5

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        target = _dim_values(node, 1, "shape")
        if target is None:
            raise ModelError(f"{node.describe()}: the shape input is required")
        text = _shape_text(target)
        allowzero = int(attr(node, "allowzero"))
        out: list[Dim | None] = []
        for i, d in enumerate(target):
            if isinstance(d, int) and d == 0 and not allowzero:
                if i >= x.type.rank:
                    raise ModelError(f"{node.describe()}: shape entry {i} is 0 (copy) but the "
                                     f"input has rank {x.type.rank}")
                out.append(x.type.shape[i])
            elif isinstance(d, int) and d == -1:
                out.append(None)
            elif isinstance(d, int) and d < 0:
                raise ModelError(f"{node.describe()}: invalid shape entry {d} in {text}")
            else:
                if not isinstance(d, int):
                    # a computed entry that were 0 or -1 at run time would mean copy/infer
                    ctx.require(node, sympy.Ge(d, 1), f"shape entry {i} ({d}) must be at least 1")
                out.append(d)
        if out.count(None) > 1:
            raise ModelError(f"{node.describe()}: more than one -1 in shape {text}")
        total = x.type.numel
        known = numel(d for d in out if d is not None)
        if None in out:
            if isinstance(known, int) and known == 0:
                raise ModelError(f"{node.describe()}: cannot infer -1 in {text}: the other "
                                 "entries multiply to 0")
            inferred = simplify_dim(sympy.cancel(sympy.sympify(total) / known))
            if not isinstance(inferred, int) and inferred.is_integer is not True:
                # a quotient such as 12*batch/seq: exact when the division leaves no remainder
                _num, den = sympy.fraction(sympy.together(sympy.sympify(inferred)))
                if not den.is_Integer:
                    raise UnsupportedOpError(
                        f"{node.describe()}: the -1 in shape {text} is {inferred} for input "
                        f"{x.type}, a division by input dims that cuvil cannot compute; pin the "
                        "dims in the model's `inputs`")
            out[out.index(None)] = inferred
            ctx.require(node, sympy.Eq(sympy.Mod(total, known), 0),
                        f"input {x.type} does not reshape to {text}: {total} elements are "
                        f"not a multiple of {known}")
        else:
            ctx.dims_equal(node, total, known, f"element count of input {x.type} vs shape {text}")
        return [TensorType(x.type.dtype, tuple(out))]


def _axes_input(node: Node, since_input: int) -> list[int] | None:
    if node.opset >= since_input:
        return _int_values(node, 1, "axes")
    axes = attr(node, "axes")
    return None if axes is None else [int(a) for a in np.reshape(axes, -1)]


@register
class Squeeze(Copy):
    op_type = "Squeeze"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        axes_raw = _axes_input(node, 13)
        shape = x.type.shape
        if axes_raw is None:
            # only dims known to be 1 are squeezed: a symbolic dim stays (pin it to 1 to drop it)
            axes = {a for a, d in enumerate(shape) if d == 1}
        else:
            axes = {normalize_axis(node, a, len(shape)) for a in axes_raw}
        for a in axes:
            ctx.dims_equal(node, shape[a], 1, f"squeezed axis {a}")
        return [TensorType(x.type.dtype, tuple(d for a, d in enumerate(shape) if a not in axes))]


@register
class Unsqueeze(Copy):
    op_type = "Unsqueeze"

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        axes_raw = _axes_input(node, 13)
        if axes_raw is None:
            raise ModelError(f"{node.describe()}: axes are required")
        rank = x.type.rank + len(axes_raw)
        axes = sorted(normalize_axis(node, a, rank) for a in axes_raw)
        if len(set(axes)) != len(axes):
            raise ModelError(f"{node.describe()}: axes {axes_raw} repeat an axis")
        shape = list(x.type.shape)
        for a in axes:
            shape.insert(a, 1)
        return [TensorType(x.type.dtype, tuple(shape))]


# -- permutations ---------------------------------------------------------------------------


def _collapse_perm(shape: Sequence[Dim], perm: Sequence[int]) -> tuple[list[Dim], list[int]]:
    """Drop size-1 axes and merge input axes that stay adjacent and in order in `perm`."""
    keep = [a for a in range(len(shape)) if not (isinstance(shape[a], int) and shape[a] == 1)]
    renum = {a: i for i, a in enumerate(keep)}
    shape = [shape[a] for a in keep]
    perm = [renum[p] for p in perm if p in renum]
    groups: list[list[int]] = []  # runs of input axes, in output order
    for p in perm:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])  # groups in input order
    new_shape = [numel(shape[a] for a in groups[g]) for g in order]
    position = {g: i for i, g in enumerate(order)}
    return new_shape, [position[g] for g in range(len(groups))]


#: tile edge of a transpose (elements of 4 bytes or more; twice as many of smaller ones)
_TILE = 16
#: output elements along its rows that one task of a transpose moves, tile by tile
_CHUNK = 256
#: a transpose with a contiguous axis this short or shorter moves element by element
_SHORT = 8
#: a transpose's lines this many bytes apart (or a multiple) share one set of an L1 cache
_ALIASED = 2048
#: bytes of whole rows one task of a transpose that keeps the innermost axis copies
_ROW_BYTES = 64 * 1024


def emit_permute(k: Emitter, src: ir.Value, dst: ir.Value, dtype: np.dtype,
                 in_shape: Sequence[Dim], perm: Sequence[int]) -> None:
    """dst = transpose(src viewed as row-major `in_shape`, perm), both dense row-major."""
    dtype = np.dtype(dtype)
    shape, perm = _collapse_perm(in_shape, perm)
    rank = len(shape)
    if rank <= 1 or perm == list(range(rank)):
        k.memcpy(dst, src, k.dim(simplify_dim(numel(in_shape) * dtype.itemsize)))
        return
    out_shape = [shape[p] for p in perm]
    x = k.contiguous(src, dtype, shape)
    y = k.contiguous(dst, dtype, out_shape)
    last = rank - 1
    if perm[-1] == last:
        # the innermost axis stays innermost: copy whole rows, a stretch of about _ROW_BYTES
        # per task for the threads (a transformer's [seq, batch, 3, hidden] -> [3, seq,
        # batch, hidden] ran on one thread: 4% of a batch-8 encoder at 2 threads)
        row = simplify_dim(shape[last] * dtype.itemsize)
        rows = simplify_dim(numel(out_shape[:-1]))
        per_task = max(1, _ROW_BYTES // row) if isinstance(row, int) else 1
        tasks = simplify_dim((rows + per_task - 1) // per_task)
        with k.parallel_loop(tasks, cost=per_task * (row if isinstance(row, int) else 64),
                             name="rows", carry=[src, dst]) as t:
            xv = k.contiguous(k.carried[0], dtype, shape)
            yv = k.contiguous(k.carried[1], dtype, out_shape)
            first = k.b.mul(t, k.i64(per_task))
            with k.loop(_min(k, k.b.add(first, k.i64(per_task)), k.dim(rows)), start=first,
                        name="r") as r:
                idx = k.unravel(r, out_shape[:-1])
                src_idx: list[ir.Value] = [k.i64(0)] * rank
                for o, i in enumerate(idx):
                    src_idx[perm[o]] = i
                src_ptr = k.element_ptr(xv, k.offset(xv, src_idx))
                dst_ptr = k.element_ptr(yv, k.offset(yv, [*idx, k.i64(0)]))
                k.memcpy(dst_ptr, src_ptr, k.dim(row))
        return
    a = perm.index(last)  # the output axis holding the input's contiguous axis
    outer_axes = [o for o in range(rank) if o not in (a, last)]

    def move(x: View, y: View, out_idx: list[ir.Value]) -> None:
        src_idx = [k.i64(0)] * rank
        for o in range(rank):
            src_idx[perm[o]] = out_idx[o]
        k.store(y, out_idx, k.load(x, src_idx))

    short = [d for d in (out_shape[a], out_shape[last]) if isinstance(d, int) and d <= _SHORT]
    if short:
        # one of the two contiguous axes has a few elements (an image's channels): loop over
        # it innermost, so the lines the other side touches stay in cache across the next
        # outer iteration
        inner = a if out_shape[a] == min(short) else last
        order = [*outer_axes, last if inner == a else a, inner]
        with k.loops([out_shape[o] for o in order], name="t") as idx:
            out_idx: list[ir.Value] = [k.i64(0)] * rank
            for o, i in zip(order, idx):
                out_idx[o] = i
            move(x, y, out_idx)
        return
    # Tiles of up to _TILE x _TILE elements: the input's _TILE lines (along its contiguous
    # axis, output axis a) and the output's stay in L1 while a tile moves, where a whole row
    # at a time touched a line per element on one side (a [1024, 64] -> [64, 1024] transpose
    # wrote 64 lines 4 KB apart, all in one cache set). Tasks for the threads: a block of
    # _TILE along a and a stretch of _CHUNK along the output's rows, per outer index.
    # Within a tile the inner loop reads the input along its contiguous axis and writes the
    # output _TILE lines apart, unless the output's lines lie a multiple of _ALIASED bytes
    # apart and the input's do not: those would share a cache set, and a tile's _TILE lines
    # would not fit its ways ([8, 256, 100] -> [100, 8, 256], lines 8 KB apart, ran 7x slower
    # than onnxruntime). The loop then runs along the output's rows instead.
    tile = _TILE if dtype.itemsize >= 4 else _TILE * 2
    outer_dims = [out_shape[o] for o in outer_axes]
    da, dl = out_shape[a], out_shape[last]
    a_blocks = (da + tile - 1) // tile
    l_chunks = (dl + _CHUNK - 1) // _CHUNK
    tasks = simplify_dim(numel(outer_dims) * a_blocks * l_chunks)
    with k.parallel_loop(tasks, cost=tile * _CHUNK, name="perm", carry=[src, dst]) as t:
        src_c, dst_c = k.carried
        b = k.b
        xv = k.contiguous(src_c, dtype, shape)
        yv = k.contiguous(dst_c, dtype, out_shape)
        da_v, dl_v = k.dim(da), k.dim(dl)
        a_blocks_v, l_chunks_v = k.dim(a_blocks), k.dim(l_chunks)
        rest, chunk = b.sdiv(t, l_chunks_v), b.srem(t, l_chunks_v)
        outer_flat, block = b.sdiv(rest, a_blocks_v), b.srem(rest, a_blocks_v)
        outer = k.unravel(outer_flat, outer_dims)
        ia0 = b.mul(block, k.i64(tile))
        ia_end = _min(k, b.add(ia0, k.i64(tile)), da_v)
        l_start = b.mul(chunk, k.i64(_CHUNK))
        l_stop = _min(k, b.add(l_start, k.i64(_CHUNK)), dl_v)
        aliased = [b.icmp_signed("==", b.srem(k.dim(simplify_dim(stride * dtype.itemsize)),
                                              k.i64(_ALIASED)), k.i64(0))
                   for stride in (numel(out_shape[a + 1:]), numel(shape[perm[last] + 1:]))]
        along_output = b.and_(aliased[0], b.not_(aliased[1]))

        def tile_loops(inner_a: bool) -> None:
            """The tiles of this task; in each, axis a innermost (or the output's last)."""
            with k.loop(l_stop, start=l_start, step=tile, name="tl") as il0:
                spans = {a: (ia_end, ia0), last: (_min(k, b.add(il0, k.i64(tile)), l_stop), il0)}
                first, second = (last, a) if inner_a else (a, last)
                with k.loop(*spans[first], name="ji") as i, k.loop(*spans[second], name="jj") as j:
                    out_idx = [k.i64(0)] * rank
                    for o, v in zip(outer_axes, outer):
                        out_idx[o] = v
                    out_idx[first], out_idx[second] = i, j
                    move(xv, yv, out_idx)

        with b.if_else(along_output) as (then, otherwise):
            with then:
                tile_loops(inner_a=False)
            with otherwise:
                tile_loops(inner_a=True)


def _min(k: Emitter, a: ir.Value, b: ir.Value) -> ir.Value:
    return k.b.select(k.b.icmp_signed("<", a, b), a, b)


def _max(k: Emitter, a: ir.Value, b: ir.Value) -> ir.Value:
    return k.b.select(k.b.icmp_signed(">", a, b), a, b)


@register
class Transpose(Op):
    op_type = "Transpose"
    dtypes = DTYPES

    def _perm(self, node: Node, rank: int) -> list[int]:
        perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
        perm = [p + rank if p < 0 else p for p in perm]
        if sorted(perm) != list(range(rank)):
            raise ModelError(f"{node.describe()}: perm {perm} is not a permutation of 0..{rank - 1}")
        return perm

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        perm = self._perm(node, x.type.rank)
        return [TensorType(x.type.dtype, tuple(x.type.shape[p] for p in perm))]

    def aliases_input(self, node: Node) -> bool:
        # the axes longer than 1 keep their order ([seq, 1, hidden] -> [1, seq, hidden]): the
        # bytes do not move
        x = required_input(node, 0)
        shape, perm = _collapse_perm(x.type.shape, self._perm(node, x.type.rank))
        return perm == list(range(len(shape)))

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        emit_permute(k, k.buffers[x], k.buffers[node.outputs[0]], x.type.dtype, x.type.shape,
                     self._perm(node, x.type.rank))


class _BlockRearrange(Op):
    """DepthToSpace and SpaceToDepth: a reshape, a transpose and a reshape."""

    dtypes = DTYPES

    def geometry(self, node: Node, ctx: InferContext) -> tuple[list[Dim], list[int], TensorType]:
        raise NotImplementedError

    def _block(self, node: Node) -> tuple[Value, int]:
        x = required_input(node, 0)
        if x.type.rank != 4:
            raise ModelError(f"{node.describe()}: input must be 4-D (NCHW), got {x.type}")
        b = int(attr(node, "blocksize"))
        if b < 1:
            raise ModelError(f"{node.describe()}: blocksize must be at least 1, got {b}")
        return x, b

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [self.geometry(node, ctx)[2]]

    def lower(self, node: Node, k: Emitter) -> None:
        shape, perm, _ = self.geometry(node, UNCHECKED)
        x = required_input(node, 0)
        emit_permute(k, k.buffers[x], k.buffers[node.outputs[0]], x.type.dtype, shape, perm)


def _divide(node: Node, ctx: InferContext, d: Dim, b: int, what: str) -> Dim:
    if isinstance(d, int):
        if d % b:
            raise ModelError(f"{node.describe()}: {what} {d} is not a multiple of {b}")
        return d // b
    ctx.require(node, sympy.Eq(sympy.Mod(d, b), 0), f"{what} ({d}) must be a multiple of {b}")
    return simplify_dim(d / b)


@register
class DepthToSpace(_BlockRearrange):
    op_type = "DepthToSpace"

    def geometry(self, node: Node, ctx: InferContext) -> tuple[list[Dim], list[int], TensorType]:
        x, b = self._block(node)
        n, c, h, w = x.type.shape
        c2 = _divide(node, ctx, c, b * b, "the channel count")
        mode = attr(node, "mode")
        if mode == "DCR":
            shape, perm = [n, b, b, c2, h, w], [0, 3, 4, 1, 5, 2]
        elif mode == "CRD":
            shape, perm = [n, c2, b, b, h, w], [0, 1, 4, 2, 5, 3]
        else:
            raise ModelError(f"{node.describe()}: mode must be DCR or CRD, got {mode!r}")
        return shape, perm, TensorType(x.type.dtype, (n, c2, h * b, w * b))


@register
class SpaceToDepth(_BlockRearrange):
    op_type = "SpaceToDepth"

    def geometry(self, node: Node, ctx: InferContext) -> tuple[list[Dim], list[int], TensorType]:
        x, b = self._block(node)
        n, c, h, w = x.type.shape
        h2 = _divide(node, ctx, h, b, "the height")
        w2 = _divide(node, ctx, w, b, "the width")
        # the onnx reference orders the new channels (row in block, column in block, channel)
        mode = attr(node, "mode")
        if mode == "DCR":
            perm = [0, 3, 5, 1, 2, 4]
        elif mode == "CRD":
            perm = [0, 1, 3, 5, 2, 4]
        else:
            raise ModelError(f"{node.describe()}: mode must be DCR or CRD, got {mode!r}")
        return ([n, c, h2, b, w2, b], perm,
                TensorType(x.type.dtype, (n, simplify_dim(c * b * b), h2, w2)))


# -- joins and cuts -------------------------------------------------------------------------


#: bytes per task of a parallel copy: large enough to amortise claiming it, small enough
#: that a megabyte splits into many
COPY_PIECE = 32768


def _copy_rows(k: Emitter, dst: ir.Value, dst_row: Dim, dst_col: Dim, src: ir.Value,
               src_row: Dim, src_col: Dim, outer: Dim, nbytes: Dim) -> None:
    """For o in range(outer): copy `nbytes` from src[o*src_row + src_col] to dst[o*dst_row +
    dst_col] (all in bytes)."""
    if isinstance(nbytes, int) and nbytes == 0:
        return
    # the rows cut into pieces of at most COPY_PIECE bytes, spread over the threads (a
    # Concat of two feature maps at batch 1 is one row of a megabyte)
    b = k.b
    size = k.dim(nbytes)
    pieces = b.add(k.floordiv(b.sub(size, k.i64(1)), k.i64(COPY_PIECE)), k.i64(1))
    # a byte copied costs about half a multiply-add (the pool's unit of work)
    cost = b.add(k.floordiv(k.minimum("int64", size, k.i64(COPY_PIECE)), k.i64(2)), k.i64(1))
    with k.parallel_loop(b.mul(k.dim(outer), pieces), cost=cost, name="piece",
                         carry=[pieces, src, dst]) as i:
        pieces_, src_, dst_ = k.carried
        bb = k.b
        o = bb.sdiv(i, pieces_)
        start = bb.mul(bb.srem(i, pieces_), k.i64(COPY_PIECE))
        length = k.minimum("int64", bb.sub(k.dim(nbytes), start), k.i64(COPY_PIECE))
        s_view = k.contiguous(src_, np.dtype(np.uint8), (outer, src_row))
        d_view = k.contiguous(dst_, np.dtype(np.uint8), (outer, dst_row))
        s = k.element_ptr(s_view, bb.add(k.offset(s_view, [o, start]), k.dim(src_col)))
        d = k.element_ptr(d_view, bb.add(k.offset(d_view, [o, start]), k.dim(dst_col)))
        k.memcpy(d, s, length)


@register
class Concat(Op):
    op_type = "Concat"
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        ins = [v for v in node.inputs if v is not None]
        if not ins:
            raise ModelError(f"{node.describe()}: needs at least one input")
        rank = ins[0].type.rank
        axis = normalize_axis(node, int(node.attrs["axis"]), rank)
        shape = list(ins[0].type.shape)
        for v in ins[1:]:
            if v.type.rank != rank or v.type.dtype != ins[0].type.dtype:
                raise ModelError(f"{node.describe()}: inputs {ins[0].type} and {v.type} differ "
                                 "in rank or dtype")
            for a in range(rank):
                if a != axis:
                    ctx.dims_equal(node, shape[a], v.type.shape[a], f"axis {a}")
            shape[axis] = simplify_dim(shape[axis] + v.type.shape[axis])
        return [TensorType(ins[0].type.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        y_val = node.outputs[0]
        rank = y_val.type.rank
        axis = normalize_axis(node, int(node.attrs["axis"]), rank)
        outer = numel(y_val.type.shape[:axis])
        itemsize = y_val.type.dtype.itemsize
        row_y = simplify_dim(numel(y_val.type.shape[axis:]) * itemsize)
        offset: Dim = 0
        for v in node.inputs:
            if v is None:
                continue
            chunk = simplify_dim(numel(v.type.shape[axis:]) * itemsize)
            _copy_rows(k, k.buffers[y_val], row_y, offset, k.buffers[v], chunk, 0, outer, chunk)
            offset = simplify_dim(offset + chunk)


@register
class Split(Op):
    op_type = "Split"
    dtypes = DTYPES

    def sizes(self, node: Node, ctx: InferContext) -> tuple[int, list[Dim]]:
        x = required_input(node, 0)
        axis = normalize_axis(node, int(attr(node, "axis", 0)), x.type.rank)  # Split-1 states no default
        d = x.type.shape[axis]
        n_out = len(node.outputs)
        split: list[Dim] | None
        if node.opset >= 13:
            split = _dim_values(node, 1, "split")
        else:
            raw = attr(node, "split")
            split = None if raw is None else [int(s) for s in raw]
        if split is not None:
            if len(split) != n_out:
                raise ModelError(f"{node.describe()}: split {_shape_text(split)} has "
                                 f"{len(split)} entries for {n_out} outputs")
            for s in split:
                if isinstance(s, int) and s < 0:
                    raise ModelError(f"{node.describe()}: negative split size {s}")
            ctx.dims_equal(node, simplify_dim(sum(split, sympy.Integer(0))), d,
                           f"sum of split sizes {_shape_text(split)} vs axis {axis} of {x.type}")
            return axis, split
        num = attr(node, "num_outputs")
        parts = int(num) if num is not None else n_out
        if num is not None and parts != n_out:
            raise ModelError(f"{node.describe()}: num_outputs is {parts} but the node has "
                             f"{n_out} outputs")
        if isinstance(d, int):
            if num is None:
                if d % parts:
                    raise ModelError(f"{node.describe()}: axis {axis} ({d}) does not split into "
                                     f"{parts} equal parts")
                return axis, [d // parts] * parts
            chunk = -(-d // parts)
            if d - (parts - 1) * chunk < 0:
                raise ModelError(f"{node.describe()}: axis {axis} ({d}) cannot split into "
                                 f"{parts} parts of {chunk} and a smaller last one")
            return axis, [chunk] * (parts - 1) + [d - (parts - 1) * chunk]
        if num is None:
            ctx.require(node, sympy.Eq(sympy.Mod(d, parts), 0),
                        f"axis {axis} ({d}) must split into {parts} equal parts")
            return axis, [simplify_dim(d / parts)] * parts
        # opset 18's num_outputs: chunks of ceil(d / parts), the last one smaller
        chunk = simplify_dim(sympy.ceiling(sympy.sympify(d) / parts))
        last = simplify_dim(d - (parts - 1) * chunk)
        ctx.require(node, sympy.Ge(last, 0), f"axis {axis} ({d}) must split into {parts} parts "
                    f"of {chunk} and a smaller last one")
        return axis, [chunk] * (parts - 1) + [last]

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        axis, split = self.sizes(node, ctx)
        shape = list(x.type.shape)
        return [TensorType(x.type.dtype, (*shape[:axis], s, *shape[axis + 1:]))
                for s in split]

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        axis, split = self.sizes(node, UNCHECKED)
        itemsize = x.type.dtype.itemsize
        outer = numel(x.type.shape[:axis])
        inner = numel(x.type.shape[axis + 1:])
        row_x = simplify_dim(numel(x.type.shape[axis:]) * itemsize)
        offset: Dim = 0
        for v, s in zip(node.outputs, split):
            chunk = simplify_dim(s * inner * itemsize)
            _copy_rows(k, k.buffers[v], chunk, 0, k.buffers[x], row_x, offset, outer, chunk)
            offset = simplify_dim(offset + chunk)


def _slice_axis(node: Node, start: Dim, end: Dim, step: int, d: Dim) -> tuple[Dim, Dim]:
    """ONNX Slice on one axis of size d: (first index read, number of elements)."""

    def normalize(v: Dim, lo: Dim, hi: Dim, what: str) -> Dim:
        if isinstance(v, int) and v >= _HUGE:
            return hi
        if isinstance(v, int) and v <= -_HUGE:
            return lo
        if _sign(node, v, what) < 0:
            v = simplify_dim(v + d)
        return simplify_dim(sympy.Min(sympy.Max(v, lo), hi))

    if step > 0:
        s = normalize(start, 0, d, "a start")
        e = normalize(end, 0, d, "an end")
        n = sympy.Max(sympy.ceiling(sympy.sympify(e - s) / step), 0)
    else:
        s = normalize(start, 0, simplify_dim(d - 1), "a start")
        e = normalize(end, -1, simplify_dim(d - 1), "an end")
        n = sympy.Max(sympy.ceiling(sympy.sympify(s - e) / -step), 0)
    return s, simplify_dim(n)


@register
class Slice(Op):
    op_type = "Slice"
    dtypes = DTYPES

    def geometry(self, node: Node) -> tuple[list[Dim], list[int], list[Dim]]:
        """(start, step, output length) per axis of the input."""
        x = required_input(node, 0)
        rank = x.type.rank
        if node.opset >= 10:
            starts = _dim_values(node, 1, "starts")
            ends = _dim_values(node, 2, "ends")
            axes = _int_values(node, 3, "axes")
            steps = _int_values(node, 4, "steps")
        else:
            starts = [int(v) for v in attr(node, "starts")]
            ends = [int(v) for v in attr(node, "ends")]
            axes = attr(node, "axes")
            axes = None if axes is None else [int(a) for a in axes]
            steps = None
        if starts is None or ends is None or len(starts) != len(ends):
            raise ModelError(f"{node.describe()}: starts and ends must be given with one entry "
                             "per sliced axis")
        axes = list(range(len(starts))) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        if len(axes) != len(starts) or len(steps) != len(starts):
            raise ModelError(f"{node.describe()}: starts, ends, axes and steps differ in length")
        first: list[Dim] = [0] * rank
        step_of = [1] * rank
        length = list(x.type.shape)
        seen = set()
        for s, e, a, st in zip(starts, ends, axes, steps):
            a = normalize_axis(node, a, rank)
            if a in seen:
                raise ModelError(f"{node.describe()}: axis {a} is sliced twice")
            seen.add(a)
            if st == 0:
                raise ModelError(f"{node.describe()}: step 0 on axis {a}")
            first[a], length[a] = _slice_axis(node, s, e, st, x.type.shape[a])
            step_of[a] = st
        return first, step_of, length

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        return [TensorType(x.type.dtype, tuple(self.geometry(node)[2]))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        y_val = node.outputs[0]
        first, steps, length = self.geometry(node)
        in_shape = x_val.type.shape
        rank = len(in_shape)
        # axes from `j` on are read as one contiguous run per output row: a suffix of whole
        # axes, plus the axis before it when that one has step 1
        def whole(a: int) -> bool:
            return steps[a] == 1 and first[a] == 0 and \
                sympy.sympify(length[a] - in_shape[a]) == 0

        j = rank
        while j > 0 and whole(j - 1):
            j -= 1
        if j > 0 and steps[j - 1] == 1:
            j -= 1
        x = k.view(x_val)
        itemsize = x_val.type.dtype.itemsize
        y = k.view(y_val)
        starts = [k.dim(f) for f in first]
        if j < rank:
            run = simplify_dim(numel(length[j:]) * itemsize)
            with k.loops(length[:j], name="s") as idx:
                src = [k.b.add(starts[a], k.b.mul(idx[a], k.i64(steps[a]))) for a in range(j)]
                src += starts[j:]
                zeros = [k.i64(0)] * (rank - j)
                k.memcpy(k.element_ptr(y, k.offset(y, [*idx, *zeros])),
                         k.element_ptr(x, k.offset(x, src)), k.dim(run))
            return
        with k.loops(length, name="s") as idx:
            src = [k.b.add(starts[a], k.b.mul(idx[a], k.i64(steps[a]))) for a in range(rank)]
            k.store(y, idx, k.load(x, src))


@register
class Pad(Op):
    op_type = "Pad"
    since = 1
    dtypes = DTYPES

    def geometry(self, node: Node) -> tuple[str, list[Dim], list[Dim]]:
        """(mode, pads at the start of each axis, pads at the end)."""
        x = required_input(node, 0)
        rank = x.type.rank
        mode = attr(node, "mode")
        if mode not in ("constant", "reflect", "edge", "wrap"):
            raise UnsupportedOpError(f"{node.describe()}: mode {mode!r} is not supported")
        if node.opset >= 11:
            pads = _dim_values(node, 1, "pads")
            axes = _int_values(node, 3, "axes") if node.opset >= 18 else None
        else:
            raw = node.attrs.get("pads", node.attrs.get("paddings"))
            pads = None if raw is None else [int(p) for p in raw]
            axes = None
        if pads is None:
            raise ModelError(f"{node.describe()}: pads are required")
        axes = list(range(rank)) if axes is None else [normalize_axis(node, a, rank) for a in axes]
        if len(pads) != 2 * len(axes):
            raise ModelError(f"{node.describe()}: {len(pads)} pads for {len(axes)} axes (want "
                             f"{2 * len(axes)})")
        begin: list[Dim] = [0] * rank
        end: list[Dim] = [0] * rank
        for i, a in enumerate(axes):
            begin[a], end[a] = pads[i], pads[i + len(axes)]
        return mode, begin, end

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        mode, begin, end = self.geometry(node)
        shape = []
        for a, d in enumerate(x.type.shape):
            out = simplify_dim(d + begin[a] + end[a])
            ctx.require(node, sympy.Ge(out, 0), f"axis {a} ({d}) padded by {begin[a]}, {end[a]} "
                        "is negative")
            if mode != "constant" and not (begin[a] == 0 and end[a] == 0):
                kept = d - sympy.Max(-sympy.sympify(begin[a]), 0) - sympy.Max(-sympy.sympify(end[a]), 0)
                ctx.require(node, sympy.Ge(kept, 1), f"{mode} padding needs a non-empty axis {a} "
                            "(after negative pads crop it)")
            shape.append(out)
        if node.opset >= 11 and node.input(2) is not None:
            cv = node.input(2)
            assert cv is not None
            if cv.type.dtype != x.type.dtype or cv.type.numel != 1:
                raise ModelError(f"{node.describe()}: constant_value must be one {x.type.dtype} "
                                 f"value, got {cv.type}")
        return [TensorType(x.type.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        x_val = required_input(node, 0)
        y_val = node.outputs[0]
        mode, begin, end = self.geometry(node)
        dtype = x_val.type.dtype
        x, y = k.view(x_val), k.view(y_val)
        rank = x.rank
        if rank == 0:
            k.store(y, [], k.load(x, []))
            return
        if mode == "constant":
            if node.opset >= 11 and node.input(2) is not None:
                cv = node.input(2)
                assert cv is not None
                fill = k.load(k.view(cv), [k.i64(0)] * cv.type.rank)
            else:
                fill = k.const(dtype, float(attr(node, "value") or 0.0))
        # negative pads crop first; the other modes then read only the cropped region (as
        # onnxruntime does): region of axis a = input[crop[a] : crop[a] + size[a]]
        pb = [k.dim(sympy.Max(b, 0)) for b in begin]
        crop = [k.dim(sympy.Max(-sympy.sympify(b), 0)) for b in begin]
        size = [k.dim(simplify_dim(d - sympy.Max(-sympy.sympify(b), 0)
                                   - sympy.Max(-sympy.sympify(e), 0)))
                for d, b, e in zip(x_val.type.shape, begin, end)]
        zero = k.i64(0)

        def source(a: int, o: ir.Value) -> ir.Value:
            """The input index output index o reads on axis a (for non-constant modes)."""
            i = k.b.sub(o, pb[a])
            d = size[a]
            if mode == "edge":
                i = _min(k, _max(k, i, zero), k.b.sub(d, k.i64(1)))
            elif mode == "wrap":
                i = _mod(k, i, d)
            else:
                # reflect: period 2(d-1); a single element reflects onto itself
                period = _max(k, k.b.mul(k.i64(2), k.b.sub(d, k.i64(1))), k.i64(1))
                m = _mod(k, i, period)
                i = _min(k, m, k.b.sub(period, m))
            return k.b.add(i, crop[a])

        last = rank - 1
        out_last = y.dims[last]
        with k.loops(y.dims[:last], name="p") as idx:
            src: list[ir.Value] = []
            inside = None
            for a, o in enumerate(idx):
                if mode == "constant":
                    i = k.b.sub(o, pb[a])
                    ok = k.b.and_(k.b.icmp_signed(">=", i, zero), k.b.icmp_signed("<", i, size[a]))
                    inside = ok if inside is None else k.b.and_(inside, ok)
                    src.append(k.b.add(i, crop[a]))
                else:
                    src.append(source(a, o))
            # inner axis: [0, lo) padding, [lo, hi) the input row, [hi, out) padding
            lo = _min(k, pb[last], out_last)
            hi = _min(k, k.b.add(pb[last], size[last]), out_last)
            shift = k.b.sub(crop[last], pb[last])

            def body_inner() -> None:
                with k.loop(hi, start=lo, name="mid") as o:
                    k.store(y, [*idx, o], k.load(x, [*src, k.b.add(o, shift)]))
                for start, stop in ((zero, lo), (hi, out_last)):
                    with k.loop(stop, start=start, name="pad") as o:
                        if mode == "constant":
                            k.store(y, [*idx, o], fill)
                        else:
                            k.store(y, [*idx, o], k.load(x, [*src, source(last, o)]))

            if inside is None:
                body_inner()
            else:
                with k.b.if_else(inside) as (then, otherwise):
                    with then:
                        body_inner()
                    with otherwise, k.loop(out_last, name="fill") as o:
                        k.store(y, [*idx, o], fill)


def _mod(k: Emitter, a: ir.Value, b: ir.Value) -> ir.Value:
    """Python's a % b for b > 0."""
    r = k.b.srem(a, b)
    return k.b.select(k.b.icmp_signed("<", r, k.i64(0)), k.b.add(r, b), r)


def _reinterpret(k: Emitter, value: Value, shape: Sequence[Dim]) -> Value:
    """A stand-in for `value`'s buffer seen with another (same-size) shape."""
    alias = Value(value.name, TensorType(value.type.dtype, tuple(shape)))
    k.buffers[alias] = k.buffers[value]
    return alias


@register
class Expand(Op):
    op_type = "Expand"
    since = 8
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        shape = _dim_values(node, 1, "shape")
        if shape is None:
            raise ModelError(f"{node.describe()}: the shape input is required")
        for i, d in enumerate(shape):
            if isinstance(d, int) and d < 0:
                raise ModelError(f"{node.describe()}: shape entry {i} is {d}")
        return [TensorType(x.type.dtype, broadcast_shapes(node, ctx, x.type.shape, tuple(shape)))]

    def lower(self, node: Node, k: Emitter) -> None:
        emit_elementwise(k, node.outputs[0], [required_input(node, 0)], lambda k, xs: xs[0])


@register
class Tile(Op):
    op_type = "Tile"
    since = 6
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        x = required_input(node, 0)
        reps = _dim_values(node, 1, "repeats")
        if reps is None or len(reps) != x.type.rank:
            raise ModelError(f"{node.describe()}: repeats must have one entry per axis of {x.type}")
        for r in reps:
            if isinstance(r, int) and r < 0:
                raise ModelError(f"{node.describe()}: negative repeat {r}")
        return [TensorType(x.type.dtype, tuple(simplify_dim(d * r)
                                               for d, r in zip(x.type.shape, reps)))]

    def lower(self, node: Node, k: Emitter) -> None:
        x = required_input(node, 0)
        y = node.outputs[0]
        reps = _dim_values(node, 1, "repeats")
        assert reps is not None
        # y seen as [r0, d0, r1, d1, ...] is x seen as [1, d0, 1, d1, ...] broadcast
        y_shape: list[Dim] = []
        x_shape: list[Dim] = []
        for d, r in zip(x.type.shape, reps):
            y_shape += [r, d]
            x_shape += [1, d]
        emit_elementwise(k, _reinterpret(k, y, y_shape), [_reinterpret(k, x, x_shape)],
                         lambda k, xs: xs[0])


# -- tensors made from shapes ---------------------------------------------------------------


def _store_dims(k: Emitter, out: Value, values: Sequence[Dim]) -> None:
    """Write dims (ints or integer/rational expressions of the input dims) into `out`."""
    view = k.contiguous(k.buffers[out], out.type.dtype, (len(values),))
    dtype = out.type.dtype
    for i, v in enumerate(values):
        expr = sympy.sympify(v)
        num, den = sympy.fraction(sympy.together(expr))
        if den == 1 or dtype.kind != "f":
            value = k.convert(k.dim(simplify_dim(expr)), np.dtype(np.int64), dtype)
        else:
            value = k.b.fdiv(k.convert(k.dim(simplify_dim(num)), np.dtype(np.int64), dtype),
                             k.convert(k.dim(simplify_dim(den)), np.dtype(np.int64), dtype))
        k.store(view, [k.i64(i)], value)


@register
class SymbolicValue(Op):
    """A small tensor whose elements are dims computed from the input dims (made by the
    frontend from shape arithmetic such as ``Concat(Shape(x)[0:1], [-1])``)."""

    op_type = "SymbolicValue"
    domain = "cuvil"
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [node.outputs[0].type]

    def lower(self, node: Node, k: Emitter) -> None:
        out = node.outputs[0]
        assert out.sym_value is not None
        _store_dims(k, out, out.sym_value)


@register
class Shape(Op):
    """Shape is resolved by the frontend (`shape_values`); this rule also serves direct use."""

    op_type = "Shape"
    dtypes = DTYPES

    def _dims(self, node: Node) -> list[Dim]:
        shape = list(required_input(node, 0).type.shape)
        rank = len(shape)
        start = int(attr(node, "start")) if node.opset >= 15 else 0
        end = attr(node, "end") if node.opset >= 15 else None
        end = rank if end is None else int(end)
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        return shape[start:end]

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [TensorType(np.dtype(np.int64), (len(self._dims(node)),))]

    def lower(self, node: Node, k: Emitter) -> None:
        _store_dims(k, node.outputs[0], self._dims(node))


@register
class Size(Op):
    op_type = "Size"
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        return [TensorType(np.dtype(np.int64), ())]

    def lower(self, node: Node, k: Emitter) -> None:
        _store_dims(k, node.outputs[0], [required_input(node, 0).type.numel])


@register
class ConstantOfShape(Op):
    op_type = "ConstantOfShape"
    since = 9
    dtypes = DTYPES

    def _value(self, node: Node) -> np.ndarray:
        value = attr(node, "value")
        return np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        shape = _dim_values(node, 0, "shape")
        if shape is None:
            raise ModelError(f"{node.describe()}: the shape input is required")
        for i, d in enumerate(shape):
            if isinstance(d, int) and d < 0:
                raise ModelError(f"{node.describe()}: shape entry {i} is {d}")
            if not isinstance(d, int):
                ctx.require(node, sympy.Ge(d, 0), f"shape entry {i} ({d}) is negative")
        value = self._value(node)
        if value.size != 1 or value.dtype.name not in DTYPES:
            raise UnsupportedOpError(f"{node.describe()}: value must be one number of a dtype "
                                     f"cuvil supports, got {value.dtype} x{value.size}")
        return [TensorType(value.dtype, tuple(shape))]

    def lower(self, node: Node, k: Emitter) -> None:
        out = node.outputs[0]
        value = self._value(node)
        if not value.any():
            k.memset(k.buffers[out], 0, k.dim(out.type.nbytes))
            return
        flat = k.contiguous(k.buffers[out], out.type.dtype, (out.type.numel,))
        c = k.const(value.dtype, value.item() if value.dtype.kind != "b" else int(value.item()))
        with k.loop(flat.dims[0], name="c") as i:
            k.store(flat, [i], c)


@register
class EyeLike(Op):
    """A matrix of the input's shape with ones on diagonal k (0: main, > 0: above, < 0: below)
    and zeros elsewhere, of the `dtype` attribute's type (default: the input's)."""

    op_type = "EyeLike"
    since = 9
    dtypes = DTYPES

    def _target(self, node: Node) -> np.dtype:
        to = attr(node, "dtype")
        if to is None:
            return required_input(node, 0).type.dtype
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))
        except Exception:
            dtype = None
        if dtype is None or dtype.name not in DTYPES:
            raise UnsupportedOpError(f"{node.describe()}: dtype {to} is not one cuvil compiles "
                                     f"({', '.join(DTYPES)})")
        return dtype

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        x = required_input(node, 0)
        if x.type.rank != 2:
            raise ModelError(f"{node.describe()}: the input must be 2-D, got {x.type}")
        if not isinstance(attr(node, "k"), int):
            raise ModelError(f"{node.describe()}: k must be an integer, got {node.attrs['k']!r}")
        return [TensorType(self._target(node), x.type.shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        out = node.outputs[0]
        diag = int(attr(node, "k"))
        k.memset(k.buffers[out], 0, k.dim(out.type.nbytes))
        y = k.view(out)
        rows, cols = y.dims
        b = k.b
        # rows i with 0 <= i + diag < cols
        start = k.i64(max(-diag, 0))
        stop = b.sub(cols, k.i64(diag))
        stop = b.select(b.icmp_signed("<", rows, stop), rows, stop)
        one = k.const(out.type.dtype, 1)
        with k.loop(stop, start=start, name="d") as i:
            k.store(y, [i, b.add(i, k.i64(diag))], one)


@register
class Range(Op):
    op_type = "Range"
    since = 11
    dtypes = ("float32", "float64", "int16", "int32", "int64")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        dtype = required_input(node, 0).type.dtype
        if dtype.name not in self.dtypes:
            raise UnsupportedOpError(f"{node.describe()}: dtype {dtype.name}; cuvil compiles "
                                     f"Range for {', '.join(self.dtypes)}")
        parts = []
        for i, what in enumerate(("start", "limit", "delta")):
            v = node.input(i)
            if v is None or v.type.numel != 1 or v.type.dtype != dtype:
                raise ModelError(f"{node.describe()}: {what} must be a scalar of dtype {dtype}")
            values = const_or_symbolic_input(node, i, what)
            assert values is not None
            parts.append(sympy.sympify(values[0]))
        start, limit, delta = parts
        if not delta.is_number:
            raise UnsupportedOpError(f"{node.describe()}: delta is {delta}; cuvil needs a constant "
                                     "delta to size the output")
        if delta == 0:
            raise ModelError(f"{node.describe()}: delta is 0")
        count = simplify_dim(sympy.Max(sympy.ceiling((limit - start) / delta), 0))
        if not isinstance(count, int) and count.is_integer is not True:
            raise UnsupportedOpError(f"{node.describe()}: cannot compute the length {count}")
        return [TensorType(dtype, (count,))]

    def lower(self, node: Node, k: Emitter) -> None:
        out = node.outputs[0]
        dtype = out.type.dtype
        start_v = node.inputs[0]
        delta_v = node.inputs[2]
        assert start_v is not None and delta_v is not None
        start = k.load(k.view(start_v), [k.i64(0)] * start_v.type.rank)
        delta = k.load(k.view(delta_v), [k.i64(0)] * delta_v.type.rank)
        y = k.contiguous(k.buffers[out], dtype, (out.type.shape[0],))
        # accumulate like onnxruntime (value += delta), which float results depend on
        with k.b.goto_entry_block():
            if k.b.block.terminator is not None:
                k.b.position_before(k.b.block.terminator)
            acc = k.b.alloca(y.elem, name="acc")
        k.b.store(start, acc)
        with k.loop(y.dims[0], name="r") as i:
            value = k.b.load(acc, typ=y.elem)
            k.store(y, [i], value)
            k.b.store(k.add(dtype, value, delta), acc)


@register
class Constant(Op):
    """Constant nodes become constant values in the frontend; this rule types them."""

    op_type = "Constant"
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        value = node.outputs[0].const
        if value is None:
            raise ModelError(f"{node.describe()}: the Constant node has no supported value")
        return [TensorType(value.dtype, value.shape)]

