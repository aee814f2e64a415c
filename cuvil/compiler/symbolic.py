"""Symbolic dims as integer arithmetic: one walker, used for LLVM code and for Python text.

Sympy writes ``floor((h - 1)/2)`` with rational numbers inside; machines want integer
floor division. `lower_dim` rewrites any dim expression into integer operations (add, mul,
floordiv, mod, min, max) and hands them to a backend object, so the library and the
generated Python package evaluate exactly the same arithmetic.
"""

from __future__ import annotations

import functools
from typing import Any, Generic, Protocol, TypeVar, cast

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


def lower_dim(expr: Any, ops: IntOps[T], memo: dict[int, Any] | None = None) -> T:
    """Evaluate `expr` (int or sympy integer expression) with the integer operations `ops`.

    Common subexpressions are evaluated once. A `memo` dict passed to several calls shares
    them between the calls too (only for backends whose results stay valid, e.g. LLVM values
    made in a function's entry block).
    """
    return _evaluate(_plan(sympy.sympify(expr)), ops, {} if memo is None else memo)


# A plan is a tree of tuples: ("const", int), ("sym", name) or (op, left, right) with op an
# `IntOps` method name. Planning calls sympy's `together`/`expand`, which are slow; a model's
# dims repeat (every node's loops, every workspace offset), so plans are cached by expression.
_Plan = tuple[Any, ...]


def _evaluate(plan: _Plan, ops: IntOps[T], memo: dict[int, Any]) -> T:
    # keyed by identity (hashing nested tuples is slow); the entry keeps `plan` alive, so
    # its id cannot be reused while the memo lives. Shared subplans come from `_plan`'s cache.
    hit = memo.get(id(plan))
    if hit is not None:
        return cast(T, hit[1])
    if plan[0] == "const":
        out = ops.const(plan[1])
    elif plan[0] == "sym":
        out = ops.sym(plan[1])
    else:
        out = getattr(ops, plan[0])(_evaluate(plan[1], ops, memo), _evaluate(plan[2], ops, memo))
    memo[id(plan)] = (plan, out)
    return out


def _fold(op: str, plans: list[_Plan]) -> _Plan:
    out = plans[0]
    for p in plans[1:]:
        out = (op, out, p)
    return out


@functools.lru_cache(maxsize=4096)
def _plan(expr: sympy.Expr) -> _Plan:
    if expr.is_Integer:
        return ("const", int(expr))
    if expr.is_Symbol:
        return ("sym", expr.name)
    if isinstance(expr, (sympy.floor, sympy.ceiling)):
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        if not den.is_Integer:
            raise ValueError(f"cannot lower {expr}: division by a non-constant")
        n = _plan(sympy.expand(num))
        d = ("const", int(den))
        if isinstance(expr, sympy.floor):
            return ("floordiv", n, d)
        # ceil(n/d) == -((-n) // d)
        neg = ("const", -1)
        return ("mul", neg, ("floordiv", ("mul", neg, n), d))
    if isinstance(expr, sympy.Mod):
        return ("mod", _plan(expr.args[0]), _plan(expr.args[1]))
    if isinstance(expr, (sympy.Max, sympy.Min)):
        return _fold("max" if isinstance(expr, sympy.Max) else "min", [_plan(a) for a in expr.args])
    if expr.is_Add or expr.is_Mul:
        if all(a.is_integer for a in expr.args):  # no fraction to gather: skip `together`
            return _fold("add" if expr.is_Add else "mul", [_plan(a) for a in expr.args])
        num, den = sympy.fraction(sympy.together(expr))
        if den != 1:
            # an exact division the shape rules guarantee (e.g. Reshape's -1)
            if not den.is_Integer:
                raise ValueError(f"cannot lower {expr}: division by a non-constant")
            return ("floordiv", _plan(sympy.expand(num)), ("const", int(den)))
        return _fold("add" if expr.is_Add else "mul", [_plan(a) for a in expr.args])
    if expr.is_Pow and expr.exp.is_Integer and int(expr.exp) > 0:
        return _fold("mul", [_plan(expr.base)] * int(expr.exp))
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
