"""The op registry: one table keyed by (domain, op type), implementations chosen by opset.

Each op family lives in its own module and defines `Op` subclasses that carry both the
shape/type rule (`infer`) and the lowering to LLVM (`lower`). Importing this package imports
every family, so the registry is complete.
"""

from __future__ import annotations

import copy
import functools
import keyword
import re
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
import sympy
from onnx import numpy_helper

from cuvil.compiler.ir import (
    Constraint,
    DataDim,
    Dim,
    Graph,
    Node,
    TensorType,
    Value,
    data_symbol,
    simplify_dim,
)
from cuvil.compiler.verify import use_shape_rules
from cuvil.errors import ModelError, UnsupportedOpError

if TYPE_CHECKING:
    from llvmlite import ir

    from cuvil.compiler.kernels.emitter import Emitter

__all__ = [
    "FLOATS",
    "UNCHECKED",
    "InferContext",
    "Op",
    "attr",
    "attribute_value",
    "broadcast_shapes",
    "compute_dtype",
    "const_input",
    "const_or_symbolic_input",
    "lookup",
    "normalize_axis",
    "register",
    "registered_ops",
    "replaced_constants",
    "required_input",
    "schema",
    "unregister",
]


#: the float dtypes, which most numeric lowerings take
FLOATS = ("float32", "float64", "float16")


@dataclass
class InferContext:
    """What a shape rule may use besides the node: the graph, to record constraints."""

    graph: Graph
    #: set by the importer while it types an If/Loop/Scan body
    in_body: bool = False

    def require(self, node: Node, condition: Any, message: str) -> None:
        """Record that `condition` (a sympy relational or bool) must hold at call time.

        A condition that is already false at compile time is a model error right away.
        """
        condition = sympy.sympify(condition)
        if condition is sympy.true:
            return
        if condition is sympy.false:
            raise ModelError(f"{node.describe()}: {message}")
        data = sorted(s.name for s in condition.free_symbols & self.graph.data_dim_table.keys())
        if data:
            # the caller checks constraints before the call, when these dims are not known yet
            raise UnsupportedOpError(
                f"{node.describe()}: {message}, where {', '.join(data)} depend on the data: cuvil "
                "cannot check at run time that sizes decided by the data agree; make them follow "
                "from one data-dependent node (e.g. Gather both tensors with the same indices)")
        self.graph.constraints.append(Constraint(condition, f"{node.describe()}: {message}"))

    def dims_equal(self, node: Node, a: Dim, b: Dim, what: str) -> Dim:
        """Two dims that must be equal: checked now if static, at call time otherwise."""
        diff = sympy.sympify(a) - b
        # simplify takes seconds on nested floors (strided convs); most pairs are equal already
        if diff != 0 and sympy.expand(diff) != 0 and sympy.simplify(diff) != 0:
            self.require(node, sympy.Eq(a, b), f"{what}: {a} != {b}")
        return a if isinstance(a, int) else b

    def data_dim(self, node: Node, output: int, axis: int, bound: Dim) -> Dim:
        """The dim `axis` of output `output` that the node's data decides, at most `bound` (an
        expression of dims known before the node runs; see `ir.DataDim`). The node's lowering
        stores its value with `Emitter.set_dim`. A rule run again on a typed node (the IR
        verifier, lowerings) gets the symbol the node's output already has."""
        existing = _typed_dim(node, output, axis)
        if existing is not None:
            return existing
        if self.in_body:
            raise UnsupportedOpError(
                f"{node.describe()}: its output size depends on the data, which cuvil supports in "
                "the main graph only, not inside an If/Loop/Scan body; move the node out of the "
                "body")
        bound = simplify_dim(bound)
        if isinstance(bound, int) and bound == 0:
            return 0
        label = node.outputs[output].name if output < len(node.outputs) else node.describe()
        base = re.sub(r"\W", "_", f"{label}_{axis}")
        base = base if base[:1].isalpha() else f"n_{base}"
        taken = {s.name for s in self.graph.symbols} | {s.name for s in self.graph.data_dim_table}
        name, count = base, 1
        while name in taken or keyword.iskeyword(name):
            name, count = f"{base}_{count}", count + 1
        sym = data_symbol(name)
        self.graph.data_dim_table[sym] = DataDim(sym, bound, node.describe())
        return sym


def _typed_dim(node: Node, output: int, axis: int) -> Dim | None:
    """The data-dependent dim an already typed output has there (None when untyped)."""
    if output >= len(node.outputs):
        return None
    shape = node.outputs[output].type.shape
    d = shape[axis] if axis < len(shape) else None
    if isinstance(d, int):
        return d if d == 0 else None  # a bound of 0 types the dim 0
    return d if isinstance(d, sympy.Symbol) and not d.is_positive else None


class _Unchecked(InferContext):
    """For lowerings that recompute geometry their `infer` already checked."""

    def __init__(self) -> None:
        pass

    def require(self, node: Node, condition: Any, message: str) -> None:
        pass

    def dims_equal(self, node: Node, a: Dim, b: Dim, what: str) -> Dim:
        return a if isinstance(a, int) else b

    def data_dim(self, node: Node, output: int, axis: int, bound: Dim) -> Dim:
        existing = _typed_dim(node, output, axis)
        if existing is None:
            raise RuntimeError(f"{node.describe()}: output {output} is not typed yet")
        return existing


UNCHECKED: InferContext = _Unchecked()


#: a per-element body: fn(k, [the operands' elements, loaded]) -> the output element
ElementFn = Callable[["Emitter", list["ir.Value"]], "ir.Value"]


@dataclass(frozen=True)
class Element:
    """An elementwise node's loop body (`Op.element`): out[i] = fn(k, [operands' elements at
    i]) under numpy broadcasting, in the output's storage type (codegen's `emit_elementwise`
    runs it); `cost` is the work of one element in multiply-adds."""

    operands: list[Value]
    fn: ElementFn
    cost: int = 1


class Op:
    """One ONNX operator (from opset `since` on). Subclasses set `op_type` and implement both."""

    op_type: ClassVar[str]
    domain: ClassVar[str] = ""
    since: ClassVar[int] = 1
    #: output 0 holds the same bytes as input 0 (Reshape, Flatten, Identity...); the memory
    #: planner may then let them share storage and skip `lower`.
    is_view: ClassVar[bool] = False
    #: dtypes the lowering handles for its main inputs
    dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    #: set when the op is registered only to explain why cuvil cannot compile it (docs/ops.md)
    not_compiled: ClassVar[str] = ""

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        raise NotImplementedError

    def lower(self, node: Node, k: Emitter) -> None:
        raise NotImplementedError

    def expand(self, node: Node) -> onnx.FunctionProto | None:
        """For an op cuvil compiles as a graph of other ops (most of ai.onnx.ml): that graph,
        built for the node's attributes and input types, its inputs and outputs named in the
        op's order. The importer compiles it in the node's place; None (the default) means the
        op has a lowering of its own."""
        return None

    def scratch_bytes(self, node: Node) -> Dim:
        """Workspace bytes the lowering needs while it runs (`k.scratch` points there)."""
        return 0

    def aliases_input(self, node: Node) -> bool:
        """The node's output 0 holds the bytes of its input 0 as they are (`is_view` ops; a
        Transpose that only moves axes of size 1): the memory planner may let them share
        storage and skip `lower`."""
        return self.is_view

    def fusable(self, node: Node) -> bool:
        """The node computes each output element from the same element of its operands
        (broadcast): `element` describes it, and passes/fuse_elementwise.py may compute it in
        one loop with its neighbours."""
        return False

    def element(self, node: Node, k: Emitter) -> Element:
        """What a `fusable` node computes per output element."""
        raise NotImplementedError

    def path(self, node: Node) -> str:
        """Which of the op's implementations the node runs, when it has several ("winograd"):
        the profiler labels the node "Conv(winograd)"; "" for the only or usual one."""
        return ""

    def derived_bytes(self, node: Node) -> int:
        """Bytes of weights the node computes from its constants once, at the library's first
        run (codegen/derived.py), instead of storing them in the library; `k.derived` points
        there in `lower` and `lower_derived`."""
        return 0

    def derived_on_demand(self, node: Node) -> bool:
        """The node's derived weights are needed on some CPUs only (float32 copies of bf16
        weights, for CPUs without bf16 instructions): `lower_derived` decides at run time
        whether to fill them, and gives their memory its pages first (the runtime's populate)
        when it does; the first run populates only the others."""
        return False

    def derived_value(self, node: Node) -> np.ndarray | None:
        """The node's derived weights computed by the compiler, for the library to store
        instead of deriving them at its first run (None: derived at run time)."""
        return None

    def replaced_inputs(self, node: Node) -> tuple[int, ...]:
        """Input slots the node's derived weights replace: its run-time code never reads
        them (the library's first run lets go of their pages once every reader is done)."""
        return ()

    def lower_derived(self, node: Node, k: Emitter) -> None:
        """Fill `k.derived` (`derived_bytes` of them) from the node's constant inputs, whose
        pointers are in `k.buffers`. Runs once per process, before the first node."""
        raise NotImplementedError

    def check_dtypes(self, node: Node) -> None:
        for v in node.inputs[:1]:
            if v is not None and v.type.dtype.name not in self.dtypes:
                raise UnsupportedOpError(
                    f"{node.describe()}: input {v.name!r} has dtype {v.type.dtype.name}; cuvil "
                    f"compiles {node.op_type} for {', '.join(self.dtypes)} only"
                )


_REGISTRY: dict[tuple[str, str], list[Op]] = {}


def register(cls: type[Op]) -> type[Op]:
    """Class decorator: add an op implementation to the table."""
    impls = _REGISTRY.setdefault((cls.domain, cls.op_type), [])
    impls.append(cls())
    impls.sort(key=lambda op: op.since)
    return cls


def unregister(cls: type[Op]) -> None:
    """Remove what `register(cls)` added (ops that exist for one compile only)."""
    impls = _REGISTRY.get((cls.domain, cls.op_type), [])
    impls[:] = [o for o in impls if type(o) is not cls]
    if not impls:
        _REGISTRY.pop((cls.domain, cls.op_type), None)


def lookup(domain: str, op_type: str, opset: int) -> Op | None:
    """The implementation for a node of `op_type` in a model importing `domain` at `opset`."""
    domain = "" if domain == "ai.onnx" else domain
    found = None
    for op in _REGISTRY.get((domain, op_type), []):
        if op.since <= opset:
            found = op
    return found


def registered_ops() -> dict[tuple[str, str], list[Op]]:
    return dict(_REGISTRY)


def replaced_constants(graph: Graph, nodes: Container[Node]) -> dict[Value, Node]:
    """The constants that only derived weights of `nodes` read (in `Op.replaced_inputs`
    slots; no other slot of any node, not a graph output), each with its last such reader:
    the code of the model never touches them."""
    last: dict[Value, Node] = {}
    read: set[Value] = set(graph.outputs)
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset) if node in nodes else None
        replaced = op.replaced_inputs(node) if op is not None else ()
        for slot, v in enumerate(node.inputs):
            if v is not None and v.is_const and slot in replaced:
                last[v] = node
            elif v is not None:
                read.add(v)
    return {v: node for v, node in last.items() if v not in read}


# -- the node's ONNX schema -----------------------------------------------------------------


@functools.cache
def _schema(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        if opset > 0:
            return onnx.defs.get_schema(op_type, opset, domain)
        # nodes made by cuvil itself may carry no opset: the newest definition
        return onnx.defs.get_schema(op_type, domain)
    except onnx.defs.SchemaError:  # not in onnx (cuvil's own ops), or newer than the opset
        return None


def schema(node: Node) -> onnx.defs.OpSchema | None:
    """onnx's definition of the node's op at the node's opset (None when onnx has none)."""
    return _schema(node.domain, node.op_type, node.opset)


def required_input(node: Node, i: int) -> Value:
    """Input i, which the op cannot do without: a ModelError naming it when it is left out."""
    v = node.input(i)
    if v is None:
        s = schema(node)
        name = f" ({s.inputs[i].name})" if s is not None and i < len(s.inputs) else ""
        raise ModelError(f"{node.describe()}: input {i}{name} is required, but the model leaves "
                         "it out")
    return v


def attribute_value(a: onnx.AttributeProto) -> Any:
    """An attribute as cuvil's nodes hold it: text as str, tensors as numpy arrays."""
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    return v


_SCHEMA = object()


def attr(node: Node, name: str, default: Any = _SCHEMA) -> Any:
    """The node's attribute `name`; when it is not set, `default` if given (for defaults onnx
    states only in words, such as one stride per axis), else onnx's default for the node's op
    at its opset (None for an optional attribute without one). A required attribute the node
    lacks is a ModelError."""
    if name in node.attrs:
        return node.attrs[name]
    if default is not _SCHEMA:
        return default
    required, value = _attr_default(node.domain, node.op_type, node.opset, name)
    if required:
        raise ModelError(f"{node.describe()}: the {name!r} attribute is required; the node does "
                         "not set it")
    return copy.copy(value)


@functools.cache
def _attr_default(domain: str, op_type: str, opset: int, name: str) -> tuple[bool, Any]:
    """(required, default) of an attribute at the node's opset. One that a later version adds
    takes that version's default (what the older versions behaved as); one that another
    version has, or that the op has in no version (shared code reads it for several ops), is
    absent: None, as for any optional attribute without a default."""
    own = _schema(domain, op_type, opset)
    versions = _versions(domain, op_type)
    newer = [v for v in versions if own is None or v.since_version > own.since_version]
    for found in ([own] if own is not None else []) + newer[::-1]:
        spec = found.attributes.get(name)
        if spec is not None:
            undefined = spec.default_value.type == onnx.AttributeProto.UNDEFINED
            return (spec.required and found is own,
                    None if undefined else attribute_value(spec.default_value))
    return False, None


@functools.cache
def _versions(domain: str, op_type: str) -> tuple[onnx.defs.OpSchema, ...]:
    """Every version onnx defines of an op, newest first."""
    found: list[onnx.defs.OpSchema] = []
    version = _schema(domain, op_type, 0)
    while version is not None:
        found.append(version)
        version = (_schema(domain, op_type, version.since_version - 1)
                   if version.since_version > 1 else None)
    return tuple(found)


# -- helpers shared by shape rules ----------------------------------------------------------


def broadcast_shapes(node: Node, ctx: InferContext, *shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy-style (multidirectional) broadcasting, with symbolic dims checked at call time."""
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out: list[Dim] = []
    for axis in range(rank):
        dims = [s[axis] for s in padded]
        non_one = [d for d in dims if not (isinstance(d, int) and d == 1)]
        if not non_one:
            out.append(1)
            continue
        result = non_one[0]
        for d in non_one[1:]:
            if isinstance(result, int) and isinstance(d, int) and result != d:
                raise ModelError(
                    f"{node.describe()}: shapes {[list(s) for s in shapes]} do not broadcast "
                    f"(axis {axis}: {result} vs {d})"
                )
            # a symbolic dim against another dim: they must be equal at call time (a symbolic
            # dim that turns out to be 1 would broadcast in onnxruntime; cuvil asks for equality)
            result = ctx.dims_equal(node, result, d, f"broadcast axis {axis}")
        out.append(simplify_dim(result))
    return tuple(out)


def const_input(node: Node, i: int, what: str) -> np.ndarray | None:
    """The compile-time value of input i (None when absent); a clear error when not constant."""
    v: Value | None = node.input(i)
    if v is None:
        return None
    if v.const is None:
        raise UnsupportedOpError(
            f"{node.describe()}: input {i} ({what}, {v.name!r}) must be known at compile time; "
            "it is computed at run time in this model. Pin the model's symbolic input dims with "
            "`inputs = {...}` in [tool.cuvil.models.<name>] so it can be folded."
        )
    return v.const


def const_or_symbolic_input(node: Node, i: int, what: str) -> tuple[Dim, ...] | None:
    """The flattened elements of input i known at compile time (None when absent).

    Constants give ints (exact sympy numbers for floats); values computed from the input
    dims by shape arithmetic (``Concat(Shape(x)[0:1], [-1])``) give sympy expressions over
    the dim symbols (`Value.sym_value`). Anything that depends on tensor data is an error
    that names the node.
    """
    v: Value | None = node.input(i)
    if v is None:
        return None
    values = v.known_values()
    if values is None:
        source = f" by {v.producer.describe()}" if v.producer is not None else ""
        raise UnsupportedOpError(
            f"{node.describe()}: input {i} ({what}, {v.name!r}) must be known at compile time, "
            f"but it is computed at run time{source} from tensor data, not from the input dims "
            "alone. Pin the dims it depends on in the model's `inputs` (e.g. "
            "`inputs = { x = [1, 3, 224, 224] }` in [tool.cuvil.models.<name>]) so it folds to a "
            "constant, or re-export the model with a static value here."
        )
    return values


def compute_dtype(*dtypes: np.dtype | str) -> np.dtype:
    """The dtype arithmetic on operands of these dtypes runs in: the widest float among them,
    float16 widened to float32 (and rounded once on store), as onnxruntime computes; integer
    operands alone compute in their own (the first's) dtype."""
    floats = [np.dtype(d) for d in dtypes if np.dtype(d).kind == "f"]
    if not floats:
        return np.dtype(dtypes[0])
    widest = max(floats, key=lambda d: d.itemsize)
    return np.dtype(np.float32) if widest.itemsize < 4 else widest


def normalize_axis(node: Node, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise ModelError(f"{node.describe()}: axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _import_families() -> None:
    # Imported for their registrations; the order does not matter.
    from cuvil.compiler.ops import (  # noqa: F401
        attention,
        contrib,
        contrib_decoder,
        contrib_quantized,
        control,
        conv,
        deform_conv,
        detection,
        dynamic_matmul,
        einsum,
        elementwise,
        fused,
        gemm,
        indexing,
        linalg,
        ml_encoders,
        ml_linear,
        ml_svm,
        ml_trees,
        normalization,
        pool,
        quantize,
        random,
        recurrent,
        reduce,
        resize,
        sampling,
        selection,
        shape,
        spectral,
        text,
    )


_import_families()
use_shape_rules(lookup)  # Graph.verify re-runs these rules
