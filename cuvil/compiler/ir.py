"""cuvil's graph IR: typed values with symbolic dims, nodes, and the graph that owns them.

Dims are Python ints when known at compile time and sympy expressions over positive integer
symbols (named after the model's symbolic input dims, such as ``batch``) otherwise. Sympy
keeps derived dims exact (``batch*64`` after a Flatten, ``floor((h - 1)/2) + 1`` after a
strided conv), so shapes can be checked at compile time and evaluated at call time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import sympy

from cuvil.runtime import ABI_DTYPES

Dim = Union[int, sympy.Expr]

#: dtypes cuvil compiles, by numpy name: the ABI's (the manifest's schema lists them)
DTYPES = ABI_DTYPES


def symbol(name: str) -> sympy.Symbol:
    """The symbol for a named dim; every symbolic dim is a positive integer."""
    return sympy.Symbol(name, integer=True, positive=True)


def data_symbol(name: str) -> sympy.Symbol:
    """The symbol of a data-dependent dim (see `DataDim`): a non-negative integer, 0 included
    (a NonZero of zeros, no box kept)."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


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


#: no tensor or workspace may need more bytes than a 64-bit address space maps (47 bits on
#: x86-64 and most AArch64 systems); it also keeps the int64 sizes of generated code exact
MAX_TENSOR_BYTES = 1 << 47


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


@dataclass(frozen=True)
class DataDim:
    """A dim whose size only the data decides (NonZero's count, the boxes NonMaxSuppression
    keeps), known at compile time by an upper bound over the input dims.

    Its symbol stands in shapes like any dim, so the ops after the producing node type and
    lower as for an input dim. At run time the value lives in the `dims` array after the
    input dims (the ABI's order: `data_dims`): the producing node stores it there, the nodes
    after it read it like any other dim, and the caller reads it back. Memory is planned
    for the bound (`upper_bound`), which holds because shape rules give sizes that grow with
    their inputs' dims."""

    symbol: sympy.Symbol
    bound: Dim
    node: str  # how errors and docs name the producer ("node 'nms' (NonMaxSuppression)")


class IRError(Exception):
    """A graph breaks an invariant of the IR: a bug in cuvil (a pass, the frontend), never
    something a user can fix, hence not a `CuvilError`."""


def subgraphs(node: Node) -> list[Graph]:
    """The bodies of a node with graph attributes (If, Loop, Scan)."""
    return [a for a in node.attrs.values() if isinstance(a, Graph)]


def walk_nodes(nodes: Iterable[Node]) -> Iterator[Node]:
    """`nodes` and, after each, the nodes of its bodies, recursively."""
    for n in nodes:
        yield n
        for body in subgraphs(n):
            yield from walk_nodes(body.nodes)


def _register(node: Node) -> None:
    for v in node.inputs:
        if v is not None:
            v.users.append(node)
    for v in node.outputs:
        v.producer = node


def _unregister(node: Node) -> None:
    """Drop `node` from the users of what it reads (its outputs keep their producer)."""
    for v in node.inputs:
        if v is not None and node in v.users:
            v.users.remove(node)


class Graph:
    def __init__(self, name: str) -> None:
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.constraints: list[Constraint] = []
        #: every data-dependent dim the shape rules made, by symbol, in creation order (see
        #: `data_dims`: those still in the graph)
        self.data_dim_table: dict[sympy.Symbol, DataDim] = {}
        #: what the model's matrix products compute in: "float32", or "bf16" (the model's
        #: precision setting; passes/bf16_weights.py)
        self.precision = "float32"
        #: where Winograd convolutions' transformed weights come from: "library" (computed by
        #: the compiler, stored) or "first-run" (derived at run time; passes/winograd_weights.py)
        self.transformed_weights = "library"
        #: what the source ONNX model says of itself, for the package's onnxruntime-style
        #: session (driver.signature_of): its metadata by onnxruntime's ModelMetadata names, and
        #: each input's and output's dims as the file declares them (int, name, None: unnamed)
        self.metadata: dict[str, Any] = {}
        self.declared_shapes: dict[str, tuple[int | str | None, ...] | None] = {}
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

    # -- editing ------------------------------------------------------------------------
    # Every change to the wiring goes through these methods, so that `Value.users` (one entry
    # per input slot reading the value, nodes of subgraph bodies included) and
    # `Value.producer` stay exact; passes never touch those lists themselves.

    def add_node(self, node: Node, index: int | None = None) -> Node:
        """Append `node` (or insert it at position `index`) and register its wiring."""
        for v in node.outputs:
            if v.producer is not None and v.producer is not node:
                raise IRError(f"{self.name}: {node.describe()} would produce {v.name!r}, which "
                              f"{v.producer.describe()} already produces")
        _register(node)
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    def insert_before(self, anchor: Node, node: Node) -> Node:
        return self.add_node(node, self._index(anchor))

    def insert_after(self, anchor: Node, node: Node) -> Node:
        return self.add_node(node, self._index(anchor) + 1)

    def set_input(self, node: Node, i: int, value: Value | None) -> None:
        """Make input slot i of `node` read `value` (None: leave it empty); slots past the end
        are created empty."""
        while len(node.inputs) <= i:
            node.inputs.append(None)
        old = node.inputs[i]
        if old is value:
            return
        if old is not None:
            old.users.remove(node)
        node.inputs[i] = value
        if value is not None:
            value.users.append(node)

    def set_inputs(self, node: Node, values: Sequence[Value | None]) -> None:
        """Make `node` read `values`, slot by slot, instead of its inputs."""
        for v in node.inputs:
            if v is not None:
                v.users.remove(node)
        node.inputs = list(values)
        for v in node.inputs:
            if v is not None:
                v.users.append(node)

    def replace_uses(self, old: Value, new: Value) -> None:
        """Make every reader of `old` (nodes and graph outputs) read `new` instead."""
        for user in list(old.users):
            user.inputs = [new if v is old else v for v in user.inputs]
            new.users.append(user)
        old.users.clear()
        self.outputs = [new if v is old else v for v in self.outputs]

    def set_output(self, node: Node, i: int, value: Value) -> None:
        """Make `node` produce `value` as its output i; the value it produced there before is
        left without a producer. `value` must not be produced by another node."""
        if value.producer is not None and value.producer is not node:
            raise IRError(f"{self.name}: {node.describe()} cannot produce {value.name!r}: "
                          f"{value.producer.describe()} produces it")
        old = node.outputs[i]
        if old.producer is node:
            old.producer = None
        node.outputs[i] = value
        value.producer = node

    def replace_node(self, old: Node, new: Node) -> Node:
        """Put `new` in `old`'s place, producing `old`'s outputs (`new.outputs` empty or the
        same values); `old` leaves the graph, with the bodies `new` does not take over."""
        if new.outputs and new.outputs != old.outputs:
            raise IRError(f"{self.name}: {new.describe()} replaces {old.describe()} but has "
                          "other outputs")
        index = self._index(old)
        _unregister(old)
        kept = {id(b) for b in subgraphs(new)}
        for body in subgraphs(old):
            if id(body) not in kept:
                body.forget()
        del self.nodes[index]
        outputs, old.outputs = list(old.outputs), []
        for v in outputs:
            v.producer = None
        new.outputs = outputs
        return self.add_node(new, index)

    def absorb(self, producer: Node, consumer: Node) -> None:
        """Let `producer` compute `consumer` too (a fusion): `producer` takes over the output of
        `consumer`, in place of its own output that `consumer` reads, which nothing else may
        read; `consumer` leaves the graph."""
        read = [v for v in producer.outputs if consumer in v.users]
        if len(read) != 1 or len(consumer.outputs) != 1:
            raise IRError(f"{self.name}: {consumer.describe()} must read exactly one output of "
                          f"{producer.describe()} and have one output to be absorbed")
        x, y = read[0], consumer.outputs[0]
        if any(u is not consumer for u in x.users) or x in self.outputs:
            raise IRError(f"{self.name}: {producer.describe()} cannot absorb "
                          f"{consumer.describe()}: {x.name!r} has other readers")
        self.remove_nodes([consumer], keep_outputs=True)
        self.set_output(producer, producer.outputs.index(x), y)

    def remove_node(self, node: Node) -> None:
        self.remove_nodes([node])

    def remove_nodes(self, nodes: Iterable[Node], keep_outputs: bool = False) -> None:
        """Remove `nodes` (and the bodies of their subgraphs). No other node and no graph
        output may read what they produce, unless `keep_outputs`: the caller then gives those
        values another producer (see `absorb`)."""
        gone = list(nodes)
        members = {id(n) for n in self.nodes}
        closure = {id(n) for n in walk_nodes(gone)}
        for n in gone:
            if id(n) not in members:
                raise IRError(f"{self.name}: {n.describe()} is not a node of this graph")
            if keep_outputs:
                continue
            for v in n.outputs:
                if v in self.outputs:
                    raise IRError(f"{self.name}: cannot remove {n.describe()}: {v.name!r} is a "
                                  "graph output")
                reader = next((u for u in v.users if id(u) not in closure), None)
                if reader is not None:
                    raise IRError(f"{self.name}: cannot remove {n.describe()}: {reader.describe()} "
                                  f"reads {v.name!r}")
        for n in walk_nodes(gone):
            _unregister(n)
        for n in gone:
            for v in n.outputs:
                if v.producer is n:
                    v.producer = None
            if keep_outputs:
                n.outputs = []
        removed = {id(n) for n in gone}
        self.nodes = [n for n in self.nodes if id(n) not in removed]

    def forget(self) -> None:
        """Drop every node (a body that will not be compiled), so that the values it read,
        enclosing ones among them, no longer count its nodes as users."""
        for n in walk_nodes(self.nodes):
            _unregister(n)
        self.nodes = []

    def _index(self, node: Node) -> int:
        for i, n in enumerate(self.nodes):
            if n is node:
                return i
        raise IRError(f"{self.name}: {node.describe()} is not a node of this graph")

    def verify(self) -> None:
        """Check the IR's invariants on this graph and its nodes' bodies (see
        `cuvil.compiler.verify`); raise `IRError` naming the first broken one."""
        from cuvil.compiler.verify import verify_graph

        verify_graph(self)

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

    @property
    def data_dims(self) -> list[DataDim]:
        """The data-dependent dims some node still outputs, in creation order: the order of
        their slots in the ABI's dim array, after the input dims."""
        used: set[sympy.Symbol] = set()
        for n in self.nodes:
            for v in n.outputs:
                for d in v.type.shape:
                    if not isinstance(d, int):
                        used |= d.free_symbols
        return [dd for s, dd in self.data_dim_table.items() if s in used]

    def upper_bound(self, d: Dim) -> Dim:
        """`d` with every data-dependent dim replaced by its bound: an expression of the
        input dims that `d` never exceeds (sizes grow with dims)."""
        for _ in range(len(self.data_dim_table) + 1):
            if isinstance(d, int) or not (d.free_symbols & self.data_dim_table.keys()):
                return d
            d = simplify_dim(sympy.sympify(d).subs(
                {s: dd.bound for s, dd in self.data_dim_table.items()}))
        raise IRError(f"{self.name}: the bounds of data-dependent dims refer to each other")

    def __repr__(self) -> str:
        lines = [f"graph {self.name}({', '.join(repr(v) for v in self.inputs)})"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines.append(f"  return {', '.join(v.name for v in self.outputs)}")
        return "\n".join(lines)
