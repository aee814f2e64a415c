"""The IR as text, for people: `cuvil inspect MODEL --ir [--after PASS]` and the passes' tests.

One line per value or node, in graph order::

    graph classifier
      input  %image: float32[batch, 1, 8, 8]
      const  %w: float32[8, 1, 3, 3] (288 bytes)
      const  %shape: int64[2] = [-1, 72]
      %y: float32[batch, 8, 6, 6] = Conv(winograd)+Relu(%image, %w, -) {pads=[0, 0, 0, 0]}  # conv0
      output %y

A node shows what it runs (its op type, the path its op chose and the steps fused into it:
the label the profiler prints), its inputs (`-` for an absent optional one), its attributes
(the `cuvil.*` ones the passes set among them) and its name. Given a memory plan, each value
also shows where it lives (`@workspace+4096`, `@weights+0`, `@input 0`, `@output 0`).
If/Loop/Scan bodies follow their node, indented.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuvil.compiler.ir import Graph, Node, Value, dim_str
from cuvil.compiler.memory import MemoryPlan
from cuvil.compiler.ops import lookup
from cuvil.compiler.ops.control import PLANS
from cuvil.compiler.ops.gemm import FUSED_ACTIVATION, MATMUL_BIAS_SLOT, RESIDUAL_SLOT

__all__ = ["graph_text", "node_label"]

#: constants with at most this many elements show their values
SHOWN_ELEMENTS = 8


def node_label(node: Node) -> str:
    """What the node runs: "Conv(winograd)+Add+Relu" (op type, its op's path, fused steps)."""
    product = node.op_type in ("Conv", "Gemm", "MatMul")
    steps = [("Bias", product and node.op_type == "MatMul" and node.input(MATMUL_BIAS_SLOT) is not None),
             ("Add", product and node.input(RESIDUAL_SLOT) is not None),
             (str(node.attrs.get(FUSED_ACTIVATION)), FUSED_ACTIVATION in node.attrs)]
    fused = "+".join(step for step, there in steps if there)
    op = lookup(node.domain, node.op_type, node.opset)
    path = op.path(node) if op is not None else ""
    label = f"{node.op_type}({path})" if path else node.op_type
    return f"{label}+{fused}" if fused else label


def graph_text(graph: Graph, plan: MemoryPlan | None = None) -> str:
    """The graph as text (see the module's docstring); with `plan`, where each value lives."""
    return "\n".join(_graph_lines(graph, plan, ""))


def _graph_lines(graph: Graph, plan: MemoryPlan | None, indent: str) -> list[str]:
    lines = [f"{indent}graph {graph.name}"]
    indent += "  "
    shown: set[Value] = set()
    for v in graph.inputs:
        lines.append(f"{indent}input  {_value(v, plan)}")
        shown.add(v)
    for node in graph.nodes:
        for c in node.inputs:
            if c is not None and c.const is not None and c not in shown:
                lines.append(f"{indent}const  {_value(c, plan)}{_const_text(c.const)}")
                shown.add(c)
        outs = ", ".join(_value(v, plan) for v in node.outputs)
        ins = ", ".join(f"%{v.name}" if v is not None else "-" for v in node.inputs)
        # bodies and their memory plans (set by plan_memory) are shown as graphs below
        plans = node.attrs.get(PLANS, {})
        attrs = {k: a for k, a in node.attrs.items() if not isinstance(a, Graph) and k != PLANS}
        attr_text = (" {" + ", ".join(f"{k}={_attr_text(a)}" for k, a in sorted(attrs.items()))
                     + "}") if attrs else ""
        name = f"  # {node.name}" if node.name else ""
        lines.append(f"{indent}{outs} = {node_label(node)}({ins}){attr_text}{name}")
        for key, body in sorted((k, a) for k, a in node.attrs.items() if isinstance(a, Graph)):
            lines.append(f"{indent}  {key}:")
            lines += _graph_lines(body, plans.get(key), indent + "    ")
    lines += [f"{indent}output %{v.name}" for v in graph.outputs]
    lines += [f"{indent}constraint {c.condition}: {c.message}" for c in graph.constraints]
    return lines


def _value(v: Value, plan: MemoryPlan | None) -> str:
    text = f"%{v.name}: {v.type}"
    storage = plan.storage.get(v) if plan is not None else None
    if storage is None:
        return text
    if storage.kind in ("input", "output"):
        return f"{text} @{storage.kind} {storage.index}"
    return f"{text} @{storage.kind}+{dim_str(storage.offset)}"


def _const_text(array: np.ndarray) -> str:
    if array.size <= SHOWN_ELEMENTS:
        return f" = {_elements(array)}"
    return f" ({array.nbytes} bytes)"


def _elements(array: np.ndarray) -> str:
    """A small array's elements, floats to 6 significant digits."""
    values = np.asarray(array).ravel().tolist()
    return "[" + ", ".join(f"{x:.6g}" if isinstance(x, float) else str(x) for x in values) + "]"


def _attr_text(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return (_elements(value) if value.size <= SHOWN_ELEMENTS
                else f"<{value.dtype.name}{list(value.shape)}>")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_attr_text(x) for x in value) + "]"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return repr(value)
    if hasattr(value, "free_symbols"):  # a sympy dim
        return str(dim_str(value))
    return str(value)
