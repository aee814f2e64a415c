"""Shape arithmetic at compile time: the values of small tensors computed from input dims.

Exported models compute shapes inside the graph (``Shape -> Gather -> Unsqueeze -> Concat ->
Reshape``, ``Range(0, Shape(x)[1])``, ``Div`` of a dim by 2 ...). When every input such a node
reads is known (a constant, or a value already known as dims), its outputs are known too:
this module evaluates the node on those values, with sympy expressions standing for the
symbolic dims. The importer then stores the result on `Value.sym_value` so shape rules can read
it like a constant, and replaces the node by one that computes the values from the dims when
the tensor is needed at run time.

Values are held as numpy object arrays whose elements are Python ints or sympy expressions;
numpy does the indexing, broadcasting and concatenation. A rule returns None when it cannot
decide a value exactly (a division whose sign is unknown, a comparison of two unrelated
dims...); the node then stays an ordinary run-time node.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import onnx
import sympy

from cuvil.compiler.ir import Dim, Node, TensorType, Value, numel, simplify_dim

__all__ = ["MAX_ELEMENTS", "propagate"]

#: larger tensors are not tracked element by element
MAX_ELEMENTS = 64

#: a known tensor: elements (object array of ints / sympy expressions) and its dtype
Known = tuple[np.ndarray, np.dtype]
Rule = Callable[[Node, list[Optional[Known]]], Optional[list[Known]]]

_RULES: dict[str, Rule] = {"Split": lambda node, ins: None}  # Split: see `propagate`


def _rule(*op_types: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in op_types:
            _RULES[t] = fn
        return fn
    return deco


def propagate(node: Node, num_outputs: int) -> list[tuple[TensorType, tuple[Dim, ...]]] | None:
    """The type and flattened values of each of the `num_outputs` outputs of `node`, or None
    when not all are known.

    Only nodes reading at least one symbolically-known value (or Shape/Size, which read only
    the input's type) are evaluated here; nodes on plain constants are left to constant
    folding.
    """
    if node.domain not in ("", "ai.onnx") or node.op_type not in _RULES:
        return None
    if node.op_type not in ("Shape", "Size") and not any(
            v is not None and v.sym_value is not None for v in node.inputs):
        return None
    ins = [_known(v) for v in node.inputs]
    try:
        rule = _RULES[node.op_type]
        outs = _split(node, ins, num_outputs) if node.op_type == "Split" else rule(node, ins)
    except (ValueError, TypeError, IndexError, ZeroDivisionError, KeyError, OverflowError):
        return None  # malformed for evaluation here: the op's own shape rule reports it
    if outs is None or len(outs) != num_outputs:
        return None
    result = []
    for arr, dtype in outs:
        if not isinstance(arr, np.ndarray):  # numpy indexing returns a 0-D result as an element
            element = arr
            arr = np.empty((), dtype=object)
            arr[()] = element
        if arr.size > MAX_ELEMENTS:
            return None
        values = tuple(_clean(x, dtype) for x in arr.reshape(-1))
        if any(x is None for x in values):
            return None
        result.append((TensorType(dtype, arr.shape), values))
    return result


def _known(v: Value | None) -> Known | None:
    if v is None:
        return None
    values = v.known_values()
    if values is None or len(values) > MAX_ELEMENTS or not v.type.is_static:
        return None
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr.reshape(tuple(int(d) for d in v.type.shape)), v.type.dtype


def _clean(x: Any, dtype: np.dtype) -> Dim | None:
    """Canonical element: int when constant; integer dtypes must hold integer values."""
    if isinstance(x, (bool, np.bool_)):
        x = int(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = sympy.sympify(x)
    if x.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo):
        return None
    if dtype.kind in "iub":
        if x.is_integer is not True:
            return None
        return simplify_dim(x)
    # float values: keep only exact numbers with small power-of-two denominators, which
    # float arithmetic on dims reproduces exactly
    for r in x.atoms(sympy.Rational):
        q = int(r.q)
        if q > (1 << 16) or q & (q - 1):
            return None
    return simplify_dim(x) if x.is_integer else x


def _arr(values: Sequence[Any], shape: Sequence[int] | None = None) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr if shape is None else arr.reshape(tuple(shape))


def _ints(k: Known | None) -> list[int] | None:
    """A known tensor whose elements are all static ints, flattened."""
    if k is None or not all(isinstance(x, int) for x in k[0].reshape(-1)):
        return None
    return [int(x) for x in k[0].reshape(-1)]


def _attr_or_input(node: Node, ins: list[Known | None], attr: str, index: int,
                   since: int) -> list[int] | None:
    if node.opset >= since:
        return _ints(ins[index] if index < len(ins) else None)
    v = node.attrs.get(attr)
    return None if v is None else [int(a) for a in np.reshape(v, -1)]


# -- sources --------------------------------------------------------------------------------


@_rule("Shape")
def _shape(node: Node, ins: list[Known | None]) -> list[Known] | None:
    x = node.inputs[0]
    assert x is not None
    shape = list(x.type.shape)
    rank = len(shape)
    start = int(node.attrs.get("start", 0)) if node.opset >= 15 else 0
    end = node.attrs.get("end") if node.opset >= 15 else None
    end = rank if end is None else int(end)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return [(_arr(shape[start:end]), np.dtype(np.int64))]


@_rule("Size")
def _size(node: Node, ins: list[Known | None]) -> list[Known] | None:
    x = node.inputs[0]
    assert x is not None
    return [(_arr([x.type.numel], ()), np.dtype(np.int64))]


# -- data movement --------------------------------------------------------------------------


@_rule("Identity")
def _identity(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return None if ins[0] is None else [ins[0]]


@_rule("Cast")
def _cast(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    arr, _src = ins[0]
    to = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])))
    if to.kind not in "iubf":
        return None
    out = []
    for x in arr.reshape(-1):
        if isinstance(x, int):
            out.append(int(np.array(x).astype(to).item()) if to.kind in "iub" else x)
            continue
        if to.kind == "f":
            out.append(x)
        elif to.kind == "b":
            nz = _sign(x)
            if nz is None or nz == "?":
                return None
            out.append(0 if nz == 0 else 1)
        elif x.is_integer:
            out.append(x)
        elif x.is_nonnegative:
            out.append(sympy.floor(x))  # float -> int truncates toward zero
        elif x.is_nonpositive:
            out.append(sympy.ceiling(x))
        else:
            return None
    return [(_arr(out, arr.shape), to)]


@_rule("Gather")
def _gather(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None or ins[1] is None:
        return None
    data, dtype = ins[0]
    idx = _ints(ins[1])
    if idx is None:
        return None
    axis = int(node.attrs.get("axis", 0))
    axis = axis + data.ndim if axis < 0 else axis
    n = data.shape[axis]
    idx_arr = np.array([i + n if i < 0 else i for i in idx], dtype=np.int64).reshape(ins[1][0].shape)
    if idx_arr.size and (idx_arr.min() < 0 or idx_arr.max() >= n):
        return None
    return [(np.take(data, idx_arr, axis=axis), dtype)]


@_rule("Slice")
def _slice(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    data, dtype = ins[0]
    starts = _attr_or_input(node, ins, "starts", 1, 10)
    ends = _attr_or_input(node, ins, "ends", 2, 10)
    if starts is None or ends is None:
        return None
    axes = _attr_or_input(node, ins, "axes", 3, 10)
    steps = _ints(ins[4]) if node.opset >= 10 and len(ins) > 4 and ins[4] is not None else None
    if node.opset >= 10 and len(ins) > 3 and ins[3] is not None and axes is None:
        return None
    if node.opset >= 10 and len(ins) > 4 and ins[4] is not None and steps is None:
        return None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index: list[slice] = [slice(None)] * data.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st == 0:
            return None
        index[a + data.ndim if a < 0 else a] = slice(s, e, st)
    return [(data[tuple(index)], dtype)]


@_rule("Concat")
def _concat(node: Node, ins: list[Known | None]) -> list[Known] | None:
    present = [k for k, v in zip(ins, node.inputs) if v is not None]
    if any(k is None for k in present) or not present:
        return None
    arrays = [k[0] for k in present if k is not None]
    return [(np.concatenate(arrays, axis=int(node.attrs["axis"])), present[0][1])]  # type: ignore[index]


@_rule("Unsqueeze")
def _unsqueeze(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    axes = _attr_or_input(node, ins, "axes", 1, 13)
    if axes is None:
        return None
    arr, dtype = ins[0]
    rank = arr.ndim + len(axes)
    shape = list(arr.shape)
    for a in sorted(a + rank if a < 0 else a for a in axes):
        shape.insert(a, 1)
    return [(arr.reshape(shape), dtype)]


@_rule("Squeeze")
def _squeeze(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    arr, dtype = ins[0]
    axes = _attr_or_input(node, ins, "axes", 1, 13)
    if axes is None:
        if (node.opset >= 13 and node.input(1) is not None):
            return None
        axes = [a for a, d in enumerate(arr.shape) if d == 1]
    axes = [a + arr.ndim if a < 0 else a for a in axes]
    if any(arr.shape[a] != 1 for a in axes):
        return None
    return [(arr.reshape([d for a, d in enumerate(arr.shape) if a not in axes]), dtype)]


@_rule("Reshape")
def _reshape(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    target = _ints(ins[1])
    if target is None:
        return None
    arr, dtype = ins[0]
    allowzero = int(node.attrs.get("allowzero", 0))
    shape = [arr.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    return [(arr.reshape(shape), dtype)]


@_rule("Flatten")
def _flatten(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    arr, dtype = ins[0]
    axis = int(node.attrs.get("axis", 1))
    axis = axis + arr.ndim if axis < 0 else axis
    return [(arr.reshape(math.prod(arr.shape[:axis]), -1), dtype)]


@_rule("Transpose")
def _transpose(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[0] is None:
        return None
    arr, dtype = ins[0]
    perm = node.attrs.get("perm")
    return [(arr.transpose(None if perm is None else [int(p) for p in perm]), dtype)]


def _split(node: Node, ins: list[Known | None], num_outputs: int) -> list[Known] | None:
    if ins[0] is None:
        return None
    arr, dtype = ins[0]
    axis = int(node.attrs.get("axis", 0))
    n = arr.shape[axis]
    sizes = _attr_or_input(node, ins, "split", 1, 13)
    if sizes is None:
        parts = num_outputs
        chunk = -(-n // parts)
        sizes = [min(chunk, n - i * chunk) for i in range(parts)]
        if node.opset < 18 and n % parts:
            return None
    bounds = np.cumsum(sizes)[:-1]
    return [(a, dtype) for a in np.split(arr, bounds, axis=axis)]


@_rule("Expand")
def _expand(node: Node, ins: list[Known | None]) -> list[Known] | None:
    shape = _ints(ins[1])
    if ins[0] is None or shape is None:
        return None
    arr, dtype = ins[0]
    out_shape = np.broadcast_shapes(arr.shape, tuple(shape))
    return [(np.broadcast_to(arr, out_shape).copy(), dtype)]


@_rule("Tile")
def _tile(node: Node, ins: list[Known | None]) -> list[Known] | None:
    reps = _ints(ins[1])
    if ins[0] is None or reps is None:
        return None
    return [(np.tile(ins[0][0], reps), ins[0][1])]


@_rule("Range")
def _range(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if any(k is None for k in ins[:3]):
        return None
    start, limit, delta = (sympy.sympify(k[0].reshape(-1)[0]) for k in ins[:3])  # type: ignore[index]
    if not delta.is_number or delta == 0:
        return None
    count = sympy.ceiling((limit - start) / delta)
    if not count.is_Integer:
        return None
    n = max(int(count), 0)
    if n > MAX_ELEMENTS:
        return None
    return [(_arr([start + i * delta for i in range(n)]), ins[0][1])]  # type: ignore[index]


# -- arithmetic -----------------------------------------------------------------------------


def _elementwise(node: Node, ins: list[Known | None], fn: Callable[..., Any],
                 dtype: np.dtype | None = None) -> list[Known] | None:
    present = [k for k, v in zip(ins, node.inputs) if v is not None]
    if not present or any(k is None for k in present):
        return None
    arrays = np.broadcast_arrays(*[k[0] for k in present if k is not None])
    out = np.empty(arrays[0].shape, dtype=object)
    for index in np.ndindex(out.shape):
        r = fn(*[a[index] for a in arrays])
        if r is None:
            return None
        out[index] = r
    return [(out, dtype or present[0][1])]  # type: ignore[index]


def _is_int_dtype(ins: list[Known | None]) -> bool:
    return ins[0] is not None and ins[0][1].kind in "iub"


@_rule("Add")
def _add(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a, b: a + b)


@_rule("Sub")
def _sub(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a, b: a - b)


@_rule("Mul")
def _mul(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a, b: a * b)


@_rule("Neg")
def _neg(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a: -a)


@_rule("Abs")
def _abs(node: Node, ins: list[Known | None]) -> list[Known] | None:
    def fn(a: Any) -> Any:
        s = _sign(a)
        return None if s == "?" else (a if s >= 0 else -a)  # type: ignore[operator]
    return _elementwise(node, ins, fn)


@_rule("Div")
def _div(node: Node, ins: list[Known | None]) -> list[Known] | None:
    integer = _is_int_dtype(ins)

    def fn(a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            if b == 0:
                return None
            if not integer:
                return sympy.Rational(a, b)
            q = abs(a) // abs(b)
            return q if (a >= 0) == (b >= 0) else -q  # integer division truncates toward zero
        q = sympy.sympify(a) / b
        if not integer or q.is_integer:
            return simplify_dim(sympy.simplify(q)) if integer else q
        if not isinstance(b, int):
            return None  # floor by a symbolic divisor cannot be computed by the dim arithmetic
        sa = _sign(a)
        if sa == "?":
            return None
        return sympy.floor(q) if (sa >= 0) == (b > 0) else sympy.ceiling(q)  # type: ignore[operator]
    return _elementwise(node, ins, fn)


@_rule("Mod")
def _mod(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if not _is_int_dtype(ins):
        return None
    fmod = int(node.attrs.get("fmod", 0))

    def fn(a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            if b == 0:
                return None
            return int(math.fmod(a, b)) if fmod else a % b
        if not isinstance(b, int) or b <= 0:
            return None
        if fmod and (_sign(a) == "?" or _sign(a) < 0):  # type: ignore[operator]
            return None  # fmod takes the dividend's sign; for a >= 0 it agrees with %
        return sympy.Mod(a, b)  # Python's %, which the dim arithmetic computes
    return _elementwise(node, ins, fn)


@_rule("Max")
def _max(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda *xs: sympy.Max(*xs))


@_rule("Min")
def _min(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda *xs: sympy.Min(*xs))


@_rule("Floor")
def _floor(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a: sympy.floor(a))


@_rule("Ceil")
def _ceil(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a: sympy.ceiling(a))


def _sign(x: Any) -> int | str:
    """-1, 0 or 1 when sympy can decide the sign of `x`, else "?"."""
    if isinstance(x, int):
        return (x > 0) - (x < 0)
    x = sympy.sympify(x)
    if x.is_zero:
        return 0
    if x.is_positive:
        return 1
    if x.is_negative:
        return -1
    return "?"


def _compare(test: Callable[[int], bool]) -> Rule:
    def rule(node: Node, ins: list[Known | None]) -> list[Known] | None:
        def fn(a: Any, b: Any) -> Any:
            s = _sign(sympy.sympify(a) - b)
            return None if s == "?" else int(test(s))  # type: ignore[arg-type]
        return _elementwise(node, ins, fn, np.dtype(np.bool_))
    return rule


_RULES["Equal"] = _compare(lambda s: s == 0)
_RULES["Less"] = _compare(lambda s: s < 0)
_RULES["LessOrEqual"] = _compare(lambda s: s <= 0)
_RULES["Greater"] = _compare(lambda s: s > 0)
_RULES["GreaterOrEqual"] = _compare(lambda s: s >= 0)


@_rule("Not")
def _not(node: Node, ins: list[Known | None]) -> list[Known] | None:
    return _elementwise(node, ins, lambda a: None if not isinstance(a, int) else int(not a))


@_rule("And", "Or", "Xor")
def _logical(node: Node, ins: list[Known | None]) -> list[Known] | None:
    fn: Callable[[bool, bool], bool] = {"And": lambda a, b: a and b, "Or": lambda a, b: a or b,
                                        "Xor": lambda a, b: a != b}[node.op_type]
    return _elementwise(node, ins, lambda a, b: None if not (isinstance(a, int) and isinstance(
        b, int)) else int(bool(fn(bool(a), bool(b)))))


@_rule("Where")
def _where(node: Node, ins: list[Known | None]) -> list[Known] | None:
    if ins[1] is None:
        return None
    out = _elementwise(node, ins, lambda c, a, b: None if not isinstance(c, int) else (a if c else b))
    return None if out is None else [(out[0][0], ins[1][1])]


def _reduce(fn: Callable[[list[Any]], Any], axes_input_since: int) -> Rule:
    def rule(node: Node, ins: list[Known | None]) -> list[Known] | None:
        if ins[0] is None:
            return None
        arr, dtype = ins[0]
        axes = _attr_or_input(node, ins, "axes", 1, axes_input_since)
        if axes is None:
            if node.opset >= axes_input_since and node.input(1) is not None:
                return None
            if int(node.attrs.get("noop_with_empty_axes", 0)):
                return [(arr, dtype)]
            axes = list(range(arr.ndim))
        axes = sorted({a + arr.ndim if a < 0 else a for a in axes})
        keep = [a for a in range(arr.ndim) if a not in axes]
        moved = arr.transpose(keep + axes).reshape(
            [arr.shape[a] for a in keep] + [math.prod(arr.shape[a] for a in axes)])
        out = np.empty(moved.shape[:-1], dtype=object)
        for index in np.ndindex(out.shape):
            out[index] = fn(list(moved[index]))
        if int(node.attrs.get("keepdims", 1)):
            out = out.reshape([1 if a in axes else d for a, d in enumerate(arr.shape)])
        return [(out, dtype)]
    return rule


_RULES["ReduceProd"] = _reduce(lambda xs: numel(xs), 18)
_RULES["ReduceSum"] = _reduce(lambda xs: functools.reduce(lambda a, b: a + b, xs, 0), 13)
_RULES["ReduceMax"] = _reduce(lambda xs: sympy.Max(*xs), 18)
_RULES["ReduceMin"] = _reduce(lambda xs: sympy.Min(*xs), 18)
