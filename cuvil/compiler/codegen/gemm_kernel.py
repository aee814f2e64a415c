"""A register-blocked float32 matrix product, C (+)= A @ B, shared by every op that needs one.

One internal function per module and epilogue, taking sizes and strides at run time: ops call
it instead of generating their own loop nests, so a model with fifty convolutions compiles
one kernel, not fifty. The kernel walks C in tiles of MR rows x NR columns; each tile keeps
its MR x NR sums in vector registers for the whole K loop, loading one NR-wide row of B and
MR scalars of A per step (broadcast, fused multiply-add). Rows and columns left over at the
edges get smaller tiles, down to scalars.

Tile sizes follow the target's vector registers (`isa_of`): 16 registers of 8 floats (AVX2)
hold a 6 x 16 tile; 16 of 4 floats (SSE) a 4 x 8 one; AArch64's 32 NEON registers an 8 x 8.
The epilogue adds a bias per row (convolution channels) or per column (Gemm), and can apply
ReLU, while the tile is still in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from cuvil.compiler.codegen.emitter import I1, I64, PTR, Emitter

F32 = ir.FloatType()


@dataclass(frozen=True)
class Isa:
    vector: int  # floats per vector register
    mr: int  # rows per tile
    nv: int  # vectors per tile row (NR = nv * vector)

    @property
    def nr(self) -> int:
        return self.vector * self.nv


def isa_of(module: ir.Module) -> Isa:
    """Tile shape for the module's target, from the triple and the CPU features it was given."""
    features = getattr(module, "cuvil_features", "")
    if module.triple.startswith(("aarch64", "arm64")):
        return Isa(vector=4, mr=8, nv=2)
    if "+avx512f" in features:
        return Isa(vector=16, mr=8, nv=2)
    if "+avx2" in features or "+avx" in features:
        return Isa(vector=8, mr=6, nv=2)
    return Isa(vector=4, mr=4, nv=2)


@dataclass(frozen=True)
class Epilogue:
    bias: str = "none"  # "none" | "row" (one per row of C) | "col" (one per column)
    relu: bool = False

    @property
    def suffix(self) -> str:
        return f"{self.bias}{'_relu' if self.relu else ''}"


#: no bias, no activation
PLAIN = Epilogue()


def gemm_function(module: ir.Module, epilogue: Epilogue = PLAIN) -> ir.Function:
    """`void gemm(M, N, K, A, lda, B, ldb, C, ldc, accumulate, bias)` (all i64 but pointers).

    C[i, j] = (accumulate ? C[i, j] : 0) + sum_k A[i, k] * B[k, j] (+ bias) (then ReLU).
    Strides are in elements; rows of B and C must be contiguous (unit column stride).
    """
    name = f"cuvil.gemm.{epilogue.suffix}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [I64, I64, I64, PTR, I64, PTR, I64,
                                                            PTR, I64, I1, PTR]), name)
    fn.linkage = "internal"
    # one shared copy: inlined into each caller, LLVM would specialize and unroll it for every
    # call's constant sizes, multiplying compile time and code size for no speed
    fn.attributes.add("noinline")
    for i in (3, 5, 7, 10):
        fn.args[i].add_attribute("noalias")
    _GemmWriter(module, fn, isa_of(module), epilogue).write()
    return fn


class _GemmWriter:
    def __init__(self, module: ir.Module, fn: ir.Function, isa: Isa, epilogue: Epilogue) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {})
        self.isa = isa
        self.epilogue = epilogue
        (self.m, self.n, self.kk, self.a, self.lda, self.bm, self.ldb, self.c, self.ldc,
         self.acc, self.bias) = fn.args

    def write(self) -> None:
        k, isa = self.k, self.isa
        b = k.b
        nr = isa.nr
        # full-width column panels, then one-vector panels, then single columns
        n_full = b.mul(k.floordiv(self.n, k.i64(nr)), k.i64(nr))
        with k.loop(n_full, step=nr, name="j") as j:
            self.rows(j, isa.nv)
        n_vec = b.add(n_full, b.mul(k.floordiv(b.sub(self.n, n_full), k.i64(isa.vector)),
                                    k.i64(isa.vector)))
        with k.loop(n_vec, start=n_full, step=isa.vector, name="jv") as j:
            self.rows(j, 1)
        with k.loop(self.n, start=n_vec, name="js") as j:
            self.rows(j, 0)
        b.ret_void()

    def rows(self, j: ir.Value, nv: int) -> None:
        """All rows of the column panel at j: full MR-row tiles, then the leftover rows."""
        k, mr = self.k, self.isa.mr
        b = k.b
        m_full = b.mul(k.floordiv(self.m, k.i64(mr)), k.i64(mr))
        with k.loop(m_full, step=mr, name="i") as i:
            self.tile(i, j, mr, nv)
        # leftover rows one at a time (a 1-row tile still uses full vectors)
        with k.loop(self.m, start=m_full, name="ir") as i:
            self.tile(i, j, 1, nv)

    def tile(self, i0: ir.Value, j0: ir.Value, rows: int, nv: int) -> None:
        """C[i0:i0+rows, j0:j0+width] where width is nv vectors (nv=0: one scalar column)."""
        k = self.k
        b = k.b
        width = self.isa.vector if nv else 1
        vt = ir.VectorType(F32, width) if nv else F32
        lanes = max(nv, 1)

        def c_ptr(r: int, v: int) -> ir.Value:
            row = b.add(i0, k.i64(r))
            off = b.add(b.mul(row, self.ldc), b.add(j0, k.i64(v * width)))
            return b.gep(self.c, [off], source_etype=F32, inbounds=True)

        def vload(p: ir.Value) -> ir.Value:
            return b.load(p, typ=vt, align=4)

        zero = ir.Constant(vt, None) if nv else ir.Constant(F32, 0.0)
        init = []
        for r in range(rows):
            for v in range(lanes):
                init.append(b.select(self.acc, vload(c_ptr(r, v)), zero))
        pre = b.block
        head = k.function.append_basic_block("kk.head")
        body = k.function.append_basic_block("kk.body")
        done = k.function.append_basic_block("kk.done")
        b.branch(head)
        b.position_at_end(head)
        p = b.phi(I64, name="kk")
        p.add_incoming(k.i64(0), pre)
        accs = []
        for x in init:
            phi = b.phi(vt)
            phi.add_incoming(x, pre)
            accs.append(phi)
        b.cbranch(b.icmp_signed("<", p, self.kk), body, done)
        b.position_at_end(body)
        brow = b.add(b.mul(p, self.ldb), j0)
        bvals = [vload(b.gep(self.bm, [b.add(brow, k.i64(v * width))], source_etype=F32,
                             inbounds=True)) for v in range(lanes)]
        fma = _fmuladd(k.module, vt)
        new = []
        for r in range(rows):
            a_off = b.add(b.mul(b.add(i0, k.i64(r)), self.lda), p)
            a = b.load(b.gep(self.a, [a_off], source_etype=F32, inbounds=True), typ=F32)
            splat = _splat(b, a, width) if nv else a
            for v in range(lanes):
                new.append(b.call(fma, [splat, bvals[v], accs[r * lanes + v]]))
        nxt = b.add(p, k.i64(1))
        latch = b.block
        b.branch(head)
        p.add_incoming(nxt, latch)
        for phi, x in zip(accs, new):
            phi.add_incoming(x, latch)
        b.position_at_end(done)
        for r in range(rows):
            for v in range(lanes):
                out = self.finish(accs[r * lanes + v], b.add(i0, k.i64(r)),
                                  b.add(j0, k.i64(v * width)), vt, width, nv)
                b.store(out, c_ptr(r, v), align=4)

    def finish(self, acc: ir.Value, row: ir.Value, col: ir.Value, vt: ir.Type, width: int,
               nv: int) -> ir.Value:
        k, ep = self.k, self.epilogue
        b = k.b
        if ep.bias == "row":
            bias = b.load(b.gep(self.bias, [row], source_etype=F32, inbounds=True), typ=F32)
            acc = b.fadd(acc, _splat(b, bias, width) if nv else bias)
        elif ep.bias == "col":
            p = b.gep(self.bias, [col], source_etype=F32, inbounds=True)
            acc = b.fadd(acc, b.load(p, typ=vt, align=4))
        if ep.relu:
            zero = ir.Constant(vt, None) if nv else ir.Constant(F32, 0.0)
            acc = b.select(b.fcmp_ordered("<", acc, zero), zero, acc)
        return acc


def _fmuladd(module: ir.Module, ty: ir.Type) -> ir.Function:
    # llvmlite's declare_intrinsic does not name vector overloads; declare it by hand
    name = f"llvm.fmuladd.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fmuladd.f32"
    try:
        return module.get_global(name)
    except KeyError:
        return ir.Function(module, ir.FunctionType(ty, [ty, ty, ty]), name)


def _splat(b: ir.IRBuilder, x: ir.Value, width: int) -> ir.Value:
    vt = ir.VectorType(F32, width)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))


def emit_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value, lda: ir.Value,
              b_ptr: ir.Value, ldb: ir.Value, c: ir.Value, ldc: ir.Value, *,
              accumulate: bool = False, bias: ir.Value | None = None,
              epilogue: Epilogue = PLAIN) -> None:
    """Call the module's kernel from the current function (one thread)."""
    fn = gemm_function(k.module, epilogue)
    k.b.call(fn, [m, n, kk, a, lda, b_ptr, ldb, c, ldc, ir.Constant(I1, int(accumulate)),
                  bias if bias is not None else ir.Constant(PTR, None)])


def emit_parallel_gemm(k: Emitter, m: ir.Value, n: ir.Value, kk: ir.Value, a: ir.Value,
                       lda: ir.Value, b_ptr: ir.Value, ldb: ir.Value, c: ir.Value, ldc: ir.Value,
                       *, accumulate: bool = False, bias: ir.Value | None = None,
                       epilogue: Epilogue = PLAIN) -> None:
    """The same product split over threads into blocks of rows (or of columns when M is small)."""
    isa = isa_of(k.module)
    b = k.b
    cost = b.mul(kk, k.i64(1))
    # split the larger dimension into blocks of whole tiles
    by_rows = b.icmp_signed(">=", m, b.mul(n, k.i64(1)))
    block = b.select(by_rows, k.i64(isa.mr * 4), k.i64(isa.nr * 4))
    extent = b.select(by_rows, m, n)
    count = k.floordiv(b.add(extent, b.sub(block, k.i64(1))), block)
    other = b.select(by_rows, n, m)
    bias_v = bias if bias is not None else ir.Constant(PTR, None)
    carry = [m, n, kk, a, lda, b_ptr, ldb, c, ldc, bias_v, block, b.zext(by_rows, I64)]
    with k.parallel_loop(count, cost=b.mul(b.mul(block, other), cost), name="gemm",
                         carry=carry) as t:
        (m_, n_, kk_, a_, lda_, b_, ldb_, c_, ldc_, bias_, block_, rows_flag) = k.carried
        bb = k.b
        start = bb.mul(t, block_)
        rows = bb.icmp_signed("!=", rows_flag, k.i64(0))
        extent_ = bb.select(rows, m_, n_)
        size = bb.sub(extent_, start)
        size = bb.select(bb.icmp_signed("<", size, block_), size, block_)
        # rows block: A and C move down; columns block: B and C move right (and the bias
        # with them when it is per column)
        a_off = bb.select(rows, bb.mul(start, lda_), k.i64(0))
        b_off = bb.select(rows, k.i64(0), start)
        c_off = bb.select(rows, bb.mul(start, ldc_), start)
        bias_off = bb.select(rows, start, k.i64(0)) if epilogue.bias == "row" else b_off
        sub_bias = (bb.gep(bias_, [bias_off], source_etype=F32) if epilogue.bias != "none"
                    else bias_)
        emit_gemm(
            k, bb.select(rows, size, m_), bb.select(rows, n_, size), kk_,
            bb.gep(a_, [a_off], source_etype=F32), lda_, bb.gep(b_, [b_off], source_etype=F32),
            ldb_, bb.gep(c_, [c_off], source_etype=F32), ldc_, accumulate=accumulate,
            bias=sub_bias, epilogue=epilogue,
        )
