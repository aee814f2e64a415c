"""Ops whose loops run on the thread pool, at num_threads 1 and 2, against onnxruntime.

One model with a symbolic batch holds every parallel path, at sizes large enough for the pool
to split them (its threshold is about 32K multiply-adds) and that do not split evenly: a 3x3
Conv whose output is too small to unfold by chunks (its X' is unfolded over the channels, its
product split by rows), a 3x3 Conv unfolded by chunks of rows, pointwise Convs split by
columns and by rows, MaxPool and AveragePool (over image x channel planes), the global pools,
Concat and Split (copies cut into pieces, rows not a whole number of pieces), MatMuls
split by rows and by columns, and grouped Convs (one loop over group x chunk tasks).
Splitting never changes what one output element sums, so the 1- and 2-thread results must be
identical; both must match onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from oracle import make_model, run_ort

import cuvil

RNG = np.random.default_rng(8)


def weights(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)


def parallel_model() -> onnx.ModelProto:
    nodes = [
        # 37 channels of 15x13: chunks of X' too few, the whole X' unfolded in parallel (5x5:
        # a 3x3 with unit strides would run as a Winograd convolution)
        helper.make_node("Conv", ["x", "w_small"], ["c_small"], pads=[2, 2, 2, 2]),
        # 5x5 on 29x31: unfolded by chunks of output rows
        helper.make_node("Conv", ["x2", "w_rows", "b_rows"], ["c_rows"], pads=[2, 1, 2, 3]),
        # pointwise: M=24 < N=195 (columns), M=203 >= N=195 (rows)
        helper.make_node("Conv", ["c_small", "w_pw_cols"], ["pw_cols"]),
        helper.make_node("Conv", ["c_small", "w_pw_rows", "b_pw_rows"], ["pw_rows"]),
        # grouped: depthwise on a small map (one task per channel), 3 groups of 3x3 unfolded
        # by chunks of rows, 3 pointwise groups (Relu and the bias fused)
        helper.make_node("Conv", ["c_small", "w_dw", "b_dw"], ["dw"], group=61,
                         pads=[1, 1, 1, 1], strides=[2, 1]),
        helper.make_node("Conv", ["c_rows", "w_g3"], ["g3"], group=3, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c_rows", "w_g3pw", "b_g3pw"], ["g3pw_pre"], group=3),
        helper.make_node("Relu", ["g3pw_pre"], ["g3pw"]),
        helper.make_node("MaxPool", ["c_rows"], ["maxpool"], kernel_shape=[3, 3], strides=[2, 2]),
        helper.make_node("AveragePool", ["c_rows"], ["avgpool"], kernel_shape=[3, 2],
                         strides=[2, 1], pads=[1, 0, 1, 1], count_include_pad=1),
        helper.make_node("GlobalAveragePool", ["c_rows"], ["gap"]),
        helper.make_node("GlobalMaxPool", ["c_rows"], ["gmp"]),
        helper.make_node("Concat", ["c_rows", "x2", "c_rows"], ["concat"], axis=1),
        helper.make_node("Split", ["concat", "split_sizes"], ["split_a", "split_b"], axis=1),
        helper.make_node("MatMul", ["m_tall", "m_b"], ["mm_rows"]),
        helper.make_node("MatMul", ["m_wide", "m_c"], ["mm_cols"]),
    ]
    inputs = {"x": (np.float32, ["batch", 37, 15, 13]), "x2": (np.float32, ["batch", 19, 29, 31]),
              "m_tall": (np.float32, ["batch", 301, 67]),
              "m_wide": (np.float32, ["batch", 21, 91])}
    outputs = dict.fromkeys(("c_small", "pw_cols", "pw_rows", "maxpool", "avgpool", "gap", "gmp",
                             "concat", "split_a", "split_b", "mm_rows", "mm_cols", "dw", "g3",
                             "g3pw"), np.float32)
    inits = {
        "w_small": weights(61, 37, 5, 5), "w_rows": weights(45, 19, 5, 5),
        "b_rows": weights(45), "w_pw_cols": weights(24, 61, 1, 1),
        "w_pw_rows": weights(203, 61, 1, 1), "b_pw_rows": weights(203),
        "m_b": weights(67, 53), "m_c": weights(91, 517),
        "split_sizes": np.array([50, 59], np.int64),
        "w_dw": weights(61, 1, 3, 3), "b_dw": weights(61), "w_g3": weights(30, 15, 3, 3),
        "w_g3pw": weights(21, 15, 1, 1), "b_g3pw": weights(21),
    }
    return make_model(nodes, inputs, outputs, inits)


@pytest.fixture(scope="module")
def compiled():
    model = parallel_model()
    return model, cuvil.compile(model)


@pytest.mark.parametrize("batch", [1, 3])
def test_outputs_equal_on_one_and_two_threads_and_match_onnxruntime(compiled, batch) -> None:
    model, m = compiled
    rng = np.random.default_rng(batch)
    feeds = {i.name: rng.standard_normal(
        [batch if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
    ).astype(np.float32) for i in model.graph.input}
    expected = dict(zip([o.name for o in model.graph.output], run_ort(model, feeds)))
    results = {}
    for threads in (1, 2):
        m.num_threads = threads
        results[threads] = m.run(feeds)
    for name, want in expected.items():
        np.testing.assert_allclose(results[1][name], want, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_array_equal(results[2][name], results[1][name], err_msg=name)


def batch_conv_model() -> onnx.ModelProto:
    """Convs whose images share one parallel loop when the batch has several (ops/_conv_gemm.py
    `_batch_pointwise`, `_batch_of_chunks`, `_batch_transposed`), with residual and
    activation epilogues, and a grouped one ((image, group, chunk) tasks); at batch 1 they run
    image by image."""
    nodes = [
        # pointwise on 23x29 (columns split per image), the residual and Relu fused
        helper.make_node("Conv", ["x", "w_pw", "b_pw"], ["pw_pre"]),
        helper.make_node("Add", ["pw_pre", "x_res"], ["pw_sum"]),
        helper.make_node("Relu", ["pw_sum"], ["pw"]),
        # 5x5 on 23x29: chunks of output rows; HardSigmoid fused
        helper.make_node("Conv", ["x", "w_rows", "b_rows"], ["rows_pre"], pads=[2, 1, 2, 3]),
        helper.make_node("HardSigmoid", ["rows_pre"], ["rows"]),
        # 3x3 stride 2 on 23x29 -> 11x14: too few chunks for one image, the residual fused
        helper.make_node("Conv", ["x", "w_few"], ["few_pre"], strides=[2, 2]),
        helper.make_node("Add", ["few_pre", "few_res"], ["few"]),
        # 7x7 maps (transposed products): pointwise with residual and Relu, 5x5 with bias
        helper.make_node("Conv", ["s", "w_tpw", "b_tpw"], ["tpw_pre"]),
        helper.make_node("Add", ["tpw_pre", "s_res"], ["tpw_sum"]),
        helper.make_node("Relu", ["tpw_sum"], ["tpw"]),
        helper.make_node("Conv", ["s", "w_t5", "b_t5"], ["t5_pre"], pads=[2, 2, 2, 2]),
        helper.make_node("Relu", ["t5_pre"], ["t5"]),
        # grouped 3x3 with bias and residual
        helper.make_node("Conv", ["x", "w_g", "b_g"], ["g_pre"], group=2, pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["g_pre", "g_res"], ["g"]),
    ]
    inputs = {"x": (np.float32, ["batch", 12, 23, 29]),
              "x_res": (np.float32, ["batch", 40, 23, 29]),
              "few_res": (np.float32, ["batch", 33, 11, 14]),
              "s": (np.float32, ["batch", 24, 7, 7]),
              "s_res": (np.float32, ["batch", 48, 7, 7]),
              "g_res": (np.float32, ["batch", 18, 23, 29])}
    outputs = dict.fromkeys(("pw", "rows", "few", "tpw", "t5", "g"), np.float32)
    inits = {
        "w_pw": weights(40, 12, 1, 1), "b_pw": weights(40),
        "w_rows": weights(26, 12, 5, 5), "b_rows": weights(26),
        "w_few": weights(33, 12, 3, 3),
        "w_tpw": weights(48, 24, 1, 1), "b_tpw": weights(48),
        "w_t5": weights(32, 24, 5, 5), "b_t5": weights(32),
        "w_g": weights(18, 6, 3, 3), "b_g": weights(18),
    }
    return make_model(nodes, inputs, outputs, inits)


@pytest.fixture(scope="module")
def batch_compiled():
    model = batch_conv_model()
    return model, cuvil.compile(model)


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_batched_convs_on_one_and_two_threads_match_onnxruntime(batch_compiled, batch) -> None:
    model, m = batch_compiled
    rng = np.random.default_rng(10 + batch)
    feeds = {i.name: rng.standard_normal(
        [batch if d.dim_param else d.dim_value for d in i.type.tensor_type.shape.dim]
    ).astype(np.float32) for i in model.graph.input}
    expected = dict(zip([o.name for o in model.graph.output], run_ort(model, feeds)))
    results = {}
    for threads in (1, 2):
        m.num_threads = threads
        results[threads] = m.run(feeds)
    for name, want in expected.items():
        for threads in (1, 2):
            np.testing.assert_allclose(results[threads][name], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name} at {threads} threads")
        np.testing.assert_array_equal(results[2][name], results[1][name], err_msg=name)


def test_static_batch_convs_match_onnxruntime() -> None:
    """A static batch of 4 compiles only the batched paths."""
    model = batch_conv_model()
    for i in model.graph.input:
        i.type.tensor_type.shape.dim[0].dim_value = 4
    for o in model.graph.output:
        o.type.tensor_type.shape.dim[0].dim_value = 4
    m = cuvil.compile(model)
    rng = np.random.default_rng(4)
    feeds = {i.name: rng.standard_normal(
        [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input}
    expected = dict(zip([o.name for o in model.graph.output], run_ort(model, feeds)))
    for threads in (1, 2):
        m.num_threads = threads
        got = m.run(feeds)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name} at {threads} threads")
