"""Custom ops with native kernels (`[tool.cuvil.custom-ops.<name>]`): the shape rule the table
declares, matching of nodes to kernels by signature, and the call through cuvil_op.h.

The kernels exist for one compile: `native_ops(kernels)` registers them while a model is
compiled. A node is matched to the kernel whose signature it fits (input count, dtypes and
ranks, attributes); a node fitting none is an error naming it, the closest signature and what
differs. Its lowering fills a `cuvil_op_context` (tensors with dtype, shape and strides; the
attributes, constant data of the library; the node's scratch memory as the workspace) and
calls the kernel, returning STATUS_CUSTOM_OP_FAILED when the kernel returns non-zero.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import onnx
import sympy
from llvmlite import ir

from cuvil.compiler.ir import Dim, Graph, Node, TensorType, simplify_dim, subgraphs
from cuvil.compiler.kernels.emitter import I32, I64, PTR
from cuvil.compiler.ops import InferContext, Op, lookup, register, unregister
from cuvil.config import CustomOpConfig, check_expression
from cuvil.errors import ModelError
from cuvil.runtime import STATUS_CUSTOM_OP_FAILED

if TYPE_CHECKING:
    from cuvil.compiler.kernels.emitter import Emitter

__all__ = ["ABI_VERSION", "NativeKernel", "native_ops", "uses_native"]

#: CUVIL_OP_ABI_VERSION of cuvil/runtime/cuvil_op.h: keep both in step
ABI_VERSION = 1
DOUBLE = ir.DoubleType()
# the structs of cuvil_op.h, field for field
TENSOR = ir.LiteralStructType([PTR, PTR, PTR, I32, I32])
ATTR = ir.LiteralStructType([PTR, PTR, PTR, PTR, I64, DOUBLE, I64, I32, I32])
CONTEXT = ir.LiteralStructType([I32, I32, I32, I32, PTR, PTR, PTR, PTR, I64])
_ATTR_CODES = {"float": 1, "int": 2, "string": 3, "floats": 6, "ints": 7}

ShapeFunction = Callable[[list[tuple[Dim, ...]], dict[str, Any]], Sequence[Sequence[Dim]]]


@dataclass(frozen=True)
class NativeKernel:
    """A custom-op table with its shape function resolved (None: the table's expressions)."""

    config: CustomOpConfig
    shape_function: ShapeFunction | None = None

    @property
    def where(self) -> str:
        return f"tool.cuvil.custom-ops.{self.config.name}"


class _Native(Op):
    """The kernels of one (domain, op type); `kernels` is set on each registered subclass."""

    kernels: tuple[NativeKernel, ...] = ()
    dtypes = ()

    def _kernel(self, node: Node) -> NativeKernel:
        candidates = [(self._differences(k, node), k) for k in self.kernels]
        fitting = [k for diffs, k in candidates if not diffs]
        if fitting:
            return fitting[0]
        diffs, closest = min(candidates, key=lambda c: len(c[0]))
        raise ModelError(
            f"{node.describe()}: no custom-op kernel matches the node's signature. The closest is "
            f"{closest.where}: {closest.config.describe()}; it differs in: {'; '.join(diffs)}. "
            "Fix the node, or declare a kernel for this signature in another "
            "[tool.cuvil.custom-ops.<name>] table")

    @staticmethod
    def _differences(kernel: NativeKernel, node: Node) -> list[str]:
        cfg = kernel.config
        diffs = []
        if node.opset < cfg.since:
            diffs.append(f"the model imports {cfg.domain} version {node.opset}, the kernel is for "
                         f"version {cfg.since} on")
        if len(node.inputs) != len(cfg.inputs):
            diffs.append(f"the node has {len(node.inputs)} inputs, the kernel takes "
                         f"{len(cfg.inputs)}")
        for i, (v, spec) in enumerate(zip(node.inputs, cfg.inputs)):
            if v is None:
                diffs.append(f"input {i} ({spec.name}) is left out")
                continue
            if v.type.dtype.name != spec.dtype:
                diffs.append(f"input {i} ({spec.name}) is {v.type.dtype.name}, the kernel takes "
                             f"{spec.dtype}")
            if spec.rank is not None and v.type.rank != spec.rank:
                diffs.append(f"input {i} ({spec.name}) has rank {v.type.rank}, the kernel takes "
                             f"rank {spec.rank}")
        if len(node.outputs) != len(cfg.outputs):
            diffs.append(f"the node has {len(node.outputs)} outputs, the kernel gives "
                         f"{len(cfg.outputs)}")
        declared = {a.name: a for a in cfg.attributes}
        for name, value in node.attrs.items():
            attr = declared.get(name)
            if attr is None:
                diffs.append(f"attribute {name!r} is not one the kernel takes "
                             f"({', '.join(declared) or 'it takes none'})")
            elif _attr_type(value) not in (attr.type, "empty list"):
                diffs.append(f"attribute {name!r} is {_attr_type(value)}, the kernel takes {attr.type}")
            elif _attr_type(value) == "empty list" and attr.type not in ("ints", "floats"):
                diffs.append(f"attribute {name!r} is an empty list, the kernel takes {attr.type}")
        for attr in cfg.attributes:
            if attr.default is None and attr.name not in node.attrs:
                diffs.append(f"attribute {attr.name!r} ({attr.type}) is required, the node does "
                             "not set it")
        return diffs

    def attributes(self, kernel: NativeKernel, node: Node) -> dict[str, Any]:
        """Every declared attribute, the node's value or the default."""
        values = {}
        for spec in kernel.config.attributes:
            value = node.attrs.get(spec.name, spec.default)
            if spec.type == "float":
                value = float(value)
            elif spec.type == "floats":
                value = [float(x) for x in value]
            values[spec.name] = value
        return values

    def _names(self, kernel: NativeKernel, node: Node) -> dict[str, Any]:
        names: dict[str, Any] = {spec.name: tuple(v.type.shape) for spec, v in
                                 zip(kernel.config.inputs, node.inputs) if v is not None}
        names.update(self.attributes(kernel, node))
        return names

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        kernel = self._kernel(node)
        cfg = kernel.config
        names = self._names(kernel, node)
        if kernel.shape_function is not None:
            shapes = [tuple(v.type.shape) for v in node.inputs if v is not None]
            try:
                found = list(kernel.shape_function(shapes, self.attributes(kernel, node)))
            except Exception as exc:
                raise ModelError(f"{node.describe()}: the shape function {cfg.shape_function} of "
                                 f"{kernel.where} raised {type(exc).__name__}: {exc}") from None
            if len(found) != len(cfg.outputs):
                raise ModelError(f"{node.describe()}: the shape function {cfg.shape_function} of "
                                 f"{kernel.where} returned {len(found)} shapes for "
                                 f"{len(cfg.outputs)} outputs")
        else:
            found = [self._evaluate_shape(kernel, node, spec.shape, names) for spec in cfg.outputs]
        types = []
        for spec, shape in zip(cfg.outputs, found):
            dims = tuple(_checked_dim(d, node, kernel, spec.name) for d in shape)
            if spec.rank is not None and len(dims) != spec.rank:
                raise ModelError(f"{node.describe()}: the shape rule of {kernel.where} gives "
                                 f"output {spec.name!r} rank {len(dims)}, declared rank {spec.rank}")
            types.append(TensorType(np.dtype(spec.dtype), dims))
        return types

    def _evaluate_shape(self, kernel: NativeKernel, node: Node, shape: Any,
                        names: dict[str, Any]) -> tuple[Dim, ...]:
        if isinstance(shape, str):
            value = _evaluate(shape, names, node, kernel)
            if not isinstance(value, (tuple, list)):
                raise ModelError(f"{node.describe()}: the shape {shape!r} of {kernel.where} gives "
                                 f"{value!r}, not a shape; write one expression per dim, or one "
                                 "naming a whole shape such as \"x\"")
            return tuple(value)
        return tuple(d if isinstance(d, int) else _evaluate(d, names, node, kernel) for d in shape)

    def scratch_bytes(self, node: Node) -> Dim:
        kernel = self._kernel(node)
        workspace = kernel.config.workspace
        if isinstance(workspace, int):
            return workspace
        return _checked_dim(_evaluate(workspace, self._names(kernel, node), node, kernel), node,
                            kernel, "workspace")

    def lower(self, node: Node, k: Emitter) -> None:
        kernel = self._kernel(node)
        b = k.b
        values = [v for v in node.inputs if v is not None] + list(node.outputs)
        tensors = b.alloca(TENSOR, size=k.i64(len(values)), name="tensors")
        for i, v in enumerate(values):
            rank = v.type.rank
            dims = b.alloca(I64, size=k.i64(max(2 * rank, 1)), name=f"dims{i}")
            view = k.view(v)
            for axis in range(rank):
                b.store(view.dims[axis], b.gep(dims, [k.i64(axis)], source_etype=I64))
                b.store(view.strides[axis], b.gep(dims, [k.i64(rank + axis)], source_etype=I64))
            fields = [k.buffers[v], dims, b.gep(dims, [k.i64(rank)], source_etype=I64),
                      ir.Constant(I32, onnx.helper.np_dtype_to_tensor_dtype(v.type.dtype)),
                      ir.Constant(I32, rank)]
            b.store(_struct(b, TENSOR, fields), b.gep(tensors, [k.i64(i)], source_etype=TENSOR))
        attrs = self._attribute_table(k.module, kernel, node)
        context = b.alloca(CONTEXT, name="context")
        n_in = len(values) - len(node.outputs)
        workspace = k.scratch if k.scratch is not None else ir.Constant(PTR, None)
        fields = [ir.Constant(I32, ABI_VERSION), ir.Constant(I32, n_in),
                  ir.Constant(I32, len(node.outputs)), ir.Constant(I32, len(kernel.config.attributes)),
                  tensors, b.gep(tensors, [k.i64(n_in)], source_etype=TENSOR), attrs, workspace,
                  k.dim(self.scratch_bytes(node))]
        b.store(_struct(b, CONTEXT, fields), context)
        status = b.call(_declare(k.module, kernel.config.function), [context])
        k.fail_if(b.icmp_signed("!=", status, ir.Constant(I32, 0)), STATUS_CUSTOM_OP_FAILED)

    def _attribute_table(self, module: ir.Module, kernel: NativeKernel, node: Node) -> ir.Value:
        """The node's attributes as a constant `cuvil_attr` array in the library."""
        entries = []
        null = ir.Constant(PTR, None)
        for spec, value in zip(kernel.config.attributes, self.attributes(kernel, node).values()):
            s = ints = floats = null
            i, f, count = 0, 0.0, 0
            if spec.type == "int":
                i = int(value)
            elif spec.type == "float":
                f = float(value)
            elif spec.type == "string":
                data = str(value).encode()
                s, count = _constant(module, "s", bytearray(data + b"\0"), ir.IntType(8)), len(data)
            elif spec.type == "ints":
                ints, count = _constant(module, "ints", [int(x) for x in value], I64), len(value)
            else:
                floats, count = _constant(module, "floats", [float(x) for x in value], DOUBLE), len(value)
            name = _constant(module, "name", bytearray(spec.name.encode() + b"\0"), ir.IntType(8))
            entries.append(ir.Constant(ATTR, [name, s, ints, floats, ir.Constant(I64, i),
                                              ir.Constant(DOUBLE, f), ir.Constant(I64, count),
                                              ir.Constant(I32, _ATTR_CODES[spec.type]),
                                              ir.Constant(I32, 0)]))
        if not entries:
            return null
        return _constant(module, "attrs", entries, ATTR)


def _struct(b: ir.IRBuilder, ty: ir.LiteralStructType, fields: Sequence[ir.Value]) -> ir.Value:
    value: ir.Value = ir.Constant(ty, ir.Undefined)
    for f, field in enumerate(fields):
        value = b.insert_value(value, field, f)
    return value


def _constant(module: ir.Module, what: str, items: Any, elem: ir.Type) -> ir.GlobalVariable:
    ty = ir.ArrayType(elem, max(len(items), 1))
    g = ir.GlobalVariable(module, ty, module.get_unique_name(f"cuvil.op.{what}"))
    if isinstance(items, bytearray):
        g.initializer = ir.Constant(ty, items)
    else:
        values = [x if isinstance(x, ir.Constant) else ir.Constant(elem, x) for x in items]
        g.initializer = ir.Constant(ty, values or [ir.Constant(elem, 0)])
    g.global_constant = True
    g.linkage = "private"
    return g


def _declare(module: ir.Module, function: str) -> ir.Function:
    try:
        fn = module.get_global(function)
    except KeyError:
        fn = ir.Function(module, ir.FunctionType(I32, [PTR]), function)
    assert isinstance(fn, ir.Function)
    return fn


def _attr_type(value: Any) -> str:
    if isinstance(value, (int, np.integer)):  # bool too
        return "int"
    if isinstance(value, (float, np.floating)):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        if not value:
            return "empty list"
        if all(isinstance(x, (int, np.integer)) for x in value):
            return "ints"
        if all(isinstance(x, (float, np.floating)) for x in value):
            return "floats"
    return type(value).__name__


def _max(*args: Any) -> Any:
    return simplify_dim(sympy.Max(*args))


def _min(*args: Any) -> Any:
    return simplify_dim(sympy.Min(*args))


def _evaluate(text: str, names: dict[str, Any], node: Node, kernel: NativeKernel) -> Any:
    """A shape expression (checked by config.check_expression) over the input shapes and the
    attributes; dims are ints or sympy expressions of the symbolic dims."""
    tree = check_expression(text, names, kernel.where, "Fix the expression")
    try:
        return eval(compile(ast.fix_missing_locations(tree), kernel.where, "eval"),
                    {"__builtins__": {}, "max": _max, "min": _min}, dict(names))
    except Exception as exc:
        raise ModelError(f"{node.describe()}: the expression {text!r} of {kernel.where} fails for "
                         f"this node: {type(exc).__name__}: {exc}") from None


def _checked_dim(d: Any, node: Node, kernel: NativeKernel, what: str) -> Dim:
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        if d < 0:
            raise ModelError(f"{node.describe()}: the shape rule of {kernel.where} gives {what} a "
                             f"negative size {d}")
        return int(d)
    if isinstance(d, sympy.Expr):
        return simplify_dim(d)
    raise ModelError(f"{node.describe()}: the shape rule of {kernel.where} gives {what} the dim "
                     f"{d!r}, not an integer")


@contextlib.contextmanager
def native_ops(kernels: Sequence[NativeKernel]) -> Iterator[None]:
    """Register `kernels` (grouped by domain and op type) while the block runs."""
    groups: dict[tuple[str, str], list[NativeKernel]] = {}
    for kernel in kernels:
        groups.setdefault((kernel.config.domain, kernel.config.op_type), []).append(kernel)
    classes = [type(f"Native_{op_type}", (_Native,),
                    {"op_type": op_type, "domain": domain, "kernels": tuple(group),
                     "since": min(k.config.since for k in group)})
               for (domain, op_type), group in groups.items()]
    for cls in classes:
        register(cls)
    try:
        yield
    finally:
        for cls in classes:
            unregister(cls)


def uses_native(graph: Graph) -> bool:
    """Whether a node of `graph` (or of a body inside it) calls a native kernel."""
    return any(isinstance(lookup(n.domain, n.op_type, n.opset), _Native)
               or any(uses_native(body) for body in subgraphs(n)) for n in graph.nodes)
