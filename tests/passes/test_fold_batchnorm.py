"""fold_batchnorm: the graph before and after (structure and folded constants), and the
compiled folded model against onnxruntime running the unfused model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from oracle import assert_matches_ort

from cuvil.compiler.frontend import import_model
from cuvil.compiler.passes import PIPELINE, run_passes
from cuvil.compiler.passes.eliminate_dead_code import eliminate_dead_code
from cuvil.compiler.passes.fold_batchnorm import fold_batchnorm
from cuvil.compiler.passes.ir_text import node_label

EPS = 1e-3


def bn_params(rng, c, dtype=np.float32):
    return {"scale": rng.standard_normal(c).astype(dtype), "shift": rng.standard_normal(c).astype(dtype),
            "mean": rng.standard_normal(c).astype(dtype), "var": rng.uniform(0.3, 2, c).astype(dtype)}


def expected_affine(p):
    """BatchNormalization as y = x * a + s, from the spec's formula."""
    a = p["scale"].astype(np.float64) / np.sqrt(p["var"].astype(np.float64) + EPS)
    return a, p["shift"] - p["mean"] * a


def model_with(layer: onnx.NodeProto, x_shape, weights: dict, *, c: int, seed=0, opset=15,
               bn_attrs=None, extra_nodes=(), extra_outputs=(), runtime=(), dtype=np.float32,
               extra_inits=None, outputs=("y",), bn_outputs=("y",)):
    """x -> layer -> t -> BatchNormalization -> y (+ extra nodes reading t)."""
    rng = np.random.default_rng(seed)
    params = bn_params(rng, c, dtype)
    attrs = {"epsilon": EPS, **(bn_attrs or {})}
    bn = helper.make_node("BatchNormalization", ["t", "scale", "shift", "mean", "var"], list(bn_outputs),
                          **attrs)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = {**weights, **params, **(extra_inits or {})}
    inputs = [helper.make_tensor_value_info("x", elem, list(x_shape))]
    for name in runtime:
        inputs.append(helper.make_tensor_value_info(name, elem, list(inits[name].shape)))
    graph = helper.make_graph(
        [layer, bn, *extra_nodes], "g", inputs,
        [helper.make_empty_tensor_value_info(o) for o in (*outputs, *extra_outputs)],
        [numpy_helper.from_array(a, n) for n, a in inits.items() if n not in runtime])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model, params


def folded(model):
    graph = import_model(model)
    return fold_batchnorm(eliminate_dead_code(graph))


def const_of(node, i):
    v = node.input(i)
    assert v is not None and v.const is not None, f"input {i} of {node} is not a constant"
    return v.const


def test_the_pass_runs_in_the_pipeline():
    assert fold_batchnorm in PIPELINE
    assert PIPELINE.index(fold_batchnorm) < len(PIPELINE) - 1  # before weight packing


# -- Conv --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("x_shape", "w_shape", "group", "bias"), [
    (["n", 3, 9, 9], (8, 3, 3, 3), 1, True),
    (["n", 4, 11], (6, 2, 3), 2, False),
    ([1, 4, 5, 6, 7], (4, 1, 2, 2, 2), 4, True),
])
def test_conv_absorbs_batchnorm(x_shape, w_shape, group, bias):
    rng = np.random.default_rng(1)
    weights = {"w": rng.standard_normal(w_shape).astype(np.float32)}
    if bias:
        weights["b"] = rng.standard_normal(w_shape[0]).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w", *(["b"] if bias else [])], ["t"], group=group,
                            pads=[1] * (2 * (len(w_shape) - 2)))
    model, params = model_with(conv, x_shape, weights, c=w_shape[0])

    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Conv"]
    node = graph.nodes[0]
    assert node.outputs[0] is graph.outputs[0] and graph.outputs[0].name == "y"
    a, s = expected_affine(params)
    w = weights["w"].astype(np.float64) * a.reshape((-1,) + (1,) * (len(w_shape) - 1))
    np.testing.assert_allclose(const_of(node, 1), w, rtol=1e-6)
    b = weights.get("b", np.zeros(w_shape[0])) * a + s
    np.testing.assert_allclose(const_of(node, 2), b, rtol=1e-5, atol=1e-6)
    assert const_of(node, 1).dtype == np.float32

    x = rng.standard_normal([2 if d == "n" else d for d in x_shape]).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_shared_weights_stay_unchanged_for_the_other_user():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 3, 1, 1)).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "w"], ["t"])
    other = helper.make_node("Conv", ["x", "w"], ["z"])
    model, _ = model_with(conv, [1, 3, 4, 4], {"w": w}, c=3, extra_nodes=[other],
                          extra_outputs=["z"])
    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Conv", "Conv"]
    untouched = next(n for n in graph.nodes if n.outputs[0].name == "z")
    np.testing.assert_array_equal(const_of(untouched, 1), w)
    x = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


# -- Gemm and MatMul -----------------------------------------------------------------------


@pytest.mark.parametrize(("trans_b", "c_shape", "alpha", "beta"), [
    (0, None, 1.0, 1.0), (1, (6,), 0.5, 2.0), (0, (1, 6), 1.0, 0.5), (1, (5, 6), 1.5, 1.0),
    (0, (), 1.0, 3.0),
])
def test_gemm_absorbs_batchnorm(trans_b, c_shape, alpha, beta):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 4) if trans_b else (4, 6)).astype(np.float32)
    weights = {"w": w}
    ins = ["x", "w"]
    if c_shape is not None:
        weights["c"] = rng.standard_normal(c_shape).astype(np.float32)
        ins.append("c")
    gemm = helper.make_node("Gemm", ins, ["t"], transB=trans_b, alpha=alpha, beta=beta)
    model, params = model_with(gemm, [5, 4], weights, c=6)

    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Gemm"]
    node = graph.nodes[0]
    a, s = expected_affine(params)
    np.testing.assert_allclose(const_of(node, 1), w * (a[:, None] if trans_b else a[None, :]),
                               rtol=1e-6)
    c = beta * weights["c"] if c_shape is not None else 0.0
    np.testing.assert_allclose(const_of(node, 2), np.broadcast_to(c * a + s, const_of(node, 2).shape),
                               rtol=1e-5, atol=1e-6)
    assert node.attrs["beta"] == 1.0

    x = rng.standard_normal((5, 4)).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_matmul_becomes_a_gemm_with_the_folded_bias():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((7, 3)).astype(np.float32)
    model, params = model_with(helper.make_node("MatMul", ["x", "w"], ["t"]), ["n", 7], {"w": w}, c=3)
    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Gemm"]
    node = graph.nodes[0]
    a, s = expected_affine(params)
    np.testing.assert_allclose(const_of(node, 1), w * a[None, :], rtol=1e-6)
    np.testing.assert_allclose(const_of(node, 2), s, rtol=1e-5, atol=1e-6)
    assert node.inputs[0] is graph.inputs[0]
    x = rng.standard_normal((4, 7)).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_float64_weights_fold_in_their_dtype():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 4)).astype(np.float64)
    gemm = helper.make_node("Gemm", ["x", "w"], ["t"])
    model, _ = model_with(gemm, [2, 3], {"w": w}, c=4, dtype=np.float64)
    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Gemm"]
    assert const_of(graph.nodes[0], 1).dtype == np.float64
    assert const_of(graph.nodes[0], 2).dtype == np.float64
    x = rng.standard_normal((2, 3))
    assert_matches_ort(model, {"x": x}, rtol=1e-10, atol=1e-10)


# -- what must stay unfolded -------------------------------------------------------------------


def _conv(ins=("x", "w")):
    return helper.make_node("Conv", list(ins), ["t"])


W = np.random.default_rng(6).standard_normal((3, 3, 1, 1)).astype(np.float32)


@pytest.mark.parametrize("case", ["other_user", "graph_output", "training", "runtime_params",
                                  "runtime_weights", "batched_matmul"])
def test_batchnorm_stays_when_folding_would_change_the_model(case):
    kw: dict = {}
    layer = _conv()
    x_shape: list = [1, 3, 4, 4]
    weights = {"w": W}
    if case == "other_user":
        kw = {"extra_nodes": [helper.make_node("Relu", ["t"], ["r"])], "extra_outputs": ["r"]}
    elif case == "graph_output":
        kw = {"extra_outputs": ["t"]}
    elif case == "training":
        kw = {"bn_attrs": {"training_mode": 1}, "bn_outputs": ("y", "rm", "rv"),
              "extra_outputs": ["rm", "rv"]}
    elif case == "runtime_params":
        kw = {"runtime": ["mean"]}
    elif case == "runtime_weights":
        kw = {"runtime": ["w"]}
    elif case == "batched_matmul":
        # [B, M, K] @ [K, N]: BatchNormalization's channel axis 1 is M, not the weights' N
        layer = helper.make_node("MatMul", ["x", "w"], ["t"])
        x_shape = [2, 3, 5]
        weights = {"w": np.random.default_rng(7).standard_normal((5, 4)).astype(np.float32)}
    model, _ = model_with(layer, x_shape, weights, c=3, **kw)
    graph = folded(model)
    ops = [n.op_type for n in graph.nodes]
    if case in ("training", "runtime_params"):  # not an affine map of constants
        assert "BatchNormalization" in ops
    else:  # not folded into the layer: a Mul and an Add of per-channel constants after it
        assert ops == [layer.op_type, "Mul", "Add", *ops[3:]], ops
        assert graph.nodes[0].inputs[1].name == "w"  # type: ignore[union-attr]
    feeds = {"x": np.random.default_rng(8).standard_normal(x_shape).astype(np.float32)}
    for name in kw.get("runtime", []):
        feeds[name] = (np.abs(W) if name == "w" else
                       np.random.default_rng(9).standard_normal(3).astype(np.float32))
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4)


def test_a_chain_of_two_batchnorms_folds_twice():
    rng = np.random.default_rng(10)
    conv = _conv()
    second = bn_params(rng, 3)
    bn2 = helper.make_node("BatchNormalization", ["y", "s2", "b2", "m2", "v2"], ["y2"], epsilon=EPS)
    extra = {name: second[key] for name, key in (("s2", "scale"), ("b2", "shift"), ("m2", "mean"),
                                                 ("v2", "var"))}
    model, _ = model_with(conv, [1, 3, 4, 4], {"w": W}, c=3, extra_nodes=[bn2], outputs=(),
                          extra_outputs=["y2"], extra_inits=extra)
    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Conv"]
    x = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


# -- per-channel Mul and Add -------------------------------------------------------------------


def _scale_shift_model(x_shape, layer, weights, consts, ops, tail_relu=True):
    """x -> layer -> t -> (Mul/Add by constants, in `ops` order) -> [Relu] -> y."""
    nodes, prev = [layer], "t"
    for i, (op, name) in enumerate(ops):
        out = f"s{i}"
        ins = [prev, name] if i % 2 == 0 else [name, prev]  # either operand order
        nodes.append(helper.make_node(op, ins, [out]))
        prev = out
    nodes.append(helper.make_node("Relu" if tail_relu else "Identity", [prev], ["y"]))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(x_shape))],
        [helper.make_empty_tensor_value_info("y")],
        [numpy_helper.from_array(a, n) for n, a in {**weights, **consts}.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


@pytest.mark.parametrize(("scale_shape", "shift_shape"), [
    ((8, 1, 1), (8, 1, 1)), ((1, 8, 1, 1), (8, 1, 1)), ((), (1,)),
])
def test_conv_absorbs_a_per_channel_mul_and_add(scale_shape, shift_shape):
    rng = np.random.default_rng(11)
    weights = {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
               "b": rng.standard_normal(8).astype(np.float32)}
    consts = {"sc": rng.standard_normal(scale_shape).astype(np.float32),
              "sh": rng.standard_normal(shift_shape).astype(np.float32)}
    conv = helper.make_node("Conv", ["x", "w", "b"], ["t"], pads=[1] * 4)
    model = _scale_shift_model(["n", 3, 7, 7], conv, weights, consts, [("Mul", "sc"), ("Add", "sh")])
    graph = folded(model)
    assert [n.op_type for n in graph.nodes] == ["Conv", "Relu"]
    for batch in (1, 2):
        x = rng.standard_normal((batch, 3, 7, 7)).astype(np.float32)
        assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_gemm_absorbs_a_per_column_mul():
    rng = np.random.default_rng(12)
    weights = {"w": rng.standard_normal((5, 6)).astype(np.float32)}
    consts = {"sc": rng.standard_normal(6).astype(np.float32),
              "sh": rng.standard_normal((1, 6)).astype(np.float32)}
    gemm = helper.make_node("Gemm", ["x", "w"], ["t"])
    model = _scale_shift_model([3, 5], gemm, weights, consts, [("Mul", "sc"), ("Add", "sh")],
                               tail_relu=False)
    assert [n.op_type for n in folded(model).nodes] == ["Gemm", "Identity"]
    assert_matches_ort(model, {"x": rng.standard_normal((3, 5)).astype(np.float32)},
                       rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["per_position", "per_image", "widening"])
def test_a_mul_that_is_not_per_channel_stays(case):
    rng = np.random.default_rng(13)
    shape = {"per_position": (1, 1, 5, 5), "per_image": (2, 1, 1, 1),
             "widening": (3, 8, 1, 1)}[case]
    weights = {"w": rng.standard_normal((8, 3, 1, 1)).astype(np.float32)}
    consts = {"sc": rng.standard_normal(shape).astype(np.float32)}
    x_shape = (2 if case == "per_image" else 1, 3, 5, 5)
    conv = helper.make_node("Conv", ["x", "w"], ["t"])
    model = _scale_shift_model(x_shape, conv, weights, consts, [("Mul", "sc")])
    assert "Mul" in [n.op_type for n in folded(model).nodes]
    x = rng.standard_normal(x_shape).astype(np.float32)
    assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_a_batchnorm_no_producer_absorbs_runs_in_one_pass_with_the_ops_around_it():
    """DenseNet's pre-activation: Concat -> BatchNormalization -> Mul -> Add -> Relu -> Conv.
    The normalization becomes a per-channel Mul and Add, and fuse_elementwise runs all five
    steps in one pass over the concatenation (two passes before: BatchNormalization, then
    Fused(Mul+Add+Relu))."""
    rng = np.random.default_rng(11)
    c = 6
    params = bn_params(rng, c)
    inits = {**params, "m": rng.standard_normal((c, 1, 1)).astype(np.float32),
             "a": rng.standard_normal((c, 1, 1)).astype(np.float32),
             "w": rng.standard_normal((4, c, 1, 1)).astype(np.float32)}
    nodes = [helper.make_node("Concat", ["x1", "x2"], ["cat"], axis=1),
             helper.make_node("BatchNormalization", ["cat", "scale", "shift", "mean", "var"],
                              ["bn"], epsilon=EPS),
             helper.make_node("Mul", ["bn", "m"], ["scaled"]),
             helper.make_node("Add", ["scaled", "a"], ["shifted"]),
             helper.make_node("Relu", ["shifted"], ["act"]),
             helper.make_node("Conv", ["act", "w"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x1", onnx.TensorProto.FLOAT, ["n", 2, 5, 5]),
                     helper.make_tensor_value_info("x2", onnx.TensorProto.FLOAT, ["n", 4, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 4, 5, 5])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    onnx.checker.check_model(model)
    ops = [node_label(n) for n in run_passes(import_model(model)).nodes]
    assert ops[:2] == ["Concat", "Fused(Mul+Add+Mul+Add+Relu)"] and len(ops) == 3, ops
    feeds = {"x1": rng.standard_normal((2, 2, 5, 5)).astype(np.float32),
             "x2": rng.standard_normal((2, 4, 5, 5)).astype(np.float32)}
    assert_matches_ort(model, feeds, rtol=1e-4, atol=1e-4)
