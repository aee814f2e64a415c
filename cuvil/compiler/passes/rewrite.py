"""A pattern-rule rewrite driver: a pass is a list of `Rule`s applied to a fixed point.

A rule is anchored on the last node of its pattern (the one whose output the rewrite takes
over, e.g. the Relu after a Conv); `Pattern` says which op types it matches and the simple
constraints that go with them (dtype, attribute predicates), and the helpers below find the
other nodes of the pattern from the anchor (`producer`, `const_operand`) with the usual
constraints (single use, not a graph output). The rewrite edits the graph only through
`Graph`'s methods and returns the node that now computes the anchor's result, or None when
the pattern does not match after all (the graph then must be unchanged).

`apply_rules` runs a worklist: every node in order, then the readers of whatever a rewrite
changed (a Relu can fuse once the Add before it has been fused into a Conv), until no rule
applies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value

__all__ = ["Pattern", "Rule", "apply_rules", "const_operand", "pattern", "producer", "scalar_operand",
           "sole_reader"]


@dataclass(frozen=True)
class Pattern:
    """Nodes of one of `op_types` (default domain), whose first output has `dtype` (None:
    any) and for which `where` holds."""

    op_types: frozenset[str]
    dtype: str | None = "float32"
    where: Callable[[Node], bool] | None = None

    def matches(self, node: Node) -> bool:
        return (node.op_type in self.op_types and not node.domain and bool(node.outputs)
                and (self.dtype is None or node.outputs[0].type.dtype.name == self.dtype)
                and (self.where is None or self.where(node)))


def pattern(*op_types: str, dtype: str | None = "float32",
            where: Callable[[Node], bool] | None = None) -> Pattern:
    return Pattern(frozenset(op_types), dtype, where)


@dataclass(frozen=True)
class Rule:
    name: str
    anchor: Pattern
    #: rewrite(graph, anchor) -> the node now computing the anchor's output, or None
    rewrite: Callable[[Graph, Node], Node | None]


def sole_reader(graph: Graph, v: Value, reader: Node) -> bool:
    """`reader` is the only reader of `v` (in however many input slots), and `v` is not a
    graph output: a rewrite may then fold `reader` into v's producer."""
    return bool(v.users) and all(u is reader for u in v.users) and v not in graph.outputs


def producer(graph: Graph, v: Value | None, want: Pattern, reader: Node) -> Node | None:
    """The producer of `v` when it matches `want` and `reader` is v's only reader."""
    if v is None or v.producer is None or not want.matches(v.producer):
        return None
    return v.producer if sole_reader(graph, v, reader) else None


def const_operand(v: Value | None) -> np.ndarray | None:
    """v's value when it is a constant."""
    return v.const if v is not None and v.const is not None else None


def scalar_operand(v: Value | None) -> float | None:
    """v's value when it is a constant of one element."""
    c = const_operand(v)
    return float(c.reshape(())) if c is not None and c.size == 1 else None


def apply_rules(graph: Graph, rules: Sequence[Rule]) -> Graph:
    """Apply `rules` to the graph's nodes (not bodies) until none applies; the first rule
    that matches a node wins."""
    alive = {id(n) for n in graph.nodes}
    work = deque(graph.nodes)
    while work:
        node = work.popleft()
        if id(node) not in alive:
            continue
        for rule in rules:
            if not rule.anchor.matches(node):
                continue
            result = rule.rewrite(graph, node)
            if result is None:
                continue
            alive = {id(n) for n in graph.nodes}
            # the rewritten node may match again (another epilogue step), and so may its readers
            work.appendleft(result)
            work.extend(u for v in result.outputs for u in v.users)
            break
    return graph
