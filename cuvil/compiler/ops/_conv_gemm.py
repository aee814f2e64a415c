"""float32 convolution as matrix products on the shared GEMM kernel.

For each image and group, the output channels are Y[Mg, P] = W[Mg, Cg*K] @ X'[Cg*K, P], where
P counts output positions and X' ("im2col") lists, for every input channel and kernel tap,
the input value each output position reads (zero in the padding). X' is written into the
node's scratch memory; a 1x1 convolution with unit strides and no padding reads X directly.
The bias (and a fused residual and activation, see ops/gemm.py `node_epilogue`) are applied
by the kernel while the tile is in registers.

Small maps (`transposed_product`: 7x7 has P = 49 positions, which fill 4 vectors of 16
lanes, 64 lanes for 49 values) run the product transposed, Y^T[P, M] = X'^T[P, K] @ W^T[K, M]:
the output channels (a multiple of 16 in every common net) fill the kernel's vectors and the
positions make its rows. X' is read in place by columns (`Layout.a_columns`), W^T is packed
into panels at compile time (passes/pack_gemm_weights.py); Y^T goes to the scratch, then
into Y through in-register transposes of lanes x lanes blocks, the residual added on the way.
With bf16 weights the same product runs on the bf16 kernel's side "bt" (W^T in its panels).
onnxruntime (MLAS's NCHWc kernels) and oneDNN do the same for small maps: vectors run along
output channels, positions along the registers of a tile.

One image splits its product finely over the threads, one parallel loop (or three) per
image. A batch of several runs one parallel loop for the whole layer instead, its tasks
(image, chunk of rows), (image, block of columns) or, transposed, whole images, each product
on one thread (`_batch_pointwise`, `_batch_of_chunks`, `_batch_transposed`): image by image,
small maps (7x7, 14x14) made the threads meet 8 times a layer at batch 8, for little work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Node, numel
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.bf16_gemm import (
    ROW_ALIGN,
    bf16_or_float32,
    emit_bf16_gemm,
    emit_float32_panels,
    emit_parallel_bf16_gemm,
    l_columns,
    round_up,
)
from cuvil.compiler.kernels.emitter import (
    I8,
    I64,
    PTR,
    Emitter,
    View,
    masked_intrinsic,
    splat,
    store_lanes,
    transpose_lanes,
)
from cuvil.compiler.kernels.gemm import (
    BLOCKS_PER_THREAD,
    MIN_COLUMN_TILES,
    Epilogue,
    Layout,
    block_span,
    emit_gemm,
    emit_parallel_gemm,
)
from cuvil.compiler.ops import required_input
from cuvil.compiler.ops._window import Window, ceil_div, clamp
from cuvil.compiler.ops.gemm import (
    BF16_WEIGHTS,
    RESIDUAL_SLOT,
    logical_weight,
    node_epilogue,
    weight_layout,
)

F32 = ir.FloatType()
F32_DTYPE = np.dtype(np.float32)

#: output positions per chunk of X' (`_chunked`): whole output rows, at least this many
CHUNK_COLUMNS = 128
#: ... for bf16 weights, whose kernel packs X' in panels of 32 columns: 224 is 7 whole panels
#: for rows of 14, 28, 56 or 112 positions (128 made chunks of 5 rows of 28, 140 columns in
#: 5 panels: ResNet-50's 56 -> 28 strided convs ran 1.13-1.19x slower on a Zen 4)
BF16_CHUNK_COLUMNS = 224
#: with fewer chunks (small outputs), X' is unfolded whole and the product split instead
MIN_CHUNKS = 4
#: a batch of several images runs one parallel loop over (image, chunk) tasks for the whole
#: layer, cut into at most this many blocks of consecutive tasks: each block has a slot of
#: the scratch of its own (blocks on different threads never share one); 8 blocks keep 2
#: threads at 4 each, 8 threads at 1
BATCH_SLOTS = 8


def is_pointwise(win: Window) -> bool:
    return (all(k == 1 for k in win.kernel) and all(s == 1 for s in win.strides)
            and all(p == 0 for p in (*win.pads_begin, *win.pads_end)))


#: set by passes/pack_gemm_weights.py on the convs it packs W^T for (`transposed_product`)
TRANSPOSED = "cuvil.transposed_product"
#: maps of at most this many positions may run transposed (Y^T stays in the scratch)
TRANSPOSE_MAX_POSITIONS = 256
#: ... when their positions waste more than this share of 16-lane vectors (7x7: 64 lanes
#: for 49 positions, 1.31; 14x14 wastes 1.06 and ran as fast untransposed)
TRANSPOSE_WASTE = 1.15
#: lanes of the widest vectors (AVX-512) the rule above counts with: a node's layout is
#: fixed at compile time, for every CPU variant of a library
WIDEST_LANES = 16


def transposed_product(node: Node, win: Window) -> bool:
    """Whether a float32 conv on the GEMM kernel runs transposed (see the module's doc): one
    group, a static map of few positions, which fill vectors poorly."""
    if int(node.attrs.get("group", 1)) != 1 or node.outputs[0].type.dtype != F32_DTYPE:
        return False
    if not all(isinstance(d, int) for d in (*win.out, *required_input(node, 0).type.shape[2:])):
        return False
    p = numel(win.out)
    assert isinstance(p, int)
    lanes = -(-p // WIDEST_LANES) * WIDEST_LANES
    return 1 < p <= TRANSPOSE_MAX_POSITIONS and lanes > TRANSPOSE_WASTE * p


def im2col_bytes(node: Node, win: Window) -> Dim:
    """Scratch for X' of one image: one group's slice, or every group's (their tasks run side
    by side, `_grouped`); none for pointwise convolutions. A transposed product's Y^T of one
    image follows X'. A batch of several images (`_batch_of_chunks`, `_batch_transposed`)
    needs BATCH_SLOTS slots: a chunk of X' each, or a transposed image's X' and Y^T each."""
    w = logical_weight(node)
    cols: Dim = 0
    group = int(node.attrs.get("group", 1))
    taps = 1
    for k in win.kernel:
        taps *= k
    kk = int(w.type.shape[1]) * taps
    if not is_pointwise(win):
        cols = numel([group, kk, *win.out, 4])
    many = not (isinstance(n := required_input(node, 0).type.shape[0], int) and n <= 1)
    if node.attrs.get(TRANSPOSED):
        assert isinstance(cols, int)
        image = _aligned(cols) + numel([int(w.type.shape[0]), *win.out, 4])
        assert isinstance(image, int)
        return _aligned(image) * BATCH_SLOTS if many else image
    if many and not is_pointwise(win):
        # a slot holds rows_per_chunk * inner <= chunk_columns - 1 + inner columns
        slots = BATCH_SLOTS * kk * 4 * (chunk_columns(node) - 1 + numel(win.out[1:]))
        if isinstance(cols, int) and isinstance(slots, int):
            return max(cols, slots)
        return sympy.Max(cols, slots)
    return cols


def chunk_columns(node: Node) -> int:
    """The least output positions of a chunk of X' (both paths of bf16 weights alike)."""
    return BF16_CHUNK_COLUMNS if BF16_WEIGHTS in node.attrs else CHUNK_COLUMNS


def _aligned(size: int) -> int:
    return -(-size // 64) * 64


class _Product:
    """W[Mg, K] @ X' on the float32 kernel (W packed by passes/pack_gemm_weights.py, or the
    float32 panels derived from bf16 weights: `derive_float32_panels`) or, `bf16`, on the bf16
    kernel (passes/bf16_weights.py: `pack_l` per group)."""

    def __init__(self, node: Node, mg: int, kk: int, bf16: bool) -> None:
        self.bf16 = bf16
        self.layout = Layout(packed_a=True) if BF16_WEIGHTS in node.attrs else weight_layout(
            node, "a")
        self.group_bytes = (round_up(mg, ROW_ALIGN) * l_columns(kk) * 2 if self.bf16
                            else mg * kk * 4)

    def weights(self, b: ir.IRBuilder, w: ir.Value, g: ir.Value) -> ir.Value:
        """Group g's weights."""
        return b.gep(w, [b.mul(g, ir.Constant(g.type, self.group_bytes))], source_etype=I8)

    def __call__(self, k: Emitter, parallel: bool, m: ir.Value, n: ir.Value, kk: ir.Value,
                 w: ir.Value, x: ir.Value, ldx: ir.Value, y: ir.Value, ldy: ir.Value, *,
                 bias: ir.Value | None, residual: ir.Value | None, epilogue: Epilogue) -> None:
        if self.bf16:
            (emit_parallel_bf16_gemm if parallel else emit_bf16_gemm)(
                k, m, n, kk, w, kk, x, ldx, y, ldy, side="a", bias=bias, residual=residual,
                epilogue=epilogue)
        else:
            (emit_parallel_gemm if parallel else emit_gemm)(
                k, m, n, kk, w, kk, x, ldx, y, ldy, bias=bias, residual=residual,
                epilogue=epilogue, layout=self.layout)


def derive_float32_panels(node: Node, k: Emitter) -> None:
    """A conv with bf16 weights, on CPUs that run its float32 path: the weights as `pack_a`
    panels per group (a transposed product's W^T: `pack_b` panels) into `k.derived` (the
    float32 weight's bytes: `Conv.derived_bytes`)."""
    w = logical_weight(node)
    group = int(node.attrs.get("group", 1))
    m, kk = int(w.type.shape[0]), int(numel(w.type.shape[1:]))
    src = k.buffers[required_input(node, 1)]
    assert k.derived is not None
    if node.attrs.get(TRANSPOSED):
        emit_float32_panels(k, "b", src, k.derived, kk, m)
    else:
        emit_float32_panels(k, "a", src, k.derived, m // group, kk, group)


def lower_conv_gemm(node: Node, k: Emitter, win: Window) -> None:
    """Y = W @ X' per image and group; bf16 weights: on the bf16 kernel where the CPU has bf16
    instructions, else on the float32 panels derived from them (`bf16_or_float32`)."""
    w_ptr = k.buffers[required_input(node, 1)]
    if BF16_WEIGHTS not in node.attrs:
        _lower_conv_gemm(node, k, win, False, w_ptr)
        return
    derived = k.derived
    assert derived is not None
    bf16_or_float32(k, lambda: _lower_conv_gemm(node, k, win, True, w_ptr),
                    lambda: _lower_conv_gemm(node, k, win, False, derived))


def _lower_conv_gemm(node: Node, k: Emitter, win: Window, bf16: bool, w_ptr: ir.Value) -> None:
    x_val, w_val, b_val = required_input(node, 0), logical_weight(node), node.input(2)
    y_val = node.outputs[0]
    b = k.b
    group = int(node.attrs.get("group", 1))
    m, cg = int(w_val.type.shape[0]), int(w_val.type.shape[1])
    mg = m // group
    taps = 1
    for t in win.kernel:
        taps *= t
    kk = cg * taps
    c_in = x_val.type.shape[1]
    p = k.dim(numel(win.out))
    in_plane = k.dim(numel(x_val.type.shape[2:]))
    x_ptr, y_ptr = k.buffers[x_val], k.buffers[y_val]
    bias = k.buffers[b_val] if b_val is not None else None
    r_val = node.input(RESIDUAL_SLOT)
    residual = k.buffers[r_val] if r_val is not None else None
    epilogue = node_epilogue(node, "row" if bias is not None else "none")
    product = _Product(node, mg, kk, bf16)
    pointwise = is_pointwise(win)
    in_shape = x_val.type.shape[2:]
    # output rows per chunk of X': about chunk_columns positions
    inner = k.dim(numel(win.out[1:]))
    rows_per_chunk = b.add(k.floordiv(k.i64(chunk_columns(node) - 1), inner), k.i64(1))
    out0 = k.dim(win.out[0])
    chunks = k.floordiv(b.add(out0, b.sub(rows_per_chunk, k.i64(1))), rows_per_chunk)
    images_dim = x_val.type.shape[0]
    images = k.dim(images_dim)
    if node.attrs.get(TRANSPOSED):
        def one_by_one() -> None:
            _transposed(k, win, in_shape, (x_ptr, w_ptr, y_ptr, bias, residual), (cg, taps, m),
                        (images, k.dim(c_in), in_plane, p), pointwise, epilogue, bf16)

        if isinstance(images_dim, int) and images_dim <= 1:
            one_by_one()
            return
        # an image per task, when there are images enough to keep every thread busy
        enough = b.icmp_signed(">=", images, b.mul(k.parallel_threads(), k.i64(2)))
        with b.if_else(b.and_(enough, b.icmp_signed(">", images, k.i64(1)))) as (by_images, one):
            with by_images:
                _batch_transposed(k, win, in_shape, (x_ptr, w_ptr, y_ptr, bias, residual),
                                  (cg, taps, m), (images, in_plane, p), pointwise, epilogue, bf16)
            with one:
                one_by_one()
        return
    ptrs = (x_ptr, w_ptr, y_ptr, bias, residual)
    split = (rows_per_chunk, chunks, inner, p, in_plane)
    if group > 1:
        def grouped() -> None:
            _grouped(k, win, in_shape, (group, cg, mg, kk), ptrs, split, pointwise, epilogue,
                     (images, k.dim(c_in), m), product)

        def grouped_batch() -> None:
            _batch_of_chunks(k, win, in_shape, (group, cg, mg, kk), ptrs, split, images,
                             pointwise, epilogue, product)

        _by_batch(k, images_dim, images, grouped_batch, grouped)
        return

    def one_image_at_a_time() -> None:
        _images(k, win, in_shape, (cg, mg, kk, taps), (x_ptr, w_ptr, y_ptr, bias, residual),
                (rows_per_chunk, chunks, inner, p, in_plane), (images, k.dim(c_in)), pointwise,
                epilogue, product)

    def batch() -> None:
        if pointwise:
            _batch_pointwise(k, (mg, kk), ptrs, p, (images, in_plane), epilogue, product)
        else:
            _batch_of_chunks(k, win, in_shape, (1, cg, mg, kk), ptrs, split, images, False,
                             epilogue, product)

    _by_batch(k, images_dim, images, batch, one_image_at_a_time)


def _by_batch(k: Emitter, images_dim: Dim, images: ir.Value, batch: Callable[[], None],
              single: Callable[[], None]) -> None:
    """batch() for several images, single() (each image's product split finely, as tuned for
    one image) for one; a symbolic batch gets both, chosen at run time."""
    if isinstance(images_dim, int):
        (single if images_dim <= 1 else batch)()
        return
    with k.b.if_else(k.b.icmp_signed(">", images, k.i64(1))) as (several, one):
        with several:
            batch()
        with one:
            single()


def _images(k: Emitter, win: Window, in_shape: tuple[Dim, ...], sizes: tuple[int, int, int, int],
            ptrs: tuple[ir.Value, ir.Value, ir.Value, ir.Value | None, ir.Value | None],
            split: tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value],
            image: tuple[ir.Value, ir.Value], pointwise: bool, epilogue: Epilogue,
            product: _Product) -> None:
    """One group, image by image, each image's product split over the threads."""
    b = k.b
    cg, mg, kk, taps = sizes
    x_ptr, w_ptr, y_ptr, bias, residual = ptrs
    rows_per_chunk, chunks, inner, p, in_plane = split
    images, c_in = image
    m = mg
    with k.loop(images, name="n") as n:
        first_channel = b.mul(n, c_in)
        x_slice = b.gep(x_ptr, [b.mul(first_channel, in_plane)], source_etype=F32)
        w_g = w_ptr
        y_off = b.mul(b.mul(n, k.i64(m)), p)
        y_g = b.gep(y_ptr, [y_off], source_etype=F32)
        # the residual has the output's layout
        r_g = b.gep(residual, [y_off], source_etype=F32) if residual is not None else None
        bias_g = bias
        if pointwise:
            product(k, True, k.i64(mg), p, k.i64(kk), w_g, x_slice, p, y_g, p, bias=bias_g,
                    residual=r_g, epilogue=epilogue)
        else:
            assert k.scratch is not None
            many = b.icmp_signed(">=", chunks, k.i64(MIN_CHUNKS))
            with b.if_else(many) as (by_chunks, whole):
                with by_chunks:
                    _chunked(k, win, in_shape, cg, mg, kk,
                             (x_slice, w_g, y_g, bias_g, r_g, k.scratch), rows_per_chunk, chunks,
                             inner, p, epilogue, product)
                with whole:
                    _parallel_im2col(k, win, in_shape, cg, taps, x_slice, k.scratch, in_plane, p)
                    product(k, True, k.i64(mg), p, k.i64(kk), w_g, k.scratch, p, y_g, p,
                            bias=bias_g, residual=r_g, epilogue=epilogue)


def slot_blocks(k: Emitter, tasks: ir.Value, task_cost: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(blocks, cost of one) for `tasks` cut into at most BATCH_SLOTS blocks of consecutive
    tasks (`block_tasks`)."""
    b = k.b
    blocks = k.minimum("int64", tasks, k.i64(BATCH_SLOTS))
    per_block = k.floordiv(b.add(tasks, b.sub(blocks, k.i64(1))), blocks)
    return blocks, b.mul(per_block, task_cost)


def block_tasks(k: Emitter, j: ir.Value, blocks: ir.Value,
                tasks: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(first task, end) of block j: as even as whole tasks allow."""
    b = k.b
    return (b.sdiv(b.mul(j, tasks), blocks),
            b.sdiv(b.mul(b.add(j, k.i64(1)), tasks), blocks))


def _batch_pointwise(k: Emitter, sizes: tuple[int, int],
                     ptrs: tuple[ir.Value, ir.Value, ir.Value, ir.Value | None, ir.Value | None],
                     p: ir.Value, image: tuple[ir.Value, ir.Value], epilogue: Epilogue,
                     product: _Product) -> None:
    """A pointwise convolution of several images: one parallel loop over (image, block of
    columns) tasks, each a product on one thread; an image is cut into blocks only as far as
    the threads need (a whole image's product reuses its weights best)."""
    b = k.b
    mg, kk = sizes
    x, w, y, bias, residual = ptrs
    images, in_plane = image
    null = ir.Constant(PTR, None)
    nr = k.target.isa.nr
    tiles = k.floordiv(b.add(p, k.i64(nr - 1)), k.i64(nr))
    wanted = k.floordiv(b.add(b.mul(k.parallel_threads(), k.i64(BLOCKS_PER_THREAD)),
                              b.sub(images, k.i64(1))), images)
    most = k.maximum("int64", k.floordiv(tiles, k.i64(MIN_COLUMN_TILES)), k.i64(1))
    per_image = k.maximum("int64", k.minimum("int64", wanted, most), k.i64(1))
    tasks = b.mul(images, per_image)
    cost = b.mul(k.floordiv(p, per_image), k.i64(mg * kk))
    carry = [x, w, y, bias if bias is not None else null,
             residual if residual is not None else null, p, in_plane, per_image]
    with k.parallel_loop(tasks, cost=cost, name="pwtask", carry=carry) as t:
        x_c, w_c, y_c, bias_c, res_c, p_c, plane_c, per_c = k.carried
        bb = k.b
        n, blk = bb.sdiv(t, per_c), bb.srem(t, per_c)
        start, width = block_span(k, blk, per_c, p_c, k.i64(nr))
        x_n = bb.gep(x_c, [bb.add(bb.mul(bb.mul(n, k.i64(kk)), plane_c), start)],
                     source_etype=F32)
        y_at = bb.add(bb.mul(bb.mul(n, k.i64(mg)), p_c), start)
        product(k, False, k.i64(mg), width, k.i64(kk), w_c, x_n, plane_c,
                bb.gep(y_c, [y_at], source_etype=F32), p_c,
                bias=bias_c if bias is not None else None, epilogue=epilogue,
                residual=bb.gep(res_c, [y_at], source_etype=F32) if residual is not None
                else None)


def _batch_of_chunks(k: Emitter, win: Window, in_shape: tuple[Dim, ...],
                     sizes: tuple[int, int, int, int],
                     ptrs: tuple[ir.Value, ir.Value, ir.Value, ir.Value | None, ir.Value | None],
                     split: tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value],
                     images: ir.Value, pointwise: bool, epilogue: Epilogue,
                     product: _Product) -> None:
    """Several images: one parallel loop over (image, group, chunk of output rows) tasks, in
    blocks of consecutive tasks (`slot_blocks`); each block unfolds its chunks one after the other
    into its own slot of the scratch (a call of the body runs whole blocks: the slot of its
    first block), each followed by its product on one thread. Pointwise groups read X."""
    b = k.b
    group, cg, mg, kk = sizes
    x, w, y, bias, residual = ptrs
    rows_per_chunk, chunks, inner, p, in_plane = split
    null = ir.Constant(PTR, None)
    cols = k.scratch if k.scratch is not None else null
    assert pointwise or k.scratch is not None
    tasks = b.mul(b.mul(images, chunks), k.i64(group))
    task_cost = b.mul(b.mul(rows_per_chunk, inner), k.i64(mg * kk))
    if pointwise:  # no slots: one task per iteration
        blocks, cost = tasks, task_cost
    else:
        blocks, cost = slot_blocks(k, tasks, task_cost)
    carry = [x, w, y, bias if bias is not None else null,
             residual if residual is not None else null, cols, rows_per_chunk, chunks,
             inner, p, in_plane, tasks, blocks]
    with k.parallel_loop(blocks, cost=cost, name="bchunk", carry=carry) as j:
        x_c, w_c, y_c, bias_c, res_c, cols_c, rpc, chunks_c, inner_c, p_c, plane_c, tasks_c, \
            blocks_c = k.carried
        bb = k.b
        slot = bb.gep(cols_c, [bb.mul(bb.mul(bb.mul(k.task_first, rpc), inner_c), k.i64(kk))],
                      source_etype=F32)
        lo, hi = block_tasks(k, j, blocks_c, tasks_c)
        if pointwise:
            lo, hi = j, bb.add(j, k.i64(1))
        with k.loop(hi, start=lo, name="bt") as t:
            plane_g, c = bb.sdiv(t, chunks_c), bb.srem(t, chunks_c)  # plane_g: n * group + g
            g = bb.srem(plane_g, k.i64(group))
            first = bb.mul(c, rpc)
            count = k.minimum("int64", bb.sub(k.dim(win.out[0]), first), rpc)
            width = bb.mul(count, inner_c)
            col0 = bb.mul(first, inner_c)
            x_g = bb.gep(x_c, [bb.mul(bb.mul(plane_g, k.i64(cg)), plane_c)], source_etype=F32)
            y_at = bb.add(bb.mul(bb.mul(plane_g, k.i64(mg)), p_c), col0)
            if pointwise:
                b_ptr, ldb = bb.gep(x_g, [col0], source_etype=F32), p_c
            else:
                _im2col(k, x_g, in_shape, win, slot, cg, (first, count))
                b_ptr, ldb = slot, width
            product(k, False, k.i64(mg), width, k.i64(kk), product.weights(bb, w_c, g), b_ptr,
                    ldb, bb.gep(y_c, [y_at], source_etype=F32), p_c,
                    bias=(bb.gep(bias_c, [bb.mul(g, k.i64(mg))], source_etype=F32)
                          if bias is not None else None),
                    epilogue=epilogue,
                    residual=bb.gep(res_c, [y_at], source_etype=F32) if residual is not None
                    else None)


def _transposed_product(k: Emitter, parallel: bool, bf16: bool, p: ir.Value, m: int, kk: int,
                        a: ir.Value, w: ir.Value, ct: ir.Value, bias: ir.Value | None,
                        epilogue: Epilogue) -> None:
    """Y^T[P, M] = X'^T @ W^T into ct, X' [K, P] read by columns: on the float32 kernel (W^T in
    `pack_b` panels) or, `bf16`, on the bf16 kernel's side "bt" (`pack_r` panels)."""
    if bf16:
        (emit_parallel_bf16_gemm if parallel else emit_bf16_gemm)(
            k, p, k.i64(m), k.i64(kk), a, p, w, k.i64(0), ct, k.i64(m), side="bt", bias=bias,
            epilogue=epilogue)
    else:
        (emit_parallel_gemm if parallel else emit_gemm)(
            k, p, k.i64(m), k.i64(kk), a, p, w, k.i64(0), ct, k.i64(m), bias=bias,
            epilogue=epilogue, layout=Layout(a_columns=True, packed_b=True))


def _transposed(k: Emitter, win: Window, in_shape: tuple[Dim, ...], ptrs: tuple[ir.Value, ...],
                sizes: tuple[int, int, int],
                image: tuple[ir.Value, ir.Value, ir.Value, ir.Value], pointwise: bool,
                epilogue: Epilogue, bf16: bool) -> None:
    """Image by image: X' (unless pointwise), Y^T = X'^T @ W^T into the scratch (the bias
    per column, and the activation when no residual follows it), then Y from Y^T."""
    b = k.b
    x, w, y, bias, residual = ptrs
    cg, taps, m = sizes
    images, c_in, in_plane, p = image
    assert k.scratch is not None
    kk = cg * taps
    cols_bytes = 0 if pointwise else numel([cg * taps, *win.out, 4])
    assert isinstance(cols_bytes, int)
    ct = b.gep(k.scratch, [k.i64(_aligned(cols_bytes) // 4)], source_etype=F32)
    kernel_epilogue = replace(epilogue, bias="col" if bias is not None else "none",
                              residual=False,
                              activation=None if residual is not None else epilogue.activation)
    with k.loop(images, name="n") as n:
        x_img = b.gep(x, [b.mul(b.mul(n, c_in), in_plane)], source_etype=F32)
        y_off = b.mul(b.mul(n, k.i64(m)), p)
        a = x_img
        if not pointwise:
            _parallel_im2col(k, win, in_shape, cg, taps, x_img, k.scratch, in_plane, p)
            a = k.scratch
        _transposed_product(k, True, bf16, p, m, kk, a, w, ct, bias, kernel_epilogue)
        _untranspose(k, ct, b.gep(y, [y_off], source_etype=F32),
                     b.gep(residual, [y_off], source_etype=F32) if residual is not None else None,
                     (p, m), epilogue)


def _batch_transposed(k: Emitter, win: Window, in_shape: tuple[Dim, ...],
                      ptrs: tuple[ir.Value, ...],
                      sizes: tuple[int, int, int], image: tuple[ir.Value, ir.Value, ir.Value],
                      pointwise: bool, epilogue: Epilogue, bf16: bool) -> None:
    """Several images of a transposed product (`_transposed`): one parallel loop over blocks
    of images (`slot_blocks`), each image on one thread: its X', Y^T and Y in turn, X' and Y^T in
    its block's slot of the scratch (one image's share each), where they stay in its cache."""
    b = k.b
    x, w, y, bias, residual = ptrs
    cg, taps, m = sizes
    images, in_plane, p = image
    assert k.scratch is not None
    kk = cg * taps
    cols_bytes = 0 if pointwise else numel([kk, *win.out, 4])
    assert isinstance(cols_bytes, int)
    image_floats = _aligned(_aligned(cols_bytes) + int(numel([m, *win.out, 4]))) // 4
    kernel_epilogue = replace(epilogue, bias="col" if bias is not None else "none",
                              residual=False,
                              activation=None if residual is not None else epilogue.activation)
    lanes = k.target.isa.vector
    null = ir.Constant(PTR, None)
    blocks, cost = slot_blocks(k, images, b.mul(p, k.i64(kk * m)))
    carry = [x, w, y, bias if bias is not None else null,
             residual if residual is not None else null, k.scratch, in_plane, p, images, blocks]
    with k.parallel_loop(blocks, cost=cost, name="btimage", carry=carry) as j:
        x_c, w_c, y_c, bias_c, res_c, scratch_c, plane_c, p_c, images_c, blocks_c = k.carried
        bb = k.b
        slot = bb.gep(scratch_c, [bb.mul(k.task_first, k.i64(image_floats))], source_etype=F32)
        ct = bb.gep(slot, [k.i64(_aligned(cols_bytes) // 4)], source_etype=F32)
        lo, hi = block_tasks(k, j, blocks_c, images_c)
        with k.loop(hi, start=lo, name="bn") as n:
            x_n = bb.gep(x_c, [bb.mul(bb.mul(n, k.i64(cg)), plane_c)], source_etype=F32)
            y_off = bb.mul(bb.mul(n, k.i64(m)), p_c)
            a = x_n
            if not pointwise:
                _im2col(k, x_n, in_shape, win, slot, cg)
                a = slot
            _transposed_product(k, False, bf16, p_c, m, kk, a, w_c, ct,
                                bias_c if bias is not None else None, kernel_epilogue)
            y_n = bb.gep(y_c, [y_off], source_etype=F32)
            r_n = bb.gep(res_c, [y_off], source_etype=F32) if residual is not None else None
            with k.loop(k.i64(-(-m // lanes)), name="ublk") as blk:
                _untranspose_block(k, blk, ct, y_n, r_n, (p_c, m), epilogue)


def _untranspose(k: Emitter, ct: ir.Value, y: ir.Value, residual: ir.Value | None,
                 sizes: tuple[ir.Value, int], epilogue: Epilogue) -> None:
    """Y[M, P] = Y^T[P, M] (+ residual, then the activation when there is one), by blocks of
    lanes channels x lanes positions transposed in registers, spread over the threads by
    blocks of channels."""
    p, m = sizes
    lanes = k.target.isa.vector
    blocks = -(-m // lanes)
    null = ir.Constant(PTR, None)
    with k.parallel_loop(k.i64(blocks), cost=k.b.mul(p, k.i64(lanes)), name="untranspose",
                         carry=[ct, y, residual if residual is not None else null, p]) as blk:
        ct_c, y_c, res_c, p_c = k.carried
        _untranspose_block(k, blk, ct_c, y_c, res_c if residual is not None else None, (p_c, m),
                           epilogue)


def _untranspose_block(k: Emitter, blk: ir.Value, ct_c: ir.Value, y_c: ir.Value,
                       res_c: ir.Value | None, sizes: tuple[ir.Value, int],
                       epilogue: Epilogue) -> None:
    """Channels blk * lanes ... of Y from Y^T (`_untranspose`)."""
    p_c, m = sizes
    lanes = k.target.isa.vector
    b = k.b
    vt = ir.VectorType(F32, lanes)
    it = ir.VectorType(I64, lanes)
    iota = ir.Constant(it, list(range(lanes)))
    o = b.mul(blk, k.i64(lanes))
    channels = b.icmp_signed("<", b.add(iota, splat(b, o, lanes)), splat(b, k.i64(m), lanes))
    with k.loop(p_c, step=lanes, name="px") as x0:
        positions = b.icmp_signed("<", b.add(iota, splat(b, x0, lanes)), splat(b, p_c, lanes))
        rows = []
        for j in range(lanes):
            # rows past P read nothing (their lanes are not stored)
            inside = b.icmp_signed("<", b.add(x0, k.i64(j)), p_c)
            mask = b.and_(channels, splat(b, inside, lanes))
            src = b.gep(ct_c, [b.add(b.mul(b.add(x0, k.i64(j)), k.i64(m)), o)],
                        source_etype=F32)
            rows.append(b.call(masked_intrinsic(k.module, "load", vt),
                               [src, _ALIGN4, mask, ir.Constant(vt, None)]))
        for i, line in enumerate(transpose_lanes(b, rows)):  # line i: channel o + i
            ch = b.add(o, k.i64(i))
            with k.if_then(b.icmp_signed("<", ch, k.i64(m))):
                off = b.add(b.mul(ch, p_c), x0)
                if res_c is not None:
                    line = b.fadd(line, b.call(masked_intrinsic(k.module, "load", vt),
                                               [b.gep(res_c, [off], source_etype=F32),
                                                _ALIGN4, positions, ir.Constant(vt, None)]))
                    if epilogue.activation is not None:
                        line = apply_activation(b, epilogue.activation, epilogue.params,
                                                line)
                store_lanes(b, line, b.gep(y_c, [off], source_etype=F32), positions,
                            b.icmp_signed("<=", b.add(x0, k.i64(lanes)), p_c))


_ALIGN4 = ir.Constant(ir.IntType(32), 4)


def _grouped(k: Emitter, win: Window, in_shape: tuple[Dim, ...], sizes: tuple[int, int, int, int],
             ptrs: tuple[ir.Value, ir.Value, ir.Value, ir.Value | None, ir.Value | None],
             split: tuple[ir.Value, ir.Value, ir.Value, ir.Value, ir.Value], pointwise: bool,
             epilogue: Epilogue, image: tuple[ir.Value, ir.Value, int], product: _Product) -> None:
    """A grouped convolution, image by image: one parallel loop over (group, chunk of output
    rows) tasks, each unfolding its rows of its group's X' (into that group's slice of the
    scratch) and multiplying them. Groups are small products: one loop over all of them keeps
    the threads busy where a loop per group would be too small to share."""
    b = k.b
    group, cg, mg, kk = sizes
    x, w, y, bias, residual = ptrs
    rows_per_chunk, chunks, inner, p, in_plane = split
    images, c_in, m = image
    null = ir.Constant(PTR, None)
    cols = k.scratch if k.scratch is not None else null
    cost = b.mul(b.mul(rows_per_chunk, inner), k.i64(mg * kk))
    with k.loop(images, name="n") as n:
        x_img = b.gep(x, [b.mul(b.mul(n, c_in), in_plane)], source_etype=F32)
        y_off = b.mul(b.mul(n, k.i64(m)), p)
        carry = [x_img, w, b.gep(y, [y_off], source_etype=F32),
                 bias if bias is not None else null,
                 b.gep(residual, [y_off], source_etype=F32) if residual is not None else null,
                 cols, rows_per_chunk, chunks, inner, p, in_plane]
        with k.parallel_loop(b.mul(chunks, k.i64(group)), cost=cost, name="task",
                             carry=carry) as t:
            x_c, w_c, y_c, bias_c, res_c, cols_c, rpc, chunks_c, inner_c, p_c, plane_c = k.carried
            bb = k.b
            g = bb.sdiv(t, chunks_c)
            first = bb.mul(bb.srem(t, chunks_c), rpc)
            count = k.minimum("int64", bb.sub(k.dim(win.out[0]), first), rpc)
            width = bb.mul(count, inner_c)
            col0 = bb.mul(first, inner_c)
            x_g = bb.gep(x_c, [bb.mul(bb.mul(g, k.i64(cg)), plane_c)], source_etype=F32)
            if pointwise:
                b_ptr, ldb = bb.gep(x_g, [col0], source_etype=F32), p_c
            else:
                # the slot of this call's first task serves all its tasks (see `_chunked`)
                first_t = k.task_first
                slot_g, slot_chunk = bb.sdiv(first_t, chunks_c), bb.srem(first_t, chunks_c)
                slice_ = bb.mul(bb.add(bb.mul(slot_g, p_c), bb.mul(bb.mul(slot_chunk, rpc),
                                                                   inner_c)), k.i64(kk))
                b_ptr, ldb = bb.gep(cols_c, [slice_], source_etype=F32), width
                _im2col(k, x_g, in_shape, win, b_ptr, cg, (first, count))
            y_g = bb.add(bb.mul(bb.mul(g, k.i64(mg)), p_c), col0)
            product(k, False, k.i64(mg), width, k.i64(kk), product.weights(bb, w_c, g), b_ptr,
                    ldb, bb.gep(y_c, [y_g], source_etype=F32), p_c,
                    bias=(bb.gep(bias_c, [bb.mul(g, k.i64(mg))], source_etype=F32)
                          if bias is not None else None),
                    epilogue=epilogue,
                    residual=(bb.gep(res_c, [y_g], source_etype=F32)
                              if residual is not None else None))


def _chunked(k: Emitter, win: Window, in_shape: tuple[Dim, ...], cg: int, mg: int, kk: int,
             ptrs: tuple[ir.Value, ir.Value, ir.Value, ir.Value | None, ir.Value | None, ir.Value],
             rows_per_chunk: ir.Value, chunks: ir.Value, inner: ir.Value, p: ir.Value,
             epilogue: Epilogue, product: _Product) -> None:
    """Y = W @ X' by chunks of output rows spread over the threads: each unfolds its chunk of
    X' (K x ~`chunk_columns` floats, into its thread's slot of the scratch) and multiplies it
    while it is still in its cache. Unfolding X' whole would run on one thread before the
    product."""
    b = k.b
    x, w, y, bias, residual, cols = ptrs
    null = ir.Constant(PTR, None)
    carry = [x, w, y, bias if bias is not None else null,
             residual if residual is not None else null, cols, rows_per_chunk, inner, p]
    cost = b.mul(b.mul(rows_per_chunk, inner), k.i64(mg * kk))
    with k.parallel_loop(chunks, cost=cost, name="chunk", carry=carry) as t:
        x_c, w_c, y_c, bias_c, res_c, cols_c, rpc, inner_c, p_c = k.carried
        bb = k.b
        first = bb.mul(t, rpc)
        count = k.minimum("int64", bb.sub(k.dim(win.out[0]), first), rpc)
        width = bb.mul(count, inner_c)
        col0 = bb.mul(first, inner_c)
        # every chunk of this call reuses its first chunk's part of the scratch: the same few
        # hundred KB stay in cache, where fresh parts of X' (MBs for a stem) came from memory
        slot = bb.mul(bb.mul(k.task_first, rpc), inner_c)
        chunk = bb.gep(cols_c, [bb.mul(slot, k.i64(kk))], source_etype=F32)
        _im2col(k, x_c, in_shape, win, chunk, cg, (first, count))
        product(k, False, k.i64(mg), width, k.i64(kk), w_c, chunk, width,
                bb.gep(y_c, [col0], source_etype=F32), p_c,
                bias=bias_c if bias is not None else None, epilogue=epilogue,
                residual=bb.gep(res_c, [col0], source_etype=F32) if residual is not None else None)


def _parallel_im2col(k: Emitter, win: Window, in_shape: tuple[Dim, ...], cg: int, taps: int,
                     x: ir.Value, cols: ir.Value, in_plane: ir.Value, p: ir.Value) -> None:
    """X' whole, its input channels spread over the threads (the product after it is split
    too: unfolded on one thread, X' would leave the other threads idle meanwhile)."""
    b = k.b
    with k.parallel_loop(cg, cost=b.mul(p, k.i64(taps)), name="unfold",
                         carry=[x, cols, in_plane, p]) as c:
        x_c, cols_c, plane_c, p_c = k.carried
        bb = k.b
        x_one = bb.gep(x_c, [bb.mul(c, plane_c)], source_etype=F32)
        cols_one = bb.gep(cols_c, [bb.mul(c, bb.mul(p_c, k.i64(taps)))], source_etype=F32)
        _im2col(k, x_one, in_shape, win, cols_one, 1)


def _im2col(k: Emitter, x: ir.Value, in_shape: tuple[Dim, ...], win: Window, cols: ir.Value,
            channels: int, rows: tuple[ir.Value, ir.Value] | None = None) -> None:
    """cols[(c, taps...), (o...)] = x[c, o*s + tap*d - pad] (0 outside the input); with `rows`
    = (first, count), only output rows first..first+count-1 of the first output axis."""
    b = k.b
    r = len(win.kernel)
    xv = k.contiguous(x, F32_DTYPE, (channels, *in_shape))
    cv = k.contiguous(cols, F32_DTYPE, (channels, *win.kernel, *win.out))
    first_row = k.i64(0)
    if rows is not None:
        first_row, count = rows
        dims = [*cv.dims[:1 + r], count, *cv.dims[2 + r:]]
        strides = [k.i64(1)]
        for d in reversed(dims[1:]):
            strides.append(b.mul(strides[-1], d))
        cv = View(cols, cv.dtype, tuple(dims), tuple(reversed(strides)), cv.shape)
    zero = ir.Constant(F32, 0.0)
    with k.loop(channels, name="c") as c, k.loops(win.kernel, name="tap") as tap:

        def nest(axis: int, out_idx: list[ir.Value], in_idx: list[ir.Value]) -> None:
            s = win.strides[axis]
            start = b.sub(b.mul(tap[axis], k.i64(win.dilations[axis])), k.dim(win.pads_begin[axis]))
            size = xv.dims[1 + axis]
            out = cv.dims[1 + r + axis]
            if axis < r - 1:
                with k.loop(out, name=f"o{axis}") as o:
                    i = b.add(b.mul(b.add(o, first_row) if axis == 0 else o, k.i64(s)), start)
                    inside = b.and_(b.icmp_signed(">=", i, k.i64(0)), b.icmp_signed("<", i, size))
                    with b.if_else(inside) as (then, otherwise):
                        with then:
                            nest(axis + 1, [*out_idx, o], [*in_idx, i])
                        with otherwise:
                            _fill_row(k, cv, [c, *tap, *out_idx, o], axis + 1, zero)
                return
            # innermost: zeros, the in-bounds run (a strided copy that vectorizes), zeros
            if axis == 0:  # a 1-D convolution: its only axis is the one split into chunks
                start = b.add(start, b.mul(first_row, k.i64(s)))
            lo = clamp(k, ceil_div(k, b.neg(start), s), k.i64(0), out)
            hi = clamp(k, ceil_div(k, b.sub(size, start), s), lo, out)
            row = [c, *tap, *out_idx]
            with k.loop(lo, name="z0") as o:
                k.store(cv, [*row, o], zero)
            if s == 1:
                _copy_run(k, k.element_ptr(cv, k.offset(cv, [*row, lo])),
                          k.element_ptr(xv, k.offset(xv, [c, *in_idx, b.add(lo, start)])),
                          b.sub(hi, lo))
            else:
                src_row = k.element_ptr(xv, k.offset(xv, [c, *in_idx, k.i64(0)]))
                _copy_strided(k, k.element_ptr(cv, k.offset(cv, [*row, k.i64(0)])), src_row,
                              (start, s, size), lo, hi)
            with k.loop(out, start=hi, name="z1") as o:
                k.store(cv, [*row, o], zero)

        nest(0, [], [])


def _copy_run(k: Emitter, dst: ir.Value, src: ir.Value, count: ir.Value) -> None:
    """dst[:count] = src[:count] (floats) in whole vectors, then one by one (one masked
    vector on AVX-512, `masked_tails`): LLVM leaves the generic copy scalar, since it cannot
    tell the input from the unfolded columns apart."""
    b = k.b
    width = k.target.isa.vector
    vt = ir.VectorType(F32, width)
    whole = b.mul(b.udiv(count, k.i64(width)), k.i64(width))
    with k.loop(whole, step=width, name="cpv") as o:
        x = b.load(b.gep(src, [o], source_etype=F32), typ=vt, align=4)
        b.store(x, b.gep(dst, [o], source_etype=F32), align=4)
    if masked_tails(k):
        left = b.sub(count, whole)
        with k.if_then(b.icmp_signed(">", left, k.i64(0))):
            lanes = _lanes_below(b, left, width)
            x = b.call(masked_intrinsic(k.module, "load", vt),
                       [b.gep(src, [whole], source_etype=F32), _ALIGN4, lanes,
                        ir.Constant(vt, None)])
            b.call(masked_intrinsic(k.module, "store", vt),
                   [x, b.gep(dst, [whole], source_etype=F32), _ALIGN4, lanes])
        return
    with k.loop(count, start=whole, name="cps") as o:
        b.store(b.load(b.gep(src, [o], source_etype=F32), typ=F32),
                b.gep(dst, [o], source_etype=F32))


def masked_tails(k: Emitter) -> bool:
    """Whether the fewer than a vector's floats left at the end of a run are copied by one
    masked load and store: AVX-512 masks every lane for free, where AVX2 and NEON would
    emulate them lane by lane. Rows of 7x7 and 14x14 maps are all tail at 16 lanes."""
    return k.target.isa.vector == 16


def _lanes_below(b: ir.IRBuilder, count: ir.Value, lanes: int) -> ir.Value:
    """The mask of the lanes numbered below count (any i64)."""
    iota = ir.Constant(ir.VectorType(I64, lanes), list(range(lanes)))
    return b.icmp_signed("<", iota, splat(b, count, lanes))


#: input strides whose unfolding runs in vectors (one load of stride x lanes floats, then a
#: shuffle); wider strides copy element by element
MAX_VECTOR_STRIDE = 4


def whole_strided_vectors(k: Emitter, span: tuple[ir.Value, ir.Value], start: ir.Value,
                          stride: int, size: ir.Value) -> ir.Value:
    """The end of the run of whole vectors from lo in [lo, hi) whose stride x lanes floats,
    from o * stride + start on, lie inside a row of `size` floats (what a strided row copy or
    scatter does in vectors before its element-by-element rest)."""
    b = k.b
    lo, hi = span
    width = k.target.isa.vector
    # a vector may start at o when o * stride + start + stride * width <= size
    last_start = k.floordiv(b.sub(b.sub(size, start), k.i64(stride * width)), k.i64(stride))
    vectors = k.minimum("int64", k.floordiv(b.sub(hi, lo), k.i64(width)),
                        b.add(k.floordiv(b.sub(last_start, lo), k.i64(width)), k.i64(1)))
    return b.add(lo, b.mul(k.maximum("int64", vectors, k.i64(0)), k.i64(width)))


def _copy_strided(k: Emitter, dst: ir.Value, src: ir.Value, axis: tuple[ir.Value, int, ir.Value],
                  lo: ir.Value, hi: ir.Value) -> None:
    """dst[o] = src[o * stride + start] for lo <= o < hi, where src is one input row of `size`
    floats: in vectors where the stride x lanes floats a vector reads lie inside the row (one
    wide load, every stride-th lane kept: a permute on AVX-512, ld2/ld3/ld4 on NEON), then
    one by one (on AVX-512, by the same vectors with masked lanes: `masked_tails`). The
    element-by-element loop took a third to a half of strided convolutions."""
    b = k.b
    start, stride, size = axis
    width = k.target.isa.vector
    lo_v = lo
    if stride <= MAX_VECTOR_STRIDE:
        wide = ir.VectorType(F32, width * stride)
        keep = ir.Constant(ir.VectorType(ir.IntType(32), width),
                           [i * stride for i in range(width)])
        lo_v = whole_strided_vectors(k, (lo, hi), start, stride, size)
        with k.loop(lo_v, start=lo, step=width, name="cpw") as o:
            i = b.add(b.mul(o, k.i64(stride)), start)
            x = b.load(b.gep(src, [i], source_etype=F32), typ=wide, align=4)
            b.store(b.shuffle_vector(x, ir.Constant(wide, None), keep),
                    b.gep(dst, [o], source_etype=F32), align=4)
    if stride <= MAX_VECTOR_STRIDE and masked_tails(k):
        # the rest by vectors of masked lanes: those a vector reads stop at its last value
        vt = ir.VectorType(F32, width)
        with k.loop(hi, start=lo_v, step=width, name="cpm") as o:
            count = k.minimum("int64", b.sub(hi, o), k.i64(width))
            i = b.add(b.mul(o, k.i64(stride)), start)
            reads = _lanes_below(b, b.add(b.mul(b.sub(count, k.i64(1)), k.i64(stride)),
                                          k.i64(1)), width * stride)
            x = b.call(masked_intrinsic(k.module, "load", wide),
                       [b.gep(src, [i], source_etype=F32), _ALIGN4, reads,
                        ir.Constant(wide, None)])
            b.call(masked_intrinsic(k.module, "store", vt),
                   [b.shuffle_vector(x, ir.Constant(wide, None), keep),
                    b.gep(dst, [o], source_etype=F32), _ALIGN4, _lanes_below(b, count, width)])
        return
    with k.loop(hi, start=lo_v, name="cp") as o:
        i = b.add(b.mul(o, k.i64(stride)), start)
        b.store(b.load(b.gep(src, [i], source_etype=F32), typ=F32),
                b.gep(dst, [o], source_etype=F32))


def _fill_row(k: Emitter, view: View, prefix: list[ir.Value], axis: int, value: ir.Value) -> None:
    """view[prefix..., :, :, ...] = value over the output axes from `axis` on."""
    r = (view.rank - 1) // 2
    with k.loops(view.dims[1 + r + axis:], name="zf") as rest:
        k.store(view, [*prefix, *rest], value)
