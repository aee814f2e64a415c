"""Elementwise ops against onnxruntime: every op in each dtype it takes, under every kind of
broadcasting (same shape, row, column, scalar, rank mismatch, both sides), symbolic dims
checked at two sizes, edge values (inf, NaN, +-0, huge, tiny), non-default attributes; the
dtypes onnxruntime has no kernel for are checked against onnx's reference evaluator.

Also: vecmath's exp/log/tanh/erf/sigmoid/softplus/expm1 against float64 numpy over dense
sweeps of float32 (and float64) inputs, errors a model can cause, and onnx's backend node
tests. Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.compiler.ir import DTYPES
from cuvil.errors import ModelError, UnsupportedOpError

#: edge values make numpy (in onnx's reference evaluator) warn about overflow and NaN
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OPSET = 20
FLOATS = ("float32", "float64", "float16")
SIGNED = ("int8", "int16", "int32", "int64")
INTS = (*SIGNED, "uint8")
NUMERIC = (*FLOATS, *INTS)
#: the symbolic dim and the sizes each model runs at
SIZES = ({"n": 3}, {"n": 1})

#: dtypes onnxruntime's CPU provider has kernels for, where fewer than the spec allows
ORT_DTYPES = {
    "Pow": (*FLOATS, "int32", "int64"),
    "Max": (*FLOATS, "int8", "int32", "int64", "uint8"),
    "Min": (*FLOATS, "int8", "int32", "int64", "uint8"),
    "Mean": ("float32", "float16"),
    "Relu": (*FLOATS, "int8", "int32"),
    "PRelu": ("float32", "float16"),
    "Where": (*FLOATS, "int8", "int32", "int64", "uint8"),
    "Clip": (*FLOATS, "int8", "int32", "int64", "uint8"),
    # onnxruntime computes float64 Shrink in float32
    "Shrink": ("float32", "float16", *INTS),
    "Celu": ("float32",),
    "LeakyRelu": ("float32", "float16"),
    # onnxruntime's float16 Sign maps NaN to 0 (its float32 Sign keeps NaN, as numpy does)
    "Sign": ("float32", "float64", *INTS),
    **dict.fromkeys(("Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Erf",
                     "Elu", "Selu", "ThresholdedRelu", "HardSigmoid", "HardSwish", "Softplus",
                     "Softsign", "Gelu", "Mish"), ("float32", "float16")),
}

#: rtol/atol per dtype (float16: one ulp is ~1e-3 and onnxruntime is not always correctly rounded)
TOL = {"float32": (2e-6, 1e-6), "float64": (1e-13, 1e-13), "float16": (2e-3, 1e-3)}

SPECIALS = (math.inf, -math.inf, math.nan, 0.0, -0.0, 1e30, -1e30, 1e-30, -1e-30, 1e-40, 88.8,
            -88.8, 100.0, -100.0, 710.0, -746.0, 0.5, -0.5, 1.0, -1.0, 2.5, 20.0, -20.0)

#: (label, shape of operand A, shape of operand B)
PATTERNS = (
    ("same", ["n", 4, 5], ["n", 4, 5]),
    ("row", ["n", 4, 5], [5]),
    ("column", [4, 1], ["n", 4, 5]),
    ("scalar", [], ["n", 3, 7]),
    ("both", ["n", 1, 5], [4, 1]),
)


def oracle(op: str, dtype: str) -> str:
    return "ort" if dtype in ORT_DTYPES.get(op, DTYPES) else "reference"


# -- input data -------------------------------------------------------------------------------


def with_specials(x: np.ndarray, rng: np.random.Generator, values=SPECIALS) -> np.ndarray:
    flat = x.reshape(-1)
    m = min(len(values), flat.size // 2)
    flat[rng.permutation(flat.size)[:m]] = values[:m]
    return x


def floats(lo: float = -4, hi: float = 4, specials: bool = False, grid: bool = True):
    """Uniform values; some on a 0.5 grid (so comparisons meet equal operands); specials."""

    def make(rng, dtype, shape):
        x = rng.uniform(lo, hi, size=shape)
        if grid:
            x = np.where(rng.random(shape) < 0.3, np.round(x * 2) / 2, x)
        if specials:
            x = with_specials(np.asarray(x, np.float64), rng)
        with np.errstate(over="ignore"):
            return np.asarray(x).astype(dtype)

    return make


def ints(lo: int, hi: int, nonzero: bool = False):
    def make(rng, dtype, shape):
        info = np.iinfo(dtype)
        x = rng.integers(max(lo, info.min), min(hi, info.max) + 1, size=shape).astype(dtype)
        if nonzero:
            x[x == 0] = 1
        return x

    return make


def full_range(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


def binary_data(op: str, dtype: str):
    d = np.dtype(dtype)
    if d == np.bool_:
        return full_range
    if d.kind == "f":
        return floats(-3, 3)
    if op == "Pow":
        return ints(-6, 6, nonzero=True)
    if op == "BitShift":
        return ints(0, 12)
    # no zero divisors (onnxruntime traps), no INT_MIN / -1
    return ints(-100, 120, nonzero=True) if d.kind == "i" else ints(1, 255)


# -- case builders ----------------------------------------------------------------------------


def binary_cases(op: str, dtype: str, attrs=None, patterns=PATTERNS) -> list[Case]:
    return [Case(op, ["a", "b"], dict(attrs or {}),
                 feeds={"a": (dtype, a), "b": (dtype, b)}, data=binary_data(op, dtype),
                 oracle=oracle(op, dtype), label=f"{op} {dtype} {label}")
            for label, a, b in patterns]


def edge_binary_case(op: str, dtype: str, attrs=None) -> Case:
    """Edge values against each other, B broadcast along rows."""
    return Case(op, ["a", "b"], dict(attrs or {}), feeds={"a": (dtype, [6, 64]), "b": (dtype, [64])},
                data=floats(-3, 3, specials=True), oracle=oracle(op, dtype),
                label=f"{op} {dtype} edge values")


def variadic_cases(op: str, dtype: str, counts=(1, 2, 3, 5)) -> list[Case]:
    shapes = (["n", 4, 5], [5], [4, 1], [], ["n", 1, 1])
    cases = []
    for count in counts:
        names = [f"x{i}" for i in range(count)]
        cases.append(Case(op, names, {}, feeds={n: (dtype, s) for n, s in zip(names, shapes)},
                          data=binary_data(op, dtype), oracle=oracle(op, dtype),
                          label=f"{op} {dtype} {count} inputs"))
    return cases


def unary_case(op: str, dtype: str, attrs=None, shape=("n", 67), data=None, label="") -> Case:
    return Case(op, ["x"], dict(attrs or {}), feeds={"x": (dtype, list(shape))},
                data=data or floats(-6, 6, specials=True), oracle=oracle(op, dtype),
                label=f"{op} {dtype} {label or attrs or ''}")


FLOAT_BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less",
                "Greater", "LessOrEqual", "GreaterOrEqual")
INT_BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater",
              "LessOrEqual", "GreaterOrEqual", "BitwiseAnd", "BitwiseOr", "BitwiseXor")
FLOAT_UNARY = ("Abs", "Neg", "Sign", "Exp", "Log", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round",
               "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh",
               "Atanh", "Erf", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "ThresholdedRelu",
               "HardSigmoid", "HardSwish", "Sigmoid", "Tanh", "Softplus", "Softsign", "Mish",
               "Gelu", "Shrink", "IsNaN", "IsInf")
#: non-default attributes
ATTRS = (
    ("LeakyRelu", {"alpha": 0.3}), ("Elu", {"alpha": 0.7}), ("Selu", {"alpha": 1.5, "gamma": 2.0}),
    ("Celu", {"alpha": 1.7}), ("ThresholdedRelu", {"alpha": 0.4}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.6}), ("Gelu", {"approximate": "tanh"}),
    ("Shrink", {"lambd": 1.2, "bias": 0.4}), ("IsInf", {"detect_positive": 0}),
    ("IsInf", {"detect_negative": 0}),
)


def prelu_cases(dtype: str) -> list[Case]:
    data = floats(-3, 3) if dtype in FLOATS else ints(-50, 50)
    return [Case("PRelu", ["x", "slope"], {}, feeds={"x": (dtype, ["n", 4, 5]), "slope": (dtype, s)},
                 data=data, oracle=oracle("PRelu", dtype), label=f"PRelu {dtype} slope {s}")
            for s in ([5], [4, 1], [1], ["n", 4, 5])]


def clip_cases(dtype: str) -> list[Case]:
    """Bounds as constants, as run-time scalars, one side only, none, min > max."""
    floaty = dtype in FLOATS
    lo, hi = (np.array(-1.5, dtype), np.array(2.25, dtype)) if floaty else \
        (np.array(3 if dtype == "uint8" else -7, dtype), np.array(90, dtype))
    common = {"data": floats(-4, 4, specials=True) if floaty else full_range,
              "oracle": oracle("Clip", dtype)}
    x = {"x": (dtype, ["n", 33])}
    return [
        Case("Clip", ["x", "lo", "hi"], {}, feeds=x, consts={"lo": lo, "hi": hi},
             label=f"Clip {dtype} constant bounds", **common),
        Case("Clip", ["x", "lo", "hi"], {}, feeds={**x, "lo": (dtype, []), "hi": (dtype, [])},
             label=f"Clip {dtype} run-time bounds", **common),
        Case("Clip", ["x", "lo"], {}, feeds=x, consts={"lo": lo}, label=f"Clip {dtype} min only",
             **common),
        Case("Clip", ["x", "", "hi"], {}, feeds=x, consts={"hi": hi}, label=f"Clip {dtype} max only",
             **common),
        Case("Clip", ["x"], {}, feeds=x, label=f"Clip {dtype} no bounds", **common),
        # min > max: everything becomes max
        Case("Clip", ["x", "hi", "lo"], {}, feeds=x, consts={"lo": lo, "hi": hi},
             label=f"Clip {dtype} min > max", **common),
    ]


def where_cases(dtype: str) -> list[Case]:
    data = full_range if dtype in ("bool", *INTS) else floats(-3, 3, specials=True)

    def make(rng, dt, shape):
        return full_range(rng, dt, shape) if np.dtype(dt) == np.bool_ else data(rng, dt, shape)

    return [Case("Where", ["c", "p", "q"], {}, feeds={"c": ("bool", c), "p": (dtype, x), "q": (dtype, y)},
                 data=make, oracle=oracle("Where", dtype), label=f"Where {dtype} {c} {x} {y}")
            for c, x, y in ((["n", 1, 5], [4, 1], [5]), (["n", 4, 5], [], ["n", 4, 5]),
                            ([5], ["n", 4, 5], []))]


#: ops checked under every broadcasting pattern (the loops are shared by all ops; the others
#: get one broadcasting case, with edge values)
ALL_PATTERNS = ("Add", "Less")
#: static shape of the one-input cases (a few use the symbolic dim)
UNARY_SHAPE = (4, 17)
SYMBOLIC_UNARY = ("Abs", "Exp", "Sigmoid", "Gelu", "IsNaN", "Relu", "Sign")


def float_cases(dtype: str) -> list[Case]:
    cases = []
    for op in FLOAT_BINARY:
        if op in ("Max", "Min", "Sum", "Mean"):
            cases += variadic_cases(op, dtype, (1, 3, 5) if op == "Max" else (3,))
        elif op in ALL_PATTERNS:
            cases += binary_cases(op, dtype)
        cases.append(edge_binary_case(op, dtype))
    cases.append(edge_binary_case("Mod", dtype, {"fmod": 1}))
    # Celu takes float32 only up to opset 27
    for op in FLOAT_UNARY:
        if op != "Celu" or dtype == "float32":
            cases.append(unary_case(op, dtype, shape=("n", 17) if op in SYMBOLIC_UNARY else UNARY_SHAPE))
    for op, attrs in ATTRS:
        if op != "Celu" or dtype == "float32":
            cases.append(unary_case(op, dtype, attrs, shape=UNARY_SHAPE))
    # long rows: several blocks of the threaded loop
    cases.append(Case("Add", ["a", "b"], {}, feeds={"a": (dtype, ["n", 10007]), "b": (dtype, [10007])},
                      data=floats(), label="Add long"))
    cases.append(unary_case("Tanh", dtype, shape=("n", 20011), data=floats(-5, 5), label="long"))
    # a rank-4 operand against a rank-2 one, odd sizes
    cases += binary_cases("Mul", dtype, patterns=(("rank 4 vs 2", [3, 1, "n", 7], ["n", 1]),))
    return cases + prelu_cases(dtype) + clip_cases(dtype) + where_cases(dtype)


def int_cases(dtype: str) -> list[Case]:
    cases = []
    signed = dtype in SIGNED
    for op in INT_BINARY:
        if op == "Pow" and dtype not in ("int32", "int64"):
            continue
        if op in ("Max", "Min"):
            cases += variadic_cases(op, dtype, (3,))
        else:
            cases += binary_cases(op, dtype, patterns=PATTERNS if op in ALL_PATTERNS else PATTERNS[1:2])
    cases += binary_cases("Div", dtype, patterns=PATTERNS[2:3])
    cases += binary_cases("Mod", dtype, {}, PATTERNS[1:3])
    cases += binary_cases("Mod", dtype, {"fmod": 1}, PATTERNS[1:3])
    if dtype == "uint8":
        cases += binary_cases("BitShift", dtype, {"direction": "LEFT"}, PATTERNS[1:2])
        cases += binary_cases("BitShift", dtype, {"direction": "RIGHT"}, PATTERNS[1:2])
    unary = ["Abs", "Sign", "BitwiseNot"] + (["Neg", "Relu"] if signed else [])
    for op in unary:
        cases.append(unary_case(op, dtype, data=full_range, shape=UNARY_SHAPE))
    cases.append(unary_case("Shrink", dtype, {"lambd": 1.5, "bias": 1.2}, data=ints(-1000, 1000),
                            shape=UNARY_SHAPE))
    if dtype in ("int32", "int64"):
        cases += prelu_cases(dtype)[:2]
    return cases + clip_cases(dtype)[:2] + where_cases(dtype)[:1]


@pytest.mark.parametrize("dtype", ("float32", "float16"))
def test_float_ops(dtype):
    rtol, atol = TOL[dtype]
    check_cases(float_cases(dtype), sizes=SIZES, opset=OPSET, rtol=rtol, atol=atol)


def test_float64_ops():
    """onnx's reference evaluator computes several float64 ops in float32 (erf, attributes
    applied as float32...): the cases it checks get float32 tolerances."""
    cases = float_cases("float64")
    rtol, atol = TOL["float64"]
    check_cases([c for c in cases if c.oracle == "ort"], sizes=SIZES, opset=OPSET, rtol=rtol,
                atol=atol)
    check_cases([c for c in cases if c.oracle != "ort"], sizes=SIZES, opset=OPSET, rtol=1e-6,
                atol=1e-7)


@pytest.mark.parametrize("dtype", INTS)
def test_integer_ops(dtype):
    check_cases(int_cases(dtype), sizes=SIZES, opset=OPSET)


def test_bool_ops():
    cases = []
    for op in ("And", "Or", "Xor", "Equal"):
        cases += binary_cases(op, "bool")
    cases.append(unary_case("Not", "bool", data=full_range))
    cases += where_cases("bool")
    check_cases(cases, sizes=SIZES, opset=OPSET)


def test_pow_mixed_dtypes():
    """Base and exponent of different dtypes; the output has the base's."""
    cases = []
    for base in ("float32", "float64", "float16", "int32", "int64"):
        for exp in ("float32", "float64", "float16", "int32", "int64", "int8", "uint8"):
            if base == exp:
                continue

            def make(rng, dtype, shape):
                if np.dtype(dtype).kind == "f":
                    return rng.uniform(0.5, 3, size=shape).astype(dtype)
                return rng.integers(1, 6, size=shape).astype(dtype)

            cases.append(Case("Pow", ["x", "e"], {}, feeds={"x": (base, ["n", 5]), "e": (exp, [5])},
                              data=make, oracle="ort" if exp in ("float32", "float64", "float16",
                                                                 "int32", "int64") else "reference",
                              label=f"Pow {base} ** {exp}"))
    # a constant exponent of 2 or 3 (multiplied out) and 0.5
    for e in (2.0, 3.0, 0.5):
        cases.append(Case("Pow", ["x", "e"], {}, feeds={"x": ("float32", ["n", 9])},
                          consts={"e": np.array(e, np.float32)}, data=floats(-3, 3, specials=True),
                          label=f"Pow x ** {e}"))
    check_cases(cases, sizes=SIZES, opset=OPSET, rtol=2e-3, atol=1e-5)


def test_clip_before_opset_11_and_at_11():
    cases = [Case("Clip", ["x"], attrs, feeds={"x": ("float32", ["n", 21])},
                  data=floats(-4, 4, specials=True), label=f"Clip-6 {attrs}")
             for attrs in ({"min": -1.0, "max": 1.5}, {"min": 0.5}, {"max": -0.5}, {})]
    check_cases(cases, sizes=SIZES, opset=10)
    lo, hi = np.array(-1.0, np.float32), np.array(2.0, np.float32)
    check_cases([Case("Clip", ["x", "lo", "hi"], {}, feeds={"x": ("float32", ["n", 21])},
                      consts={"lo": lo, "hi": hi}, data=floats(-4, 4, specials=True))],
                sizes=SIZES, opset=11)


def test_opset_28_float_floor_mod_and_signed_bit_shifts():
    """From opset 28 fmod=0 applies to floats (the result takes the divisor's sign) and
    BitShift takes signed integers (arithmetic right shift; counts out of range give 0, or
    -1 for a negative value shifted right). onnxruntime has neither: onnx's reference."""
    cases = [Case("Mod", ["a", "b"], {}, feeds={"a": ("float32", ["n", 64]), "b": ("float32", [64])},
                  data=floats(-5, 5, specials=True), oracle="reference", label="Mod float fmod=0")]
    for dtype in ("int8", "int32", "int64"):
        for direction in ("LEFT", "RIGHT"):
            cases.append(Case("BitShift", ["a", "b"], {"direction": direction},
                              feeds={"a": (dtype, ["n", 40]), "b": (dtype, [40])},
                              data=ints(-70, 70), oracle="reference",
                              label=f"BitShift {dtype} {direction}"))
    check_cases(cases, sizes=SIZES, opset=28, rtol=1e-6, atol=1e-6)


# -- casts ------------------------------------------------------------------------------------


def cast_data(src: str, dst: str):
    """Values whose cast is defined: float -> int only in range (NaN/inf/overflow to an
    integer is undefined behaviour in onnxruntime too)."""
    s, d = np.dtype(src), np.dtype(dst)
    if s.kind != "f":
        return full_range
    if d.kind in "iu":
        lo, hi = (0, 255) if d.kind == "u" else (-120, 120)
        return floats(lo, hi)
    return floats(-70000, 70000, specials=True)


def test_cast_every_pair():
    cases = []
    for src in DTYPES:
        for dst in DTYPES:
            to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
            cases.append(Case("Cast", ["x"], {"to": to}, feeds={"x": (src, ["n", 40])},
                              data=cast_data(src, dst), label=f"Cast {src} -> {dst}"))
    for src, dst in (("float32", "int8"), ("int64", "float16"), ("bool", "float64"),
                     ("float64", "float16")):
        def make(rng, dtype, shape, src=src, dst=dst):
            if np.dtype(dtype) != np.dtype(src):  # the `like` input: only its dtype matters
                return np.zeros(shape, dtype)
            return cast_data(src, dst)(rng, dtype, shape)

        cases.append(Case("CastLike", ["x", "like"], {},
                          feeds={"x": (src, ["n", 40]), "like": (dst, [2])}, data=make,
                          label=f"CastLike {src} -> {dst}"))
    check_cases(cases, sizes=SIZES, opset=OPSET, rtol=0, atol=0)


def test_float_to_small_int_goes_through_int32_as_onnxruntime():
    """300.7 -> int8 is 44 and -1.5 -> uint8 is 255 in onnxruntime (C's conversion to int32,
    then truncation); cuvil gives the same for values within int32."""
    cases = [Case("Cast", ["x"], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(dst))},
                  feeds={"x": ("float32", ["n", 30])}, data=floats(-70000, 70000),
                  label=f"Cast float32 -> {dst} wrapping")
             for dst in ("int8", "uint8", "int16")]
    check_cases(cases, sizes=SIZES, opset=OPSET)


# -- vecmath accuracy -------------------------------------------------------------------------


def _every_float32(step: int) -> np.ndarray:
    bits = np.arange(0, 2 ** 32, step, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


def _check_accuracy(name: str, got: np.ndarray, x: np.ndarray, want: np.ndarray, dtype,
                    max_rel: float, flush: bool = False) -> None:
    """Relative error on normal results; exact (after rounding) on the rest: inf, 0, NaN,
    subnormal results (within one subnormal step, or 0 with `flush`)."""
    info = np.finfo(dtype)
    got64 = got.astype(np.float64)
    normal = np.isfinite(want) & (np.abs(want) >= info.tiny) & (np.abs(want) <= info.max)
    rel = np.abs(got64[normal] - want[normal]) / np.abs(want[normal])
    worst = int(np.argmax(rel))
    assert rel[worst] < max_rel, (f"{name}: relative error {rel[worst]:.3g} at "
                                  f"x={x[normal][worst]!r} (got {got[normal][worst]!r}, "
                                  f"want {want[normal][worst]!r})")
    with np.errstate(over="ignore"):
        rounded = want[~normal].astype(dtype).astype(np.float64)
    other = got64[~normal]
    step = float(info.tiny if flush else info.smallest_subnormal)
    ok = (other == rounded) | (np.isnan(other) & np.isnan(rounded)) | \
        (np.abs(other - want[~normal]) <= step)
    assert ok.all(), (f"{name}: special values wrong at x={x[~normal][~ok][:5]!r}: got "
                      f"{other[~ok][:5]!r}, want {want[~normal][~ok][:5]!r}")


def test_vecmath_float32_accuracy_over_all_floats():
    """Every 757th float32 (5.7 million values: all binades, subnormals, both signs), plus the
    specials, through the vectorized functions; reference: float64 numpy (math.erf)."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF], np.uint32)
    x = np.concatenate([_every_float32(757), np.array(SPECIALS, np.float32), nans.view(np.float32),
                        np.array([88.72283, 88.72284, -87.33654, -103.97208, -103.9721, 9.01,
                                  3.92, 0.8, 0.9, 0.34657359, -0.34657359], np.float32)])
    ops = ("Exp", "Log", "Tanh", "Sigmoid", "Softplus", "Erf")
    nodes = [helper.make_node(op, ["x"], [op]) for op in ops]
    nodes.append(helper.make_node("Elu", ["x"], ["Elu"]))  # expm1 for x < 0
    from oracle import make_model

    model = make_model(nodes, {"x": ("float32", ["n"])}, dict.fromkeys((*ops, "Elu"), "float32"))
    got = cuvil.compile(model).run({"x": x})
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        refs = {"Exp": np.exp(x64), "Log": np.log(x64), "Tanh": np.tanh(x64),
                "Sigmoid": np.where(x64 >= 0, 1 / (1 + np.exp(-x64)), np.exp(x64) / (1 + np.exp(x64))),
                "Softplus": np.logaddexp(0, x64), "Elu": np.where(x64 < 0, np.expm1(x64), x64)}
    sub = x[::7]  # math.erf is slow in Python
    erf = np.frompyfunc(math.erf, 1, 1)(sub.astype(np.float64)).astype(np.float64)
    for op, want in refs.items():
        # sigmoid flushes results below the normal range to 0
        _check_accuracy(op, got[op], x, want, np.float32, 1e-6, flush=op == "Sigmoid")
    _check_accuracy("Erf", got["Erf"][::7], sub, erf, np.float32, 1e-6)
    # never outside the function's range, not even by rounding
    finite = ~np.isnan(x)
    assert np.abs(got["Tanh"][finite]).max() <= 1 and np.abs(got["Erf"][finite]).max() <= 1
    assert got["Sigmoid"][finite].min() >= 0 and got["Sigmoid"][finite].max() <= 1


def test_vecmath_float64_accuracy():
    rng = np.random.default_rng(64)
    bits = rng.integers(0, 2 ** 63, 1_500_000, dtype=np.uint64)
    x = np.concatenate([bits.view(np.float64), -bits[:500_000].view(np.float64),
                        rng.uniform(-750, 750, 500_000), 1 + rng.uniform(-1e-3, 1e-3, 100_000),
                        np.array(SPECIALS),
                        np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001,
                                  0xFFFFFFFFFFFFFFFF], np.uint64).view(np.float64),
                        np.array([709.782712893384, 709.7827128933841,
                                                      -745.1332191019411, -708.3964185322641])])
    from oracle import make_model

    ops = ("Exp", "Log", "Sigmoid", "Softplus")
    model = make_model([helper.make_node(op, ["x"], [op]) for op in ops],
                       {"x": ("float64", ["n"])}, dict.fromkeys(ops, "float64"))
    got = cuvil.compile(model).run({"x": x})
    with np.errstate(all="ignore"):
        refs = {"Exp": np.exp(x), "Log": np.log(x),
                "Sigmoid": np.where(x >= 0, 1 / (1 + np.exp(-x)), np.exp(x) / (1 + np.exp(x))),
                "Softplus": np.logaddexp(0, x)}
    for op, want in refs.items():
        _check_accuracy(op, got[op], x, want, np.float64, 2e-15, flush=op == "Sigmoid")


# -- errors -----------------------------------------------------------------------------------


def _raw_model(nodes, inputs, outputs, opset=OPSET, inits=()):
    graph = helper.make_graph(
        nodes, "bad",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s)
         for n, (t, s) in inputs.items()],
        # outputs typed like input 0 (the checker wants a type; cuvil infers its own)
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)),
                                       next(iter(inputs.values()))[1])
         for n, t in outputs.items()], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("op, inputs, attrs, opset, error, message", [
    ("Add", {"a": ("float32", [3]), "b": ("int32", [3])}, {}, OPSET, ModelError,
     r"node 'bad' \(Add\): inputs 0 \('a', float32\) and 1 \('b', int32\) must have the same dtype"),
    ("Sin", {"a": ("int32", [3])}, {}, OPSET, ModelError, r"\(Sin\): input 0 \('a'\) is int32, but Sin"),
    ("Where", {"c": ("float32", [3]), "a": ("float32", [3]), "b": ("float32", [3])}, {}, OPSET,
     ModelError, "input 0 .* is float32, but Where .* takes bool"),
    ("Mod", {"a": ("float32", [3]), "b": ("float32", [3])}, {}, 17, ModelError, "needs fmod=1"),
    ("PRelu", {"a": ("float32", [4, 5]), "b": ("float32", [2, 4, 5])}, {}, OPSET, ModelError,
     "must broadcast to X's shape"),
    ("Add", {"a": ("float32", [3, 4]), "b": ("float32", [5])}, {}, OPSET, ModelError, "do not broadcast"),
    ("Cast", {"a": ("float32", [3])}, {"to": onnx.TensorProto.STRING}, OPSET, UnsupportedOpError,
     "casts to STRING"),
    ("Cast", {"a": ("float32", [3])}, {"to": onnx.TensorProto.BFLOAT16}, OPSET, UnsupportedOpError,
     "casts to BFLOAT16"),
    ("Clip", {"a": ("float32", [3]), "lo": ("float32", [2])}, {}, OPSET, ModelError,
     "min must be a scalar"),
    ("BitShift", {"a": ("uint8", [3]), "b": ("uint8", [3])}, {"direction": "UP"}, OPSET, ModelError,
     "direction must be"),
    ("Gelu", {"a": ("float32", [3])}, {"approximate": "fast"}, OPSET, ModelError,
     "approximate must be"),
])
def test_errors_name_the_node(op, inputs, attrs, opset, error, message):
    model = _raw_model([helper.make_node(op, list(inputs), ["y"], name="bad", **attrs)], inputs,
                       {"y": "float32"}, opset)
    with pytest.raises(error, match=message):
        cuvil.compile(model)


# -- onnx's backend node tests ----------------------------------------------------------------

BACKEND = {
    "abs": "Abs", "acos": "Acos", "acosh": "Acosh", "add": "Add", "and_": "And", "asin": "Asin",
    "asinh": "Asinh", "atan": "Atan", "atanh": "Atanh", "bitshift": "BitShift",
    "bitwiseand": "BitwiseAnd", "bitwisenot": "BitwiseNot", "bitwiseor": "BitwiseOr",
    "bitwisexor": "BitwiseXor", "cast": "Cast", "castlike": "CastLike", "ceil": "Ceil",
    "celu": "Celu", "clip": "Clip", "cos": "Cos", "cosh": "Cosh", "div": "Div",
    "dropout": "Dropout", "elu": "Elu", "equal": "Equal", "erf": "Erf", "exp": "Exp",
    "floor": "Floor", "gelu": "Gelu", "greater": "Greater", "greater_or_equal": "GreaterOrEqual",
    "hardsigmoid": "HardSigmoid", "hardswish": "HardSwish", "identity": "Identity",
    "isinf": "IsInf", "isnan": "IsNaN", "leakyrelu": "LeakyRelu", "less": "Less",
    "less_or_equal": "LessOrEqual", "log": "Log", "max": "Max", "mean": "Mean", "min": "Min",
    "mish": "Mish", "mod": "Mod", "mul": "Mul", "neg": "Neg", "not_": "Not", "or_": "Or",
    "pow": "Pow", "prelu": "PRelu", "reciprocal": "Reciprocal", "relu": "Relu", "round": "Round",
    "selu": "Selu", "shrink": "Shrink", "sigmoid": "Sigmoid", "sign": "Sign", "sin": "Sin",
    "sinh": "Sinh", "softplus": "Softplus", "softsign": "Softsign", "sqrt": "Sqrt", "sub": "Sub",
    "sum": "Sum", "tan": "Tan", "tanh": "Tanh", "thresholdedrelu": "ThresholdedRelu",
    "where": "Where", "xor": "Xor",
}


def _compilable(test) -> bool:
    """Tests whose tensors all have cuvil dtypes, and Dropout in inference mode only."""
    known = {helper.np_dtype_to_tensor_dtype(np.dtype(d)) for d in DTYPES}
    g = test.model.graph
    if any(v.type.tensor_type.elem_type not in known for v in (*g.input, *g.output)):
        return False
    return not test.name.startswith("test_training_dropout")


@pytest.mark.slow
def test_backend_node_tests():
    tests = [t for module, op in BACKEND.items() for t in backend_cases(module, [op])
             if _compilable(t)]
    assert len(tests) >= 280
    check_backend_cases(tests)


# -- BitCast ----------------------------------------------------------------------------------


def _bitcast_data(rng, dtype, shape):
    """Any bit pattern for numbers (NaN payloads included); 0/1 bytes for bool."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def test_bitcast_every_same_width_pair():
    pairs = [(a, b) for a in DTYPES for b in DTYPES
             if a != b and np.dtype(a).itemsize == np.dtype(b).itemsize and b != "bool"]
    assert ("bool", "uint8") in pairs and ("float32", "int32") in pairs
    cases = [Case("BitCast", ["x"], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(b))},
                  feeds={"x": (a, ["n", 3])}, data=_bitcast_data, label=f"BitCast {a}->{b}",
                  # onnxruntime 1.32 has no BitCast kernel for some pairs (bool)
                  oracle="reference")
             for a, b in pairs]
    cases.append(Case("BitCast", ["x"], {"to": onnx.TensorProto.INT32}, feeds={"x": ("float32", [])},
                      label="scalar"))
    check_cases(cases, opset=26, sizes=SIZES)


def test_bitcast_feeding_integer_ops_shares_storage():
    # |x| by clearing the sign bit: float -> int32 view, And, view back; and the view of a
    # constant (weights) input
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])
    nodes = [
        helper.make_node("BitCast", ["x"], ["bits"], to=onnx.TensorProto.INT32),
        helper.make_node("BitwiseAnd", ["bits", "mask"], ["cleared"]),
        helper.make_node("BitCast", ["cleared"], ["abs"], to=onnx.TensorProto.FLOAT),
        helper.make_node("BitCast", ["w"], ["w_bits"], to=onnx.TensorProto.UINT8),
        helper.make_node("Add", ["w_bits", "w_bits"], ["w2"]),
    ]
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("abs", onnx.TensorProto.FLOAT,
                                                                          ["n", 4]),
                                            helper.make_tensor_value_info("w2", onnx.TensorProto.UINT8,
                                                                          [4])],
                          [onnx.numpy_helper.from_array(np.array(0x7FFFFFFF, np.int32), "mask"),
                           onnx.numpy_helper.from_array(np.array([-1, 2, -128, 127], np.int8), "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 26)])
    model.ir_version = 10
    compiled = cuvil.compile(model)
    from oracle import assert_matches_ort

    rng = np.random.default_rng(3)
    for n in (1, 5):
        feeds = {"x": rng.standard_normal((n, 4)).astype(np.float32)}
        assert_matches_ort(model, feeds, compiled=compiled)
        np.testing.assert_array_equal(compiled.run(feeds)["abs"], np.abs(feeds["x"]))


@pytest.mark.parametrize("to,error,message", [
    (onnx.TensorProto.INT64, ModelError, "float32 \\(32 bits\\) to int64 \\(64 bits\\)"),
    (onnx.TensorProto.BFLOAT16, UnsupportedOpError, "bit-casts to BFLOAT16"),
    (onnx.TensorProto.COMPLEX64, UnsupportedOpError, "bit-casts to COMPLEX64"),
])
def test_bitcast_errors_name_the_node(to, error, message):
    g = helper.make_graph([helper.make_node("BitCast", ["x"], ["y"], name="bc", to=to)], "g",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", to, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 26)])
    model.ir_version = 10
    with pytest.raises(error, match=message) as info:
        cuvil.compile(model)
    assert "'bc'" in str(info.value)
