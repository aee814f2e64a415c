"""The rewrite driver: rules apply to a fixed point through the worklist, patterns check op
type, dtype and predicates, `producer` refuses values with other readers or that are graph
outputs, and a rule that does not match leaves the graph as it was."""

from __future__ import annotations

import numpy as np
from irbuild import build, structure

from cuvil.compiler.ir import Graph, Node
from cuvil.compiler.passes.rewrite import Rule, apply_rules, pattern, producer


def fold_relu_into_relu(graph: Graph, outer: Node) -> Node | None:
    """Relu(Relu(x)) is Relu(x): the inner one takes over the outer one's output."""
    inner = producer(graph, outer.inputs[0], pattern("Relu"), outer)
    if inner is None:
        return None
    graph.absorb(inner, outer)
    return inner


RELU_RULES = [Rule("relu-relu", pattern("Relu"), fold_relu_into_relu)]


def test_rules_apply_to_a_fixed_point() -> None:
    g = build("""
        x: float32[batch, 4]
        a = Relu(x)
        b = Relu(a)
        c = Relu(b)
        d = Relu(c)
        return d
    """)
    apply_rules(g, RELU_RULES)
    g.verify()
    assert structure(g) == ["%0 = Relu(x)", "return %0"]


def test_a_value_with_another_reader_or_a_graph_output_is_not_folded() -> None:
    g = build("""
        x: float32[batch, 4]
        a = Relu(x)
        b = Relu(a)
        n = Neg(a)
        c = Relu(b)
        return c, b, n
    """)
    before = structure(g)
    apply_rules(g, RELU_RULES)
    assert structure(g) == before


def test_patterns_check_dtype_and_predicates() -> None:
    g = build("""
        x: float64[4]
        a = Relu(x)
        b = Relu(a)
        return b
    """)
    apply_rules(g, RELU_RULES)
    assert len(g.nodes) == 2  # float64: the default pattern wants float32
    assert pattern("Relu", dtype=None).matches(g.nodes[0])
    assert not pattern("Relu", dtype=None, where=lambda n: bool(n.attrs)).matches(g.nodes[0])
    assert not pattern("Neg", dtype=None).matches(g.nodes[0])


def test_the_first_matching_rule_wins_and_a_miss_changes_nothing() -> None:
    calls: list[str] = []

    def miss(graph: Graph, node: Node) -> Node | None:
        calls.append("miss")
        return None

    g = build("""
        x: float32[3]
        a = Relu(x)
        b = Relu(a)
        return b
    """, c=np.ones(3, np.float32))
    apply_rules(g, [Rule("miss", pattern("Relu"), miss), *RELU_RULES])
    assert structure(g) == ["%0 = Relu(x)", "return %0"]
    # each Relu tries "miss" first; the second folds into the first, which is tried again
    assert calls == ["miss", "miss", "miss"]
