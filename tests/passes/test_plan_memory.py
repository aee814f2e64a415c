"""plan_memory: views alias their input, dead buffers are reused, graph outputs and constants
live where they belong, and an independent checker finds no two buffers that are live at
the same time sharing a byte of the workspace (random graphs, symbolic dims, scratch)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import sympy
from irbuild import build

from cuvil.compiler.frontend import import_model
from cuvil.compiler.ir import Graph, Value
from cuvil.compiler.ops import lookup
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.plan_memory import ALIGN, MemoryPlan, plan_memory


def evaluate(d, binding: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    return int(sympy.sympify(d).subs({s: binding[s.name] for s in d.free_symbols}))


def check_plan(graph: Graph, plan: MemoryPlan, binding: dict[str, int]) -> int:
    """Every buffer the plan puts in the workspace, with its byte range and the node span it
    must survive (from its producer to its last reader, through the views that alias it), at
    the dims in `binding`; assert that no two with overlapping spans overlap in bytes and
    that all fit in the workspace. Returns the number of buffers checked."""
    alias: dict[Value, Value] = {}  # view output -> the value whose bytes it is
    for n in graph.nodes:
        if n in plan.elided:
            op = lookup(n.domain, n.op_type, n.opset)
            assert op is not None and op.aliases_input(n) and len(n.outputs) == 1, f"{n} is elided"
            src = n.inputs[0]
            assert src is not None
            alias[n.outputs[0]] = alias.get(src, src)
            assert plan.storage[n.outputs[0]] == plan.storage[src], f"{n}: view not aliased"
    span: dict[Value, list[int]] = {}
    for t, n in enumerate(graph.nodes):
        for v in n.outputs:
            if v not in alias:
                span[v] = [t, t]
        for v in n.inputs:
            if v is not None and alias.get(v, v) in span:
                span[alias.get(v, v)][1] = t
    size = evaluate(plan.workspace_size, binding)
    blocks: list[tuple[str, int, int, int, int]] = []  # (what, start, end, first, last)
    for v, (first, last) in span.items():
        s = plan.storage[v]
        if s.kind != "workspace":
            continue
        start = evaluate(s.offset, binding)
        blocks.append((v.name, start, start + evaluate(v.type.nbytes, binding), first, last))
    for t, n in enumerate(graph.nodes):
        if n in plan.scratch:
            op = lookup(n.domain, n.op_type, n.opset)
            start = evaluate(plan.scratch[n], binding)
            blocks.append((f"scratch of {n.describe()}", start,
                           start + evaluate(op.scratch_bytes(n), binding), t, t))  # type: ignore[union-attr]
    for what, start, end, _, _ in blocks:
        assert start >= 0 and end <= size, f"{what}: [{start}, {end}) outside workspace {size}"
        assert start % ALIGN == 0, f"{what}: offset {start} not aligned"
    for i, a in enumerate(blocks):
        for b in blocks[i + 1:]:
            live_together = a[3] <= b[4] and b[3] <= a[4]
            share_bytes = a[1] < b[2] and b[1] < a[2] and a[1] < a[2] and b[1] < b[2]
            assert not (live_together and share_bytes), f"{a} and {b} overlap"
    return len(blocks)


def test_views_share_their_inputs_storage() -> None:
    g = build("""
        x: float32[batch, 4, 2]
        a = Relu(x)
        r = Flatten(a, axis=1)
        i = Identity(r)
        n = Neg(i)
        v = Flatten(x, axis=1)
        m = Add(v, n)
        return m
    """)
    plan = plan_memory(g)
    a, r, i, n, v, m = (node.outputs[0] for node in g.nodes)
    assert plan.elided == {g.nodes[1], g.nodes[2], g.nodes[4]}
    assert plan.storage[r] == plan.storage[i] == plan.storage[a]
    assert plan.storage[a].kind == "workspace"
    assert plan.storage[v] == plan.storage[g.inputs[0]] and plan.storage[v].kind == "input"
    assert plan.storage[m].kind == "output"
    # a is read (through r and i) by Neg: n must not take a's bytes
    assert plan.storage[n].offset != plan.storage[a].offset
    check_plan(g, plan, {"batch": 3})


def test_transposes_that_move_no_bytes_are_views() -> None:
    # [seq, 1, hidden] -> [1, seq, hidden] keeps the bytes where they are; swapping two axes
    # longer than 1 moves them, and so may a symbolic axis, which may be longer than 1
    g = build("""
        x: float32[seq, 1, 8]
        a = Relu(x)
        t = Transpose(a, perm=[1, 0, 2])
        u = Transpose(t, perm=[0, 2, 1])
        s: float32[2, batch, 8]
        w = Transpose(s, perm=[1, 0, 2])
        return u, w
    """)
    plan = plan_memory(g)
    relu, moved_by_ones, _swapped, _symbolic = g.nodes
    assert plan.elided == {moved_by_ones}
    assert plan.storage[moved_by_ones.outputs[0]] == plan.storage[relu.outputs[0]]
    check_plan(g, plan, {"seq": 5, "batch": 3})


def test_a_view_that_is_a_graph_output_is_a_copy() -> None:
    g = build("""
        x: float32[2, 4]
        a = Relu(x)
        r = Flatten(a, axis=0)
        return r
    """)
    plan = plan_memory(g)
    assert plan.elided == set() and plan.storage[g.outputs[0]].kind == "output"


def test_dead_buffers_are_reused() -> None:
    g = build("""
        x: float32[batch, 16]
        a = Relu(x)
        b = Neg(a)
        c = Abs(b)
        d = Relu(c)
        e = Neg(d)
        return e
    """)
    plan = plan_memory(g)
    # a..d live one node past their producer: two blocks of batch*64 bytes suffice
    assert sympy.simplify(plan.workspace_size - 2 * 64 * sympy.Symbol("batch", integer=True,
                                                                       positive=True)) == 0
    offsets = [plan.storage[n.outputs[0]].offset for n in g.nodes[:4]]
    assert offsets[0] == offsets[2] and offsets[1] == offsets[3] and offsets[0] != offsets[1]
    for batch in (1, 5):
        check_plan(g, plan, {"batch": batch})


def test_a_larger_dead_block_takes_a_smaller_symbolic_value() -> None:
    """128*batch bytes free, 64*batch needed: provably enough, reused."""
    g = build("""
        x: float32[batch, 32]
        a = Relu(x)
        h, k = Split(a, axis=1, num_outputs=2)
        n = Neg(h)
        m = Abs(n)
        s = Add(m, k)
        return s
    """, opset=18)
    plan = plan_memory(g)
    a, (h, _k), n, m = g.nodes[0].outputs[0], g.nodes[1].outputs, g.nodes[2].outputs[0], \
        g.nodes[3].outputs[0]
    assert plan.storage[m].offset == plan.storage[h].offset  # h dead after Neg
    assert plan.storage[n].offset == plan.storage[a].offset  # a dead after Split
    check_plan(g, plan, {"batch": 2})


def test_inputs_constants_and_outputs() -> None:
    c = np.arange(5, dtype=np.float32)
    d = np.arange(3, dtype=np.int64)
    g = build("""
        x: float32[5]
        a = Add(x, c)
        b = Mul(a, c)
        e = Relu(b)
        return e, x, b, k, e
    """, c=c, k=d)
    plan = plan_memory(g)
    e, b = g.outputs[0], g.outputs[2]
    assert plan.storage[e].kind == "output" and plan.storage[e].index == 0
    assert plan.storage[b].kind == "output" and plan.storage[b].index == 2
    assert plan.storage[g.nodes[0].outputs[0]].kind == "workspace"
    # x (an input), k (a constant) and e again are copied into their output slots
    assert [(v.name, i) for v, i in plan.output_copies] == [("x", 1), ("k", 3), (e.name, 4)]
    for v, arr in ((g.nodes[0].inputs[1], c), (g.outputs[3], d)):
        s = plan.storage[v]  # type: ignore[index]
        assert s.kind == "weights" and s.offset % ALIGN == 0
        assert bytes(plan.weights[s.offset:s.offset + arr.nbytes]) == arr.tobytes()


OPS = ("Relu", "Neg", "Add", "Concat", "Split", "Flatten", "Identity", "ReduceSum")


def random_graph(seed: int) -> Graph:
    """A random DAG over x[batch, 8]: elementwise ops, views, concatenations and splits."""
    rng = np.random.default_rng(seed)
    lines = ["x: float32[batch, 8]"]
    pool = [("x", 8)]  # (name, size of dim 1)
    for i in range(int(rng.integers(6, 25))):
        op = OPS[int(rng.integers(len(OPS)))]
        a, wa = pool[int(rng.integers(len(pool)))]
        same = [p for p in pool if p[1] == wa]
        b, wb = same[int(rng.integers(len(same)))] if op == "Add" else pool[int(rng.integers(len(pool)))]
        name = f"v{i}"
        if op in ("Relu", "Neg", "Flatten", "Identity"):
            lines.append(f"{name} = {op}({a}, axis=1)" if op == "Flatten" else f"{name} = {op}({a})")
            pool.append((name, wa))
        elif op == "Add":
            lines.append(f"{name} = Add({a}, {b})")
            pool.append((name, wa))
        elif op == "Concat" and wa + wb <= 64:
            lines.append(f"{name} = Concat({a}, {b}, axis=1)")
            pool.append((name, wa + wb))
        elif op == "Split" and wa % 2 == 0:
            lines.append(f"{name}a, {name}b = Split({a}, axis=1, num_outputs=2)")
            pool += [(f"{name}a", wa // 2), (f"{name}b", wa // 2)]
        elif op == "ReduceSum":
            lines.append(f"{name} = ReduceSum({a}, one, keepdims=1)")
            pool.append((name, 1))
    picks = {pool[-1][0], *(pool[int(j)][0] for j in rng.integers(1, len(pool), 2))} if \
        len(pool) > 1 else {"x"}
    lines.append("return " + ", ".join(sorted(picks)))
    return build("\n".join(lines), opset=18, one=np.array([1]))


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_have_no_overlapping_live_buffers(seed) -> None:
    g = random_graph(seed)
    g.verify()
    plan = plan_memory(g)
    for batch in (1, 3):
        check_plan(g, plan, {"batch": batch})


def test_the_checker_catches_an_overlap() -> None:
    g = build("""
        x: float32[4]
        a = Relu(x)
        b = Neg(x)
        c = Add(a, b)
        return c
    """)
    plan = plan_memory(g)
    a, b = g.nodes[0].outputs[0], g.nodes[1].outputs[0]
    plan.storage[b] = plan.storage[a]  # a is still live when b is written
    with pytest.raises(AssertionError, match="overlap"):
        check_plan(g, plan, {})


def test_a_real_model_with_scratch() -> None:
    """light_resnet50 (im2col scratch for its convolutions), with a symbolic batch."""
    path = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light/light_resnet50.onnx")
    model = onnx.load(path)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    del model.graph.value_info[:]
    for out in model.graph.output:
        del out.type.tensor_type.shape.dim[:]
    g = run_passes(import_model(model))
    plan = plan_memory(g)
    assert plan.scratch
    n = check_plan(g, plan, {"batch": 2})
    assert n > len(plan.scratch)

