"""Matrix products with very few rows of activations, C[M, N] (+)= alpha * A[M, K] @ B, M <= 4:
batch-1 Linear layers and classifier heads.

Each weight is used M times, so the product is bound by reading B once from memory, which the
register-tiled GEMM (kernels/gemm.py) is not built for: its row tiles are mostly empty
and it walks B in cache blocks meant for reuse. This kernel streams B once, in order, keeping
every row's sums for a block of columns in vector registers, with several independent sets of
accumulators (K split into interleaved parts) so that the multiply-adds' latency does not
bound the loop. The parallel form splits the columns over the threads, so each core reads its
own part of B with its own memory bandwidth.

B is read in one of three layouts (`LAYOUTS`):

- "packed": `pack_b` panels of PACK_COLS columns, each k-major (a constant weight, see
  passes/pack_gemm_weights.py): one block of columns is a contiguous stream;
- "rows": row-major [K, N] with a row stride: the same walk, rows ldb apart;
- "transposed": B^T row-major [N, K] (a Gemm with transB whose weight is computed at run time):
  each output is a dot product of two contiguous rows, a few outputs at a time, their vector
  sums reduced at the end.

The epilogue is the GEMM kernel's (`Epilogue`): C = act(alpha * sum (+ C) + bias + residual).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from llvmlite import ir

from cuvil.compiler.kernels.activation import apply_activation
from cuvil.compiler.kernels.emitter import (
    I1,
    I64,
    PTR,
    Emitter,
    fmuladd_intrinsic,
    masked_intrinsic,
    splat,
)
from cuvil.compiler.kernels.gemm import PACK_COLS, PLAIN, Epilogue
from cuvil.compiler.kernels.objects import kernel_function
from cuvil.compiler.kernels.target import KernelTarget

F32 = ir.FloatType()
#: the most rows of A the kernel takes: each more row is one more set of accumulators
MAX_ROWS = 4
LAYOUTS = ("packed", "rows", "transposed")
#: columns per block of a parallel product (a multiple of PACK_COLS: blocks start on panels)
#: and blocks per thread (a few, so a thread slowed down by another process hands work on)
BLOCK_COLS = 2 * PACK_COLS
BLOCKS_PER_THREAD = 4
_ALIGN = ir.Constant(ir.IntType(32), 4)


def gemv_function(module: ir.Module, target: KernelTarget, rows: int, layout: str,
                  epilogue: Epilogue, alpha: float = 1.0) -> ir.Function:
    """`void gemv(N, K, A, lda, B, ldb, C, ldc, accumulate, bias, residual, j0, j1)`: columns
    j0 <= j < j1 of C[rows, N] (all i64 but pointers and the flag). j0 is a multiple of
    PACK_COLS for the "packed" layout. `bias` and `residual` are for the whole C (the residual
    laid out like C); `ldb` is not read for "packed" B."""
    assert 1 <= rows <= MAX_ROWS and layout in LAYOUTS
    name = (f"cuvil.gemv{rows}.{layout}.{epilogue.suffix}"
            + (f".a{struct.pack('<f', alpha).hex()}" if alpha != 1.0 else ""))

    def define(module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        fn.attributes.add("noinline")
        for i in (2, 4, 6, 9, 10):
            fn.args[i].add_attribute("noalias")
        _GemvWriter(module, fn, target, rows, layout, epilogue, alpha).write()

    return kernel_function(module, target, name, _GEMV_TYPE, define)


_GEMV_TYPE = ir.FunctionType(ir.VoidType(), [I64, I64, PTR, I64, PTR, I64, PTR, I64, I1, PTR, PTR,
                                             I64, I64])


class _GemvWriter:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget, rows: int,
                 layout: str, epilogue: Epilogue, alpha: float) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.rows, self.layout, self.epilogue, self.alpha = rows, layout, epilogue, alpha
        self.width = target.isa.vector
        self.vt = ir.VectorType(F32, self.width)
        # the accumulators may take half the register file (32 registers on AArch64 and
        # AVX-512, 16 on AVX2 and SSE); the rest hold B, broadcasts of A, addresses
        self.budget = target.vector_registers // 2
        (self.n, self.kk, self.a, self.lda, self.bm, self.ldb, self.c, self.ldc, self.acc,
         self.bias, self.residual, self.j0, self.j1) = fn.args

    def write(self) -> None:
        if self.layout == "transposed":
            self.dot_columns()
        else:
            self.axpy_columns()
        self.k.b.ret_void()

    # -- helpers ------------------------------------------------------------------------
    def accumulators(self, count: int, ty: ir.Type) -> list[ir.Value]:
        """Zeroed stack slots (promoted to registers by LLVM: loops carry them as phis)."""
        b = self.k.b
        slots = []
        with b.goto_entry_block():
            for _ in range(count):
                slots.append(b.alloca(ty))
        for s in slots:
            b.store(ir.Constant(ty, None), s)
        return slots

    def vload(self, p: ir.Value, mask: ir.Value | None) -> ir.Value:
        if mask is None:
            return self.k.b.load(p, typ=self.vt, align=4)
        return self.k.b.call(masked_intrinsic(self.k.module, "load", self.vt),
                             [p, _ALIGN, mask, ir.Constant(self.vt, None)])

    def vstore(self, x: ir.Value, p: ir.Value, mask: ir.Value | None) -> None:
        if mask is None:
            self.k.b.store(x, p, align=4)
        else:
            self.k.b.call(masked_intrinsic(self.k.module, "store", self.vt), [x, p, _ALIGN, mask])

    def lanes_below(self, count: ir.Value) -> ir.Value:
        """The mask of the lanes < count."""
        lanes = ir.Constant(ir.VectorType(I64, self.width), list(range(self.width)))
        return self.k.b.icmp_signed("<", lanes, splat(self.k.b, count, self.width))

    def at(self, base: ir.Value, offset: ir.Value) -> ir.Value:
        return self.k.b.gep(base, [offset], source_etype=F32, inbounds=True)

    def finish(self, total: ir.Value, r: int, col: ir.Value, mask: ir.Value | None) -> ir.Value:
        """The epilogue of C[r, col..] (a vector, or a scalar when `total` is one)."""
        k, ep = self.k, self.epilogue
        b = k.b
        vector = isinstance(total.type, ir.VectorType)

        def read(base: ir.Value, offset: ir.Value) -> ir.Value:
            p = self.at(base, offset)
            return self.vload(p, mask) if vector else b.load(p, typ=F32)

        def widen(x: ir.Value) -> ir.Value:
            return splat(b, x, self.width) if vector else x

        if self.alpha != 1.0:
            total = b.fmul(total, widen(ir.Constant(F32, self.alpha)))
        c_off = b.add(b.mul(k.i64(r), self.ldc), col)
        # C's old values are read (and dropped) even when not accumulating: it is C
        total = b.fadd(total, b.select(self.acc, read(self.c, c_off),
                                       ir.Constant(total.type, None)))
        if ep.bias == "col":
            total = b.fadd(total, read(self.bias, col))
        elif ep.bias == "row":
            total = b.fadd(total, widen(b.load(self.at(self.bias, k.i64(r)), typ=F32)))
        if ep.residual:
            total = b.fadd(total, read(self.residual, c_off))
        if ep.activation is not None:
            total = apply_activation(b, ep.activation, ep.params, total)
        return total

    # -- "packed" and "rows": sums of rows of B scaled by A's values ---------------------
    def axpy_shape(self) -> tuple[int, int]:
        """(vectors per block of columns, interleaved parts of K) within the register budget."""
        nvec = PACK_COLS // self.width
        while self.rows * nvec > self.budget and nvec > 1:
            nvec //= 2
        parts = max(1, min(4, self.budget // (self.rows * nvec)))
        return nvec, parts

    def axpy_columns(self) -> None:
        """Columns j0..j1 in blocks of nvec vectors; the columns left, one narrower block, its
        last vector masked."""
        k = self.k
        b = k.b
        nvec, _ = self.axpy_shape()
        cols = nvec * self.width
        span = b.sub(self.j1, self.j0)
        full = b.add(self.j0, b.mul(b.udiv(span, k.i64(cols)), k.i64(cols)))
        with k.loop(full, start=self.j0, step=cols, name="j") as j:
            self.axpy_block(j, nvec, None)
        rem = b.sub(self.j1, full)
        for nv in range(1, nvec + 1):
            lo, hi = (nv - 1) * self.width, nv * self.width
            with k.if_then(b.and_(b.icmp_signed(">", rem, k.i64(lo)),
                                  b.icmp_signed("<=", rem, k.i64(hi)))):
                self.axpy_block(full, nv, self.lanes_below(b.sub(rem, k.i64(lo))))

    def b_block(self, j: ir.Value) -> tuple[ir.Value, ir.Value]:
        """B[0, j..] and the stride from one k to the next."""
        k = self.k
        b = k.b
        if self.layout == "rows":
            return self.at(self.bm, j), self.ldb
        base = b.mul(b.udiv(j, k.i64(PACK_COLS)), k.i64(PACK_COLS))
        width = k.minimum("int64", b.sub(self.n, base), k.i64(PACK_COLS))
        return self.at(self.bm, b.add(b.mul(base, self.kk), b.sub(j, base))), width

    def axpy_block(self, j: ir.Value, nvec: int, mask: ir.Value | None) -> None:
        k = self.k
        b = k.b
        _, parts = self.axpy_shape()
        rows, w = self.rows, self.width
        bsrc, stride = self.b_block(j)
        accs = self.accumulators(parts * rows * nvec, self.vt)
        fma = fmuladd_intrinsic(k.module, self.vt)

        def step(p: ir.Value, part: int) -> None:
            row = self.at(bsrc, b.mul(p, stride))
            bvals = [self.vload(self.at(row, k.i64(v * w)), mask if v == nvec - 1 else None)
                     for v in range(nvec)]
            for r in range(rows):
                a = b.load(self.at(self.a, b.add(b.mul(k.i64(r), self.lda), p)), typ=F32)
                a_lanes = splat(b, a, w)
                for v in range(nvec):
                    slot = accs[(part * rows + r) * nvec + v]
                    b.store(b.call(fma, [a_lanes, bvals[v], b.load(slot)]), slot)

        main = b.mul(b.udiv(self.kk, k.i64(parts)), k.i64(parts))
        with k.loop(main, step=parts, name="p") as p:
            for part in range(parts):
                step(b.add(p, k.i64(part)), part)
        with k.loop(self.kk, start=main, name="pt") as p:
            step(p, 0)
        for r in range(rows):
            for v in range(nvec):
                total = b.load(accs[r * nvec + v])
                for part in range(1, parts):
                    total = b.fadd(total, b.load(accs[(part * rows + r) * nvec + v]))
                col = b.add(j, k.i64(v * w))
                m = mask if v == nvec - 1 else None
                self.vstore(self.finish(total, r, col, m),
                            self.at(self.c, b.add(b.mul(k.i64(r), self.ldc), col)), m)

    # -- "transposed": dot products of rows of A and rows of B^T -------------------------
    def dot_shape(self) -> tuple[int, int]:
        """(columns per block, interleaved vector steps of K) within the register budget."""
        cols = max(1, min(4, self.budget // self.rows))
        parts = max(1, min(2, self.budget // (self.rows * cols)))
        return cols, parts

    def dot_columns(self) -> None:
        k = self.k
        b = k.b
        cols, _ = self.dot_shape()
        span = b.sub(self.j1, self.j0)
        full = b.add(self.j0, b.mul(b.udiv(span, k.i64(cols)), k.i64(cols)))
        with k.loop(full, start=self.j0, step=cols, name="j") as j:
            self.dot_block(j, cols)
        with k.loop(self.j1, start=full, name="jt") as j:
            self.dot_block(j, 1)

    def dot_block(self, j: ir.Value, cols: int) -> None:
        k = self.k
        b = k.b
        _, parts = self.dot_shape()
        rows, w = self.rows, self.width
        accs = self.accumulators(parts * rows * cols, self.vt)
        fma = fmuladd_intrinsic(k.module, self.vt)
        b_rows = [self.at(self.bm, b.mul(b.add(j, k.i64(c)), self.ldb)) for c in range(cols)]

        def step(p: ir.Value, part: int, mask: ir.Value | None) -> None:
            bvals = [self.vload(self.at(br, p), mask) for br in b_rows]
            for r in range(rows):
                x = self.vload(self.at(self.a, b.add(b.mul(k.i64(r), self.lda), p)), mask)
                for c in range(cols):
                    slot = accs[(part * rows + r) * cols + c]
                    b.store(b.call(fma, [x, bvals[c], b.load(slot)]), slot)

        chunk = parts * w
        main = b.mul(b.udiv(self.kk, k.i64(chunk)), k.i64(chunk))
        with k.loop(main, step=chunk, name="p") as p:
            for part in range(parts):
                step(b.add(p, k.i64(part * w)), part, None)
        whole = b.mul(b.udiv(self.kk, k.i64(w)), k.i64(w))
        with k.loop(whole, start=main, step=w, name="pv") as p:
            step(p, 0, None)
        with k.if_then(b.icmp_signed("<", whole, self.kk)):
            step(whole, 0, self.lanes_below(b.sub(self.kk, whole)))
        for r in range(rows):
            for c in range(cols):
                total = b.load(accs[r * cols + c])
                for part in range(1, parts):
                    total = b.fadd(total, b.load(accs[(part * rows + r) * cols + c]))
                col = b.add(j, k.i64(c))
                out = self.finish(_horizontal_sum(b, total), r, col, None)
                b.store(out, self.at(self.c, b.add(b.mul(k.i64(r), self.ldc), col)))


def _horizontal_sum(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """The sum of a vector's lanes: halves added until one lane is left."""
    width = x.type.count
    while width > 1:
        half = width // 2
        lo = b.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                list(range(half))))
        hi = b.shuffle_vector(x, x, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                list(range(half, width))))
        x, width = b.fadd(lo, hi), half
    return b.extract_element(x, ir.Constant(ir.IntType(32), 0))


def emit_parallel_gemv(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,  # noqa: PLR0913  (the kernel's C arguments, passed through)
                       lda: ir.Value, b_ptr: ir.Value, ldb: ir.Value, c: ir.Value, ldc: ir.Value,
                       *, layout: str, accumulate: bool = False, bias: ir.Value | None = None,
                       residual: ir.Value | None = None, epilogue: Epilogue = PLAIN,
                       alpha: float = 1.0) -> None:
    """C[m, n] (+)= alpha * A @ B for 1 <= m <= MAX_ROWS (checked by the caller), the columns
    split over the threads in blocks of BLOCK_COLS."""
    b = k.b
    blocks_needed = k.floordiv(b.add(n, k.i64(BLOCK_COLS - 1)), k.i64(BLOCK_COLS))
    wanted = b.mul(k.parallel_threads(), k.i64(BLOCKS_PER_THREAD))
    blocks = k.maximum("int64", k.minimum("int64", wanted, blocks_needed), k.i64(1))
    per_block = b.mul(k.floordiv(b.add(blocks_needed, b.sub(blocks, k.i64(1))), blocks),
                      k.i64(BLOCK_COLS))
    count = k.floordiv(b.add(n, b.sub(per_block, k.i64(1))), per_block)
    null = ir.Constant(PTR, None)
    carry = [m, n, kk, a, lda, b_ptr, ldb, c, ldc, bias if bias is not None else null,
             residual if residual is not None else null, per_block]
    with k.parallel_loop(count, cost=b.mul(b.mul(per_block, kk), m), name="gemv",
                         carry=carry) as t:
        m_, n_, kk_, a_, lda_, b_, ldb_, c_, ldc_, bias_, res_, per_block_ = k.carried
        bb = k.b
        j0 = bb.mul(t, per_block_)
        j1 = k.minimum("int64", bb.add(j0, per_block_), n_)
        args = [n_, kk_, a_, lda_, b_, ldb_, c_, ldc_, ir.Constant(I1, int(accumulate)), bias_,
                res_, j0, j1]
        static = [int(m.constant)] if isinstance(m, ir.Constant) else None
        _by_rows(k, m_, static, lambda rows: bb.call(
            gemv_function(k.module, k.target, rows, layout, epilogue, alpha), args))


def _by_rows(k: Emitter, m: ir.Value, static: list[int] | None,
             call: Callable[[int], object]) -> None:
    """call(rows) for the function of m's row count (only that one when it is `static`)."""
    if static is not None:
        call(static[0])
        return
    for rows in range(1, MAX_ROWS + 1):
        with k.if_then(k.b.icmp_signed("==", m, k.i64(rows))):
            call(rows)
