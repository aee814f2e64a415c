"""A matrix product in bfloat16 with float32 sums, C = act(L @ R + bias + residual), for models
compiled with precision = "bf16" (passes/bf16_weights.py).

bf16 is float32 with the low 16 bits of the mantissa dropped (8 significant bits): each
product of two rounded operands is within about 2^-8 of the float32 one, and the sums are
float32, so the error of an output is that of a dot product of operands each off by at most
2^-9 relative (docs/precision.md has the measured figures).

One operand is a constant packed at compile time, the other float32 read at run time and
rounded to bf16 (to nearest, ties to even) as the kernel packs it, block by block of K, into
a buffer on the stack:

- side "b" (Gemm, MatMul: weights on the right): L is the float32 activation [M, K] (row
  stride ldl), R the constant `pack_r` of B [K, N];
- side "bt" (the transposed products of convolutions over small maps: Y^T[P, M] =
  X'^T[P, K] @ W^T[K, M], ops/_conv_gemm.py): as "b", but L is stored by columns, L[i, k] at
  l[k * ldl + i] (X' read in place); a row tile's block of it is packed with its rows side by
  side (`pack_l_columns`);
- side "a" (convolutions: Y[M, P] = W[M, K] @ X'[K, P]): L is the constant `pack_l` of W,
  R the float32 X' [K, N] (row stride ldr).

Both packed forms are shared by every instruction set below (one weights blob serves the CPU
variants of a library), K padded with zeros to a multiple of K_ALIGN:

- L: row-major bf16 [Mp, Kl], M padded to a multiple of ROW_ALIGN rows, rows of Kl =
  `l_columns(K)` values: Kp, one cache line more where Kp's rows would be a multiple of
  1 KiB apart (a register tile's 12 rows then fell into the same few sets of L1, ResNet-50's
  K = 2048 convs ran at 95 GFLOP/s);
- R: panels of PACK_COLS columns (N padded with zero columns), each Kp/2 "pair rows" of
  PACK_COLS x 2 bf16: column c's B[2g, c], B[2g+1, c] side by side, what a 2-way bf16 dot
  product reads (vdpbf16ps, AMX's B tile).

Instruction sets (`bf16_isa`):

- "amx": AMX-BF16 tiles (Sapphire Rapids and later): C in blocks of 32 x 32 (four 16 x 16
  float32 tiles, two tiles of L, two of R per 32 values of K); the tile configuration comes
  from LLVM (the `.internal` intrinsics carry the shapes). Linux hands a process the tile
  state only when asked (arch_prctl): the runtime's `cuvil_amx_ready` asks and tells.
- "dpbf16": AVX-512 BF16 vdpbf16ps, a 12 x 32 register tile (as the float kernel's).

AVX512-BF16 and AMX are not part of x86-64-v4, so, as the int8 kernel does for VNNI, the v4
copy holds both kernels and picks one at its first call (a CPUID bit, and for AMX the OS's
permission, each read once and kept in an internal global); each kernel is compiled with its
extra features as a function attribute.

Every other CPU runs float32 code (`bf16_hardware` says which path a call takes): bf16 widened
to float32 on the fly ran at half the float32 kernel's speed, so there the products run on
the float32 kernel (kernels/gemm.py), over float32 panels in its packed layouts that
the first run derives from the bf16 weights (`emit_float32_panels`; exact: a shift) into the
derived-weights buffer, only on those CPUs (`Op.derived_on_demand`). The library keeps the
bf16 weights; the activations are then not rounded, so the results differ by CPU within the
same bound (docs/precision.md). The v3 and baseline copies and AArch64 hold no bf16 kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from cuvil.compiler.kernels import gemm
from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import (
    I1,
    I8,
    I32,
    I64,
    POPULATE,
    PTR,
    RELEASE,
    Emitter,
    add_target_features,
    asked_once,
    cpuid_gate,
    declare_function,
    masked_intrinsic,
    prefetch,
    splat,
)
from cuvil.compiler.kernels.gemm import PLAIN, Epilogue, block_span, split_blocks
from cuvil.compiler.kernels.objects import kernel_function
from cuvil.compiler.kernels.target import KernelTarget

F32 = ir.FloatType()
I16 = ir.IntType(16)
#: columns per panel of a packed R; K is padded to K_ALIGN (one AMX tile: 32 bf16 = 64 bytes),
#: the rows of a packed L to ROW_ALIGN (one AMX tile's 16 rows)
PACK_COLS = 32
K_ALIGN = 32
ROW_ALIGN = 16
#: rows of a packed L whose Kp is a multiple of this many values get K_ALIGN more (`l_columns`)
L_SPREAD = 512
#: bytes of one pair row of a panel (PACK_COLS columns x 2 bf16)
PAIR_ROW = PACK_COLS * 4
#: K is walked in blocks of KC values: the run-time operand's block is packed into a stack
#: buffer (32 rows x KC bf16, or PANELS panels of KC / 2 pair rows: 64 KiB), one panel of
#: which (16 KiB) and a row tile of L (6 KiB) then share L1 (32 KiB on Zen 4) for every row
#: tile; KC = 512 kept neither in it
KC = 256
#: side "a" packs this many panels of R at a time, reading PANELS x 32 consecutive floats of
#: each row of X' (512 bytes, which the hardware prefetcher follows) instead of 128: ResNet-50's
#: 1x1 convs on 56x56 maps, whose rows are 12 KiB apart, ran at 130 GFLOP/s
PANELS = 4
#: parallel split (gemm.split_blocks): fewest tiles per block; rows are split in
#: multiples of ROW_SPLIT (whole tiles of every kind: 12-row register tiles, 16- and 32-row
#: AMX blocks)
MIN_ROW_TILES = 2
MIN_COLUMN_TILES = 2
ROW_SPLIT = 48
#: side "a": how far ahead in its rows the tile asks for the weights' lines (a probe of
#: ResNet-50's shapes on a Zen 4: 2-4% faster with 256 or 512 bytes)
L_PREFETCH = 512
#: side "bt": rows of L packed side by side at a time (one vector of float32 lanes)
COLUMN_TILE = 16
#: AMX: rows and columns of a block of C (2 x 2 tiles of 16 x 16)
AMX_ROWS = 32
#: the kernel's forms (`bf16_gemm_function`): which operand is the packed constant, and how
#: the other is stored
SIDES = ("a", "b", "bt")


# ------------------------------------------------------------------------------ packing


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest, ties to even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    """bf16 bits -> float32 (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def l_columns(kk: int) -> int:
    """bf16 values per row of a packed L of K = kk (module docstring)."""
    kp = round_up(max(kk, 1), K_ALIGN)
    return kp + K_ALIGN if kp % L_SPREAD == 0 else kp


def emit_l_row_bytes(k: Emitter, kk: ir.Value) -> ir.Value:
    """`l_columns(kk)` * 2 at run time."""
    b = k.b
    kp = b.and_(b.add(k.maximum("int64", kk, k.i64(1)), k.i64(K_ALIGN - 1)), k.i64(-K_ALIGN))
    spread = b.icmp_signed("==", b.and_(kp, k.i64(L_SPREAD - 1)), k.i64(0))
    return b.mul(b.add(kp, b.select(spread, k.i64(K_ALIGN), k.i64(0))), k.i64(2))


def pack_l(w: np.ndarray) -> np.ndarray:
    """A constant left operand [M, K] as bf16 [Mp, Kl] (module docstring), zeros padding."""
    m, k = w.shape
    out = np.zeros((round_up(max(m, 1), ROW_ALIGN), l_columns(k)), np.uint16)
    out[:m, :k] = to_bf16(w)
    return out


def pack_r(b: np.ndarray) -> np.ndarray:
    """A constant right operand [K, N] as bf16 panels [Np / 32, Kp / 2, 32, 2]."""
    k, n = b.shape
    full = np.zeros((round_up(max(k, 1), K_ALIGN), round_up(max(n, 1), PACK_COLS)), np.uint16)
    full[:k, :n] = to_bf16(b)
    kp, np_ = full.shape
    # [pair, j, panel, column] -> [panel, pair, column, j]
    return np.ascontiguousarray(
        full.reshape(kp // 2, 2, np_ // PACK_COLS, PACK_COLS).transpose(2, 0, 3, 1))


# ------------------------------------------------------------------------------ instruction sets


@dataclass(frozen=True)
class Bf16Isa:
    kind: str  # "amx" or "dpbf16" (module docstring)
    vector: int  # float32 lanes per vector
    mr: int  # rows per register tile (AMX: per block)
    nv: int  # vectors per tile row (NR = vector * nv divides PACK_COLS)
    #: what the kernel's function needs beyond the module's features
    features: str = ""

    @property
    def nr(self) -> int:
        return self.vector * self.nv


AMX = Bf16Isa("amx", 16, AMX_ROWS, 2, "+amx-tile,+amx-bf16,+avx512bf16")
DPBF16 = Bf16Isa("dpbf16", 16, 12, 2, "+avx512bf16")
#: CPUID leaf 7 subleaf 1, EAX bit 5: AVX512_BF16 (its register state is AVX-512's)
AVX512BF16_BIT = (7, 1, 0, 5)
#: the runtime's checks (cuvil/runtime/threadpool.c): AMX's, and CUVIL_BF16=0's
AMX_READY = "cuvil_amx_ready"
BF16_ALLOWED = "cuvil_bf16_allowed"


def bf16_isas(target: KernelTarget) -> list[Bf16Isa]:
    """The kernels the target's copy holds, best first: none outside x86's AVX-512 copies."""
    return _chain(target)[0]


def _chain(target: KernelTarget) -> tuple[list[Bf16Isa], bool]:
    """`bf16_isas`, and whether the CPU must be asked about the last one (the others:
    always)."""
    if not target.is_x86 or not target.has("avx512f"):
        return [], False
    chain = []
    if not target.excludes("amx-bf16") and not target.excludes("amx-tile"):
        chain.append(AMX)
    if not target.excludes("avx512bf16"):
        chain.append(DPBF16)
    return chain, not target.has("avx512bf16")


def bf16_isa(target: KernelTarget) -> Bf16Isa:
    """The kernel the target's copy runs when every run-time test passes."""
    return bf16_isas(target)[0]


# ------------------------------------------------------------------------------ the function

_TYPE = ir.FunctionType(ir.VoidType(), [I64, I64, I64, PTR, I64, PTR, I64, PTR, I64, I1, PTR,
                                        PTR])


def bf16_gemm_function(module: ir.Module, target: KernelTarget, side: str,
                       epilogue: Epilogue = PLAIN) -> ir.Function:
    """`void bf16gemm(M, N, K, L, ldl, R, ldr, C, ldc, accumulate, bias, residual)`:
    C[i, j] = act((accumulate ? C[i, j] : 0) + sum_k L[i, k] R[k, j] (+ bias) (+ residual)),
    to call only where `bf16_hardware` says yes.
    `side` names the packed operand: "b" (R is `pack_r`; L float32, row stride ldl; ldr not
    read), "bt" (the same with L by columns, column stride ldl) or "a" (L is `pack_l`; R
    float32, row stride ldr; ldl not read). Strides are in elements; C's and the residual's
    rows are ldc apart."""
    assert side in SIDES, side
    name = f"cuvil.bf16gemm.{side}.{epilogue.suffix}"

    def define_isa(module: ir.Module, fn: ir.Function, target: KernelTarget,
                   isa: Bf16Isa) -> None:
        fn.attributes.add("noinline")
        for i in (3, 5, 7, 10, 11):
            fn.args[i].add_attribute("noalias")
        if isa.features:
            add_target_features(target, fn, isa.features)
        _Writer(module, fn, target, isa, side, epilogue).write()

    def define(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        chain = bf16_isas(target)
        assert chain, "no bf16 kernel in this copy: its products run float32 (bf16_hardware)"
        if len(chain) == 1:
            define_isa(module, fn, target, chain[0])
            return
        kernels = [ir.Function(module, _TYPE, f"{name}.{isa.kind}") for isa in chain]
        for kernel, isa in zip(kernels, chain):
            kernel.linkage = "internal"
            define_isa(module, kernel, target, isa)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        for isa, kernel in zip(chain[:-1], kernels[:-1]):
            with b.if_then(_gate(module, b, isa)):
                b.call(kernel, fn.args)
                b.ret_void()
        # (`bf16_hardware` has said yes: if not to the others, then to this one)
        b.call(kernels[-1], fn.args)
        b.ret_void()

    return kernel_function(module, target, name, _TYPE, define)


def _gate(module: ir.Module, b: ir.IRBuilder, isa: Bf16Isa) -> ir.Value:
    """Whether the CPU (and OS) run `isa` (`asked_once`)."""
    if isa.kind == "amx":
        return asked_once(module, b, "cuvil.amx_ready", AMX_READY, [])
    return cpuid_gate(module, b, AVX512BF16_BIT)


_HARDWARE_TYPE = ir.FunctionType(I32, [])


def bf16_hardware(k: Emitter) -> ir.Value | None:
    """Whether a bf16 product runs on the bf16 kernel here (an i1), or None where the module's
    copy holds none (the float32 path, always): the CPU and OS run one of the copy's bf16
    kernels, and CUVIL_BF16 is not 0 (the runtime's `cuvil_bf16_allowed`)."""
    if not bf16_isas(k.target):
        return None
    fn = kernel_function(k.module, k.target, "cuvil.bf16.hardware", _HARDWARE_TYPE,
                         _define_hardware)
    return k.b.icmp_signed("!=", k.b.call(fn, []), ir.Constant(I32, 0))


def _define_hardware(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
    chain, ask_last = _chain(target)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    with b.if_then(b.not_(asked_once(module, b, "cuvil.bf16_allowed", BF16_ALLOWED, []))):
        b.ret(ir.Constant(I32, 0))
    for isa in chain if ask_last else chain[:-1]:
        with b.if_then(_gate(module, b, isa)):
            b.ret(ir.Constant(I32, 1))
    b.ret(ir.Constant(I32, 0 if ask_last else 1))


def bf16_or_float32(k: Emitter, bf16: Callable[[], None], float32: Callable[[], None]) -> None:
    """bf16(): a product on the bf16 kernel, where `bf16_hardware` says so; else float32(): the
    same on the float32 kernel, over the panels `emit_float32_panels` derived."""
    gate = bf16_hardware(k)
    if gate is None:
        float32()
        return
    with k.b.if_else(gate) as (fast, other):
        with fast:
            bf16()
        with other:
            float32()


def emit_float32_panels(k: Emitter, side: str, src: ir.Value, dst: ir.Value, rows: int,
                        cols: int, groups: int = 1) -> None:
    """Where this CPU takes the float32 path (`bf16_hardware`): dst = the float32 kernel's
    packed weights of the bf16 ones in src, `groups` [rows, cols] matrices one after the
    other: side "a" (convolutions) `pack_l` -> `gemm.pack_a`, side "b" `pack_r` ->
    `pack_b` (Winograd's transformed weights: a matrix per point). Then
    src's pages leave the resident memory: nothing reads them on this CPU. For the first run
    (`Op.lower_derived`): dst gets its pages first, as the derived buffer's others do."""
    gate = bf16_hardware(k)
    if gate is None:
        _float32_panels(k, side, src, dst, rows, cols, groups)
        return
    with k.b.if_then(k.b.not_(gate)):
        _float32_panels(k, side, src, dst, rows, cols, groups)


def _float32_panels(k: Emitter, side: str, src: ir.Value, dst: ir.Value, rows: int, cols: int,
                    groups: int) -> None:
    b = k.b
    m = k.module
    kp = l_columns(cols) if side == "a" else round_up(max(rows, 1), K_ALIGN)
    if side == "a":  # pack_l rows of Kl bf16 -> panels of PACK_ROWS rows, k-major
        step, units = gemm.PACK_ROWS, -(-rows // gemm.PACK_ROWS)
        src_group = round_up(max(rows, 1), ROW_ALIGN) * kp
    else:  # pack_r panels of pair rows -> panels of PACK_COLS columns, k-major
        step, units = gemm.PACK_COLS, -(-cols // gemm.PACK_COLS)
        src_group = round_up(max(cols, 1), PACK_COLS) * kp
    declare_function(m, POPULATE, ir.VoidType(), [PTR, I64])
    b.call(m.get_global(POPULATE), [dst, k.i64(groups * rows * cols * 4)])
    with k.parallel_loop(groups * units, cost=step * (cols if side == "a" else rows),
                         name="panels", carry=[src, dst]) as t:
        bf, f32 = k.carried
        bb = k.b
        g, unit = bb.udiv(t, k.i64(units)), bb.urem(t, k.i64(units))
        first = bb.mul(unit, k.i64(step))
        width = k.minimum("int64", bb.sub(k.i64(rows if side == "a" else cols), first),
                          k.i64(step))
        out = bb.gep(f32, [bb.add(bb.mul(g, k.i64(rows * cols)),
                                  bb.mul(first, k.i64(cols if side == "a" else rows)))],
                     source_etype=F32)
        if side == "a":
            rows_in = bb.gep(bf, [bb.add(bb.mul(g, k.i64(src_group)), bb.mul(first, k.i64(kp)))],
                             source_etype=I16)
            with k.loop(width, name="r") as r, k.loop(cols, name="c") as c:
                x = bb.load(bb.gep(rows_in, [bb.add(bb.mul(r, k.i64(kp)), c)],
                                   source_etype=I16), typ=I16)
                bb.store(_widened(bb, x), bb.gep(out, [bb.add(bb.mul(c, width), r)],
                                                 source_etype=F32))
        else:  # (step == PACK_COLS: a float32 panel is a bf16 one)
            panel = bb.gep(bf, [bb.add(bb.mul(g, k.i64(src_group)),
                                       bb.mul(unit, k.i64(kp * PACK_COLS)))], source_etype=I16)
            with k.loop(rows, name="r") as r, k.loop(width, name="c") as c:
                pair = bb.mul(bb.lshr(r, k.i64(1)), k.i64(PACK_COLS * 2))
                at = bb.add(pair, bb.add(bb.mul(c, k.i64(2)), bb.and_(r, k.i64(1))))
                x = bb.load(bb.gep(panel, [at], source_etype=I16), typ=I16)
                bb.store(_widened(bb, x), bb.gep(out, [bb.add(bb.mul(r, width), c)],
                                                 source_etype=F32))
    declare_function(m, RELEASE, ir.VoidType(), [PTR, I64])
    b.call(m.get_global(RELEASE), [src, k.i64(groups * src_group * 2)])


def _widened(b: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """bf16 bits (i16) -> the float32 of the same value (exact)."""
    return b.bitcast(b.shl(b.zext(bits, I32), ir.Constant(I32, 16)), F32)


class _NamedType(ir.Type):  # type: ignore[misc]  # llvmlite is untyped
    """An LLVM type that llvmlite has no class for, written by its name."""

    def __init__(self, llvm_name: str) -> None:
        self.llvm_name = llvm_name

    def _to_string(self) -> str:
        return self.llvm_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NamedType) and other.llvm_name == self.llvm_name

    def __hash__(self) -> int:
        return hash(self.llvm_name)


#: the type of an AMX tile
TILE = _NamedType("x86_amx")
#: a float32 `fptrunc` to bfloat rounds to nearest, ties to even, which the bf16 kernels'
#: targets compile to vcvtneps2bf16 (inputs below float32's normal range count as zero there:
#: off by less than 2^-126)
BFLOAT = _NamedType("bfloat")


def to_bf16_bits(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """A vector of n float32 -> n i16 holding their bf16 bits (as `to_bf16`)."""
    n = x.type.count
    return b.bitcast(b.fptrunc(x, ir.VectorType(BFLOAT, n)), ir.VectorType(I16, n))


class _AmxTiles:
    """The AMX operations of a kernel on 16 x 64-byte tiles: LLVM's intrinsics (a tile is an
    x86_amx value; LLVM writes the tile configuration from the shapes they carry), or, for a
    target with `emulate_amx` (tests/kernels, on CPUs without AMX), calls of
    functions with the same meaning on 1 KiB buffers in the kernel's frame
    (tests/harness/amx_emulation.c: dot updates its accumulator in place and returns it)."""

    def __init__(self, writer: _Writer) -> None:
        self.writer, self.b, self.module = writer, writer.k.b, writer.module
        self.emulated = writer.k.target.emulate_amx
        self.type = PTR if self.emulated else TILE
        self.c16, self.c64 = ir.Constant(I16, 16), ir.Constant(I16, 64)

    def _call(self, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
        """The intrinsic llvm.x86.`name`, or the emulation's cuvil_emulated_<name up to a dot>."""
        name = "cuvil_emulated_" + name.split(".")[0] if self.emulated else "llvm.x86." + name
        fn = declare_function(self.module, name, ret, [a.type for a in args])
        return self.b.call(fn, args)

    def _fresh(self) -> list[ir.Value]:
        return [self.writer.buffer(1024)] if self.emulated else []

    def zero(self) -> ir.Value:
        return self._call("tilezero.internal", self.type, [self.c16, self.c64, *self._fresh()])

    def load(self, base: ir.Value, stride: ir.Value) -> ir.Value:
        return self._call("tileloadd64.internal", self.type,
                          [self.c16, self.c64, base, stride, *self._fresh()])

    def dot(self, acc: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self._call("tdpbf16ps.internal", self.type, [self.c16, self.c64, self.c64, acc, a, b])

    def store(self, base: ir.Value, stride: ir.Value, tile: ir.Value) -> None:
        self._call("tilestored64.internal", ir.VoidType(), [self.c16, self.c64, base, stride, tile])

    def release(self) -> None:
        if not self.emulated:
            self._call("tilerelease", ir.VoidType(), [])


class _Writer:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget, isa: Bf16Isa,
                 side: str, epilogue: Epilogue) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.module, self.isa, self.side, self.epilogue = module, isa, side, epilogue
        (self.m, self.n, self.kk, self.l, self.ldl, self.r, self.ldr, self.c, self.ldc,
         self.acc, self.bias, self.residual) = fn.args
        self.w = isa.vector
        self.vf = ir.VectorType(F32, self.w)

    # -- helpers -------------------------------------------------------------------------
    def buffer(self, size: int) -> ir.Value:
        b = self.k.b
        with b.goto_entry_block():
            buf = b.alloca(ir.ArrayType(I8, size))
        buf.align = 64
        buf.type = PTR  # an untyped pointer, like every other buffer here
        return buf

    def at(self, p: ir.Value, offset: ir.Value) -> ir.Value:
        return self.k.b.gep(p, [offset], source_etype=I8)

    def lanes_below(self, count: ir.Value, width: int) -> ir.Value:
        lanes = ir.Constant(ir.VectorType(I64, width), list(range(width)))
        return self.k.b.icmp_signed("<", lanes, splat(self.k.b, count, width))

    def masked_load(self, p: ir.Value, vt: ir.VectorType, mask: ir.Value) -> ir.Value:
        fn = masked_intrinsic(self.module, "load", vt)
        return self.k.b.call(fn, [p, ir.Constant(I32, 4), mask, ir.Constant(vt, None)])

    def masked_store(self, x: ir.Value, p: ir.Value, mask: ir.Value) -> None:
        fn = masked_intrinsic(self.module, "store", x.type)
        self.k.b.call(fn, [x, p, ir.Constant(I32, 4), mask])

    # -- structure -----------------------------------------------------------------------
    def write(self) -> None:
        """K in blocks of KC; in each, the run-time operand's block is packed (side "b": a row
        tile of L at a time, every column tile after it; side "a": PANELS panels of R at a
        time, then every row tile over each panel in turn)."""
        k = self.k
        b = k.b
        self.kp = b.and_(b.add(self.kk, k.i64(K_ALIGN - 1)), k.i64(-K_ALIGN))
        rows = max(self.isa.mr, AMX_ROWS if self.isa.kind == "amx" else 0)
        panel_bytes = KC // 2 * PAIR_ROW
        pack_buf = self.buffer(PANELS * panel_bytes if self.side == "a" else
                               max(rows * KC * 2, KC // 2 * COLUMN_TILE * 4))
        self.c_buf = self.buffer(AMX_ROWS * PACK_COLS * 4) if self.isa.kind == "amx" else None
        # K = 0 leaves C as the epilogue of nothing: one block of zeros
        blocks = k.maximum("int64", self.kk, k.i64(1))
        with k.loop(blocks, step=KC, name="k0") as k0:
            kc = k.minimum("int64", b.sub(self.kk, k0), k.i64(KC))
            self.pairs = b.udiv(b.add(kc, k.i64(K_ALIGN - 1)), k.i64(K_ALIGN))
            self.pairs = b.mul(self.pairs, k.i64(K_ALIGN // 2))
            self.load_c = b.or_(self.acc, b.icmp_signed(">", k0, k.i64(0)))
            self.last = b.icmp_signed(">=", b.add(k0, kc), self.kk)
            self.k0, self.kc = k0, kc
            if self.side != "a":
                # L's packed rows: KC values apart, or (side "bt" on AVX-512) side by side,
                # a pair of each row in turn
                side_by_side = self.side == "bt" and self.isa.kind != "amx"
                row_bytes, pair_bytes = (4, COLUMN_TILE * 4) if side_by_side else (KC * 2, 4)

                def row_tile(i0: ir.Value, height: int) -> None:
                    if self.side == "b":
                        self.pack_l_rows(pack_buf, i0, height)
                    else:
                        self.pack_l_columns(pack_buf, i0, height, side_by_side)
                    with k.loop(self.n, step=self.isa.nr, name="j") as j:
                        panel = b.udiv(j, k.i64(PACK_COLS))
                        within = b.sub(j, b.mul(panel, k.i64(PACK_COLS)))
                        off = b.add(b.mul(panel, b.mul(self.kp, k.i64(PAIR_ROW // 2))),
                                    b.add(b.mul(b.udiv(k0, k.i64(2)), k.i64(PAIR_ROW)),
                                          b.mul(within, k.i64(4))))
                        self.tile(pack_buf, k.i64(row_bytes), self.at(self.r, off),
                                  k.i64(0), i0, j, height, pair_bytes)
                self.row_tiles(row_tile)
            else:
                lld = emit_l_row_bytes(k, self.kk)
                with k.loop(self.n, step=PACK_COLS * PANELS, name="jb") as jb:
                    self.pack_r_panels(pack_buf, jb)
                    for q in range(PANELS):
                        jp = b.add(jb, k.i64(q * PACK_COLS))
                        panel = self.at(pack_buf, k.i64(q * panel_bytes))
                        with k.if_then(b.icmp_signed("<", jp, self.n)):
                            def tile(i0: ir.Value, height: int, jp: ir.Value = jp,
                                     panel: ir.Value = panel) -> None:
                                l_rows = self.at(self.l, b.mul(k0, k.i64(2)))
                                for sub in range(0, PACK_COLS, self.isa.nr):
                                    j = b.add(jp, k.i64(sub))
                                    with k.if_then(b.icmp_signed("<", j, self.n)):
                                        self.tile(l_rows, lld, self.at(panel, k.i64(sub * 4)),
                                                  i0, i0, j, height)
                            self.row_tiles(tile)
        if self.isa.kind == "amx":  # the tile state back to its initial, cheap to switch
            _AmxTiles(self).release()
        b.ret_void()

    def row_tiles(self, body: Callable[[ir.Value, int], None]) -> None:
        """body(i0, height): whole tiles of MR rows, then halving heights for the rest (AMX:
        blocks of 32 rows, then one of 16 for the up to 16 left)."""
        k, mr = self.k, self.isa.mr
        b = k.b
        m_full = b.mul(b.udiv(self.m, k.i64(mr)), k.i64(mr))
        with k.loop(m_full, step=mr, name="i") as i:
            body(i, mr)
        heights: list[int] = []
        h = 1
        while h < mr:
            heights.insert(0, h)
            h *= 2
        if self.isa.kind == "amx":  # rows past M in a block are computed, not stored
            with k.if_then(b.icmp_signed("<", m_full, self.m)):
                left = b.sub(self.m, m_full)
                with b.if_else(b.icmp_signed(">", left, k.i64(AMX_ROWS // 2))) as (two, one):
                    with two:
                        body(m_full, AMX_ROWS)
                    with one:
                        body(m_full, AMX_ROWS // 2)
            return
        start = m_full
        for h in heights:
            fits = b.icmp_signed(">=", b.sub(self.m, start), k.i64(h))
            with k.if_then(fits):
                body(start, h)
            start = b.add(start, b.select(fits, k.i64(h), k.i64(0)))

    # -- packing the run-time operand -----------------------------------------------------
    def pack_l_rows(self, buf: ir.Value, i0: ir.Value, height: int) -> None:
        """buf[r, 0:pairs*2] = bf16(L[i0 + r, k0:k0 + kc]) for the tile's rows (zeros past K;
        AMX: rows past M zero too), rows KC values apart."""
        k = self.k
        b = k.b
        width = 16
        valid = b.sub(self.m, i0)
        with k.loop(k.i64(height), name="pr") as r:
            inside = b.icmp_signed("<", r, valid)
            row_src = b.gep(self.l, [b.add(b.mul(b.add(i0, r), self.ldl), self.k0)],
                            source_etype=F32)
            row_dst = self.at(buf, b.mul(r, k.i64(KC * 2)))
            with k.loop(b.mul(self.pairs, k.i64(2)), step=width, name="pk") as p:
                count = b.select(inside, b.sub(self.kc, p), k.i64(0))
                x = self.masked_load(b.gep(row_src, [p], source_etype=F32),
                                     ir.VectorType(F32, width), self.lanes_below(count, width))
                b.store(to_bf16_bits(b, x), self.at(row_dst, b.mul(p, k.i64(2))), align=2)

    def pack_l_columns(self, buf: ir.Value, i0: ir.Value, height: int,
                       side_by_side: bool) -> None:
        """As `pack_l_rows` for an L stored by columns (side "bt"): per pair of K's rows, the
        tile's COLUMN_TILE consecutive values of each (zeros past M and K) rounded and
        interleaved into a pair per row, stored `side_by_side` (COLUMN_TILE pairs at a time:
        row r's pair g at g * COLUMN_TILE + r; heights up to COLUMN_TILE) or into each row of
        `pack_l_rows`'s layout (AMX's tiles load rows)."""
        k = self.k
        b = k.b
        lanes = COLUMN_TILE
        assert side_by_side <= (height <= lanes)
        for h0 in range(0, height, lanes):
            valid = b.sub(self.m, b.add(i0, k.i64(h0)))
            rows = self.lanes_below(k.minimum("int64", valid, k.i64(min(lanes, height - h0))),
                                    lanes)
            no = ir.Constant(ir.VectorType(I1, lanes), [0] * lanes)
            with k.loop(self.pairs, name="pc") as g:
                kr = b.add(self.k0, b.mul(g, k.i64(2)))
                bits = []
                for j in range(2):
                    inside = b.icmp_signed("<", b.add(kr, k.i64(j)), self.kk)
                    src = b.gep(self.l, [b.add(b.mul(b.add(kr, k.i64(j)), self.ldl),
                                               b.add(i0, k.i64(h0)))], source_etype=F32)
                    x = self.masked_load(src, ir.VectorType(F32, lanes), b.select(inside, rows, no))
                    bits.append(to_bf16_bits(b, x))
                pairs = b.bitcast(b.shuffle_vector(bits[0], bits[1], ir.Constant(
                    ir.VectorType(I32, 2 * lanes), [i // 2 + (i % 2) * lanes
                                                    for i in range(2 * lanes)])),
                    ir.VectorType(I32, lanes))
                if side_by_side:
                    b.store(pairs, self.at(buf, b.mul(g, k.i64(lanes * 4))), align=4)
                    continue
                for r in range(min(lanes, height - h0)):
                    b.store(b.extract_element(pairs, ir.Constant(I32, r)),
                            self.at(buf, b.add(k.i64((h0 + r) * KC * 2), b.mul(g, k.i64(4)))),
                            align=4)

    def pack_r_panels(self, buf: ir.Value, jb: ir.Value) -> None:
        """buf = the PANELS panels of R's columns from jb for this block of K, each as `pack_r`
        lays one out (bf16 pairs; zeros past N and K), KC / 2 pair rows apart; panels wholly
        past N are left as they are (never read). A whole panel's pairs of rows inside K are
        copied without masks: with masks everywhere, the stem conv's product per chunk of X'
        (64 x 224 x 147) ran at 116 GFLOP/s, without them at 158."""
        k = self.k
        b = k.b
        cols = b.sub(self.n, jb)
        whole_pairs = b.udiv(self.kc, k.i64(2))
        for q in range(PANELS):
            col0 = q * PACK_COLS
            panel = self.at(buf, k.i64(q * (KC // 2) * PAIR_ROW))
            with k.if_then(b.icmp_signed(">", cols, k.i64(col0))):
                whole = b.icmp_signed(">=", cols, k.i64(col0 + PACK_COLS))
                first_masked = b.select(whole, whole_pairs, k.i64(0))
                with k.loop(first_masked, name="pw") as g:
                    self.pack_pair_row(panel, jb, col0, g, None)
                masks = [self.lanes_below(b.sub(cols, k.i64(col0 + h * 16)), 16)
                         for h in range(2)]
                with k.loop(self.pairs, start=first_masked, name="pm") as g:
                    self.pack_pair_row(panel, jb, col0, g, masks)

    def pack_pair_row(self, panel: ir.Value, jb: ir.Value, col0: int, g: ir.Value,
                      masks: list[ir.Value] | None) -> None:
        """Pair row g of a panel: rows k0 + 2g and k0 + 2g + 1 of R's columns jb + col0 ...
        + 31, interleaved column by column, as bf16; `masks`: lanes of columns inside N, and
        rows past K read as zeros (else every value is read)."""
        k = self.k
        b = k.b
        kr = b.add(self.k0, b.mul(g, k.i64(2)))
        src = [b.gep(self.r, [b.add(b.mul(b.add(kr, k.i64(j)), self.ldr),
                                    b.add(jb, k.i64(col0)))], source_etype=F32)
               for j in range(2)]
        if masks is None:
            rows = [b.load(p, typ=ir.VectorType(F32, PACK_COLS), align=4) for p in src]
            # the next group's lines of these rows (a few hundred rows of X', each read 128
            # bytes at a time, from L3 or memory): asked for while this group is multiplied
            for p in src:
                for line in range(2):
                    prefetch(b, b.gep(p, [k.i64(PANELS * PACK_COLS + line * 16)],
                                      source_etype=F32))
        else:
            no = ir.Constant(ir.VectorType(I1, 16), [0] * 16)
            rows = []
            for j in range(2):
                inside = b.icmp_signed("<", b.add(kr, k.i64(j)), self.kk)
                halves = [self.masked_load(b.gep(src[j], [k.i64(h * 16)], source_etype=F32),
                                           ir.VectorType(F32, 16), b.select(inside, masks[h], no))
                          for h in range(2)]
                rows.append(b.shuffle_vector(halves[0], halves[1], ir.Constant(
                    ir.VectorType(I32, PACK_COLS), list(range(PACK_COLS)))))
        # column c's two values side by side: lanes 2c (row kr), 2c + 1 (row kr + 1)
        bits = [to_bf16_bits(b, row) for row in rows]
        pairs = b.shuffle_vector(bits[0], bits[1], ir.Constant(
            ir.VectorType(I32, 2 * PACK_COLS),
            [i // 2 + (i % 2) * PACK_COLS for i in range(2 * PACK_COLS)]))
        b.store(pairs, self.at(panel, b.mul(g, k.i64(PAIR_ROW))), align=4)

    # -- one tile ------------------------------------------------------------------------
    def tile(self, l_src: ir.Value, lld: ir.Value, r_src: ir.Value, l_row0: ir.Value,
             i0: ir.Value, j0: ir.Value, rows: int, pair_bytes: int = 4) -> None:
        """C[i0:i0+rows, j0:j0+NR] for this block of K: L's rows from l_src (row l_row0 there
        is C's row i0; rows lld bytes apart, a row's pairs pair_bytes apart; AMX: 4), R's pair
        rows from r_src, PAIR_ROW bytes apart."""
        if self.isa.kind == "amx":
            self.amx_block(l_src, lld, r_src, l_row0, i0, j0, rows)
            return
        k, isa, w = self.k, self.isa, self.w
        b = k.b
        accs = []
        with b.goto_entry_block():
            for _ in range(rows * isa.nv):
                accs.append(b.alloca(self.vf))
        for a in accs:
            b.store(ir.Constant(self.vf, None), a)
        a_rows = [self.at(l_src, b.mul(b.add(l_row0, k.i64(r)), lld)) for r in range(rows)]
        vi = ir.VectorType(I32, w)
        # the pairs past K are zeros in both packed operands: vdpbf16ps skips them (AMX's
        # tiles take 16 pairs at a time); the stem's K = 147 multiplies 74 pairs, not 80
        with k.loop(b.udiv(b.add(self.kc, k.i64(1)), k.i64(2)), name="g") as g:
            if self.side == "a":
                # the weights' rows are far apart (a stream each); one row per step is asked
                # for L_PREFETCH bytes ahead, so every line is before the tile reaches it
                ahead = b.urem(g, k.i64(rows))
                prefetch(b, self.at(a_rows[0], b.add(b.mul(ahead, lld), b.add(
                    b.mul(g, k.i64(pair_bytes)), k.i64(L_PREFETCH)))))
            bsrc = self.at(r_src, b.mul(g, k.i64(PAIR_ROW)))
            bvec = [b.load(self.at(bsrc, k.i64(v * w * 4)), typ=vi, align=4)
                    for v in range(isa.nv)]
            for r in range(rows):
                a2 = b.load(self.at(a_rows[r], b.mul(g, k.i64(pair_bytes))), typ=I32, align=4)
                for v in range(isa.nv):
                    slot = accs[r * isa.nv + v]
                    b.store(self.multiply(b.load(slot), a2, bvec[v]), slot)
        left = b.sub(self.n, j0)
        masks = [self.lanes_below(b.sub(left, k.i64(v * w)), w) for v in range(isa.nv)]
        for r in range(rows):
            self.store_row(b.add(i0, k.i64(r)), j0,
                           [b.load(accs[r * isa.nv + v]) for v in range(isa.nv)], masks)

    def multiply(self, acc: ir.Value, a2: ir.Value, bv: ir.Value) -> ir.Value:
        """acc + a[0] * b[.., 0] + a[1] * b[.., 1] for a pair of bf16 `a2` (i32) and W columns."""
        b, w = self.k.b, self.w
        vi = ir.VectorType(I32, w)
        fn = declare_function(self.module, "llvm.x86.avx512bf16.dpbf16ps.512", self.vf, [self.vf, vi, vi])
        return b.call(fn, [acc, splat(b, a2, w), bv])

    def amx_block(self, l_src: ir.Value, lld: ir.Value, r_src: ir.Value, l_row0: ir.Value,
                  i0: ir.Value, j0: ir.Value, rows: int) -> None:
        """A block of rows (32 or 16) x 32 columns of C in AMX tiles, stored into c_buf, then
        added to C row by row (`store_row`)."""
        k = self.k
        b = k.b
        tiles = _AmxTiles(self)
        heights = rows // 16
        pre = b.block
        init = [tiles.zero() for _ in range(heights * 2)]
        head = k.function.append_basic_block("amx.head")
        body = k.function.append_basic_block("amx.body")
        done = k.function.append_basic_block("amx.done")
        b.branch(head)
        b.position_at_end(head)
        step = b.phi(I64, name="ks")
        step.add_incoming(k.i64(0), pre)
        accs = []
        for x in init:
            phi = b.phi(tiles.type)
            phi.add_incoming(x, pre)
            accs.append(phi)
        steps = b.udiv(self.pairs, k.i64(16))
        b.cbranch(b.icmp_signed("<", step, steps), body, done)
        b.position_at_end(body)
        a_tiles = [tiles.load(self.at(l_src, b.add(
            b.mul(b.add(l_row0, k.i64(16 * t)), lld), b.mul(step, k.i64(64)))), lld)
            for t in range(heights)]
        r_step = self.at(r_src, b.mul(step, k.i64(16 * PAIR_ROW)))
        b_tiles = [tiles.load(self.at(r_step, k.i64(64 * u)), k.i64(PAIR_ROW)) for u in range(2)]
        new = [tiles.dot(accs[t * 2 + u], a_tiles[t], b_tiles[u])
               for t in range(heights) for u in range(2)]
        latch = b.block
        step.add_incoming(b.add(step, k.i64(1)), latch)
        for phi, x in zip(accs, new):
            phi.add_incoming(x, latch)
        b.branch(head)
        b.position_at_end(done)
        assert self.c_buf is not None
        for t in range(heights):
            for u in range(2):
                tiles.store(self.at(self.c_buf, k.i64(t * 16 * 128 + u * 64)), k.i64(128),
                            accs[t * 2 + u])
        left = b.sub(self.n, j0)
        masks = [self.lanes_below(b.sub(left, k.i64(v * 16)), 16) for v in range(2)]
        valid = k.minimum("int64", b.sub(self.m, i0), k.i64(rows))
        with k.loop(valid, name="cr") as r:
            row = self.at(self.c_buf, b.mul(r, k.i64(128)))
            xs = [b.load(self.at(row, k.i64(64 * v)), typ=self.vf, align=64) for v in range(2)]
            self.store_row(b.add(i0, r), j0, xs, masks)

    # -- into C --------------------------------------------------------------------------
    def store_row(self, row: ir.Value, j0: ir.Value, xs: list[ir.Value],
                  masks: list[ir.Value]) -> None:
        """C[row, j0 + v*W ...] = the sums xs (plus C's earlier blocks or accumulate), through
        the epilogue after K's last block; lanes outside `masks` untouched."""
        k, w, ep = self.k, self.w, self.epilogue
        b = k.b
        base = b.add(b.mul(row, self.ldc), j0)
        outs = []
        for v, x in enumerate(xs):
            ptr = b.gep(self.c, [b.add(base, k.i64(v * w))], source_etype=F32)
            earlier = self.masked_load(ptr, self.vf, b.and_(masks[v], splat(b, self.load_c, w)))
            outs.append((b.fadd(x, earlier), ptr))
        if ep == PLAIN:
            for v, (x, ptr) in enumerate(outs):
                self.masked_store(x, ptr, masks[v])
            return
        with b.if_else(self.last) as (last, partial):
            with last:
                for v, (x, ptr) in enumerate(outs):
                    col = b.add(j0, k.i64(v * w))
                    if ep.bias == "row":
                        bias = b.load(b.gep(self.bias, [row], source_etype=F32), typ=F32)
                        x = b.fadd(x, splat(b, bias, w))
                    elif ep.bias == "col":
                        x = b.fadd(x, self.masked_load(b.gep(self.bias, [col], source_etype=F32),
                                                       self.vf, masks[v]))
                    if ep.residual:
                        res = b.gep(self.residual, [b.add(base, k.i64(v * w))], source_etype=F32)
                        x = b.fadd(x, self.masked_load(res, self.vf, masks[v]))
                    if ep.activation is not None:
                        x = apply_activation(b, ep.activation, ep.params, x)
                    self.masked_store(x, ptr, masks[v])
            with partial:
                for v, (x, ptr) in enumerate(outs):
                    self.masked_store(x, ptr, masks[v])


# ------------------------------------------------------------------------------ emitting


def emit_bf16_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, l_ptr: ir.Value,
                   ldl: ir.Value, r_ptr: ir.Value, ldr: ir.Value, c: ir.Value, ldc: ir.Value, *,
                   side: str, accumulate: bool = False, bias: ir.Value | None = None,
                   residual: ir.Value | None = None, epilogue: Epilogue = PLAIN) -> None:
    """Call the module's kernel (one thread): see `bf16_gemm_function`."""
    fn = bf16_gemm_function(k.module, k.target, side, epilogue)
    null = ir.Constant(PTR, None)
    k.b.call(fn, [m, n, kk, l_ptr, ldl, r_ptr, ldr, c, ldc, ir.Constant(I1, int(accumulate)),
                  bias if bias is not None else null, residual if residual is not None else null])


def emit_parallel_bf16_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value,
                            l_ptr: ir.Value, ldl: ir.Value, r_ptr: ir.Value, ldr: ir.Value,
                            c: ir.Value, ldc: ir.Value, *, side: str, accumulate: bool = False,
                            bias: ir.Value | None = None, residual: ir.Value | None = None,
                            epilogue: Epilogue = PLAIN) -> None:
    """The product split over the threads into blocks of rows (or of whole panels of columns
    when M is the smaller side), as the float kernel's emit_parallel_gemm."""
    b = k.b
    by_rows, block, count, other, tile = split_blocks(k, m, n, ROW_SPLIT, PACK_COLS,
                                                      MIN_ROW_TILES, MIN_COLUMN_TILES)
    null = ir.Constant(PTR, None)
    carry = [m, n, kk, l_ptr, ldl, r_ptr, ldr, c, ldc, bias if bias is not None else null,
             residual if residual is not None else null, count, tile, b.zext(by_rows, I64)]
    with k.parallel_loop(count, cost=b.mul(b.mul(block, other), kk), name="bf16gemm",
                         carry=carry) as t:
        (m_, n_, kk_, l_, ldl_, r_, ldr_, c_, ldc_, bias_, res_, count_, tile_,
         rows_flag) = k.carried
        bb = k.b
        rows = bb.icmp_signed("!=", rows_flag, k.i64(0))
        start, size = block_span(k, t, count_, bb.select(rows, m_, n_), tile_)
        row0 = bb.select(rows, start, k.i64(0))
        col0 = bb.select(rows, k.i64(0), start)
        if side != "a":  # L float32 rows (or columns); R panels of Kp / 2 pair rows (a column
            # block starts on a panel)
            kp2 = bb.mul(bb.and_(bb.add(kk_, k.i64(K_ALIGN - 1)), k.i64(-K_ALIGN)), k.i64(2))
            l_off = bb.mul(row0 if side == "bt" else bb.mul(row0, ldl_), k.i64(4))
            r_off = bb.mul(col0, kp2)
        else:  # L bf16 rows of Kl; R float32 columns
            l_off = bb.mul(row0, emit_l_row_bytes(k, kk_))
            r_off = bb.mul(col0, k.i64(4))
        c_off = bb.add(bb.mul(row0, ldc_), col0)
        bias_off = row0 if epilogue.bias == "row" else col0
        emit_bf16_gemm(
            k, bb.select(rows, size, m_), bb.select(rows, n_, size), kk_,
            bb.gep(l_, [l_off], source_etype=I8), ldl_, bb.gep(r_, [r_off], source_etype=I8),
            ldr_, bb.gep(c_, [c_off], source_etype=F32), ldc_, side=side, accumulate=accumulate,
            bias=bb.gep(bias_, [bias_off], source_etype=F32) if epilogue.bias != "none" else None,
            residual=bb.gep(res_, [c_off], source_etype=F32) if epilogue.residual else None,
            epilogue=epilogue)
