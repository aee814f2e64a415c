"""A transpose of a byte matrix in 16 x 16 tiles of vector registers: the int8 convolutions'
layout changes (ops/quantize.py: an image [C, H, W] copied channels-last, the products
[positions, channels] back into [channels, positions]).

Read one element at a time, a transpose costs a strided load or store per byte. A tile is
16 vector loads of 16 bytes, four rounds of interleaves (round r: out[2i] = the low halves of
in[i] and in[i + 8] interleaved byte by byte, out[2i + 1] the high halves; after log2(16)
rounds out[j] is column j) and 16 vector stores. An interleave of two 16-byte vectors is one
instruction on every target (punpcklbw/punpckhbw on x86, zip1/zip2 on AArch64), so the tile
costs 0.375 instructions per byte. The edges that do not fill a tile are copied byte by byte.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.codegen.emitter import I8, I32, Emitter

__all__ = ["TILE", "emit_byte_transpose"]

TILE = 16
_V = ir.VectorType(I8, TILE)
_LOW = ir.Constant(ir.VectorType(I32, TILE), [j for i in range(TILE // 2) for j in (i, i + TILE)])
_HIGH = ir.Constant(ir.VectorType(I32, TILE),
                    [j for i in range(TILE // 2, TILE) for j in (i, i + TILE)])


def _tile(k: Emitter, src: ir.Value, src_stride: ir.Value, dst: ir.Value,
          dst_stride: ir.Value) -> None:
    b = k.b
    rows = [b.load(b.gep(src, [b.mul(k.i64(i), src_stride)], source_etype=I8), typ=_V, align=1)
            for i in range(TILE)]
    for _ in range(4):
        half = TILE // 2
        rows = [v for i in range(half)
                for v in (b.shuffle_vector(rows[i], rows[i + half], _LOW),
                          b.shuffle_vector(rows[i], rows[i + half], _HIGH))]
    for j, v in enumerate(rows):
        b.store(v, b.gep(dst, [b.mul(k.i64(j), dst_stride)], source_etype=I8), align=1)


def emit_byte_transpose(k: Emitter, src: ir.Value, src_stride: ir.Value, dst: ir.Value,
                        dst_stride: ir.Value, rows: ir.Value, cols: ir.Value) -> None:
    """dst[j * dst_stride + i] = src[i * src_stride + j] for i < rows, j < cols (i64 values;
    src and dst pointers to bytes that do not overlap). The bands of 16 rows are spread over
    the runtime's threads."""
    b = k.b
    t = k.i64(TILE)
    bands = b.udiv(rows, t)
    with k.parallel_loop(bands, cost=b.mul(cols, t), name="tr",
                         carry=[src, src_stride, dst, dst_stride, cols]) as tr:
        b = k.b  # the band's own function
        band_src, band_src_stride, band_dst, band_dst_stride, band_cols = k.carried
        with k.loop(b.udiv(band_cols, t), name="tc") as tc:
            r0, c0 = b.mul(tr, t), b.mul(tc, t)
            _tile(k, b.gep(band_src, [b.add(b.mul(r0, band_src_stride), c0)], source_etype=I8),
                  band_src_stride,
                  b.gep(band_dst, [b.add(b.mul(c0, band_dst_stride), r0)], source_etype=I8),
                  band_dst_stride)
    b = k.b
    full_rows = b.mul(bands, t)
    full_cols = b.mul(b.udiv(cols, t), t)

    def bytewise(r_start: ir.Value, r_stop: ir.Value, c_start: ir.Value) -> None:
        with k.loop(r_stop, start=r_start, name="er") as r, k.loop(cols, start=c_start,
                                                                    name="ec") as c:
            v = b.load(b.gep(src, [b.add(b.mul(r, src_stride), c)], source_etype=I8), typ=I8)
            b.store(v, b.gep(dst, [b.add(b.mul(c, dst_stride), r)], source_etype=I8))

    bytewise(k.i64(0), full_rows, full_cols)  # the columns right of the tiles
    bytewise(full_rows, rows, k.i64(0))  # the rows below them
