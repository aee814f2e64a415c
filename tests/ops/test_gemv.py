"""Gemm and MatMul with at most four rows of activations (the matrix-vector kernel,
kernels/gemv.py) against onnxruntime: weights wide and deep enough to cross its column
blocks, panels, K parts and masked tails; transB 0/1 with constant and run-time B; alpha, beta
and every kind of C; MatMul with a constant weight after a [1, 1, K] input; a symbolic batch
that is 1 to 4 (the kernel) and more (the tiled GEMM) in calls of one compiled model; fused
activations and residuals; 1 and 2 threads; weights computed at run time by ConstantOfShape
(hoisted out of the run, passes/plan_memory.py)."""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, check_cases
from onnx import helper, numpy_helper
from oracle import assert_matches_ort, make_model

import cuvil

#: the batch sizes each model runs at: the kernel's row counts, then the tiled GEMM's
BATCHES = [{"m": 1}, {"m": 2}, {"m": 3}, {"m": 4}, {"m": 5}, {"m": 9}]
TOL = {"rtol": 2e-4, "atol": 2e-4}


def gemm(rng: np.random.Generator, kk: int, n: int, *, trans_b: int, const_b: bool,
         c: str = "[N]", alpha: float = 1.0, beta: float = 1.0) -> Case:
    attrs = {"transB": trans_b, "alpha": alpha, "beta": beta}
    case = Case("Gemm", ["a", "b", "c"] if c != "none" else ["a", "b"], attrs,
                feeds={"a": ("float32", ["m", kk])},
                label=f"Gemm K={kk} N={n} transB={trans_b} const_b={const_b} C={c}")
    b = rng.standard_normal([n, kk] if trans_b else [kk, n]).astype(np.float32)
    if const_b:
        case.consts["b"] = b
    else:
        case.feeds["b"] = ("float32", list(b.shape))
    shapes = {"[N]": [n], "[1,N]": [1, n], "scalar": [], "[M,1]": ["m", 1], "[M,N]": ["m", n]}
    if c in ("[M,1]", "[M,N]"):
        case.feeds["c"] = ("float32", shapes[c])
    elif c != "none":
        case.consts["c"] = rng.standard_normal(shapes[c]).astype(np.float32)
    return case


def test_gemm_transb_constant_and_runtime_weights():
    rng = np.random.default_rng(10)
    shapes = [(1, 1), (7, 5), (64, 33), (301, 130), (96, 1000)]
    cases = [gemm(rng, kk, n, trans_b=tb, const_b=const)
             for kk, n in shapes for tb in (0, 1) for const in (True, False)]
    check_cases(cases, sizes=BATCHES, **TOL)


def test_gemm_alpha_beta_and_every_c():
    rng = np.random.default_rng(11)
    cases = [gemm(rng, 77, 45, trans_b=tb, const_b=const, c=c, alpha=alpha, beta=beta)
             for tb, const in ((0, True), (1, False), (1, True))
             for c in ("none", "[N]", "[1,N]", "scalar", "[M,1]", "[M,N]")
             for alpha, beta in ((1.0, 1.0), (0.5, -1.5), (-2.0, 0.0))]
    check_cases(cases, sizes=BATCHES, **TOL)


def test_matmul_with_constant_weight():
    rng = np.random.default_rng(12)
    cases = [Case("MatMul", ["a", "b"], {}, feeds={"a": ("float32", shape)},
                  consts={"b": rng.standard_normal([kk, n]).astype(np.float32)},
                  label=f"MatMul {shape} x [{kk}, {n}]")
             for shape, kk, n in ((["m", 200], 200, 70), ([1, "m", 33], 33, 129),
                                  (["m", 1, 64], 64, 32), ([1, 1, 500], 500, 17))]
    check_cases(cases, sizes=BATCHES, **TOL)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["Relu", "HardSwish", "Sigmoid"])
def test_fused_bias_activation_and_residual(threads: int, activation: str):
    """Linear -> activation (+ a residual) as exporters write them: MatMul + Add bias and Gemm
    with C, each fused into the product by passes/fuse_epilogue.py."""
    rng = np.random.default_rng(13)
    kk, n = 260, 300
    w1 = rng.standard_normal([kk, n]).astype(np.float32) * 0.1
    w2 = rng.standard_normal([n, n]).astype(np.float32) * 0.1
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node(activation, ["h1"], ["h"]),
             helper.make_node("Gemm", ["h", "w2", "b2"], ["g"], transB=1),
             helper.make_node("Add", ["g", "h"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    model = make_model(nodes, {"x": ("float32", ["m", kk])}, {"y": "float32"},
                       {"w1": w1, "b1": rng.standard_normal(n).astype(np.float32),
                        "w2": w2, "b2": rng.standard_normal(n).astype(np.float32)})
    compiled = cuvil.compile(model)
    compiled.num_threads = threads
    for m in (1, 4, 6):
        assert_matches_ort(model, {"x": rng.standard_normal([m, kk]).astype(np.float32)},
                           compiled=compiled, **TOL)


def test_weight_made_by_constant_of_shape_is_computed_once():
    """A weight too large to fold (the onnx package's light models' fully connected layers),
    computed at the first run and kept: later runs, at other batch sizes, read it."""
    kk, n = 4100, 4097  # more elements than the frontend folds
    fill = numpy_helper.from_array(np.array([0.01], np.float32))
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"], value=fill),
             helper.make_node("Gemm", ["a", "w", "c"], ["y"], transB=1)]
    model = make_model(nodes, {"a": ("float32", ["m", kk])}, {"y": "float32"},
                       {"shape": np.array([n, kk], np.int64),
                        "c": np.arange(n, dtype=np.float32)})
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(14)
    for m in (1, 3, 6, 1):
        assert_matches_ort(model, {"a": rng.standard_normal([m, kk]).astype(np.float32)},
                           compiled=compiled, rtol=1e-4, atol=1e-3)


def test_squeeze_excite_convs_run_as_gemm():
    """A squeeze-excite block (pool to 1x1, 1x1 conv + Relu, 1x1 conv + HardSigmoid, scale):
    its convs of 1x1 maps become Gemm (passes/fully_connected_convs.py) with the activations
    still fused; a padded 1x1 conv of a 1x1 map (its output is 3x3) stays a conv."""
    from cuvil.compiler.frontend import import_model
    from cuvil.compiler.passes import run_passes

    rng = np.random.default_rng(15)
    c, mid = 72, 24
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["s0"]),
             helper.make_node("Relu", ["s0"], ["s1"]),
             helper.make_node("Conv", ["s1", "w2", "b2"], ["s2"], strides=[2, 2]),
             helper.make_node("HardSigmoid", ["s2"], ["s"], alpha=1 / 6, beta=0.5),
             helper.make_node("Mul", ["x", "s"], ["y"]),
             helper.make_node("Conv", ["p", "w3"], ["z"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, {"x": ("float32", ["m", c, 5, 5])}, {"y": "float32", "z": "float32"},
                       {"w1": rng.standard_normal([mid, c, 1, 1]).astype(np.float32),
                        "b1": rng.standard_normal(mid).astype(np.float32),
                        "w2": rng.standard_normal([c, mid, 1, 1]).astype(np.float32),
                        "b2": rng.standard_normal(c).astype(np.float32),
                        "w3": rng.standard_normal([4, c, 1, 1]).astype(np.float32)})
    graph = run_passes(import_model(model, None, "se"))
    ops = sorted(f"{n.op_type}+{n.attrs.get('cuvil.fused_activation')}" for n in graph.nodes
                 if n.op_type in ("Conv", "Gemm"))
    assert ops == ["Conv+None", "Gemm+HardSigmoid", "Gemm+Relu"], ops
    compiled = cuvil.compile(model)
    for m in (1, 3, 8):
        assert_matches_ort(model, {"x": rng.standard_normal([m, c, 5, 5]).astype(np.float32)},
                           compiled=compiled, **TOL)
