"""DynamicQuantizeLinear of a contiguous float32 tensor in explicit vector registers.

Two passes over vectors of the ISA's full float width (`KernelTarget.isa`): the range [min(x, 0),
max(x, 0)] (compare and select, one vminps/vmaxps per vector; NaN is skipped, as the scalar
rule does), then q = saturate(round_half_even(x / scale) + zero) into uint8. The scale and
zero point are formed as onnxruntime forms them: scale = (max - min) / 255 (1 / 255 for an
all-zero input), zero = saturate(round(0 - min / scale)). The division, not a product with
the reciprocal, keeps the bytes those of onnxruntime's kernel. The last n mod width elements
take the same steps on one-lane vectors.
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from cuvil.compiler.kernels.emitter import I8, I32, I64, PTR, Emitter, splat
from cuvil.compiler.kernels.target import KernelTarget

__all__ = ["emit_dynamic_quantize"]

F32 = ir.FloatType()


def emit_dynamic_quantize(k: Emitter, x: ir.Value, n: ir.Value, q: ir.Value, scale: ir.Value,
                          zero: ir.Value) -> None:
    """q[:n] (uint8) = x[:n] (float32) quantized; its scale (a float) stored at `scale`, its
    zero point (a byte) at `zero`."""
    k.b.call(_function(k), [x, n, q, scale, zero])


def _function(caller: Emitter) -> ir.Function:
    module = caller.module
    name = "cuvil.dynamic_quantize.uint8"
    if name in module.globals:
        return module.globals[name]
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, I64, PTR, PTR, PTR]), name)
    fn.linkage = "internal"
    for i in (0, 2):
        fn.args[i].add_attribute("noalias")
    _Writer(module, fn, caller.target).write()
    return fn


def _intrinsic(module: ir.Module, name: str, ty: ir.Type) -> ir.Function:
    if name in module.globals:
        return module.globals[name]
    return ir.Function(module, ir.FunctionType(ty, [ty]), name)


class _Writer:
    def __init__(self, module: ir.Module, fn: ir.Function, target: KernelTarget) -> None:
        self.module = module
        self.k = Emitter(module, fn, ir.Constant(PTR, None), [], {}, target)
        self.x, self.n, self.q, self.scale_out, self.zero_out = fn.args
        self.width = target.isa.vector

    def slot(self, init: ir.Value) -> ir.Value:
        b = self.k.b
        with b.goto_entry_block():
            s = b.alloca(init.type)
        b.store(init, s)
        return s

    def passes(self, body: Callable[[ir.Value, int], object]) -> None:
        """body(i, lanes) at the start of each whole vector, then for each element left."""
        k = self.k
        w = self.width
        with k.loop(self.full, step=w, name="v") as i:
            body(i, w)
        with k.loop(self.n, start=self.full, name="s") as i:
            body(i, 1)

    def load(self, i: ir.Value, lanes: int) -> ir.Value:
        b = self.k.b
        p = b.gep(self.x, [i], source_etype=F32, inbounds=True)
        return b.load(p, typ=ir.VectorType(F32, lanes), align=4)

    def write(self) -> None:
        k = self.k
        b = k.b
        w = self.width
        self.full = b.mul(k.floordiv(self.n, k.i64(w)), k.i64(w))

        def smaller(a: ir.Value, c: ir.Value) -> ir.Value:  # c when a is NaN: skips NaN
            return b.select(b.fcmp_ordered("<", a, c), a, c)

        def larger(a: ir.Value, c: ir.Value) -> ir.Value:
            return b.select(b.fcmp_ordered(">", a, c), a, c)

        zeros = {lanes: ir.Constant(ir.VectorType(F32, lanes), None) for lanes in (1, w)}
        lo = {lanes: self.slot(v) for lanes, v in zeros.items()}
        hi = {lanes: self.slot(v) for lanes, v in zeros.items()}

        def extremes(i: ir.Value, lanes: int) -> None:
            v = self.load(i, lanes)
            b.store(smaller(v, b.load(lo[lanes])), lo[lanes])
            b.store(larger(v, b.load(hi[lanes])), hi[lanes])

        self.passes(extremes)
        lanes_of = self.k.reduce_lanes
        mn = smaller(lanes_of(b.load(lo[w]), smaller), lanes_of(b.load(lo[1]), smaller))
        mx = larger(lanes_of(b.load(hi[w]), larger), lanes_of(b.load(hi[1]), larger))
        span = b.select(b.fcmp_ordered("==", mn, mx), ir.Constant(F32, 1.0), b.fsub(mx, mn))
        scale = b.fdiv(span, ir.Constant(F32, 255.0))
        zero = self.saturate(b.fsub(ir.Constant(F32, 0.0), b.fdiv(mn, scale)))
        b.store(scale, self.scale_out)
        b.store(b.trunc(zero, I8), self.zero_out)
        scales = {lanes: splat(b, scale, lanes) for lanes in (1, w)}
        zero_f = b.sitofp(zero, F32)
        zero_points = {lanes: splat(b, zero_f, lanes) for lanes in (1, w)}

        def quantize(i: ir.Value, lanes: int) -> None:
            r = self.round(b.fdiv(self.load(i, lanes), scales[lanes]))
            q = self.saturate(b.fadd(r, zero_points[lanes]), rounded=True)
            p = b.gep(self.q, [i], source_etype=I8, inbounds=True)
            b.store(b.trunc(q, ir.VectorType(I8, lanes)), p, align=1)

        self.passes(quantize)
        b.ret_void()

    def round(self, v: ir.Value) -> ir.Value:
        """Round half to even (the current rounding mode's nearest)."""
        t = v.type
        suffix = f"v{t.count}f32" if isinstance(t, ir.VectorType) else "f32"
        return self.k.b.call(_intrinsic(self.module, f"llvm.roundeven.{suffix}", t), [v])

    def saturate(self, v: ir.Value, rounded: bool = False) -> ir.Value:
        """v rounded (unless it is already) and clamped to [0, 255] as int32; NaN gives 0."""
        b = self.k.b
        r = v if rounded else self.round(v)
        lanes = r.type.count if isinstance(r.type, ir.VectorType) else 0
        lo, hi = ir.Constant(F32, 0.0), ir.Constant(F32, 255.0)
        if lanes:
            lo, hi = splat(b, lo, lanes), splat(b, hi, lanes)
        r = b.select(b.fcmp_unordered("<", r, lo), lo, r)
        r = b.select(b.fcmp_ordered(">", r, hi), hi, r)
        return b.fptosi(r, ir.VectorType(I32, lanes) if lanes else I32)
