"""cuvil's IR: the graph's editing methods keep users/producer exact, `Graph.verify` catches
each kind of corruption (every test below breaks one invariant by hand and expects the
error), and no code outside ir.py edits the wiring by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import sympy
from irbuild import build, structure

from cuvil.compiler.ir import Graph, IRError, Node, TensorType, Value, symbol

C4 = np.arange(4, dtype=np.float32)


def chain() -> Graph:
    return build("""
        x: float32[batch, 4]
        y = Relu(x)
        z = Add(y, c)
        w = Mul(z, z)
        return w
    """, c=C4)


def node(g: Graph, out: str) -> Node:
    return next(n for n in g.nodes if n.outputs[0].name == out)


def value(g: Graph, name: str) -> Value:
    return next(v for n in g.nodes for v in [*n.inputs, *n.outputs] if v is not None and v.name == name)


def test_built_graph_verifies_and_counts_one_user_per_slot() -> None:
    g = chain()
    g.verify()
    z = value(g, "z")
    assert z.users == [node(g, "w"), node(g, "w")]  # Mul(z, z): two slots
    assert z.producer is node(g, "z")


def test_set_input_moves_the_registration() -> None:
    g = chain()
    add, x, y = node(g, "z"), g.inputs[0], value(g, "y")
    g.set_input(add, 0, x)
    g.verify()
    assert y.users == [] and x.users.count(add) == 1
    assert structure(g)[1] == "%1 = Add(x, const[4])"
    g.set_input(add, 3, None)  # slots past the end are created empty
    assert add.inputs[2:] == [None, None]


def test_replace_uses_rewires_nodes_and_graph_outputs() -> None:
    g = chain()
    w = value(g, "w")
    neg = g.add_node(Node("Neg", [w], [g.value("n", w.type)], opset=17))
    g.outputs = [w]
    g.replace_uses(w, g.inputs[0])
    assert neg.inputs == [g.inputs[0]] and g.outputs == [g.inputs[0]]
    g.remove_nodes([neg, *g.nodes[::-1][1:]])
    g.verify()
    assert g.nodes == [] and g.inputs[0].users == []


def test_insert_before_and_after() -> None:
    g = chain()
    x, y = g.inputs[0], value(g, "y")
    first = g.insert_before(node(g, "y"), Node("Neg", [x], [g.value("n", x.type)], opset=17))
    last = g.insert_after(node(g, "w"), Node("Abs", [value(g, "w")], [g.value("a", x.type)],
                                              opset=17))
    g.outputs = [last.outputs[0]]
    g.verify()
    assert g.nodes[0] is first and g.nodes[-1] is last and y.producer is g.nodes[1]


def test_replace_node_keeps_outputs() -> None:
    g = chain()
    relu, y = node(g, "y"), value(g, "y")
    sig = Node("Sigmoid", [g.inputs[0]], [], opset=17)
    g.replace_node(relu, sig)
    g.verify()
    assert g.nodes[0] is sig and sig.outputs == [y] and y.producer is sig
    assert g.inputs[0].users == [sig] and relu.outputs == []


def test_absorb_takes_over_the_consumers_output() -> None:
    g = chain()
    relu, add = node(g, "y"), node(g, "z")
    y, z = value(g, "y"), value(g, "z")
    g.absorb(relu, add)
    assert relu.outputs == [z] and z.producer is relu and y.producer is None
    assert [n.op_type for n in g.nodes] == ["Relu", "Mul"]
    # (the types are no longer those of a Relu: a real fusion records the Add in attrs)


def test_absorb_refuses_when_the_value_has_other_readers() -> None:
    g = build("""
        x: float32[4]
        y = Relu(x)
        z = Neg(y)
        w = Abs(y)
        return z, w
    """)
    with pytest.raises(IRError, match="other readers"):
        g.absorb(g.nodes[0], g.nodes[1])


def test_remove_node_refuses_to_orphan_readers_and_outputs() -> None:
    g = chain()
    with pytest.raises(IRError, match="reads 'y'"):
        g.remove_node(node(g, "y"))
    with pytest.raises(IRError, match="graph output"):
        g.remove_node(node(g, "w"))
    with pytest.raises(IRError, match="not a node of this graph"):
        g.remove_node(Node("Relu", [], []))
    g.verify()  # nothing changed


def test_remove_nodes_with_a_body_forgets_the_bodys_users() -> None:
    g = chain()
    x = g.inputs[0]
    body = Graph("body")
    inner = Node("Neg", [x], [body.value("t", x.type)], opset=17)
    body.add_node(inner)  # reads the enclosing x
    body.outputs = [inner.outputs[0]]
    holder = g.add_node(Node("Identity", [x], [g.value("h", x.type)], {"body": body}, opset=17))
    assert x.users.count(inner) == 1
    g.remove_node(holder)
    assert inner not in x.users and holder not in x.users
    g.verify()


def test_replace_node_forgets_bodies_the_new_node_does_not_take() -> None:
    g = chain()
    x = g.inputs[0]
    body = Graph("body")
    inner = body.add_node(Node("Neg", [x], [body.value("t", x.type)], opset=17))
    body.outputs = [inner.outputs[0]]
    holder = g.insert_before(node(g, "y"), Node("Identity", [x], [g.value("h", x.type)],
                                                {"body": body}, opset=17))
    g.replace_node(holder, Node("Abs", [x], [], opset=17))
    assert inner not in x.users
    g.verify()


# -- verify: one corruption each --------------------------------------------------------


def corrupt_stale_user(g: Graph) -> None:
    g.inputs[0].users.append(node(g, "w"))


def corrupt_missing_user(g: Graph) -> None:
    value(g, "y").users.clear()


def corrupt_user_in_no_graph(g: Graph) -> None:
    value(g, "y").users.append(Node("Relu", [value(g, "y")], []))


def corrupt_wrong_producer(g: Graph) -> None:
    value(g, "z").producer = node(g, "y")


def corrupt_outside_producer(g: Graph) -> None:
    g.inputs[0].producer = Node("Relu", [], [g.inputs[0]])


def corrupt_produced_twice(g: Graph) -> None:
    node(g, "w").outputs.append(value(g, "y"))


def corrupt_order(g: Graph) -> None:
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]


def corrupt_unknown_input(g: Graph) -> None:
    stray = Value("stray", TensorType(np.float32, (symbol("batch"), 4)))
    add = node(g, "z")
    add.inputs[0] = stray
    stray.users.append(add)
    value(g, "y").users.clear()


def corrupt_output_not_produced(g: Graph) -> None:
    g.outputs = [Value("nowhere", TensorType(np.float32, (4,)))]


def corrupt_duplicate_name(g: Graph) -> None:
    value(g, "z").name = "y"


def corrupt_dtype(g: Graph) -> None:
    value(g, "z").type = TensorType(np.float64, value(g, "z").type.shape)


def corrupt_shape(g: Graph) -> None:
    value(g, "w").type = TensorType(np.float32, (symbol("batch") * 2, 4))


def corrupt_rank(g: Graph) -> None:
    value(g, "y").type = TensorType(np.float32, (4,))


def corrupt_constant_type(g: Graph) -> None:
    c = node(g, "z").inputs[1]
    c.type = TensorType(np.float32, (5,))  # type: ignore[union-attr]


def corrupt_shape_rule_rejects(g: Graph) -> None:
    add = node(g, "z")
    c = g.constant(np.ones(3, np.float32))
    g.set_input(add, 1, c)  # [batch, 4] + [3] does not broadcast


@pytest.mark.parametrize(("corrupt", "message"), [
    (corrupt_stale_user, "lists node 'w' .* as a user 1 time"),
    (corrupt_missing_user, "lists node 'z' .* as a user 0 time"),
    (corrupt_user_in_no_graph, "in no graph"),
    (corrupt_wrong_producer, "whose producer is node 'y'"),
    (corrupt_outside_producer, "a node outside the graph"),
    (corrupt_produced_twice, "produced twice"),
    (corrupt_order, "produced later by"),
    (corrupt_unknown_input, "'stray' .* neither an input"),
    (corrupt_output_not_produced, "graph output 'nowhere'"),
    (corrupt_duplicate_name, "two values are named 'y'"),
    (corrupt_dtype, "is float64.* gives float32"),
    (corrupt_shape, r"is float32\[2\*batch, 4\]"),
    (corrupt_rank, r"'y' is float32\[4\]"),
    (corrupt_constant_type, "holds a float32"),
    (corrupt_shape_rule_rejects, "shape rule rejects"),
], ids=lambda x: x.__name__[len("corrupt_"):] if callable(x) else "")
def test_verify_catches(corrupt, message) -> None:
    g = chain()
    g.verify()
    corrupt(g)
    with pytest.raises(IRError, match=message):
        g.verify()


def test_verify_checks_bodies_and_their_view_of_enclosing_values() -> None:
    g = chain()
    x, w = g.inputs[0], value(g, "w")
    body = Graph("body")
    inner = Node("Neg", [w], [body.value("t", w.type)], opset=17)
    body.add_node(inner)
    body.outputs = [inner.outputs[0]]
    # the holder comes before w's producer: the body reads w too early
    g.insert_before(node(g, "w"), Node("Identity", [x], [g.value("h", x.type)], {"body": body},
                                       opset=17))
    with pytest.raises(IRError, match=r"body: node 't' .* reads 'w' .* produced later"):
        g.verify()


def test_equal_symbolic_dims_spelled_differently_agree() -> None:
    g = build("""
        x: float32[h, 4]
        y = Relu(x)
        return y
    """)
    h = symbol("h")
    y = g.nodes[0].outputs[0]
    y.type = TensorType(np.float32, (sympy.floor((2 * h + 2) / 2) - 1, 4))  # == h
    g.verify()


MUTATORS = {"append", "remove", "clear", "extend", "insert", "pop", "sort", "reverse"}


def test_no_code_outside_ir_edits_users_or_producer() -> None:
    """Passes and the frontend edit the wiring through Graph's methods only."""
    root = Path(__file__).parents[2] / "cuvil"
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "ir.py" and path.parent.name == "compiler":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else \
                [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in ("users", "producer"):
                    offenders.append(f"{path.relative_to(root)}:{n.lineno}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in MUTATORS and isinstance(n.func.value, ast.Attribute) \
                    and n.func.value.attr == "users":
                offenders.append(f"{path.relative_to(root)}:{n.lineno}")
    assert offenders == []
