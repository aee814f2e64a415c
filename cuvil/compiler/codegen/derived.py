"""Weights derived from the model's constants at run time (Winograd's transformed conv weights,
4x the 3x3 kernels they come from), and the outputs of nodes computed from constants alone that
are too large to fold (`MemoryPlan.hoisted`): computed once per process, at the first run, so
that a library carries only the constants.

A library's derived weights live in one zero-initialised global (`derived` of
`module.symbol_names`), which the linker puts in .bss: it takes no file space, and memory only
as it is filled. The memory plan gives each node its offset there (`MemoryPlan.derived`); the
weights only some CPUs need (`Op.derived_on_demand`: the float32 copies of bf16 weights, for
CPUs without bf16 instructions) come last, past `MemoryPlan.derived_eager_size`, and their
nodes' `lower_derived` decides at run time whether to fill (and populate) their part.

`run` first calls `prepare`, which reads a state word. The first caller to swap it from EMPTY
to BUSY fills the buffer (each node's `Op.lower_derived`, parallel over the thread pool) and
publishes READY; callers that find it BUSY yield their CPU until it is READY. Only atomics on a
global: no TLS (reached through the dynamic loader in a dlopened library, see
runtime/threadpool.c) and no pthread_once (whose initial value is not zero on every OS).

x86_64 libraries carry several CPU variants of the model code: variant 0 defines the buffer
and the state word, the others refer to them, so a library has one of each.
"""

from __future__ import annotations

from llvmlite import ir

from cuvil.compiler.ir import Graph, Node, Value
from cuvil.compiler.kernels.emitter import I8, I32, POPULATE, PTR, RELEASE, Emitter
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.compiler.memory import MemoryPlan
from cuvil.compiler.ops import lookup, replaced_constants

#: values of the state word
EMPTY, BUSY, READY = 0, 1, 2
#: POSIX: give the CPU to the thread filling the buffer (Linux and macOS libcs have it)
SCHED_YIELD = "sched_yield"
# The runtime's populate(p, bytes) (cuvil/runtime/threadpool.c) gives the buffer its pages, in
# parallel and huge where the system allows, before the fill writes it: faulting in its
# megabytes one 4 KiB page at a time took about as long as computing them. Its release(p,
# bytes) lets the library's weights a derived weight replaced leave the resident memory once
# derived (VGG-19's 80 MB of 3x3 kernels, 4x their size in U).


class DerivedWeights:
    """The derived-weights buffer of one module and its `prepare(dims)` function."""

    def __init__(self, module: ir.Module, target: KernelTarget, graph: Graph, plan: MemoryPlan,
                 names: dict[str, str],
                 weights: ir.GlobalVariable | None, symbols: list[str], *, primary: bool) -> None:
        size = ir.ArrayType(I8, plan.derived_size)
        self.buffer = ir.GlobalVariable(module, size, names["derived"])
        self.state = ir.GlobalVariable(module, I32, names["derived_state"])
        for var, init in ((self.buffer, ir.Constant(size, None)), (self.state, ir.Constant(I32, EMPTY))):
            var.align = 64 if var is self.buffer else 4
            if primary:
                var.initializer = init
            else:
                var.linkage = "external"
        fill = _fill_function(module, target, graph, plan, self.buffer, weights, symbols)
        self.prepare = _prepare_function(module, self.state, self.buffer, plan.derived_eager_size,
                                         fill)
        self._offsets = plan.derived

    def pointer(self, b: ir.IRBuilder, node: Node) -> ir.Value:
        return self.at(b, self._offsets[node])

    def at(self, b: ir.IRBuilder, offset: int) -> ir.Value:
        return b.gep(self.buffer, [ir.Constant(ir.IntType(64), offset)], source_etype=I8,
                     inbounds=True)


def hide_derived(ir_text: str, names: dict[str, str]) -> str:
    """The buffer, the state word and the runtime's populate and release are the library's own: hidden (see
    module.hide_declarations)."""
    for sym in (names["derived"], names["derived_state"]):
        ir_text = (ir_text.replace(f'@"{sym}" = global', f'@"{sym}" = hidden global')
                   .replace(f'@"{sym}" = external global', f'@"{sym}" = external hidden global'))
    for fn in (POPULATE, RELEASE):
        ir_text = ir_text.replace(f'declare void @"{fn}"', f'declare hidden void @"{fn}"')
    return ir_text


def _fill_function(module: ir.Module, target: KernelTarget, graph: Graph, plan: MemoryPlan,
                   buffer: ir.GlobalVariable,
                   weights: ir.GlobalVariable | None, symbols: list[str]) -> ir.Function:
    """fill(dims): every node's `lower_derived`, in graph order (each in a function of its own)."""
    fill = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR]),
                       module.get_unique_name("derive_weights"))
    fill.linkage = "internal"
    fb = ir.IRBuilder(fill.append_basic_block("entry"))
    hoisted = set(plan.hoisted)
    released = _released_after(graph, plan)
    for index, node in enumerate(graph.nodes):
        if node not in plan.derived and node not in hoisted:
            continue
        # a hoisted node's lowering may leave with a status (`fail_if`): its function returns
        # one like every node's, which the fill ignores (its inputs are constants it accepts)
        ret = I32 if node in hoisted else ir.VoidType()
        fn = ir.Function(module, ir.FunctionType(ret, [PTR]),
                         module.get_unique_name(f"derive{index}_{node.op_type}"))
        fn.linkage = "internal"
        fn.attributes.add("noinline")
        k = Emitter(module, fn, fn.args[0], symbols, {}, target)
        for v in [*node.inputs, *node.outputs]:
            s = plan.storage.get(v) if v is not None else None
            if v is None or s is None:
                continue
            base = weights if s.kind == "weights" else buffer if s.kind == "derived" else None
            if base is not None:
                p = k.b.gep(base, [k.dim(s.offset)], source_etype=I8, inbounds=True)
                p.type = PTR  # an untyped pointer, as node functions' arguments are
                k.buffers[v] = p
        op = lookup(node.domain, node.op_type, node.opset)
        assert op is not None
        if node in hoisted:
            op.lower(node, k)
            k.b.ret(ir.Constant(I32, 0))
        else:
            k.derived = k.b.gep(buffer, [k.i64(plan.derived[node])], source_etype=I8,
                                inbounds=True)
            op.lower_derived(node, k)
            k.b.ret_void()
        fb.call(fn, [fill.args[0]])
        for v in released.get(node, ()):
            assert weights is not None
            release = module.globals.get(RELEASE) or ir.Function(
                module, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(64)]), RELEASE)
            at = fb.gep(weights, [ir.Constant(ir.IntType(64), plan.storage[v].offset)],
                        source_etype=I8, inbounds=True)
            fb.call(release, [at, ir.Constant(ir.IntType(64), int(v.type.nbytes))])
    fb.ret_void()
    return fill


def _released_after(graph: Graph, plan: MemoryPlan) -> dict[Node, list[Value]]:
    """The library's weights that only derived weights read (`replaced_constants`), by the
    node after whose fill none reads them. Dropping pages of the library's file is always
    safe (touched again, they are read again): this only picks the ones nothing touches."""
    out: dict[Node, list[Value]] = {}
    for v, node in replaced_constants(graph, plan.derived).items():
        out.setdefault(node, []).append(v)
    return out


def _i32(n: int) -> ir.Constant:
    return ir.Constant(I32, n)


def _prepare_function(module: ir.Module, state: ir.GlobalVariable, buffer: ir.GlobalVariable,
                      size: int, fill: ir.Function) -> ir.Function:
    """prepare(dims): returns once the buffer is READY, filling it if this caller is the first
    (its first `size` bytes populated first)."""
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR]),
                     module.get_unique_name("prepare_derived"))
    fn.linkage = "internal"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    done = fn.append_basic_block("done")
    claim = fn.append_basic_block("claim")
    wait = fn.append_basic_block("wait")
    ready = b.load_atomic(state, "acquire", 4, typ=I32)
    b.cbranch(b.icmp_unsigned("==", ready, _i32(READY)), done, claim)
    b.position_at_end(claim)
    won = b.extract_value(b.cmpxchg(state, _i32(EMPTY), _i32(BUSY), "acq_rel", "acquire"), 1)
    with b.if_then(won):
        if size:  # (the on-demand part past it: see the module docstring)
            populate = module.globals.get(POPULATE) or ir.Function(
                module, ir.FunctionType(ir.VoidType(), [PTR, ir.IntType(64)]), POPULATE)
            b.call(populate, [buffer, ir.Constant(ir.IntType(64), size)])
        b.call(fill, [fn.args[0]])
        b.store_atomic(_i32(READY), state, "release", 4)
        b.branch(done)
    b.branch(wait)
    b.position_at_end(wait)
    yield_fn = module.globals.get(SCHED_YIELD) or ir.Function(module, ir.FunctionType(I32, []),
                                                              SCHED_YIELD)
    b.call(yield_fn, [])
    ready = b.load_atomic(state, "acquire", 4, typ=I32)
    b.cbranch(b.icmp_unsigned("==", ready, _i32(READY)), done, wait)
    b.position_at_end(done)
    b.ret_void()
    return fn
