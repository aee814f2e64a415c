"""eliminate_dead_code alone: the graph after the pass against the graph expected, and the
wiring of what it removed (no value keeps a removed node, or a removed body's node, as a
user)."""

from __future__ import annotations

import numpy as np
from irbuild import build, structure
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code

C = np.arange(4, dtype=np.float32)


def test_dead_chains_go_live_nodes_stay_in_order() -> None:
    g = build("""
        x: float32[batch, 4]
        a = Relu(x)
        dead1 = Neg(a)
        dead2 = Add(dead1, c)
        b = Add(a, c)
        dead3 = Abs(x)
        return b
    """, c=C)
    expected = build("""
        x: float32[batch, 4]
        a = Relu(x)
        b = Add(a, c)
        return b
    """, c=C)
    eliminate_dead_code(g)
    g.verify()
    assert structure(g) == structure(expected)
    assert g.inputs[0].users == [g.nodes[0]]
    c = g.nodes[1].inputs[1]
    assert c is not None and c.users == [g.nodes[1]]  # the dead Add no longer reads c


def test_a_node_with_one_live_output_stays_whole() -> None:
    g = build("""
        x: float32[4, 6]
        a, b = Split(x, axis=1, num_outputs=2)
        n = Neg(b)
        return a
    """, opset=18)
    eliminate_dead_code(g)
    g.verify()
    assert structure(g) == ["%0.0, %0.1 = Split(x) {'axis': 1, 'num_outputs': 2}", "return %0.0"]


def test_everything_dead_when_outputs_are_inputs() -> None:
    g = build("""
        x: float32[4]
        a = Relu(x)
        return x
    """)
    eliminate_dead_code(g)
    g.verify()
    assert g.nodes == [] and g.inputs[0].users == []


def test_a_dead_if_takes_its_branches_with_it() -> None:
    """A run-time If whose result nothing reads: its branches' nodes read the enclosing x
    and must not stay listed as x's users (which later passes count)."""
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", 1, [2, 3])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", 1, [2, 3])])
    model = make_model([helper.make_node("If", ["c"], ["unused"], then_branch=then,
                                         else_branch=other),
                        helper.make_node("Relu", ["x"], ["y"])],
                       {"c": (np.bool_, []), "x": (np.float32, [2, 3])}, {"y": np.float32})
    g = import_model(model)
    x = next(v for v in g.inputs if v.name == "x")
    assert len(x.users) == 4  # the If (a free value), Neg, Abs, Relu
    eliminate_dead_code(g)
    g.verify()
    assert [n.op_type for n in g.nodes] == ["Relu"] and x.users == g.nodes
    feeds = {"c": np.array(True), "x": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)}
    assert_matches_ort(model, feeds)
