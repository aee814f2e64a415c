"""Empty inputs (a batch of 0, a sequence of length 0): when every output gets a 0 dim they
come back empty with onnxruntime's shape and dtype, through a call, `run` and `out=`, without
running the library; where an output still holds elements (a reduction over the empty dim, the
empty past of a KV cache) the library runs and gives onnxruntime's values. onnxruntime is the
oracle for every shape and value."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from oracle import make_model, run_ort

import cuvil

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "models" / "classifier.onnx"
F32 = np.float32


def encoder() -> onnx.ModelProto:
    """One attention block and its mean over the sequence: shapes [batch, seq, 16]."""
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal((16, 16)).astype(F32) * 0.25 for n in ("wq", "wk", "wv")}
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"]),
        helper.make_node("Add", ["a", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], axis=-1),
        helper.make_node("ReduceMean", ["y"], ["pooled"], axes=[1], keepdims=0),
    ]
    weights.update(scale=np.array(0.25, F32), gamma=np.ones(16, F32), beta=np.zeros(16, F32))
    return make_model(nodes, {"x": (F32, ["batch", "seq", 16])}, {"y": F32, "pooled": F32},
                      weights)


def reshapes() -> onnx.ModelProto:
    """Reshape with -1, Flatten, Concat along the batch, Gemm, Gather of rows."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Reshape", ["x", "to"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w"], ["logits"]),
        helper.make_node("Flatten", ["x"], ["flat2"], axis=2),
        helper.make_node("Concat", ["x", "x"], ["twice"], axis=0),
        helper.make_node("Gather", ["twice", "rows"], ["picked"], axis=1),
    ]
    init = {"to": np.array([-1, 24], np.int64), "w": rng.standard_normal((24, 5)).astype(F32),
            "rows": np.array([3, 0], np.int64)}
    return make_model(nodes, {"x": (F32, ["batch", 4, 6])},
                      {"logits": F32, "flat2": F32, "twice": F32, "picked": F32}, init)


def nonzero() -> onnx.ModelProto:
    """An output whose length the data decides (NonZero)."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["positive"]),
             helper.make_node("NonZero", ["positive"], ["where"])]
    return make_model(nodes, {"x": (F32, ["batch", 4])}, {"where": np.int64},
                      {"zero": np.array(0.0, F32)})


def assert_same_as_onnxruntime(compiled, model, feeds) -> None:
    expected = run_ort(model, feeds)
    got = compiled.run(feeds)
    for info, want in zip(compiled.outputs, expected):
        assert want.size == 0, f"{info.name}: the case must give onnxruntime an empty output"
        assert got[info.name].shape == want.shape, info.name
        assert got[info.name].dtype == want.dtype, info.name


@pytest.mark.parametrize(("build", "feeds"), [
    (lambda: onnx.load(DIGITS), {"image": np.zeros((0, 1, 8, 8), F32)}),
    (encoder, {"x": np.zeros((0, 7, 16), F32)}),
    (reshapes, {"x": np.zeros((0, 4, 6), F32)}),
    (nonzero, {"x": np.zeros((0, 4), F32)}),
], ids=["digits", "encoder", "reshapes", "nonzero"])
def test_a_batch_of_zero_gives_empty_outputs_shaped_as_onnxruntime(build, feeds) -> None:
    model = build()
    compiled = cuvil.compile(model)
    assert_same_as_onnxruntime(compiled, model, feeds)
    # a non-empty call still runs afterwards, and out= takes empty arrays
    full = {k: np.random.default_rng(2).standard_normal((3, *v.shape[1:])).astype(v.dtype)
            for k, v in feeds.items()}
    for info, want in zip(compiled.outputs, run_ort(model, full)):
        np.testing.assert_allclose(compiled.run(full)[info.name], want, rtol=1e-4, atol=1e-5)
    if len(compiled.outputs) == 1 and not compiled.outputs[0].data_dependent:
        shape = run_ort(model, feeds)[0].shape
        given = np.empty(shape, compiled.outputs[0].dtype)
        assert compiled(*feeds.values(), out=given) is given


def test_an_output_that_keeps_elements_is_computed_as_onnxruntime_computes_it() -> None:
    model = encoder()
    compiled = cuvil.compile(model)
    feeds = {"x": np.zeros((2, 0, 16), F32)}
    y, pooled = run_ort(model, feeds)
    # `pooled` is a [2, 16] mean over nothing: the library runs, `y` stays empty
    assert y.shape == (2, 0, 16) and pooled.shape == (2, 16)
    got = compiled.run(feeds)
    assert got["y"].shape == y.shape
    np.testing.assert_array_equal(got["pooled"], pooled)  # NaN where onnxruntime's is NaN
    # a batch of zero leaves both outputs empty
    assert_same_as_onnxruntime(compiled, model, {"x": np.zeros((0, 3, 16), F32)})


def test_a_reduction_over_an_empty_batch_is_its_identity() -> None:
    model = make_model([helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0)],
                       {"x": (F32, ["batch", 4])}, {"total": F32},
                       {"axes": np.array([0], np.int64)}, opset=13)
    compiled = cuvil.compile(model)
    want = run_ort(model, {"x": np.zeros((0, 4), F32)})[0]
    np.testing.assert_array_equal(want, np.zeros(4))
    np.testing.assert_array_equal(compiled(np.zeros((0, 4), F32)), want)


def kv_cache_attention() -> onnx.ModelProto:
    """One attention step of a decoder with a KV cache: the new keys and values are appended
    to the past ones (its length symbolic, 0 at the first step) and returned as present."""
    rng = np.random.default_rng(4)
    weights = {n: rng.standard_normal((16, 16)).astype(F32) * 0.4 for n in ("wq", "wk", "wv")}
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("MatMul", ["x", "wv"], ["v"]),
        helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=1),
        helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=1),
        helper.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "present_v"], ["y"]),
    ]
    return make_model(nodes, {"x": (F32, ["batch", "seq", 16]),
                              "past_k": (F32, ["batch", "past", 16]),
                              "past_v": (F32, ["batch", "past", 16])},
                      {"y": F32, "present_k": F32, "present_v": F32}, weights)


def test_a_kv_cache_starts_empty_and_grows_as_onnxruntime_s() -> None:
    model = kv_cache_attention()
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(5)
    ours = theirs = {"past_k": np.zeros((2, 0, 16), F32), "past_v": np.zeros((2, 0, 16), F32)}
    length = 0
    for seq in (3, 1, 1, 2):  # a prompt, then a token at a time
        x = rng.standard_normal((2, seq, 16)).astype(F32)
        want = dict(zip(("y", "present_k", "present_v"), run_ort(model, {"x": x, **theirs})))
        got = compiled.run({"x": x, **ours})
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
        length += seq
        assert got["present_k"].shape == (2, length, 16)
        ours = {"past_k": got["present_k"], "past_v": got["present_v"]}
        theirs = {"past_k": want["present_k"], "past_v": want["present_v"]}
