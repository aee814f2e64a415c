"""The paths a transformer's layers take, against onnxruntime: Linear-layer MatMuls ([..., K]
x [K, N] as one threaded GEMM), batched MatMuls of attention (one matrix per task, or each split
over the threads when the batch is small) with broadcast batch dims and a transposed operand,
Softmax and LayerNormalization rows spread over threads; symbolic batch and sequence dims,
tile-edge and tiny sizes; and a whole attention block as PyTorch exports it.
"""

from __future__ import annotations

import numpy as np
from batch_oracle import Case, check_cases
from onnx import helper
from oracle import assert_matches_ort, make_model

rng = np.random.default_rng(11)


def weights(*shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def test_linear_layer_matmul_runs_as_one_product():
    cases = [
        Case("MatMul", ["a", "w"], {}, feeds={"a": ("float32", ["b", "s", 37])},
             consts={"w": weights(37, 70)}, label="[b, s, K] x [K, N]"),
        Case("MatMul", ["a", "w"], {}, feeds={"a": ("float32", ["s", "b", 2, 19])},
             consts={"w": weights(1, 1, 19, 33)}, label="rank 4 x [1, 1, K, N]"),
        Case("MatMul", ["a", "w"], {}, feeds={"a": ("float32", ["b", "s", 300])},
             consts={"w": weights(300, 17)}, label="K past one block"),
        Case("MatMul", ["a", "w"], {}, feeds={"a": ("float32", [19])},
             consts={"w": weights(19, 40)}, label="1-D x [K, N]"),
        Case("MatMul", ["a", "w"], {}, feeds={"a": ("float32", ["b", "s", 9]),
                                              "w": ("float32", [9, "s"])}, label="run-time B"),
    ]
    check_cases(cases, sizes=[{"b": 1, "s": 1}, {"b": 2, "s": 7}, {"b": 3, "s": 45}])


def test_batched_matmul_small_and_large_batches_with_broadcasting():
    cases = [
        Case("MatMul", ["q", "k"], {}, feeds={"q": ("float32", ["b", "h", "s", 8]),
                                              "k": ("float32", ["b", "h", 8, "s"])},
             label="scores [b, h, s, d] x [b, h, d, s]"),
        Case("MatMul", ["p", "v"], {}, feeds={"p": ("float32", ["b", "h", "s", "s"]),
                                              "v": ("float32", ["b", "h", "s", 24])},
             label="context [b, h, s, s] x [b, h, s, d]"),
        Case("MatMul", ["a", "c"], {}, feeds={"a": ("float32", [1, "h", "s", 5]),
                                              "c": ("float32", ["b", 1, 5, 11])},
             label="both sides broadcast"),
        Case("MatMul", ["a", "c"], {}, feeds={"a": ("float32", ["s", 6])},
             consts={"c": weights(3, 6, 13)}, label="[M, K] x constant [B, K, N]"),
        Case("MatMul", ["a", "c"], {}, feeds={"a": ("float32", ["h", "s", 6]),
                                              "c": ("float32", [6, "h"])}, label="run-time [K, N] B"),
    ]
    # b * h below MIN_PARALLEL_BATCH (each product split over threads), then above it
    check_cases(cases, sizes=[{"b": 1, "h": 1, "s": 1}, {"b": 1, "h": 3, "s": 30},
                              {"b": 2, "h": 5, "s": 17}, {"b": 1, "h": 12, "s": 64}])


def test_matmul_with_an_empty_sum_is_zero():
    cases = [Case("MatMul", ["a", "c"], {}, feeds={"a": ("float32", ["b", 4, 0]),
                                                   "c": ("float32", ["b", 0, 5])}),
             Case("MatMul", ["a", "c"], {}, feeds={"a": ("float32", ["b", 3, 0])},
                  consts={"c": np.zeros((0, 6), np.float32)})]
    check_cases(cases, sizes=[{"b": 1}, {"b": 5}])


def test_matmul_of_a_transposed_operand():
    """Q @ K^T where K^T comes from a Transpose of the heads' last two axes."""
    model = make_model(
        [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
         helper.make_node("MatMul", ["q", "kt"], ["y"])],
        {"q": (np.float32, ["b", 4, "s", 16]), "k": (np.float32, ["b", 4, "s", 16])},
        {"y": np.float32})
    compiled = None
    for b, s in ((1, 1), (2, 33), (1, 128)):
        feeds = {n: rng.standard_normal((b, 4, s, 16)).astype(np.float32) for n in ("q", "k")}
        compiled = assert_matches_ort(model, feeds, compiled=compiled)


def test_softmax_and_layernorm_rows_on_threads():
    cases = [Case("Softmax", ["x"], {"axis": axis}, feeds={"x": ("float32", ["b", 12, "s", "s"])},
                  label=f"Softmax axis {axis}") for axis in (-1, 2, 1)]
    cases += [Case("LayerNormalization", ["x", "g", "beta"], {"axis": axis, "epsilon": 1e-5},
                   feeds={"x": ("float32", ["b", "s", 6, 64])},
                   consts={"g": weights(*shape), "beta": weights(*shape)},
                   label=f"LayerNorm axis {axis}")
              for axis, shape in ((-1, (64,)), (2, (6, 64)), (-2, (1, 64)))]
    check_cases(cases, sizes=[{"b": 1, "s": 1}, {"b": 1, "s": 3}, {"b": 2, "s": 96}])


def attention_block(hidden: int = 32, heads: int = 4) -> object:
    """One post-norm encoder layer's attention as torch exports it: in-projection MatMul +
    bias, heads split by Reshape/Transpose, scaled scores, mask Add, Softmax, context, merged
    heads, out-projection, residual, LayerNormalization, then an erf-GELU feed-forward."""
    d = hidden // heads
    nodes = [
        helper.make_node("MatMul", ["x", "w_qkv"], ["qkv0"]),
        helper.make_node("Add", ["b_qkv", "qkv0"], ["qkv"]),
        helper.make_node("Split", ["qkv", "split"], ["q0", "k0", "v0"], axis=-1),
    ]
    for name in ("q", "k", "v"):
        nodes += [helper.make_node("Reshape", [f"{name}0", "heads_shape"], [f"{name}1"]),
                  helper.make_node("Transpose", [f"{name}1"], [f"{name}h"], perm=[0, 2, 1, 3])]
    nodes += [
        helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["qh", "kt"], ["s0"]),
        helper.make_node("Div", ["s0", "scale"], ["s1"]),
        helper.make_node("Add", ["s1", "mask"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vh"], ["c0"]),
        helper.make_node("Transpose", ["c0"], ["c1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["c1", "merged_shape"], ["c2"]),
        helper.make_node("MatMul", ["c2", "w_o"], ["o0"]),
        helper.make_node("Add", ["o0", "b_o"], ["o1"]),
        helper.make_node("Add", ["x", "o1"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "w_1"], ["f0"]),
        helper.make_node("Add", ["f0", "b_1"], ["f1"]),
        helper.make_node("Div", ["f1", "sqrt2"], ["g0"]),
        helper.make_node("Erf", ["g0"], ["g1"]),
        helper.make_node("Add", ["g1", "one"], ["g2"]),
        helper.make_node("Mul", ["f1", "g2"], ["g3"]),
        helper.make_node("Mul", ["g3", "half"], ["g4"]),
        helper.make_node("MatMul", ["g4", "w_2"], ["y"]),
    ]
    consts = {
        "w_qkv": weights(hidden, 3 * hidden), "b_qkv": weights(3 * hidden),
        "split": np.array([hidden] * 3, np.int64),
        "heads_shape": np.array([0, -1, heads, d], np.int64),
        "merged_shape": np.array([0, -1, hidden], np.int64),
        "scale": np.array(np.sqrt(d), np.float32), "w_o": weights(hidden, hidden),
        "b_o": weights(hidden), "gamma": weights(hidden) + 1, "beta": weights(hidden),
        "w_1": weights(hidden, 4 * hidden), "b_1": weights(4 * hidden),
        "sqrt2": np.array(np.sqrt(2), np.float32), "one": np.array(1, np.float32),
        "half": np.array(0.5, np.float32), "w_2": weights(4 * hidden, hidden),
    }
    return make_model(nodes, {"x": (np.float32, ["b", "s", hidden]),
                              "mask": (np.float32, ["b", 1, 1, "s"])}, {"y": np.float32}, consts,
                      opset=17)


def test_attention_block_as_exported():
    model = attention_block()
    compiled = None
    for b, s in ((1, 1), (2, 9), (1, 128)):
        mask = np.where(rng.random((b, 1, 1, s)) < 0.2, -1e4, 0).astype(np.float32)
        feeds = {"x": rng.standard_normal((b, s, 32)).astype(np.float32), "mask": mask}
        compiled = assert_matches_ort(model, feeds, compiled=compiled, rtol=1e-4, atol=2e-5)
