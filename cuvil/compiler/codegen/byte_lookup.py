"""The byte lookup kernel of cuvil's LookupTable: dst[i] = table[src[i] xor flip], 256 entries.

Loop vectorizers cannot vectorize a load at a computed index but by gathers, which on Zen 4
ran no faster than one byte at a time (1.4 cycles an element). With AVX-512 VBMI the whole
table fits in four registers: `vpermi2b` picks 64 bytes at once from two of them (128
entries, by bits 0-6 of each index byte), once for the low and once for the high half of
the table, and bit 7 of the index chooses between the two results: three instructions for 64
elements. VBMI is not part of x86-64-v4, so the v4 copy of a library tests the CPUID bit once
(`cpuid_gate`, as the int8 GEMM kernel does for VNNI) and falls back to the loop one byte at a
time, which every other target runs.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.codegen.emitter import (
    I8,
    I64,
    PTR,
    Emitter,
    add_target_features,
    cpuid_gate,
    declare_function,
    splat,
)
from cuvil.compiler.codegen.kernel_objects import kernel_function

__all__ = ["byte_lookup_function"]

#: void lookup(table, src, dst, n, flip): table 256 bytes, n elements, flip 0x80 for int8 src
LOOKUP_TYPE = ir.FunctionType(ir.VoidType(), [PTR, PTR, PTR, I64, I8])
#: CPUID leaf 7, subleaf 0, ECX bit 1: AVX512_VBMI
_VBMI_BIT = (7, 0, 2, 1)
_LANES = 64
_V = ir.VectorType(I8, _LANES)


def byte_lookup_function(module: ir.Module) -> ir.Function:
    """The kernel for the module's target and features (see the module docstring)."""

    def define(module: ir.Module, fn: ir.Function) -> None:
        features = set(getattr(module, "cuvil_features", "").split(","))
        if not module.triple.startswith("x86_64") or "+avx512bw" not in features \
                or "-avx512vbmi" in features:
            _bytewise(module, fn)
        elif "+avx512vbmi" in features:
            _vbmi(module, fn)
        else:
            fast, slow = (ir.Function(module, LOOKUP_TYPE, f"{fn.name}.{kind}")
                          for kind in ("vbmi", "bytewise"))
            fast.linkage = slow.linkage = "internal"
            add_target_features(module, fast, "+avx512vbmi")
            _vbmi(module, fast)
            _bytewise(module, slow)
            b = ir.IRBuilder(fn.append_basic_block("entry"))
            with b.if_else(cpuid_gate(module, b, _VBMI_BIT)) as (yes, no):
                with yes:
                    b.call(fast, fn.args)
                with no:
                    b.call(slow, fn.args)
            b.ret_void()

    return kernel_function(module, "cuvil.lookup8", LOOKUP_TYPE, define)


def _emitter(module: ir.Module, fn: ir.Function) -> Emitter:
    return Emitter(module, fn, ir.Constant(PTR, None), [], {})


def _bytes(k: Emitter, table: ir.Value, src: ir.Value, dst: ir.Value, flip: ir.Value,
           start: ir.Value, stop: ir.Value) -> None:
    b = k.b
    with k.loop(stop, start=start, name="i") as i:
        x = b.xor(b.load(b.gep(src, [i], source_etype=I8), typ=I8), flip)
        y = b.load(b.gep(table, [b.zext(x, I64)], source_etype=I8), typ=I8)
        b.store(y, b.gep(dst, [i], source_etype=I8))


def _bytewise(module: ir.Module, fn: ir.Function) -> None:
    k = _emitter(module, fn)
    table, src, dst, n, flip = fn.args
    _bytes(k, table, src, dst, flip, k.i64(0), n)
    k.b.ret_void()


def _vbmi(module: ir.Module, fn: ir.Function) -> None:
    k = _emitter(module, fn)
    b = k.b
    table, src, dst, n, flip = fn.args
    for arg in (src, dst):
        arg.add_attribute("noalias")
    permute = declare_function(module, "llvm.x86.avx512.vpermi2var.qi.512", _V, [_V, _V, _V])
    quarters = [b.load(b.gep(table, [k.i64(_LANES * q)], source_etype=I8), typ=_V, align=1)
                for q in range(4)]
    flips = splat(b, flip, _LANES)
    whole = b.and_(n, k.i64(-_LANES))
    with k.loop(whole, step=_LANES, name="v") as i:
        x = b.xor(b.load(b.gep(src, [i], source_etype=I8), typ=_V, align=1), flips)
        low = b.call(permute, [quarters[0], x, quarters[1]])
        high = b.call(permute, [quarters[2], x, quarters[3]])
        top = b.icmp_signed("<", x, ir.Constant(_V, None))
        b.store(b.select(top, high, low), b.gep(dst, [i], source_etype=I8), align=1)
    _bytes(k, table, src, dst, flip, whole, n)
    b.ret_void()
