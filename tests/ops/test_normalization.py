"""Normalizations and the softmax family against onnxruntime (or onnx's reference evaluator
where onnxruntime has no kernel for a dtype): random ranks and axes (negative ones too),
symbolic dims at several sizes (1, odd, and past the 256-lane tile), every opset spelling,
float32 / float64 / float16.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

SIZES = ({"n": 3, "m": 5}, {"n": 1, "m": 300}, {"n": 2, "m": 1})
F16 = {"rtol": 5e-3, "atol": 5e-3}


def check_typed(nodes, feeds, outputs, consts=None, *, opset, sizes=SIZES, oracle="ort",
                rtol=1e-4, atol=1e-4, seed=0):
    """Compile one model whose outputs are typed by hand (`outputs`: name -> (dtype, shape)),
    for function ops (GroupNormalization, MeanVarianceNormalization) whose bodies onnx's
    strict shape inference trips over; compare every output with the oracle at each size."""
    def vi(name, dtype, shape):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                             list(shape))

    graph = helper.make_graph(
        nodes, "g", [vi(n, *spec) for n, spec in feeds.items()],
        [vi(n, *spec) for n, spec in outputs.items()],
        [onnx.numpy_helper.from_array(np.asarray(a), n) for n, a in (consts or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 17 else 10
    onnx.checker.check_model(model)
    compiled = cuvil.compile(model)
    rng = _rng(seed)
    for binding in sizes:
        data = {n: rng.standard_normal(static(shape, binding)).astype(dtype)
                for n, (dtype, shape) in feeds.items()}
        if oracle == "ort":
            import onnxruntime as ort

            want = ort.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"]).run(None, data)
        else:
            from onnx.reference import ReferenceEvaluator

            want = ReferenceEvaluator(model).run(None, data)
        got = compiled.run(data)
        for name, expected in zip(outputs, want):
            np.testing.assert_allclose(got[name], expected, rtol=rtol, atol=atol,
                                       err_msg=f"{name} at {binding}")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def static(shape, sizes=SIZES[0]):
    return [sizes.get(d, d) if isinstance(d, str) else d for d in shape]


# -- softmax family -------------------------------------------------------------------------


def softmax_cases(opset: int, dtype, seed: int, ops=("Softmax", "LogSoftmax", "Hardmax"),
                  oracle: str = "ort") -> list[Case]:
    rng = _rng(seed)
    shapes = [["n", 7], [3, "m"], ["n", 4, "m"], [2, 3, 5, "m"], [1, "n", 9, 2], [6]]
    cases = []
    for i, shape in enumerate(shapes):
        rank = len(shape)
        for op in ops:
            axis = int(rng.integers(-rank, rank))
            cases.append(Case(op, ["x"], {"axis": axis}, feeds={"x": (dtype, shape)},
                              oracle=oracle, label=f"{op} case {i}"))
    # the default axis (1 before opset 13, -1 from 13 on)
    cases.append(Case(ops[0], ["x"], {}, feeds={"x": (dtype, ["n", 3, "m"])}, oracle=oracle))
    return cases


@pytest.mark.parametrize("opset", [11, 13])
def test_softmax_family_float32(opset):
    check_cases(softmax_cases(opset, np.float32, opset), sizes=SIZES, opset=opset)


def test_softmax_family_float64_and_float16():
    cases = softmax_cases(13, np.float64, 1, ops=("Softmax", "LogSoftmax"))
    # onnxruntime has no float64 Hardmax kernel
    cases += softmax_cases(13, np.float64, 2, ops=("Hardmax",), oracle="reference")
    check_cases(cases, sizes=SIZES[:2], opset=13, rtol=1e-10, atol=1e-12)
    check_cases(softmax_cases(13, np.float16, 3), sizes=SIZES[:2], opset=13, **F16)


def test_softmax_is_stable_for_large_inputs():
    def big(rng, dtype, shape):
        return (rng.standard_normal(shape) * 30 + 1000).astype(dtype)

    cases = [Case(op, ["x"], {"axis": axis}, feeds={"x": (np.float32, ["n", 3, "m"])}, data=big)
             for op in ("Softmax", "LogSoftmax") for axis in (-1, 1)]
    check_cases(cases, sizes=SIZES, opset=13, rtol=1e-4, atol=1e-5)


def test_softmax_over_contiguous_rows():
    """float32 Softmax over the innermost axis (attention's scores) runs on the vector row
    kernel: row lengths below, at and past the vector width with a scalar tail, symbolic rows
    and row lengths, the flattened pre-13 form, and rows whose entries lie far below their
    max (exp flushed to 0), hold -inf or a NaN (the row becomes NaN, as in onnxruntime)."""
    def spread(rng, dtype, shape):
        x = rng.standard_normal(shape) * 40
        flat = x.reshape(-1, shape[-1])
        flat[0, 0] = -np.inf
        flat[-1, -1] = 200.0  # the rest of that row underflows: e^(x - 200) ~ 0
        if flat.shape[0] > 2:
            flat[1, flat.shape[1] // 2] = np.nan
        return x.astype(dtype)

    def attention(rng, dtype, shape):  # scores of a 12-head layer, mask-like large negatives
        x = rng.standard_normal(shape) * 3
        x[..., -2:] = -1e4
        return x.astype(dtype)

    cases = [Case("Softmax", ["x"], {"axis": -1}, feeds={"x": (np.float32, ["n", 3, "m"])},
                  label="rows of m"),
             Case("Softmax", ["x"], {"axis": 2}, feeds={"x": (np.float32, [2, "n", "m"])},
                  data=spread, label="spread rows"),
             Case("Softmax", ["x"], {"axis": -1}, feeds={"x": (np.float32, ["n", 12, 37, 37])},
                  data=attention, label="attention scores")]
    sizes = ({"n": 1, "m": 1}, {"n": 3, "m": 15}, {"n": 2, "m": 16}, {"n": 4, "m": 17},
             {"n": 2, "m": 128}, {"n": 1, "m": 300})
    check_cases(cases, sizes=sizes, opset=13, rtol=1e-5, atol=1e-7)
    # before opset 13 the input is flattened to 2-D at axis: the rows are [axis:] (contiguous)
    flat = [Case("Softmax", ["x"], {"axis": 1}, feeds={"x": (np.float32, ["n", 3, "m"])},
                 data=spread, label="flattened")]
    check_cases(flat, sizes=sizes, opset=11, rtol=1e-5, atol=1e-7)


def test_softmax_rows_exp_is_accurate_over_its_range():
    """The row kernel's exp(x - max) against float64 numpy over a dense sweep of x - max in
    [-110, 0]: within a few ulp where the result is normal, below 2^-126 (flushed) past it."""
    x = np.linspace(-110.0, 0.0, 200_003).astype(np.float32)
    # rows of 16 x (whole vectors) and a 0 (the scalar tail): softmax = [e^x]*16 + [1], / sum
    rows = np.concatenate([np.repeat(x[:, None], 16, axis=1), np.zeros((x.size, 1), np.float32)],
                          axis=1)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 17])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 17])]),
        opset_imports=[helper.make_opsetid("", 13)])
    got = cuvil.compile(model).run({"x": rows})["y"]
    e = np.exp(x.astype(np.float64))
    want = np.concatenate([np.repeat((e / (1 + 16 * e))[:, None], 16, axis=1),
                           (1 / (1 + 16 * e))[:, None]], axis=1)
    normal = want[:, 0] >= 2.0 ** -126
    np.testing.assert_allclose(got[normal], want[normal], rtol=5e-7, atol=0)
    assert (got[~normal, :16] < 2.0 ** -126).all() and (got[~normal, 16] == 1).all()


def test_hardmax_picks_the_first_of_equal_maxima():
    def ties(rng, dtype, shape):
        return rng.integers(0, 3, size=shape).astype(dtype)

    cases = [Case("Hardmax", ["x"], {"axis": axis}, feeds={"x": (np.float32, ["n", 4, "m"])},
                  data=ties) for axis in (0, 1, 2)]
    check_cases(cases, sizes=SIZES, opset=13)


# -- LpNormalization --------------------------------------------------------------------------


def test_lp_normalization():
    def with_zero_rows(rng, dtype, shape):
        x = rng.standard_normal(shape).astype(dtype)
        x.reshape(-1)[: shape[-1]] = 0  # a zero row along the last axis
        return x

    layouts = ((-1, ["n", "m"]), (0, ["n", 3, "m"]), (1, [2, 5, "m"]), (-2, [4, "n"]))
    cases = [Case("LpNormalization", ["x"], {"p": p, "axis": axis}, feeds={"x": (np.float32, shape)},
                  data=with_zero_rows) for p in (1, 2) for axis, shape in layouts]
    cases += [Case("LpNormalization", ["x"], {"p": p, "axis": axis}, feeds={"x": (np.float64, shape)},
                   data=with_zero_rows) for p, (axis, shape) in zip((1, 2), layouts[:2])]
    check_cases(cases, sizes=SIZES, opset=13)
    cases = [Case("LpNormalization", ["x"], {"p": p, "axis": axis}, feeds={"x": (np.float16, shape)},
                  data=with_zero_rows) for p, (axis, shape) in zip((1, 2), layouts[1:3])]
    check_cases(cases, sizes=SIZES[:2], opset=13, **F16)


# -- BatchNormalization -----------------------------------------------------------------------


def bn_case(dtype, shape, opset: int, seed: int, *, spatial: int | None = None, training=False,
            param_dtype=None, eps: float | None = None, runtime_params=False, oracle="ort") -> Case:
    rng = _rng(seed)
    c = shape[1]
    pshape = [c] if spatial in (None, 1) else static(shape[1:])
    pd = np.dtype(param_dtype or dtype)
    params = {"scale": rng.standard_normal(pshape).astype(pd),
              "B": rng.standard_normal(pshape).astype(pd),
              "mean": rng.standard_normal(pshape).astype(pd),
              "var": rng.uniform(0.2, 2.0, pshape).astype(pd)}
    attrs: dict = {}
    if eps is not None:
        attrs["epsilon"] = eps
    if spatial is not None:
        attrs["spatial"] = spatial
    outputs = ["y"]
    if training:
        attrs["training_mode"] = 1
        attrs["momentum"] = 0.8
        outputs = ["y", "running_mean", "running_var"]
    feeds = {"x": (dtype, shape)}
    if runtime_params:
        feeds.update(dict.fromkeys(params, (pd, pshape)))
        params = {}
    return Case("BatchNormalization", ["x", "scale", "B", "mean", "var"], attrs, feeds=feeds,
                consts=params, outputs=outputs, oracle=oracle,
                label=f"BN opset {opset} {np.dtype(dtype).name}")


@pytest.mark.parametrize("opset", [7, 9, 15])
def test_batchnorm_inference_ranks_2_to_5(opset):
    shapes = [["n", 3], ["n", 4, "m"], [2, 3, "m", 5], ["n", 2, 3, 4, 5]]
    cases = [bn_case(np.float32, s, opset, i, eps=[None, 1e-3][i % 2]) for i, s in enumerate(shapes)]
    cases.append(bn_case(np.float32, [2, 5, "m"], opset, 9, runtime_params=True))
    if opset == 7:
        cases += [bn_case(np.float32, s, 7, 10 + i, spatial=0)
                  for i, s in enumerate([[2, 3, 4], [2, 3, 2, 5], ["n", 4]])]
    if opset == 15:
        cases.append(bn_case(np.float16, [2, 3, "m"], 15, 20, param_dtype=np.float32))
    check_cases(cases, sizes=SIZES, opset=opset, rtol=1e-3 if opset == 15 else 1e-4, atol=1e-3)


def test_batchnorm_float64_and_float16():
    cases = [bn_case(np.float64, s, 15, i) for i, s in enumerate([["n", 3, "m"], [2, 4, 3, 3]])]
    check_cases(cases, sizes=SIZES, opset=15, rtol=1e-10, atol=1e-10)
    cases = [bn_case(np.float16, s, 15, i) for i, s in enumerate([["n", 3, "m"], [2, 4, 3, 3]])]
    check_cases(cases, sizes=SIZES[:2], opset=15, **F16)


def test_batchnorm_training_mode_uses_batch_statistics():
    cases = [bn_case(np.float32, s, 15, i, training=True)
             for i, s in enumerate([[4, 3, "m"], ["n", 2, 3, 3], [5, 3]])]
    check_cases(cases, sizes=SIZES[:2], opset=15, rtol=1e-4, atol=1e-4)


# -- LayerNormalization -----------------------------------------------------------------------


def ln_case(dtype, shape, axis, seed, *, bias=True, scale_rank=None, eps=None, stats=True,
            stash_type=None, oracle="ort") -> Case:
    rng = _rng(seed)
    rank = len(shape)
    norm = static(shape[axis % rank:])
    sshape = norm if scale_rank is None else norm[len(norm) - scale_rank:]
    consts = {"scale": rng.standard_normal(sshape).astype(dtype)}
    inputs = ["x", "scale"]
    if bias:
        consts["B"] = rng.standard_normal(sshape).astype(dtype)
        inputs.append("B")
    attrs: dict = {"axis": axis}
    if eps is not None:
        attrs["epsilon"] = eps
    if stash_type is not None:
        attrs["stash_type"] = stash_type
    return Case("LayerNormalization", inputs, attrs, feeds={"x": (dtype, shape)}, consts=consts,
                outputs=["y", "mean", "inv_std"] if stats else ["y"], oracle=oracle,
                label=f"LayerNorm {np.dtype(dtype).name}")


def test_layer_normalization_float32():
    cases = []
    for i, (shape, axis) in enumerate([(["n", 5], -1), (["n", 300], 1), (["m", 3, 7], -1),
                                       (["n", 3, 4], 1), ([2, 3, 4], 0), ([2, "n", 3, 5], -2),
                                       ([2, 3, 4, 5], -3), ([7], 0), (["n", "m", 9], 2)]):
        cases.append(ln_case(np.float32, shape, axis, i, bias=i % 3 != 0, eps=[None, 1e-3][i % 2],
                             stats=i % 4 != 1))
    # Scale and B broadcast over the leading normalized axes
    cases.append(ln_case(np.float32, ["n", 3, 6], 1, 20, scale_rank=1))
    check_cases(cases, sizes=SIZES, opset=17, rtol=1e-4, atol=1e-4)


def test_layer_normalization_float64_and_float16():
    cases = [ln_case(np.float64, s, a, i) for i, (s, a) in enumerate([(["n", "m", 6], -1),
                                                                      ([2, 3, 4], 1)])]
    check_cases(cases, sizes=SIZES, opset=17, rtol=1e-6, atol=1e-6)
    cases = [ln_case(np.float16, s, a, i) for i, (s, a) in enumerate([(["n", "m", 6], -1),
                                                                      ([2, 3, 4], 1)])]
    check_cases(cases, sizes=SIZES[:2], opset=17, **F16)


def test_layer_normalization_float64_stash():
    """stash_type=11 (float64 statistics) has neither an onnxruntime kernel nor a reference
    implementation: the spec's formula in numpy float64 is the oracle."""
    rng = _rng(11)
    scale, bias = rng.standard_normal(6), rng.standard_normal(6)
    nodes = [helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"],
                              stash_type=11, epsilon=1e-3)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 6]),
         helper.make_tensor_value_info("mean", onnx.TensorProto.DOUBLE, ["n", 1]),
         helper.make_tensor_value_info("inv", onnx.TensorProto.DOUBLE, ["n", 1])],
        [onnx.numpy_helper.from_array(scale.astype(np.float32), "s"),
         onnx.numpy_helper.from_array(bias.astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    m = cuvil.compile(model)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    got = m.run({"x": x})
    xd = x.astype(np.float64)
    mean = xd.mean(axis=1, keepdims=True)
    inv = 1 / np.sqrt(((xd - mean) ** 2).mean(axis=1, keepdims=True) + np.float32(1e-3))
    np.testing.assert_allclose(got["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(got["inv"], inv, rtol=1e-12)
    y = (xd - mean) * inv * scale.astype(np.float32) + bias.astype(np.float32)
    np.testing.assert_allclose(got["y"], y.astype(np.float32), rtol=1e-5, atol=1e-6)


# -- Instance, Group, MeanVariance, LRN -------------------------------------------------------


def affine_case(op, dtype, shape, seed, size=None, attrs=None, oracle="ort") -> Case:
    rng = _rng(seed)
    c = size if size is not None else shape[1]
    return Case(op, ["x", "scale", "bias"], dict(attrs or {}), feeds={"x": (dtype, shape)},
                consts={"scale": rng.standard_normal([c]).astype(dtype),
                        "bias": rng.standard_normal([c]).astype(dtype)}, oracle=oracle,
                label=f"{op} {np.dtype(dtype).name}")


def test_instance_normalization():
    shapes = [["n", 3, "m"], [2, 4, 3, 5], [1, 2, 3, 2, "m"], [2, 3, 1]]
    cases = [affine_case("InstanceNormalization", np.float32, s, i,
                         attrs={"epsilon": 1e-3} if i % 2 else None) for i, s in enumerate(shapes)]
    # onnxruntime has no float64 kernel
    cases.append(affine_case("InstanceNormalization", np.float64, ["n", 3, "m"], 7, oracle="reference"))
    check_cases(cases, sizes=SIZES, opset=17, rtol=1e-4, atol=1e-4)
    cases = [affine_case("InstanceNormalization", np.float16, s, i) for i, s in enumerate(shapes[:2])]
    check_cases(cases, sizes=SIZES[:2], opset=17, **F16)


def test_group_normalization():
    """Opset 21's per-channel scale and bias (onnx's checker rejects the deprecated opset-18
    GroupNormalization, so cuvil's loader never lets one through)."""
    opset = 21
    rng = _rng(opset)
    nodes, feeds, outputs, consts = [], {}, {}, {}
    for i, (shape, groups, dtype) in enumerate([
            (["n", 4, "m"], 2, np.float32), ([2, 6, 3, 3], 3, np.float32), (["n", 6, 5], 6, np.float32),
            ([2, 4, "m"], 1, np.float32), ([3, 8], 4, np.float32), (["n", 4, "m"], 2, np.float64)]):
        size = shape[1] if opset >= 21 else groups
        consts[f"s{i}"] = rng.standard_normal(size).astype(dtype)
        consts[f"b{i}"] = rng.standard_normal(size).astype(dtype)
        feeds[f"x{i}"] = (dtype, shape)
        outputs[f"y{i}"] = (dtype, shape)
        nodes.append(helper.make_node("GroupNormalization", [f"x{i}", f"s{i}", f"b{i}"], [f"y{i}"],
                                      num_groups=groups, epsilon=[1e-5, 1e-3][i % 2]))
    check_typed(nodes, feeds, outputs, consts, opset=opset)


def test_mean_variance_normalization():
    nodes, feeds, outputs = [], {}, {}
    for i, (shape, axes) in enumerate([(["n", 3, 4, "m"], None), ([2, 3, "m", 5], [2, 3]),
                                       (["n", 3, 4, 5], [1]), ([2, 3, 4, "m"], [0, 1]),
                                       ([3, "m", 4], [-1]), ([2, 3, 4, 5], [0, 1, 2, 3])]):
        feeds[f"x{i}"] = (np.float32, shape)
        outputs[f"y{i}"] = (np.float32, shape)
        nodes.append(helper.make_node("MeanVarianceNormalization", [f"x{i}"], [f"y{i}"],
                                      **({} if axes is None else {"axes": axes})))
    check_typed(nodes, feeds, outputs, opset=13)


def test_lrn():
    cases = []
    # onnxruntime computes rank 4 and odd sizes only (test_lrn_follows_the_spec covers the rest)
    for i, (shape, size) in enumerate([(["n", 5, "m", 3], 3), ([2, 7, 3, 3], 1), ([1, 4, 3, "m"], 5),
                                       (["n", 9, "m", 1], 7)]):
        attrs = {"size": size}
        if i % 2:
            attrs.update(alpha=0.01, beta=0.5, bias=2.0)
        cases.append(Case("LRN", ["x"], attrs, feeds={"x": (np.float32, shape)}, label=f"LRN {i}"))
    check_cases(cases, sizes=SIZES, opset=13, rtol=1e-4, atol=1e-5)
    check_cases([Case("LRN", ["x"], {"size": 3}, feeds={"x": (np.float16, [2, 5, "m", 3])})],
                sizes=SIZES[:2], opset=13, **F16)


def lrn_formula(x, size, alpha, beta, bias):
    """The spec's definition in float64 (onnx's reference LRN sums the wrong window)."""
    sq = np.zeros(x.shape, dtype=np.float64)
    c = x.shape[1]
    for ch in range(c):
        lo, hi = max(0, ch - (size - 1) // 2), min(c - 1, ch + size - 1 - (size - 1) // 2)
        sq[:, ch] = (x[:, lo:hi + 1].astype(np.float64) ** 2).sum(axis=1)
    return (x / (bias + alpha / size * sq) ** beta).astype(x.dtype)


@pytest.mark.parametrize(("shape", "size", "dtype"), [((2, 6, 7), 4, np.float32),
                                                      ((1, 5, 3, 2, 4), 2, np.float32),
                                                      ((2, 7, 3, 3), 6, np.float64)])
def test_lrn_follows_the_spec(shape, size, dtype):
    nodes = [helper.make_node("LRN", ["x"], ["y"], size=size, alpha=0.02, beta=0.6, bias=1.5)]
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, list(shape))],
                              [helper.make_tensor_value_info("y", t, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = _rng(5).standard_normal(shape).astype(dtype)
    np.testing.assert_allclose(cuvil.compile(model)(x), lrn_formula(x, size, 0.02, 0.6, 1.5),
                               rtol=1e-5, atol=1e-6)


# -- onnx's backend node tests ---------------------------------------------------------------

BACKEND = {"batch_normalization": "BatchNormalization", "softmax": "Softmax", "logsoftmax": "LogSoftmax",
           "hardmax": "Hardmax", "layernormalization": "LayerNormalization",
           "instance_normalization": "InstanceNormalization", "groupnormalization": "GroupNormalization",
           "lrn": "LRN", "meanvariancenormalization": "MeanVarianceNormalization",
           "lpnormalization": "LpNormalization"}


def test_onnx_backend_node_cases():
    """Every single-node case, training-mode BatchNormalization included."""
    tests = [t for module, op in BACKEND.items() for t in backend_cases(module, [op])]
    assert len(tests) >= 40
    check_backend_cases(tests)


# -- errors ---------------------------------------------------------------------------------


def _single(op, attrs, shape=(2, 4, 3), extra=(), opset=17, outputs=("y",)):
    inits = [onnx.numpy_helper.from_array(np.asarray(a), n) for n, a in extra]
    graph = helper.make_graph(
        [helper.make_node(op, ["x", *(n for n, _ in extra)], list(outputs), **attrs)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, list(shape)) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_lp_normalization_rejects_other_p():
    with pytest.raises(ModelError, match=r"LpNormalization.*p must be 1 or 2"):
        cuvil.compile(_single("LpNormalization", {"p": 3}))


def test_group_normalization_needs_divisible_channels():
    one = np.ones(4, np.float32)
    with pytest.raises(ModelError, match=r"GroupNormalization.*4 channels do not split into 3"):
        cuvil.compile(_single("GroupNormalization", {"num_groups": 3},
                              extra=[("s", one), ("b", one)], opset=21))


def test_layer_normalization_unsupported_stash_type():
    s = np.ones(3, np.float32)
    with pytest.raises(UnsupportedOpError, match=r"LayerNormalization.*stash_type 10"):
        cuvil.compile(_single("LayerNormalization", {"stash_type": 10}, extra=[("s", s)]))


def test_batchnorm_training_outputs_before_opset_14_are_unsupported():
    p = np.ones(4, np.float32)
    extra = [("s", p), ("b", p), ("m", p), ("v", p)]
    with pytest.raises(UnsupportedOpError, match=r"BatchNormalization.*eval mode"):
        cuvil.compile(_single("BatchNormalization", {}, extra=extra, opset=9,
                              outputs=("y", "mean", "var", "saved_mean", "saved_var")))


def test_integer_input_is_reported():
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.INT32, [2, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    with pytest.raises((UnsupportedOpError, ModelError), match=r"Softmax"):
        cuvil.compile(model)
