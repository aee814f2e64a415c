"""The recurrent product of one time step, C[m, n] = A[m, kk] @ B[kk, n], for few rows.

A recurrent step multiplies the batch rows of the state (m is the batch: often 1) by R^T,
which is larger than L1 and read once per step. The shared GEMM kernel's tiles are made for
many rows: with one row, a tile has two accumulators and waits on their latency. This
kernel reads B in panels packed at compile time (`pack_panels`): PANEL consecutive columns
of every row of B, stored one panel after another, so that the whole of B is one forward
stream. A tile keeps up to 4 rows x a chunk of a panel's columns in vector registers over
the whole K loop, with enough independent accumulators (8 or more) to cover the FMA latency.
The panel width does not depend on the vector width, so the one packed constant serves every
CPU variant of a library.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from cuvil.compiler.kernels.emitter import I64, PTR, REDUCE_FLAGS, Emitter, splat
from cuvil.compiler.kernels.target import KernelTarget

__all__ = ["PANEL", "emit_small_gemm", "pack_panels", "packed_rows"]

#: columns per packed panel (256 bytes of each row: four cache lines)
PANEL = 64
F32 = ir.FloatType()
#: rows per tile, largest first
_ROW_TILES = (4, 2, 1)


def packed_rows(kk: int, n: int) -> int:
    """Rows of the [rows, PANEL] array `pack_panels` makes of a [kk, n] matrix."""
    return -(-n // PANEL) * kk


def pack_panels(bt: np.ndarray) -> np.ndarray:
    """[kk, n] -> [packed_rows(kk, n), PANEL]: panel p holds columns p*PANEL.. of every row,
    the columns past n zero."""
    kk, n = bt.shape
    panels = -(-n // PANEL)
    padded = np.zeros((kk, panels * PANEL), dtype=bt.dtype)
    padded[:, :n] = bt
    return np.ascontiguousarray(padded.reshape(kk, panels, PANEL).transpose(1, 0, 2)
                                .reshape(panels * kk, PANEL))


def emit_small_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,
                    lda: ir.Value, panels: ir.Value, c: ir.Value, ldc: ir.Value) -> None:
    """C[m, n] = A[m, kk] @ B, B packed by `pack_panels` (float32, one thread)."""
    k.b.call(_function(k), [m, n, kk, a, lda, panels, c, ldc])


def _function(caller: Emitter) -> ir.Function:
    module = caller.module
    name = "cuvil.recurrent_gemm.float32"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64, I64, I64, PTR, I64, PTR, PTR,
                                                            I64]), name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # one copy shared by every recurrent node
    for i in (3, 5, 6):
        fn.args[i].add_attribute("noalias")
    _Writer(module, fn, caller.target).write()
    return fn


class _Writer:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.m, self.n, self.kk, self.a, self.lda, self.bp, self.c, self.ldc = fn.args
        self.width = target.isa.vector
        self.vt = ir.VectorType(F32, self.width)
        # accumulators a tile may hold: most of the register file (32 registers with AVX-512
        # and NEON, 16 otherwise), leaving room for the row of B and the broadcasts
        self.budget = target.vector_registers // 2
        self.per_panel = PANEL // self.width  # vectors per panel row
        k = self.k
        b = k.b
        # the last tile's results go through this buffer when its panel passes n
        self.spill = b.alloca(ir.ArrayType(F32, max(_ROW_TILES) * PANEL), name="spill")
        self.spill.align = 64
        self.spill.type = PTR

    def vectors(self, rows: int) -> int:
        """Vectors of a panel row a tile of `rows` rows covers (a divisor of the panel's)."""
        v = self.per_panel
        while v > 1 and rows * v > self.budget:
            v //= 2
        return v

    def write(self) -> None:
        k = self.k
        b = k.b
        count = k.floordiv(b.add(self.n, k.i64(PANEL - 1)), k.i64(PANEL))
        with k.loop(count, name="panel") as p:
            j0 = b.mul(p, k.i64(PANEL))
            bpan = b.gep(self.bp, [b.mul(j0, self.kk)], source_etype=F32, inbounds=True)
            full = b.icmp_signed("<=", b.add(j0, k.i64(PANEL)), self.n)
            rows4 = b.mul(k.floordiv(self.m, k.i64(4)), k.i64(4))
            with k.loop(rows4, step=4, name="i4") as i:
                self.tiles(bpan, i, j0, 4, full)
            start = rows4
            for rows in _ROW_TILES[1:]:
                fits = b.icmp_signed(">=", b.sub(self.m, start), k.i64(rows))
                with k.if_then(fits):
                    self.tiles(bpan, start, j0, rows, full)
                start = b.add(start, b.select(fits, k.i64(rows), k.i64(0)))
        b.ret_void()

    def tiles(self, bpan: ir.Value, i0: ir.Value, j0: ir.Value, rows: int,
              full: ir.Value) -> None:
        """Rows i0..i0+rows of the panel at column j0, a chunk of columns at a time."""
        nv = self.vectors(rows)
        b = self.k.b
        with b.if_else(full) as (whole, partial):
            with whole:
                for chunk in range(self.per_panel // nv):
                    accs = self.tile(bpan, i0, rows, chunk * nv, nv)
                    for r in range(rows):
                        for v in range(nv):
                            b.store(accs[r][v], self.c_ptr(i0, r, j0, (chunk * nv + v) * self.width),
                                    align=4)
            with partial:
                self.partial(bpan, i0, j0, rows, nv)

    def partial(self, bpan: ir.Value, i0: ir.Value, j0: ir.Value, rows: int, nv: int) -> None:
        """The last panel: sums into `spill`, then the columns before n copied into C."""
        k = self.k
        b = k.b
        for chunk in range(self.per_panel // nv):
            accs = self.tile(bpan, i0, rows, chunk * nv, nv)
            for r in range(rows):
                for v in range(nv):
                    off = r * PANEL + (chunk * nv + v) * self.width
                    b.store(accs[r][v], b.gep(self.spill, [k.i64(off)], source_etype=F32), align=4)
        left = b.sub(self.n, j0)
        for r in range(rows):
            with k.loop(left, name="tail") as j:
                x = b.load(b.gep(self.spill, [b.add(j, k.i64(r * PANEL))], source_etype=F32),
                           typ=F32)
                b.store(x, b.gep(self.c_ptr(i0, r, j0, 0), [j], source_etype=F32))

    def c_ptr(self, i0: ir.Value, r: int, j0: ir.Value, col: int) -> ir.Value:
        b = self.k.b
        row = b.add(i0, self.k.i64(r))
        return b.gep(self.c, [b.add(b.mul(row, self.ldc), b.add(j0, self.k.i64(col)))],
                     source_etype=F32, inbounds=True)

    def tile(self, bpan: ir.Value, i0: ir.Value, rows: int, v0: int,
             nv: int) -> list[list[ir.Value]]:
        """Sums of rows i0.. over K for vectors v0..v0+nv of the panel (in registers)."""
        k = self.k
        b = k.b
        zero = ir.Constant(self.vt, None)
        slots = []
        with b.goto_entry_block():
            if b.block.terminator is not None:
                b.position_before(b.block.terminator)
            for _ in range(rows * nv):
                slots.append(b.alloca(self.vt))
        for s in slots:
            b.store(zero, s)
        arows = [b.gep(self.a, [b.mul(b.add(i0, k.i64(r)), self.lda)], source_etype=F32,
                       inbounds=True) for r in range(rows)]
        with k.loop(self.kk, name="kk") as p:
            brow = b.gep(bpan, [b.add(b.mul(p, k.i64(PANEL)), k.i64(v0 * self.width))],
                         source_etype=F32, inbounds=True)
            bvals = [b.load(b.gep(brow, [k.i64(v * self.width)], source_etype=F32, inbounds=True),
                            typ=self.vt, align=4) for v in range(nv)]
            for r in range(rows):
                x = b.load(b.gep(arows[r], [p], source_etype=F32, inbounds=True), typ=F32)
                splat = self.splat(x)
                for v in range(nv):
                    s = slots[r * nv + v]
                    prod = b.fmul(splat, bvals[v])
                    prod.flags.extend(REDUCE_FLAGS)
                    acc = b.fadd(b.load(s, typ=self.vt), prod)
                    acc.flags.extend(REDUCE_FLAGS)
                    b.store(acc, s)
        return [[b.load(slots[r * nv + v], typ=self.vt) for v in range(nv)] for r in range(rows)]

    def splat(self, x: ir.Value) -> ir.Value:
        return splat(self.k.b, x, self.width)
