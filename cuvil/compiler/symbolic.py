"""Symbolic dims as integer arithmetic: one walker, used for LLVM code and for Python text.

Sympy writes ``floor((h - 1)/2)`` with rational numbers inside; machines want integer
floor division. `lower_dim` rewrites any dim expression into integer operations (add, mul,
floordiv, mod, min, max) and hands them to a backend object, so the library and the
generated Python package evaluate exactly the same arithmetic.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import sympy

T = TypeVar("T")


class IntOps(Protocol, Generic[T]):
    def const(self, value: int) -> T: ...
    def sym(self, name: str) -> T: ...
    def add(self, a: T, b: T) -> T: ...
    def mul(self, a: T, b: T) -> T: ...
    def floordiv(self, a: T, b: T) -> T: ...
    def mod(self, a: T, b: T) -> T: ...
    def max(self, a: T, b: T) -> T: ...
    def min(self, a: T, b: T) -> T: ...


def lower_dim(expr: Any, ops: IntOps[T]) -> T:
    """Evaluate `expr` (int or sympy integer expression) with the integer operations `ops`."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return ops.const(int(expr))
    if expr.is_Symbol:
        return ops.sym(expr.name)
    if isinstance(expr, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        if not den.is_Integer:
            raise ValueError(f"cannot lower {expr}: division by a non-constant")
        n = lower_dim(sympy.expand(num), ops)
        d = ops.const(int(den))
        if isinstance(expr, sympy.floor):
            return ops.floordiv(n, d)
        # ceil(n/d) == -((-n) // d)
        neg = ops.const(-1)
        return ops.mul(neg, ops.floordiv(ops.mul(neg, n), d))
    if isinstance(expr, sympy.Mod):
        return ops.mod(lower_dim(expr.args[0], ops), lower_dim(expr.args[1], ops))
    if isinstance(expr, (sympy.Max, sympy.Min)):
        fold = ops.max if isinstance(expr, sympy.Max) else ops.min
        args = [lower_dim(a, ops) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = fold(out, a)
        return out
    if expr.is_Add or expr.is_Mul:
        num, den = sympy.fraction(sympy.together(expr))
        if den != 1:
            # an exact division the shape rules guarantee (e.g. Reshape's -1)
            if not den.is_Integer:
                raise ValueError(f"cannot lower {expr}: division by a non-constant")
            return ops.floordiv(lower_dim(sympy.expand(num), ops), ops.const(int(den)))
        combine = ops.add if expr.is_Add else ops.mul
        args = [lower_dim(a, ops) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            out = combine(out, a)
        return out
    if expr.is_Pow and expr.exp.is_Integer and int(expr.exp) > 0:
        base = lower_dim(expr.base, ops)
        out = base
        for _ in range(int(expr.exp) - 1):
            out = ops.mul(out, base)
        return out
    raise ValueError(f"cannot lower dim expression {expr}")


class PythonText:
    """`IntOps` producing Python source text over variables named like the symbols."""

    def const(self, value: int) -> str:
        return str(value) if value >= 0 else f"({value})"

    def sym(self, name: str) -> str:
        return name

    def add(self, a: str, b: str) -> str:
        return f"({a} + {b})"

    def mul(self, a: str, b: str) -> str:
        return f"({a} * {b})"

    def floordiv(self, a: str, b: str) -> str:
        return f"({a} // {b})"

    def mod(self, a: str, b: str) -> str:
        return f"({a} % {b})"

    def max(self, a: str, b: str) -> str:
        return f"max({a}, {b})"

    def min(self, a: str, b: str) -> str:
        return f"min({a}, {b})"


def to_python(expr: Any) -> str | int:
    """An int for a constant dim, else a Python expression over the symbol names."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    return lower_dim(expr, PythonText())


def relational_to_python(cond: Any) -> str:
    """A constraint (sympy relational, or And of them) as a Python boolean expression."""
    if isinstance(cond, sympy.And):
        return " and ".join(f"({relational_to_python(a)})" for a in cond.args)
    ops = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Ge: ">=", sympy.Gt: ">", sympy.Le: "<=",
           sympy.Lt: "<"}
    for cls, text in ops.items():
        if isinstance(cond, cls):
            return f"{to_python(cond.lhs)} {text} {to_python(cond.rhs)}"
    raise ValueError(f"cannot express constraint {cond}")
