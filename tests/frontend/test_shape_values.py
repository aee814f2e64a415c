"""frontend.shape_values: shape arithmetic on values known as dims, against numpy computing
the same ops on the concrete shape once the symbols are given values."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

from cuvil.compiler.frontend.shape_values import propagate
from cuvil.compiler.ir import Node, TensorType, Value, symbol

b, h = symbol("b"), symbol("h")
BINDINGS = [{"b": 1, "h": 1}, {"b": 3, "h": 8}, {"b": 7, "h": 13}]
X = Value("x", TensorType(np.float32, (b, 3, h, 2 * h)))


def known(name: str, elements, dtype=np.int64, shape=None) -> Value:
    """A value whose elements are known as dims (or a constant when they are all numbers)."""
    elements = list(elements)
    shape = (len(elements),) if shape is None else shape
    if all(isinstance(e, int) for e in elements):
        return Value(name, TensorType(dtype, shape), np.array(elements, dtype=dtype).reshape(shape))
    v = Value(name, TensorType(dtype, shape))
    v.sym_value = tuple(elements)
    return v


def concrete(v_or_elements, binding) -> np.ndarray:
    subs = {symbol(k): val for k, val in binding.items()}
    return np.array([int(sympy.sympify(e).subs(subs)) for e in v_or_elements])


def shape_of(binding) -> tuple[int, ...]:
    return tuple(int(concrete([d], binding)[0]) for d in X.type.shape)


def run(op_type: str, inputs, n_out: int = 1, opset: int = 17, **attrs):
    return propagate(Node(op_type, list(inputs), [], attrs, domain="", opset=opset), n_out)


SHAPE = Value("s", TensorType(np.int64, (4,)))
SHAPE.sym_value = (b, 3, h, 2 * h)

CASES = [
    # (op, inputs, attrs, numpy on (shape array s, binding))
    ("Shape", [X], {}, lambda s, _: s),
    ("Shape", [X], {"start": 1, "end": -1}, lambda s, _: s[1:-1]),
    ("Size", [X], {}, lambda s, _: np.array(np.prod(s))),
    ("Gather", [SHAPE, known("i", [0, 2])], {"axis": 0}, lambda s, _: s[[0, 2]]),
    ("Gather", [SHAPE, known("i", [-1])], {}, lambda s, _: s[[-1]]),
    ("Slice", [SHAPE, known("st", [1]), known("en", [3])], {}, lambda s, _: s[1:3]),
    ("Slice", [SHAPE, known("st", [-1]), known("en", [-5]), known("ax", [0]), known("sp", [-2])],
     {}, lambda s, _: s[-1:-5:-2]),
    ("Concat", [SHAPE, known("m", [-1])], {"axis": 0}, lambda s, _: np.concatenate([s, [-1]])),
    ("Mul", [SHAPE, known("two", [2])], {}, lambda s, _: s * 2),
    ("Add", [SHAPE, SHAPE], {}, lambda s, _: s + s),
    ("Sub", [SHAPE, known("one", [1])], {}, lambda s, _: s - 1),
    ("Div", [SHAPE, known("two", [2])], {}, None),  # exact only where sympy can tell: below
    ("Mod", [SHAPE, known("four", [4])], {}, lambda s, _: s % 4),
    ("Max", [SHAPE, known("five", [5])], {}, lambda s, _: np.maximum(s, 5)),
    ("Min", [SHAPE, known("five", [5])], {}, lambda s, _: np.minimum(s, 5)),
    ("Greater", [SHAPE, known("zero", [0])], {}, lambda s, _: s > 0),  # dims are positive
    ("Equal", [SHAPE, SHAPE], {}, lambda s, _: s == s),
    ("Less", [known("v", [h]), known("w", [h + 1])], {}, lambda s, _: np.array([True])),
    ("Unsqueeze", [SHAPE, known("ax", [0])], {}, lambda s, _: s[None]),
    ("Reshape", [SHAPE, known("t", [2, 2])], {}, lambda s, _: s.reshape(2, 2)),
    ("ReduceProd", [SHAPE], {"keepdims": 0}, lambda s, _: np.array(np.prod(s))),
    ("ReduceSum", [SHAPE, known("ax", [0])], {"keepdims": 1}, lambda s, _: s.sum(keepdims=True)),
    ("Expand", [known("e", [b]), known("t", [3])], {}, lambda s, bd: np.repeat(bd["b"], 3)),
    ("Cast", [SHAPE], {"to": 1}, lambda s, _: s.astype(np.float32)),
]


@pytest.mark.parametrize(("op", "inputs", "attrs", "reference"), [c for c in CASES if c[3]],
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES) if c[3]])
def test_like_numpy_on_the_concrete_shape(op, inputs, attrs, reference) -> None:
    out = run(op, inputs, **attrs)
    assert out is not None, f"{op} not evaluated"
    (t, elements), = out
    for binding in BINDINGS:
        want = np.asarray(reference(np.array(shape_of(binding)), binding))
        assert tuple(int(d) for d in t.shape) == want.shape
        if t.dtype.kind != "b":
            assert t.dtype == want.dtype or (t.dtype == np.int64 and want.dtype.kind in "iu")
        np.testing.assert_array_equal(concrete(elements, binding), want.reshape(-1).astype(np.int64))


def test_integer_division_truncates_and_stays_exact() -> None:
    out = run("Div", [known("v", [2 * h, h, -h]), known("d", [2, 3, 2])])
    assert out is not None
    (_, elements), = out
    for binding in BINDINGS:
        hv = binding["h"]
        assert list(concrete(elements, binding)) == [hv, hv // 3, -(hv // 2)]


def test_range_over_a_known_count() -> None:
    out = run("Range", [known("s", [h], shape=()), known("l", [h + 3], shape=()),
                        known("d", [1], shape=())])
    assert out is not None
    for binding in BINDINGS:
        hv = binding["h"]
        np.testing.assert_array_equal(concrete(out[0][1], binding), np.arange(hv, hv + 3))
    # a count that depends on the dims is not known
    assert run("Range", [known("s", [0], shape=()), known("l", [h], shape=()),
                         known("d", [1], shape=())]) is None


def test_split_into_known_parts() -> None:
    out = run("Split", [SHAPE, known("sizes", [1, 3])], 2)
    assert out is not None and [len(e) for _, e in out] == [1, 3]
    assert list(out[0][1]) == [b] and list(out[1][1]) == [3, h, 2 * h]


@pytest.mark.parametrize(("op", "inputs"), [
    ("Div", [known("v", [h]), known("d", [b])]),  # h / b: no floor the dim arithmetic has
    ("Less", [known("v", [h]), known("w", [b])]),  # unrelated dims
    ("Equal", [SHAPE, known("three", [3])]),  # b may be 3 or not
    ("Abs", [known("v", [h - b])]),  # sign unknown
    ("Gather", [SHAPE, known("i", [4])]),  # out of range: left to the op's own rule
], ids=["div-by-dim", "compare-unrelated", "equal-undecided", "abs-unknown-sign",
                                   "gather-out-of-range"])
def test_undecidable_values_are_left_to_run_time(op, inputs) -> None:
    assert run(op, inputs) is None


def test_nodes_without_symbolic_inputs_are_left_to_folding() -> None:
    assert run("Add", [known("a", [1, 2]), known("c", [3, 4])]) is None
