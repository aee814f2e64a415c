"""ONNX graph -> cuvil IR: type every value with the op registry's shape rules, folding
constants on the way so that shape inputs (Reshape's shape, Clip's bounds...) are known at
compile time, and report every unsupported op at once."""

from __future__ import annotations

import keyword
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from cuvil.compiler.frontend.loader import check_and_upgrade, load_onnx
from cuvil.compiler.frontend.shape_values import propagate
from cuvil.compiler.ir import Dim, Graph, Node, TensorType, Value, symbol
from cuvil.compiler.ops import InferContext, lookup
from cuvil.compiler.passes.fold_constants import fold_node
from cuvil.errors import CuvilError, ModelError, UnsupportedOpError

__all__ = ["import_model"]

#: the type of an output while its node's shape rule runs
_UNTYPED = TensorType(np.float32, ())


def _identifier(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    if not s or s[0].isdigit() or keyword.iskeyword(s):
        s = "d_" + s
    return s


def _input_type(vi: onnx.ValueInfoProto, pins: Sequence[int | str] | None, label: str) -> TensorType:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise UnsupportedOpError(f"{label}: input {vi.name!r} is not a tensor; cuvil compiles "
                                 "tensor inputs only")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
    dims: list[Dim] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(symbol(_identifier(d.dim_param or f"{vi.name}_{i}")))
    if pins is not None:
        if tt.HasField("shape") and len(pins) != len(dims):
            raise ModelError(f"{label}: inputs.{vi.name} pins {len(pins)} dims but the model's "
                             f"input has rank {len(dims)}")
        pinned: list[Dim] = []
        for i, p in enumerate(pins):
            model_dim = dims[i] if i < len(dims) else None
            if isinstance(p, int):
                if isinstance(model_dim, int) and model_dim != p:
                    raise ModelError(f"{label}: inputs.{vi.name} pins dim {i} to {p} but the model "
                                     f"fixes it to {model_dim}")
                pinned.append(p)
            elif isinstance(model_dim, int):
                raise ModelError(f"{label}: inputs.{vi.name} names dim {i} {p!r} but the model "
                                 f"fixes it to {model_dim}; use {model_dim}")
            else:
                pinned.append(symbol(_identifier(p)))
        dims = pinned
    elif not tt.HasField("shape"):
        raise ModelError(f"{label}: input {vi.name!r} has no shape; give one with "
                         f"inputs = {{ {vi.name} = [...] }}")
    return TensorType(dtype, tuple(dims))


def import_model(source: str | Path | onnx.ModelProto,
                 pins: Mapping[str, Sequence[int | str]] | None = None, name: str = "model") -> Graph:
    """Read, check and type an ONNX model; raise one error listing every unsupported op."""
    model, label = load_onnx(source)
    model = check_and_upgrade(model, label)
    opsets = {("" if i.domain == "ai.onnx" else i.domain): int(i.version) for i in model.opset_import}
    g = model.graph
    graph = Graph(name)
    pins = dict(pins or {})
    values: dict[str, Value] = {}

    for init in g.initializer:
        try:
            arr = numpy_helper.to_array(init)
        except Exception as exc:
            raise ModelError(f"{label}: initializer {init.name!r} cannot be read: {exc}") from None
        values[init.name] = graph.constant(arr, init.name)
        values[init.name].name = init.name
    initializer_names = set(values)
    for vi in g.input:
        if vi.name in initializer_names:
            continue  # old exporters list weights as inputs too
        v = graph.value(vi.name, _input_type(vi, pins.pop(vi.name, None), label))
        values[vi.name] = v
        graph.inputs.append(v)
    if pins:
        raise ModelError(f"{label}: inputs {sorted(pins)} are pinned in the config but the model "
                         f"has no such inputs; its inputs are {[v.name for v in graph.inputs]}")

    ctx = InferContext(graph)
    unsupported: dict[tuple[str, str, int], list[str]] = {}
    unknown: set[str] = set()  # outputs of unsupported nodes: their users cannot be typed
    for index, pn in enumerate(g.node):
        node_label = pn.name or (pn.output[0] if pn.output else f"#{index}")
        if any(i in unknown for i in pn.input if i):
            unknown.update(pn.output)
            if lookup(pn.domain, pn.op_type, opsets.get(pn.domain or "", 0)) is None:
                unsupported.setdefault((pn.domain or "ai.onnx", pn.op_type,
                                        opsets.get(pn.domain, 0)), []).append(node_label)
            continue
        try:
            node = _make_node(pn, values, opsets, label, node_label)
        except CuvilError:
            raise
        if pn.op_type == "Constant" and pn.domain in ("", "ai.onnx"):
            values[pn.output[0]] = graph.constant(_constant_value(pn, label), pn.output[0])
            continue
        folded = None
        if node.inputs and all(v is None or v.is_const for v in node.inputs):
            folded = fold_node(pn, [v.const if v is not None else None for v in node.inputs],
                               opsets, model.ir_version)
        if folded is not None:
            for name, arr in zip(pn.output, folded):
                if name:
                    values[name] = graph.constant(arr, name)
            continue
        known = propagate(node, len(pn.output))
        if known is not None:
            _add_known_values(graph, node, pn, known, values)
            continue
        op = lookup(node.domain, node.op_type, node.opset)
        if op is None:
            unsupported.setdefault((pn.domain or "ai.onnx", pn.op_type, node.opset),
                                   []).append(node_label)
            unknown.update(pn.output)
            continue
        # the outputs exist (untyped) while the rule runs, so it can see how many there are
        node.outputs = [graph.value(out_name or f"{node_label}_unused", _UNTYPED)
                        for out_name in pn.output]
        try:
            types = op.infer(node, ctx)
        except CuvilError:
            raise
        except Exception as exc:
            raise ModelError(f"{label}: {node.describe()}: cannot infer output shapes: "
                             f"{type(exc).__name__}: {exc}") from None
        node.outputs = node.outputs[:len(types)]
        for out_name, v, t in zip(pn.output, node.outputs, types):
            v.type = t
            if out_name:
                values[out_name] = v
        graph.add_node(node)

    if unsupported:
        lines = [f"  {domain} {op} (opset {ver}): used by {', '.join(repr(n) for n in names[:8])}"
                 + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                 for (domain, op, ver), names in sorted(unsupported.items())]
        raise UnsupportedOpError(
            f"{label}: cuvil cannot compile {len(unsupported)} operator(s) used by this model:\n"
            + "\n".join(lines)
            + "\nSee docs/ops.md for the supported operators; an older or newer export opset "
            "may avoid them."
        )

    for vi in g.output:
        if vi.name not in values:
            raise ModelError(f"{label}: graph output {vi.name!r} is not produced by any node")
        graph.outputs.append(values[vi.name])
    _check_symbols_known(graph, label)
    return graph


def _add_known_values(graph: Graph, node: Node, pn: onnx.NodeProto,
                      known: list[tuple[TensorType, tuple[Dim, ...]]],
                      values: dict[str, Value]) -> None:
    """Outputs of shape arithmetic known at compile time: constants when every element is a
    number, else values carrying their dims (`Value.sym_value`), each produced by a
    `cuvil.SymbolicValue` node that computes the elements from the dims when the tensor is
    read at run time (dead-code elimination drops it when only shape rules read it)."""
    for out_name, (t, elements) in zip(pn.output, known):
        if not out_name:
            continue
        if all(sympy.sympify(x).is_number for x in elements):
            arr = np.array([float(x) if t.dtype.kind == "f" else int(x) for x in elements],
                           dtype=t.dtype).reshape(tuple(int(d) for d in t.shape))
            values[out_name] = graph.constant(arr, out_name)
            continue
        v = graph.value(out_name, t)
        v.sym_value = elements
        graph.add_node(Node("SymbolicValue", [], [v], {"source_op": node.op_type},
                            name=node.name or out_name, domain="cuvil", opset=1))
        values[out_name] = v


def _make_node(pn: onnx.NodeProto, values: dict[str, Value], opsets: dict[str, int], label: str,
               node_label: str) -> Node:
    inputs: list[Value | None] = []
    for name in pn.input:
        if not name:
            inputs.append(None)
        elif name not in values:
            raise ModelError(f"{label}: node {node_label!r} ({pn.op_type}) reads {name!r}, which "
                             "no earlier node produces (is the graph sorted?)")
        else:
            inputs.append(values[name])
    attrs = {a.name: _attr_value(a) for a in pn.attribute}
    domain = "" if pn.domain == "ai.onnx" else pn.domain
    return Node(pn.op_type, inputs, [], attrs, name=pn.name, domain=domain,
                opset=opsets.get(domain, 0))


def _attr_value(a: onnx.AttributeProto) -> Any:
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    return v


def _constant_value(pn: onnx.NodeProto, label: str) -> np.ndarray:
    for a in pn.attribute:
        v = _attr_value(a)
        if a.name == "value":
            return np.asarray(v)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(v, dtype=np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(v, dtype=np.int64)
    raise UnsupportedOpError(f"{label}: Constant node {pn.name or pn.output[0]!r} uses an "
                             "unsupported attribute (sparse or string values)")


def _check_symbols_known(graph: Graph, label: str) -> None:
    known = {s.name for s in graph.symbols}
    for v in graph.outputs:
        for d in v.type.shape:
            if isinstance(d, sympy.Expr):
                extra = {s.name for s in d.free_symbols} - known
                if extra:
                    raise ModelError(f"{label}: output {v.name!r} has dims {sorted(extra)} that do "
                                     "not follow from the input dims")
