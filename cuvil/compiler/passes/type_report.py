"""Every value's dtype and where precision changes (`cuvil inspect --types MODEL`).

The model is typed by cuvil's frontend (constants folded, as a build does), so the table
shows the dtypes cuvil compiles. Flagged are the model's own Casts (narrowing or widening),
the nodes cuvil computes in float32 for float16 values (passes/widen_float16.py: where such a
region reads float16 and where it rounds back), values whose dtype in the model's
value_info differs from what cuvil infers, and the node where typing stops, if it does
(the table then holds what ONNX's own shape inference says, for the values it could type).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from cuvil.compiler.frontend.importer import import_model
from cuvil.compiler.frontend.loader import load_onnx
from cuvil.compiler.ir import Graph, Node, Value, dim_str
from cuvil.compiler.passes.widen_float16 import F16, widened_nodes
from cuvil.errors import CuvilError

__all__ = ["TypeReport", "type_report"]


@dataclass(frozen=True)
class TypedValue:
    name: str
    dtype: str
    shape: str
    producer: str  # "input", "constant" or the producing node's name and op type


@dataclass(frozen=True)
class Flag:
    node: str  # the node's name and op type
    kind: str  # "cast", "float32 compute", "declared type", "inference stops"
    message: str


@dataclass
class TypeReport:
    label: str
    values: list[TypedValue] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)

    @property
    def broken(self) -> bool:
        return any(f.kind == "inference stops" for f in self.flags)

    def text(self) -> str:
        rows = [("value", "dtype", "shape", "produced by")] + [
            (v.name, v.dtype, v.shape, v.producer) for v in self.values]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{self.label}: {len(self.values)} values"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3]
                  for r in rows]
        lines.append(f"precision changes and type problems ({len(self.flags)}):" if self.flags
                     else "no precision changes: every value keeps its dtype")
        lines += [f"  {f.kind:<16} {f.node}: {f.message}" for f in self.flags]
        return "\n".join(lines)


def _label(node: Node) -> str:
    return f"{node.name or node.outputs[0].name} ({node.op_type})"


def _shape(v: Value) -> str:
    return "[" + ", ".join(str(dim_str(d)) for d in v.type.shape) + "]"


def type_report(source: str | Path, pins: Mapping[str, Sequence[int | str]] | None = None,
                label: str | None = None) -> TypeReport:
    model, default_label = load_onnx(source)
    report = TypeReport(label or default_label)
    try:
        graph = import_model(model, pins, "model")
    except CuvilError as exc:
        report.flags.append(Flag(_failing_node(model, str(exc)), "inference stops", str(exc)))
        report.values = _onnx_types(model)
        return report
    report.values = _values(graph)
    order = {_label(n): i for i, n in enumerate(graph.nodes)}
    flags = _casts(graph) + _float32_compute(graph) + _declared(model, graph)
    report.flags = sorted(flags, key=lambda f: order.get(f.node, len(order)))
    return report


def _values(graph: Graph) -> list[TypedValue]:
    rows: list[TypedValue] = []
    seen: set[int] = set()

    def add(v: Value, producer: str) -> None:
        if id(v) not in seen:
            seen.add(id(v))
            rows.append(TypedValue(v.name, v.type.dtype.name, _shape(v), producer))

    for v in graph.inputs:
        add(v, "input")
    for node in graph.nodes:
        for x in node.inputs:
            if x is not None and x.const is not None:
                add(x, "constant")
        for y in node.outputs:
            add(y, _label(node))
    return rows


def _casts(graph: Graph) -> list[Flag]:
    flags = []
    for node in graph.nodes:
        if node.op_type not in ("Cast", "CastLike") or node.domain:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x is None or x.type.dtype == y.type.dtype:
            continue
        a, b = x.type.dtype, y.type.dtype
        how = "narrows" if a.kind == b.kind == "f" and b.itemsize < a.itemsize else \
            "widens" if a.kind == b.kind == "f" else "converts"
        flags.append(Flag(_label(node), "cast", f"{how} {x.name!r} {a.name} -> {b.name}"))
    return flags


def _float32_compute(graph: Graph) -> list[Flag]:
    wide = widened_nodes(graph)
    inside = {id(n) for n in wide}
    flags = []
    for node in wide:
        reads = [x.name for x in node.inputs if x is not None and x.type.dtype == F16
                 and x.const is None and (x.producer is None or id(x.producer) not in inside)]
        rounds = [y.name for y in node.outputs if y.type.dtype == F16 and (
            y in graph.outputs or any(id(u) not in inside for u in y.users))]
        parts = ["computes float16 in float32"]
        if reads:
            parts.append(f"widens {', '.join(map(repr, reads))} on the way in")
        if rounds:
            parts.append(f"rounds {', '.join(map(repr, rounds))} to float16 on the way out")
        flags.append(Flag(_label(node), "float32 compute", "; ".join(parts)))
    return flags


def _declared(model: onnx.ModelProto, graph: Graph) -> list[Flag]:
    """value_info entries that name another dtype than cuvil infers (a converter's leftover)."""
    typed = {y.name: (y, n) for n in graph.nodes for y in n.outputs}
    flags = []
    for vi in model.graph.value_info:
        elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
        if not elem or vi.name not in typed:
            continue
        v, node = typed[vi.name]
        declared = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        if declared != v.type.dtype:
            flags.append(Flag(_label(node), "declared type",
                              f"value_info declares {vi.name!r} {declared.name}, the node computes "
                              f"{v.type.dtype.name}"))
    return flags


def _failing_node(model: onnx.ModelProto, message: str) -> str:
    """The node an import error names (errors say "node 'NAME' (OP)"), else the model."""
    for node in model.graph.node:
        label = node.name or (node.output[0] if node.output else "")
        if label and f"node {label!r}" in message:
            return f"{label} ({node.op_type})"
    return "(model)"


def _onnx_types(model: onnx.ModelProto) -> list[TypedValue]:
    """What ONNX's shape inference types, for a model cuvil cannot type to the end."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    g = inferred.graph
    producers = {y: f"{n.name or n.output[0]} ({n.op_type})" for n in g.node for y in n.output}
    initializers = {t.name for t in g.initializer}
    rows = []
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.name in initializers or not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        dtype = (np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
                 if tt.elem_type else "?")
        dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
                for d in tt.shape.dim] if tt.HasField("shape") else ["?"]
        rows.append(TypedValue(vi.name, dtype, "[" + ", ".join(dims) + "]",
                               producers.get(vi.name, "input")))
    return rows
