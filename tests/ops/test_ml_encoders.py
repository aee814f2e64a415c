"""LabelEncoder (int->int, int->float, float->int maps, default values) and FeatureVectorizer
written with onnx.helper in the ai.onnx.ml domain, compared with onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil

ort = pytest.importorskip("onnxruntime")

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)]


def _model(node, inputs, outputs):
    graph = helper.make_graph([node], "ml", inputs, outputs)
    return helper.make_model(graph, opset_imports=OPSETS)


def _compare(model, feed):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, feed)
    got = cuvil.compile(model).run(feed)
    for out, want in zip(model.graph.output, expected):
        assert got[out.name].dtype == want.dtype, out.name
        np.testing.assert_array_equal(got[out.name], want, err_msg=out.name)


@pytest.mark.parametrize("keys,values,default,x", [
    ({"keys_int64s": [3, 1, 7]}, {"values_int64s": [10, 20, 30]}, {"default_int64": 99},
     np.array([[3, 1], [7, 5], [-1, 3]], np.int64)),
    ({"keys_int64s": [3, 1, 7]}, {"values_int64s": [10, 20, 30]}, {},  # default -1
     np.array([1, 2, 7, 8], np.int64)),
    ({"keys_int64s": [0, 2]}, {"values_floats": [0.5, -2.25]}, {"default_float": 7.5},
     np.array([[0, 1, 2]], np.int64)),
    ({"keys_floats": [0.5, -1.0, 2.0]}, {"values_int64s": [1, 2, 3]}, {"default_int64": -5},
     np.array([0.5, -1.0, 2.0, 0.25, 3.0], np.float32)),
    ({"keys_floats": [0.5, -1.0]}, {"values_floats": [1.5, 2.5]}, {},  # default -0.0
     np.array([[0.5, -1.0, 4.0]], np.float32)),
])
def test_label_encoder(keys, values, default, x):
    out_type = TensorProto.INT64 if "values_int64s" in values else TensorProto.FLOAT
    in_type = TensorProto.INT64 if x.dtype == np.int64 else TensorProto.FLOAT
    node = helper.make_node("LabelEncoder", ["X"], ["Y"], domain="ai.onnx.ml",
                            **keys, **values, **default)
    model = _model(node, [helper.make_tensor_value_info("X", in_type, list(x.shape))],
                   [helper.make_tensor_value_info("Y", out_type, list(x.shape))])
    _compare(model, {"X": x})


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float64])
def test_feature_vectorizer(dtype):
    # (onnxruntime binds all inputs to one type)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node("FeatureVectorizer", ["A", "B", "C"], ["Y"], domain="ai.onnx.ml",
                            inputdimensions=[2, 1, 3])
    model = _model(node, [
        helper.make_tensor_value_info("A", elem, ["N", 2]),
        helper.make_tensor_value_info("B", elem, ["N", 1]),
        helper.make_tensor_value_info("C", elem, ["N", 3]),
    ], [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 6])])
    rng = np.random.default_rng(0)
    _compare(model, {name: (rng.normal(size=(4, d)) * 10).astype(dtype)
                     for name, d in (("A", 2), ("B", 1), ("C", 3))})
