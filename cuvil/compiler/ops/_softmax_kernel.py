"""Softmax of one contiguous float32 row in explicit vector registers.

The generic softmax loops (`normalization._softmax`) leave vectorization to LLVM, which picks
the target's preferred width (256 bits on AVX-512 CPUs), lowers `llvm.maximum` to a
several-instruction sequence and runs the full-range exp. A row here takes three passes over
vectors of the ISA's full width (`KernelTarget.isa`): the max (compare and select: one `vmaxps`),
e = exp(x - max) stored into y while its sum accumulates (`vecmath.exp_nonpositive`: x - max
is never positive), then y * (1 / sum). The last n mod width elements take the same steps in
scalar code. NaN anywhere in a row makes the whole row NaN (its exp poisons the sum), as a
NaN max would.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import I64, PTR, REDUCE_FLAGS, Emitter, splat
from cuvil.compiler.kernels.target import KernelTarget

__all__ = ["emit_softmax_row"]

F32 = ir.FloatType()
I32 = ir.IntType(32)


def emit_softmax_row(k: Emitter, x: ir.Value, y: ir.Value, n: ir.Value) -> None:
    """y[:n] = softmax(x[:n]) for float32 pointers (y may be x)."""
    k.b.call(_function(k), [x, y, n])


def _function(caller: Emitter) -> ir.Function:
    module = caller.module
    name = "cuvil.softmax_row.float32"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64]), name)
    fn.linkage = "internal"
    _Writer(module, fn, caller.target).write()
    return fn


class _Writer:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.x, self.y, self.n = fn.args
        self.width = target.isa.vector
        self.vt = ir.VectorType(F32, self.width)

    def splat(self, v: ir.Value) -> ir.Value:
        return splat(self.k.b, v, self.width)

    def slot(self, ty: ir.Type, init: ir.Value) -> ir.Value:
        b = self.k.b
        with b.goto_entry_block():
            s = b.alloca(ty)
        b.store(init, s)
        return s

    def ptr(self, base: ir.Value, i: ir.Value) -> ir.Value:
        return self.k.b.gep(base, [i], source_etype=F32, inbounds=True)

    def passes(self, vector: Callable[[ir.Value], object],
               scalar: Callable[[ir.Value], object]) -> None:
        """vector(i) at the start i of each whole vector of the row, then scalar(i) for each
        element left."""
        k = self.k
        with k.loop(self.full, step=self.width, name="v") as i:
            vector(i)
        with k.loop(self.n, start=self.full, name="s") as i:
            scalar(i)

    def write(self) -> None:
        k = self.k
        b = k.b
        w = self.width
        self.full = b.mul(k.floordiv(self.n, k.i64(w)), k.i64(w))

        def larger(a: ir.Value, c: ir.Value) -> ir.Value:
            # x86's max instruction exactly: the second operand when either is NaN
            return b.select(b.fcmp_ordered(">", a, c), a, c)

        def add(a: ir.Value, c: ir.Value) -> ir.Value:
            s = b.fadd(a, c)
            s.flags.extend(REDUCE_FLAGS)
            return s

        def vload(base: ir.Value, i: ir.Value) -> ir.Value:
            return b.load(self.ptr(base, i), typ=self.vt, align=4)

        def sload(base: ir.Value, i: ir.Value) -> ir.Value:
            return b.load(self.ptr(base, i), typ=F32)

        low = ir.Constant(F32, float("-inf"))
        vmax, top = self.slot(self.vt, self.splat(low)), self.slot(F32, low)
        self.passes(lambda i: b.store(larger(vload(self.x, i), b.load(vmax)), vmax),
                    lambda i: b.store(larger(sload(self.x, i), b.load(top)), top))
        mx = larger(self.k.reduce_lanes(b.load(vmax), larger), b.load(top))
        mv = self.splat(mx)
        vsum = self.slot(self.vt, ir.Constant(self.vt, None))
        total = self.slot(F32, ir.Constant(F32, 0.0))

        def vexp(i: ir.Value) -> None:
            e = vecmath.exp_nonpositive(b, b.fsub(vload(self.x, i), mv))
            b.store(e, self.ptr(self.y, i), align=4)
            b.store(add(b.load(vsum), e), vsum)

        def sexp(i: ir.Value) -> None:
            e = vecmath.exp_nonpositive(b, b.fsub(sload(self.x, i), mx))
            b.store(e, self.ptr(self.y, i))
            b.store(add(b.load(total), e), total)

        self.passes(vexp, sexp)
        inv = b.fdiv(ir.Constant(F32, 1.0), add(self.k.reduce_lanes(b.load(vsum), add), b.load(total)))
        iv = self.splat(inv)
        self.passes(lambda i: b.store(b.fmul(vload(self.y, i), iv), self.ptr(self.y, i), align=4),
                    lambda i: b.store(b.fmul(sload(self.y, i), inv), self.ptr(self.y, i)))
        b.ret_void()
