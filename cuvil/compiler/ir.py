"""cuvil's graph IR: typed values with symbolic dims, nodes, and the graph that owns them.

Dims are Python ints when known at compile time and sympy expressions over positive integer
symbols (named after the model's symbolic input dims, such as ``batch``) otherwise. Sympy
keeps derived dims exact (``batch*64`` after a Flatten, ``floor((h - 1)/2) + 1`` after a
strided conv), so shapes can be checked at compile time and evaluated at call time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import sympy

Dim = Union[int, sympy.Expr]

#: dtypes cuvil compiles, by numpy name. Keys are also the names used in the ABI.
DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool")


def symbol(name: str) -> sympy.Symbol:
    """The symbol for a named dim; every symbolic dim is a positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)


def simplify_dim(d: Dim) -> Dim:
    """Return an int when `d` is a constant expression, else the (expanded) expression."""
    if isinstance(d, (int, np.integer)):
        return int(d)
    d = sympy.sympify(d)
    if d.is_Integer:
        return int(d)
    return d


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


def dim_str(d: Dim) -> str | int:
    """A dim as users see it: an int, or the expression's text (``batch``, ``2*batch``)."""
    return d if isinstance(d, int) else str(d)


def numel(shape: Iterable[Dim]) -> Dim:
    n: Dim = 1
    for d in shape:
        n = n * d
    return simplify_dim(n)


@dataclass(frozen=True)
class TensorType:
    dtype: np.dtype
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(simplify_dim(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Dim:
        return numel(self.shape)

    @property
    def nbytes(self) -> Dim:
        return simplify_dim(self.numel * self.dtype.itemsize)

    @property
    def is_static(self) -> bool:
        return all(is_static(d) for d in self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.name}[{', '.join(str(dim_str(d)) for d in self.shape)}]"


class Value:
    """A tensor flowing through the graph: an input, an output of a node, or a constant."""

    def __init__(self, name: str, type: TensorType, const: np.ndarray | None = None,
                 sym_value: tuple[Dim, ...] | None = None) -> None:
        self.name = name
        self.type = type
        self.const = const
        #: the elements (row-major, flattened) of a small integer tensor whose values are
        #: known at compile time as dims, e.g. ``Shape(x)`` of an input ``x[batch, 3]`` is
        #: ``(batch, 3)``. Shape rules read it like a constant (see `known_values`); code
        #: that needs the tensor itself computes it from the dims at run time.
        self.sym_value = sym_value
        self.producer: Node | None = None
        self.users: list[Node] = []

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def is_known(self) -> bool:
        """True when the elements are known at compile time, as numbers or as dims."""
        return self.const is not None or self.sym_value is not None

    def known_values(self) -> tuple[Dim, ...] | None:
        """The flattened elements as dims (ints or sympy expressions), or None if unknown.

        Integer and bool constants give Python ints; float constants give exact sympy
        numbers (so shape arithmetic such as ``floor(h * 0.5)`` stays exact).
        """
        if self.sym_value is not None:
            return self.sym_value
        if self.const is None:
            return None
        flat = np.asarray(self.const).reshape(-1)
        if flat.dtype.kind in "iub":
            return tuple(int(x) for x in flat)
        if flat.dtype.kind == "f":
            return tuple(simplify_dim(sympy.Rational(float(x))) if np.isfinite(x)
                         else sympy.nan for x in flat)
        return None

    def __repr__(self) -> str:
        kind = "const " if self.is_const else ""
        known = f" = {[dim_str(d) for d in self.sym_value]}" if self.sym_value is not None else ""
        return f"<Value {kind}{self.name!r} {self.type}{known}>"


@dataclass(eq=False)
class Node:
    op_type: str
    inputs: list[Value | None]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    #: opset version of the node's domain in the model
    opset: int = 0

    def input(self, i: int) -> Value | None:
        """Input i, or None when it is absent (optional input left empty or beyond the list)."""
        return self.inputs[i] if i < len(self.inputs) else None

    def describe(self) -> str:
        """How errors name a node: its name (or first output) and op type."""
        label = self.name or (self.outputs[0].name if self.outputs else "?")
        return f"node {label!r} ({self.op_type})"

    def __repr__(self) -> str:
        ins = ", ".join(v.name if v else "-" for v in self.inputs)
        outs = ", ".join(v.name for v in self.outputs)
        return f"<Node {self.op_type} {self.name!r} ({ins}) -> ({outs})>"


@dataclass(frozen=True)
class Constraint:
    """A fact about symbolic dims that a call must satisfy, checked before running."""

    condition: sympy.Basic  # a relational over symbols, e.g. Eq(batch*16, 64*n) or h >= 3
    message: str


class Graph:
    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.constraints: list[Constraint] = []
        self._names: set[str] = set()
        self._counter = itertools.count()

    # -- building -----------------------------------------------------------------------
    def unique_name(self, base: str) -> str:
        name = base
        while name in self._names:
            name = f"{base}_{next(self._counter)}"
        self._names.add(name)
        return name

    def value(self, name: str, type: TensorType, const: np.ndarray | None = None) -> Value:
        return Value(self.unique_name(name), type, const)

    def constant(self, array: np.ndarray, name: str = "const") -> Value:
        array = np.asarray(array, order="C")  # (ascontiguousarray makes 0-D arrays 1-D)
        return self.value(name, TensorType(array.dtype, array.shape), array)

    def add_node(self, node: Node, index: int | None = None) -> Node:
        for v in node.inputs:
            if v is not None:
                v.users.append(node)
        for v in node.outputs:
            v.producer = node
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    def remove_node(self, node: Node) -> None:
        self.nodes.remove(node)
        for v in node.inputs:
            if v is not None and node in v.users:
                v.users.remove(node)
        for v in node.outputs:
            if v.producer is node:
                v.producer = None

    def replace_uses(self, old: Value, new: Value) -> None:
        """Make every reader of `old` (nodes and graph outputs) read `new` instead."""
        for user in list(old.users):
            user.inputs = [new if v is old else v for v in user.inputs]
            new.users.append(user)
        old.users.clear()
        self.outputs = [new if v is old else v for v in self.outputs]

    # -- queries ------------------------------------------------------------------------
    @property
    def symbols(self) -> list[sympy.Symbol]:
        """The symbols of the input dims, in first-seen order: the order of the ABI's dim array."""
        seen: dict[str, sympy.Symbol] = {}
        for v in self.inputs:
            for d in v.type.shape:
                if not isinstance(d, int):
                    for s in sorted(d.free_symbols, key=lambda s: s.name):
                        seen.setdefault(s.name, s)
        return list(seen.values())

    def __repr__(self) -> str:
        lines = [f"graph {self.name}({', '.join(repr(v) for v in self.inputs)})"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"  return {', '.join(v.name for v in self.outputs)}")
        return "\n".join(lines)
