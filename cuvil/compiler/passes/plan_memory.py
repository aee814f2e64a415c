"""Decide where every value lives: caller buffers, the weights blob, or the workspace; and
where the weights derived at run time go in their buffer (`Op.derived_bytes`), with the
outputs of the nodes computed once from constants alone (`HOISTED_OPS`); derived weights the
compiler computes (`Op.derived_value`) go in the blob instead of the constants they replace.

Intermediate values get offsets in one workspace whose size is an expression of the
symbolic input dims. A block is reused by a later value once its last reader has run and
its size provably suffices (static sizes, or e.g. ``64*batch >= 32*batch``). View ops
(Reshape, Flatten, Identity...) share their input's storage and emit no code. A value with a
data-dependent dim (`ir.DataDim`) gets the block of its upper bound, so the workspace size
stays an expression of the input dims.
"""

from __future__ import annotations

import sympy

from cuvil.compiler.ir import Dim, Graph, Node, Value, simplify_dim
from cuvil.compiler.memory import MemoryPlan, Storage
from cuvil.compiler.ops import lookup, replaced_constants
from cuvil.compiler.ops.control import PLANS, SubgraphOp, planning_graph

ALIGN = 64
#: ops that make large tensors from small constants (the frontend folds smaller results into
#: the library): with constant inputs, run once at the first run instead of by every run
HOISTED_OPS = {"ConstantOfShape", "EyeLike", "Expand", "Tile"}


def _aligned(size: Dim) -> Dim:
    if isinstance(size, int):
        return -(-size // ALIGN) * ALIGN
    return simplify_dim(ALIGN * sympy.ceiling(sympy.sympify(size) / ALIGN))


def _fits(block: Dim, need: Dim) -> bool:
    if isinstance(block, int) and isinstance(need, int):
        return block >= need
    return bool(sympy.sympify(block - need).is_nonnegative)


def _same(a: Dim, b: Dim) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return simplify_dim(a - b) == 0


def _order(offset: Dim) -> tuple[int, str]:
    """Sort key of offsets: static ones by value, symbolic ones after them (in text order,
    only to be deterministic; the free range at the workspace's end is found by its end)."""
    return (offset, "") if isinstance(offset, int) else (1 << 62, str(offset))


def plan_memory(graph: Graph, *, body: bool = False) -> MemoryPlan:  # noqa: C901  (older than the rule: to split)
    """The plan of a model (`body`: of an If/Loop/Scan body, which has no derived buffer)."""
    _plan_bodies(graph)
    plan = MemoryPlan()
    for i, inp in enumerate(graph.inputs):
        plan.storage[inp] = Storage("input", i)

    # derived weights the compiler computes: stored in the blob; the constants only they
    # replace are not, their readers' code never touches them
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset)
        value = op.derived_value(node) if op is not None else None
        if value is not None:
            plan.stored[node] = _add_bytes(plan, value.tobytes())
    for const, reader in replaced_constants(graph, plan.stored).items():
        plan.storage[const] = Storage("weights", offset=plan.stored[reader])  # nothing reads it

    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.is_const and v not in plan.storage:
                _add_weight(plan, v)

    on_demand = []
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset)
        derived = op.derived_bytes(node) if op is not None and node not in plan.stored else 0
        if derived and op is not None and op.derived_on_demand(node):
            on_demand.append((node, derived))
        elif derived:
            plan.derived[node] = plan.derived_size
            plan.derived_size += -(-derived // ALIGN) * ALIGN
        elif not body and _hoistable(plan, graph, node):
            plan.hoisted.append(node)
            for v in node.outputs:
                plan.storage[v] = Storage("derived", offset=plan.derived_size)
                plan.derived_size += -(-max(int(v.type.nbytes), 1) // ALIGN) * ALIGN
    # after the rest: the first run populates the buffer up to them (codegen/derived.py)
    plan.derived_eager_size = plan.derived_size
    for node, derived in on_demand:
        plan.derived[node] = plan.derived_size
        plan.derived_size += -(-derived // ALIGN) * ALIGN

    for i, v in enumerate(graph.outputs):
        if v in plan.storage or v.producer is None:
            if v.is_const and v not in plan.storage:
                _add_weight(plan, v)
            plan.output_copies.append((v, i))
        else:
            plan.storage[v] = Storage("output", i)

    # views: share storage with the input (the root of a chain of views)
    root: dict[Value, Value] = {}
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset)
        out = node.outputs[0]
        src = node.input(0)
        if (op is not None and len(node.outputs) == 1 and src is not None
                and out not in plan.storage and op.aliases_input(node)):
            root[out] = root.get(src, src)
            plan.elided.add(node)

    # lifetimes over storage roots, in node order
    last_use: dict[Value, int] = {}
    for t, node in enumerate(graph.nodes):
        for v in node.inputs:
            if v is not None:
                last_use[root.get(v, v)] = t
    free: list[tuple[Dim, Dim]] = []  # (offset, size) of released blocks, by offset
    end: Dim = 0
    live: dict[Value, tuple[Dim, Dim]] = {}

    def allocate(nbytes: Dim) -> tuple[Dim, Dim]:
        """Static sizes take the smallest free range that fits (the rest stays free) or the
        free range at the workspace's end, grown; a symbolic size takes a whole free block
        it provably fits. Splitting and merging ranges kept VGG-19's workspace at its largest
        live set (94 MB) where whole blocks took 167 MB (a freed 68 MB scratch never merged
        with its neighbours), and every fresh megabyte costs the first run page faults."""
        nonlocal end
        need = _aligned(nbytes)
        if isinstance(need, int):
            fits = [b for b in free if isinstance(b[1], int) and b[1] >= need]
            if fits:
                block = min(fits, key=lambda b: (b[1], b[0]))
                free.remove(block)
                if block[1] > need:
                    release((simplify_dim(block[0] + need), block[1] - need))
                return block[0], need
            last = next((b for b in free if isinstance(b[1], int)
                         and _same(simplify_dim(b[0] + b[1]), end)), None)
            if last is not None:
                free.remove(last)
                end = simplify_dim(last[0] + need)
                return last[0], need
        else:
            whole = next((b for b in free if _fits(b[1], need)), None)
            if whole is not None:
                free.remove(whole)
                return whole
        block = (end, need)
        end = simplify_dim(end + need)
        return block

    def release(block: tuple[Dim, Dim]) -> None:
        """Back to the free ranges, merged with a static neighbour it touches."""
        offset, size = block
        if isinstance(size, int):
            for other in list(free):
                if not isinstance(other[1], int):
                    continue
                if _same(simplify_dim(other[0] + other[1]), offset):  # other, then block
                    free.remove(other)
                    offset, size = other[0], other[1] + size
                elif _same(simplify_dim(offset + size), other[0]):  # block, then other
                    free.remove(other)
                    size += other[1]
        free.append((offset, size))
        free.sort(key=lambda b: _order(b[0]))

    for t, node in enumerate(graph.nodes):
        for v in node.outputs:
            if v in plan.storage or v in root:
                continue
            # a data-dependent dim takes the block its bound needs
            live[v] = allocate(graph.upper_bound(v.type.nbytes))
            plan.storage[v] = Storage("workspace", offset=live[v][0])
        op = lookup(node.domain, node.op_type, node.opset)
        scratch = op.scratch_bytes(node) if op is not None and node not in plan.elided else 0
        scratch = graph.upper_bound(scratch)
        if not (isinstance(scratch, int) and scratch == 0):
            block = allocate(scratch)
            plan.scratch[node] = block[0]
            release(block)  # only the node itself uses it
        for v in [*node.inputs, *node.outputs]:
            r = root.get(v, v) if v is not None else None
            if r in live and last_use.get(r, t) <= t:
                release(live.pop(r))
    for v, r in root.items():
        plan.storage[v] = plan.storage[r]
    plan.workspace_size = end
    return plan


def _plan_bodies(graph: Graph) -> None:
    """Plan each If/Loop/Scan body first, as a model of its own: the node's scratch memory
    holds its bodies' workspaces (`SubgraphOp.scratch_bytes` reads the plans)."""
    for node in graph.nodes:
        op = lookup(node.domain, node.op_type, node.opset)
        if isinstance(op, SubgraphOp):
            plans = {attr: plan_memory(planning_graph(node.attrs[attr]), body=True)
                     for attr in op.graph_attrs}
            node.attrs = {**node.attrs, PLANS: plans}


def _hoistable(plan: MemoryPlan, graph: Graph, node: Node) -> bool:
    """A node of HOISTED_OPS whose inputs are constants (or hoisted) and whose outputs have
    static shapes and are not the model's outputs."""
    inputs_fixed = all(v is None or v.is_const or
                       (v in plan.storage and plan.storage[v].kind == "derived")
                       for v in node.inputs)
    return (node.op_type in HOISTED_OPS and node.domain in ("", "ai.onnx") and inputs_fixed
            and all(isinstance(v.type.nbytes, int) and v not in graph.outputs
                    for v in node.outputs))


def _add_weight(plan: MemoryPlan, v: Value) -> None:
    assert v.const is not None
    plan.storage[v] = Storage("weights", offset=_add_bytes(plan, v.const.tobytes()))


def _add_bytes(plan: MemoryPlan, data: bytes) -> int:
    """Append to the weights blob, aligned; returns the offset."""
    pad = (-len(plan.weights)) % ALIGN
    plan.weights.extend(b"\0" * pad)
    offset = len(plan.weights)
    # a zero-size constant still needs an address inside the blob
    plan.weights.extend(data or b"\0")
    return offset
