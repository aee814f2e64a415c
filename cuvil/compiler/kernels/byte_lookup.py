"""The byte lookup kernel of cuvil's LookupTable: dst[i] = table[src[i] xor flip], 256 entries.

Loop vectorizers cannot vectorize a load at a computed index but by gathers, which on Zen 4
ran no faster than one byte at a time (1.4 cycles an element). Byte shuffles can, each way
its instruction set allows:

- AVX-512 VBMI: the whole table fits in four registers; `vpermi2b` picks 64 bytes at once from
  two of them (128 entries, by bits 0-6 of each index byte), once for the low and once for the
  high half of the table, and bit 7 of the index chooses: three instructions for 64 elements.
  VBMI is not part of x86-64-v4, so the v4 copy tests the CPUID bit once (`cpuid_gate`, as
  the int8 GEMM kernel does for VNNI).
- AVX-512BW without VBMI, and AVX2: `vpshufb` looks up 16-entry tables (in every 128-bit lane)
  by the low 4 bits of an index, so the table is 16 of them, one per value of the high 4 bits
  (`_nibbles`): 16 shuffles a vector, each kept where the high bits match.
- AArch64: `tbl`/`tbx` look up 64-entry tables held in four registers, out-of-range indices
  giving zero (`tbl`) or keeping the destination (`tbx`): four lookups a 16-byte vector.

The x86 baseline copy (SSE4.2, for CPUs from before 2013) and other targets look up one byte
at a time.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from cuvil.compiler.kernels.emitter import (
    I8,
    I32,
    I64,
    PTR,
    Emitter,
    add_target_features,
    cpuid_gate,
    declare_function,
    splat,
)
from cuvil.compiler.kernels.objects import kernel_function
from cuvil.compiler.kernels.target import KernelTarget

__all__ = ["byte_lookup_function"]

#: void lookup(table, src, dst, n, flip): table 256 bytes, n elements, flip 0x80 for int8 src
LOOKUP_TYPE = ir.FunctionType(ir.VoidType(), [PTR, PTR, PTR, I64, I8])
#: CPUID leaf 7, subleaf 0, ECX bit 1: AVX512_VBMI
_VBMI_BIT = (7, 0, 2, 1)
_LANES = 64
_V = ir.VectorType(I8, _LANES)
#: the byte shuffle of each x86 vector width (16-entry tables in every 128-bit lane)
_PSHUFB = {32: "llvm.x86.avx2.pshuf.b", 64: "llvm.x86.avx512.pshuf.b.512"}


def byte_lookup_function(module: ir.Module, target: KernelTarget) -> ir.Function:
    """The kernel for the target and its features (see the module docstring)."""

    def define(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        if target.triple.startswith("aarch64"):
            _neon(module, fn, target)
        elif not target.triple.startswith("x86_64"):
            _bytewise(module, fn, target)
        elif not target.has("avx512bw"):
            _nibbles(module, fn, target, 32) if target.has("avx2") else _bytewise(module, fn, target)
        elif target.has("avx512vbmi"):
            _vbmi(module, fn, target)
        elif target.excludes("avx512vbmi"):
            _nibbles(module, fn, target, 64)
        else:
            fast, slow = (ir.Function(module, LOOKUP_TYPE, f"{fn.name}.{kind}")
                          for kind in ("vbmi", "nibbles"))
            fast.linkage = slow.linkage = "internal"
            add_target_features(target, fast, "+avx512vbmi")
            _vbmi(module, fast, target)
            _nibbles(module, slow, target, 64)
            b = ir.IRBuilder(fn.append_basic_block("entry"))
            with b.if_else(cpuid_gate(module, b, _VBMI_BIT)) as (yes, no):
                with yes:
                    b.call(fast, fn.args)
                with no:
                    b.call(slow, fn.args)
            b.ret_void()

    return kernel_function(module, target, "cuvil.lookup8", LOOKUP_TYPE, define)


def _emitter(module: ir.Module, fn: ir.Function, target: KernelTarget) -> Emitter:
    return Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)


def _bytes(k: Emitter, table: ir.Value, src: ir.Value, dst: ir.Value, flip: ir.Value,
           start: ir.Value, stop: ir.Value) -> None:
    b = k.b
    with k.loop(stop, start=start, name="i") as i:
        x = b.xor(b.load(b.gep(src, [i], source_etype=I8), typ=I8), flip)
        y = b.load(b.gep(table, [b.zext(x, I64)], source_etype=I8), typ=I8)
        b.store(y, b.gep(dst, [i], source_etype=I8))


def _bytewise(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
    k = _emitter(module, fn, target)
    table, src, dst, n, flip = fn.args
    _bytes(k, table, src, dst, flip, k.i64(0), n)
    k.b.ret_void()


def _vbmi(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
    k = _emitter(module, fn, target)
    b = k.b
    permute = declare_function(module, "llvm.x86.avx512.vpermi2var.qi.512", _V, [_V, _V, _V])
    quarters = _table_rows(k, fn.args[0], _LANES, _LANES)

    def body(x: ir.Value) -> ir.Value:
        low = b.call(permute, [quarters[0], x, quarters[1]])
        high = b.call(permute, [quarters[2], x, quarters[3]])
        top = b.icmp_signed("<", x, ir.Constant(_V, None))
        return b.select(top, high, low)

    _vectors(k, fn, _LANES, body)


def _vectors(k: Emitter, fn: ir.Function, lanes: int,
             body: Callable[[ir.Value], ir.Value]) -> None:
    """dst = body(src xor flip) a vector of `lanes` bytes at a time, the tail a byte at a
    time."""
    b = k.b
    table, src, dst, n, flip = fn.args
    for arg in (src, dst):
        arg.add_attribute("noalias")
    vt = ir.VectorType(I8, lanes)
    flips = splat(b, flip, lanes)
    whole = b.and_(n, k.i64(-lanes))
    with k.loop(whole, step=lanes, name="v") as i:
        x = b.xor(b.load(b.gep(src, [i], source_etype=I8), typ=vt, align=1), flips)
        b.store(body(x), b.gep(dst, [i], source_etype=I8), align=1)
    _bytes(k, table, src, dst, flip, whole, n)
    b.ret_void()


def _table_rows(k: Emitter, table: ir.Value, size: int, lanes: int) -> list[ir.Value]:
    """The table as 256 / size rows of `size` bytes, each repeated to fill `lanes`."""
    b = k.b
    row_type = ir.VectorType(I8, size)
    rows = []
    for r in range(256 // size):
        row = b.load(b.gep(table, [k.i64(size * r)], source_etype=I8), typ=row_type, align=1)
        if size < lanes:
            repeat = ir.Constant(ir.VectorType(I32, lanes), [j % size for j in range(lanes)])
            row = b.shuffle_vector(row, ir.Constant(row_type, ir.Undefined), repeat)
        rows.append(row)
    return rows


def _nibbles(module: ir.Module, fn: ir.Function, target: KernelTarget, lanes: int) -> None:
    """x86 `pshufb` on 16 rows of 16 entries: row h looked up by the low 4 bits of each index
    whose high 4 bits are h. AVX-512BW keeps a row's results by a mask compare (merge-masked
    shuffles); AVX2 instead moves the index out of the shuffle's range where the high bits
    differ, ((x xor 16 h) +sat 0x70 has bit 7 set, which makes pshufb give 0) and ORs the rows'
    results, four one-uop instructions a row where a byte blend costs two or three on Intel."""
    k = _emitter(module, fn, target)
    b = k.b
    vt = ir.VectorType(I8, lanes)
    shuffle = declare_function(module, _PSHUFB[lanes], vt, [vt, vt])
    rows = _table_rows(k, fn.args[0], 16, lanes)

    def body(x: ir.Value) -> ir.Value:
        if lanes == 64:
            low = b.and_(x, ir.Constant(vt, [0x0F] * lanes))
            high = b.lshr(x, ir.Constant(vt, [4] * lanes))
            out = ir.Constant(vt, None)
            for h, row in enumerate(rows):
                hit = b.icmp_unsigned("==", high, ir.Constant(vt, [h] * lanes))
                out = b.select(hit, b.call(shuffle, [row, low]), out)
            return out
        saturating_add = declare_function(module, f"llvm.uadd.sat.v{lanes}i8", vt, [vt, vt])
        out = ir.Constant(vt, None)
        for h, row in enumerate(rows):
            index = b.call(saturating_add, [b.xor(x, ir.Constant(vt, [16 * h] * lanes)),
                                            ir.Constant(vt, [0x70] * lanes)])
            out = b.or_(out, b.call(shuffle, [row, index]))
        return out

    _vectors(k, fn, lanes, body)


def _neon(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
    """AArch64 `tbl` on the table's first 64 entries, then `tbx` on each next 64 with the
    index less 64 (indices below wrap past 64: out of range, the result stays)."""
    k = _emitter(module, fn, target)
    b = k.b
    vt = ir.VectorType(I8, 16)
    rows = _table_rows(k, fn.args[0], 16, 16)
    tbl = declare_function(module, "llvm.aarch64.neon.tbl4.v16i8", vt, [vt] * 5)
    tbx = declare_function(module, "llvm.aarch64.neon.tbx4.v16i8", vt, [vt] * 6)

    def body(x: ir.Value) -> ir.Value:
        out = b.call(tbl, [*rows[:4], x])
        for q in range(1, 4):
            index = b.sub(x, ir.Constant(vt, [64 * q] * 16))
            out = b.call(tbx, [out, *rows[4 * q:4 * q + 4], index])
        return out

    _vectors(k, fn, 16, body)
