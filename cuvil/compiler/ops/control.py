"""Control flow: If, Loop and Scan, whose bodies are subgraphs run inside the node's function.

The importer decides what it can at compile time: an If on a known condition is replaced by
the branch it takes, and a Loop whose body needs its iteration number as a constant is
unrolled (`cuvil.compiler.frontend.importer`). What remains is compiled here.

Each body is a cuvil `Graph` typed like the model. Its formal inputs (iteration number,
carried values, scan slices) are values of its own; the values of enclosing scopes and the
constants it reads are its *free values*, which `SubgraphOp.attach` appends to the node's
inputs so that memory planning, liveness and dead-code elimination see them (and constants
land in the weights blob). The node's lowering runs a body the way the model's `run` runs
the top graph: one LLVM function per body node, called in order, with the body planned by
`plan_memory` as if it were a model whose inputs are its formal inputs and free values and
whose workspace is part of the node's scratch memory. Body outputs are written straight to
where they belong: the If node's outputs, the next copy of double-buffered loop-carried
values, or the current iteration's slice of a scan output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import onnx
import sympy
from llvmlite import ir

from cuvil.compiler.ir import DTYPES, Dim, Graph, Node, TensorType, Value, dim_str, simplify_dim
from cuvil.compiler.kernels.emitter import I8, I32, I64, PTR, Emitter, View
from cuvil.compiler.memory import MemoryPlan
from cuvil.compiler.ops import InferContext, Op, lookup, normalize_axis, register, required_input
from cuvil.errors import CuvilError, ModelError, UnsupportedOpError

__all__ = ["PLANS", "If", "Loop", "Scan", "SubgraphOp", "free_values", "known_flag", "planning_graph"]

ALIGN = 64
#: node attribute holding how many of the node's inputs are its ONNX inputs (the rest are
#: the free values of its bodies)
FORMAL = "cuvil_formal_inputs"
#: node attribute holding each body's MemoryPlan by attribute name; `plan_memory` sets it, planning
#: the bodies before the graph around them
PLANS = "cuvil_body_plans"


def _aligned(size: Dim) -> Dim:
    if isinstance(size, int):
        return -(-size // ALIGN) * ALIGN
    return simplify_dim(ALIGN * sympy.ceiling(sympy.sympify(size) / ALIGN))


def _max(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return simplify_dim(sympy.Max(a, b))


def _same_shape(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    return len(a) == len(b) and all(sympy.simplify(sympy.sympify(x) - y) == 0 for x, y in zip(a, b))


def _shape_str(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(dim_str(d)) for d in shape) + "]"


def known_flag(v: Value | None) -> bool | None:
    """The truth of a one-element condition known at compile time, else None."""
    if v is None:
        return None
    known = v.known_values()
    if known is None or len(known) != 1 or not sympy.sympify(known[0]).is_number:
        return None
    return bool(known[0])


def free_values(body: Graph) -> list[Value]:
    """Values `body` reads (or returns) that it neither takes as input nor produces: values of
    enclosing scopes and constants, in first-use order."""
    produced = set(body.inputs)
    for n in body.nodes:
        produced.update(n.outputs)
    free: list[Value] = []
    for v in [*(v for n in body.nodes for v in n.inputs), *body.outputs]:
        if v is not None and v not in produced and v not in free:
            free.append(v)
    return free


class SubgraphOp(Op):
    """An op with graph attributes. The importer turns each (`graph_attrs`) into a typed
    `Graph` whose formal inputs hold what `bind_subgraph` says, then calls `attach`."""

    graph_attrs: ClassVar[tuple[str, ...]] = ()
    dtypes = DTYPES

    def bind_subgraph(self, node: Node, attr: str,
                      proto: onnx.GraphProto) -> list[TensorType | np.ndarray]:
        """What each formal input of body `attr` holds: a run-time value of a type, or a
        constant."""
        return []

    def attach(self, node: Node, bodies: dict[str, Graph]) -> None:
        """Store the typed bodies on the node and append their free values to its inputs.
        (The passes rewrite bodies later, then call `captures` again.)"""
        node.attrs[FORMAL] = len(node.inputs)
        node.attrs.update(bodies)
        node.inputs += self.captures(node)

    def captures(self, node: Node) -> list[Value]:
        """The free values of the node's bodies that are not among its formal inputs: the
        inputs `attach` appends after the formal ones, in first-use order."""
        formal = self.formal(node)
        captured: list[Value] = []
        for body in self.bodies(node):
            for v in free_values(body):
                if v not in formal and v not in captured:
                    captured.append(v)
        return captured

    def bodies(self, node: Node) -> list[Graph]:
        return [node.attrs[a] for a in self.graph_attrs]

    def formal(self, node: Node) -> list[Value | None]:
        return node.inputs[:node.attrs.get(FORMAL, len(node.inputs))]


# -- running a body inside a node's function --------------------------------------------------


@dataclass
class _Body:
    """A body with its storage: inputs are its formal inputs then its free values."""

    graph: Graph
    free: list[Value]
    plan: MemoryPlan

    @property
    def workspace(self) -> Dim:
        return self.plan.workspace_size


def planning_graph(body: Graph) -> Graph:
    """`body` as memory planning sees it: a model whose inputs are its formal inputs, then its
    free values (the order `_run_body` passes them in)."""
    shell = Graph(body.name)
    shell.inputs = [*body.inputs, *free_values(body)]
    shell.outputs = list(body.outputs)
    shell.nodes = list(body.nodes)
    return shell


def _plan(node: Node, attr: str) -> _Body:
    body = node.attrs[attr]
    plan = node.attrs[PLANS][attr]
    assert not plan.weights, "body constants are free values, stored with the model's weights"
    return _Body(body, free_values(body), plan)


def _operands(node: Node) -> list[Value]:
    seen: list[Value] = []
    for v in [*node.inputs, *node.outputs]:
        if v is not None and v not in seen:
            seen.append(v)
    return seen


def _byte_ptr(k: Emitter, base: ir.Value, offset: Dim | ir.Value) -> ir.Value:
    return k.b.gep(base, [k.dim(offset)], source_etype=I8, inbounds=True)


def _run_body(k: Emitter, body: _Body, inputs: Sequence[ir.Value], outputs: Sequence[ir.Value],
              workspace: ir.Value | None, tag: str) -> None:
    """Emit, at the builder's position, one run of `body`: `inputs` point at its formal inputs,
    `outputs` at where its outputs go, `workspace` at its scratch (`body.workspace` bytes).
    A body node's failure status leaves the enclosing function with that status."""
    plan = body.plan
    formal = list(inputs)
    free = []
    for v in body.free:
        if v not in k.buffers:
            raise AssertionError(f"{body.graph.name}: free value {v.name!r} is not an input of "
                                 "the node running the body")
        free.append(k.buffers[v])
    ins = [*formal, *free]

    def pointer(v: Value) -> ir.Value:
        s = plan.storage[v]
        if s.kind == "input":
            return ins[s.index]
        if s.kind == "output":
            return outputs[s.index]
        assert s.kind == "workspace" and workspace is not None
        return _byte_ptr(k, workspace, s.offset)

    for index, node in enumerate(body.graph.nodes):
        if node in plan.elided:
            continue
        fn = _body_node_function(k, body, node, f"{k.function.name}.{tag}.node{index}_{node.op_type}")
        args = [k.dims_ptr, *[pointer(v) for v in _operands(node)]]
        if node in plan.scratch:
            assert workspace is not None
            args.append(_byte_ptr(k, workspace, plan.scratch[node]))
        status = k.b.call(fn, args)
        with k.b.if_then(k.b.icmp_signed("!=", status, ir.Constant(I32, 0)), likely=False):
            k.b.ret(status)
    for v, i in plan.output_copies:
        k.memcpy(outputs[i], pointer(v), k.dim(v.type.nbytes))


def _body_node_function(k: Emitter, body: _Body, node: Node, name: str) -> ir.Function:
    op = lookup(node.domain, node.op_type, node.opset)
    assert op is not None
    bufs = _operands(node)
    scratch = node in body.plan.scratch
    fn = ir.Function(k.module, ir.FunctionType(I32, [PTR] * (1 + len(bufs) + scratch)),
                     k.module.get_unique_name(name))
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    # a body node writes only its outputs (body outputs or body workspace), which share no
    # memory with anything else it is given; inputs that alias each other are only read
    places = [body.plan.storage[v] for v in bufs]
    if len(set(places)) == len(places):
        for arg in fn.args[1:]:
            arg.add_attribute("noalias")
    sub = Emitter(k.module, fn, fn.args[0], k.symbols, dict(zip(bufs, fn.args[1:])), k.target)
    sub.scratch = fn.args[-1] if scratch else None
    try:
        op.lower(node, sub)
    except CuvilError:
        raise
    except Exception as exc:
        raise ModelError(f"{node.describe()} (in {body.graph.name}): code generation failed: "
                         f"{type(exc).__name__}: {exc}") from exc
    sub.b.ret(ir.Constant(I32, 0))
    return fn


# -- If ---------------------------------------------------------------------------------------


@register
class If(SubgraphOp):
    """An If whose condition is only known at run time (the importer inlines the others):
    both branches are compiled and must agree on their outputs' dtypes and shapes."""

    op_type = "If"
    graph_attrs = ("then_branch", "else_branch")

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        cond = node.inputs[0]
        assert cond is not None
        if cond.type.dtype != np.bool_ or cond.type.numel != 1:
            raise ModelError(f"{node.describe()}: the condition {cond.name!r} must be a bool "
                             f"tensor of one element, not {cond.type}")
        then, other = self.bodies(node)
        if not (len(then.outputs) == len(other.outputs) == len(node.outputs)):
            raise ModelError(f"{node.describe()}: then_branch has {len(then.outputs)} outputs, "
                             f"else_branch {len(other.outputs)}, the node {len(node.outputs)}")
        types = []
        for i, (a, b) in enumerate(zip(then.outputs, other.outputs)):
            if a.type.dtype != b.type.dtype or not _same_shape(a.type.shape, b.type.shape):
                raise UnsupportedOpError(
                    f"{node.describe()}: output {i} is {a.type} in then_branch but {b.type} in "
                    "else_branch, and the condition is only known at run time; cuvil needs both "
                    "branches of a run-time If to produce the same dtypes and shapes (pin the "
                    "model's input dims, or re-export with a condition known from shapes)")
            types.append(a.type)
        return types

    def scratch_bytes(self, node: Node) -> Dim:
        then, other = (_plan(node, a) for a in self.graph_attrs)
        return _max(then.workspace, other.workspace)

    def lower(self, node: Node, k: Emitter) -> None:
        then, other = (_plan(node, a) for a in self.graph_attrs)
        cond = k.b.load(k.buffers[required_input(node, 0)], typ=I8)
        outs = [k.buffers[v] for v in node.outputs]
        with k.b.if_else(k.b.icmp_unsigned("!=", cond, ir.Constant(I8, 0))) as (yes, no):
            with yes:
                _run_body(k, then, [], outs, k.scratch, "then")
            with no:
                _run_body(k, other, [], outs, k.scratch, "else")


# -- Loop and Scan ----------------------------------------------------------------------------


@dataclass
class _Layout:
    """The scratch of a loop node: fixed slots, carried values twice, then the body's workspace."""

    body: _Body
    iter_slot: Dim
    cond_slot: Dim
    #: per carried value: the offsets of its two copies
    carried: list[tuple[Dim, Dim]]
    #: offsets of per-iteration buffers (scan slices not on axis 0), by name
    slots: dict[str, Dim]
    workspace: Dim
    size: Dim


def _layout(planned: _Body, carried: Sequence[TensorType],
            slots: Sequence[tuple[str, TensorType]] = ()) -> _Layout:
    offset: Dim = 0

    def take(nbytes: Dim) -> Dim:
        nonlocal offset
        at = offset
        offset = simplify_dim(offset + _aligned(nbytes))
        return at

    iter_slot = take(8)
    cond_slot = take(1)
    pairs = [(take(t.nbytes), take(t.nbytes)) for t in carried]
    named = {name: take(t.nbytes) for name, t in slots}
    workspace = take(planned.workspace)
    return _Layout(planned, iter_slot, cond_slot, pairs, named, workspace, offset)


class _Iterations:
    """Emits `for i in range(trip) while go: body` with double-buffered carried values.

    `carried_in(i)` / `carried_out(i)` point at the copies of the carried values iteration i
    reads and writes (the two copies alternate); `finish(count, outputs)` copies the values
    the last iteration wrote (the initial ones after no iteration) to `outputs`.
    """

    def __init__(self, k: Emitter, lay: _Layout, carried: Sequence[TensorType]) -> None:
        assert k.scratch is not None
        self.k = k
        self.lay = lay
        self.types = list(carried)
        self.a = [_byte_ptr(k, k.scratch, a) for a, _ in lay.carried]
        self.b = [_byte_ptr(k, k.scratch, b) for _, b in lay.carried]

    def init(self, initial: Sequence[ir.Value]) -> None:
        for dst, src, t in zip(self.a, initial, self.types):
            self.k.memcpy(dst, src, self.k.dim(t.nbytes))

    def pick(self, parity: ir.Value, first: list[ir.Value], second: list[ir.Value]) -> list[ir.Value]:
        odd = self.k.b.icmp_unsigned("!=", parity, self.k.i64(0))
        return [self.k.b.select(odd, y, x) for x, y in zip(first, second)]

    def carried_in(self, i: ir.Value) -> list[ir.Value]:
        return self.pick(self.k.b.and_(i, self.k.i64(1)), self.a, self.b)

    def carried_out(self, i: ir.Value) -> list[ir.Value]:
        return self.pick(self.k.b.and_(i, self.k.i64(1)), self.b, self.a)

    def run(self, trip: ir.Value, go: ir.Value | None,
            step: Callable[[ir.Value], ir.Value | None]) -> ir.Value:
        """Emit the loop; `step(i) -> ir.Value | None` emits one iteration and returns whether
        to go on (None: always). Returns the number of iterations run."""
        k = self.k
        b = k.b
        pre = b.block
        head = k.function.append_basic_block("loop.head")
        body = k.function.append_basic_block("loop.body")
        done = k.function.append_basic_block("loop.done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name="iter")
        i.add_incoming(k.i64(0), pre)
        flag = None
        if go is not None:
            flag = b.phi(ir.IntType(1), name="go")
            flag.add_incoming(go, pre)
        more = b.icmp_signed("<", i, trip)
        if flag is not None:
            more = b.and_(more, flag)
        b.cbranch(more, body, done)
        b.position_at_end(body)
        keep_going = step(i)
        nxt = b.add(i, k.i64(1))
        i.add_incoming(nxt, b.block)
        if flag is not None:
            flag.add_incoming(keep_going if keep_going is not None else ir.Constant(ir.IntType(1), 1),
                              b.block)
        b.branch(head)
        b.position_at_end(done)
        return i

    def finish(self, count: ir.Value, outputs: Sequence[ir.Value]) -> None:
        for dst, src, t in zip(outputs, self.carried_in(count), self.types):
            self.k.memcpy(dst, src, self.k.dim(t.nbytes))


@register
class Loop(SubgraphOp):
    """A Loop with loop-carried values of fixed shape. Scan outputs need a trip count known at
    compile time (constant or from input dims) and a condition that never stops the loop early;
    without scan outputs the trip count and condition may be run-time values (a while loop)."""

    op_type = "Loop"
    graph_attrs = ("body",)

    def bind_subgraph(self, node: Node, attr: str,
                      proto: onnx.GraphProto) -> list[TensorType | np.ndarray]:
        carried = self.formal(node)[2:]
        if len(proto.input) != 2 + len(carried):
            raise ModelError(f"{node.describe()}: the body takes {len(proto.input)} inputs; "
                             f"expected 2 + {len(carried)} (iteration number, condition, "
                             "loop-carried values)")
        if any(v is None for v in carried):
            raise ModelError(f"{node.describe()}: a loop-carried initial value is missing")
        # the body runs only while the condition holds: its condition input is always true
        return [TensorType(np.dtype(np.int64), ()), np.array(True),
                *[v.type for v in carried if v is not None]]

    def _parts(self, node: Node) -> tuple[Value | None, Value | None, list[Value], Graph, int]:
        formal = self.formal(node)
        m, cond = [*formal, None, None][:2]
        carried = [v for v in formal[2:] if v is not None]
        body: Graph = node.attrs["body"]
        return m, cond, carried, body, len(body.outputs) - 1 - len(carried)

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        m, cond, carried, body, k_scan = self._parts(node)
        n = len(carried)
        if k_scan < 0 or len(node.outputs) != n + k_scan:
            raise ModelError(f"{node.describe()}: the body returns {len(body.outputs)} values and "
                             f"the node has {len(node.outputs)} outputs; expected 1 + {n} + K and "
                             f"{n} + K for {n} loop-carried values and K scan outputs")
        if m is not None and (m.type.dtype != np.int64 or m.type.numel != 1):
            raise ModelError(f"{node.describe()}: the trip count M must be one int64, not {m.type}")
        if cond is not None and (cond.type.dtype != np.bool_ or cond.type.numel != 1):
            raise ModelError(f"{node.describe()}: the condition must be one bool, not {cond.type}")
        cond_out = body.outputs[0]
        if cond_out.type.dtype != np.bool_ or cond_out.type.numel != 1:
            raise ModelError(f"{node.describe()}: the body's condition output must be one bool, "
                             f"not {cond_out.type}")
        for j, (init, out) in enumerate(zip(carried, body.outputs[1:])):
            if init.type.dtype != out.type.dtype or not _same_shape(init.type.shape, out.type.shape):
                raise UnsupportedOpError(
                    f"{node.describe()}: loop-carried value {j} ({init.name!r}) enters the loop "
                    f"as {init.type} but the body returns {out.type}; cuvil compiles loops whose "
                    "carried values keep their dtype and shape (a loop with a small trip count "
                    "known at compile time is unrolled instead)")
        if m is None and known_flag(cond_out):
            raise ModelError(f"{node.describe()}: the loop has no trip count and its condition "
                             "stays true: it never ends")
        types = [v.type for v in carried]
        if k_scan:
            types += [TensorType(s.type.dtype, (self._trip(node), *s.type.shape))
                      for s in body.outputs[1 + n:]]
        return types

    def _trip(self, node: Node) -> Dim:
        """The iteration count when known at compile time (needed by scan outputs)."""
        m, cond, _, body, _ = self._parts(node)
        first, always = known_flag(cond), known_flag(body.outputs[0])
        if cond is not None and first is False:
            return 0
        if m is None or m.known_values() is None:
            raise UnsupportedOpError(
                f"{node.describe()}: the loop has scan outputs, whose length is its iteration "
                "count, but the trip count M is " + ("absent" if m is None else
                                                     f"computed at run time ({m.name!r})")
                + "; cuvil needs it known at compile time (a constant, or computed from input "
                "dims) so that output shapes follow from input shapes")
        if cond is not None and first is None:
            raise UnsupportedOpError(
                f"{node.describe()}: the loop has scan outputs but its initial condition "
                f"{cond.name!r} is computed at run time, so the number of iterations (their "
                "length) would depend on data; make the condition a constant")
        if not always:
            raise UnsupportedOpError(
                f"{node.describe()}: the loop has scan outputs but its body's condition "
                f"{body.outputs[0].name!r} is computed at run time, so the number of iterations "
                "(their length) would depend on data; cuvil compiles such a loop only without "
                "scan outputs")
        known = m.known_values()
        assert known is not None
        return simplify_dim(sympy.Max(known[0], 0))

    def _layout(self, node: Node) -> _Layout:
        _, _, carried, _, _ = self._parts(node)
        return _layout(_plan(node, "body"), [v.type for v in carried])

    def scratch_bytes(self, node: Node) -> Dim:
        return self._layout(node).size

    def lower(self, node: Node, k: Emitter) -> None:
        m, cond, carried, body, k_scan = self._parts(node)
        n = len(carried)
        lay = self._layout(node)
        assert k.scratch is not None
        b = k.b
        if k_scan:
            trip = k.dim(self._trip(node))
        elif m is None:
            trip = k.i64(2**63 - 1)
        elif m.is_known:
            trip = k.dim(sympy.Max(m.known_values()[0], 0))  # type: ignore[index]
        else:
            trip = b.load(k.buffers[m], typ=I64)
        go: ir.Value | None = None
        first = known_flag(cond)
        if cond is not None and first is None:
            go = b.icmp_unsigned("!=", b.load(k.buffers[cond], typ=I8), ir.Constant(I8, 0))
        elif cond is not None and not first:
            trip = k.i64(0)
        always = known_flag(body.outputs[0])
        if go is None and not always:
            go = ir.Constant(ir.IntType(1), 1)

        loop = _Iterations(k, lay, [v.type for v in carried])
        loop.init([k.buffers[v] for v in carried])
        iter_ptr = _byte_ptr(k, k.scratch, lay.iter_slot)
        cond_ptr = _byte_ptr(k, k.scratch, lay.cond_slot)
        workspace = _byte_ptr(k, k.scratch, lay.workspace)
        # a scan output's rows: one per iteration, as the body returns them
        scans = [(k.buffers[v], s.type.nbytes) for v, s in zip(node.outputs[n:], body.outputs[1 + n:])]

        def step(i: ir.Value) -> ir.Value | None:
            b.store(i, iter_ptr)
            outs = [cond_ptr, *loop.carried_out(i)]
            for base, row in scans:
                outs.append(b.gep(base, [b.mul(i, k.dim(row))], source_etype=I8, inbounds=True))
            _run_body(k, lay.body, [iter_ptr, *loop.carried_in(i)], outs, workspace, "body")
            if always:
                return None
            return b.icmp_unsigned("!=", b.load(cond_ptr, typ=I8), ir.Constant(I8, 0))

        count = loop.run(trip, go, step)
        loop.finish(count, [k.buffers[v] for v in node.outputs[:n]])


@dataclass
class _ScanSide:
    """One scan input or output: the per-iteration slice type, its axis and direction."""

    value: Value  # the node's input or output
    slice: TensorType
    axis: int
    reverse: bool


class _ScanBase(SubgraphOp):
    graph_attrs = ("body",)
    #: whether the first axis of every state and scan tensor is a batch (Scan-8)
    batched: ClassVar[bool] = False

    def _split(self, node: Node) -> tuple[Value | None, list[Value], list[Value]]:
        """(sequence_lens, states, scan inputs) of the node's ONNX inputs."""
        formal = self.formal(node)
        lens = formal[0] if self.batched else None
        formal = formal[1:] if self.batched else formal
        if any(v is None for v in formal):
            raise ModelError(f"{node.describe()}: Scan inputs cannot be left out")
        m = int(node.attrs.get("num_scan_inputs", 0))
        if not 0 < m <= len(formal):
            raise ModelError(f"{node.describe()}: num_scan_inputs = {m} for {len(formal)} inputs")
        values: list[Value] = formal  # type: ignore[assignment]
        return lens, values[:len(values) - m], values[len(values) - m:]

    def _inputs(self, node: Node) -> tuple[list[Value], list[_ScanSide]]:
        _, states, scans = self._split(node)
        m = len(scans)
        if self.batched:
            axes, dirs = [0] * m, [int(d) for d in node.attrs.get("directions", [0] * m)]
        else:
            axes = [int(a) for a in node.attrs.get("scan_input_axes", [0] * m)]
            dirs = [int(d) for d in node.attrs.get("scan_input_directions", [0] * m)]
        if len(axes) != m or len(dirs) != m:
            raise ModelError(f"{node.describe()}: the scan input axes/directions need {m} entries")
        sides = []
        for v, a, d in zip(scans, axes, dirs):
            shape = v.type.shape[1:] if self.batched else v.type.shape
            a = normalize_axis(node, a, len(shape))
            sides.append(_ScanSide(v, TensorType(v.type.dtype, shape[:a] + shape[a + 1:]), a, bool(d)))
        return states, sides

    def _state_type(self, v: Value) -> TensorType:
        return TensorType(v.type.dtype, v.type.shape[1:]) if self.batched else v.type

    def bind_subgraph(self, node: Node, attr: str,
                      proto: onnx.GraphProto) -> list[TensorType | np.ndarray]:
        states, sides = self._inputs(node)
        if self.batched and any(v.type.rank < 1 for v in states):
            raise ModelError(f"{node.describe()}: Scan-8 states need a batch axis")
        if len(proto.input) != len(states) + len(sides):
            raise ModelError(f"{node.describe()}: the body takes {len(proto.input)} inputs for "
                             f"{len(states)} states and {len(sides)} scan inputs")
        return [*[self._state_type(v) for v in states], *[side.slice for side in sides]]

    def _outputs(self, node: Node) -> list[_ScanSide]:
        states, _ = self._inputs(node)
        body: Graph = node.attrs["body"]
        k_scan = len(body.outputs) - len(states)
        if k_scan < 0 or len(node.outputs) != len(body.outputs):
            raise ModelError(f"{node.describe()}: the body returns {len(body.outputs)} values for "
                             f"{len(states)} states; the node has {len(node.outputs)} outputs")
        if self.batched:
            axes, dirs = [0] * k_scan, [0] * k_scan
        else:
            axes = [int(a) for a in node.attrs.get("scan_output_axes", [0] * k_scan)]
            dirs = [int(d) for d in node.attrs.get("scan_output_directions", [0] * k_scan)]
        if len(axes) != k_scan or len(dirs) != k_scan:
            raise ModelError(f"{node.describe()}: scan_output_axes/directions need {k_scan} entries")
        return [_ScanSide(y, v.type, normalize_axis(node, a, v.type.rank + 1), bool(d))
                for y, v, a, d in zip(node.outputs[len(states):], body.outputs[len(states):],
                                      axes, dirs)]

    def _length(self, node: Node, ctx: InferContext) -> Dim:
        _, sides = self._inputs(node)
        off = 1 if self.batched else 0
        length = sides[0].value.type.shape[sides[0].axis + off]
        for side in sides[1:]:
            length = ctx.dims_equal(node, length, side.value.type.shape[side.axis + off],
                                    "scan input lengths")
        return length

    def infer(self, node: Node, ctx: InferContext) -> list[TensorType]:
        lens, states, sides = self._split(node)[0], *self._inputs(node)
        body: Graph = node.attrs["body"]
        batch: Dim = 1
        if self.batched:
            batch = states[0].type.shape[0] if states else sides[0].value.type.shape[0]
            for v in [*states, *(side.value for side in sides)]:
                batch = ctx.dims_equal(node, batch, v.type.shape[0], "batch sizes")
        for j, (init, out) in enumerate(zip(states, body.outputs)):
            t = self._state_type(init)
            if t.dtype != out.type.dtype or not _same_shape(t.shape, out.type.shape):
                raise UnsupportedOpError(
                    f"{node.describe()}: state {j} ({init.name!r}) enters as {t} but the "
                    f"body returns {out.type}; cuvil compiles Scan states of fixed shape")
        length = self._length(node, ctx)
        if lens is not None:
            known = lens.known_values()
            if known is None or any(sympy.simplify(sympy.sympify(x) - length) != 0 for x in known):
                raise UnsupportedOpError(
                    f"{node.describe()}: sequence_lens ({lens.name!r}) must be a constant equal "
                    f"to the scan length {dim_str(length)} for every batch entry; cuvil does not "
                    "compile Scan-8 over sequences of different lengths")
        types = [v.type for v in states]
        for side in self._outputs(node):
            s = side.slice.shape
            shape = (*s[:side.axis], length, *s[side.axis:])
            types.append(TensorType(side.slice.dtype, (batch, *shape) if self.batched else shape))
        return types

    def _layout(self, node: Node) -> _Layout:
        states, sides = self._inputs(node)
        slots = [(f"in{j}", side.slice) for j, side in enumerate(sides) if side.axis != 0]
        slots += [(f"out{j}", side.slice) for j, side in enumerate(self._outputs(node))
                  if side.axis != 0]
        return _layout(_plan(node, "body"), [self._state_type(v) for v in states], slots)

    def scratch_bytes(self, node: Node) -> Dim:
        return self._layout(node).size

    def lower(self, node: Node, k: Emitter) -> None:
        from cuvil.compiler.ops import UNCHECKED

        states, ins = self._inputs(node)
        outs = self._outputs(node)
        n = len(states)
        lay = self._layout(node)
        length = self._length(node, UNCHECKED)
        loop = _Iterations(k, lay, [self._state_type(v) for v in states])
        if not self.batched:
            _scan(k, lay, loop, length, [k.buffers[v] for v in states], ins,
                  [k.buffers[v] for v in node.outputs[:n]], outs)
            return
        b = k.b

        def row(v: Value, i: ir.Value) -> ir.Value:  # batch entry i of v
            per = k.dim(simplify_dim(TensorType(v.type.dtype, v.type.shape[1:]).nbytes))
            return b.gep(k.buffers[v], [b.mul(i, per)], source_etype=I8, inbounds=True)

        batch = (states[0] if states else ins[0].value).type.shape[0]
        with k.loop(batch, name="batch") as i:
            _scan(k, lay, loop, length, [row(v, i) for v in states], ins,
                  [row(v, i) for v in node.outputs[:n]], outs, [row(s.value, i) for s in ins],
                  [row(s.value, i) for s in outs])


def _scan(k: Emitter, lay: _Layout, loop: _Iterations, length: Dim, states: list[ir.Value],
          ins: list[_ScanSide], finals: list[ir.Value], outs: list[_ScanSide],
          in_ptrs: list[ir.Value] | None = None, out_ptrs: list[ir.Value] | None = None) -> None:
    """Emit the iterations of a scan over `length` steps (the tensors start at `in_ptrs` /
    `out_ptrs`, by default the node's buffers)."""
    assert k.scratch is not None
    b = k.b
    in_ptrs = in_ptrs or [k.buffers[s.value] for s in ins]
    out_ptrs = out_ptrs or [k.buffers[s.value] for s in outs]
    n_len = k.dim(length)
    last = b.sub(n_len, k.i64(1))
    loop.init(states)
    workspace = _byte_ptr(k, k.scratch, lay.workspace)
    slots = {name: _byte_ptr(k, k.scratch, off) for name, off in lay.slots.items()}

    def position(i: ir.Value, side: _ScanSide) -> ir.Value:
        return b.sub(last, i) if side.reverse else i

    def whole(side: _ScanSide, base: ir.Value) -> View:
        s = side.slice.shape
        return k.contiguous(base, side.slice.dtype, (*s[:side.axis], length, *s[side.axis:]))

    def step(i: ir.Value) -> None:
        body_ins = loop.carried_in(i)
        for j, (side, base) in enumerate(zip(ins, in_ptrs)):
            t = position(i, side)
            if side.axis == 0:
                body_ins.append(b.gep(base, [b.mul(t, k.dim(side.slice.nbytes))], source_etype=I8,
                                      inbounds=True))
            else:
                part = k.contiguous(slots[f"in{j}"], side.slice.dtype, side.slice.shape)
                _copy_slice(k, whole(side, base), side.axis, t, part, gather=True)
                body_ins.append(slots[f"in{j}"])
        body_outs = loop.carried_out(i)
        for j, (side, base) in enumerate(zip(outs, out_ptrs)):
            if side.axis == 0:
                t = position(i, side)
                body_outs.append(b.gep(base, [b.mul(t, k.dim(side.slice.nbytes))], source_etype=I8,
                                       inbounds=True))
            else:
                body_outs.append(slots[f"out{j}"])
        _run_body(k, lay.body, body_ins, body_outs, workspace, "body")
        for j, (side, base) in enumerate(zip(outs, out_ptrs)):
            if side.axis != 0:
                part = k.contiguous(slots[f"out{j}"], side.slice.dtype, side.slice.shape)
                _copy_slice(k, whole(side, base), side.axis, position(i, side), part, gather=False)
        return

    count = loop.run(n_len, None, step)
    loop.finish(count, finals)


def _copy_slice(k: Emitter, full: View, axis: int, t: ir.Value, part: View, gather: bool) -> None:
    """Copy between `part` and the slice of `full` at index `t` of `axis`."""
    with k.loops(part.dims, name="s") as idx:
        at = [*idx[:axis], t, *idx[axis:]]
        if gather:
            k.store(part, idx, k.load(full, at))
        else:
            k.store(full, at, k.load(part, idx))


@register
class Scan(_ScanBase):
    """Scan (opset 9+): state values of fixed shape carried across the iterations, scan inputs
    sliced along their axes (either direction), scan outputs stacked along theirs."""

    op_type = "Scan"
    since = 9


@register
class Scan8(_ScanBase):
    """Scan-8: every state and scan tensor has a leading batch axis, each batch entry scanned
    along axis 1; sequence_lens, when given, must be the full length for every entry."""

    op_type = "Scan"
    since = 8
    batched = True
