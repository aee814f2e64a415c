"""The IR's invariants, checked on a whole graph (and the bodies of its nodes).

`verify_graph` is what `Graph.verify` runs; the test suite runs it on the frontend's output
and after every pass (``CUVIL_VERIFY_IR=1``, see `cuvil.compiler.passes.run_passes`). A
broken invariant is a bug in cuvil, reported as `IRError` naming the graph, the node and
what is wrong:

- wiring: each value's `producer` produces it and each of its `users` entries is one input
  slot of a node that reads it (nodes of bodies included); no value is produced twice, and
  graph inputs and constants are produced by no node;
- order: a node reads only graph inputs, constants and values produced before it (a body
  also reads what its node can read); graph outputs are available at the end;
- names: the values a graph defines (inputs, node outputs) have distinct names (constants
  are not checked: a body's constants become free values of its node, named in the body's
  namespace, and nothing refers to a constant by name);
- types: each node's output types are what its op's shape rule gives for its inputs now
  (the ops registry hands its lookup to `use_shape_rules` when it is imported: the IR comes
  before the ops in the part order, so it does not import them).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import sympy

from cuvil.compiler.ir import Dim, Graph, IRError, Node, TensorType, Value, subgraphs, walk_nodes

__all__ = ["use_shape_rules", "verify_graph"]

#: (domain, op type, opset) -> the op (with `infer`), or None; set by the ops registry
_lookup: Callable[[str, str, int], Any] | None = None


def use_shape_rules(lookup: Callable[[str, str, int], Any]) -> None:
    """Let `verify_graph` re-run the ops' shape rules (called by `cuvil.compiler.ops`)."""
    global _lookup
    _lookup = lookup


def verify_graph(graph: Graph) -> None:
    nodes = list(walk_nodes(graph.nodes))
    _check_wiring(graph, nodes)
    _check_scope(graph, set(), {id(n) for n in nodes})


def _check_wiring(graph: Graph, nodes: list[Node]) -> None:
    slots: dict[Value, Counter[int]] = {}
    by_id = {id(n): n for n in nodes}
    producer_of: dict[Value, Node] = {}
    for n in nodes:
        for v in n.inputs:
            if v is not None and not isinstance(v, Value):
                raise IRError(f"{graph.name}: {n.describe()} has an input that is not a Value: {v!r}")
            if v is not None:
                slots.setdefault(v, Counter())[id(n)] += 1
        for v in n.outputs:
            if v in producer_of:
                raise IRError(f"{graph.name}: {v.name!r} is produced twice, by "
                              f"{producer_of[v].describe()} and {n.describe()}")
            producer_of[v] = n
            if v.producer is not n:
                actual = v.producer.describe() if v.producer is not None else "no node"
                raise IRError(f"{graph.name}: {n.describe()} outputs {v.name!r}, whose producer is "
                              f"{actual}")
            if v.is_const:
                raise IRError(f"{graph.name}: {n.describe()} produces {v.name!r}, a constant")
            slots.setdefault(v, Counter())
    values = set(slots) | set(graph.inputs) | set(graph.outputs)
    for body in (b for n in nodes for b in subgraphs(n)):
        values.update(body.inputs)
        values.update(body.outputs)
    for v in values:
        p = v.producer
        if p is not None and producer_of.get(v) is not p:
            where = "a node outside the graph" if id(p) not in by_id else p.describe()
            raise IRError(f"{graph.name}: {v.name!r} names {where} as its producer, which does "
                          "not list it among its outputs")
        listed = Counter(id(u) for u in v.users)
        want = slots.get(v, Counter())
        if listed != want:
            for key in (listed - want) | (want - listed):
                node = by_id.get(key) or next(u for u in v.users if id(u) == key)
                raise IRError(f"{graph.name}: {v.name!r} lists {node.describe()} as a user "
                              f"{listed[key]} time(s) but the node reads it in {want[key]} "
                              "input slot(s)" + ("" if key in by_id else
                                                 " (the node is in no graph)"))


def _check_scope(graph: Graph, outer: set[Value], members: set[int]) -> None:
    """Order, names and types within `graph`, whose nodes may also read `outer`."""
    available = set(outer)
    names: dict[str, Value] = {}

    def define(v: Value, what: str) -> None:
        other = names.setdefault(v.name, v)
        if other is not v:
            raise IRError(f"{graph.name}: two values are named {v.name!r} ({what})")

    for v in graph.inputs:
        if v.producer is not None:
            raise IRError(f"{graph.name}: graph input {v.name!r} is produced by "
                          f"{v.producer.describe()}")
        if v.is_const:
            raise IRError(f"{graph.name}: graph input {v.name!r} is a constant")
        define(v, "a graph input")
        available.add(v)
    for n in graph.nodes:
        for i, read in enumerate(n.inputs):
            if read is None or read in available:
                continue
            if read.is_const and read.producer is None:
                _check_constant(graph, read)
                available.add(read)
                continue
            where = (f"produced later by {read.producer.describe()}" if read.producer is not None
                     and id(read.producer) in members else "neither an input, a constant nor "
                     "produced by an earlier node")
            raise IRError(f"{graph.name}: {n.describe()} reads {read.name!r} (input {i}), {where}")
        for body in subgraphs(n):
            _check_scope(body, available, members)
        _check_types(graph, n)
        for v in n.outputs:
            define(v, f"an output of {n.describe()}")
            available.add(v)
    for v in graph.outputs:
        if v.is_const and v not in available:
            _check_constant(graph, v)
        elif v not in available:
            raise IRError(f"{graph.name}: graph output {v.name!r} is not produced by any node of "
                          "the graph nor an input or a constant")


def _check_constant(graph: Graph, v: Value) -> None:
    c = v.const
    assert c is not None
    if v.type.dtype != c.dtype or v.type.shape != tuple(c.shape):
        raise IRError(f"{graph.name}: constant {v.name!r} is typed {v.type} but holds a "
                      f"{c.dtype}{list(c.shape)} array")


class _Probe:
    """A shape-rule context that records nothing: the rules already checked the model."""

    def __init__(self) -> None:
        self.graph = Graph("verify")  # for rules that make constants (RNN weight packing)

    def require(self, node: Node, condition: Any, message: str) -> None:
        pass

    def dims_equal(self, node: Node, a: Dim, b: Dim, what: str) -> Dim:
        return a if isinstance(a, int) else b

    def data_dim(self, node: Node, output: int, axis: int, bound: Dim) -> Dim:
        """The data-dependent dim the node's output has (the rule made it when typing)."""
        d = node.outputs[output].type.shape[axis] if output < len(node.outputs) else None
        if d == 0:
            return 0
        if not isinstance(d, sympy.Symbol) or d.is_positive:
            raise IRError(f"{node.describe()}: output {output} dim {axis} is {d}, not the "
                          "data-dependent dim its shape rule makes")
        return d


def _check_types(graph: Graph, node: Node) -> None:
    """Re-run the node's shape rule on a copy (rules may rewrite their node, e.g. pack
    weights) and compare with the output types it has."""
    if _lookup is None:  # no op registry loaded: no node could have been typed by a rule
        return
    if node.domain == "cuvil" and node.op_type == "SymbolicValue":
        # its type is its output's (the frontend's shape arithmetic made it): check the
        # elements it carries instead
        v = node.outputs[0] if len(node.outputs) == 1 else None
        if v is None or v.sym_value is None or not isinstance(v.type.numel, int) \
                or len(v.sym_value) != v.type.numel:
            raise IRError(f"{graph.name}: {node.describe()} must output one value carrying as "
                          "many elements as its type holds")
        return
    op = _lookup(node.domain, node.op_type, node.opset)
    if op is None:
        raise IRError(f"{graph.name}: {node.describe()} has no implementation at opset "
                      f"{node.opset}")
    copy = Node(node.op_type, list(node.inputs), [Value(v.name, v.type) for v in node.outputs],
                dict(node.attrs), node.name, node.domain, node.opset)
    try:
        types = op.infer(copy, _Probe())
    except Exception as exc:
        raise IRError(f"{graph.name}: {node.describe()}: its shape rule rejects the node as it "
                      f"is now: {type(exc).__name__}: {exc}") from exc
    # a rule may type optional outputs the node leaves out (the importer keeps as many as
    # the node has)
    if len(types) < len(node.outputs):
        raise IRError(f"{graph.name}: {node.describe()} has {len(node.outputs)} outputs but its "
                      f"shape rule gives {len(types)}")
    for v, t in zip(node.outputs, types):
        if not _same_type(v.type, t):
            raise IRError(f"{graph.name}: {node.describe()} output {v.name!r} is {v.type} but "
                          f"its shape rule gives {t}")


def _same_type(a: TensorType, b: TensorType) -> bool:
    return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
        _same_dim(x, y) for x, y in zip(a.shape, b.shape))


def _same_dim(a: Dim, b: Dim) -> bool:
    if a == b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    diff = sympy.sympify(a) - b
    # rules give the same expressions for the same inputs; simplify (slow on nested floors)
    # only settles the rare spelling difference
    return bool(sympy.expand(diff) == 0 or sympy.simplify(diff) == 0)
