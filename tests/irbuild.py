"""Small cuvil graphs written as text, and their structure as text, for pass tests.

    g = build('''
        x: float32[batch, 4]
        y = Relu(x)
        z = Add(y, c)
        return z
    ''', c=np.ones(4, np.float32))

One statement a line: ``name: dtype[dims]`` declares an input (dims are ints or symbol
names), ``a, b = Op(in, ..., attr=literal)`` adds a node typed by the op registry's shape
rule (``_`` leaves an optional input empty), ``return ...`` names the outputs. Names that
no line defines are constants taken from the keyword arguments.

`structure(g)` renders the wiring with positional labels (inputs by name, node outputs as
``%k``, constants as ``const[shape]``), so a rewritten graph compares equal to the graph
the test expects regardless of the names the pass gave new values.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np

from cuvil.compiler.ir import Graph, Node, TensorType, Value, symbol
from cuvil.compiler.ops import InferContext, lookup

OPSET = 17


def build(text: str, name: str = "g", opset: int = OPSET, **consts: Any) -> Graph:
    graph = Graph(name)
    scope: dict[str, Value] = {}

    def ref(expr: ast.expr) -> Value | None:
        assert isinstance(expr, ast.Name), ast.dump(expr)
        if expr.id == "_":
            return None
        if expr.id not in scope:
            scope[expr.id] = graph.constant(np.asarray(consts[expr.id]), expr.id)
        return scope[expr.id]

    for line in (ln.split("#")[0].strip() for ln in text.strip().splitlines()):
        if not line:
            continue
        if line.startswith("return"):
            tree = ast.parse(line[len("return"):].strip(), mode="eval").body
            outs = tree.elts if isinstance(tree, ast.Tuple) else [tree]
            graph.outputs = [ref(e) for e in outs]  # type: ignore[misc]
            continue
        stmt = ast.parse(line).body[0]
        if isinstance(stmt, ast.AnnAssign):  # x: float32[batch, 4]
            ann = stmt.annotation
            assert isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
            dims = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            shape = tuple(d.value if isinstance(d, ast.Constant) else symbol(d.id)  # type: ignore[attr-defined]
                          for d in dims)
            v = graph.value(stmt.target.id, TensorType(np.dtype(ann.value.id), shape))  # type: ignore[union-attr]
            graph.inputs.append(v)
            scope[v.name] = v
            continue
        assert isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call), line
        target = stmt.targets[0]
        names = [t.id for t in target.elts] if isinstance(target, ast.Tuple) else [target.id]  # type: ignore[attr-defined]
        call = stmt.value
        op_type = call.func.id  # type: ignore[attr-defined]
        domain = "cuvil" if op_type == "SymbolicValue" else ""
        attrs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        node = Node(op_type, [ref(a) for a in call.args], [Value(n, TensorType(np.float32, ()))
                                                           for n in names],
                    attrs, name=names[0], domain=domain, opset=opset)
        op = lookup(domain, op_type, opset)
        assert op is not None, f"no op {op_type}"
        for v, t in zip(node.outputs, op.infer(node, InferContext(graph))):
            v.name = graph.unique_name(v.name)
            v.type = t
            scope[v.name] = v
        graph.add_node(node)
    return graph


def structure(graph: Graph) -> list[str]:
    """One line per node, ``%k = Op(inputs) {attrs}``, then ``return ...``."""
    label: dict[Value, str] = {v: v.name for v in graph.inputs}

    def name(v: Value | None) -> str:
        if v is None:
            return "_"
        if v in label:
            return label[v]
        if v.is_const:
            return f"const{list(v.type.shape)}"
        return f"?{v.name}"  # read before it is produced: verify would reject this graph

    lines = []
    for k, n in enumerate(graph.nodes):
        ins = ", ".join(name(v) for v in n.inputs)
        attrs = {a: x for a, x in sorted(n.attrs.items()) if not isinstance(x, (Graph, np.ndarray))}
        for j, v in enumerate(n.outputs):
            label[v] = f"%{k}" if len(n.outputs) == 1 else f"%{k}.{j}"
        outs = ", ".join(label[v] for v in n.outputs)
        lines.append(f"{outs} = {n.op_type}({ins})" + (f" {attrs}" if attrs else ""))
    lines.append("return " + ", ".join(name(v) for v in graph.outputs))
    return lines
