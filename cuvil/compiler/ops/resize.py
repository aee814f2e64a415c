"""Resampling: Resize (opsets 10-19) and Upsample (opsets 7-9), modes nearest, linear, cubic.

Every resized axis maps an output coordinate to a few input positions ("taps") with weights:
one tap for nearest, two for linear, four for cubic; a multi-axis resize is the product of
its axes' taps. The arithmetic mirrors onnxruntime's float32 formulas step by step, so
nearest picks the same pixels and linear/cubic agree to rounding. The formulas are written
once against a small math interface (`_Math`) and evaluated either with numpy at compile time,
when an axis' lengths are static (the taps become constant tables in the library), or as LLVM
code at run time, when they are symbolic.

With antialias (opset 18) a shrinking linear/cubic axis stretches its filter by 1/scale, so
its tap count varies with the output coordinate: such axes loop over their taps (a table of
first index, count and weights, or a window computed at run time), as onnxruntime computes them.

Like onnxruntime: an axis whose scale is exactly 1 is copied unchanged whatever the
coordinate mode, and a resize whose output shape equals its input shape is a plain copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import sympy
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Node, TensorType, simplify_dim
from cuvil.compiler.kernels.emitter import I1, I32, I64, Emitter, View
from cuvil.compiler.ops import (
    UNCHECKED,
    InferContext,
    Op,
    attr,
    const_input,
    const_or_symbolic_input,
    normalize_axis,
    register,
    required_input,
)
from cuvil.compiler.ops._window import entry_alloca
from cuvil.errors import ModelError, UnsupportedOpError

F32 = ir.FloatType()
F64 = ir.DoubleType()

_MODES = ("nearest", "linear", "cubic")
_COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                     "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


@dataclass
class _Axis:
    n_in: Dim
    n_out: Dim
    #: float32 scale when known at compile time; None: out/in computed at run time
    scale: np.float32 | None
    roi: tuple[np.float32, np.float32]

    @property
    def identity(self) -> bool:
        return self.scale is not None and self.scale == np.float32(1)

    @property
    def static(self) -> bool:
        return isinstance(self.n_in, int) and isinstance(self.n_out, int) and self.scale is not None


@dataclass
class _Plan:
    mode: str
    coordinate: str
    nearest: str  # one of _NEAREST_MODES or "simple" (opsets < 11)
    cubic_a: np.float32
    exclude_outside: bool
    extrapolation: float
    axes: list[_Axis]
    #: linear/cubic filter stretched by 1/scale when shrinking (opset 18 antialias = 1)
    antialias: bool = False

    @property
    def extrapolate(self) -> bool:
        return self.coordinate == "tf_crop_and_resize"


# -- the shared geometry ----------------------------------------------------------------------


def _floats(node: Node, i: int, what: str) -> np.ndarray | None:
    v = const_input(node, i, what)
    if v is None:
        return None
    arr = np.asarray(v).reshape(-1)
    return None if arr.size == 0 else arr.astype(np.float32)


def _plan(node: Node, ctx: InferContext) -> _Plan:  # noqa: C901  (older than the rule: to split)
    x = node.inputs[0]
    if x is None:
        raise ModelError(f"{node.describe()}: input X is required")
    rank = x.type.rank
    if rank < 1:
        raise ModelError(f"{node.describe()}: the input must have rank >= 1, got a scalar")
    upsample = node.op_type == "Upsample"
    opset = node.opset
    mode = str(attr(node, "mode"))
    if mode not in _MODES or (upsample and mode == "cubic"):
        raise ModelError(f"{node.describe()}: mode {mode!r} is not one of "
                         f"{list(_MODES[:2] if upsample else _MODES)}")
    legacy = upsample or opset < 11
    coordinate = "asymmetric" if legacy else str(
        attr(node, "coordinate_transformation_mode"))
    if coordinate not in _COORDINATE_MODES or (coordinate == "half_pixel_symmetric" and opset < 19):
        raise ModelError(f"{node.describe()}: coordinate_transformation_mode {coordinate!r} is not "
                         f"supported at opset {opset}")
    nearest = "simple" if legacy else str(attr(node, "nearest_mode"))
    if not legacy and nearest not in _NEAREST_MODES:
        raise ModelError(f"{node.describe()}: nearest_mode {nearest!r} is not one of "
                         f"{list(_NEAREST_MODES)}")
    exclude = bool(attr(node, "exclude_outside"))
    if exclude and mode != "cubic":
        raise ModelError(f"{node.describe()}: exclude_outside = 1 needs mode 'cubic'")
    antialias = bool(attr(node, "antialias")) and mode != "nearest"  # nearest ignores it
    policy = "stretch" if upsample else str(attr(node, "keep_aspect_ratio_policy"))
    if policy not in ("stretch", "not_larger", "not_smaller"):
        raise ModelError(f"{node.describe()}: keep_aspect_ratio_policy {policy!r} is unknown")
    if x.type.dtype.name not in DTYPES:
        raise UnsupportedOpError(f"{node.describe()}: dtype {x.type.dtype.name} is not supported")
    if mode != "nearest" and x.type.dtype.name != "float32":
        raise UnsupportedOpError(f"{node.describe()}: mode {mode!r} is compiled for float32 input "
                                 f"only, got {x.type.dtype.name}; mode 'nearest' takes any dtype")

    axes_attr = attr(node, "axes") if opset >= 18 and not upsample else None
    axes = (list(range(rank)) if axes_attr is None
            else [normalize_axis(node, int(a), rank) for a in axes_attr])
    if len(set(axes)) != len(axes):
        raise ModelError(f"{node.describe()}: axes {list(axes_attr or [])} repeat an axis")

    # scales / sizes / roi by opset
    roi = sizes = None
    if upsample and opset < 9:
        raw = attr(node, "scales")
        scales = None if raw is None else np.asarray(raw, dtype=np.float32)
    elif legacy:
        scales = _floats(node, 1, "scales")
    else:
        scales = _floats(node, 2, "scales")
        sizes = const_or_symbolic_input(node, 3, "sizes")
        if sizes is not None and len(sizes) == 0:
            sizes = None
        if coordinate == "tf_crop_and_resize":
            roi = _floats(node, 1, "roi")
    if (scales is None) == (sizes is None):
        raise ModelError(f"{node.describe()}: exactly one of scales and sizes must be given")
    given = scales if scales is not None else sizes
    assert given is not None
    if len(given) != len(axes):
        raise ModelError(f"{node.describe()}: {'scales' if scales is not None else 'sizes'} has "
                         f"{len(given)} values for {len(axes)} axes of input {x.type}")
    if policy != "stretch" and sizes is None:
        policy = "stretch"  # the policy applies to sizes only

    starts = [np.float32(0)] * rank
    ends = [np.float32(1)] * rank
    if roi is not None:
        if roi.size != 2 * len(axes):
            raise ModelError(f"{node.describe()}: roi must hold {2 * len(axes)} values "
                             f"(starts, then ends), got {roi.size}")
        for j, a in enumerate(axes):
            starts[a], ends[a] = roi[j], roi[len(axes) + j]

    in_shape = x.type.shape
    out: list[_Axis] = [_Axis(d, d, np.float32(1), (starts[a], ends[a]))
                        for a, d in enumerate(in_shape)]
    if scales is not None:
        for j, a in enumerate(axes):
            s = np.float32(scales[j])
            if not s > 0 or (upsample and s < 1):
                raise ModelError(f"{node.describe()}: scale {float(s):.7g} of axis {a} must be "
                                 f"{'>= 1' if upsample else '> 0'}")
            out[a] = _Axis(in_shape[a], _scaled_dim(node, ctx, in_shape[a], s), s, out[a].roi)
    else:
        assert sizes is not None
        want = [simplify_dim(d) for d in sizes]
        for j in range(len(axes)):
            if isinstance(want[j], int) and want[j] < 1:
                raise ModelError(f"{node.describe()}: sizes[{j}] = {want[j]} must be positive")
        if policy != "stretch":
            want = _keep_aspect_ratio(node, [in_shape[a] for a in axes], want, policy, out, axes)
        else:
            for j, a in enumerate(axes):
                n_in, n_out = in_shape[a], want[j]
                scale = (np.float32(n_out) / np.float32(n_in)
                         if isinstance(n_in, int) and isinstance(n_out, int) else None)
                if scale is None and sympy.simplify(sympy.sympify(n_out) - n_in) == 0:
                    scale = np.float32(1)
                out[a] = _Axis(n_in, n_out, scale, out[a].roi)
    # Upsample has neither attribute (nor a cubic mode, nor points outside the input)
    cubic_a, outside = (-0.75, 0.0) if upsample else (attr(node, "cubic_coeff_a"),
                                                      attr(node, "extrapolation_value"))
    return _Plan(mode, coordinate, nearest, np.float32(cubic_a), exclude, float(outside), out,
                 antialias)


def _scaled_dim(node: Node, ctx: InferContext, n: Dim, s: np.float32) -> Dim:
    """onnxruntime's output length: the float32 product of length and scale, truncated."""
    if s == np.float32(1):
        return n
    if isinstance(n, int):
        return int(np.float32(n) * s)
    # exact while the float32 product is: n * s = n * odd * 2**e needs n * odd < 2**24
    mantissa, _ = np.frexp(np.float64(s))
    odd = int(mantissa * 2 ** 53)
    while odd % 2 == 0:
        odd //= 2
    if odd >= 2 ** 12:
        raise UnsupportedOpError(
            f"{node.describe()}: scale {float(s):.7g} on the symbolic dim {n}: onnxruntime sizes the "
            "output by a float32 product whose rounding cuvil cannot express for every value of "
            f"{n}; pin that dim in the model's `inputs`, or use a scale that is a short binary "
            "fraction (2, 1.5, 0.5, 0.75...)")
    if odd > 1:
        ctx.require(node, sympy.Lt(n * odd, 2 ** 24),
                    f"dim {n} times scale {float(s):.7g} must be exact in float32 (dim * {odd} < 2**24)")
    return simplify_dim(sympy.floor(n * sympy.Rational(float(s))))


def _keep_aspect_ratio(node: Node, n_in: list[Dim], want: list[Dim], policy: str,
                       out: list[_Axis], axes: list[int]) -> list[Dim]:
    if not all(isinstance(d, int) for d in [*n_in, *want]):
        raise UnsupportedOpError(f"{node.describe()}: keep_aspect_ratio_policy {policy!r} needs "
                                 "static input dims and sizes; pin them in the model's `inputs`")
    ratios = [np.float32(w) / np.float32(d) for w, d in zip(want, n_in)]
    s = min(ratios) if policy == "not_larger" else max(ratios)
    result = []
    for j, a in enumerate(axes):
        n = int(np.floor(np.float64(np.float32(s) * np.float32(n_in[j])) + 0.5))  # std::round
        result.append(n)
        out[a] = _Axis(n_in[j], n, np.float32(s), out[a].roi)
    return result


# -- the math, once for numpy (tables) and once for LLVM (run time) ---------------------------


class _Math:
    """float32/float64/int64 operations used by the coordinate formulas."""

    def f32(self, v: float | np.float32) -> Any: ...
    def f64(self, v: float) -> Any: ...


class _NumpyMath(_Math):
    """Arrays of float32 (float64, int64) values, one element per output coordinate."""

    def f32(self, v: float | np.float32) -> Any:
        return np.float32(v)

    def f64(self, v: float) -> Any:
        return np.float64(v)

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def sub(self, a: Any, b: Any) -> Any:
        return a - b

    def mul(self, a: Any, b: Any) -> Any:
        return a * b

    def div(self, a: Any, b: Any) -> Any:
        with np.errstate(divide="ignore", invalid="ignore"):
            return a / b

    def to_f64(self, a: Any) -> Any:
        return np.float64(a) if np.ndim(a) == 0 else np.asarray(a, dtype=np.float64)

    def to_f32(self, a: Any) -> Any:
        return np.float32(a) if np.ndim(a) == 0 else np.asarray(a, dtype=np.float32)

    def floor(self, a: Any) -> Any:
        return np.floor(a)

    def ceil(self, a: Any) -> Any:
        return np.ceil(a)

    def round(self, a: Any) -> Any:  # half away from zero, like std::round
        t = np.trunc(a)
        return np.where(np.abs(a - t) >= a.dtype.type(0.5), t + np.sign(a), t).astype(a.dtype)

    def fabs(self, a: Any) -> Any:
        return np.abs(a)

    def trunc_int(self, a: Any) -> Any:
        with np.errstate(invalid="ignore"):
            return np.trunc(a).astype(np.int64)

    def int_f32(self, a: Any) -> Any:
        return np.asarray(a).astype(np.float32)

    def lt(self, a: Any, b: Any) -> Any:
        return a < b

    def gt(self, a: Any, b: Any) -> Any:
        return a > b

    def eq(self, a: Any, b: Any) -> Any:
        return a == b

    def or_(self, a: Any, b: Any) -> Any:
        return np.logical_or(a, b)

    def select(self, c: Any, a: Any, b: Any) -> Any:
        return np.where(c, a, b)

    def fmin(self, a: Any, b: Any) -> Any:  # std::min(a, b): b < a ? b : a
        return np.where(b < a, b, a)

    def fmax(self, a: Any, b: Any) -> Any:  # std::max(a, b): a < b ? b : a
        return np.where(a < b, b, a)

    def i64(self, v: int) -> Any:
        return np.int64(v)

    def iadd(self, a: Any, b: Any) -> Any:
        return a + b

    def isub(self, a: Any, b: Any) -> Any:
        return a - b

    def imin(self, a: Any, b: Any) -> Any:
        return np.minimum(a, b)

    def imax(self, a: Any, b: Any) -> Any:
        return np.maximum(a, b)

    def ilt(self, a: Any, b: Any) -> Any:
        return a < b

    def ieq(self, a: Any, b: Any) -> Any:
        return a == b


class _LLVMMath(_Math):
    def __init__(self, k: Emitter) -> None:
        self.k = k
        self.b = k.b

    def f32(self, v: float | np.float32) -> Any:
        return ir.Constant(F32, float(np.float32(v)))

    def f64(self, v: float) -> Any:
        return ir.Constant(F64, float(v))

    def add(self, a: Any, b: Any) -> Any:
        return self.b.fadd(a, b)

    def sub(self, a: Any, b: Any) -> Any:
        return self.b.fsub(a, b)

    def mul(self, a: Any, b: Any) -> Any:
        return self.b.fmul(a, b)

    def div(self, a: Any, b: Any) -> Any:
        return self.b.fdiv(a, b)

    def to_f64(self, a: Any) -> Any:
        return self.b.fpext(a, F64)

    def to_f32(self, a: Any) -> Any:
        return self.b.fptrunc(a, F32)

    def floor(self, a: Any) -> Any:
        return self.k.intrinsic("llvm.floor", [a])

    def ceil(self, a: Any) -> Any:
        return self.k.intrinsic("llvm.ceil", [a])

    def round(self, a: Any) -> Any:
        return self.k.intrinsic("llvm.round", [a])

    def fabs(self, a: Any) -> Any:
        return self.k.intrinsic("llvm.fabs", [a])

    def trunc_int(self, a: Any) -> Any:
        # saturating: coordinates far outside the tensor stay well defined
        fn = self.k.module.declare_intrinsic("llvm.fptosi.sat", [I64, a.type],
                                             ir.FunctionType(I64, [a.type]))
        return self.b.call(fn, [a])

    def int_f32(self, a: Any) -> Any:
        return self.b.sitofp(a, F32)

    def lt(self, a: Any, b: Any) -> Any:
        return self.b.fcmp_ordered("<", a, b)

    def gt(self, a: Any, b: Any) -> Any:
        return self.b.fcmp_ordered(">", a, b)

    def eq(self, a: Any, b: Any) -> Any:
        return self.b.fcmp_ordered("==", a, b)

    def or_(self, a: Any, b: Any) -> Any:
        return self.b.or_(a, b)

    def select(self, c: Any, a: Any, b: Any) -> Any:
        return self.b.select(c, a, b)

    def fmin(self, a: Any, b: Any) -> Any:
        return self.b.select(self.b.fcmp_ordered("<", b, a), b, a)

    def fmax(self, a: Any, b: Any) -> Any:
        return self.b.select(self.b.fcmp_ordered("<", a, b), b, a)

    def i64(self, v: int) -> Any:
        return ir.Constant(I64, int(v))

    def iadd(self, a: Any, b: Any) -> Any:
        return self.b.add(a, b)

    def isub(self, a: Any, b: Any) -> Any:
        return self.b.sub(a, b)

    def imin(self, a: Any, b: Any) -> Any:
        return self.b.select(self.b.icmp_signed("<", a, b), a, b)

    def imax(self, a: Any, b: Any) -> Any:
        return self.b.select(self.b.icmp_signed(">", a, b), a, b)

    def ilt(self, a: Any, b: Any) -> Any:
        return self.b.icmp_signed("<", a, b)

    def ieq(self, a: Any, b: Any) -> Any:
        return self.b.icmp_signed("==", a, b)


def _original(m: Any, plan: _Plan, x: Any, s: Any, n_out: Any, n_in: Any,
              roi: tuple[Any, Any]) -> Any:
    """onnxruntime's input coordinate of output coordinate x (all float32)."""
    mode = plan.coordinate
    half, one = m.f32(0.5), m.f32(1)
    if mode == "asymmetric":
        return m.div(x, s)
    if mode == "half_pixel":
        return m.sub(m.div(m.add(x, half), s), half)
    if mode == "pytorch_half_pixel":
        return m.select(m.gt(n_out, one), m.sub(m.div(m.add(x, half), s), half), m.f32(0))
    if mode == "tf_half_pixel_for_nn":
        return m.div(m.add(x, half), s)
    if mode == "align_corners":
        return m.select(m.eq(n_out, one), m.f32(0),
                        m.div(m.mul(x, m.sub(n_in, one)), m.sub(n_out, one)))
    if mode == "half_pixel_symmetric":
        adjustment = m.div(n_out, m.mul(s, n_in))
        offset = m.mul(m.div(n_in, m.f32(2)), m.sub(one, adjustment))
        orig = m.sub(m.add(m.to_f64(offset), m.div(m.add(m.to_f64(x), m.f64(0.5)), m.to_f64(s))),
                     m.f64(0.5))
        return m.to_f32(orig)
    assert mode == "tf_crop_and_resize"
    start, end = roi
    span = m.sub(n_in, one)
    many = m.add(m.mul(start, span), m.div(m.mul(m.mul(x, m.sub(end, start)), span),
                                           m.sub(n_out, one)))
    single = m.to_f32(m.mul(m.mul(m.f64(0.5), m.to_f64(m.add(start, end))), m.to_f64(span)))
    return m.select(m.gt(n_out, one), many, single)


def _taps(m: Any, plan: _Plan, x: Any, s: Any, n_out: Any, n_in: Any, n_in_int: Any,
          roi: tuple[Any, Any], s_is_one: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """(input index, weight) taps of output coordinate x and its out-of-roi flag (or None).
    Weights are None for nearest."""
    orig = m.select(s_is_one, x, _original(m, plan, x, s, n_out, n_in, roi))
    last = m.iadd(n_in_int, m.i64(-1))
    oob = None
    if plan.extrapolate:
        oob = m.or_(m.lt(orig, m.f32(0)), m.gt(orig, m.sub(n_in, m.f32(1))))
    if plan.mode == "nearest":
        mode = plan.nearest
        if mode == "simple":  # opsets < 11: ceil when shrinking, else truncate
            r = m.select(m.lt(s, m.f32(1)), m.ceil(orig), orig)
        elif mode == "round_prefer_floor":
            half_way = m.eq(orig, m.add(m.int_f32(m.trunc_int(orig)), m.f32(0.5)))
            r = m.select(half_way, m.floor(orig), m.round(orig))
        elif mode == "round_prefer_ceil":
            r = m.round(orig)
        elif mode == "floor":
            r = m.floor(orig)
        else:
            r = m.ceil(orig)
        i = m.imin(m.imax(m.trunc_int(r), m.i64(0)), last)
        return [(i, None)], oob
    if plan.mode == "linear":
        xc = m.fmax(m.f32(0), m.fmin(orig, m.sub(n_in, m.f32(1))))
        i1 = m.imin(m.trunc_int(xc), last)
        i2 = m.imin(m.iadd(i1, m.i64(1)), last)
        d1 = m.fabs(m.sub(xc, m.int_f32(i1)))
        d2 = m.fabs(m.sub(xc, m.int_f32(i2)))
        same = m.ieq(i1, i2)
        d1 = m.select(same, m.f32(0.5), d1)
        d2 = m.select(same, m.f32(0.5), d2)
        return [(i1, d2), (i2, d1)], oob
    # cubic (Keys), coefficients of the taps at floor(orig) - 1 .. floor(orig) + 2
    fl = m.floor(orig)
    base = m.trunc_int(fl)
    t = m.fabs(m.sub(orig, fl))
    a = m.f32(plan.cubic_a)
    a5, a8, a4 = m.mul(m.f32(5), a), m.mul(m.f32(8), a), m.mul(m.f32(4), a)
    a2, a3 = m.add(a, m.f32(2)), m.add(a, m.f32(3))

    def outer(u: Any) -> Any:
        return m.sub(m.mul(m.add(m.mul(m.sub(m.mul(a, u), a5), u), a8), u), a4)

    def inner(u: Any) -> Any:
        return m.add(m.mul(m.mul(m.sub(m.mul(a2, u), a3), u), u), m.f32(1))

    one, two = m.f32(1), m.f32(2)
    coeffs = [outer(m.add(t, one)), inner(t), inner(m.sub(one, t)), outer(m.sub(two, t))]
    positions = [m.iadd(base, m.i64(j - 1)) for j in range(4)]
    if plan.exclude_outside:
        zero = m.f32(0)
        coeffs = [m.select(m.or_(m.ilt(p, m.i64(0)), m.ilt(last, p)), zero, c)
                  for p, c in zip(positions, coeffs)]
        total = zero
        for c in coeffs:
            total = m.add(total, c)
        coeffs = [m.div(c, total) for c in coeffs]
    taps = [(m.imin(m.imax(p, m.i64(0)), last), c) for p, c in zip(positions, coeffs)]
    return taps, oob


#: the filter's support (width) at scale 1, as in onnxruntime's antialias kernels
_SUPPORT = {"linear": 2.0, "cubic": 4.0}


def _aa_filter(m: Any, plan: _Plan, u: Any) -> Any:
    """onnxruntime's antialias filter at distance u: the triangle (linear) or Keys' cubic."""
    u = m.fabs(u)
    one, zero = m.f32(1), m.f32(0)
    if plan.mode == "linear":
        return m.select(m.lt(u, one), m.sub(one, u), zero)
    a = m.f32(plan.cubic_a)
    near = m.add(m.mul(m.mul(m.sub(m.mul(m.add(a, m.f32(2)), u), m.add(a, m.f32(3))), u), u), one)
    far = m.mul(m.sub(m.mul(m.add(m.mul(m.sub(u, m.f32(5)), u), m.f32(8)), u), m.f32(4)), a)
    return m.select(m.lt(u, one), near, m.select(m.lt(u, m.f32(2)), far, zero))


def _aa_window(m: Any, plan: _Plan, x: Any, s: Any, n_out: Any, n_in: Any, n_in_int: Any,
               roi: tuple[Any, Any]) -> tuple[Any, ...]:
    """onnxruntime's antialiased taps of output coordinate x: the filter, stretched by 1/s when
    shrinking, covers input positions first .. first + count - 1; the normalised weight of
    position p is `_aa_weight(p)` / (the sum over those positions). Positions outside the input
    stand for its edge pixels (they are cut away with exclude_outside). Returns (center,
    inv_scale, first, count, lo, hi, oob): [lo, hi) is the window inside the input (empty: the
    output is 0), oob the out-of-roi flag or None."""
    one, half = m.f32(1), m.f32(0.5)
    stretch = m.div(one, s)
    shrink = m.or_(m.gt(stretch, one), m.eq(stretch, one))
    base = m.f32(_SUPPORT[plan.mode] / 2)
    support = m.select(shrink, m.mul(base, stretch), base)
    inv_scale = m.select(shrink, m.div(one, stretch), one)
    c = m.trunc_int(m.ceil(support))
    window = m.iadd(m.iadd(c, c), m.i64(1))
    center = m.add(half, m.select(m.eq(stretch, one), x, _original(m, plan, x, s, n_out, n_in, roi)))
    oob = None
    if plan.extrapolate:
        p = m.sub(center, half)
        oob = m.or_(m.lt(p, m.f32(0)), m.gt(p, m.sub(n_in, one)))
    xmin = m.trunc_int(m.floor(m.add(m.sub(center, support), half)))
    xmax = m.trunc_int(m.floor(m.add(m.add(center, support), half)))
    xmax = m.imin(m.imax(xmax, xmin), m.iadd(xmin, window))
    zero = m.i64(0)
    lo = m.imin(m.imax(xmin, zero), n_in_int)
    hi = m.imin(m.imax(xmax, zero), n_in_int)
    first, last = (lo, hi) if plan.exclude_outside else (xmin, xmax)
    return center, inv_scale, first, m.isub(last, first), lo, hi, oob


def _aa_weight(m: Any, plan: _Plan, p: Any, center: Any, inv_scale: Any) -> Any:
    """The unnormalised weight of input position p (int64) in the window around center."""
    return _aa_filter(m, plan, m.mul(m.add(m.sub(m.int_f32(p), center), m.f32(0.5)), inv_scale))


def _aa_table(plan: _Plan, axis: _Axis) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Per output coordinate of a static axis: the first input index, the tap count and the
    weights (rows padded with zeros to the largest count), and the out-of-roi flags (or None).
    Like onnxruntime, an axis whose length does not change is copied (its taps are 1:1)."""
    m = _NumpyMath()
    n_out, n_in = int(axis.n_out), int(axis.n_in)
    assert axis.scale is not None
    coords = np.arange(n_out, dtype=np.float32)
    center, inv_scale, first, count, lo, hi, oob = _aa_window(
        m, plan, coords, axis.scale, np.float32(n_out), np.float32(n_in), np.int64(n_in), axis.roi)
    first, count, lo, hi = (np.broadcast_to(v, (n_out,)) for v in (first, count, lo, hi))
    oob = None if oob is None else np.broadcast_to(oob, (n_out,))
    if n_out == n_in:
        return np.arange(n_out), np.ones(n_out, np.int64), np.ones((n_out, 1), np.float32), oob
    j = np.arange(max(int(count.max()), 1))
    pos = first[:, None] + j
    used = j < count[:, None]
    raw = np.where(used, _aa_weight(m, plan, pos, center[:, None], inv_scale), np.float32(0))
    raw = raw.astype(np.float32)
    total = raw.sum(axis=1, dtype=np.float32)
    with np.errstate(divide="ignore"):
        inv_total = np.where(total == 0, np.float32(1), np.float32(1) / total).astype(np.float32)
    # fold the weights of positions outside the input onto the edge pixels
    used &= (lo < hi)[:, None]
    rows = np.broadcast_to(np.arange(n_out)[:, None], pos.shape)
    taps = np.clip(pos, 0, n_in - 1) - lo[:, None]
    weights = np.zeros(pos.shape, np.float32)
    np.add.at(weights, (rows[used], taps[used]), raw[used])
    weights *= inv_total[:, None]
    counts = np.maximum(hi - lo, 0)
    return lo, counts, weights[:, :max(int(counts.max()), 1)], oob


# -- lowering ---------------------------------------------------------------------------------


class _Resample(Op):
    dtypes = DTYPES

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        plan = _plan(node, ctx)
        x = required_input(node, 0)
        return [TensorType(x.type.dtype, tuple(a.n_out for a in plan.axes))]

    def lower(self, node: Node, k: Emitter) -> None:
        plan = _plan(node, UNCHECKED)
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        xv, yv = k.view(x), k.view(y)
        same = [sympy.simplify(sympy.sympify(a.n_out) - a.n_in) == 0 for a in plan.axes]
        if all(same):
            k.memcpy(k.buffers[y], k.buffers[x], k.dim(x.type.nbytes))
            return
        static_differ = any(isinstance(a.n_in, int) and isinstance(a.n_out, int) and not s
                            for a, s in zip(plan.axes, same))
        if static_differ:
            _Resampler(k, plan, xv, yv, node).emit()
            return
        # equal shapes (known only at run time) are a copy, as in onnxruntime
        equal: ir.Value = ir.Constant(I1, 1)
        for a, s in zip(plan.axes, same):
            if not s:
                equal = k.b.and_(equal, k.b.icmp_signed("==", k.dim(a.n_in), k.dim(a.n_out)))
        with k.b.if_else(equal) as (copy, resample):
            with copy:
                k.memcpy(k.buffers[y], k.buffers[x], k.dim(x.type.nbytes))
            with resample:
                _Resampler(k, plan, xv, yv, node).emit()


@dataclass
class _TapLoop:
    """An antialiased axis' taps: `count` of them, tap(j) -> (input index, weight)."""

    count: ir.Value
    stride: ir.Value
    tap: Callable[[ir.Value], tuple[ir.Value, ir.Value]]


class _Resampler:
    """Emits the loop nest: one loop per output axis, outermost first; each resized axis
    contributes its taps (from a table or computed) at its own loop level."""

    def __init__(self, k: Emitter, plan: _Plan, x: View, y: View, node: Node) -> None:
        self.k, self.plan, self.x, self.y, self.node = k, plan, x, y, node
        self.dtype = x.dtype
        self.tables = 0
        #: the antialiased axes' tap loops, outermost first (each level is emitted once)
        self.aa_loops: list[_TapLoop] = []

    def emit(self) -> None:
        self._level(0, [(self.k.i64(0), None)], self.k.i64(0), None)

    def _level(self, a: int, combos: list[tuple[ir.Value, ir.Value | None]], out_off: ir.Value,
               oob: ir.Value | None) -> None:
        k = self.k
        if a == len(self.plan.axes):
            self._store(combos, out_off, oob)
            return
        axis = self.plan.axes[a]
        with k.loop(self.y.dims[a], name=f"o{a}") as o:
            out_next = k.b.add(out_off, k.b.mul(o, self.y.strides[a]))
            stride = self.x.strides[a]
            if axis.identity:
                new = [(k.b.add(off, k.b.mul(o, stride)), w) for off, w in combos]
            elif self.plan.antialias:  # a variable number of taps: a loop in `_aa_sum`
                new = combos
                axis_oob = self._aa_loop(a, axis, o)
                if axis_oob is not None:
                    oob = axis_oob if oob is None else k.b.or_(oob, axis_oob)
            else:
                taps, axis_oob = self._axis_taps(a, axis, o)
                new = []
                for (off, w), (i, tw) in itertools.product(combos, taps):
                    weight = tw if w is None else (w if tw is None else k.b.fmul(w, tw))
                    new.append((k.b.add(off, k.b.mul(i, stride)), weight))
                if axis_oob is not None:
                    oob = axis_oob if oob is None else k.b.or_(oob, axis_oob)
            self._level(a + 1, new, out_next, oob)

    def _store(self, combos: list[tuple[ir.Value, ir.Value | None]], out_off: ir.Value,
               oob: ir.Value | None) -> None:
        k = self.k
        if self.aa_loops:
            value = self._aa_sum(0, combos, k.i64(0))
        elif combos[0][1] is None:
            value = k.load_at(self.x, combos[0][0])
        else:
            value = None
            for off, w in combos:
                term = k.b.fmul(w, k.load_at(self.x, off))
                value = term if value is None else k.b.fadd(value, term)
        if oob is not None:
            value = k.b.select(oob, k.const(self.dtype, self.plan.extrapolation), value)
        k.store_at(self.y, out_off, value)

    def _aa_sum(self, level: int, combos: list[tuple[ir.Value, ir.Value | None]],
                off: ir.Value) -> ir.Value:
        """The weighted sum over the taps of antialiased axes `level`...: per axis, the sum of
        weight times the inner axes' sum (onnxruntime's order: the innermost axis first)."""
        k = self.k
        loop = self.aa_loops[level]
        acc = entry_alloca(k, F32, f"aa{level}")
        k.b.store(ir.Constant(F32, 0.0), acc)
        with k.loop(loop.count, name=f"aa{level}") as j:
            i, w = loop.tap(j)
            at = k.b.add(off, k.b.mul(i, loop.stride))
            if level + 1 < len(self.aa_loops):
                inner = self._aa_sum(level + 1, combos, at)
            else:
                inner = None
                for c_off, c_w in combos:
                    v = k.load_at(self.x, k.b.add(c_off, at))
                    term = v if c_w is None else k.b.fmul(c_w, v)
                    inner = term if inner is None else k.b.fadd(inner, term)
            k.b.store(k.b.fadd(k.b.load(acc), k.b.fmul(w, inner)), acc)
        return k.b.load(acc)

    def _aa_loop(self, a: int, axis: _Axis, o: ir.Value) -> ir.Value | None:
        """Adds axis a's tap loop (antialias) for output coordinate o; returns its out-of-roi
        flag (or None). Static axes read tables; symbolic ones compute the window here and
        the weights in the loop."""
        k = self.k
        stride = self.x.strides[a]
        if axis.static:
            lo, counts, weights, flags = _aa_table(self.plan, axis)
            first = k.b.sext(self._table(lo.astype(np.int32), I32, o), I64)
            count = k.b.sext(self._table(counts.astype(np.int32), I32, o), I64)
            flat, width = weights.reshape(-1), weights.shape[1]

            def table_tap(j: ir.Value) -> tuple[ir.Value, ir.Value]:
                w = self._table(flat, F32, k.b.add(k.b.mul(o, k.i64(width)), j))
                return k.b.add(first, j), w

            self.aa_loops.append(_TapLoop(count, stride, table_tap))
            if flags is None or not flags.any():
                return None
            return k.b.trunc(self._table(flags.astype(np.int8), ir.IntType(8), o), I1)
        m = _LLVMMath(k)
        n_in_int, n_out_int = k.dim(axis.n_in), k.dim(axis.n_out)
        n_in, n_out = m.int_f32(n_in_int), m.int_f32(n_out_int)
        s = m.f32(axis.scale) if axis.scale is not None else k.b.fdiv(n_out, n_in)
        roi = (m.f32(axis.roi[0]), m.f32(axis.roi[1]))
        center, inv_scale, first, count, lo, hi, oob = _aa_window(
            m, self.plan, m.int_f32(o), s, n_out, n_in, n_in_int, roi)
        zero, one = m.f32(0), m.f32(1)
        total = entry_alloca(k, F32, f"total{a}")
        k.b.store(zero, total)
        with k.loop(count, name=f"w{a}") as j:
            w = _aa_weight(m, self.plan, k.b.add(first, j), center, inv_scale)
            k.b.store(k.b.fadd(k.b.load(total), w), total)
        sum_w = k.b.load(total)
        inv_total = k.b.select(k.b.fcmp_ordered("==", sum_w, zero), one, k.b.fdiv(one, sum_w))
        copy = k.b.icmp_signed("==", n_in_int, n_out_int)  # onnxruntime copies such an axis
        inside = k.b.select(k.b.icmp_signed("<", lo, hi), count, k.i64(0))
        last = k.b.sub(n_in_int, k.i64(1))

        def computed_tap(j: ir.Value) -> tuple[ir.Value, ir.Value]:
            p = k.b.add(first, j)
            i = m.imin(m.imax(p, m.i64(0)), last)  # outside positions stand for the edge pixels
            w = k.b.fmul(_aa_weight(m, self.plan, p, center, inv_scale), inv_total)
            return k.b.select(copy, o, i), k.b.select(copy, one, w)

        self.aa_loops.append(_TapLoop(k.b.select(copy, k.i64(1), inside), stride, computed_tap))
        return oob

    def _axis_taps(self, a: int, axis: _Axis,
                   o: ir.Value) -> tuple[list[tuple[ir.Value, ir.Value | None]], ir.Value | None]:
        k = self.k
        if axis.static:
            return self._table_taps(a, axis, o)
        m = _LLVMMath(k)
        n_in_int = k.dim(axis.n_in)
        n_in, n_out = m.int_f32(n_in_int), m.int_f32(k.dim(axis.n_out))
        if axis.scale is not None:
            s = m.f32(axis.scale)
            s_is_one = ir.Constant(I1, 0)
        else:
            s = k.b.fdiv(n_out, n_in)
            s_is_one = k.b.fcmp_ordered("==", s, m.f32(1))
        roi = (m.f32(axis.roi[0]), m.f32(axis.roi[1]))
        return _taps(m, self.plan, m.int_f32(o), s, n_out, n_in, n_in_int, roi, s_is_one)

    def _table_taps(self, a: int, axis: _Axis,
                    o: ir.Value) -> tuple[list[tuple[ir.Value, ir.Value | None]], ir.Value | None]:
        k = self.k
        m = _NumpyMath()
        n_out, n_in = int(axis.n_out), int(axis.n_in)
        assert axis.scale is not None
        coords = np.arange(n_out, dtype=np.float32)
        taps, oob = _taps(m, self.plan, coords, axis.scale, np.float32(n_out), np.float32(n_in),
                          np.int64(n_in), axis.roi, np.False_)
        result: list[tuple[ir.Value, ir.Value | None]] = []
        for i, w in taps:
            idx = self._table(np.broadcast_to(i, (n_out,)).astype(np.int32), I32, o)
            weight = None if w is None else self._table(
                np.broadcast_to(w, (n_out,)).astype(np.float32), F32, o)
            result.append((k.b.sext(idx, I64), weight))
        flag = None
        if oob is not None:
            flags = np.broadcast_to(oob, (n_out,))
            if flags.any():
                flag = k.b.trunc(self._table(flags.astype(np.int8), ir.IntType(8), o), I1)
        return result, flag

    def _table(self, values: np.ndarray, ty: ir.Type, o: ir.Value) -> ir.Value:
        k = self.k
        if np.all(values == values[0]):
            return ir.Constant(ty, values[0].item())
        arr_ty = ir.ArrayType(ty, len(values))
        name = f"{k.function.name}.table{self.tables}"
        self.tables += 1
        g = ir.GlobalVariable(k.module, arr_ty, name)
        g.linkage = "private"
        g.global_constant = True
        g.unnamed_addr = True
        g.initializer = ir.Constant(arr_ty, [v.item() for v in values])
        ptr = k.b.gep(g, [k.i64(0), o], inbounds=True, source_etype=arr_ty)
        return k.b.load(ptr, typ=ty)


@register
class Resize(_Resample):
    op_type = "Resize"
    since = 10


@register
class Upsample(_Resample):
    op_type = "Upsample"
    since = 7
