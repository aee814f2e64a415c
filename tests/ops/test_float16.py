"""float16 models as onnxconverter-common's float16 converter makes them from float32 models:
whole-graph float16 and mixed graphs (keep_io_types: float32 inputs and outputs, Casts
inside). cuvil runs their arithmetic in float32 (passes/widen_float16.py); the oracles are
onnxruntime on the same float16 model, the float32 model they were converted from, and
numpy in float64 where float16 arithmetic itself would overflow or lose the result.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil.compiler.frontend.importer import import_model
from cuvil.compiler.passes import run_passes
from tests import light_models
from tests.oracle import make_model, run_ort

float16 = pytest.importorskip("onnxconverter_common.float16")


def to_float16(model: onnx.ModelProto, keep_io_types: bool) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the float32 number ... will be truncated"
        return float16.convert_float_to_float16(model, keep_io_types=keep_io_types)


def conv_net(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv-BN-Relu-MaxPool, Conv-Relu, GlobalAveragePool, Flatten, Gemm, Softmax."""
    w = {
        "w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(8) * 0.1,
        "scale": rng.uniform(0.5, 1.5, 8), "bias": rng.standard_normal(8) * 0.1,
        "mean": rng.standard_normal(8) * 0.1, "var": rng.uniform(0.5, 1.5, 8),
        "w2": rng.standard_normal((16, 8, 3, 3)) * 0.15, "b2": rng.standard_normal(16) * 0.1,
        "fc": rng.standard_normal((10, 16)) * 0.5, "fc_b": rng.standard_normal(10) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["n1"],
                         name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2],
                         name="pool1"),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc", "fc_b"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax"),
    ]
    return make_model(nodes, {"x": (np.float32, ["batch", 3, 16, 16])}, {"probs": np.float32},
                      {k: v.astype(np.float32) for k, v in w.items()})


def mlp(rng: np.random.Generator) -> onnx.ModelProto:
    """MatMul + Add, LayerNormalization, Tanh, MatMul + Add, Softmax; and a ReduceMean."""
    w = {"w1": rng.standard_normal((32, 64)) * 0.2, "b1": rng.standard_normal(64) * 0.1,
         "gamma": rng.uniform(0.5, 1.5, 64), "beta": rng.standard_normal(64) * 0.1,
         "w2": rng.standard_normal((64, 16)) * 0.3, "b2": rng.standard_normal(16) * 0.1}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="fc1_bias"),
        helper.make_node("LayerNormalization", ["hb", "gamma", "beta"], ["ln"], axis=-1,
                         name="norm"),
        helper.make_node("Tanh", ["ln"], ["t"], name="act"),
        helper.make_node("MatMul", ["t", "w2"], ["o"], name="fc2"),
        helper.make_node("Add", ["o", "b2"], ["ob"], name="fc2_bias"),
        helper.make_node("Softmax", ["ob"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("ReduceMean", ["hb"], ["mean"], axes=[1], keepdims=0, name="mean"),
    ]
    return make_model(nodes, {"x": (np.float32, ["batch", 32])},
                      {"probs": np.float32, "mean": np.float32},
                      {k: v.astype(np.float32) for k, v in w.items()})


def compare(model32: onnx.ModelProto, keep_io_types: bool, feeds32: dict[str, np.ndarray]) -> None:
    """cuvil on the float16 model against onnxruntime on it (float16 tolerances, same top-1)
    and against the float32 model."""
    model16 = to_float16(model32, keep_io_types)
    feeds = feeds32 if keep_io_types else {k: v.astype(np.float16) for k, v in feeds32.items()}
    compiled = cuvil.compile(model16)
    got = compiled.run(feeds)
    names = [o.name for o in model16.graph.output]
    for name, theirs, exact in zip(names, run_ort(model16, feeds), run_ort(model32, feeds32)):
        ours = got[name]
        assert ours.dtype == theirs.dtype == (np.float32 if keep_io_types else np.float16)
        np.testing.assert_allclose(ours.astype(np.float32), theirs.astype(np.float32), rtol=1e-2,
                                   atol=1e-2 * float(np.abs(exact).max()), err_msg=name)
        np.testing.assert_allclose(ours.astype(np.float32), exact, rtol=1e-2,
                                   atol=1e-2 * float(np.abs(exact).max()), err_msg=name)
        if ours.ndim == 2 and ours.shape[1] > 1:
            np.testing.assert_array_equal(ours.argmax(1), theirs.argmax(1), err_msg=name)


@pytest.mark.parametrize("keep_io_types", [False, True], ids=["float16", "mixed"])
def test_conv_net(keep_io_types: bool) -> None:
    rng = np.random.default_rng(0)
    compare(conv_net(rng), keep_io_types, {"x": rng.standard_normal((4, 3, 16, 16), np.float32)})


@pytest.mark.parametrize("keep_io_types", [False, True], ids=["float16", "mixed"])
def test_mlp_with_layer_norm_softmax_and_reduce_mean(keep_io_types: bool) -> None:
    rng = np.random.default_rng(1)
    compare(mlp(rng), keep_io_types, {"x": rng.standard_normal((5, 32), np.float32)})


def test_convs_and_gemm_run_in_float32_between_casts() -> None:
    """The mixed conv net's products run on the float32 kernels: every Conv and Gemm (and the
    ops between them) computes float32, the model's own Casts stay at the edges."""
    graph = run_passes(import_model(to_float16(conv_net(np.random.default_rng(0)), True)))
    products = [n for n in graph.nodes if n.op_type in ("Conv", "Gemm")]
    assert len(products) == 3
    assert all(n.outputs[0].type.dtype == np.float32 for n in products)
    assert all(v.type.dtype == np.float32 for n in products for v in n.inputs if v is not None)


def test_float16_stability_where_float16_sums_overflow() -> None:
    """A mean over 8192 values of about 30 sums past float16's largest finite value (65504),
    and LayerNormalization of values near 1000 needs their variance below float16's
    resolution there: both must come out as numpy computes them in float64."""
    rng = np.random.default_rng(2)
    x = (30 + rng.standard_normal((3, 8192))).astype(np.float16)
    ln_x = (1000 + rng.standard_normal((3, 64))).astype(np.float16)
    gamma, beta = np.ones(64, np.float16), np.zeros(64, np.float16)
    model = make_model(
        [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=0),
         helper.make_node("LayerNormalization", ["y", "gamma", "beta"], ["n"], axis=-1)],
        {"x": (np.float16, [3, 8192]), "y": (np.float16, [3, 64])},
        {"m": np.float16, "n": np.float16}, {"gamma": gamma, "beta": beta})
    got = cuvil.compile(model).run({"x": x, "y": ln_x})
    np.testing.assert_allclose(got["m"], x.astype(np.float64).mean(1), rtol=1e-3)
    y = ln_x.astype(np.float64)
    want = (y - y.mean(1, keepdims=True)) / np.sqrt(y.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got["n"].astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_light_squeezenet_mixed_float16() -> None:
    """SqueezeNet 1.0 (onnx's light model, random weights) converted with float32 I/O: the
    class probabilities agree with onnxruntime's on the same model and top-1 with float32."""
    model32 = light_models.dense_model(light_models.LIGHT / "light_squeezenet.onnx")
    model16 = to_float16(model32, keep_io_types=True)
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224), np.float32)
    got = cuvil.compile(model16)(x)
    (theirs,), (exact,) = run_ort(model16, {"data_0": x}), run_ort(model32, {"data_0": x})
    np.testing.assert_allclose(got, theirs, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(got, exact, rtol=1e-2, atol=2e-3)
    assert got.reshape(-1).argmax() == exact.reshape(-1).argmax()


def test_converter_leftover_type_mismatch_is_named() -> None:
    """A Sub of float16 and float32 (what the converter leaves when a Cast to float32 feeds
    arithmetic) is a model error naming the node and the fix."""
    model = make_model(
        [helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT, name="mask_cast"),
         helper.make_node("Sub", ["x", "mf"], ["y"], name="mask_sub")],
        {"x": (np.float32, [2, 4]), "m": (np.int64, [2, 4])}, {"y": np.float32})
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    with pytest.raises(cuvil.CuvilError, match=r"node 'mask_sub' \(Sub\).*insert a Cast"):
        cuvil.compile(model)
