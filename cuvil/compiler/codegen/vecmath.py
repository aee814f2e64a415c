"""Branch-free exp, expm1, log, log1p, tanh, erf (and sigmoid, softplus) in LLVM IR.

LLVM turns `llvm.exp` and friends into calls to libm, and a loop that calls a function does
not vectorize. The functions here are written with arithmetic, bit operations and `select`
only, so an elementwise loop over them becomes SIMD code. They take an IRBuilder and a
`float` or `double` value and return a value of the same type; float16 callers compute in
float32.

Method (classic table-free elementary-function design; see J.-M. Muller, "Elementary
Functions: Algorithms and Implementation", ch. 2-3 and 11, and W. Cody & W. Waite, "Software
Manual for the Elementary Functions", 1980):

* exp: n = round(x / ln2) with the "add 1.5*2^p, subtract it again" rounding trick, the
  reduced argument r = x - n*ln2 computed with ln2 split in a short high part (exact
  products) and a low part (Cody-Waite), e^r = 1 + r + r^2 P(r) on |r| <= ln2/2, and the
  scaling by 2^n done as two multiplications by 2^(n/2) so that results that overflow or
  are subnormal come out correctly rounded from one final multiplication.
* log: x = m * 2^e with m in [sqrt(1/2), sqrt(2)) taken from the bits (subnormals first
  scaled by 2^23 / 2^52); with f = m - 1, log(1+f) = f - f^2/2 + f^3 P(f) (float) or
  2s + s^3 R(s^2), s = f/(2+f) (double: the atanh series); then + e*ln2 in two parts.
* tanh: |x| < 0.8: x + x^3 P(x^2); else 1 - 2/(e^(2|x|) + 1); the sign restored last.
* erf (float): |x| < 0.9: x + x Q(x^2); else 1 - exp(-x^2 + H(|x|)) where H approximates
  log(erfc(x)) + x^2, a smooth slowly varying function, on [0.9, 4] (erf rounds to 1 above).
* expm1, log1p: the small-argument polynomial of exp for |x| < ln2/2, else exp(x) - 1;
  log1p(x) = log(1+x) + (x - ((1+x) - 1)) / (1+x), the second term restoring what rounding
  1+x lost.

The float32 polynomials are minimax fits (relative error, Lawson's iteratively reweighted
least squares on Chebyshev nodes, mpmath for the reference values) rounded to float32;
`derive_coefficients()` recomputes them (`python -m cuvil.compiler.codegen.vecmath`). The
float64 polynomials are the truncated Taylor series (1/k! and 2/(2k+3)), whose truncation
error is below 1e-17 on the reduced ranges. Measured against numpy/mpmath over dense sweeps
(tests/ops/test_elementwise.py) the float32 functions are within about 2 ulp (relative
error < 3e-7) for normal results; inf, NaN, +-0, overflow and underflow are handled
explicitly. float64 tanh and erf are left to libm (accuracy first; rarely hot).
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

__all__ = [
    "derive_coefficients",
    "erf",
    "exp",
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
#: tanh(x) = x + x^3 P(x^2), |x| < 0.8
TANH_P32 = (-0.33333298563957214, 0.13332220911979675, -0.05385233089327812, 0.02130299247801304,
            -0.007409558165818453, 0.0015847566537559032)
#: erf(x) = x + x Q(x^2), |x| < 0.9
ERF_Q32 = (0.12837915122509003, -0.3761252462863922, 0.11282140761613846, -0.026778914034366608,
           0.0050119683146476746, -0.000609038514085114)
#: erf(x) = 1 - exp(H(x - 2.45) - x^2), 0.9 <= x <= 4
ERF_H32 = (-1.5390427112579346, -0.3583887815475464, 0.05778377130627632, -0.01112978532910347,
           0.0026101593393832445, -0.00015166126831900328, 0.00019821966998279095)

TANH_SMALL = 0.8
ERF_SMALL = 0.9
ERF_BIG = 4.0
ERF_CENTER = (ERF_SMALL + ERF_BIG) / 2

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
    ln2_hi: float  # ln2 with enough trailing zeros that n*ln2_hi is exact
    ln2_lo: float
    sqrt_half_bits: int  # bit pattern of sqrt(1/2)


_F32 = _Format(ir.FloatType(), ir.IntType(32), 23, 127, -104.0, 89.0, 2.0 ** -126,
               0.693359375, -2.12194440e-4, 0x3F3504F3)
_F64 = _Format(ir.DoubleType(), ir.IntType(64), 52, 1023, -746.0, 710.0, 2.0 ** -1022,
               0.6931471803691238, 1.9082149292705877e-10, 0x3FE6A09E667F3BCD)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _fmt(x: ir.Value) -> _Format:
    if isinstance(x.type, ir.FloatType):
        return _F32
    if isinstance(x.type, ir.DoubleType):
        return _F64
    raise TypeError(f"vecmath works on float and double values, not {x.type}")


class _M:
    """Shorthands over an IRBuilder for one floating-point format."""

    def __init__(self, b: ir.IRBuilder, x: ir.Value) -> None:
        self.b = b
        self.f = _fmt(x)

    def c(self, v: float) -> ir.Constant:
        return ir.Constant(self.f.ty, v)

    def ci(self, v: int) -> ir.Constant:
        return ir.Constant(self.f.ity, v)

    def call(self, name: str, *args: ir.Value) -> ir.Value:
        """An overloaded LLVM intrinsic on this format (llvm.fabs -> llvm.fabs.f32)."""
        full = f"{name}.{'f32' if self.f is _F32 else 'f64'}"
        fn = self.b.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.b.module, ir.FunctionType(self.f.ty, [self.f.ty] * len(args)), full)
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
        return self.b.bitcast(bits, f.ty)


# -- exp, expm1 ------------------------------------------------------------------------------


def _exp_reduce(m: _M, x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """For a finite x in the clamp range: (n, r) with x = n*ln2 + r, |r| <= ln2/2."""
    b, f = m.b, m.f
    shifter = m.c(1.5 * 2.0 ** f.mant)
    # adding 1.5*2^p rounds x/ln2 to an integer in the low mantissa bits (round to nearest)
    t = b.fadd(b.fmul(x, m.c(LOG2E)), shifter)
    nf = b.fsub(t, shifter)
    n = b.sub(b.bitcast(t, f.ity), b.bitcast(shifter, f.ity))
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
    nan = m.isnan(x)
    xc = b.select(m.gt(x, m.c(f.exp_hi)), m.c(f.exp_hi), x)
    xc = b.select(m.lt(xc, m.c(f.exp_lo)), m.c(f.exp_lo), xc)
    xc = b.select(nan, m.c(0.0), xc)
    n, r = _exp_reduce(m, xc)
    y = b.fadd(_expm1_poly(m, r), m.c(1.0))
    # 2^n in two factors: n reaches -150 (subnormal results) and +128 (overflow to inf)
    n1 = b.ashr(n, m.ci(1))
    y = b.fmul(b.fmul(y, m.pow2(n1)), m.pow2(b.sub(n, n1)))
    return b.select(nan, x, y)


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
    ix = b.add(b.bitcast(xs, f.ity), m.ci(one - f.sqrt_half_bits))
    e = b.sub(b.ashr(ix, m.ci(f.mant)), m.ci(f.bias))
    e = b.sub(e, b.select(sub, m.ci(f.mant), m.ci(0)))
    mbits = b.add(b.and_(ix, m.ci((1 << f.mant) - 1)), m.ci(f.sqrt_half_bits))
    fr = b.fsub(b.bitcast(mbits, f.ty), m.c(1.0))  # exact
    ef = b.sitofp(e, f.ty)
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


def tanh(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    if m.f is _F64:
        return m.call("llvm.tanh", x)
    a = m.fabs(x)
    z = b.fmul(a, a)
    near = m.fma(b.fmul(a, z), m.horner(TANH_P32, z), a)
    e = exp(b, b.fadd(a, a))
    far = b.fsub(m.c(1.0), b.fdiv(m.c(2.0), b.fadd(e, m.c(1.0))))
    return m.copysign(b.select(m.lt(a, m.c(TANH_SMALL)), near, far), x)


def erf(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    m = _M(b, x)
    if m.f is _F64:
        fn = b.module.globals.get("erf")
        if fn is None:
            fn = ir.Function(b.module, ir.FunctionType(m.f.ty, [m.f.ty]), "erf")
        return b.call(fn, [x])
    a = m.fabs(x)
    a = b.select(m.gt(a, m.c(ERF_BIG)), m.c(ERF_BIG), a)  # keeps NaN
    z = b.fmul(a, a)
    near = m.fma(a, m.horner(ERF_Q32, z), a)
    h = m.horner(ERF_H32, b.fsub(a, m.c(ERF_CENTER)))
    far = b.fsub(m.c(1.0), exp(b, b.fsub(h, z)))
    return m.copysign(b.select(m.lt(a, m.c(ERF_SMALL)), near, far), x)


# -- compositions ----------------------------------------------------------------------------


def sigmoid(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """1/(1+e^-x), with e^-|x| so that neither side overflows or cancels."""
    m = _M(b, x)
    e = exp(b, b.fneg(m.fabs(x)))
    r = b.fdiv(m.c(1.0), b.fadd(e, m.c(1.0)))
    return b.select(b.fcmp_ordered(">=", x, m.c(0.0)), r, b.fmul(e, r))


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

    def fit(x: np.ndarray, target: np.ndarray, basis: np.ndarray, degree: int,
            weight: np.ndarray) -> tuple[float, ...]:
        """min over c of max |weight * (sum c_i basis^i - target)| by Lawson's algorithm."""
        a = np.stack([basis ** i for i in range(degree + 1)], 1) * weight[:, None]
        y = target * weight
        w = np.full(len(x), 1.0 / len(x))
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

    def mpv(fn, xs):
        return np.array([float(fn(mp.mpf(float(v)))) for v in xs])

    out = {}
    r = nodes(-LN2 / 2, LN2 / 2)
    r = r[r != 0]
    out["EXP_P32"] = fit(r, mpv(lambda t: (mp.exp(t) - 1 - t) / t ** 2, r), r, 4, r ** 2 / np.exp(r))
    f = nodes(float(np.sqrt(0.5) - 1), float(np.sqrt(2) - 1))
    f = f[f != 0]
    out["LOG_P32"] = fit(f, mpv(lambda t: (mp.log1p(t) - t + t ** 2 / 2) / t ** 3, f), f, 7,
                         np.abs(f ** 3 / np.log1p(f)))
    x = nodes(1e-4, TANH_SMALL)
    out["TANH_P32"] = fit(x, mpv(lambda t: (mp.tanh(t) - t) / t ** 3, x), x * x, 5,
                          x ** 3 / np.tanh(x))
    x = nodes(1e-4, ERF_SMALL)
    erf_x = mpv(mp.erf, x)
    out["ERF_Q32"] = fit(x, erf_x / x - 1, x * x, 5, x / erf_x)
    x = nodes(ERF_SMALL, ERF_BIG)
    out["ERF_H32"] = fit(x, mpv(lambda t: mp.log(mp.erfc(t)) + t ** 2, x), x - ERF_CENTER, 6,
                         mpv(lambda t: mp.erfc(t) / mp.erf(t), x))
    return out


if __name__ == "__main__":  # pragma: no cover
    for name, coeffs in derive_coefficients().items():
        print(f"{name} = {coeffs!r}")
