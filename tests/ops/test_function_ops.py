"""Operators onnx defines as functions of other operators (Attention, RMSNormalization,
Swish...) compile through the body onnx's schema gives; onnx's reference evaluator, which
implements each of them directly, is the oracle."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import cuvil
from cuvil.compiler.frontend import importer
from cuvil.errors import UnsupportedOpError

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, opset, initializers=()):
    graph = helper.make_graph(nodes, "functions", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)  # types the outputs
    onnx.checker.check_model(model)
    return model


def _check(model, compiled, feeds, rtol=1e-5, atol=1e-6):
    want = ReferenceEvaluator(model).run(None, feeds)
    got = compiled.run(feeds)
    assert len(got) == len(want)
    for (name, g), w in zip(got.items(), want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=name)


def _rms_model():
    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, 8, dtype=np.float32), "scale")
    return _model(
        [helper.make_node("RMSNormalization", ["x", "scale"], ["y"], name="norm", axis=-1,
                          epsilon=1e-3)],
        [helper.make_tensor_value_info("x", F, ["batch", "seq", 8])],
        [helper.make_empty_tensor_value_info("y")], opset=23, initializers=[scale])


def test_rms_normalization_compiles_once_for_any_size():
    model = _rms_model()
    compiled = cuvil.compile(model)
    assert [str(d) for d in compiled.inputs[0].shape] == ["batch", "seq", "8"]
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 8), (3, 5, 8)]:
        _check(model, compiled, {"x": rng.standard_normal(shape, dtype=np.float32) * 3})


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_swish_takes_the_attribute_or_the_schema_default(alpha):
    attrs = {} if alpha is None else {"alpha": alpha}
    model = _model([helper.make_node("Swish", ["x"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", F, [2, 7])],
                   [helper.make_empty_tensor_value_info("y")], opset=24)
    x = np.linspace(-6, 6, 14, dtype=np.float32).reshape(2, 7)
    _check(model, cuvil.compile(model), {"x": x})


def test_attention_with_an_omitted_optional_input_and_a_kv_cache():
    # attn_mask (input 3) omitted while past_key/past_value follow it: the body must see it
    # as absent, not pick up an outer value of the same name
    q, k, v = (helper.make_tensor_value_info(n, F, ["b", 2, "s", 4]) for n in ("Q", "K", "V"))
    past = [helper.make_tensor_value_info(n, F, ["b", 2, 3, 4]) for n in ("past_k", "past_v")]
    outs = [helper.make_tensor_value_info("Y", F, ["b", 2, "s", 4]),
            *(helper.make_tensor_value_info(n, F, ["b", 2, "p", 4]) for n in ("present_k", "present_v"))]
    model = _model([helper.make_node("Attention", ["Q", "K", "V", "", "past_k", "past_v"],
                                     ["Y", "present_k", "present_v"], name="attn", is_causal=0)],
                   [q, k, v, *past], outs, opset=23)
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(1)
    for b, s in [(1, 1), (2, 5)]:
        feeds = {n: rng.standard_normal((b, 2, s, 4), dtype=np.float32) for n in ("Q", "K", "V")}
        feeds |= {n: rng.standard_normal((b, 2, 3, 4), dtype=np.float32) for n in ("past_k", "past_v")}
        _check(model, compiled, feeds, rtol=1e-5, atol=1e-5)


def test_an_op_missing_inside_a_body_is_reported_as_the_models_op(monkeypatch):
    real_lookup = importer.lookup

    def without_reduce_mean(domain, op_type, opset):
        return None if op_type == "ReduceMean" else real_lookup(domain, op_type, opset)

    monkeypatch.setattr(importer, "lookup", without_reduce_mean)
    with pytest.raises(UnsupportedOpError) as info:
        importer.import_model(_rms_model())
    message = str(info.value)
    assert "RMSNormalization (opset 23): used by 'norm'" in message
    assert "ReduceMean" not in message
