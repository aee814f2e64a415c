"""float32 transposed convolution as matrix products on the shared GEMM kernel, each followed
by a scatter of its columns into the output (col2im), as onnxruntime (MLAS) and oneDNN do.

For each image and group, C[Mg*K, P] = W_g^T[Mg*K, Cg] @ X[Cg, P], where K counts kernel taps
and P input positions: row (m, tap) of C holds what input position p gives output channel m
through that tap, y[m, p*s + tap*d - pad] += C[(m, tap), p]. ONNX stores the weight of group g
as [Cg, Mg*K] row-major, which is W_g^T stored column by column: the kernel reads it in place
(`Layout.a_columns`), so nothing is packed at compile time and weights given at run time work
the same way.

The work is one parallel loop over tasks of (image, group, block of output channels). A task
owns its channels' output planes: it fills them with the bias, copies its columns of W_g^T
into its slot of the scratch (when the kernel reads them more than once), then, chunk of
input rows by chunk, computes its rows of C (the block's channels x all taps, on one thread)
into its slot and adds them into its planes while both are in its cache. Read in place,
W_g^T's columns are Mg*K floats apart, often a multiple of 4 KB (192 channels x 16 taps:
12 KB), so every line a tile reads falls in the same few sets of L1 and L2 and is fetched
again for each row tile and panel; the copy, its columns as many apart as the task's rows, is
read once from memory and then from L2 (384 -> 192 channels over 16x16, 4x4 taps: the AVX2
copy 54 -> 91 GFLOP/s, AVX-512 98 -> 99). No two tasks write the same element, so nothing is
locked and the result does not depend on the threads. A fused activation
(passes/fuse_epilogue.py) runs over a task's planes once they are complete, while they are
still in its cache.
"""

from __future__ import annotations

import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, numel, simplify_dim
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import PTR, Emitter
from cuvil.compiler.kernels.gemm import Epilogue, Layout, emit_gemm
from cuvil.compiler.ops import required_input
from cuvil.compiler.ops._conv_gemm import (
    BATCH_SLOTS,
    F32,
    MAX_VECTOR_STRIDE,
    block_tasks,
    slot_blocks,
    whole_strided_vectors,
)
from cuvil.compiler.ops._window import TransposedWindow, ceil_div, clamp
from cuvil.compiler.ops.gemm import node_epilogue

#: input positions per chunk of C (whole input rows, at least this many): a task's slot of
#: the scratch holds its rows of C for one chunk, which stay in its cache until scattered
CHUNK_COLUMNS = 256
#: rows of C (channels x taps) a task computes at most: enough for the kernel's tiles to reuse
#: each loaded column of X many times, few enough to stay in cache with the chunk
TASK_ROWS = 128
#: with several threads, channels are cut into smaller tasks until each thread has this many
#: (a thread finishing last waits at most a third of its work for the others)
TASKS_PER_THREAD = 3


def _taps(node: Node) -> int:
    return int(numel(required_input(node, 1).type.shape[2:]))


def most_channels_per_task(node: Node) -> int:
    """The output channels of the largest task: about TASK_ROWS rows of C."""
    mg = int(required_input(node, 1).type.shape[1])
    return max(1, min(TASK_ROWS // _taps(node), mg))


def _chunk_floats(node: Node) -> Dim:
    """The most input positions one chunk of C covers (`CHUNK_COLUMNS` rounded up to whole
    input rows, at most the whole input)."""
    x = required_input(node, 0)
    inner = numel(x.type.shape[3:])
    return simplify_dim(sympy.Min(numel(x.type.shape[2:]), CHUNK_COLUMNS - 1 + inner))


def _input_channels(node: Node) -> int:
    """Cg, the input channels of a group (the products' K)."""
    return int(required_input(node, 1).type.shape[0]) // int(node.attrs.get("group", 1))


def _slot_floats(node: Node) -> Dim:
    """One task's rows of C for one chunk, then its copy of W_g^T's columns."""
    rows = most_channels_per_task(node) * _taps(node)
    return simplify_dim(rows * (sympy.sympify(_chunk_floats(node)) + _input_channels(node)))


def scratch_bytes(node: Node) -> Dim:
    """BATCH_SLOTS slots (`_slot_floats`)."""
    return simplify_dim(BATCH_SLOTS * 4 * sympy.sympify(_slot_floats(node)))


def lower_conv_transpose_gemm(node: Node, k: Emitter, win: TransposedWindow) -> None:
    x_val, w_val, b_val = required_input(node, 0), required_input(node, 1), node.input(2)
    y_val = node.outputs[0]
    b = k.b
    group = int(node.attrs.get("group", 1))
    cg, mg = _input_channels(node), int(w_val.type.shape[1])
    taps = _taps(node)
    most = most_channels_per_task(node)
    in_shape, out_shape = tuple(x_val.type.shape[2:]), tuple(y_val.type.shape[2:])
    images = k.dim(x_val.type.shape[0])
    # the largest tasks on one thread; on several, smaller ones until each thread has a few
    threads = k.parallel_threads()
    wanted = b.select(b.icmp_signed(">", threads, k.i64(1)),
                      b.mul(threads, k.i64(TASKS_PER_THREAD)), k.i64(1))
    per_task = k.floordiv(b.add(b.mul(images, k.i64(group * mg)), b.sub(wanted, k.i64(1))),
                          wanted)
    per_task = k.maximum("int64", k.minimum("int64", per_task, k.i64(most)), k.i64(1))
    blocks_per_group = k.floordiv(b.add(k.i64(mg), b.sub(per_task, k.i64(1))), per_task)
    tasks = b.mul(images, b.mul(blocks_per_group, k.i64(group)))
    # cost of a task: its rows of C times the input channels, and the scatter's adds
    task_cost = b.mul(b.mul(k.dim(numel(in_shape)), per_task), k.i64(taps * (cg + 1)))
    blocks, cost = slot_blocks(k, tasks, task_cost)
    null = ir.Constant(PTR, None)
    assert k.scratch is not None
    epilogue = node_epilogue(node)
    carry = [k.buffers[x_val], k.buffers[w_val], k.buffers[y_val],
             k.buffers[b_val] if b_val is not None else null, k.scratch, tasks, blocks,
             per_task, blocks_per_group]
    with k.parallel_loop(blocks, cost=cost, name="ctblock", carry=carry) as j:
        x_c, w_c, y_c, bias_c, scratch_c, tasks_c, blocks_c, per_task_c, per_group_c = k.carried
        bb = k.b
        slot = bb.gep(scratch_c, [bb.mul(k.task_first, k.dim(_slot_floats(node)))],
                      source_etype=F32)
        a_copy = bb.gep(slot, [bb.mul(k.dim(_chunk_floats(node)), k.i64(most * taps))],
                        source_etype=F32)
        in_plane_c, out_plane_c = k.dim(numel(in_shape)), k.dim(numel(out_shape))
        inner = k.dim(numel(in_shape[1:]))
        rows_per_chunk = bb.add(k.floordiv(k.i64(CHUNK_COLUMNS - 1), inner), k.i64(1))
        in0 = k.dim(in_shape[0])
        chunks = k.floordiv(bb.add(in0, bb.sub(rows_per_chunk, k.i64(1))), rows_per_chunk)
        # the copy of W_g^T pays when a chunk's columns make more than one panel of the
        # kernel (each reads the task's weights again); with one, they are read once anyway
        copy_w = bb.icmp_signed(">", k.minimum("int64", bb.mul(rows_per_chunk, inner), in_plane_c),
                                k.i64(k.target.isa.nr))
        lo, hi = block_tasks(k, j, blocks_c, tasks_c)
        with k.loop(hi, start=lo, name="ct") as t:
            plane_g = bb.sdiv(t, per_group_c)  # n * group + g
            g = bb.srem(plane_g, k.i64(group))
            oc0 = bb.mul(bb.srem(t, per_group_c), per_task_c)
            count = k.minimum("int64", bb.sub(k.i64(mg), oc0), per_task_c)
            y_t = bb.gep(y_c, [bb.mul(bb.add(bb.mul(plane_g, k.i64(mg)), oc0), out_plane_c)],
                         source_etype=F32)
            oc_first = bb.add(bb.mul(g, k.i64(mg)), oc0)
            _fill_bias(k, y_t, bias_c if b_val is not None else None, oc_first, count,
                       out_plane_c)
            x_g = bb.gep(x_c, [bb.mul(bb.mul(plane_g, k.i64(cg)), in_plane_c)], source_etype=F32)
            a = bb.gep(w_c, [bb.add(bb.mul(g, k.i64(cg * mg * taps)), bb.mul(oc0, k.i64(taps)))],
                       source_etype=F32)
            task_rows = bb.mul(count, k.i64(taps))
            with bb.if_then(copy_w), k.loop(k.i64(cg), name="wcopy") as ci:
                k.memcpy(bb.gep(a_copy, [bb.mul(ci, task_rows)], source_etype=F32),
                         bb.gep(a, [bb.mul(ci, k.i64(mg * taps))], source_etype=F32),
                         bb.mul(task_rows, k.i64(4)))
            a = bb.select(copy_w, a_copy, a)
            lda = bb.select(copy_w, task_rows, k.i64(mg * taps))
            with k.loop(chunks, name="chunk") as c:
                first = bb.mul(c, rows_per_chunk)
                rows = k.minimum("int64", bb.sub(in0, first), rows_per_chunk)
                width = bb.mul(rows, inner)
                emit_gemm(k, task_rows, width, k.i64(cg), a, lda,
                          bb.gep(x_g, [bb.mul(first, inner)], source_etype=F32), in_plane_c,
                          slot, width, layout=Layout(a_columns=True))
                _scatter(k, win, in_shape, slot, y_t, (count, out_plane_c), (first, rows, width))
            if epilogue.activation is not None:  # the task's planes are complete: in cache
                _activate(k, y_t, bb.mul(count, out_plane_c), epilogue)


def _activate(k: Emitter, y: ir.Value, count: ir.Value, epilogue: Epilogue) -> None:
    """y[:count] = the fused activation of itself (a loop LLVM vectorizes)."""
    b = k.b
    assert epilogue.activation is not None
    with k.loop(count, name="act") as i:
        at = b.gep(y, [i], source_etype=F32)
        b.store(apply_activation(b, epilogue.activation, epilogue.params, b.load(at, typ=F32)),
                at)


def _fill_bias(k: Emitter, y: ir.Value, bias: ir.Value | None, oc_first: ir.Value,
               count: ir.Value, plane: ir.Value) -> None:
    """count output planes from y on, each its channel's bias (or 0)."""
    b = k.b
    with k.loop(count, name="bc") as c:
        value = (b.load(b.gep(bias, [b.add(oc_first, c)], source_etype=F32), typ=F32)
                 if bias is not None else ir.Constant(F32, 0.0))
        row = b.gep(y, [b.mul(c, plane)], source_etype=F32)
        with k.loop(plane, name="bi") as i:
            b.store(value, b.gep(row, [i], source_etype=F32))


def _scatter(k: Emitter, win: TransposedWindow, in_shape: tuple[Dim, ...], cols: ir.Value,
             y: ir.Value, planes: tuple[ir.Value, ir.Value],
             chunk: tuple[ir.Value, ir.Value, ir.Value]) -> None:
    """y[c, o] += cols[(c, tap), p] for o = p*s + tap*d - pad inside the output, over input
    rows first..first+rows-1 of the first spatial axis (cols holds `width` of them)."""
    b = k.b
    count, out_plane = planes
    first, rows, width = chunk
    r = len(win.kernel)
    in_dims = [k.dim(d) for d in in_shape]
    out_dims = [k.dim(d) for d in win.out]
    taps = 1
    for t in win.kernel:
        taps *= t
    with k.loop(count, name="sc") as c, k.loops(win.kernel, name="tap") as tap:
        tap_index = k.i64(0)
        for a in range(r):
            tap_index = b.add(b.mul(tap_index, k.i64(win.kernel[a])), tap[a])
        row = b.gep(cols, [b.mul(b.add(b.mul(c, k.i64(taps)), tap_index), width)],
                    source_etype=F32)
        plane = b.gep(y, [b.mul(c, out_plane)], source_etype=F32)

        def nest(axis: int, src: ir.Value, dst: ir.Value) -> None:
            s = win.strides[axis]
            offset = b.sub(b.mul(tap[axis], k.i64(win.dilations[axis])),
                           k.dim(win.pads_begin[axis]))
            # valid p: 0 <= p*s + offset < out  ->  ceil(-offset/s) <= p < ceil((out-offset)/s)
            begin, end = (first, b.add(first, rows)) if axis == 0 else (k.i64(0), in_dims[axis])
            lo = clamp(k, ceil_div(k, b.neg(offset), s), begin, end)
            hi = clamp(k, ceil_div(k, b.sub(out_dims[axis], offset), s), lo, end)
            src_stride = k.dim(numel(in_shape[axis + 1:]))
            dst_stride = k.dim(numel(win.out[axis + 1:]))
            if axis < r - 1:
                with k.loop(hi, start=lo, name=f"p{axis}") as p:
                    local = b.sub(p, begin)
                    o = b.add(b.mul(p, k.i64(s)), offset)
                    nest(axis + 1, b.gep(src, [b.mul(local, src_stride)], source_etype=F32),
                         b.gep(dst, [b.mul(o, dst_stride)], source_etype=F32))
                return
            # the innermost axis: dst[p*s + offset] += src[p - begin] for lo <= p < hi
            _add_strided(k, b.gep(dst, [offset], source_etype=F32),
                         b.gep(src, [b.neg(begin)], source_etype=F32), s,
                         (lo, hi, out_dims[axis]), offset)

        nest(0, row, plane)


def _add_strided(k: Emitter, dst: ir.Value, src: ir.Value, stride: int,
                 span: tuple[ir.Value, ir.Value, ir.Value], offset: ir.Value) -> None:
    """dst[p*stride] += src[p] for lo <= p < hi, where dst + lo*stride .. lies in a row of
    `size` floats starting at dst - offset: in vectors while a vector's stride x lanes floats
    stay inside the row (other tasks' planes may follow it; strides up to MAX_VECTOR_STRIDE:
    a wide load, the column's lanes spread over it by a shuffle, the sum stored back), then
    one by one."""
    b = k.b
    lo, hi, size = span
    lanes = k.target.isa.vector
    p_vec = lo
    if stride <= MAX_VECTOR_STRIDE:
        wide = ir.VectorType(F32, lanes * stride)
        narrow = ir.VectorType(F32, lanes)
        # lane i*stride of the wide vector takes src lane i; the others a zero
        spread = ir.Constant(ir.VectorType(ir.IntType(32), lanes * stride),
                             [i // stride if i % stride == 0 else lanes for i in range(lanes * stride)])
        zero = ir.Constant(narrow, [0.0] * lanes)
        p_vec = whole_strided_vectors(k, (lo, hi), offset, stride, size)
        with k.loop(p_vec, start=lo, step=lanes, name="sv") as p:
            at = b.gep(dst, [b.mul(p, k.i64(stride))], source_etype=F32)
            column = b.load(b.gep(src, [p], source_etype=F32), typ=narrow, align=4)
            spread_v = column if stride == 1 else b.shuffle_vector(column, zero, spread)
            b.store(b.fadd(b.load(at, typ=wide, align=4), spread_v), at, align=4)
    with k.loop(hi, start=p_vec, name="ss") as p:
        at = b.gep(dst, [b.mul(p, k.i64(stride))], source_etype=F32)
        b.store(b.fadd(b.load(at, typ=F32), b.load(b.gep(src, [p], source_etype=F32), typ=F32)),
                at)
