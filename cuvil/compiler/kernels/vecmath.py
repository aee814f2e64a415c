"""Branch-free exp, expm1, log, log1p, tanh, erf (and sigmoid, softplus) in LLVM IR.

LLVM turns `llvm.exp` and friends into calls to libm, and a loop that calls a function does
not vectorize. The functions here are written with arithmetic, bit operations and `select`
only, so an elementwise loop over them becomes SIMD code. They take an IRBuilder and a
`float` or `double` value, or a vector of them (the GEMM kernel's epilogue works on whole
registers), and return a value of the same type; float16 callers compute in float32.

Method (classic table-free elementary-function design; see J.-M. Muller, "Elementary
Functions: Algorithms and Implementation", ch. 2-3 and 11, and W. Cody & W. Waite, "Software
Manual for the Elementary Functions", 1980):

* exp: n = round(x / ln2) with the "add 1.5*2^p, subtract it again" rounding trick, the
  reduced argument r = x - n*ln2 computed with ln2 split in a short high part (exact
  products) and a low part (Cody-Waite), e^r = 1 + r + r^2 P(r) on |r| <= ln2/2, and the
  scaling by 2^n done as two multiplications by 2^(n/2) so that results that overflow or
  are subnormal come out correctly rounded from one final multiplication. `exp_nonpositive`
  (softmax's exp(x - max)) skips the upper clamp and scales by 2^n at once, flushing
  results below the normal range to 0.
* log: x = m * 2^e with m in [sqrt(1/2), sqrt(2)) taken from the bits (subnormals first
  scaled by 2^23 / 2^52); with f = m - 1, log(1+f) = f - f^2/2 + f^3 P(f) (float) or
  2s + s^3 R(s^2), s = f/(2+f) (double: the atanh series); then + e*ln2 in two parts.
* tanh, erf (float): odd rational functions x P(x^2) / Q(x^2) on |x| <= 9 (tanh) and
  |x| <= 3.95 (erf), the input clamped there (beyond, both round to +-1 in float32). One
  division and a dozen FMAs: several times cheaper than going through exp, at a few ulp.
* expm1, log1p: the small-argument polynomial of exp for |x| < ln2/2, else exp(x) - 1;
  log1p(x) = log(1+x) + (x - ((1+x) - 1)) / (1+x), the second term restoring what rounding
  1+x lost.

The float32 polynomials are minimax fits (relative error, Lawson's iteratively reweighted
least squares on Chebyshev nodes, mpmath for the reference values) rounded to float32; the
rational ones are fitted the same way after linearizing P/Q ~ f as P - f Q ~ 0 with weights
1/Q of the previous iterate (Sanathanan-Koerner), then Q is rounded and P refitted.
`derive_coefficients()` recomputes them (`python -m cuvil.compiler.kernels.vecmath`). The
float64 polynomials are the truncated Taylor series (1/k! and 2/(2k+3)), whose truncation
error is below 1e-17 on the reduced ranges. Measured against numpy/mpmath over dense sweeps
(tests/ops/test_elementwise.py), for normal results: float32 exp, log within 1 ulp, expm1,
log1p, sigmoid, softplus within 3.5 ulp, tanh and erf within 6 ulp (relative error < 4e-7);
float64 exp, log, log1p within 2 ulp, the rest within 4. inf, NaN (any payload), +-0,
overflow and underflow are handled explicitly; sigmoid flushes results below the normal
range to 0.
float64 tanh and erf are left to libm (accuracy first; rarely hot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from llvmlite import ir

__all__ = [
    "derive_coefficients",
    "erf",
    "exp",
    "exp_nonpositive",
    "expm1",
    "log",
    "log1p",
    "sigmoid",
    "softplus",
    "tanh",
]

# -- coefficients (see derive_coefficients) ---------------------------------------------------

#: e^r = 1 + r + r^2 P(r), |r| <= ln2/2 (max relative error of the fit 3.1e-9)
EXP_P32 = (0.4999999403953552, 0.1666652113199234, 0.04166838899254799, 0.008368710055947304,
           0.001381461275741458)
#: log(1+f) = f - f^2/2 + f^3 P(f), f in [sqrt(1/2)-1, sqrt(2)-1] (fit error 5.8e-9)
LOG_P32 = (0.3333333134651184, -0.2500081956386566, 0.20001226663589478, -0.16623356938362122,
           0.14201757311820984, -0.13160182535648346, 0.1276157647371292, -0.07634496688842773)
#: tanh(x) = x P(x^2) / Q(x^2), |x| <= 9 (fit error 6.2e-8)
TANH_P32 = (1.0, 0.12922488152980804, 0.002924117026850581, 9.295302334066946e-06,
            -1.2854203035317369e-08, 1.842010745323197e-11)
TANH_Q32 = (1.0, 0.4625578820705414, 0.023777298629283905, 0.0002285451628267765)
TANH_CLAMP = 9.0
#: erf(x) = x P(x^2) / Q(x^2), |x| <= 3.95 (fit error 5.9e-8)
ERF_P32 = (1.128379225730896, 0.20111429691314697, 0.05072681978344917, 0.003743415931239724,
           0.00014211589586921036, -1.9421715933276573e-06, 1.9602412137942338e-08)
ERF_Q32 = (1.0, 0.5115650296211243, 0.11548493057489395, 0.014448157511651516,
           0.0009636933682486415)
ERF_CLAMP = 3.95

_FACT = [1.0]
for _k in range(1, 16):
    _FACT.append(_FACT[-1] * _k)
#: e^r = 1 + r + r^2 P(r): Taylor, terms r^2/2! .. r^13/13!
EXP_P64 = tuple(1.0 / _FACT[k + 2] for k in range(12))
#: log(1+f) = 2s + s^3 R(s^2), s = f/(2+f): R(w) = sum 2/(2k+3) w^k
LOG_R64 = tuple(2.0 / (2 * k + 3) for k in range(10))


@dataclass(frozen=True)
class _Format:
    """What the bit tricks need to know about a binary floating-point format."""

    ty: ir.Type
    ity: ir.IntType
    mant: int  # explicit mantissa bits
    bias: int
    exp_lo: float  # exp(x) for x below this is 0 (after rounding); clamp point
    exp_hi: float  # exp(x) for x above this is inf; clamp point
    min_normal: float
    min_exp: float  # ln(min_normal) rounded up: exp(x) is normal from here on
    ln2_hi: float  # ln2 with enough trailing zeros that n*ln2_hi is exact
    ln2_lo: float
    sqrt_half_bits: int  # bit pattern of sqrt(1/2)


_F32 = _Format(ir.FloatType(), ir.IntType(32), 23, 127, -104.0, 89.0, 2.0 ** -126, -87.33654,
               0.693359375, -2.12194440e-4, 0x3F3504F3)
_F64 = _Format(ir.DoubleType(), ir.IntType(64), 52, 1023, -746.0, 710.0, 2.0 ** -1022,
               -708.3964, 0.6931471803691238, 1.9082149292705877e-10, 0x3FE6A09E667F3BCD)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _fmt(x: ir.Value) -> _Format:
    ty = x.type.element if isinstance(x.type, ir.VectorType) else x.type
    if isinstance(ty, ir.FloatType):
        return _F32
    if isinstance(ty, ir.DoubleType):
        return _F64
    raise TypeError(f"vecmath works on float and double values (or vectors of them), not {x.type}")


class _M:
    """Shorthands over an IRBuilder for one floating-point format."""

    def __init__(self, b: ir.IRBuilder, x: ir.Value) -> None:
        self.b = b
        self.f = _fmt(x)
        #: lanes of a vector argument (the GEMM kernel's epilogue), 0 for a scalar
        self.lanes = x.type.count if isinstance(x.type, ir.VectorType) else 0
        self.ty = self._vec(self.f.ty)
        self.ity = self._vec(self.f.ity)

    def _vec(self, ty: ir.Type) -> ir.Type:
        return ir.VectorType(ty, self.lanes) if self.lanes else ty

    def _splat(self, scalar: ir.Constant) -> ir.Constant:
        return ir.Constant(self._vec(scalar.type), [scalar] * self.lanes) if self.lanes else scalar

    def c(self, v: float) -> ir.Constant:
        return self._splat(ir.Constant(self.f.ty, v))

    def ci(self, v: int) -> ir.Constant:
        return self._splat(ir.Constant(self.f.ity, v))

    def call(self, name: str, *args: ir.Value) -> ir.Value:
        """An overloaded LLVM intrinsic on this format (llvm.fabs -> llvm.fabs.f32, or
        llvm.fabs.v8f32 on vectors)."""
        elem = "f32" if self.f is _F32 else "f64"
        full = f"{name}.{f'v{self.lanes}{elem}' if self.lanes else elem}"
        fn = self.b.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.b.module, ir.FunctionType(self.ty, [self.ty] * len(args)), full)
        return self.b.call(fn, list(args))

    def fabs(self, x: ir.Value) -> ir.Value:
        return self.call("llvm.fabs", x)

    def copysign(self, mag: ir.Value, sign: ir.Value) -> ir.Value:
        return self.call("llvm.copysign", mag, sign)

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a*b + c, fused where the target has FMA."""
        return self.call("llvm.fmuladd", a, b, c)

    def horner(self, coeffs: tuple[float, ...], t: ir.Value) -> ir.Value:
        acc: ir.Value = self.c(coeffs[-1])
        for co in reversed(coeffs[:-1]):
            acc = self.fma(acc, t, self.c(co))
        return acc

    def lt(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fcmp_ordered("<", a, b)

    def gt(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fcmp_ordered(">", a, b)

    def isnan(self, x: ir.Value) -> ir.Value:
        return self.b.fcmp_unordered("uno", x, x)

    def pow2(self, n: ir.Value) -> ir.Value:
        """2^n for an integer n in the normal exponent range."""
        f = self.f
        bits = self.b.shl(self.b.add(n, self.ci(f.bias)), self.ci(f.mant))
        return self.b.bitcast(bits, self.ty)


# -- exp, expm1 ------------------------------------------------------------------------------


def _exp_reduce(m: _M, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """For a finite x in the clamp range: (n, r) with x = n*ln2 + r, |r| <= ln2/2."""
    b, f = m.b, m.f
    shifter = m.c(1.5 * 2.0 ** f.mant)
    # adding 1.5*2^p rounds x/ln2 to an integer in the low mantissa bits (round to nearest)
    t = b.fadd(b.fmul(x, m.c(LOG2E)), shifter)
    nf = b.fsub(t, shifter)
    n = b.sub(b.bitcast(t, m.ity), b.bitcast(shifter, m.ity))
    r = m.fma(nf, m.c(-f.ln2_hi), x)
    r = m.fma(nf, m.c(-f.ln2_lo), r)
    return n, r


def _expm1_poly(m: _M, r: ir.Value) -> ir.Value:
    """e^r - 1 = r + r^2 P(r) for |r| <= ln2/2."""
    p = m.horner(EXP_P32 if m.f is _F32 else EXP_P64, r)
    return m.fma(m.b.fmul(r, r), p, r)


def exp(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    f = m.f
    # the clamps keep NaN; a NaN then flows through as NaN (its n is garbage but finite
    # integer arithmetic, and NaN times any scale is NaN)
    xc = b.select(m.gt(x, m.c(f.exp_hi)), m.c(f.exp_hi), x)
    xc = b.select(m.lt(xc, m.c(f.exp_lo)), m.c(f.exp_lo), xc)
    n, r = _exp_reduce(m, xc)
    y = b.fadd(_expm1_poly(m, r), m.c(1.0))
    # 2^n in two factors: n reaches -150 (subnormal results) and +128 (overflow to inf)
    n1 = b.ashr(n, m.ci(1))
    return b.fmul(b.fmul(y, m.pow2(n1)), m.pow2(b.sub(n, n1)))


def exp_nonpositive(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """exp(x) for x <= 0 (softmax's x - max), cheaper than `exp`: no upper clamp and 2^n in
    one factor, results below the normal range flushed to 0. NaN stays NaN; x > 0 is not
    supported (wrong past ~88)."""
    m = _M(b, x)
    f = m.f
    # below ln(min_normal) exp(x) is subnormal: 0 instead (|error| < min_normal)
    tiny = m.lt(x, m.c(f.min_exp))
    n, r = _exp_reduce(m, b.select(tiny, m.c(0.0), x))
    y = b.fmul(b.fadd(_expm1_poly(m, r), m.c(1.0)), m.pow2(n))
    return b.select(tiny, m.c(0.0), y)


def expm1(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    small = m.lt(m.fabs(x), m.c(LN2 / 2))
    near = _expm1_poly(m, b.select(small, x, m.c(0.0)))
    far = b.fsub(exp(b, x), m.c(1.0))
    # expm1 has the sign of x (keeps -0 and tiny negatives exact)
    return m.copysign(b.select(small, near, far), x)


# -- log, log1p ------------------------------------------------------------------------------


def log(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    f = m.f
    one = f.bias << f.mant  # bits of 1.0
    sub = m.lt(x, m.c(f.min_normal))
    xs = b.select(sub, b.fmul(x, m.c(2.0 ** f.mant)), x)
    # shift the bits so that the exponent field flips where m crosses sqrt(2)
    ix = b.add(b.bitcast(xs, m.ity), m.ci(one - f.sqrt_half_bits))
    e = b.sub(b.ashr(ix, m.ci(f.mant)), m.ci(f.bias))
    e = b.sub(e, b.select(sub, m.ci(f.mant), m.ci(0)))
    mbits = b.add(b.and_(ix, m.ci((1 << f.mant) - 1)), m.ci(f.sqrt_half_bits))
    fr = b.fsub(b.bitcast(mbits, m.ty), m.c(1.0))  # exact
    ef = b.sitofp(e, m.ty)
    if f is _F32:
        f2 = b.fmul(fr, fr)
        y = b.fmul(b.fmul(f2, fr), m.horner(LOG_P32, fr))
        y = m.fma(m.c(-0.5), f2, y)
        y = m.fma(ef, m.c(f.ln2_lo), y)
        y = b.fadd(y, fr)
    else:
        s = b.fdiv(fr, b.fadd(fr, m.c(2.0)))
        s2 = b.fmul(s, s)
        y = b.fmul(b.fmul(s2, s), m.horner(LOG_R64, s2))
        y = m.fma(ef, m.c(f.ln2_lo), y)
        y = b.fadd(y, b.fadd(s, s))
    y = m.fma(ef, m.c(f.ln2_hi), y)
    # special cases: log(<0) = NaN, log(+-0) = -inf, log(inf) = inf, NaN stays
    y = b.select(m.lt(x, m.c(0.0)), m.c(float("nan")), y)
    y = b.select(b.fcmp_ordered("==", x, m.c(0.0)), m.c(float("-inf")), y)
    y = b.select(b.fcmp_ordered("==", x, m.c(float("inf"))), x, y)
    return b.select(m.isnan(x), x, y)


def log1p(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    u = b.fadd(x, m.c(1.0))
    correction = b.fdiv(b.fsub(x, b.fsub(u, m.c(1.0))), u)
    # the correction is meaningless (0/0, inf-inf) at u = 0 or huge x, and not needed there
    usable = b.and_(m.lt(m.fabs(x), m.c(2.0 ** (m.f.mant + 1))),
                    b.fcmp_ordered("!=", u, m.c(0.0)))
    y = b.fadd(log(b, u), b.select(usable, correction, m.c(0.0)))
    # log1p has the sign of x on its domain (keeps -0)
    return m.copysign(y, x)


# -- tanh, erf -------------------------------------------------------------------------------


def _odd_rational(m: _M, x: ir.Value, p: tuple[float, ...], q: tuple[float, ...],
                  clamp: float) -> ir.Value:
    """x P(x^2) / Q(x^2) with x clamped to [-clamp, clamp], the result to [-1, 1] (rounding
    puts it a hair above 1 near the clamp). NaN stays NaN."""
    b = m.b
    x = b.select(m.gt(x, m.c(clamp)), m.c(clamp), x)
    x = b.select(m.lt(x, m.c(-clamp)), m.c(-clamp), x)
    z = b.fmul(x, x)
    y = b.fdiv(b.fmul(x, m.horner(p, z)), m.horner(q, z))
    y = b.select(m.gt(y, m.c(1.0)), m.c(1.0), y)
    return b.select(m.lt(y, m.c(-1.0)), m.c(-1.0), y)


def tanh(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    if m.f is _F64:
        return m.call("llvm.tanh", x)
    return _odd_rational(m, x, TANH_P32, TANH_Q32, TANH_CLAMP)


def erf(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    if m.f is _F64:
        assert not m.lanes, "float64 erf is libm's, one value at a time"
        fn = b.module.globals.get("erf")
        if fn is None:
            fn = ir.Function(b.module, ir.FunctionType(m.f.ty, [m.f.ty]), "erf")
        return b.call(fn, [x])
    return _odd_rational(m, x, ERF_P32, ERF_Q32, ERF_CLAMP)


# -- compositions ----------------------------------------------------------------------------


def _exp_normal(m: _M, x: ir.Value) -> ir.Value:
    """e^x for callers that only need normal results: x is clamped to the range where e^x
    is a normal number, and 2^n goes straight into the exponent bits (no two-step scale).
    A NaN x gives garbage: callers select it away."""
    b, f = m.b, m.f
    lo = -86.6 if f is _F32 else -707.7  # e^lo > 2^(2 - bias): the result stays normal
    hi = 88.72 if f is _F32 else 709.78  # just below log(max)
    xc = b.select(m.gt(x, m.c(hi)), m.c(hi), x)
    xc = b.select(m.lt(xc, m.c(lo)), m.c(lo), xc)
    n, r = _exp_reduce(m, xc)
    y = b.fadd(_expm1_poly(m, r), m.c(1.0))
    bits = b.add(b.bitcast(y, m.ity), b.shl(n, m.ci(f.mant)))
    return b.bitcast(bits, m.ty)


def sigmoid(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1/(1+e^-x): accurate in relative terms wherever the result is a normal number (for
    x < 0 the error is e^-x's); results below the normal range (x < -88.7, or -709.8 for
    double) flush to 0."""
    m = _M(b, x)
    hi = 88.72 if m.f is _F32 else 709.78
    e = _exp_normal(m, b.fneg(x))
    r = b.fdiv(m.c(1.0), b.fadd(e, m.c(1.0)))
    r = b.select(m.lt(x, m.c(-hi)), m.c(0.0), r)
    return b.select(m.isnan(x), x, r)


def softplus(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """log(1 + e^x) = max(x, 0) + log1p(e^-|x|)."""
    m = _M(b, x)
    pos = b.select(m.gt(x, m.c(0.0)), x, m.c(0.0))
    pos = b.select(m.isnan(x), x, pos)
    return b.fadd(pos, log1p(b, exp(b, b.fneg(m.fabs(x)))))


# -- derivation of the float32 coefficients ------------------------------------------------


def derive_coefficients() -> dict[str, tuple[float, ...]]:  # pragma: no cover - a tool
    """Recompute the float32 minimax polynomials (needs numpy and mpmath; a few seconds)."""
    import mpmath as mp
    import numpy as np

    mp.mp.dps = 40

    def nodes(lo: float, hi: float, n: int = 2000) -> np.ndarray:
        t = np.cos(np.pi * (np.arange(n) + 0.5) / n)
        return np.sort(lo + (hi - lo) * (t + 1) / 2)

    def linear_minimax(a: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
        """min over c of max |a c - y| (Lawson's algorithm), c rounded to float32."""
        w = np.full(len(y), 1.0 / len(y))
        best, best_err = None, np.inf
        for _ in range(300):
            sw = np.sqrt(w)
            c = np.linalg.lstsq(a * sw[:, None], y * sw, rcond=None)[0]
            err = np.abs(a @ c - y)
            if err.max() < best_err:
                best, best_err = c, err.max()
            w = w * err
            w /= w.sum()
        assert best is not None
        return tuple(float(np.float32(v)) for v in best)

    def fit(target: np.ndarray, basis: np.ndarray, degree: int,
            weight: np.ndarray) -> tuple[float, ...]:
        """A polynomial in `basis` minimizing max |weight * (P - target)|."""
        a = np.stack([basis ** i for i in range(degree + 1)], 1) * weight[:, None]
        return linear_minimax(a, target * weight)

    def mpv(fn: Callable[[Any], Any], xs: np.ndarray) -> np.ndarray:
        return np.array([float(fn(mp.mpf(float(v)))) for v in xs])

    def rational(x: np.ndarray, target: np.ndarray, t: np.ndarray, np_: int, nq: int,
                 p0: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """P(t)/Q(t) ~ target in relative error, P(0) = p0, Q(0) = 1; float32 coefficients."""
        bp = np.stack([t ** i for i in range(1, np_ + 1)], 1)
        bq = np.stack([t ** i for i in range(1, nq + 1)], 1)
        q = np.ones_like(x)
        w = np.full(len(x), 1.0 / len(x))
        best, best_err = None, np.inf
        for _ in range(200):
            s = np.sqrt(w) / (q * target)
            a = np.concatenate([bp, -target[:, None] * bq], 1) * s[:, None]
            c = np.linalg.lstsq(a, (target - p0) * s, rcond=None)[0]
            num, q = p0 + bp @ c[:np_], 1 + bq @ c[np_:]
            err = np.abs(num / q / target - 1)
            if err.max() < best_err:
                best, best_err = c, err.max()
            w = w * err
            w /= w.sum()
        assert best is not None
        qc = tuple(float(np.float32(v)) for v in best[np_:])
        qv = 1 + bq @ np.array(qc)
        assert qv.min() > 0, "the denominator has a zero in the range"
        # numerator refitted against the rounded denominator: linear in P
        pc = linear_minimax(bp / (qv * target)[:, None], 1 - p0 / (qv * target))
        return (float(np.float32(p0)), *pc), (1.0, *qc)

    out = {}
    r = nodes(-LN2 / 2, LN2 / 2)
    r = r[r != 0]
    out["EXP_P32"] = fit(mpv(lambda t: (mp.exp(t) - 1 - t) / t ** 2, r), r, 4, r ** 2 / np.exp(r))
    f = nodes(float(np.sqrt(0.5) - 1), float(np.sqrt(2) - 1))
    f = f[f != 0]
    out["LOG_P32"] = fit(mpv(lambda t: (mp.log1p(t) - t + t ** 2 / 2) / t ** 3, f), f, 7,
                         np.abs(f ** 3 / np.log1p(f)))
    x = nodes(1e-4, TANH_CLAMP, 3000)
    out["TANH_P32"], out["TANH_Q32"] = rational(x, mpv(lambda t: mp.tanh(t) / t, x), x * x, 5, 3, 1.0)
    x = nodes(1e-4, ERF_CLAMP, 3000)
    out["ERF_P32"], out["ERF_Q32"] = rational(x, mpv(lambda t: mp.erf(t) / t, x), x * x, 6, 4,
                                              2 / np.sqrt(np.pi))
    return out


if __name__ == "__main__":  # pragma: no cover
    for name, coeffs in derive_coefficients().items():
        print(f"{name} = {coeffs!r}")
