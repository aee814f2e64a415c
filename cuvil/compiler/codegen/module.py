"""Graph + memory plan -> one LLVM module exposing the model's C ABI.

Exported (default visibility), for a model named m:

    const char    cuvil_m_abi_checksum[65];              hex sha256 of the signature, NUL-ended
    int64_t       cuvil_m_workspace_size(const int64_t *dims);
    int32_t       cuvil_m_run(const void *const *inputs, void *const *outputs,
                              const int64_t *dims, void *workspace);
    int32_t       cuvil_m_run_profiled(..., void *workspace, uint64_t *timestamps_ns);

`run_profiled` is `run` that also stores the monotonic clock around every node (see
`_run_function`); `run` itself reads no clock, so profiling costs nothing when unused.

`dims` holds the values of the symbolic input dims in the signature's order, then one slot
per data-dependent dim (`ir.DataDim`, the signature's "data_dims"), which `run` fills: the node
that decides the dim stores it (`Emitter.set_dim`) before any later node reads it. Each node
becomes an internal function returning a status (nodes that would get the same code share
one: see `_SharedFunctions`); `run` calls them in order and stops at the
first non-zero status s, returning ``(node_index << 8) | s`` (see `cuvil.runtime`'s STATUS_*).
Weights live in a separate object (`__cuvil_m_weights`, hidden) made by the toolchain from
the raw blob, so big models never pass through LLVM IR text. Weights some nodes derive from
them (Winograd convs) are computed at the first run into .bss (see `derived`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from llvmlite import ir

from cuvil.compiler.codegen.derived import DerivedWeights, hide_derived
from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.kernels.emitter import (
    I8,
    I32,
    I64,
    PARALLEL_FOR,
    PARALLEL_THREADS,
    PTR,
    Emitter,
    guard_divisions,
)
from cuvil.compiler.kernels.objects import KernelSet
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.compiler.memory import MemoryPlan
from cuvil.compiler.ops import lookup
from cuvil.errors import ModelError
from cuvil.runtime import exported_symbol


def symbol_names(model: str) -> dict[str, str]:
    return {
        "checksum": exported_symbol(model, "abi_checksum"),
        "workspace_size": exported_symbol(model, "workspace_size"),
        "run": exported_symbol(model, "run"),
        "run_profiled": exported_symbol(model, "run_profiled"),
        "weights": f"__cuvil_{model}_weights",
        "derived": f"__cuvil_{model}_derived",
        "derived_state": f"__cuvil_{model}_derived_state",
    }


#: the exported functions that run the model (each CPU variant has a hidden copy of both)
ENTRY_POINTS = ("run", "run_profiled")

#: the runtime's monotonic clock in nanoseconds (cuvil/runtime/clock.c)
CLOCK_NS = "cuvil_clock_ns"


def variant_run_symbol(model: str, index: int, entry: str = "run") -> str:
    """The hidden `entry` (one of ENTRY_POINTS) of CPU variant `index`; the exported one
    dispatches to one of them."""
    return f"__cuvil_{model}_{entry}_{index}"


def build_module(graph: Graph, plan: MemoryPlan, model: str, checksum: str,
                 triple: str, data_layout: str, *, features: str = "",
                 variant: int | None = None, kernels: KernelSet | None = None) -> str:
    """The LLVM IR text of the model's library.

    With `variant`, this is one of several copies of the code for different CPU levels: its
    entry points are the hidden `variant_run_symbol(model, variant, entry)` and only variant 0
    defines the checksum and workspace-size symbols (a dispatcher defines the exported ones).
    With `kernels`, the module only declares the kernels it calls, and `kernels` collects them
    (kernels/objects.py: the driver compiles each once).
    """
    names = symbol_names(model)
    module = ir.Module(name=model)
    module.triple = triple
    module.data_layout = data_layout
    target = KernelTarget(triple, features)  # kernels size their tiles from it
    module.cuvil_kernels = kernels
    # the data-dependent dims' slots follow the input dims': their producers store them there
    symbols = [s.name for s in graph.symbols] + [d.symbol.name for d in graph.data_dims]
    primary = variant in (None, 0)
    hidden = []

    if primary:
        text = bytearray(checksum.encode() + b"\0")
        cs = ir.GlobalVariable(module, ir.ArrayType(I8, len(text)), names["checksum"])
        cs.initializer = ir.Constant(ir.ArrayType(I8, len(text)), text)
        cs.global_constant = True

    weights = None
    if plan.weights:
        weights = ir.GlobalVariable(module, ir.ArrayType(I8, 0), names["weights"])
        weights.linkage = "external"
        weights.global_constant = True

    if primary:
        # int64_t workspace_size(const int64_t *dims)
        ws_fn = ir.Function(module, ir.FunctionType(I64, [PTR]), names["workspace_size"])
        k = Emitter(module, ws_fn, ws_fn.args[0], symbols, {}, target)
        k.b.ret(k.dim(plan.workspace_size))

    derived = (DerivedWeights(module, target, graph, plan, names, weights, symbols,
                              primary=primary)
               if plan.derived_size else None)
    shared = _SharedFunctions()
    node_fns = [_node_function(module, target, graph, plan, i, symbols, shared)
                for i in range(len(graph.nodes))]

    for entry in ENTRY_POINTS:
        fn_name = names[entry] if variant is None else variant_run_symbol(model, variant, entry)
        if variant is not None:
            hidden.append(fn_name)
        _run_function(module, target, fn_name, graph, plan, node_fns, weights, derived, symbols,
                      profiled=entry == "run_profiled")

    guard_divisions(module)
    ir_text = hide_derived(hide_declarations(str(module), names["weights"], hidden,
                                             kernels.requests if kernels else ()), names)
    return dll_exports(ir_text, model) if "windows" in triple or "mingw" in triple else ir_text


def dll_exports(ir_text: str, model: str) -> str:
    """Mark dllexport what this module defines of the model's C ABI (`cuvil_<model>_*`): a
    DLL exports nothing else, having no visibility (and llvmlite writes no storage class on
    function definitions)."""
    prefix = re.escape(exported_symbol(model, ""))
    ir_text = re.sub(rf'^define (\S+) @"({prefix}\w+)"', r'define dllexport \1 @"\2"', ir_text,
                     flags=re.M)
    return re.sub(rf'^@"({prefix}\w+)" = constant', r'@"\1" = dllexport constant', ir_text,
                  flags=re.M)


def _run_function(module: ir.Module, target: KernelTarget, name: str, graph: Graph,
                  plan: MemoryPlan,
                  node_fns: list[ir.Function | None], weights: ir.GlobalVariable | None,
                  derived: DerivedWeights | None, symbols: list[str], *, profiled: bool) -> None:
    """`run`: the derived weights made ready, each node's function in order, then the copies
    into outputs. `profiled` adds a fifth argument, timestamps_ns[len(nodes) + 2]: the clock
    before the first node, after each node (a node without code repeats the previous value)
    and after the copies."""
    params = [PTR] * (5 if profiled else 4)
    run = ir.Function(module, ir.FunctionType(I32, params), name)
    inputs, outputs, dims, workspace = run.args[:4]
    k = Emitter(module, run, dims, symbols, {}, target)
    stamp = _stamper(module, k, run.args[4]) if profiled else _no_stamp
    if derived is not None:
        k.b.call(derived.prepare, [dims])

    def pointer(v: Value) -> ir.Value:
        s = plan.storage[v]
        if s.kind in ("input", "output"):
            table = inputs if s.kind == "input" else outputs
            slot = k.b.gep(table, [k.i64(s.index)], source_etype=PTR, inbounds=True)
            return k.b.load(slot, typ=PTR)
        if s.kind == "derived":
            assert derived is not None
            return derived.at(k.b, s.offset)
        base = weights if s.kind == "weights" else workspace
        return k.b.gep(base, [k.dim(s.offset)], source_etype=I8, inbounds=True)

    last = stamp(0)
    for index, (node, fn) in enumerate(zip(graph.nodes, node_fns)):
        if fn is None:
            stamp(index + 1, last)
            continue
        args = [pointer(v) for v in _buffers(node)]
        if node in plan.scratch:
            args.append(k.b.gep(workspace, [k.dim(plan.scratch[node])], source_etype=I8,
                                inbounds=True))
        if derived is not None and node in plan.derived:
            args.append(derived.pointer(k.b, node))
        elif node in plan.stored:  # derived by the compiler: in the blob
            args.append(k.b.gep(weights, [k.i64(plan.stored[node])], source_etype=I8,
                                inbounds=True))
        status = k.b.call(fn, [dims, *args])
        with k.b.if_then(k.b.icmp_signed("!=", status, ir.Constant(I32, 0)), likely=False):
            k.b.ret(k.b.or_(status, ir.Constant(I32, index << 8)))
        last = stamp(index + 1)
    for v, i in plan.output_copies:
        src = pointer(v)
        slot = k.b.gep(outputs, [k.i64(i)], source_etype=PTR, inbounds=True)
        if isinstance(v.type.nbytes, int) or not v.type.nbytes.free_symbols & graph.data_dim_table.keys():
            k.memcpy(k.b.load(slot, typ=PTR), src, k.dim(v.type.nbytes))
        else:  # `run` read the dims on entry, before the nodes stored the data-dependent ones
            k.b.call(_copy_function(k, v, symbols), [dims, k.b.load(slot, typ=PTR), src])
    stamp(len(graph.nodes) + 1)
    k.b.ret(ir.Constant(I32, 0))


def _copy_function(caller: Emitter, v: Value, symbols: list[str]) -> ir.Function:
    """copy(dims, dst, src): `v`'s bytes, counted from the dims when it is called."""
    module = caller.module
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR] * 3),
                     module.get_unique_name(f"copy_{v.name}"))
    fn.linkage = "internal"
    k = Emitter(module, fn, fn.args[0], symbols, {}, caller.target)
    k.memcpy(fn.args[1], fn.args[2], k.dim(v.type.nbytes))
    k.b.ret_void()
    return fn


def _no_stamp(slot: int, value: ir.Value | None = None) -> None:
    return None


def _stamper(module: ir.Module, k: Emitter,
             timestamps: ir.Value) -> Callable[..., ir.Value]:
    """stamp(slot, value=None): store the clock (or `value`) at timestamps[slot]; returns it."""
    clock = module.globals.get(CLOCK_NS) or ir.Function(module, ir.FunctionType(I64, []),
                                                        CLOCK_NS)

    def stamp(slot: int, value: ir.Value | None = None) -> ir.Value:
        value = value if value is not None else k.b.call(clock, [])
        k.b.store(value, k.b.gep(timestamps, [k.i64(slot)], source_etype=I64, inbounds=True))
        return value

    return stamp


def hide_declarations(ir_text: str, weights_symbol: str, functions: Sequence[str] = (),
                      kernels: Iterable[str] = ()) -> str:
    """Mark hidden the symbols other objects of the library define (weights, runtime,
    `kernels`) and the `functions` defined here that must not be exported.

    llvmlite cannot set visibility; hidden lets the code reach them directly instead of
    through the GOT/PLT, and keeps them out of the library's exports.
    """
    ir_text = (ir_text
               .replace(f'@"{weights_symbol}" = external constant',
                        f'@"{weights_symbol}" = external hidden constant')
               .replace(f'declare void @"{PARALLEL_FOR}"',
                        f'declare hidden void @"{PARALLEL_FOR}"')
               .replace(f'declare i32 @"{PARALLEL_THREADS}"()',
                        f'declare hidden i32 @"{PARALLEL_THREADS}"()')
               .replace(f'declare i64 @"{CLOCK_NS}"()', f'declare hidden i64 @"{CLOCK_NS}"()'))
    for name in functions:
        ir_text = ir_text.replace(f'define i32 @"{name}"', f'define hidden i32 @"{name}"')
    for name in kernels:  # (void, or i32: kernels/bf16_gemm.py's bf16_hardware)
        for ret in ("void", "i32"):
            ir_text = ir_text.replace(f'declare {ret} @"{name}"', f'declare hidden {ret} @"{name}"')
    return ir_text


def _buffers(node: Node) -> list[Value]:
    seen: list[Value] = []
    for v in [*node.inputs, *node.outputs]:
        if v is not None and v not in seen:
            seen.append(v)
    return seen


def _node_function(module: ir.Module, target: KernelTarget, graph: Graph, plan: MemoryPlan,
                   index: int,
                   symbols: list[str], shared: _SharedFunctions) -> ir.Function | None:
    node = graph.nodes[index]
    if node in plan.elided or node in plan.hoisted:  # hoisted: run by derived.py, once
        return None
    bufs = _buffers(node)
    scratch = node in plan.scratch
    derived = node in plan.derived or node in plan.stored
    noalias = _distinct(plan, bufs)
    key = _structure_key(node, bufs, (scratch, derived, noalias))
    found = shared.find(key, node)
    if found is not None:
        return found
    op = lookup(node.domain, node.op_type, node.opset)
    assert op is not None
    fn = ir.Function(module, ir.FunctionType(I32, [PTR] * (1 + len(bufs) + scratch + derived)),
                     f"node{index}_{node.op_type}")
    fn.linkage = "internal"
    # kept out of `run`: inlined, every node would land in one huge function whose
    # optimization time grows much faster than its size (a call per node costs nothing)
    fn.attributes.add("noinline")
    if noalias:
        for arg in fn.args[1:]:
            arg.add_attribute("noalias")
    k = Emitter(module, fn, fn.args[0], symbols, dict(zip(bufs, fn.args[1:])), target)
    k.scratch = fn.args[1 + len(bufs)] if scratch else None
    k.derived = fn.args[-1] if derived else None
    watched = _watch_constants(node)
    try:
        op.lower(node, k)
    except Exception as exc:
        raise ModelError(f"{node.describe()}: code generation failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        read_constants = _unwatch(watched)
    k.b.ret(ir.Constant(I32, 0))
    shared.add(key, node, fn, read_constants)
    return fn


class _Unshareable(Exception):
    """An attribute the structure key cannot hold (a subgraph): the node gets its own code."""


def _frozen(x: object) -> object:
    """A hashable stand-in for an attribute value, equal only for equal values and types."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_frozen(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((str(k), _frozen(v)) for k, v in x.items())))
    if isinstance(x, (float, np.generic)):  # by bits: -0.0 == 0.0, nan != nan
        return (type(x).__name__, np.asarray(x).tobytes())
    if isinstance(x, (int, str, bytes, type(None))):
        return (type(x).__name__, x)
    raise _Unshareable


def _structure_key(node: Node, bufs: list[Value], extra: tuple[object, ...]) -> object | None:
    """What a lowering can see of a node apart from its buffers' addresses (which are the
    function's arguments) and its constants' elements (`_SharedFunctions` adds those when
    the lowering reads them); None if the node must get its own function."""
    try:
        attrs = _frozen(node.attrs)
    except _Unshareable:
        return None

    def value(v: Value | None) -> object:
        if v is None:
            return None
        return (bufs.index(v), v.type, v.sym_value, v.const is not None)

    return (node.domain, node.op_type, node.opset, attrs, extra,
            tuple(value(v) for v in node.inputs), tuple(value(v) for v in node.outputs))


class _SharedFunctions:
    """Node functions by structure key, so that identical nodes are compiled once.

    A key's first lowering tells whether it read constant elements; if it did, later nodes
    with that key share its function only when their constants hold the same elements."""

    def __init__(self) -> None:
        self._functions: dict[object, ir.Function] = {}
        self._reads_constants: set[object] = set()

    @staticmethod
    def _with_constants(key: object, node: Node) -> object:
        return (key, tuple(None if v is None or v.const is None else _frozen(v.const)
                           for v in node.inputs))

    def find(self, key: object | None, node: Node) -> ir.Function | None:
        if key is None:
            return None
        if key in self._reads_constants:
            key = self._with_constants(key, node)
        return self._functions.get(key)

    def add(self, key: object | None, node: Node, fn: ir.Function, read_constants: bool) -> None:
        if key is None:
            return
        if read_constants:
            self._reads_constants.add(key)
            key = self._with_constants(key, node)
        self._functions[key] = fn


class _WatchedValue(Value):
    """A constant input while its node is lowered: reading `const` (the elements) is noted.
    `is_const` and `is_known` are part of the structure key, so they are not reads."""

    @property
    def const(self) -> np.ndarray | None:
        self.__dict__["_const_read"] = True
        const: np.ndarray | None = self.__dict__["const"]
        return const

    @const.setter
    def const(self, value: np.ndarray | None) -> None:
        self.__dict__["const"] = value

    @property
    def is_const(self) -> bool:
        return self.__dict__["const"] is not None

    @property
    def is_known(self) -> bool:
        return self.__dict__["const"] is not None or self.sym_value is not None


def _watch_constants(node: Node) -> list[Value]:
    watched = [v for v in node.inputs
               if v is not None and type(v) is Value and v.__dict__.get("const") is not None]
    for v in watched:
        v.__class__ = _WatchedValue
    return watched


def _unwatch(watched: list[Value]) -> bool:
    """Restore the values `_watch_constants` changed; True if the lowering read an element."""
    read = False
    for v in watched:
        v.__class__ = Value
        read = v.__dict__.pop("_const_read", False) or read
    return read


def _distinct(plan: MemoryPlan, bufs: list[Value]) -> bool:
    """True when no two buffers of the node can share memory (so `noalias` is truthful)."""
    places = [plan.storage[v] for v in bufs]
    return len(set(places)) == len(places)
