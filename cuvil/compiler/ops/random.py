"""Random generators: RandomNormal, RandomUniform, RandomNormalLike, RandomUniformLike,
Bernoulli and Multinomial.

What a call draws, as onnx's reference evaluator does: a node with a `seed` draws the same
values at every call (its own stream, fixed by the seed); a node without one draws new values
at every call, different between nodes, calls, threads and processes. onnxruntime differs for
seeded nodes: its kernel keeps one generator per session, so a seeded node's n-th call repeats
across sessions but its calls differ from each other. A cuvil library keeps no state per
caller, so it cannot number a caller's calls; the values themselves (another generator) never
equal onnxruntime's.

The generator is counter-based (splitmix64's output function over a Weyl sequence): element i
of a call is mix(key + (i + 1) * golden), a pure function of the call's key and i. The pool's
threads then fill any part of an output without sharing state, and a seeded node's values do
not depend on how many threads ran. A seeded node's key is a hash of the seed. An unseeded
call's key mixes a library-wide call counter, bumped atomically (every call in the process gets
its own key, from any thread, without locks), with the monotonic clock (processes draw apart,
as onnxruntime's unseeded nodes do); the C ABI stays as it is.

Uniforms take as many random bits as their dtype holds exactly (24 for float32), so they lie in
[low, high); normals (Box-Muller, in float64 for every dtype) take 53-bit uniforms in (0, 1)
for the logarithm, never 0. The frontend never folds these ops (`frontend/fold_constants.py`'s
NONDETERMINISTIC), and the memory planner hoists only the ops it lists (`HOISTED_OPS`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import onnx
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, Value
from cuvil.compiler.kernels import vecmath
from cuvil.compiler.kernels.emitter import I64, Emitter, View, declare_function
from cuvil.compiler.ops import FLOATS, InferContext, Op, attr, register, required_input
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError, UnsupportedOpError

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
#: the library-wide count of unseeded calls (an internal global, updated atomically)
_CALLS = "cuvil.random.calls"
#: the runtime's monotonic clock (cuvil/runtime/clock.c), linked into every library
_CLOCK = "cuvil_clock_ns"
#: random bits a uniform of each dtype takes: its significand, so every value is exact
_UNIFORM_BITS = {"float16": 11, "float32": 24, "float64": 53}

F64 = np.dtype(np.float64)
F32 = np.dtype(np.float32)


def _mix64(x: int) -> int:
    """splitmix64's output function (Stafford's Mix13): `_mix` at compile time, for seeds."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    x = b.mul(b.xor(x, b.lshr(x, ir.Constant(I64, 30))), ir.Constant(I64, 0xBF58476D1CE4E5B9))
    x = b.mul(b.xor(x, b.lshr(x, ir.Constant(I64, 27))), ir.Constant(I64, 0x94D049BB133111EB))
    return b.xor(x, b.lshr(x, ir.Constant(I64, 31)))


def _seed(node: Node) -> float | None:
    seed = attr(node, "seed", None)
    if seed is not None and not math.isfinite(float(seed)):
        raise ModelError(f"{node.describe()}: seed is {seed}; give a finite number, or none "
                         "for new values at every call")
    return None if seed is None else float(seed)


def _call_key(k: Emitter, node: Node) -> ir.Value:
    """This call's stream key (i64): from the seed, or drawn anew (see the module's text)."""
    seed = _seed(node)
    if seed is not None:
        bits = struct.unpack("<Q", struct.pack("<d", seed))[0]
        return ir.Constant(I64, _mix64(bits))
    try:
        calls = k.module.get_global(_CALLS)
    except KeyError:
        calls = ir.GlobalVariable(k.module, I64, _CALLS)
        calls.linkage = "internal"
        calls.initializer = ir.Constant(I64, 0)
    b = k.b
    count = b.atomic_rmw("add", calls, ir.Constant(I64, 1), "monotonic")
    now = b.call(declare_function(k.module, _CLOCK, I64, []), [])
    return _mix(b, b.add(_mix(b, count), now))


def _bits(k: Emitter, key: ir.Value, i: ir.Value) -> ir.Value:
    """64 random bits: element i of the stream `key`."""
    b = k.b
    return _mix(b, b.add(key, b.mul(b.add(i, k.i64(1)), ir.Constant(I64, _GOLDEN))))


def _unit(k: Emitter, bits: ir.Value, n: int, dtype: np.dtype, half: bool = False) -> ir.Value:
    """The top `n` random bits as a float of `dtype` in [0, 1), exactly; `half` adds half a step,
    for (0, 1)."""
    top = k.b.uitofp(k.b.lshr(bits, k.i64(64 - n)), ir.DoubleType() if dtype == F64
                     else ir.FloatType())
    if half:
        top = k.b.fadd(top, k.const(dtype, 0.5))
    return k.b.fmul(top, k.const(dtype, 2.0 ** -n))


def _normal(k: Emitter, key: ir.Value, i: ir.Value) -> ir.Value:
    """A standard normal draw (float64) from elements 2i and 2i+1 of the stream: Box-Muller."""
    b = k.b
    two_i = b.shl(i, k.i64(1))
    u1 = _unit(k, _bits(k, key, two_i), 53, F64, half=True)
    u2 = _unit(k, _bits(k, key, b.add(two_i, k.i64(1))), 53, F64)
    radius = k.intrinsic("llvm.sqrt", [b.fmul(vecmath.log(b, u1), k.const(F64, -2.0))])
    return b.fmul(radius, _cos_2pi(k, u2))


#: sin(x) = x * P(x^2) on [-pi/2, pi/2]: its Taylor series to x^17 (error < 5e-14)
_SIN_TAYLOR = tuple((-1) ** n / math.factorial(2 * n + 1) for n in range(9))


def _cos_2pi(k: Emitter, u: ir.Value) -> ir.Value:
    """cos(2 pi u) for u in [0, 1), as sin(x) with x = 2 pi (|u - 1/2| - 1/4) in [-pi/2, pi/2]:
    a polynomial the loop vectorizes, four times faster than libm's cos here."""
    b = k.b
    half = b.fsub(u, k.const(F64, 0.5))
    a = b.select(b.fcmp_ordered("<", half, k.const(F64, 0.0)), b.fneg(half), half)
    x = b.fmul(b.fsub(a, k.const(F64, 0.25)), k.const(F64, 2 * math.pi))
    x2 = b.fmul(x, x)
    acc: ir.Value = k.const(F64, _SIN_TAYLOR[-1])
    for c in reversed(_SIN_TAYLOR[:-1]):
        acc = k.intrinsic("llvm.fmuladd", [acc, x2, k.const(F64, c)])
    return b.fmul(x, acc)


def _to_float(k: Emitter, value: ir.Value, src: np.dtype, dst: np.dtype) -> ir.Value:
    """`value` converted between float dtypes, float16 <-> float64 through float32 (the
    conversions cuvil's other float16 ops use)."""
    if {src.name, dst.name} == {"float16", "float64"}:
        value, src = k.convert(value, src, F32), F32
    return k.convert(value, src, dst)


#: fills element i of the output from the call's key: fn(k, key, i) -> value of the out dtype
Draw = Callable[[Emitter, ir.Value, ir.Value], ir.Value]


def _fill(k: Emitter, node: Node, out: Value, draw: Draw, cost: int) -> None:
    """Every element of `out` (as a flat array), spread over the pool's threads."""
    key = _call_key(k, node)
    n = out.type.numel
    with k.parallel_loop(n, cost=cost, name="draw", carry=[key]) as i:
        y = k.contiguous(k.buffers[out], out.type.dtype, (n,))
        k.store(y, [i], draw(k, k.carried[0], i))


def _dtype_attr(node: Node, allowed: tuple[str, ...]) -> np.dtype | None:
    """The `dtype` attribute as a numpy dtype, one of `allowed` (None when not set)."""
    to = attr(node, "dtype")
    if to is None:
        return None
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))
    except Exception:
        dtype = None
    if dtype is None or dtype.name not in allowed:
        name = dtype.name if dtype is not None else f"{to}"
        raise UnsupportedOpError(f"{node.describe()}: dtype {name}; cuvil compiles "
                                 f"{node.op_type} to {', '.join(allowed)}")
    return dtype


class _Distribution(Op):
    """RandomNormal and RandomUniform (shape attribute) and their *Like forms (the input's
    shape): the output's dtype is the `dtype` attribute, else (the *Like forms) the input's."""

    dtypes: ClassVar[tuple[str, ...]] = FLOATS
    like: ClassVar[bool] = False

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _seed(node)
        dtype = _dtype_attr(node, FLOATS)
        if self.like:
            x = required_input(node, 0)
            dtype = dtype or x.type.dtype
            if dtype.name not in FLOATS:
                raise ModelError(f"{node.describe()}: input {x.name!r} is {dtype.name}; set the "
                                 "dtype attribute to the float type to draw")
            return [TensorType(dtype, x.type.shape)]
        shape = attr(node, "shape")
        dims = [int(d) for d in shape]
        if not dims or any(d < 0 for d in dims):
            raise ModelError(f"{node.describe()}: shape {list(shape)} must list one size >= 0 "
                             "per axis")
        assert dtype is not None  # the attribute defaults to float
        return [TensorType(dtype, tuple(dims))]

    def draw(self, node: Node, dtype: np.dtype) -> tuple[Draw, int]:
        raise NotImplementedError

    def lower(self, node: Node, k: Emitter) -> None:
        out = node.outputs[0]
        draw, cost = self.draw(node, out.type.dtype)
        _fill(k, node, out, draw, cost)


class _Normal(_Distribution):
    def draw(self, node: Node, dtype: np.dtype) -> tuple[Draw, int]:
        mean, scale = float(attr(node, "mean")), float(attr(node, "scale"))

        def draw(k: Emitter, key: ir.Value, i: ir.Value) -> ir.Value:
            z = _normal(k, key, i)
            y = k.b.fadd(k.b.fmul(z, k.const(F64, scale)), k.const(F64, mean))
            return _to_float(k, y, F64, dtype)

        return draw, 40


class _Uniform(_Distribution):
    def draw(self, node: Node, dtype: np.dtype) -> tuple[Draw, int]:
        low, high = float(attr(node, "low")), float(attr(node, "high"))
        # float16 computes in float32 and rounds once
        wide = F64 if dtype == F64 else F32

        def draw(k: Emitter, key: ir.Value, i: ir.Value) -> ir.Value:
            u = _unit(k, _bits(k, key, i), _UNIFORM_BITS[dtype.name], wide)
            y = k.b.fadd(k.b.fmul(u, k.const(wide, high - low)), k.const(wide, low))
            return _to_float(k, y, wide, dtype)

        return draw, 4


@register
class RandomNormal(_Normal):
    op_type = "RandomNormal"


@register
class RandomNormalLike(_Normal):
    op_type = "RandomNormalLike"
    dtypes = DTYPES
    like = True


@register
class RandomUniform(_Uniform):
    op_type = "RandomUniform"


@register
class RandomUniformLike(_Uniform):
    op_type = "RandomUniformLike"
    dtypes = DTYPES
    like = True


@register
class Bernoulli(Op):
    """y = 1 with probability p (the input's element), else 0, in the `dtype` attribute's type
    (default: the input's)."""

    op_type = "Bernoulli"
    since = 15
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _seed(node)
        x = required_input(node, 0)
        return [TensorType(_dtype_attr(node, DTYPES) or x.type.dtype, x.type.shape)]

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        dtype = out.type.dtype

        def draw(k: Emitter, key: ir.Value, i: ir.Value) -> ir.Value:
            p = k.contiguous(k.buffers[x], x.type.dtype, (x.type.numel,))
            prob = _to_float(k, k.load(p, [i]), x.type.dtype, F64)
            # u < p with u in [0, 1): p = 0 never draws 1, p = 1 always does
            hit = k.b.fcmp_ordered("<", _unit(k, _bits(k, key, i), 53, F64), prob)
            return k.b.select(hit, k.const(dtype, 1), k.const(dtype, 0))

        _fill(k, node, out, draw, cost=4)


@register
class Multinomial(Op):
    """`sample_size` class indices per row of the input [batch, classes], drawn with the
    probabilities softmax(row) (the input holds unnormalized log-probabilities)."""

    op_type = "Multinomial"
    since = 7
    dtypes = FLOATS

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        self.check_dtypes(node)
        _seed(node)
        x = required_input(node, 0)
        if x.type.rank != 2:
            raise ModelError(f"{node.describe()}: the input must be 2-D [batch, classes], got "
                             f"{x.type}")
        samples = attr(node, "sample_size")
        if not isinstance(samples, int) or samples < 1:
            raise ModelError(f"{node.describe()}: sample_size must be a positive integer, got "
                             f"{samples!r}")
        dtype = _dtype_attr(node, ("int32", "int64"))
        assert dtype is not None  # the attribute defaults to int32
        ctx.require(node, x.type.shape[1] >= 1, "the input has no classes")
        return [TensorType(dtype, (x.type.shape[0], samples))]

    def scratch_bytes(self, node: Node) -> Dim:
        # each row's cumulative sums, in float64
        return 8 * required_input(node, 0).type.numel

    def lower(self, node: Node, k: Emitter) -> None:
        x, out = required_input(node, 0), node.outputs[0]
        rows, classes = x.type.shape
        samples = out.type.shape[1]
        if k.scratch is None:  # no rows at all
            return
        key = _call_key(k, node)
        with k.parallel_loop(rows, cost=40 * classes + samples * classes, name="row",
                             carry=[key, k.scratch]) as row:
            key, scratch = k.carried
            self._row(k, x, out, key, k.contiguous(scratch, F64, (rows, classes)), row)

    @staticmethod
    def _row(k: Emitter, x: Value, out: Value, key: ir.Value, cdf: View, row: ir.Value
             ) -> None:
        b = k.b
        xs, y = k.view(x), k.view(out)
        classes, samples = xs.dims[1], y.dims[1]
        acc = entry_alloca(k, ir.DoubleType(), "acc")
        b.store(k.const(F64, -math.inf), acc)
        with k.loop(classes, name="m") as j:
            b.store(k.fmax(b.load(acc), _to_float(k, k.load(xs, [row, j]), x.type.dtype, F64)),
                    acc)
        top = b.load(acc)
        b.store(k.const(F64, 0.0), acc)
        with k.loop(classes, name="c") as j:
            v = _to_float(k, k.load(xs, [row, j]), x.type.dtype, F64)
            total = b.fadd(b.load(acc), vecmath.exp(b, b.fsub(v, top)))
            b.store(total, acc)
            k.store(cdf, [row, j], total)
        total = b.load(acc)
        count = entry_alloca(k, I64, "count")
        with k.loop(samples, name="s") as s:
            # the class whose cumulative interval holds u * total: the number of classes whose
            # sums are <= it, at most classes - 1 (u of 32 bits is at most 1 - 2^-32, so
            # u * total rounds below total)
            u = _unit(k, _bits(k, key, b.add(b.mul(row, samples), s)), 32, F64)
            target = b.fmul(u, total)
            b.store(k.i64(0), count)
            with k.loop(b.sub(classes, k.i64(1)), name="j") as j:
                below = b.fcmp_ordered("<=", k.load(cdf, [row, j]), target)
                b.store(b.add(b.load(count), b.zext(below, I64)), count)
            k.store(y, [row, s], k.convert(b.load(count), np.dtype(np.int64), out.type.dtype))
