"""ONNX graph -> cuvil IR: type every value with the op registry's shape rules, folding
constants on the way so that shape inputs (Reshape's shape, Clip's bounds...) are known at
compile time, and report every unsupported op at once."""

from __future__ import annotations

import keyword
import re
from collections import ChainMap
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from cuvil.compiler.frontend.fold_constants import fold_node
from cuvil.compiler.frontend.functions import expandable, function_body
from cuvil.compiler.frontend.loader import check_and_upgrade, load_onnx
from cuvil.compiler.frontend.shape_values import propagate
from cuvil.compiler.ir import (
    MAX_TENSOR_BYTES,
    Dim,
    Graph,
    Node,
    TensorType,
    Value,
    subgraphs,
    symbol,
)
from cuvil.compiler.ops import InferContext, attribute_value, lookup
from cuvil.compiler.ops.control import SubgraphOp, known_flag
from cuvil.compiler.ops.registered import load_entry_points
from cuvil.errors import CuvilError, ModelError, UnsupportedOpError

__all__ = ["import_model"]

#: the type of an output while its node's shape rule runs
_UNTYPED = TensorType(np.dtype(np.float32), ())


def _identifier(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    if not s or s[0].isdigit() or keyword.iskeyword(s):
        s = "d_" + s
    return s


def _is_unknown(d: onnx.TensorShapeProto.Dimension) -> bool:
    """Exporters' ways of writing "any size": no value, an empty name, "?" (PaddlePaddle,
    for several different dims), "-1", or a negative dim_value (PaddlePaddle). Each such dim
    gets a symbol of its own. A dim_value of 0 stays an empty dim, as ONNX defines it (empty
    axes lists are inputs of shape [0]); a config pin may still override it (`_input_type`)."""
    if d.HasField("dim_value"):
        return d.dim_value < 0
    return d.dim_param.strip() in ("", "?", "-1")


def element_dtype(elem_type: int, what: str) -> np.dtype:
    """The numpy dtype of an ONNX element type; a ModelError naming `what` for types that have
    none (UNDEFINED = 0, an unknown number)."""
    name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() \
        else None
    if elem_type == onnx.TensorProto.UNDEFINED or name is None:
        raise ModelError(f"{what} has element type {elem_type} ({name or 'not an ONNX type'}); "
                         "the exporter left the type out: re-export the model, or set the type "
                         "with onnx.helper.make_tensor_value_info")
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{what} has element type {name}, which has no numpy dtype; cuvil "
                         "compiles numeric and bool tensors") from None


def _input_type(vi: onnx.ValueInfoProto, pins: Sequence[int | str] | None, label: str) -> TensorType:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        raise UnsupportedOpError(f"{label}: input {vi.name!r} is not a tensor; cuvil compiles "
                                 "tensor inputs only")
    dtype = element_dtype(tt.elem_type, f"{label}: input {vi.name!r}")
    dims: list[Dim] = []
    for i, d in enumerate(tt.shape.dim):
        if _is_unknown(d):
            dims.append(symbol(_identifier(f"{vi.name}_{i}")))
        elif d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(symbol(_identifier(d.dim_param)))
    if pins is not None:
        if tt.HasField("shape") and len(pins) != len(dims):
            raise ModelError(f"{label}: inputs.{vi.name} pins {len(pins)} dims but the model's "
                             f"input has rank {len(dims)}")
        pinned: list[Dim] = []
        for i, p in enumerate(pins):
            model_dim = dims[i] if i < len(dims) else None
            if isinstance(p, int):
                # 0 is also how some exporters write "unknown": a pin says which it is
                if isinstance(model_dim, int) and model_dim not in (p, 0):
                    raise ModelError(f"{label}: inputs.{vi.name} pins dim {i} to {p} but the model "
                                     f"fixes it to {model_dim}")
                pinned.append(p)
            elif isinstance(model_dim, int) and model_dim != 0:
                raise ModelError(f"{label}: inputs.{vi.name} names dim {i} {p!r} but the model "
                                 f"fixes it to {model_dim}; use {model_dim}")
            else:
                pinned.append(symbol(_identifier(p)))
        dims = pinned
    elif not tt.HasField("shape"):
        raise ModelError(f"{label}: input {vi.name!r} has no shape; give one with "
                         f"inputs = {{ {vi.name} = [...] }}")
    return TensorType(dtype, tuple(dims))


def _metadata(model: onnx.ModelProto) -> dict[str, Any]:
    """The model's metadata, named as onnxruntime's ModelMetadata names it."""
    meta: dict[str, Any] = {
        "producer_name": model.producer_name, "graph_name": model.graph.name,
        "domain": model.domain, "description": model.doc_string,
        "graph_description": model.graph.doc_string,
        "custom_metadata_map": {p.key: p.value for p in model.metadata_props}}
    if model.HasField("model_version"):
        meta["version"] = model.model_version
    return meta


def _declared_shape(vi: onnx.ValueInfoProto) -> tuple[int | str | None, ...] | None:
    """A graph input's or output's dims as the file declares them: a size, a name, or None
    (no size nor name); None when it declares no shape."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return None
    return tuple(int(d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0
                 else d.dim_param or None for d in vi.type.tensor_type.shape.dim)


def import_model(source: str | Path | onnx.ModelProto,
                 pins: Mapping[str, Sequence[int | str]] | None = None, name: str = "model") -> Graph:
    """Read, check and type an ONNX model; raise one error listing every unsupported op."""
    load_entry_points()  # ops installed packages define (cuvil.register_op)
    model, label = load_onnx(source)
    metadata = _metadata(model)  # before the version converter, which may not keep it all
    model = check_and_upgrade(model, label)
    opsets = _opsets(model.opset_import)
    g = model.graph
    graph = Graph(name)
    graph.metadata = metadata
    graph.declared_shapes = {vi.name: _declared_shape(vi) for vi in [*g.input, *g.output]}
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

    importer = _Importer(graph, opsets, label, model.ir_version)
    scope: Scope = ChainMap(values)
    importer.nodes(g.node, scope, graph)

    if importer.unsupported:
        lines = [f"  {domain} {op} (opset {ver}): used by {', '.join(repr(n) for n in names[:8])}"
                 + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                 for (domain, op, ver), names in sorted(importer.unsupported.items())]
        raise UnsupportedOpError(
            f"{label}: cuvil cannot compile {len(importer.unsupported)} operator(s) used by this "
            "model:\n" + "\n".join(lines) + "\n" + unsupported_ops_advice(importer.unsupported)
        )

    if not g.output:
        raise ModelError(f"{label}: the graph declares no outputs, so it computes nothing; "
                         "re-export the model with its outputs listed")
    for vi in g.output:
        if vi.name not in scope:
            raise ModelError(f"{label}: graph output {vi.name!r} is not produced by any node")
        v = scope[vi.name]
        _check_declared_dtype(vi, v, f"{label}: output {vi.name!r}")
        graph.outputs.append(v)
    _check_symbols_known(graph, label)
    _check_sizes(graph, label)
    return graph


#: the ONNX standard's domains; an op of any other domain is a custom op (a project defines it)
STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training")


def unsupported_ops_advice(ops: Iterable[tuple[str, str, int]]) -> str:
    """What to do about unsupported (domain, op type, opset) ops: for a standard op, another
    export opset or a definition of one's own; for a custom-domain op, how to define it."""
    ops = list(ops)
    custom = sorted({(d, op) for d, op, _ in ops if d not in STANDARD_DOMAINS})
    lines = []
    if any(d in STANDARD_DOMAINS for d, _, _ in ops):
        lines.append("See docs/ops.md for the supported operators; an older or newer export opset "
                     "may avoid them, or the project can define them (docs/custom-ops.md).")
    if custom:
        domain, op = custom[0]
        lines.append(
            f"{', '.join(f'{d} {o}' for d, o in custom)}: custom-domain op(s); define them in the "
            f'project as ONNX ops (@cuvil.register_op("{domain}", "{op}") in a module listed in '
            "tool.cuvil.op-modules) or as C/C++ kernels ([tool.cuvil.custom-ops.<name>]): see "
            "docs/custom-ops.md.")
    return "\n".join(lines)


#: names in scope: ONNX names -> values; a subgraph's scope is a child of its node's scope, so
#: it reads enclosing values by name and its own names shadow (never clobber) outer ones
Scope = ChainMap[str, Value]

#: stands in a scope for the outputs of unsupported nodes: their users cannot be typed
_UNKNOWN = Value("<unknown>", _UNTYPED)

#: a Loop with a compile-time trip count whose body cannot be compiled as a run-time loop (it
#: needs the iteration number as a constant, or its carried values change shape) is unrolled
#: when trip count x body size stays within this many nodes
UNROLL_MAX_NODES = 2048


class _Importer:
    """Types ONNX nodes into a cuvil graph; subgraphs (If/Loop/Scan bodies) recurse."""

    def __init__(self, main: Graph, opsets: dict[str, int], label: str, ir_version: int) -> None:
        self.main = main
        self.opsets = opsets
        self.label = label
        self.ir_version = ir_version
        #: run-time constraints of every scope go to the model's graph
        self.ctx = InferContext(main)
        self.unsupported: dict[tuple[str, str, int], list[str]] = {}
        #: prepended to the names of values made while inlining a branch or unrolling a loop,
        #: so that they never take a name the enclosing graph gives later (a graph output's)
        self.prefix = ""

    def nodes(self, protos: Sequence[onnx.NodeProto], scope: Scope, graph: Graph) -> None:
        for index, pn in enumerate(protos):
            self.node(pn, index, scope, graph)

    def node(self, pn: onnx.NodeProto, index: int, scope: Scope, graph: Graph) -> None:
        """Type one node into `graph`, folding it when its inputs are known; binds its outputs."""
        node_label = pn.name or (pn.output[0] if pn.output else f"#{index}")
        std = pn.domain in ("", "ai.onnx")
        if any(scope.get(i) is _UNKNOWN for i in pn.input if i):
            self._unknown(pn, scope)
            opset = self.opsets.get(pn.domain or "", 0)
            if lookup(pn.domain, pn.op_type, opset) is None and not expandable(pn.domain, pn.op_type,
                                                                                opset):
                self._unsupported(pn, opset, node_label)
            return
        node = _make_node(pn, scope, self.opsets, self.label, node_label)
        if pn.op_type == "Constant" and std:
            scope[pn.output[0]] = graph.constant(_constant_value(pn, self.label),
                                                 self.prefix + pn.output[0])
            return
        if pn.op_type == "If" and std:
            cond = known_flag(node.input(0))
            if cond is not None:  # the common case in exports: decided by shapes or constants
                self._inline_if(pn, node_label, cond, scope, graph)
                return
        folded = None
        if node.inputs and all(v is None or v.is_const for v in node.inputs):
            folded = fold_node(pn, [v.const if v is not None else None for v in node.inputs],
                               self.opsets, self.ir_version)
        if folded is not None:
            for name, arr in zip(pn.output, folded):
                if name:
                    scope[name] = graph.constant(arr, self.prefix + name)
            return
        known = propagate(node, len(pn.output))
        if known is not None:
            _add_known_values(graph, node, pn, known, scope, self.prefix)
            return
        op = lookup(node.domain, node.op_type, node.opset)
        if op is None and self._expand(pn, node, node_label, scope, graph):
            return
        body = op.expand(node) if op is not None else None
        if body is not None:  # an op cuvil builds from other ops (ai.onnx.ml)
            self._expand(pn, node, node_label, scope, graph, body)
            return
        if op is None:
            self._unsupported(pn, node.opset, node_label)
            self._unknown(pn, scope)
            return
        if pn.op_type == "Loop" and std:
            self._loop(pn, node, op, node_label, scope, graph)
            return
        self._typed(pn, node, op, node_label, scope, graph)

    def _typed(self, pn: onnx.NodeProto, node: Node, op: Any, node_label: str, scope: Scope,
               graph: Graph) -> None:
        """Import the node's subgraphs, run its shape rule and add it to `graph`."""
        # the outputs exist (untyped, unnamed in the graph) while the rule runs, so it can see
        # how many there are; they take their names once the rule accepts the node
        node.outputs = [Value(self.prefix + (out_name or f"{node_label}_unused"), _UNTYPED)
                        for out_name in pn.output]
        if isinstance(op, SubgraphOp):
            bodies = {}
            for attr in op.graph_attrs:
                proto = node.attrs.get(attr)
                if proto is None:
                    raise ModelError(f"{self.label}: {node.describe()} has no {attr!r} graph")
                try:
                    body = self.subgraph(proto, op.bind_subgraph(node, attr, proto), scope,
                                         f"{graph.name}.{node_label}.{attr}")
                except CuvilError as exc:
                    raise type(exc)(f"{exc}\n(in the {attr} of {node.describe()})") from None
                if body is None:  # an unsupported op inside: reported with the others
                    self._unknown(pn, scope)
                    return
                bodies[attr] = body
            op.attach(node, bodies)
        try:
            types = op.infer(node, self.ctx)
        except CuvilError:
            raise
        except Exception as exc:
            raise ModelError(f"{self.label}: {node.describe()}: cannot infer output shapes: "
                             f"{type(exc).__name__}: {exc}") from None
        node.outputs = node.outputs[:len(types)]
        for out_name, v, t in zip(pn.output, node.outputs, types):
            v.name = graph.unique_name(v.name)
            v.type = t
            if out_name:
                scope[out_name] = v
        graph.add_node(node)

    def _unsupported(self, pn: onnx.NodeProto, opset: int, node_label: str) -> None:
        self.unsupported.setdefault((pn.domain or "ai.onnx", pn.op_type, opset),
                                    []).append(node_label)

    def _unknown(self, pn: onnx.NodeProto, scope: Scope) -> None:
        for name in pn.output:
            if name:
                scope[name] = _UNKNOWN

    def subgraph(self, proto: onnx.GraphProto, bindings: Sequence[TensorType | np.ndarray],
                 scope: Scope, name: str) -> Graph | None:
        """A body as a graph of its own: its formal inputs hold `bindings` (a run-time value of
        that type, or a constant); names of enclosing scopes resolve to the enclosing values
        (the node captures them, see `SubgraphOp.attach`). None when an op inside is unsupported."""
        body = Graph(name)  # a namespace of its own
        inner = scope.new_child()
        outer_prefix, self.prefix = self.prefix, ""
        outer_body, self.ctx.in_body = self.ctx.in_body, True
        if len(bindings) != len(proto.input):
            raise ModelError(f"{self.label}: subgraph {name!r} has {len(proto.input)} inputs, "
                             f"expected {len(bindings)}")
        for vi, b in zip(proto.input, bindings):
            if isinstance(b, TensorType):
                v = body.value(vi.name or "unused", b)
                body.inputs.append(v)
            else:
                v = body.constant(np.asarray(b), vi.name or "unused")
            if vi.name:
                inner[vi.name] = v
        for init in proto.initializer:
            inner[init.name] = body.constant(numpy_helper.to_array(init), init.name)
        try:
            self.nodes(proto.node, inner, body)
        except CuvilError:
            body.forget()
            raise
        finally:
            self.prefix = outer_prefix
            self.ctx.in_body = outer_body
        outputs = [self._lookup(inner, vo.name, name) for vo in proto.output]
        if any(v is _UNKNOWN for v in outputs):
            return None
        for vo, v in zip(proto.output, outputs):
            _check_declared_dtype(vo, v, f"{self.label}: output {vo.name!r} of subgraph {name!r}")
        body.outputs = outputs
        return body

    def _lookup(self, scope: Scope, name: str, where: str) -> Value:
        v: Value | None = scope.get(name) if name else None
        if v is None:
            raise ModelError(f"{self.label}: {where}: output {name!r} is not produced by any node "
                             "of the subgraph nor defined around it")
        return v

    def _bind(self, name: str, v: Value, scope: Scope, graph: Graph, node_label: str) -> None:
        """Make `name` (an output of an inlined node) hold `v` under its own name."""
        if v is _UNKNOWN:
            scope[name] = v
        elif v.is_const:
            scope[name] = graph.constant(v.const, name)  # type: ignore[arg-type]
        else:  # a graph output must carry its ONNX name: an Identity (a view, free otherwise)
            tmp = scope.new_child({" source": v})
            opsets = self.opsets  # a graph of ai.onnx.ml ops only may import no default opset
            self.opsets = {"": 1, **opsets}
            try:
                self.node(onnx.helper.make_node("Identity", [" source"], [name], name=node_label),
                          0, tmp, graph)
            finally:
                self.opsets = opsets
            scope[name] = tmp[name]

    def _inline_if(self, pn: onnx.NodeProto, node_label: str, cond: bool, scope: Scope,
                   graph: Graph) -> None:
        """Replace an If on a compile-time condition by the branch it takes."""
        attr = "then_branch" if cond else "else_branch"
        branch = _graph_attr(pn, attr)
        if branch is None:
            raise ModelError(f"{self.label}: If node {node_label!r} has no {attr}")
        inner = scope.new_child()
        outer_prefix = self.prefix
        self.prefix = f"{outer_prefix}{node_label}/"
        try:
            for init in branch.initializer:
                inner[init.name] = graph.constant(numpy_helper.to_array(init), self.prefix + init.name)
            self.nodes(branch.node, inner, graph)
        finally:
            self.prefix = outer_prefix
        for name in ("then_branch", "else_branch"):  # as onnxruntime, whichever is taken
            other = _graph_attr(pn, name)
            if other is not None and len(other.output) != len(pn.output):
                raise ModelError(f"{self.label}: If node {node_label!r} has {len(pn.output)} "
                                 f"outputs but its {name} produces {len(other.output)}; give "
                                 "the node one output per branch output")
        for out_name, bo in zip(pn.output, branch.output):
            v = self._lookup(inner, bo.name, f"If {node_label!r} {attr}")
            _check_declared_dtype(bo, v, f"{self.label}: output {bo.name!r} of the {attr} of If "
                                         f"node {node_label!r}")
            if out_name:
                self._bind(out_name, v, scope, graph, node_label)

    def _expand(self, pn: onnx.NodeProto, node: Node, node_label: str, scope: Scope,
                graph: Graph, body: onnx.FunctionProto | None = None) -> bool:
        """Compile `body` (else the body onnx defines) for an op cuvil has no kernel for; False
        when there is none. An op inside the body that cuvil cannot compile is reported as the
        node's own op, the one the user sees in the model."""
        if body is None:
            body = function_body(pn, node.opset,
                                 [v.type if v is not None else None for v in node.inputs])
        if body is None:
            return False
        unsupported = {k: list(v) for k, v in self.unsupported.items()}
        inner = scope.new_child()
        missing = set()
        for formal, actual in zip(body.input, [*pn.input, *[""] * len(body.input)]):
            if actual:
                inner[formal] = scope[actual]
            else:
                missing.add(formal)
        nodes = []
        for fn in body.node:  # omitted optional inputs stay omitted inside the body
            if missing.intersection(fn.input):
                fn = onnx.NodeProto.FromString(fn.SerializeToString())
                fn.input[:] = ["" if i in missing else i for i in fn.input]
            nodes.append(fn)
        outer_prefix, outer_opsets = self.prefix, self.opsets
        self.prefix = f"{outer_prefix}{node_label}/"
        self.opsets = {**outer_opsets, **_opsets(body.opset_import)}
        try:
            self.nodes(nodes, inner, graph)
        except CuvilError as exc:
            raise type(exc)(f"{exc}\n(in the ops {node.describe()} is compiled as)") from None
        finally:
            self.prefix, self.opsets = outer_prefix, outer_opsets
        if self.unsupported != unsupported:
            self.unsupported = unsupported
            self._unsupported(pn, node.opset, node_label)
            self._unknown(pn, scope)
            return True
        for out_name, formal in zip(pn.output, body.output):
            if out_name:
                self._bind(out_name, self._lookup(inner, formal, f"body of {node.describe()}"),
                           scope, graph, node_label)
        return True

    # -- Loop ---------------------------------------------------------------------------

    def _loop(self, pn: onnx.NodeProto, node: Node, op: Any, node_label: str, scope: Scope,
              graph: Graph) -> None:
        """A run-time loop when its body compiles as one; else, with a small compile-time trip
        count, the body unrolled into the graph (iteration numbers become constants)."""
        unsupported = {k: list(v) for k, v in self.unsupported.items()}
        constraints = len(self.main.constraints)
        try:
            self._typed(pn, node, op, node_label, scope, graph)
            return
        except CuvilError as exc:
            rolled_error = exc
            for body in subgraphs(node):
                body.forget()
        trip = self._unroll_count(pn, node)
        if isinstance(trip, str):
            raise type(rolled_error)(
                f"{rolled_error}\n(the loop cannot be unrolled instead: {trip})") from None
        # start over: what the failed attempt recorded does not hold for the unrolled loop
        self.unsupported = unsupported
        del self.main.constraints[constraints:]
        first = len(graph.nodes)
        try:
            self._unroll(pn, node, node_label, trip, scope, graph)
        except CuvilError as exc:
            graph.remove_nodes(graph.nodes[first:])
            self.unsupported = unsupported
            del self.main.constraints[constraints:]
            raise type(rolled_error)(
                f"{rolled_error}\n(unrolling the loop instead failed too: {exc})") from None

    def _unroll_count(self, pn: onnx.NodeProto, node: Node) -> int | str:
        """The trip count if the loop may be unrolled (known M, or a known false condition,
        and a body small enough), else why not."""
        body = _graph_attr(pn, "body")
        if body is None:
            return "it has no body"
        m = node.input(0)
        m_known = m.known_values() if m is not None else None
        cond = node.input(1)
        if cond is not None and known_flag(cond) is None:
            return f"its condition {cond.name!r} is computed at run time"
        if cond is not None and not known_flag(cond):
            return 0
        if m is None:
            return "it has no trip count M"
        if m_known is None or len(m_known) != 1 or not isinstance(m_known[0], int):
            return f"its trip count M ({m.name!r}) is not a constant"
        trip = max(int(m_known[0]), 0)
        if trip * max(len(body.node), 1) > UNROLL_MAX_NODES:
            return f"{trip} iterations of {len(body.node)} nodes are too many"
        return trip

    def _unroll(self, pn: onnx.NodeProto, node: Node, node_label: str, trip: int, scope: Scope,
                graph: Graph) -> None:
        body = _graph_attr(pn, "body")
        assert body is not None
        names_in = [vi.name for vi in body.input]
        names_out = [vo.name for vo in body.output]
        n = len(pn.input) - 2
        if len(names_in) != n + 2 or len(names_out) != len(pn.output) + 1 or len(pn.output) < n:
            raise ModelError(f"{self.label}: {node.describe()}: the body has {len(names_in)} inputs "
                             f"and {len(names_out)} outputs for {n} loop-carried values and "
                             f"{len(pn.output)} node outputs; it needs 2 + N inputs and one "
                             "output more than the node (its condition)")
        k = len(names_out) - 1 - n
        carried: list[Value] = [v for v in node.inputs[2:2 + n] if v is not None]
        if len(carried) != n:
            raise ModelError(f"{self.label}: {node.describe()}: every loop-carried input must be given")
        parts: list[list[Value]] = [[] for _ in range(k)]
        outer_prefix = self.prefix
        for t in range(trip):
            inner = scope.new_child()
            self.prefix = f"{outer_prefix}{node_label}/{t}/"
            try:
                if names_in[0]:
                    inner[names_in[0]] = graph.constant(np.array(t, dtype=np.int64),
                                                        self.prefix + names_in[0])
                if names_in[1]:
                    inner[names_in[1]] = graph.constant(np.array(True), self.prefix + names_in[1])
                for name, v in zip(names_in[2:], carried):
                    if name:
                        inner[name] = v
                for init in body.initializer:
                    inner[init.name] = graph.constant(numpy_helper.to_array(init),
                                                      self.prefix + init.name)
                self.nodes(body.node, inner, graph)
            finally:
                self.prefix = outer_prefix
            outs = [self._lookup(inner, name, f"{node.describe()} body") for name in names_out]
            if any(v is _UNKNOWN for v in outs):
                self._unknown(pn, scope)
                return
            for vo, v in zip(body.output, outs):
                _check_declared_dtype(vo, v, f"{self.label}: output {vo.name!r} of the body of "
                                             f"{node.describe()}")
            go = known_flag(outs[0])
            if go is None:
                raise UnsupportedOpError(
                    f"{self.label}: {node.describe()}: the body's condition is computed at run "
                    "time, so the loop cannot be unrolled")
            carried = outs[1:1 + n]
            for part, v in zip(parts, outs[1 + n:]):
                part.append(v)
            if not go:
                break
        for out_name, v in zip(pn.output[:n], carried):
            if out_name:
                self._bind(out_name, v, scope, graph, node_label)
        for j, out_name in enumerate(pn.output[n:n + k]):
            if not out_name:
                continue
            if not parts[j]:
                raise UnsupportedOpError(
                    f"{self.label}: {node.describe()}: the loop runs no iteration, so its scan "
                    f"output {out_name!r} has no element type and shape to take")
            self._stack(parts[j], out_name, node_label, scope, graph)

    def _stack(self, parts: list[Value], out_name: str, node_label: str, scope: Scope,
               graph: Graph) -> None:
        """Bind `out_name` to the per-iteration values stacked along a new first axis."""
        outer_prefix = self.prefix
        self.prefix = f"{outer_prefix}{node_label}/"
        try:
            work = scope.new_child({" axes": graph.constant(np.array([0], dtype=np.int64),
                                                            self.prefix + "axes")})
            rows = []
            for t, v in enumerate(parts):
                work[f" part{t}"] = v
                if self.opsets.get("", 0) >= 13:
                    pn = onnx.helper.make_node("Unsqueeze", [f" part{t}", " axes"], [f" row{t}"],
                                               name=node_label)
                else:
                    pn = onnx.helper.make_node("Unsqueeze", [f" part{t}"], [f" row{t}"], axes=[0],
                                               name=node_label)
                self.node(pn, 0, work, graph)
                rows.append(f" row{t}")
        finally:
            self.prefix = outer_prefix  # the loop's output takes its own name
        self.node(onnx.helper.make_node("Concat", rows, [out_name], axis=0, name=node_label),
                  0, work, graph)
        scope[out_name] = work[out_name]


def _check_declared_dtype(vi: onnx.ValueInfoProto, v: Value, what: str) -> None:
    """Refuse an output declared with another element type than the graph computes there,
    as onnxruntime does (no declared type, or an untyped value, passes)."""
    declared = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
    if not declared or v is _UNKNOWN or v.type is _UNTYPED:
        return
    if element_dtype(declared, what) != v.type.dtype:
        raise ModelError(
            f"{what} is declared {onnx.TensorProto.DataType.Name(declared)} but the graph "
            f"computes {v.type.dtype} there (onnxruntime refuses such a model too); fix the "
            "declaration or re-export the model")


def _check_variadic_names(pn: onnx.NodeProto, opset: int, label: str, node_label: str) -> None:
    """Refuse an empty name (an omitted input) among a standard op's variadic inputs: only
    optional inputs may be omitted, and onnxruntime fails such a node (Concat, Sum, Max...)."""
    if pn.domain not in ("", "ai.onnx") or "" not in pn.input:
        return
    try:
        schema = onnx.defs.get_schema(pn.op_type, opset, "")
    except onnx.defs.SchemaError:
        return  # not a standard op at this opset: reported as unsupported
    formal = list(schema.inputs)
    if not formal or formal[-1].option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return
    first = len(formal) - 1
    for position, name in enumerate(pn.input[first:], start=first):
        if not name:
            raise ModelError(
                f"{label}: node {node_label!r} ({pn.op_type}) has an empty name as input "
                f"{position}, one of its {formal[-1].name!r} inputs, which cannot be left out; "
                "name the tensor it should read, or drop the entry")


def _opsets(imports: Sequence[onnx.OperatorSetIdProto]) -> dict[str, int]:
    """Opset version per domain, the default domain spelled ""."""
    return {("" if i.domain == "ai.onnx" else i.domain): int(i.version) for i in imports}


def _graph_attr(pn: onnx.NodeProto, name: str) -> onnx.GraphProto | None:
    return next((a.g for a in pn.attribute if a.name == name and a.type == a.GRAPH), None)


def _add_known_values(graph: Graph, node: Node, pn: onnx.NodeProto,
                      known: list[tuple[TensorType, tuple[Dim, ...]]],
                      values: MutableMapping[str, Value], prefix: str = "") -> None:
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
            values[out_name] = graph.constant(arr, prefix + out_name)
            continue
        v = graph.value(prefix + out_name, t)
        v.sym_value = elements
        graph.add_node(Node("SymbolicValue", [], [v], {"source_op": node.op_type},
                            name=node.name or out_name, domain="cuvil", opset=1))
        values[out_name] = v


def _make_node(pn: onnx.NodeProto, values: Mapping[str, Value], opsets: dict[str, int], label: str,
               node_label: str) -> Node:
    _check_variadic_names(pn, opsets.get(pn.domain if pn.domain != "ai.onnx" else "", 0), label,
                          node_label)
    inputs: list[Value | None] = []
    for name in pn.input:
        if not name:
            inputs.append(None)
        elif name not in values:
            raise ModelError(f"{label}: node {node_label!r} ({pn.op_type}) reads {name!r}, which "
                             "no earlier node produces (is the graph sorted?)")
        else:
            inputs.append(values[name])
    attrs = {a.name: _attribute(a, pn, label) for a in pn.attribute}
    domain = "" if pn.domain == "ai.onnx" else pn.domain
    return Node(pn.op_type, inputs, [], attrs, name=pn.name, domain=domain,
                opset=opsets.get(domain, 0))


def _attribute(a: onnx.AttributeProto, pn: onnx.NodeProto, label: str) -> Any:
    """The attribute's value; a ModelError naming the node when it cannot be read (a tensor
    whose raw bytes disagree with its dims: the checker lets through more bytes than needed)."""
    try:
        return attribute_value(a)
    except Exception as exc:  # numpy_helper's ValueError, protobuf's errors
        raise ModelError(f"{label}: node {pn.name or pn.output[0]!r} ({pn.op_type}): attribute "
                         f"{a.name!r} cannot be read ({exc}); re-export the model") from None


def _constant_value(pn: onnx.NodeProto, label: str) -> np.ndarray:
    for a in pn.attribute:
        v = _attribute(a, pn, label)
        if a.name == "value":
            return np.asarray(v)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(v, dtype=np.float32)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(v, dtype=np.int64)
    raise UnsupportedOpError(f"{label}: Constant node {pn.name or pn.output[0]!r} uses an "
                             "unsupported attribute (sparse or string values)")


def _check_symbols_known(graph: Graph, label: str) -> None:
    known = {s.name for s in graph.symbols} | {s.name for s in graph.data_dim_table}
    for v in graph.outputs:
        for d in v.type.shape:
            if isinstance(d, sympy.Expr):
                extra = {s.name for s in d.free_symbols} - known
                if extra:
                    raise ModelError(f"{label}: output {v.name!r} has dims {sorted(extra)} that do "
                                     "not follow from the input dims")


def _check_sizes(graph: Graph, label: str) -> None:
    """Refuse tensors whose static size no machine could hold (dims like 2**63 - 1)."""
    values = [*graph.inputs, *(v for node in graph.nodes for v in node.outputs)]
    for v in values:
        size = v.type.dtype.itemsize
        for d in v.type.shape:
            if isinstance(d, int):
                size *= d
        if size > MAX_TENSOR_BYTES:
            where = f"input {v.name!r}" if v.producer is None else \
                f"{v.name!r}, output of {v.producer.describe()}"
            raise ModelError(f"{label}: {where} has shape {list(v.type.shape)}: {size} bytes, more "
                             f"than any address space holds ({MAX_TENSOR_BYTES} bytes); fix the "
                             "model's dims")
