"""A register-blocked float32 matrix product, C (+)= A @ B, shared by every op that needs one.

One internal function per module, epilogue and operand layout, taking sizes and strides at
run time: ops call it instead of generating their own loop nests, so a model with fifty
convolutions compiles a few kernels, not fifty. The kernel walks C in tiles of MR rows x NR
columns; each tile keeps its MR x NR sums in vector registers for the whole K loop, loading
one NR-wide row of B and MR scalars of A per step (broadcast, fused multiply-add). Rows left
over at the edge get tiles of halving heights (8, 4, 2, 1); the columns left over, one panel
of as many vectors as they need, the lanes of its last vector past N masked off. A packed A
times at most GEMV_COLUMNS columns runs the other way round (`narrow_panel`): vectors along
A's rows, one column at a time.

Tile sizes follow the target's vector registers (`KernelTarget.isa`): AVX-512's 32 registers of 16
floats hold a 12 x 32 tile (24 accumulators, two rows of B, a broadcast); AVX2's 16 of 8
floats a 6 x 16; SSE's 16 of 4 a 4 x 8; AArch64's 32 NEON registers a 12 x 8.

Operands are row-major with a row stride, or packed at compile time (`Layout`, `pack_a`,
`pack_b`: constant weights, see passes/pack_gemm_weights.py): A in panels of 12 rows stored
k-major, so a tile's MR values at one k are consecutive floats (one pointer, constant
offsets, broadcasts straight from memory), B in panels of 32 columns, so no call copies it.
One panel layout serves every tile shape above (each MR divides 12, each NR 32): the CPU
variants of an x86 library share one weights blob.

The epilogue adds a bias per row (convolution channels) or per column (Gemm), then a
residual (a tensor laid out like C, read with C's strides), then applies an activation
(kernels/activation.py), while the tile is still in registers: fused nodes make one pass over
memory instead of three.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir

from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import (
    I1,
    I64,
    PTR,
    Emitter,
    fmuladd_intrinsic,
    masked_intrinsic,
    prefetch,
    splat,
)
from cuvil.compiler.kernels.objects import kernel_function
from cuvil.compiler.kernels.target import KernelTarget

F32 = ir.FloatType()


#: rows per panel of a pre-packed A (`pack_a`) and columns per panel of a pre-packed B
#: (`pack_b`): one layout every x86 level (and AArch64) reads, since the weights blob is
#: shared by a library's CPU variants. Every MR divides PACK_ROWS and every NR PACK_COLS.
PACK_ROWS = 12
PACK_COLS = 32


@dataclass(frozen=True)
class Layout:
    """How the kernel reads A and B: row-major with a row stride (the default), or packed at
    compile time (`pack_a`, `pack_b`), when the stride arguments are ignored. `a_columns`: A
    is stored column by column, A[i, k] at a[k * lda + i] (the transposed products of convs
    over small maps, whose A is the input's [channels, pixels] read as [pixels, channels]):
    a tile's MR values at one k are then consecutive floats, as in a packed A."""

    packed_a: bool = False
    packed_b: bool = False
    a_columns: bool = False

    def __post_init__(self) -> None:
        assert not (self.packed_a and self.a_columns), "A is packed or stored by columns"

    @property
    def suffix(self) -> str:
        return (("_pa" if self.packed_a else "") + ("_ac" if self.a_columns else "")
                + ("_pb" if self.packed_b else ""))


ROW_MAJOR = Layout()


def pack_a(a: np.ndarray) -> np.ndarray:
    """A[M, K] as panels of PACK_ROWS rows (the last one the rows left), each stored k-major:
    panel p holds A[p*R:(p+1)*R, k] for k = 0, 1, ... one after the other. Same size as A."""
    m = a.shape[0]
    panels = [a[i:i + PACK_ROWS].T.ravel() for i in range(0, m, PACK_ROWS)]
    return np.concatenate(panels).astype(a.dtype).reshape(a.shape) if panels else a.copy()


def pack_b(b: np.ndarray) -> np.ndarray:
    """B[K, N] as panels of PACK_COLS columns (the last one the columns left), each stored
    k-major (row by row of the panel). Same size as B."""
    n = b.shape[1]
    panels = [b[:, j:j + PACK_COLS].ravel() for j in range(0, n, PACK_COLS)]
    return np.concatenate(panels).astype(b.dtype).reshape(b.shape) if panels else b.copy()


@dataclass(frozen=True)
class Epilogue:
    """What the kernel does to a finished tile, in this order: C = act(C + bias + residual)."""

    bias: str = "none"  # "none" | "row" (one per row of C) | "col" (one per column)
    #: add the residual operand (same layout and strides as C)
    residual: bool = False
    #: an activation of kernels/activation.py, and its parameters
    activation: str | None = None
    params: tuple[float, ...] = ()

    @property
    def suffix(self) -> str:
        """Names the kernel: one function per distinct epilogue (parameters by their bits)."""
        parts = [self.bias]
        if self.residual:
            parts.append("res")
        if self.activation is not None:
            parts.append(self.activation.lower())
            parts += [struct.pack("<f", p).hex() for p in self.params]
        return "_".join(parts)


#: no bias, no activation
PLAIN = Epilogue()


_GEMM_TYPE = ir.FunctionType(ir.VoidType(), [I64, I64, I64, PTR, I64, PTR, I64, PTR, I64, I1, PTR,
                                             PTR])


def gemm_function(module: ir.Module, target: KernelTarget, epilogue: Epilogue = PLAIN,
                  layout: Layout = ROW_MAJOR) -> ir.Function:
    """`void gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate, bias, residual)` (all i64 but
    pointers and the flag).

    C[i, j] = act((accumulate ? C[i, j] : 0) + sum_k A[i, k] * B[k, j] (+ bias)
    (+ residual[i * ldc + j])). Strides are in elements; rows of B and C must be contiguous
    (unit column stride). A packed A (`layout`) is `pack_a` of the [M, K] matrix (lda = K);
    an A by columns has A[i, k] at a[k * lda + i]; a packed B, `pack_b` of the [K, N] one
    (ldb is not read).
    """
    def define(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        # one shared copy: inlined into each caller, LLVM would specialize and unroll it for
        # every call's constant sizes, multiplying compile time and code size for no speed
        fn.attributes.add("noinline")
        for i in (3, 5, 7, 10, 11):
            fn.args[i].add_attribute("noalias")
        isa = target.isa
        assert PACK_ROWS % isa.mr == 0 and PACK_COLS % isa.nr == 0, isa
        _GemmWriter(module, fn, target, epilogue, layout).write()

    # the IR is vectorized and unrolled as it should run: LLVM's IR optimizer took 55% of the
    # kernel's compile time and left the libraries' outputs and speed as they were (ResNet-50,
    # a U-Net, MobileNet-v3, a GRU, a ViT); the int8 kernel, by contrast, needs it
    return kernel_function(module, target, f"cuvil.gemm.{epilogue.suffix}{layout.suffix}",
                           _GEMM_TYPE, define, optimize=False)


#: K is walked in blocks of KC: one packed panel of B (KC x NR floats, 16 KB with AVX2) then
#: stays in L1 while every row tile of A runs over it
KC = 256
#: with B packed at compile time (weights), K in one block when A's rows of the product fit
#: this (in L2) or when even a block of KC would not (A then comes from L3 either way): C is
#: then written once instead of read back and rewritten per block. On a Zen 3, M x K x N =
#: 512 x 1024 x 4096: 51.7 -> 46.6 ms, 64 x 1024 x 4096: 7.2 -> 6.5 ms; but 64 x 4096 x 1024
#: stays in blocks (7.4 ms, 9.0 whole: its 1 MB of A rows would leave L2)
WHOLE_K_BYTES = 512 * 1024
BLOCKED_A_BYTES = 256 * 1024
#: the K loop prefetches the rows of A and of B this many steps ahead: a tile's first pass
#: over a block streams constant weights from L3 or memory (a panel of B is 32 KB, its
#: rows cross a page every 32 steps, where the hardware's prefetchers stop), and a 7x7 map's
#: weights are reused only 49 times (whole ResNet-50 at 1 thread: 1.22 -> 1.14 x onnxruntime)
PREFETCH_A = 16
PREFETCH_B = 16
#: floats per cache line
LINE_FLOATS = 16
#: products at most this wide walk row tiles outside, column panels inside (`write`): the
#: block of B (KC x N floats, 256 KB at most) stays in L2 while each tile of A is read once
NARROW = 256
#: with fewer rows than this, a packed panel would be read too few times to repay the copy
PACK_MIN_ROWS = 12
#: blocks per thread a parallel product is split into: a few, so that a thread slowed down
#: (by another process on its core) hands its share to the others
BLOCKS_PER_THREAD = 4
#: the fewest tiles in a block of rows (each repacks B: fewer, larger blocks share more) and
#: in a block of columns (each rereads A, which is cheaper)
MIN_ROW_TILES = 4
MIN_COLUMN_TILES = 2
#: products of a packed A with at most this many columns (a conv's map of a few positions,
#: known only at run time) take `narrow_panel`: a tile's 16 or 32 lanes along the columns
#: would hold 1 to 4 of them, 4 to 32 times the multiply-adds
GEMV_COLUMNS = 4
#: panels packed together: the copy reads PANELS x NR consecutive floats of each row of B
#: (256 bytes with AVX2), which the hardware prefetcher follows, instead of one cache line
PANELS = 4


class _GemmWriter:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget,
                 epilogue: Epilogue, layout: Layout) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.isa = target.isa
        self.epilogue = epilogue
        self.layout = layout
        (self.m, self.n, self.kk, self.a, self.lda, self.bm, self.ldb, self.c, self.ldc,
         self.acc, self.bias, self.residual) = fn.args
        #: lanes of the last, partial vector panel (None elsewhere)
        self.mask: ir.Value | None = None
        #: per vector of a tile row, the lanes of C it writes (None: the whole vector), for
        #: panels copied with zeros past N (`packed_groups`): their B is read whole
        self.c_masks: list[ir.Value] | None = None

    def write(self) -> None:
        """C in blocks of KC along K. Unless B is pre-packed, each block of B is first copied,
        PANELS panels of NR columns at a time (the last one partial, its lanes past N zero),
        into a contiguous stack buffer when there are enough rows to reuse it: B's rows are
        ldb apart (a 1x1 convolution reads X, whose rows are H*W floats apart: a new page per
        step), and N = 49 or 196 positions leave them unaligned. Within a group of panels,
        when N is small (`NARROW`), row tiles outside and panels inside: a tile's rows of A,
        read once, serve every panel from L1 — weights of late ResNet layers are too big to be
        re-read per panel. For wider products, panels outside (each then in L1), row tiles
        inside. The fewer than NR columns left make one panel, its last vector masked."""
        k, isa = self.k, self.isa
        b = k.b
        nr = isa.nr
        packed_b = self.layout.packed_b
        n_full = b.mul(b.udiv(self.n, k.i64(nr)), k.i64(nr))
        narrow = b.icmp_signed("<=", self.n, k.i64(NARROW))
        if not packed_b:
            panel = b.alloca(ir.ArrayType(F32, KC * nr * PANELS), name="panels")
            panel.align = 64
            panel.type = PTR  # used as an untyped pointer, like every other buffer here
            pack = b.icmp_signed(">=", self.m, k.i64(PACK_MIN_ROWS))
        block = self.whole_k_or_blocks(narrow) if packed_b else k.i64(KC)
        with k.loop(self.kk, step=block, name="k0") as k0:
            kc = k.minimum("int64", b.sub(self.kk, k0), block)
            # earlier blocks' sums are in C; the epilogue runs once, after the last block
            self.load_c = b.or_(self.acc, b.icmp_signed(">", k0, k.i64(0)))
            self.last = b.icmp_signed("==", b.add(k0, kc), self.kk)
            self.kc, self.k0 = kc, k0
            self.b_blk = b.gep(self.bm, [b.mul(k0, self.ldb)], source_etype=F32)
            if packed_b:
                self.unpacked_block(n_full, narrow)
            elif self.layout.packed_a:
                with b.if_else(b.icmp_signed("<=", self.n, k.i64(GEMV_COLUMNS))) as (few, many):
                    with few:
                        self.narrow_block(n_full)
                    with many:
                        self.copied_or_in_place(panel, pack, n_full, narrow)
            else:
                self.copied_or_in_place(panel, pack, n_full, narrow)
        b.ret_void()

    def whole_k_or_blocks(self, narrow: ir.Value) -> ir.Value:
        """The K block of a product with pre-packed B (`WHOLE_K_BYTES`): all of K, or KC. Not
        for narrow products, whose block of B (K x N) must stay in L2 while every row tile
        runs over it."""
        k = self.k
        b = k.b
        a_rows = b.mul(self.m, k.i64(4))
        fits = b.icmp_unsigned("<=", b.mul(a_rows, self.kk), k.i64(WHOLE_K_BYTES))
        never = b.icmp_unsigned(">", b.mul(a_rows, k.i64(KC)), k.i64(BLOCKED_A_BYTES))
        whole = b.and_(b.not_(narrow), b.or_(fits, never))
        return b.select(whole, k.maximum("int64", self.kk, k.i64(1)), k.i64(KC))

    def copied_or_in_place(self, panel: ir.Value, pack: ir.Value, n_full: ir.Value,
                           narrow: ir.Value) -> None:
        """This block of K, B copied into `panel` when there are rows enough (`pack`)."""
        with self.k.b.if_else(pack) as (packing, in_place):
            with packing:
                self.packed_groups(panel, narrow)
            with in_place:  # at most a few row tiles: B's block is read that often
                self.row_tiles(lambda i, height: self.columns(n_full, i, height))

    def narrow_block(self, n_full: ir.Value) -> None:
        """This block of K for N <= GEMV_COLUMNS: each whole panel of packed A by
        `narrow_panel`, the rows past them in tiles as `write` runs them."""
        k = self.k
        b = k.b
        whole = b.mul(b.udiv(self.m, k.i64(PACK_ROWS)), k.i64(PACK_ROWS))
        with k.loop(whole, step=PACK_ROWS, name="gp") as i:
            self.narrow_panel(i)
        self.row_tiles(lambda i, height: self.columns(n_full, i, height), start=whole)

    def narrow_panel(self, i0: ir.Value) -> None:
        """C[i0:i0+12, j] (+)= A[i0:i0+12, k0:k0+kc] @ B[k0:k0+kc, j] for each of the few
        columns j: vectors along the panel's 12 rows (its k-major layout holds them side by
        side), B's value broadcast; four sums over alternate values of k, whose
        multiply-adds do not wait for each other."""
        k = self.k
        b = k.b
        vt = ir.VectorType(F32, PACK_ROWS)
        fma = fmuladd_intrinsic(k.module, vt)
        a0 = b.gep(self.a, [b.mul(i0, self.lda)], source_etype=F32)  # panel i0 // 12
        a0 = b.gep(a0, [b.mul(self.k0, k.i64(PACK_ROWS))], source_etype=F32)
        quads = b.and_(self.kc, k.i64(-4))
        with b.goto_entry_block():  # the sums: stack slots LLVM keeps in registers
            slots = [b.alloca(vt) for _ in range(4)]
        with k.loop(self.n, name="gj") as j:
            column = b.gep(self.b_blk, [j], source_etype=F32)

            def step(p: ir.Value, slot: ir.Value) -> None:
                a = b.load(b.gep(a0, [b.mul(p, k.i64(PACK_ROWS))], source_etype=F32), typ=vt,
                           align=4)
                x = b.load(b.gep(column, [b.mul(p, self.ldb)], source_etype=F32), typ=F32)
                b.store(b.call(fma, [a, splat(b, x, PACK_ROWS), b.load(slot)]), slot)

            for slot in slots:
                b.store(ir.Constant(vt, None), slot)
            with k.loop(quads, step=4, name="gk") as p:
                for q, slot in enumerate(slots):
                    step(b.add(p, k.i64(q)), slot)
            with k.loop(self.kc, start=quads, name="gr") as p:
                step(p, slots[0])
            sums = [b.load(slot) for slot in slots]
            total = b.fadd(b.fadd(sums[0], sums[1]), b.fadd(sums[2], sums[3]))
            self.narrow_store(total, i0, j)

    def narrow_store(self, total: ir.Value, i0: ir.Value, j: ir.Value) -> None:
        """C[i0:i0+12, j] = total (plus C's earlier blocks or accumulate), through the
        epilogue after K's last block: a column of C, one element a row."""
        k, ep = self.k, self.epilogue
        b = k.b
        rows = range(PACK_ROWS)
        at = [b.add(b.mul(b.add(i0, k.i64(r)), self.ldc), j) for r in rows]

        def gather(base: ir.Value) -> ir.Value:
            x = ir.Constant(total.type, None)
            for r in rows:
                value = b.load(b.gep(base, [at[r]], source_etype=F32), typ=F32)
                x = b.insert_element(x, value, k.i64(r))
            return x

        earlier = b.select(self.load_c, gather(self.c), ir.Constant(total.type, None))
        total = b.fadd(total, earlier)
        if ep != PLAIN:
            finished = total
            if ep.bias == "row":
                finished = b.fadd(finished, b.load(b.gep(self.bias, [i0], source_etype=F32),
                                                   typ=total.type, align=4))
            elif ep.bias == "col":
                bias = b.load(b.gep(self.bias, [j], source_etype=F32), typ=F32)
                finished = b.fadd(finished, splat(b, bias, PACK_ROWS))
            if ep.residual:
                finished = b.fadd(finished, gather(self.residual))
            if ep.activation is not None:
                finished = apply_activation(b, ep.activation, ep.params, finished)
            total = b.select(self.last, finished, total)
        for r in rows:
            b.store(b.extract_element(total, k.i64(r)), b.gep(self.c, [at[r]], source_etype=F32))

    def unpacked_block(self, n_full: ir.Value, narrow: ir.Value) -> None:
        """This block of K of a pre-packed B, in the order `write` says."""
        k, isa = self.k, self.isa
        b = k.b
        with b.if_else(narrow) as (rows_first, panels_first):
            with rows_first:
                self.row_tiles(lambda i, height: self.columns(n_full, i, height))
            with panels_first:
                with k.loop(n_full, step=isa.nr, name="j") as j:
                    self.rows(*self.b_src(j), j, isa.nv)
                src, ld = self.b_src(n_full)
                self.remainder(b.sub(self.n, n_full),
                               lambda nv: self.rows(src, ld, n_full, nv))

    def packed_groups(self, panel: ir.Value, narrow: ir.Value) -> None:
        """This block of K, B copied PANELS panels at a time into `panel` (panel q at
        q * KC * NR floats, rows NR apart, zeros past N), then multiplied in the order `write`
        says. A panel's tile stores only the columns of C it has (masks computed per panel, B read
        whole): full and partial panels share tile shapes, one per height and vector count."""
        k, isa = self.k, self.isa
        b = k.b
        nr = isa.nr
        with k.loop(self.n, step=nr * PANELS, name="jb") as jb:
            cols = k.minimum("int64", b.sub(self.n, jb), k.i64(nr * PANELS))
            full = b.udiv(cols, k.i64(nr))
            rem = b.sub(cols, b.mul(full, k.i64(nr)))
            self.pack(b.gep(self.b_blk, [jb], source_etype=F32), panel, full, rem)
            count = b.add(full, b.zext(b.icmp_signed(">", rem, k.i64(0)), I64))

            def tile(q: ir.Value, i: ir.Value, height: int) -> None:
                j = b.add(jb, b.mul(q, k.i64(nr)))
                left = b.sub(self.n, j)
                src = b.gep(panel, [b.mul(q, k.i64(KC * nr))], source_etype=F32)
                # a whole panel stores without masks: a masked store of C is one instruction
                # with AVX-512 but some 20 micro-ops on AMD's AVX2 cores (Zen 3), a third of a
                # 1x1 convolution's time there
                with k.if_then(b.icmp_signed(">=", left, k.i64(nr))):
                    self.tile(src, k.i64(nr), i, j, height, isa.nv)
                # the last, partial panel: as many vectors as its columns need (4 columns
                # would otherwise cost a full tile's multiply-adds), C's lanes masked
                for nv in range(isa.nv, 0, -1):
                    upper = nv * isa.vector if nv < isa.nv else nr - 1
                    fits = b.and_(b.icmp_signed(">", left, k.i64((nv - 1) * isa.vector)),
                                  b.icmp_signed("<=", left, k.i64(upper)))
                    with k.if_then(fits):
                        self.c_masks = [self.lanes_below(b.sub(left, k.i64(v * isa.vector)))
                                        for v in range(nv)]
                        self.tile(src, k.i64(nr), i, j, height, nv)
                        self.c_masks = None

            with b.if_else(narrow) as (rows_first, panels_first):
                with rows_first:
                    def group(i: ir.Value, height: int) -> None:
                        with k.loop(count, name="q") as q:
                            tile(q, i, height)
                    self.row_tiles(group)
                with panels_first, k.loop(count, name="q") as q:
                    self.row_tiles(lambda i, height: tile(q, i, height))

    def b_panel(self, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Where columns j.. of this K block start in a pre-packed B, and its row stride:
        B is stored in panels of PACK_COLS columns (the last one narrower), each k-major."""
        k = self.k
        b = k.b
        base = b.mul(b.udiv(j, k.i64(PACK_COLS)), k.i64(PACK_COLS))
        width = k.minimum("int64", b.sub(self.n, base), k.i64(PACK_COLS))
        off = b.add(b.add(b.mul(base, self.kk), b.mul(self.k0, width)), b.sub(j, base))
        return b.gep(self.bm, [off], source_etype=F32), width

    def b_src(self, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        """B's columns j.. in this K block, read in place, and their row stride."""
        if self.layout.packed_b:
            return self.b_panel(j)
        return self.k.b.gep(self.b_blk, [j], source_etype=F32), self.ldb

    def remainder(self, rem: ir.Value, run: Callable[[int], None]) -> None:
        """run(nv) for a panel of the `rem` < NR columns left (none if rem is 0): as many
        vectors as they need, the last one's lanes past them masked off (one pass over A, not
        one per vector)."""
        k, isa = self.k, self.isa
        b = k.b
        for nv in range(1, isa.nv + 1):
            lo, hi = (nv - 1) * isa.vector, nv * isa.vector
            with k.if_then(b.and_(b.icmp_signed(">", rem, k.i64(lo)),
                                  b.icmp_signed("<=", rem, k.i64(hi)))):
                self.mask = self.lanes_below(b.sub(rem, k.i64(lo)))
                run(nv)
                self.mask = None

    def lanes_below(self, count: ir.Value) -> ir.Value:
        """The mask of a vector's lanes numbered below `count` (any i64)."""
        width = self.isa.vector
        lanes = ir.Constant(ir.VectorType(I64, width), list(range(width)))
        return self.k.b.icmp_signed("<", lanes, splat(self.k.b, count, width))

    def columns(self, n_full: ir.Value, i0: ir.Value, height: int) -> None:
        """Every column panel of the row tile at i0 (B read in place)."""
        k, isa = self.k, self.isa
        with k.loop(n_full, step=isa.nr, name="jc") as j:
            self.tile(*self.b_src(j), i0, j, height, isa.nv)
        src, ld = self.b_src(n_full)
        self.remainder(k.b.sub(self.n, n_full),
                       lambda nv: self.tile(src, ld, i0, n_full, height, nv))

    def row_tiles(self, body: Callable[[ir.Value, int], None],
                  start: ir.Value | None = None) -> None:
        """body(i0, height) for every row tile from row `start` (0): full MR-row tiles, then
        the fewer than MR rows left in tiles of halving heights (one row at a time would load
        B once per two multiply-adds)."""
        k, mr = self.k, self.isa.mr
        b = k.b
        first = start if start is not None else k.i64(0)
        rows = b.sub(self.m, first)
        m_full = b.add(first, b.mul(b.udiv(rows, k.i64(mr)), k.i64(mr)))
        with k.loop(m_full, start=first, step=mr, name="i") as i:
            body(i, mr)
        start = m_full
        for height in _leftover_heights(mr):
            fits = b.icmp_signed(">=", b.sub(self.m, start), k.i64(height))
            with k.if_then(fits):
                body(start, height)
            start = b.add(start, b.select(fits, k.i64(height), k.i64(0)))

    def a_tile(self, i0: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | int]:
        """(pointer to A[i0, k0], elements from one k to the next, elements from one row to
        the next) for the tile at row i0. Pre-packed A is stored in panels of PACK_ROWS rows
        (the last one shorter), each k-major: a tile's rows are consecutive floats."""
        k = self.k
        b = k.b
        if self.layout.a_columns:
            return b.gep(self.a, [b.add(b.mul(self.k0, self.lda), i0)], source_etype=F32), \
                self.lda, 1
        if not self.layout.packed_a:
            return b.gep(self.a, [b.add(b.mul(i0, self.lda), self.k0)], source_etype=F32), \
                k.i64(1), self.lda
        base = b.mul(b.udiv(i0, k.i64(PACK_ROWS)), k.i64(PACK_ROWS))
        height = k.minimum("int64", b.sub(self.m, base), k.i64(PACK_ROWS))
        off = b.add(b.add(b.mul(base, self.lda), b.mul(self.k0, height)), b.sub(i0, base))
        return b.gep(self.a, [off], source_etype=F32), height, 1

    def pack(self, src: ir.Value, panels: ir.Value, full: ir.Value, rem: ir.Value) -> None:
        """panels[q, p, :] = src[p * ldb + q * NR : ... + NR] for p < kc, for the `full` panels
        and, when rem > 0, one more of rem columns (lanes past them zero; the loads masked, so
        they never read past B): row by row, so each row of B is read in one run."""
        k, isa = self.k, self.isa
        b = k.b
        vt = ir.VectorType(F32, isa.vector)
        masks = [self.lanes_below(b.sub(rem, k.i64(v * isa.vector))) for v in range(isa.nv)]
        with k.loop(self.kc, name="pk") as p:
            row = b.gep(src, [b.mul(p, self.ldb)], source_etype=F32)
            out_row = b.gep(panels, [b.mul(p, k.i64(isa.nr))], source_etype=F32)

            def copy(q: ir.Value, masked: bool) -> None:
                at = b.gep(row, [b.mul(q, k.i64(isa.nr))], source_etype=F32)
                out = b.gep(out_row, [b.mul(q, k.i64(KC * isa.nr))], source_etype=F32)
                for v in range(isa.nv):
                    ptr = b.gep(at, [k.i64(v * isa.vector)], source_etype=F32)
                    x = (b.call(masked_intrinsic(k.module, "load", vt),
                                [ptr, _ALIGN, masks[v], ir.Constant(vt, None)]) if masked
                         else b.load(ptr, typ=vt, align=4))
                    b.store(x, b.gep(out, [k.i64(v * isa.vector)], source_etype=F32), align=32)

            with k.loop(full, name="pq") as q:
                copy(q, False)
            with k.if_then(b.icmp_signed(">", rem, k.i64(0))):
                copy(full, True)

    def rows(self, bsrc: ir.Value, ldb: ir.Value, j: ir.Value, nv: int) -> None:
        """All row tiles of the column panel at j (B's panel at bsrc, rows ldb apart)."""
        self.row_tiles(lambda i, height: self.tile(bsrc, ldb, i, j, height, nv))

    def tile(self, bsrc: ir.Value, ldb: ir.Value, i0: ir.Value, j0: ir.Value, rows: int,
             nv: int) -> None:
        """C[i0:i0+rows, j0:j0+width] (+)= A[i0:i0+rows, k0:k0+kc] @ B-panel, where width is nv
        vectors (the last lanes masked off when `self.mask` is set)."""
        k = self.k
        b = k.b
        width = self.isa.vector
        vt = ir.VectorType(F32, width)

        def c_ptr(r: int, v: int, base: ir.Value = self.c) -> ir.Value:
            row = b.add(i0, k.i64(r))
            off = b.add(b.mul(row, self.ldc), b.add(j0, k.i64(v * width)))
            return b.gep(base, [off], source_etype=F32, inbounds=True)

        a_ptr, a_step, a_row = self.a_tile(i0)
        a_rows = [k.i64(r * a_row) if isinstance(a_row, int) else b.mul(k.i64(r), a_row)
                  for r in range(rows)]
        # the tile's sums start from C (a later block of K, or accumulate) or from zero: one
        # branch for the tile, not a select per vector
        pre = b.block
        load = k.function.append_basic_block("c.load")
        start = k.function.append_basic_block("kk.start")
        b.cbranch(self.load_c, load, start)
        b.position_at_end(load)
        loaded = [self.vload(c_ptr(r, v), self.c_mask(v, nv)) for r in range(rows)
                  for v in range(nv)]
        b.branch(start)
        b.position_at_end(start)
        init = []
        for x in loaded:
            phi = b.phi(vt)
            phi.add_incoming(x, load)
            phi.add_incoming(ir.Constant(vt, None), pre)
            init.append(phi)
        head = k.function.append_basic_block("kk.head")
        body = k.function.append_basic_block("kk.body")
        done = k.function.append_basic_block("kk.done")
        b.branch(head)
        b.position_at_end(head)
        p = b.phi(I64, name="kk")
        p.add_incoming(k.i64(0), start)
        a_cur = b.phi(PTR, name="a")
        a_cur.add_incoming(a_ptr, start)
        b_cur = b.phi(PTR, name="b")
        b_cur.add_incoming(bsrc, start)
        accs = []
        for x in init:
            phi = b.phi(vt)
            phi.add_incoming(x, start)
            accs.append(phi)
        b.cbranch(b.icmp_signed("<", p, self.kc), body, done)
        b.position_at_end(body)
        bvals = [self.vload(b.gep(b_cur, [k.i64(v * width)], source_etype=F32, inbounds=True),
                            self.mask if v == nv - 1 else None) for v in range(nv)]
        if PREFETCH_B:
            for line in range(0, nv * width, LINE_FLOATS):  # B's row in this tile
                ahead = b.add(b.mul(ldb, k.i64(PREFETCH_B)), k.i64(line))
                prefetch(b, b.gep(b_cur, [ahead], source_etype=F32))
        if PREFETCH_A:  # one line: a packed tile's 12 floats at one k, or a row's next 16
            prefetch(b, b.gep(a_cur, [b.mul(a_step, k.i64(PREFETCH_A))], source_etype=F32))
        fma = fmuladd_intrinsic(k.module, vt)
        new = []
        for r in range(rows):
            a = b.load(b.gep(a_cur, [a_rows[r]], source_etype=F32, inbounds=True), typ=F32)
            a_lanes = splat(b, a, width)
            for v in range(nv):
                new.append(b.call(fma, [a_lanes, bvals[v], accs[r * nv + v]]))
        latch = b.block
        p.add_incoming(b.add(p, k.i64(1)), latch)
        a_cur.add_incoming(b.gep(a_cur, [a_step], source_etype=F32), latch)
        b_cur.add_incoming(b.gep(b_cur, [ldb], source_etype=F32), latch)
        b.branch(head)
        for phi, x in zip(accs, new):
            phi.add_incoming(x, latch)
        b.position_at_end(done)
        if self.epilogue == PLAIN:
            for r in range(rows):
                for v in range(nv):
                    self.vstore(accs[r * nv + v], c_ptr(r, v), self.c_mask(v, nv))
            return
        # the epilogue only after the last block of K (earlier blocks store partial sums)
        with b.if_else(self.last) as (last, partial):
            with last:
                for r in range(rows):
                    for v in range(nv):
                        res = c_ptr(r, v, self.residual) if self.epilogue.residual else None
                        out = self.finish(accs[r * nv + v], b.add(i0, k.i64(r)),
                                          b.add(j0, k.i64(v * width)), res, self.c_mask(v, nv))
                        self.vstore(out, c_ptr(r, v), self.c_mask(v, nv))
            with partial:
                for r in range(rows):
                    for v in range(nv):
                        self.vstore(accs[r * nv + v], c_ptr(r, v), self.c_mask(v, nv))

    def c_mask(self, v: int, nv: int) -> ir.Value | None:
        """The lanes of vector v (of nv) of a tile row that C has (None: all of them)."""
        if self.c_masks is not None:
            return self.c_masks[v]
        return self.mask if v == nv - 1 else None

    def vload(self, p: ir.Value, mask: ir.Value | None) -> ir.Value:
        """One vector at p, only the lanes of `mask` (None: all) read."""
        b, vt = self.k.b, ir.VectorType(F32, self.isa.vector)
        if mask is None:
            return b.load(p, typ=vt, align=4)
        return b.call(masked_intrinsic(self.k.module, "load", vt),
                      [p, _ALIGN, mask, ir.Constant(vt, None)])

    def vstore(self, x: ir.Value, p: ir.Value, mask: ir.Value | None) -> None:
        b = self.k.b
        if mask is None:
            b.store(x, p, align=4)
        else:
            b.call(masked_intrinsic(self.k.module, "store", x.type), [x, p, _ALIGN, mask])

    def finish(self, acc: ir.Value, row: ir.Value, col: ir.Value, residual: ir.Value | None,
               mask: ir.Value | None) -> ir.Value:
        b, ep = self.k.b, self.epilogue
        if ep.bias == "row":
            bias = b.load(b.gep(self.bias, [row], source_etype=F32, inbounds=True), typ=F32)
            acc = b.fadd(acc, splat(b, bias, self.isa.vector))
        elif ep.bias == "col":
            acc = b.fadd(acc, self.vload(b.gep(self.bias, [col], source_etype=F32, inbounds=True),
                                         mask))
        if residual is not None:
            acc = b.fadd(acc, self.vload(residual, mask))
        if ep.activation is not None:
            acc = apply_activation(b, ep.activation, ep.params, acc)
        return acc


def _leftover_heights(mr: int) -> list[int]:
    """Tile heights for the fewer than MR rows left: halving, each used at most once."""
    heights: list[int] = []
    h = 1
    while h < mr:
        heights.insert(0, h)
        h *= 2
    return heights



_ALIGN = ir.Constant(ir.IntType(32), 4)




def emit_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value, lda: ir.Value,
              b_ptr: ir.Value, ldb: ir.Value, c: ir.Value, ldc: ir.Value, *,
              accumulate: bool = False, bias: ir.Value | None = None,
              residual: ir.Value | None = None, epilogue: Epilogue = PLAIN,
              layout: Layout = ROW_MAJOR) -> None:
    """Call the module's kernel from the current function (one thread). `residual` (when the
    epilogue adds one) is laid out like C, with C's row stride; `layout` says whether A or B
    are pre-packed (`pack_a`, `pack_b`)."""
    fn = gemm_function(k.module, k.target, epilogue, layout)
    null = ir.Constant(PTR, None)
    k.b.call(fn, [m, n, kk, a, lda, b_ptr, ldb, c, ldc, ir.Constant(I1, int(accumulate)),
                  bias if bias is not None else null, residual if residual is not None else null])


def split_blocks(k: Emitter, m: ir.Value, n: ir.Value, row_tile: int, column_tile: int,
                 min_row_tiles: int = MIN_ROW_TILES,
                 min_column_tiles: int = MIN_COLUMN_TILES) -> tuple[ir.Value, ...]:
    """How a product of M x N splits over the threads (every GEMM kernel's parallel entry):
    along the larger dimension, into blocks of whole tiles (row_tile rows or column_tile
    columns) of at least min_*_tiles each, as many as the threads that will run them share
    evenly (one block, the whole product, when the loop runs inline). Returns (by_rows,
    the largest block, count of blocks, the other dimension's extent, the tile); block t
    is `block_span(k, t, count, extent, tile)`."""
    b = k.b
    by_rows = b.icmp_signed(">=", m, n)
    extent = b.select(by_rows, m, n)
    tile = b.select(by_rows, k.i64(row_tile), k.i64(column_tile))
    tiles = k.floordiv(b.add(extent, b.sub(tile, k.i64(1))), tile)
    threads = k.parallel_threads()
    least = b.select(by_rows, k.i64(min_row_tiles), k.i64(min_column_tiles))
    per_thread = k.floordiv(tiles, b.mul(threads, least))
    per_thread = k.minimum("int64", k.maximum("int64", per_thread, k.i64(1)),
                           k.i64(BLOCKS_PER_THREAD))
    count = k.minimum("int64", b.mul(threads, per_thread), k.maximum("int64", tiles, k.i64(1)))
    block_tiles = k.floordiv(b.add(tiles, b.sub(count, k.i64(1))), count)
    block = b.mul(k.maximum("int64", block_tiles, k.i64(1)), tile)
    other = b.select(by_rows, n, m)
    return by_rows, block, count, other, tile


def block_span(k: Emitter, t: ir.Value, count: ir.Value, extent: ir.Value,
               tile: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(first row or column, size) of block t of `count` (`split_blocks`): whole tiles, as
    many in each block as they allow (counts differ by at most one). Ceiling-sized blocks
    left the last one short: 7 panels of columns (N = 196) made blocks of 128 and 68."""
    b = k.b
    tiles = k.floordiv(b.add(extent, b.sub(tile, k.i64(1))), tile)
    start = b.mul(k.floordiv(b.mul(t, tiles), count), tile)
    end = b.mul(k.floordiv(b.mul(b.add(t, k.i64(1)), tiles), count), tile)
    return start, b.sub(k.minimum("int64", end, extent), start)


def emit_parallel_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,
                       lda: ir.Value, b_ptr: ir.Value, ldb: ir.Value, c: ir.Value, ldc: ir.Value,
                       *, accumulate: bool = False, bias: ir.Value | None = None,
                       residual: ir.Value | None = None, epilogue: Epilogue = PLAIN,
                       layout: Layout = ROW_MAJOR) -> None:
    """The same product split over threads into blocks of rows (or of columns when M is small)."""
    isa = k.target.isa
    b = k.b
    # (a block of a pre-packed operand starts on one of its panels)
    by_rows, block, count, other, tile = split_blocks(
        k, m, n, PACK_ROWS if layout.packed_a else isa.mr, PACK_COLS if layout.packed_b else isa.nr)
    bias_v = bias if bias is not None else ir.Constant(PTR, None)
    res_v = residual if residual is not None else ir.Constant(PTR, None)
    carry = [m, n, kk, a, lda, b_ptr, ldb, c, ldc, bias_v, res_v, count, tile,
             b.zext(by_rows, I64)]
    with k.parallel_loop(count, cost=b.mul(b.mul(block, other), kk), name="gemm",
                         carry=carry) as t:
        (m_, n_, kk_, a_, lda_, b_, ldb_, c_, ldc_, bias_, res_, count_, tile_,
         rows_flag) = k.carried
        bb = k.b
        rows = bb.icmp_signed("!=", rows_flag, k.i64(0))
        start, size = block_span(k, t, count_, bb.select(rows, m_, n_), tile_)
        # rows block: A and C move down; columns block: B and C move right (and the bias
        # with them when it is per column)
        a_off = bb.select(rows, start if layout.a_columns else bb.mul(start, lda_), k.i64(0))
        b_off = bb.select(rows, k.i64(0), bb.mul(start, kk_) if layout.packed_b else start)
        col_off = bb.select(rows, k.i64(0), start)
        c_off = bb.select(rows, bb.mul(start, ldc_), col_off)
        bias_off = bb.select(rows, start, k.i64(0)) if epilogue.bias == "row" else col_off
        sub_bias = (bb.gep(bias_, [bias_off], source_etype=F32) if epilogue.bias != "none"
                    else bias_)
        emit_gemm(
            k, bb.select(rows, size, m_), bb.select(rows, n_, size), kk_,
            bb.gep(a_, [a_off], source_etype=F32), lda_, bb.gep(b_, [b_off], source_etype=F32),
            ldb_, bb.gep(c_, [c_off], source_etype=F32), ldc_, accumulate=accumulate,
            bias=sub_bias, epilogue=epilogue,
            residual=bb.gep(res_, [c_off], source_etype=F32) if epilogue.residual else None,
            layout=layout,
        )
