"""A transpose of a byte matrix in 16 x 16 tiles of vector registers: the int8 convolutions'
layout changes (ops/quantize.py: an image [C, H, W] copied channels-last, the products
[positions, channels] back into [channels, positions]).

Read one element at a time, a transpose costs a strided load or store per byte. A tile is
16 vector loads of 16 bytes, four rounds of interleaves (round r: out[2i] = the low halves of
in[i] and in[i + 8] interleaved byte by byte, out[2i + 1] the high halves; after log2(16)
rounds out[j] is column j) and 16 vector stores. An interleave of two 16-byte vectors is one
instruction on every target (punpcklbw/punpckhbw on x86, zip1/zip2 on AArch64), so the tile
costs 0.375 instructions per byte. Where the rows or columns past the last whole tile number a
constant, they make partial tiles (fewer rows loaded, or fewer bytes of each); other edges
are copied byte by byte.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.kernels.emitter import I8, I32, Emitter

__all__ = ["TILE", "emit_byte_transpose"]

TILE = 16
_V = ir.VectorType(I8, TILE)
_LOW = ir.Constant(ir.VectorType(I32, TILE), [j for i in range(TILE // 2) for j in (i, i + TILE)])
_HIGH = ir.Constant(ir.VectorType(I32, TILE),
                    [j for i in range(TILE // 2, TILE) for j in (i, i + TILE)])


def _tile(k: Emitter, src: ir.Value, src_stride: ir.Value, dst: ir.Value,
          dst_stride: ir.Value, rows: int = TILE, cols: int = TILE) -> None:
    """dst[j, i] = src[i, j] for i < rows, j < cols (at most a tile each): only the rows and
    row bytes that exist are read, only the bytes that exist written (a partial tile's other
    lanes are undefined)."""
    b = k.b
    undef = ir.Constant(_V, ir.Undefined)
    lines = []
    for i in range(TILE):
        if i >= rows:
            lines.append(undef)
            continue
        at = b.gep(src, [b.mul(k.i64(i), src_stride)], source_etype=I8)
        if cols == TILE:
            lines.append(b.load(at, typ=_V, align=1))
            continue
        short = ir.VectorType(I8, cols)
        line = b.load(at, typ=short, align=1)
        widen = ir.Constant(ir.VectorType(I32, TILE), [min(j, cols) for j in range(TILE)])
        lines.append(b.shuffle_vector(line, ir.Constant(short, ir.Undefined), widen))
    for _ in range(4):
        half = TILE // 2
        lines = [v for i in range(half)
                 for v in (b.shuffle_vector(lines[i], lines[i + half], _LOW),
                           b.shuffle_vector(lines[i], lines[i + half], _HIGH))]
    for j, v in enumerate(lines[:cols]):
        if rows < TILE:
            v = b.shuffle_vector(v, undef, ir.Constant(ir.VectorType(I32, rows), list(range(rows))))
        b.store(v, b.gep(dst, [b.mul(k.i64(j), dst_stride)], source_etype=I8), align=1)


#: column tiles per task of the parallel loop
CHUNK_TILES = 16


def _left(count: ir.Value) -> int | None:
    """count % TILE when count is a constant (an int8 conv's channels), else None."""
    return count.constant % TILE if isinstance(count, ir.Constant) else None


def emit_byte_transpose(k: Emitter, src: ir.Value, src_stride: ir.Value, dst: ir.Value,
                        dst_stride: ir.Value, rows: ir.Value, cols: ir.Value) -> None:
    """dst[j * dst_stride + i] = src[i * src_stride + j] for i < rows, j < cols (i64 values;
    src and dst pointers to bytes that do not overlap). Tasks of a band of 16 rows and up to
    CHUNK_TILES tiles of columns are spread over the runtime's threads. Rows or columns left
    past the whole tiles make partial tiles when their count is a constant (a conv's 3 or 24
    channels: byte by byte they took a whole int8 stem conv's time), else go byte by byte."""
    b = k.b
    t = k.i64(TILE)
    row_left, col_left = _left(rows), _left(cols)
    bands = b.udiv(rows, t)
    full_rows, full_cols = b.mul(bands, t), b.mul(b.udiv(cols, t), t)
    # tasks: every band (and the band of row_left rows) x every chunk of column tiles (and
    # the tile of col_left columns, for the whole bands)
    all_bands = b.add(bands, k.i64(1 if row_left else 0))
    chunks = b.udiv(b.add(b.udiv(cols, t), k.i64(CHUNK_TILES - 1)), k.i64(CHUNK_TILES))
    all_chunks = b.add(chunks, k.i64(1 if col_left else 0))
    with k.parallel_loop(b.mul(all_bands, all_chunks), cost=k.i64(TILE * TILE * CHUNK_TILES),
                         name="tr", carry=[src, src_stride, dst, dst_stride, cols, bands,
                                           chunks, all_chunks]) as task:
        b = k.b  # the task's own function
        t_src, t_src_stride, t_dst, t_dst_stride, t_cols, t_bands, t_chunks, t_all = k.carried
        band, chunk = b.udiv(task, t_all), b.urem(task, t_all)
        r0 = b.mul(band, k.i64(TILE))

        def tile(c0: ir.Value, height: int = TILE, width: int = TILE) -> None:
            _tile(k, b.gep(t_src, [b.add(b.mul(r0, t_src_stride), c0)], source_etype=I8),
                  t_src_stride, b.gep(t_dst, [b.add(b.mul(c0, t_dst_stride), r0)], source_etype=I8),
                  t_dst_stride, height, width)

        def column_tiles(height: int) -> None:
            first = b.mul(chunk, k.i64(CHUNK_TILES))
            stop = k.minimum("int64", b.add(first, k.i64(CHUNK_TILES)),
                             b.udiv(t_cols, k.i64(TILE)))
            with k.loop(stop, start=first, name="tc") as tc:
                tile(b.mul(tc, k.i64(TILE)), height=height)

        whole_band = b.icmp_unsigned("<", band, t_bands)
        in_chunks = b.icmp_unsigned("<", chunk, t_chunks)
        with k.if_then(b.and_(whole_band, in_chunks)):
            column_tiles(TILE)
        if row_left:
            with k.if_then(b.and_(b.not_(whole_band), in_chunks)):
                column_tiles(row_left)
        if col_left:
            with k.if_then(b.and_(whole_band, b.not_(in_chunks))):
                tile(b.mul(b.udiv(t_cols, k.i64(TILE)), k.i64(TILE)), width=col_left)
    b = k.b

    def bytewise(r_start: ir.Value, c_start: ir.Value, c_stop: ir.Value) -> None:
        with k.loop(rows, start=r_start, name="er") as r, k.loop(c_stop, start=c_start,
                                                                 name="ec") as c:
            v = b.load(b.gep(src, [b.add(b.mul(r, src_stride), c)], source_etype=I8), typ=I8)
            b.store(v, b.gep(dst, [b.add(b.mul(c, dst_stride), r)], source_etype=I8))

    # what no tile covered: the columns right of the tiles (below the whole bands when they
    # had partial tiles), the rows below the tiles (unless they had partial tiles)
    bytewise(full_rows if col_left else k.i64(0), full_cols, cols)
    bytewise(rows if row_left else full_rows, k.i64(0), full_cols)
