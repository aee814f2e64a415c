"""Identical nodes share one LLVM function (compile time), and sharing never changes results.

The function count is read from the module's IR text; onnxruntime is the oracle for the
outputs, including nodes whose lowering reads constant elements at compile time (Gather's
indices, Pad's pads), which must not share code with nodes holding other elements.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper

from cuvil.compiler.codegen.module import build_module
from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import run_passes
from cuvil.compiler.passes.fuse_elementwise import MAX_STEPS
from cuvil.compiler.passes.plan_memory import plan_memory
from tests.oracle import assert_matches_ort, make_model

RNG = np.random.default_rng(7)


def node_functions(model: onnx.ModelProto) -> list[str]:
    """Op types of the node functions the module defines (helpers they call excluded)."""
    graph = run_passes(import_model(model, None, "m"))
    text = build_module(graph, plan_memory(graph), "m", "0" * 64, "x86_64-unknown-linux-gnu", "")
    return re.findall(r'define internal i32 @"node\d+_(\w+)"\(', text)


def block_chain(blocks: int) -> onnx.ModelProto:
    """MatMul (own weights, same shape), Add (own bias), Relu, Reshape, repeated."""
    nodes, inits = [], {"shape": np.array([-1, 8], np.int64)}
    x = "x"
    for b in range(blocks):
        inits[f"w{b}"] = RNG.standard_normal((8, 8)).astype(np.float32)
        inits[f"b{b}"] = RNG.standard_normal(8).astype(np.float32)
        nodes += [helper.make_node("MatMul", [x, f"w{b}"], [f"m{b}"]),
                  helper.make_node("Add", [f"m{b}", f"b{b}"], [f"a{b}"]),
                  helper.make_node("Relu", [f"a{b}"], [f"r{b}"]),
                  helper.make_node("Reshape", [f"r{b}", "shape"], [f"y{b}"])]
        x = f"y{b}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return make_model(nodes, {"x": (np.float32, ["batch", 8])}, {"y": np.float32}, inits)


def test_identical_nodes_share_one_function() -> None:
    model = block_chain(30)
    functions = node_functions(model)
    # each MatMul takes its bias Add (as a Gemm) and its Relu: 30 identical nodes, one function
    assert functions.count("Gemm") == 1, functions
    assert len(functions) == len(set(functions)) <= 6, functions  # one per distinct node
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_a_relu_chain_is_one_function() -> None:
    # fused into loops of MAX_STEPS Relus (passes/fuse_elementwise.py) and 8 more: the three
    # long ones share one function
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(200)]
    model = make_model(nodes, {"t0": (np.float32, ["batch", 5])}, {"t200": np.float32})
    assert MAX_STEPS == 64
    assert node_functions(model) == ["Fused", "Fused"]
    assert_matches_ort(model, {"t0": RNG.standard_normal((2, 5)).astype(np.float32)})


@pytest.mark.parametrize("op, constants", [
    ("Gather", [(np.roll(np.arange(4), i),) for i in range(4)]),
    ("Pad", [(np.array([0, 1, 0, 0]), np.float32(i)) for i in range(4)]),
])
def test_constants_read_at_compile_time_keep_nodes_apart(
        op: str, constants: list[tuple[np.ndarray, ...]]) -> None:
    nodes, inits = [], {}
    for i, consts in enumerate(constants):
        names = [f"c{i}_{j}" for j in range(len(consts))]
        inits.update(zip(names, consts))
        nodes.append(helper.make_node(op, [f"t{i}", *names], [f"t{i + 1}"]))
    out = f"t{len(constants)}"
    model = make_model(nodes, {"t0": (np.float32, [4, 2])}, {out: np.float32}, inits)
    assert node_functions(model) == [op] * len(constants)
    assert_matches_ort(model, {"t0": RNG.standard_normal((4, 2)).astype(np.float32)})


def test_a_300_node_chain_of_mixed_ops_matches_onnxruntime() -> None:
    """Blocks of different small ops, some repeated with other constants, a symbolic batch."""
    nodes, inits = [], {"shape": np.array([-1, 4, 4], np.int64),
                        "flat": np.array([-1, 16], np.int64)}
    x = "x"

    def add(op: str, *inputs: str, **attrs: object) -> None:
        nonlocal x
        out = f"v{len(nodes)}"
        nodes.append(helper.make_node(op, [x, *inputs], [out], **attrs))
        x = out

    b = 0
    while len(nodes) < 300:
        inits[f"w{b}"] = (RNG.standard_normal((16, 16)) / 4).astype(np.float32)
        inits[f"s{b}"] = np.float32(0.5 + b % 3)
        inits[f"g{b}"] = np.roll(np.arange(4), b % 4).astype(np.int64)
        add("MatMul", f"w{b}")
        add("Mul", f"s{b}")
        add("Tanh" if b % 2 else "Sigmoid")
        add("Reshape", "shape")
        add("Transpose", perm=[0, 2, 1])
        add("Gather", f"g{b}", axis=1)
        add("Softmax", axis=-1)
        add("Reshape", "flat")
        b += 1
    model = make_model(nodes, {"x": (np.float32, ["batch", 16])}, {x: np.float32}, inits)
    assert len(nodes) >= 300
    assert_matches_ort(model, {"x": RNG.standard_normal((3, 16)).astype(np.float32)},
                       rtol=1e-4, atol=1e-5)
