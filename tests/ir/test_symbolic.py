"""cuvil.compiler.symbolic: dim expressions lowered to integer arithmetic (Python text here)
give what sympy gives when the symbols are substituted, on a grid of positive values."""

from __future__ import annotations

import itertools

import pytest
import sympy

from cuvil.compiler.ir import symbol
from cuvil.compiler.symbolic import lower_dim, relational_to_python, to_python

h, w, n = symbol("h"), symbol("w"), symbol("n")
GRID = list(itertools.product([1, 2, 3, 7, 64, 65], [1, 4, 9], [1, 5]))

EXPRS = [
    h,
    3 * h * w + 2,
    sympy.floor((h - 1) / 2) + 1,  # a strided conv
    sympy.floor((h + 2 * 1 - 3) / 2) + 1,
    sympy.ceiling(h / 3),
    sympy.ceiling((h - 5) / 4),  # negative numerators: ceil, not truncation
    sympy.floor((h - 7) / 3),
    sympy.Mod(h * w + 3, 4),
    sympy.Max(h, 2 * w, 5),
    sympy.Min(h - w, 3),
    h * w / 2 * 4,  # exact rational times integer
    (h * n - h) / 1,
    h ** 2 * w,
    64 * sympy.ceiling(4 * h * w / 64),  # an aligned workspace size
    sympy.floor(h * sympy.Rational(1, 2)) + sympy.floor(w * sympy.Rational(3, 4)),
]


@pytest.mark.parametrize("expr", EXPRS, ids=str)
def test_python_text_evaluates_like_sympy(expr) -> None:
    text = to_python(expr)
    code = compile(str(text), "<dim>", "eval")
    for hv, wv, nv in GRID:
        env = {"h": hv, "w": wv, "n": nv}
        want = sympy.sympify(expr).subs({h: hv, w: wv, n: nv})
        assert want.is_Integer, f"{expr} at {env} is {want}"
        assert eval(code, {"max": max, "min": min}, env) == int(want), f"{expr} = {text} at {env}"


def test_constants_are_ints() -> None:
    assert to_python(sympy.Integer(12)) == 12
    assert to_python(5) == 5


def test_exact_division_of_a_sum() -> None:
    """(h*w - h)/2 is exact only when the shape rules guarantee it: lowered as floordiv."""
    text = to_python((h * w - h) / 2)
    assert eval(str(text), {}, {"h": 4, "w": 3}) == 4


@pytest.mark.parametrize("expr", [h / w, sympy.floor(h / w), sympy.sqrt(h)], ids=str)
def test_what_integer_arithmetic_cannot_express_is_refused(expr) -> None:
    with pytest.raises(ValueError, match="cannot lower"):
        to_python(expr)


class Counting:
    """IntOps that counts operations, to see shared subexpressions evaluated once."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name):
        def op(*args):
            self.calls += 1
            return (name, *args)
        return op


def test_common_subexpressions_are_evaluated_once_per_memo() -> None:
    e = sympy.floor((h - 1) / 2)
    ops, memo = Counting(), {}
    lower_dim(e, ops, memo)
    first = ops.calls
    lower_dim(e, ops, memo)
    assert ops.calls == first
    lower_dim(e * w, ops, memo)
    assert ops.calls - first == 2  # w and the multiply; the floor is reused


@pytest.mark.parametrize("cond", [
    sympy.Eq(h * 2, w + 1),
    sympy.Ge(h, 3),
    sympy.Lt(sympy.floor(h / 2), w),
    sympy.And(sympy.Ge(h, 2), sympy.Ne(w, 4)),
], ids=str)
def test_relations_evaluate_like_sympy(cond) -> None:
    text = relational_to_python(cond)
    for hv, wv, nv in GRID:
        want = bool(cond.subs({h: hv, w: wv, n: nv}))
        assert eval(text, {"max": max, "min": min}, {"h": hv, "w": wv, "n": nv}) == want, text
