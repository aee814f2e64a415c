"""An exact 8-bit integer matrix product with int32 results, MatMulInteger's arithmetic, shared
by the quantized ops:

    C[m, n] = sum_k (A[m, k] - a_zero) * (B[k, n] - b_zero[n])          (int32, wrapping)

A is uint8 or int8, row-major with a row stride; a_zero is a run-time scalar (DynamicQuantizeLinear
computes it per call). B is a constant weight packed at compile time (`pack_b_int8`), b_zero a
scalar or one per column; a B computed at run time is packed by the kernel into scratch memory
first (`emit_parallel_int8_gemm_runtime_b`: attention's products of two activations).

Every path multiplies the same two byte representations: ua = A as uint8 (signed A xor 0x80,
i.e. a + 128) and sb = B as int8 (unsigned B xor 0x80, i.e. b - 128), the form AVX-512 VNNI's
vpdpbusd takes. With a = ua + ca (ca = -128 for int8 A, else 0) and b = sb + cb (cb = 128 for
uint8 B, else 0), alpha = ca - a_zero and beta[n] = cb - b_zero[n]:

    C = sum_k ua * sb + beta[n] * rowsum(ua)[m] + alpha * (colsum(sb)[n] + K * beta[n])

colsum and beta come from the packing; the row sums of A are computed only when some beta is
not 0 (`PackedB.row_sums`: uint8 weights whose zero point is not 128; the usual int8 symmetric
and uint8-at-128 weights need none). All of it is int32 arithmetic modulo 2^32, so the result
is bit-identical to the int64 sum reduced to int32, whatever the order of the additions.

B is packed (`pack_b_int8`) in panels of PACK_COLS columns, N padded with zero columns to a whole
panel, each panel k-major in groups of GROUP = 4 values of k: group g of a panel is 32 columns x
4 bytes, column c's B[4g..4g+3, c] consecutive (K padded with zeros to a multiple of 4). One
vector load then gives W columns' 4 values each, what a 4-way dot product instruction reads;
every x86 level and every AArch64 kernel reads this one layout (the CPU variants of a library
share one weights blob; the packing pass does not know the target). After the panels come
colsum and beta (int32, one per padded column).

Instruction sets (`int8_isa`), each a register tile of MR rows x NV vectors of W columns whose
int32 sums stay in registers over the whole of K:

- "vnni512": AVX-512 VNNI vpdpbusd, 64 multiply-adds per instruction (12 x 32 tile);
- "avxvnni": AVX-VNNI's VEX vpdpbusd on 8 lanes (6 x 16);
- "madd512" / "madd256" / "madd128" (AVX-512BW, AVX2, SSE2; 6 x 2 vectors): bytes widened to
  int16 exactly and multiplied with vpmaddwd, 16 multiply-adds per 256 bits. A row tile's A is
  widened once into a stack buffer (`_Writer.widen_rows`), each group as [a0, a2, a1, a3], so
  that the tile broadcasts its int16 pairs straight from memory; B's words are split into
  sign-extended low and high bytes by shifts (`_Writer.b_operand`), which pairs column c's
  k0, k2 with a0, a2 and k1, k3 with a1, a3 in c's own 32-bit lane. vpmaddubsw (32 per 256
  bits, as onnxruntime's u8s8 kernels use) is not: its int16 pair sums saturate, and results
  would then depend on the CPU;
- "i8mm": AArch64 I8MM, 2 x 8 by 8 x 2 byte matrices into 2 x 2 int32 per instruction (twice
  SDOT's multiply-adds): USMMLA on uint8 A as it is (no xor, no correction: the usual uint8
  activations by int8 weights), SMMLA on int8 A as it is (plus 128 * colsum(sb), as SDOT's);
  B's 8 x 2 blocks are two groups zipped in registers (`_Writer.tile_mmla`);
- "sdot": AArch64 SDOT (dotprod) for int8 A, which it takes as it is (sa = ua xor 0x80 =
  ua - 128, plus 128 * colsum(sb));
- "udot": AArch64 UDOT (dotprod) for uint8 A: ua as it is by ub = sb xor 0x80 = sb + 128 (the
  xor once per B vector, shared by the tile's 12 rows, where SDOT would xor each row's A),
  minus 128 * rowsum(ua) (the row sums cost one pass over the tile's rows of A);
- "generic": widening multiply-accumulate in plain LLVM vectors (NEON's smlal on AArch64
  without dotprod, and any other target), products summed in groups of 4 at the end.

B is stored as sb (int8) whatever its ONNX type, so UMMLA (uint8 by uint8) would need the same
xor and row sums as UDOT without doing more than USMMLA: it is not used.

VNNI is not part of x86-64-v4 nor AVX-VNNI of v3, so the library has no copy that could assume
them. Rather than a fourth and fifth copy of every model's code (compile time, library size and
the dispatcher's table, all for one kernel), the v4 copy holds both the vnni512 and the
madd512 kernel, the v3 copy avxvnni and madd256, and the kernel's entry tests the CPUID bit
once (the runtime's cuvil_cpuid_bit, its answer cached in an internal global like the
dispatcher's level), see `cpuid_gate`. The VNNI
kernel itself is compiled with the extra feature as a function attribute. A module whose
features name the flag ("+avx512vnni", e.g. cpu="native" here) calls it directly; one that
excludes it ("-avx512vnni") never does. AArch64 does the same, in two steps: a baseline
without dotprod (aarch64-linux's Armv8.0-A) holds the i8mm, the sdot or udot (by A's type)
and the generic kernel, and asks the OS once for each flag, I8MM first (HWCAP2_I8MM, then
HWCAP_ASIMDDP, from getauxval on Linux); "+dotprod" (apple-m1, a pinned cortex-a76) holds
i8mm and the dot product only, "+i8mm" (a pinned neoverse-v1) i8mm only. macOS is asked for
I8MM with sysctl (FEAT_I8MM, the M2 on); Windows is asked for the dot product only, so it
never runs the i8mm kernel (it has no documented I8MM query the runtime can rely on).

The epilogue (`QEpilogue`) turns a finished tile into the output while it is in registers:
int32 as is, float32 = (acc) * a_scale * scale[n] + bias[n], or uint8/int8 =
saturate(round_half_even((acc + bias[n]) * a_scale * scale[n]) + c_zero) (QLinearMatMul/Conv),
optionally followed by a second per-column requantization of that byte q (`post`):
saturate(round_half_even((q - c_zero) * post_scale[n] + post_shift[n])), a
DequantizeLinear -> BatchNormalization -> QuantizeLinear after the product (the second zero
point is in post_shift).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import (
    I8,
    I32,
    I64,
    PTR,
    Emitter,
    add_target_features,
    cpuid_gate,
    declare_function,
    masked_intrinsic,
    splat,
    vector_suffix,
)
from cuvil.compiler.kernels.gemm import block_span, split_blocks
from cuvil.compiler.kernels.objects import kernel_function
from cuvil.compiler.kernels.target import KernelTarget

I16 = ir.IntType(16)
F32 = ir.FloatType()
#: columns per panel of a packed B and values of k per group (what one 4-way dot reads)
PACK_COLS = 32
GROUP = 4
#: a block of columns of B (x K bytes) is walked by every row tile before the next: it stays in L2
BLOCK_BYTES = 512 * 1024
#: the stack buffer of a row tile's A widened to int16 (the vpmaddwd kinds: `widen_rows`)
A_BUFFER_BYTES = 64 * 1024


# ------------------------------------------------------------------------------ packing


@dataclass(frozen=True)
class PackedB:
    """A constant B packed for the kernel: `data` is the whole blob (panels, colsum, beta)."""

    data: np.ndarray  # uint8, packed_b_size(k, n) bytes
    k: int
    n: int
    #: whether the kernel must compute row sums of A (some column's beta is not 0)
    row_sums: bool


def padded(k: int, n: int) -> tuple[int, int]:
    """K rounded up to whole groups, N to whole panels."""
    return -(-k // GROUP) * GROUP, -(-n // PACK_COLS) * PACK_COLS


def packed_b_size(k: int, n: int) -> int:
    """Bytes of a packed B[K, N] (also the scratch the run-time-B product needs)."""
    kp, np_ = padded(k, n)
    return kp * np_ + 8 * np_


def pack_b_int8(b: np.ndarray, b_zero: int | np.ndarray = 0) -> PackedB:
    """B[K, N] (uint8 or int8) with its zero point (a scalar, or one per column) packed as the
    module docstring says."""
    b = np.asarray(b)
    if b.ndim != 2 or b.dtype not in (np.uint8, np.int8):
        raise ValueError(f"pack_b_int8 takes a 2-D uint8 or int8 matrix, not {b.dtype} {b.shape}")
    k, n = b.shape
    zero = np.asarray(b_zero).astype(np.int64).reshape(-1)
    if zero.size not in (1, n):
        raise ValueError(f"b_zero has {zero.size} values for {n} columns")
    unsigned = b.dtype == np.uint8
    sb = b.astype(np.int64) - (128 if unsigned else 0)
    kp, np_ = padded(k, n)
    full = np.zeros((kp, np_), np.int8)
    full[:k, :n] = sb
    # [group, j, panel, column] -> [panel, group, column, j]
    panels = full.reshape(kp // GROUP, GROUP, np_ // PACK_COLS, PACK_COLS).transpose(2, 0, 3, 1)
    colsum = np.zeros(np_, np.int64)
    colsum[:n] = sb.sum(axis=0)
    beta = np.zeros(np_, np.int64)
    beta[:n] = (128 if unsigned else 0) - np.broadcast_to(zero, (n,))
    data = np.concatenate([np.ascontiguousarray(panels).reshape(-1).view(np.uint8),
                           colsum.astype(np.int32).view(np.uint8),
                           beta.astype(np.int32).view(np.uint8)])
    return PackedB(data, k, n, bool(np.any(beta != 0)))


# ------------------------------------------------------------------------------ interface


@dataclass(frozen=True)
class QEpilogue:
    """What a finished tile becomes: output "int32" (the sums), "float32"
    (acc * a_scale * scale[n] + bias[n]) or "uint8"/"int8" (saturate(round((acc + bias[n]) *
    a_scale * scale[n]) + c_zero), round half to even). `bias`: "none", "int32" (added to the
    sums before scaling: QLinearConv's B) or "float32" (added after: float32 output only).
    scale and bias are float32/int32 arrays of N; a_scale (float32) and c_zero (int32) are
    run-time scalars. `relu` (uint8/int8 output): the result is at least c_zero (a fused
    Relu of the dequantized value)."""

    output: str = "int32"
    bias: str = "none"
    relu: bool = False
    #: float32 output: an activation applied last (kernels/activation.py's names) and its
    #: parameters (a fused Gelu after a dynamically quantized product)
    activation: str | None = None
    params: tuple[float, ...] = ()
    #: the second requantization (post_scale, post_shift: float32 arrays of N)
    post: bool = False

    def __post_init__(self) -> None:
        assert self.output in ("int32", "float32", "uint8", "int8"), self.output
        assert self.bias in ("none", "int32", "float32"), self.bias
        assert self.bias != "float32" or self.output == "float32", self
        assert not self.relu or self.output in ("uint8", "int8"), self
        assert self.activation is None or self.output == "float32", self
        assert not self.post or (self.output in ("uint8", "int8") and not self.relu), self

    @property
    def suffix(self) -> str:
        act = f"_{self.activation}{'_'.join(map(repr, self.params))}" if self.activation else ""
        return (f"{self.output}_{self.bias}{'_relu' if self.relu else ''}{act}"
                f"{'_post' if self.post else ''}")


INT32 = QEpilogue()


@dataclass(frozen=True)
class QOperands:
    """What a product's epilogue reads besides the sums: its form (`QEpilogue`) and its
    operands, each read only where the form uses it (scale, bias, post_scale, post_shift:
    pointers to N values; a_scale: a float; c_zero: an i32)."""

    epilogue: QEpilogue = INT32
    scale: ir.Value | None = None
    a_scale: ir.Value | None = None
    bias: ir.Value | None = None
    c_zero: ir.Value | None = None
    post_scale: ir.Value | None = None
    post_shift: ir.Value | None = None


@dataclass(frozen=True)
class Int8Isa:
    kind: str  # see the module docstring
    vector: int  # int32 lanes (= columns) per vector
    mr: int  # rows per tile
    nv: int  # vectors per tile row
    #: the CPUID test (leaf, subleaf, register, bit) under which `kind` runs, else `fallback`
    #: (itself possibly gated: AArch64 tries I8MM, then the dot product, then plain NEON)
    gate: tuple[int, int, int, int] | None = None
    fallback: Int8Isa | None = None
    #: extra LLVM target features the kind's function needs
    features: str = ""

    @property
    def nr(self) -> int:
        return self.vector * self.nv


_SHAPES = {"vnni512": (16, 12, 2), "avxvnni": (8, 6, 2), "madd512": (16, 6, 2),
           "madd256": (8, 6, 2), "madd128": (4, 6, 2), "sdot": (4, 12, 2), "udot": (4, 12, 2),
           # 6 row pairs x 4 column pairs of 2 x 2 sums: 24 of the 32 registers
           "i8mm": (4, 12, 2), "generic": (4, 4, 1)}
#: the kinds that multiply with vpmaddwd (bytes widened to int16: exact, unlike vpmaddubsw)
_MADD = ("madd512", "madd256", "madd128")
#: CPUID leaf 7 bits (X86_CPU_FLAGS): AVX512_VNNI is ECX bit 11 of subleaf 0, AVX-VNNI EAX bit 4
#: of subleaf 1 (an invalid subleaf reads as zeros). Their register state is the AVX-512 or
#: AVX state the dispatcher already checked to run the copy.
_VNNI512_BIT = (7, 0, 2, 11)
_AVXVNNI_BIT = (7, 1, 0, 4)
#: AArch64: HWCAP_ASIMDDP, bit 20 of AT_HWCAP, and HWCAP2_I8MM, bit 13 of AT_HWCAP2 (the
#: runtime reads them with getauxval; macOS is asked for FEAT_I8MM with sysctl)
_DOTPROD_BIT = (1, 0, 0, 20)
_I8MM_BIT = (2, 0, 0, 13)


def isa_named(kind: str, **extra: object) -> Int8Isa:
    vector, mr, nv = _SHAPES[kind]
    return Int8Isa(kind, vector, mr, nv, **extra)  # type: ignore[arg-type]


def _gated(target: KernelTarget, flag: str, kind: str, bit: tuple[int, int, int, int],
           fallback: Int8Isa) -> Int8Isa:
    """`kind` where the module's features have `flag`, `fallback` where they exclude it, else
    `kind` behind the run-time test of `bit`."""
    if target.has(flag):
        return isa_named(kind)
    if target.excludes(flag):
        return fallback
    return isa_named(kind, gate=bit, fallback=fallback, features=f"+{flag}")


def int8_isa(target: KernelTarget, a_signed: bool = False) -> Int8Isa:
    """The kernel for the target and its features and A's signedness (see the module
    docstring)."""
    if target.is_aarch64:
        dot = _gated(target, "dotprod", "sdot" if a_signed else "udot", _DOTPROD_BIT,
                     isa_named("generic"))
        return _gated(target, "i8mm", "i8mm", _I8MM_BIT, dot)
    if not target.is_x86:
        return isa_named("generic")
    if target.has("avx512bw"):
        return _gated(target, "avx512vnni", "vnni512", _VNNI512_BIT, isa_named("madd512"))
    if target.has("avx2"):
        return _gated(target, "avxvnni", "avxvnni", _AVXVNNI_BIT, isa_named("madd256"))
    return isa_named("madd128")


def int8_gemm_function(module: ir.Module, target: KernelTarget, a_signed: bool, row_sums: bool,
                       epilogue: QEpilogue = INT32) -> ir.Function:
    """`void qgemm(M, N, K, A, lda, a_zero, B, colsum, beta, C, ldc, scale, a_scale, bias,
    c_zero, post_scale, post_shift)`: C[M, N] (row stride ldc, elements of the epilogue's
    output type) from A[M, K] (row stride lda, bytes) and a packed B whose panels start at B
    and whose colsum and beta (int32) at colsum and beta. M, N, K, lda, ldc are i64, a_zero and
    c_zero i32, a_scale float; scale, bias, post_scale and post_shift (N values) are read only
    when the epilogue uses them."""
    key = f"{int(a_signed)}{int(row_sums)}.{epilogue.suffix}"
    name = f"cuvil.qgemm.{key}"

    def define_isa(module: ir.Module, fn: ir.Function, target: KernelTarget,
                   kind_isa: Int8Isa) -> None:
        fn.attributes.add("noinline")
        for i in (3, 6, 9):
            fn.args[i].add_attribute("noalias")
        if kind_isa.features:
            add_target_features(target, fn, kind_isa.features)
        _Writer(module, fn, target, kind_isa, a_signed, row_sums, epilogue).write()

    def define_gated(module: ir.Module, fn: ir.Function, target: KernelTarget,
                     isa: Int8Isa) -> None:
        if isa.gate is None:
            define_isa(module, fn, target, isa)
            return
        assert isa.fallback is not None
        # a gated fallback is its own gate's entry, not yet its kernel
        fast, slow = (ir.Function(module, _QGEMM_TYPE, f"{name}.{kind}") for kind in (
            isa.kind, isa.fallback.kind + (".gated" if isa.fallback.gate else "")))
        fast.linkage = slow.linkage = "internal"
        define_isa(module, fast, target, isa)
        define_gated(module, slow, target, isa.fallback)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        has = cpuid_gate(module, b, isa.gate)
        with b.if_else(has) as (yes, no):
            with yes:
                b.call(fast, fn.args)
            with no:
                b.call(slow, fn.args)
        b.ret_void()

    def define(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        define_gated(module, fn, target, int8_isa(target, a_signed))

    return kernel_function(module, target, name, _QGEMM_TYPE, define)


_QGEMM_TYPE = ir.FunctionType(ir.VoidType(), [I64, I64, I64, PTR, I64, I32, PTR, PTR, PTR, PTR,
                                              I64, PTR, F32, PTR, I32, PTR, PTR])


_ALIGN1 = ir.Constant(I32, 1)


class _Writer:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget, isa: Int8Isa,
                 a_signed: bool, row_sums: bool, epilogue: QEpilogue) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.module = module
        self.isa, self.epilogue = isa, epilogue
        (self.m, self.n, self.kk, self.a, self.lda, self.a_zero, self.bp, self.colsum,
         self.beta, self.c, self.ldc, self.scale, self.a_scale, self.bias,
         self.c_zero, self.post_scale, self.post_shift) = fn.args
        w = isa.vector
        self.w = w
        self.vi32 = ir.VectorType(I32, w)
        # the xor that turns A's bytes into the multiplied form: ua (signed A: a ^ 0x80), or
        # sa = ua ^ 0x80 where the instruction takes signed bytes (SDOT; SMMLA for int8 A,
        # USMMLA takes uint8 A as it is)
        self.signed_a = isa.kind == "sdot" or (isa.kind == "i8mm" and a_signed)
        self.ua_xor = 0x80 if a_signed else 0
        self.a_xor = self.ua_xor ^ (0x80 if self.signed_a else 0)
        # UDOT multiplies ub = sb ^ 0x80 = sb + 128 (B's xor, once per load for all rows)
        # and takes 128 * rowsum(ua) off: every tile needs A's row sums
        self.row_sums = row_sums or isa.kind == "udot"
        self.ca = -128 if a_signed else 0
        self._buffer: ir.Value | None = None
        self._widened: ir.Value | None = None
        self.out_type = {"int32": I32, "float32": F32, "uint8": I8, "int8": I8}[epilogue.output]

    # -- helpers -------------------------------------------------------------------------
    def i32(self, v: int) -> ir.Constant:
        return ir.Constant(I32, v)

    def slots(self, count: int, ty: ir.Type) -> list[ir.Value]:
        """Zeroed stack slots (registers after mem2reg: loops carry them as phis)."""
        b = self.k.b
        with b.goto_entry_block():
            out = [b.alloca(ty) for _ in range(count)]
        for s in out:
            b.store(ir.Constant(ty, None), s)
        return out

    def lanes_below(self, count: ir.Value, width: int) -> ir.Value:
        lanes = ir.Constant(ir.VectorType(I64, width), list(range(width)))
        return self.k.b.icmp_signed("<", lanes, splat(self.k.b, count, width))

    def vload(self, p: ir.Value, vt: ir.VectorType, mask: ir.Value | None,
              passthru: ir.Constant | None = None) -> ir.Value:
        b = self.k.b
        if mask is None:
            return b.load(p, typ=vt, align=1)
        return b.call(masked_intrinsic(self.module, "load", vt),
                      [p, _ALIGN1, mask, passthru or ir.Constant(vt, None)])

    def vstore(self, x: ir.Value, p: ir.Value, mask: ir.Value | None) -> None:
        b = self.k.b
        if mask is None:
            b.store(x, p, align=1)
        else:
            b.call(masked_intrinsic(self.module, "store", x.type), [x, p, _ALIGN1, mask])

    def tile_buffer(self, count: int) -> ir.Value:
        """A stack buffer of `count` outputs (the largest tile's), made once per function."""
        if self._buffer is None:
            b = self.k.b
            with b.goto_entry_block():
                size = self.isa.mr * self.isa.nr
                self._buffer = b.alloca(ir.ArrayType(self.out_type, size))
                self._buffer.align = 64
                self._buffer.type = PTR  # an untyped pointer, like every other buffer here
        assert count <= self.isa.mr * self.isa.nr
        return self._buffer

    def byte_splat(self, value: int, count: int) -> ir.Constant:
        return ir.Constant(ir.VectorType(I8, count), [value] * count)

    # -- structure -----------------------------------------------------------------------
    def write(self) -> None:
        """Columns in blocks of BLOCK_BYTES of B; in each, every row tile (its row sums first,
        when needed) walks the block's column tiles."""
        k = self.k
        b = k.b
        kp = b.and_(b.add(self.kk, k.i64(GROUP - 1)), k.i64(-GROUP))
        self.kp = kp
        self.groups = b.udiv(self.kk, k.i64(GROUP))
        self.tail = b.sub(self.kk, b.mul(self.groups, k.i64(GROUP)))
        self.alpha = b.sub(self.i32(self.ca), self.a_zero)
        k32 = b.trunc(self.kk, I32)
        self.k32 = k32
        cols = b.udiv(k.i64(BLOCK_BYTES), k.maximum("int64", kp, k.i64(1)))
        block = k.maximum("int64", b.mul(b.udiv(cols, k.i64(PACK_COLS)), k.i64(PACK_COLS)),
                          k.i64(PACK_COLS))
        count = b.udiv(b.add(self.n, b.sub(block, k.i64(1))), block)
        with k.loop(count, name="jb") as t:
            jb = b.mul(t, block)
            jend = k.minimum("int64", self.n, b.add(jb, block))

            def row_tile(i0: ir.Value, height: int) -> None:
                sums = self.row_sums_of(i0, height) if self.row_sums else None
                if self.isa.kind in _MADD:
                    self.widen_rows(i0, height)
                self.columns(jb, jend, i0, height, sums)

            self.row_tiles(row_tile)
        b.ret_void()

    def widen_rows(self, i0: ir.Value, height: int) -> None:
        """The vpmaddwd kinds: rows i0.. of A as ua widened to int16 into a stack buffer, once
        per row tile for all its column tiles, each group of 4 as [a0, a2, a1, a3] (what
        b_operand's halves pair them with): the tile then broadcasts A straight from memory,
        where widening it there cost three vector operations per row and group. Zeros past
        K."""
        k = self.k
        b = k.b
        if self._widened is None:
            with b.goto_entry_block():
                # MR rows of K values when they fit in A_BUFFER_BYTES; else `row_tiles` takes
                # one row at a time (a K of tens of thousands: FC layers, M is small there)
                size = k.maximum("int64", k.i64(A_BUFFER_BYTES), b.mul(self.kp, k.i64(2)))
                self._widened = b.alloca(I8, size=size)
                self._widened.align = 64
                self._widened.type = PTR  # an untyped pointer, like every other buffer here
        flip = self.byte_splat(self.ua_xor, 8 * GROUP)
        order = [GROUP * (i // GROUP) + (0, 2, 1, 3)[i % GROUP] for i in range(8 * GROUP)]
        whole = b.mul(b.udiv(self.kk, k.i64(8 * GROUP)), k.i64(8 * GROUP))
        vt = ir.VectorType(I8, 8 * GROUP)

        def widen(src: ir.Value, dst: ir.Value, p: ir.Value, mask: ir.Value | None) -> None:
            # lanes past K read as the flip, which the xor turns into 0
            x = b.xor(self.vload(b.gep(src, [p], source_etype=I8), vt, mask, flip), flip)
            x = b.shuffle_vector(x, ir.Constant(vt, ir.Undefined),
                                 ir.Constant(ir.VectorType(I32, 8 * GROUP), order))
            wide = b.zext(x, ir.VectorType(I16, 8 * GROUP))
            out = b.gep(dst, [p], source_etype=I16)
            if mask is None:
                b.store(wide, out, align=2)
            else:  # the kp - p values left: whole groups, their zeros too
                groups_left = b.udiv(b.sub(self.kp, p), k.i64(GROUP))
                self.vstore(wide, out, self.lanes_below(b.mul(groups_left, k.i64(GROUP)),
                                                        8 * GROUP))

        for r in range(height):
            src = b.gep(self.a, [b.mul(b.add(i0, k.i64(r)), self.lda)], source_etype=I8)
            dst = b.gep(self._widened, [b.mul(k.i64(r), self.kp)], source_etype=I16)
            with k.loop(whole, step=8 * GROUP, name="wa") as p:
                widen(src, dst, p, None)
            with k.if_then(b.icmp_signed("<", whole, self.kk)):
                widen(src, dst, whole, self.lanes_below(b.sub(self.kk, whole), 8 * GROUP))

    def row_tiles(self, body: Callable[[ir.Value, int], None]) -> None:
        """body(i0, height): whole MR-row tiles, then tiles of halving heights for the rest.
        The vpmaddwd kinds take every row alone where MR widened rows of A would not fit in
        A_BUFFER_BYTES (`widen_rows`)."""
        k, mr = self.k, self.isa.mr
        b = k.b
        tiled = self.m
        if self.isa.kind in _MADD:
            fits = b.icmp_unsigned("<=", b.mul(self.kp, k.i64(2 * mr)), k.i64(A_BUFFER_BYTES))
            tiled = b.select(fits, self.m, k.i64(0))
        m_full = b.mul(b.udiv(tiled, k.i64(mr)), k.i64(mr))
        with k.loop(m_full, step=mr, name="i") as i:
            body(i, mr)
        start = m_full
        height = 1
        heights: list[int] = []
        while height < mr:
            heights.insert(0, height)
            height *= 2
        for h in heights:
            if h == 1:  # (a loop: all rows when tiled is 0, else the one row left if any)
                with k.loop(self.m, start=start, name="i1") as i:
                    body(i, 1)
                break
            fits = b.icmp_signed(">=", b.sub(tiled, start), k.i64(h))
            with k.if_then(fits):
                body(start, h)
            start = b.add(start, b.select(fits, k.i64(h), k.i64(0)))

    def columns(self, jb: ir.Value, jend: ir.Value, i0: ir.Value, height: int,
                sums: list[ir.Value] | None) -> None:
        """The column tiles of [jb, jend) for the rows at i0, the last one's stores masked to
        the columns left (B is padded to whole panels: its loads need no mask). One tile body
        per height, not one per width of the last tile: compile time."""
        k, isa = self.k, self.isa
        with k.loop(jend, start=jb, step=isa.nr, name="j") as j:
            self.tile(i0, j, height, isa.nv, k.b.sub(jend, j), sums)

    def row_sums_of(self, i0: ir.Value, height: int) -> list[ir.Value]:
        """sum_k ua[i0 + r, k] (int32) for each row r of the tile, 16 bytes at a time."""
        k = self.k
        b = k.b
        width = 16
        vb = ir.VectorType(I8, width)
        vi = ir.VectorType(I32, width)
        accs = self.slots(height, vi)
        whole = b.mul(b.udiv(self.kk, k.i64(width)), k.i64(width))
        flip = self.byte_splat(self.ua_xor, width)

        def add(p: ir.Value, mask: ir.Value | None, r: int) -> None:
            row = b.gep(self.a, [b.add(b.mul(b.add(i0, k.i64(r)), self.lda), p)],
                        source_etype=I8)
            # lanes past K read as the flip, which the xor turns into 0
            x = b.xor(self.vload(row, vb, mask, flip), flip)
            b.store(b.add(b.load(accs[r]), b.zext(x, vi)), accs[r])

        with k.loop(whole, step=width, name="rs") as p:
            for r in range(height):
                add(p, None, r)
        with k.if_then(b.icmp_signed("<", whole, self.kk)):
            mask = self.lanes_below(b.sub(self.kk, whole), width)
            for r in range(height):
                add(whole, mask, r)
        reduce = declare_function(self.module, "llvm.vector.reduce.add.v16i32", I32, [vi])
        return [b.call(reduce, [b.load(acc)]) for acc in accs]

    # -- one tile ------------------------------------------------------------------------
    def tile(self, i0: ir.Value, j0: ir.Value, rows: int, nv: int, left: ir.Value,
             sums: list[ir.Value] | None) -> None:
        """C[i0:i0+rows, j0:j0+nv*W]; `left`: the columns from j0 to the end of the block
        (fewer than a tile's: the stores are masked to them)."""
        k, isa = self.k, self.isa
        b = k.b
        kind = isa.kind
        if kind == "i8mm":
            self.tile_mmla(i0, j0, rows, nv, left, sums)
            return
        acc_t = ir.VectorType(I32, 4 * self.w) if kind == "generic" else self.vi32
        accs = self.slots(rows * nv, acc_t)
        b_base, a_rows = self.tile_operands(i0, j0, rows)
        a_mask_vt = ir.VectorType(I8, GROUP)
        widened = kind in _MADD

        def step(g: ir.Value, tail_mask: ir.Value | None) -> None:
            bsrc = b.gep(b_base, [b.mul(g, k.i64(PACK_COLS * GROUP))], source_etype=I8)
            bvec = [self.b_operand(self.vload(b.gep(bsrc, [k.i64(v * self.w * GROUP)],
                                                    source_etype=I8),
                                              ir.VectorType(I8, self.w * GROUP), None))
                    for v in range(nv)]
            for r in range(rows):
                a_op: ir.Value | tuple[ir.Value, ir.Value]
                if widened:  # [a0, a2] and [a1, a3] as int16, from `widen_rows`
                    at = b.gep(a_rows[r], [b.mul(g, k.i64(GROUP))], source_etype=I16)
                    a_op = tuple(self.word_pairs(b.load(b.gep(at, [k.i64(h)], source_etype=I32),
                                                        typ=I32, align=4)) for h in range(2))
                else:
                    at = b.gep(a_rows[r], [b.mul(g, k.i64(GROUP))], source_etype=I8)
                    if tail_mask is None:
                        a4 = b.load(at, typ=I32, align=1)
                    else:
                        a4 = b.bitcast(self.vload(at, a_mask_vt, tail_mask), I32)
                    if self.a_xor:
                        a4 = b.xor(a4, self.i32(self.a_xor * 0x01010101))
                    a_op = self.a_operand(a4)
                for v in range(nv):
                    self.multiply(accs[r * nv + v], a_op, bvec[v])

        if widened:  # the widened rows hold whole groups, zeros past K
            with k.loop(b.udiv(self.kp, k.i64(GROUP)), name="g") as g:
                step(g, None)
        else:
            with k.loop(self.groups, name="g") as g:
                step(g, None)
            with k.if_then(b.icmp_signed(">", self.tail, k.i64(0))):
                step(self.groups, self.lanes_below(self.tail, GROUP))

        def row_vector(r: int, v: int) -> ir.Value:
            return self.reduce(accs[r * nv + v])

        self.finish(row_vector, i0, j0, rows, nv, left, sums)

    def tile_operands(self, i0: ir.Value, j0: ir.Value,
                      rows: int) -> tuple[ir.Value, list[ir.Value]]:
        """Where the tile at (i0, j0) reads: column j0's group 0 in the packed B (panels of
        PACK_COLS columns, K padded to kp), and its rows of A."""
        k = self.k
        b = k.b
        panel = b.udiv(j0, k.i64(PACK_COLS))
        within = b.sub(j0, b.mul(panel, k.i64(PACK_COLS)))
        b_base = b.gep(self.bp, [b.add(b.mul(panel, b.mul(self.kp, k.i64(PACK_COLS))),
                                       b.mul(within, k.i64(GROUP)))], source_etype=I8)
        if self.isa.kind in _MADD:  # widened by widen_rows
            assert self._widened is not None
            a_rows = [b.gep(self._widened, [b.mul(k.i64(r), self.kp)], source_etype=I16)
                      for r in range(rows)]
        else:
            a_rows = [b.gep(self.a, [b.mul(b.add(i0, k.i64(r)), self.lda)], source_etype=I8)
                      for r in range(rows)]
        return b_base, a_rows

    def tile_mmla(self, i0: ir.Value, j0: ir.Value, rows: int, nv: int, left: ir.Value,
                  sums: list[ir.Value] | None) -> None:
        """The tile on I8MM: per 8 values of k, SMMLA/USMMLA multiply two rows of A (2 x 8
        bytes) by two columns of B (8 x 2) into a 2 x 2 block of sums. B's 8 x 2 blocks are
        two groups' 32-bit lanes interleaved (zip1/zip2, 4 per 24 MMLAs), from the packing
        every target reads: a layout of I8MM's own would double the weights (packed both
        ways, the i8mm kernel chosen at run time) or need the target in the packing pass,
        which does not know it."""
        k, w = self.k, self.w
        b = k.b
        pairs, cols = (rows + 1) // 2, 2 * nv  # pairs of rows, pairs of columns
        v16 = ir.VectorType(I8, 16)
        accs = self.slots(pairs * cols, self.vi32)
        b_base, a_rows = self.tile_operands(i0, j0, rows)
        name = f"llvm.aarch64.neon.{'smmla' if self.signed_a else 'usmmla'}.v4i32.v16i8"
        mmla = declare_function(self.module, name, self.vi32, [self.vi32, v16, v16])
        lo_hi = ir.VectorType(I32, 4)
        assert self.a_xor == 0  # USMMLA takes uint8 A as it is, SMMLA int8 A

        with b.goto_entry_block():
            spare = b.alloca(I64)

        def step(s: ir.Value, rest: ir.Value | None, second: ir.Value | None) -> None:
            """k from 8s: groups 2s and 2s + 1; the last step has `rest` < 8 values of k
            (`second`: whether group 2s + 1 is in B; A's zeros past K make its products 0)."""
            first = b.gep(b_base, [b.mul(s, k.i64(2 * PACK_COLS * GROUP))], source_etype=I8)
            after = b.gep(first, [k.i64(PACK_COLS * GROUP)], source_etype=I8)
            if second is not None:
                after = b.select(second, after, first)
            blocks = []
            for v in range(nv):
                lo, hi = (self.vload(b.gep(p, [k.i64(v * w * GROUP)], source_etype=I8), lo_hi,
                                     None) for p in (first, after))
                for order in ([0, 4, 1, 5], [2, 6, 3, 7]):
                    pair = b.shuffle_vector(lo, hi, ir.Constant(lo_hi, order))
                    blocks.append(b.bitcast(pair, v16))
            for p in range(pairs):
                halves = ir.Constant(ir.VectorType(I64, 2), None)
                for h in range(2):
                    r = 2 * p + h
                    if r >= rows:
                        continue  # the odd last row's partner: zeros
                    at = b.gep(a_rows[r], [b.mul(s, k.i64(2 * GROUP))], source_etype=I8)
                    if rest is None:
                        a8 = b.load(at, typ=I64, align=1)
                    else:  # a copy, not a masked load: LLVM splits that into a branch a byte
                        b.store(ir.Constant(I64, 0), spare)
                        k.memcpy(spare, at, rest)
                        a8 = b.load(spare)
                    halves = b.insert_element(halves, a8, ir.Constant(I32, h))
                a16 = b.bitcast(halves, v16)
                for c in range(cols):
                    acc = accs[p * cols + c]
                    b.store(b.call(mmla, [b.load(acc), a16, blocks[c]]), acc)

        steps = b.udiv(self.kk, k.i64(2 * GROUP))
        rest = b.sub(self.kk, b.mul(steps, k.i64(2 * GROUP)))
        with k.loop(steps, name="g") as s:
            step(s, None, None)
        with k.if_then(b.icmp_signed(">", rest, k.i64(0))):
            step(steps, rest, b.icmp_signed(">", rest, k.i64(GROUP)))

        def row_vector(r: int, v: int) -> ir.Value:
            # a 2 x 2 block is [r c, r c+1, r+1 c, r+1 c+1]: row r's 4 columns from two blocks
            p, h = divmod(r, 2)
            left_, right = (b.load(accs[p * cols + 2 * v + i]) for i in (0, 1))
            order = [0, 1, 4, 5] if h == 0 else [2, 3, 6, 7]
            return b.shuffle_vector(left_, right, ir.Constant(lo_hi, order))

        self.finish(row_vector, i0, j0, rows, nv, left, sums)

    def b_operand(self, bv: ir.Value) -> ir.Value | tuple[ir.Value, ir.Value]:
        """What the multiply takes of one vector of B (4W bytes: W columns' 4 values of k).
        The vpmaddwd kinds: B's 16-bit words (a column's k0 k1, then its k2 k3) split into
        their low and high bytes, each sign-extended to 16 bits by shifts (lo: k0 and k2 of
        each column, hi: k1 and k3), so that one vpmaddwd of each by A's matching bytes leaves
        every column's sums in its own 32-bit lane: no shuffle, one accumulator per vector."""
        b, kind = self.k.b, self.isa.kind
        if kind == "udot":
            return b.xor(bv, self.byte_splat(0x80, self.w * GROUP))
        if kind not in _MADD:
            return bv
        words = b.bitcast(bv, ir.VectorType(I16, 2 * self.w))
        eight = ir.Constant(words.type, [8] * (2 * self.w))
        return b.ashr(b.shl(words, eight), eight), b.ashr(words, eight)

    def word_pairs(self, pair: ir.Value) -> ir.Value:
        """Two int16 values of A (one i32) in every 32-bit lane: a vpmaddwd operand."""
        return self.k.b.bitcast(splat(self.k.b, pair, self.w), ir.VectorType(I16, 2 * self.w))

    def a_operand(self, a4: ir.Value) -> ir.Value:
        """What the multiply takes of one row's 4 bytes of A (ua, or its SDOT form), once per
        row for all the tile's vectors (the vpmaddwd kinds read A widened: `widen_rows`)."""
        b, kind, w = self.k.b, self.isa.kind, self.w
        bytes_t = ir.VectorType(I8, 4 * w)
        if kind == "generic":  # int16 operands: smlal on AArch64
            return b.zext(b.bitcast(splat(b, a4, w), bytes_t), ir.VectorType(I16, 4 * w))
        return b.bitcast(splat(b, a4, w), bytes_t)

    def multiply(self, acc: ir.Value, a_op: ir.Value | tuple[ir.Value, ir.Value],
                 b_op: ir.Value | tuple[ir.Value, ir.Value]) -> None:
        """acc += ua . sb of this group of k for the W columns of `b_op` (4W bytes)."""
        b, kind, w = self.k.b, self.isa.kind, self.w
        if kind in _MADD:
            assert isinstance(a_op, tuple) and isinstance(b_op, tuple)
            wide = ir.VectorType(I16, 2 * w)
            name = {"madd512": "llvm.x86.avx512.pmaddw.d.512", "madd256": "llvm.x86.avx2.pmadd.wd",
                    "madd128": "llvm.x86.sse2.pmadd.wd"}[kind]
            fn = declare_function(self.module, name, self.vi32, [wide, wide])
            even, odd = (b.call(fn, [b_op[h], a_op[h]]) for h in range(2))
            b.store(b.add(b.load(acc), b.add(even, odd)), acc)
            return
        assert not isinstance(a_op, tuple) and not isinstance(b_op, tuple)
        if kind == "generic":  # 4W products, each into its own lane
            lanes = ir.VectorType(I32, 4 * w)
            prod = b.mul(b.sext(b.sext(b_op, a_op.type), lanes), b.sext(a_op, lanes))
            b.store(b.add(b.load(acc), prod), acc)
            return
        bytes_t = ir.VectorType(I8, 4 * w)
        name = {"vnni512": "llvm.x86.avx512.vpdpbusd.512",
                "avxvnni": "llvm.x86.avx512.vpdpbusd.256",
                "sdot": f"llvm.aarch64.neon.sdot.v{w}i32.v{4 * w}i8",
                "udot": f"llvm.aarch64.neon.udot.v{w}i32.v{4 * w}i8"}[kind]
        fn = declare_function(self.module, name, self.vi32, [self.vi32, bytes_t, bytes_t])
        b.store(b.call(fn, [b.load(acc), a_op, b_op]), acc)

    def reduce(self, acc: ir.Value) -> ir.Value:
        """The W column sums of one vector's accumulator (the generic kind's holds each
        column's 4 products apart)."""
        b, w = self.k.b, self.w
        x = b.load(acc)
        if self.isa.kind != "generic":
            return x
        total = None
        for j in range(GROUP):
            idx = ir.Constant(ir.VectorType(I32, w), [GROUP * c + j for c in range(w)])
            part = b.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), idx)
            total = part if total is None else b.add(total, part)
        assert total is not None
        return total

    def finish(self, row_vector: Callable[[int, int], ir.Value], i0: ir.Value, j0: ir.Value,
               rows: int, nv: int, left: ir.Value, sums: list[ir.Value] | None) -> None:
        """The zero-point corrections, then the epilogue, and the stores; row_vector(r, v):
        sum ua . sb (or its SDOT/UDOT/SMMLA form) of row r, columns v * W to v * W + W - 1."""
        k, w = self.k, self.w
        b = k.b
        ep = self.epilogue
        col_terms, betas, masks = [], [], []
        for v in range(nv):
            col = b.add(j0, k.i64(v * w))
            colsum = self.vload(b.gep(self.colsum, [col], source_etype=I32), self.vi32, None)
            beta = self.vload(b.gep(self.beta, [col], source_etype=I32), self.vi32, None)
            term = b.mul(splat(b, self.alpha, w), b.add(colsum, b.mul(beta, splat(b, self.k32, w))))
            if self.signed_a:  # sum ua.sb = sum (ua - 128).sb + 128 colsum
                term = b.add(term, b.shl(colsum, splat(b, self.i32(7), w)))
            col_terms.append(term)
            if self.isa.kind == "udot":  # sum ua.sb = sum ua.(sb + 128) - 128 rowsum(ua)
                beta = b.sub(beta, splat(b, self.i32(128), w))
            betas.append(beta)
            masks.append(self.lanes_below(b.sub(left, k.i64(v * w)), w))
        scales = biases = None
        if ep.output != "int32":
            a_scale = splat(b, self.a_scale, w)
            scales = [b.fmul(self.vload(b.gep(self.scale, [b.add(j0, k.i64(v * w))],
                                              source_etype=F32),
                                        ir.VectorType(F32, w), masks[v]), a_scale)
                      for v in range(nv)]
        if ep.bias != "none":
            bt = ir.VectorType(I32 if ep.bias == "int32" else F32, w)
            biases = [self.vload(b.gep(self.bias, [b.add(j0, k.i64(v * w))],
                                       source_etype=bt.element), bt, masks[v])
                      for v in range(nv)]
        posts: list[tuple[ir.Value, ir.Value]] = []
        if ep.post:
            vf = ir.VectorType(F32, w)

            def column(p: ir.Value, v: int) -> ir.Value:
                return self.vload(b.gep(p, [b.add(j0, k.i64(v * w))], source_etype=F32), vf,
                                  masks[v])

            posts = [(column(self.post_scale, v), column(self.post_shift, v)) for v in range(nv)]
        stores = []
        for r in range(rows):
            for v in range(nv):
                x = b.add(row_vector(r, v), col_terms[v])
                if sums is not None:
                    x = b.add(x, b.mul(betas[v], splat(b, sums[r], w)))
                out = self.convert(x, scales[v] if scales else None,
                                   biases[v] if biases else None, posts[v] if posts else None)
                row = b.add(i0, k.i64(r))
                ptr = b.gep(self.c, [b.add(b.mul(row, self.ldc), b.add(j0, k.i64(v * w)))],
                            source_etype=self.out_type)
                stores.append((out, ptr, masks[v]))
        # a whole tile stores whole vectors; the last of a block goes through a buffer on the
        # stack, from which each row's columns are copied (masked stores would be scalarized
        # into a branch per lane below AVX-512: code size, compile time)
        nr = nv * w
        with b.if_else(b.icmp_signed(">=", left, k.i64(nr))) as (whole, part):
            with whole:
                for out, ptr, _ in stores:
                    self.vstore(out, ptr, None)
            with part:
                buffer = self.tile_buffer(rows * nr)
                for index, (out, _, _) in enumerate(stores):
                    self.vstore(out, b.gep(buffer, [k.i64(index * w)],
                                           source_etype=self.out_type), None)
                size = self.out_type.width // 8 if self.out_type != F32 else 4
                for r in range(rows):
                    row = b.add(i0, k.i64(r))
                    k.memcpy(b.gep(self.c, [b.add(b.mul(row, self.ldc), j0)],
                                   source_etype=self.out_type),
                             b.gep(buffer, [k.i64(r * nr)], source_etype=self.out_type),
                             b.mul(left, k.i64(size)))

    def convert(self, x: ir.Value, scale: ir.Value | None, bias: ir.Value | None,
                post: tuple[ir.Value, ir.Value] | None = None) -> ir.Value:
        b, ep, w = self.k.b, self.epilogue, self.w
        if ep.output == "int32":
            return x
        vf = ir.VectorType(F32, w)
        if ep.bias == "int32":
            assert bias is not None
            x = b.add(x, bias)
        y = b.fmul(b.sitofp(x, vf), scale)
        if ep.output == "float32":
            y = b.fadd(y, bias) if ep.bias == "float32" else y
            return apply_activation(b, ep.activation, ep.params, y) if ep.activation else y
        lo, hi = (0, 255) if ep.output == "uint8" else (-128, 127)
        zero = b.sitofp(self.c_zero, F32)
        vf = ir.VectorType(F32, w)
        roundeven = declare_function(self.module, f"llvm.roundeven.{vector_suffix(vf)}", vf, [vf])
        y = b.call(roundeven, [y])
        # y - c_zero >= lo - c_zero, and >= 0 with a fused Relu (c_zero >= lo)
        low = splat(b, ir.Constant(F32, 0.0) if ep.relu
                    else b.fsub(ir.Constant(F32, float(lo)), zero), w)
        high = splat(b, b.fsub(ir.Constant(F32, float(hi)), zero), w)
        y = b.select(b.fcmp_ordered("<", y, low), low, y)
        y = b.select(b.fcmp_ordered(">", y, high), high, y)
        if post is not None:  # y is q - c_zero: requantized again, its zero point in the shift
            y = b.fadd(b.fmul(y, post[0]), post[1])
            y = b.call(roundeven, [y])
            low, high = (splat(b, ir.Constant(F32, float(v)), w) for v in (lo, hi))
            y = b.select(b.fcmp_ordered("<", y, low), low, y)
            y = b.select(b.fcmp_ordered(">", y, high), high, y)
            return b.trunc(b.fptosi(y, self.vi32), ir.VectorType(I8, w))
        q = b.add(b.fptosi(y, self.vi32), splat(b, self.c_zero, w))
        return b.trunc(q, ir.VectorType(I8, w))


# ------------------------------------------------------------------------------ emitting


def _b_parts(k: Emitter, b_packed: ir.Value, n: ir.Value, kk: ir.Value
             ) -> tuple[ir.Value, ir.Value]:
    """Where colsum and beta start in a packed B blob of K x N."""
    b = k.b
    kp = b.and_(b.add(kk, k.i64(GROUP - 1)), k.i64(-GROUP))
    np_ = b.and_(b.add(n, k.i64(PACK_COLS - 1)), k.i64(-PACK_COLS))
    colsum = b.gep(b_packed, [b.mul(kp, np_)], source_etype=I8)
    return colsum, b.gep(colsum, [np_], source_etype=I32)


def emit_int8_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,
                   lda: ir.Value, a_zero: ir.Value, b_packed: ir.Value, c: ir.Value,
                   ldc: ir.Value, *, a_signed: bool, row_sums: bool,
                   out: QOperands = QOperands()) -> None:
    """C = the product of A and a packed B (`pack_b_int8` of the K x N matrix; `row_sums` is
    its PackedB.row_sums), on the calling thread, finished as `out` says. a_zero: an i32."""
    colsum, beta = _b_parts(k, b_packed, n, kk)
    _call(k, m, n, kk, a, lda, a_zero, b_packed, colsum, beta, c, ldc, a_signed, row_sums, out)


def _call(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value, lda: ir.Value,
          a_zero: ir.Value, panels: ir.Value, colsum: ir.Value, beta: ir.Value, c: ir.Value,
          ldc: ir.Value, a_signed: bool, row_sums: bool, out: QOperands) -> None:
    null = ir.Constant(PTR, None)
    fn = int8_gemm_function(k.module, k.target, a_signed, row_sums, out.epilogue)
    k.b.call(fn, [m, n, kk, a, lda, a_zero, panels, colsum, beta, c, ldc,
                  out.scale if out.scale is not None else null,
                  out.a_scale if out.a_scale is not None else ir.Constant(F32, 1.0),
                  out.bias if out.bias is not None else null,
                  out.c_zero if out.c_zero is not None else ir.Constant(I32, 0),
                  out.post_scale if out.post_scale is not None else null,
                  out.post_shift if out.post_shift is not None else null])


def _out_type(epilogue: QEpilogue) -> ir.Type:
    return {"int32": I32, "float32": F32, "uint8": I8, "int8": I8}[epilogue.output]


def emit_parallel_int8_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,
                            lda: ir.Value, a_zero: ir.Value, b_packed: ir.Value, c: ir.Value,
                            ldc: ir.Value, *, a_signed: bool, row_sums: bool,
                            out: QOperands = QOperands()) -> None:
    """`emit_int8_gemm` split over the threads into blocks of rows (or of whole panels of
    columns when M is the smaller side), as the float kernel's emit_parallel_gemm."""
    colsum, beta = _b_parts(k, b_packed, n, kk)
    _parallel(k, m, n, kk, a, lda, a_zero, b_packed, colsum, beta, c, ldc, a_signed, row_sums,
              out)


def _parallel(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value, lda: ir.Value,
              a_zero: ir.Value, panels: ir.Value, colsum: ir.Value, beta: ir.Value,
              c: ir.Value, ldc: ir.Value, a_signed: bool, row_sums: bool,
              out: QOperands) -> None:
    isa = int8_isa(k.target, a_signed)
    b = k.b
    null = ir.Constant(PTR, None)
    by_rows, block, count, other, tile = split_blocks(k, m, n, isa.mr, PACK_COLS)
    a_scale = out.a_scale if out.a_scale is not None else ir.Constant(F32, 1.0)
    a_scale_bits = b.zext(b.bitcast(a_scale, I32), I64)
    c_zero = out.c_zero if out.c_zero is not None else ir.Constant(I32, 0)
    carry = [m, n, kk, a, lda, b.sext(a_zero, I64), panels, colsum, beta, c, ldc,
             out.scale if out.scale is not None else null, a_scale_bits,
             out.bias if out.bias is not None else null, b.sext(c_zero, I64), count, tile,
             b.zext(by_rows, I64), out.post_scale if out.post_scale is not None else null,
             out.post_shift if out.post_shift is not None else null]
    epilogue = out.epilogue
    out_t = _out_type(epilogue)
    bias_t = F32 if epilogue.bias == "float32" else I32
    with k.parallel_loop(count, cost=b.mul(b.mul(block, other), kk), name="qgemm",
                         carry=carry) as t:
        (m_, n_, kk_, a_, lda_, az_, panels_, colsum_, beta_, c_, ldc_, scale_, as_, bias_,
         cz_, count_, tile_, rows_flag, post_scale_, post_shift_) = k.carried
        bb = k.b
        rows = bb.icmp_signed("!=", rows_flag, k.i64(0))
        start, size = block_span(k, t, count_, bb.select(rows, m_, n_), tile_)
        col0 = bb.select(rows, k.i64(0), start)
        kp = bb.and_(bb.add(kk_, k.i64(GROUP - 1)), k.i64(-GROUP))
        _call(k, bb.select(rows, size, m_), bb.select(rows, n_, size), kk_,
              bb.gep(a_, [bb.select(rows, bb.mul(start, lda_), k.i64(0))], source_etype=I8),
              lda_, bb.trunc(az_, I32),
              bb.gep(panels_, [bb.mul(col0, kp)], source_etype=I8),
              bb.gep(colsum_, [col0], source_etype=I32), bb.gep(beta_, [col0], source_etype=I32),
              bb.gep(c_, [bb.select(rows, bb.mul(start, ldc_), col0)], source_etype=out_t),
              ldc_, a_signed, row_sums,
              QOperands(epilogue, bb.gep(scale_, [col0], source_etype=F32),
                        bb.bitcast(bb.trunc(as_, I32), F32),
                        bb.gep(bias_, [col0], source_etype=bias_t), bb.trunc(cz_, I32),
                        bb.gep(post_scale_, [col0], source_etype=F32),
                        bb.gep(post_shift_, [col0], source_etype=F32)))


def emit_parallel_int8_gemm_runtime_b(  # noqa: PLR0913  (the kernel's C arguments, passed through)
        k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value, lda: ir.Value,
        a_zero: ir.Value, b_ptr: ir.Value, ldb: ir.Value, b_zero: ir.Value, scratch: ir.Value,
        c: ir.Value, ldc: ir.Value, *, a_signed: bool, b_signed: bool,
        b_zero_per_column: bool, out: QOperands = QOperands()) -> None:
    """The product with a B[K, N] computed at run time (row-major, row stride ldb, uint8 or
    int8 by `b_signed`), its zero point read from `b_zero` (one value of B's type, or N of them
    with `b_zero_per_column`): B is packed (one thread per panel) into `scratch`
    (packed_b_size(K, N) bytes), then multiplied as a constant one would be."""
    b = k.b
    colsum, beta = _b_parts(k, scratch, n, kk)
    panels = b.udiv(b.add(n, k.i64(PACK_COLS - 1)), k.i64(PACK_COLS))
    with k.parallel_loop(panels, cost=b.mul(kk, k.i64(PACK_COLS)), name="qpack",
                         carry=[n, kk, b_ptr, ldb, b_zero, scratch, colsum, beta]) as p:
        _pack_panel(k, p, *k.carried, b_signed=b_signed, per_column=b_zero_per_column)
    _parallel(k, m, n, kk, a, lda, a_zero, scratch, colsum, beta, c, ldc, a_signed, True, out)


def _pack_panel(k: Emitter, p: ir.Value, n: ir.Value, kk: ir.Value, src: ir.Value,
                ldb: ir.Value, b_zero: ir.Value, out: ir.Value, colsum: ir.Value,
                beta: ir.Value, *, b_signed: bool, per_column: bool) -> None:
    """Panel p of B as pack_b_int8 lays it out, with its columns' colsum and beta: a group
    of GROUP rows at a time, each of its rows read along the panel's columns (contiguous
    loads, where a walk down each column read one byte per row of B)."""
    b = k.b
    kp = b.and_(b.add(kk, k.i64(GROUP - 1)), k.i64(-GROUP))
    base = b.gep(out, [b.mul(p, b.mul(kp, k.i64(PACK_COLS)))], source_etype=I8)
    flip = ir.Constant(I8, 0 if b_signed else 0x80)
    ext = b.sext if b_signed else b.zext
    last_k = b.sub(kk, k.i64(1))
    first = b.mul(p, k.i64(PACK_COLS))
    sums = b.gep(colsum, [first], source_etype=I32)
    with k.loop(k.i64(PACK_COLS), name="pz") as col:
        b.store(ir.Constant(I32, 0), b.gep(sums, [col], source_etype=I32))
    with k.loop(b.udiv(kp, k.i64(GROUP)), name="pg") as group:
        rows = []
        for r in range(GROUP):
            kr = b.add(b.mul(group, k.i64(GROUP)), k.i64(r))
            rows.append((b.icmp_signed("<", kr, kk),
                         b.gep(src, [b.mul(k.minimum("int64", kr, last_k), ldb)],
                               source_etype=I8)))
        dst = b.gep(base, [b.mul(group, k.i64(PACK_COLS * GROUP))], source_etype=I8)
        with k.loop(k.i64(PACK_COLS), name="pc") as col:
            j = b.add(first, col)
            inside = b.icmp_signed("<", j, n)
            j_safe = b.select(inside, j, k.i64(0))
            total: ir.Value = ir.Constant(I32, 0)
            for r, (real_k, row) in enumerate(rows):
                raw = b.load(b.gep(row, [j_safe], source_etype=I8), typ=I8)
                sb = b.select(b.and_(inside, real_k), b.xor(raw, flip), ir.Constant(I8, 0))
                b.store(sb, b.gep(dst, [b.add(b.mul(col, k.i64(GROUP)), k.i64(r))],
                                  source_etype=I8))
                total = b.add(total, b.sext(sb, I32))
            at = b.gep(sums, [col], source_etype=I32)
            b.store(b.add(b.load(at, typ=I32), total), at)
    with k.loop(k.i64(PACK_COLS), name="pb") as col:
        j = b.add(first, col)
        inside = b.icmp_signed("<", j, n)
        j_safe = b.select(inside, j, k.i64(0))
        zero = ext(b.load(b.gep(b_zero, [j_safe if per_column else k.i64(0)], source_etype=I8),
                          typ=I8), I32)
        b.store(b.select(inside, b.sub(ir.Constant(I32, 0 if b_signed else 128), zero),
                         ir.Constant(I32, 0)), b.gep(beta, [j], source_etype=I32))


def _slot(k: Emitter, ty: ir.Type) -> ir.Value:
    """A zeroed stack slot made in the entry block (a register after mem2reg)."""
    b = k.b
    with b.goto_entry_block():
        slot = b.alloca(ty)
    b.store(ir.Constant(ty, None), slot)
    return slot
