"""Activations a fused node applies to its results (see passes/fuse_epilogue.py), on float32
scalars or whole vector registers (the GEMM kernel's epilogue).

Each takes the builder, the value and the activation's parameters (floats fixed at compile
time, e.g. Clip's bounds) and computes what the ONNX op of the same name computes, with the
same formulas as the elementwise ops (ops/elementwise.py), so a fused and an unfused model
agree to rounding.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from llvmlite import ir

from cuvil.compiler.kernels import vecmath

__all__ = ["ACTIVATIONS", "apply_activation"]


def _c(like: ir.Value, value: float) -> ir.Constant:
    """A float constant of `like`'s type (splat over the lanes of a vector)."""
    if isinstance(like.type, ir.VectorType):
        scalar = ir.Constant(like.type.element, float(value))
        return ir.Constant(like.type, [scalar] * like.type.count)
    return ir.Constant(like.type, float(value))


def _lt(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.fcmp_ordered("<", x, y)


def _relu(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    return b.select(_lt(b, x, _c(x, 0)), _c(x, 0), x)


def _clip(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    lo, hi = _c(x, p[0]), _c(x, p[1])
    y = b.select(_lt(b, x, lo), lo, x)
    return b.select(_lt(b, hi, y), hi, y)


def _leaky_relu(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    return b.select(_lt(b, x, _c(x, 0)), b.fmul(x, _c(x, p[0])), x)


def _hard_sigmoid(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    y = b.fadd(b.fmul(x, _c(x, p[0])), _c(x, p[1]))
    y = b.select(_lt(b, _c(x, 1), y), _c(x, 1), y)
    return b.select(_lt(b, y, _c(x, 0)), _c(x, 0), y)


def _hard_swish(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    return b.fmul(x, _hard_sigmoid(b, x, (1 / 6, 0.5)))


def _gelu(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    t = vecmath.erf(b, b.fmul(x, _c(x, np.sqrt(0.5))))
    return b.fmul(b.fmul(_c(x, 0.5), x), b.fadd(_c(x, 1), t))


def _gelu_tanh(b: ir.IRBuilder, x: ir.Value, p: tuple[float, ...]) -> ir.Value:
    cube = b.fmul(_c(x, 0.044715), b.fmul(x, b.fmul(x, x)))
    t = vecmath.tanh(b, b.fmul(_c(x, np.sqrt(2 / np.pi)), b.fadd(x, cube)))
    return b.fmul(b.fmul(_c(x, 0.5), x), b.fadd(_c(x, 1), t))


#: activation name -> (parameter count, emitter). The names are ONNX op types, but for SiLU
#: (x * Sigmoid(x)) and GeluTanh (Gelu with approximate="tanh").
ACTIVATIONS: dict[str, tuple[int, Callable[[ir.IRBuilder, ir.Value, tuple[float, ...]], ir.Value]]] = {
    "Relu": (0, _relu),
    "Clip": (2, _clip),  # (min, max)
    "LeakyRelu": (1, _leaky_relu),  # (alpha,)
    "HardSigmoid": (2, _hard_sigmoid),  # (alpha, beta)
    "HardSwish": (0, _hard_swish),
    "Sigmoid": (0, lambda b, x, p: vecmath.sigmoid(b, x)),
    "SiLU": (0, lambda b, x, p: b.fmul(x, vecmath.sigmoid(b, x))),
    "Tanh": (0, lambda b, x, p: vecmath.tanh(b, x)),
    "Gelu": (0, _gelu),
    "GeluTanh": (0, _gelu_tanh),
}


def apply_activation(b: ir.IRBuilder, name: str, params: tuple[float, ...],
                     x: ir.Value) -> ir.Value:
    count, emit = ACTIVATIONS[name]
    assert len(params) == count, f"{name} takes {count} parameters, got {params}"
    return emit(b, x, params)
