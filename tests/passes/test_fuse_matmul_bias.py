"""fuse_matmul_bias: the graph after the pass, and the fused model's numbers against
onnxruntime on the unfused model."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from oracle import assert_matches_ort, make_model

from cuvil.compiler.frontend import import_model
from cuvil.compiler.ops.gemm import FUSED_BIAS
from cuvil.compiler.passes import run_passes

rng = np.random.default_rng(5)


def linear(bias_shape, bias_first: bool = False, extra_user: bool = False, k: int = 12,
           w_shape=None):
    add_inputs = ["bias", "p"] if bias_first else ["p", "bias"]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
             helper.make_node("Add", add_inputs, ["y"])]
    outputs = {"y": np.float32}
    if extra_user:
        nodes.append(helper.make_node("Neg", ["p"], ["n"]))
        outputs["n"] = np.float32
    w = rng.standard_normal(w_shape or (k, 7)).astype(np.float32)
    return make_model(nodes, {"x": (np.float32, ["b", "s", k])}, outputs,
                      {"w": w, "bias": rng.standard_normal(bias_shape).astype(np.float32)})


def ops(model) -> list[tuple[str, int | None, int]]:
    graph = run_passes(import_model(model))
    return [(n.op_type, n.attrs.get(FUSED_BIAS), len(n.inputs)) for n in graph.nodes]


def check_numbers(model) -> None:
    compiled = None
    for b, s in ((2, 1), (2, 20)):
        feeds = {"x": rng.standard_normal((b, s, 12)).astype(np.float32)}
        compiled = assert_matches_ort(model, feeds, compiled=compiled)


@pytest.mark.parametrize("bias_shape, bias_first", [((7,), False), ((7,), True),
                                                    ((1, 7), False), ((1, 1, 7), True)])
def test_bias_is_fused(bias_shape, bias_first) -> None:
    model = linear(bias_shape, bias_first)
    assert ops(model) == [("MatMul", 1, 3)]
    check_numbers(model)


@pytest.mark.parametrize("kwargs", [
    {"bias_shape": (1, 1, 1, 7)},  # broadcasts the output to a higher rank
    {"bias_shape": (1, 7), "w_shape": (2, 12, 7)},  # a batch of weight matrices
    {"bias_shape": (7,), "extra_user": True},  # the product itself is needed
])
def test_bias_stays_when_it_cannot_fold(kwargs) -> None:
    model = linear(**kwargs)
    assert [op for op, _, _ in ops(model)][:2] == ["MatMul", "Add"]
    check_numbers(model)


def test_a_bias_per_row_stays() -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "c"], ["y"])]
    model = make_model(nodes, {"x": (np.float32, [7, 12])}, {"y": np.float32},
                       {"w": rng.standard_normal((12, 7)).astype(np.float32),
                        "c": rng.standard_normal((7, 1)).astype(np.float32)})
    assert [op for op, _, _ in ops(model)] == ["MatMul", "Add"]
    assert_matches_ort(model, {"x": rng.standard_normal((7, 12)).astype(np.float32)})
