"""DeformConv (opsets 19, 22) against onnxruntime: seeded random groups and offset groups,
kernels, strides, dilations and asymmetric pads, with and without mask and bias, constant and
run-time weights, float32/float64/float16, symbolic batch and spatial dims at several sizes, a
detection-style model whose offsets come from a Conv over the same input; onnx's backend node
tests; the errors a model can cause.

Offsets are random, with some exact integers and half pixels and some far outside the image,
where the bilinear corners and the zero padding decide. Cases are batched (one compile per
test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper
from oracle import assert_matches_ort, make_model

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

#: symbolic dims ("_h", "_w" are private to each case) and the sizes each test runs them at
SIZES = ({"n": 1, "_h": 7, "_w": 6}, {"n": 3, "_h": 10, "_w": 13}, {"n": 2, "_h": 5, "_w": 9})


def _data(rng, dtype, shape):
    v = rng.standard_normal(shape) * 1.5
    flat = v.reshape(-1)
    special = rng.random(flat.shape) < 0.25
    flat[special] = rng.choice([-1.0, 0.0, 1.0, 0.5, -0.5, 2.0, -3.0, 9.5, -20.0], special.sum())
    return v.astype(dtype)


def _out(size, k, s, d, p0, p1):
    return (size + p0 + p1 - d * (k - 1) - 1) // s + 1


def deform_case(rng, dtype="float32", symbolic=False, const_w=None):
    group = int(rng.choice([1, 1, 2, 3]))
    cg, mg = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    c = cg * group
    offset_group = int(rng.choice([d for d in (1, 2, 3, 4, 6) if c % d == 0]))
    kernel = [int(rng.integers(1, 4)), int(rng.integers(1, 4))]
    strides = [int(rng.integers(1, 3)) for _ in range(2)]
    dilations = [int(rng.integers(1, 3)) for _ in range(2)]
    pads = [int(rng.integers(0, 3)) for _ in range(4)]
    attrs = {"group": group, "offset_group": offset_group, "strides": strides,
             "dilations": dilations, "pads": pads}
    if rng.random() < 0.5:
        attrs["kernel_shape"] = kernel
    taps = kernel[0] * kernel[1]
    if symbolic:
        # the offsets' spatial dims are symbols of their own: equal to the output's at run time
        x_shape = ["n", c, "_h", "_w"]
        spatial: list = ["_oh", "_ow"]
        batch = "n"
    else:
        h, w = int(rng.integers(3, 9)), int(rng.integers(3, 9))
        x_shape = [2, c, h, w]
        spatial = [_out(h, kernel[0], strides[0], dilations[0], pads[0], pads[2]),
                   _out(w, kernel[1], strides[1], dilations[1], pads[1], pads[3])]
        batch = 2
    with_mask, with_bias = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
    feeds = {"x": (dtype, x_shape), "off": (dtype, [batch, offset_group * 2 * taps, *spatial])}
    consts = {}
    w_shape = [mg * group, cg, *kernel]
    if const_w if const_w is not None else rng.random() < 0.5:
        consts["w"] = rng.standard_normal(w_shape).astype(dtype)
    else:
        feeds["w"] = (dtype, w_shape)
    inputs = ["x", "w", "off", "", ""]
    if with_bias:
        consts["b"] = rng.standard_normal(mg * group).astype(dtype)
        inputs[3] = "b"
    if with_mask:
        feeds["mask"] = (dtype, [batch, offset_group * taps, *spatial])
        inputs[4] = "mask"
    while inputs[-1] == "":
        inputs.pop()
    case = Case("DeformConv", inputs, attrs, feeds=feeds, consts=consts, data=_data)
    case.geometry = (kernel, strides, dilations, pads)  # type: ignore[attr-defined]
    return case


def _bindings(cases, sizes):
    """Per size, the output dims of every symbolic case ("_oh", "_ow" are private per case)."""
    out = []
    for base in sizes:
        binding = dict(base)
        for i, c in enumerate(cases):
            kernel, strides, dilations, pads = c.geometry
            h = _out(base["_h"], kernel[0], strides[0], dilations[0], pads[0], pads[2])
            w = _out(base["_w"], kernel[1], strides[1], dilations[1], pads[1], pads[3])
            binding[f"c{i}__oh"], binding[f"c{i}__ow"] = h, w
        out.append(binding)
    return out


def _private(cases):
    # "_oh"/"_ow" bound per case: name them as batch_oracle names private dims ("c<i>__oh")
    for i, c in enumerate(cases):
        for name, (dtype, shape) in list(c.feeds.items()):
            c.feeds[name] = (dtype, [f"c{i}__{d[1:]}" if d in ("_oh", "_ow") else d for d in shape])
    return cases


def test_random_static_shapes():
    rng = np.random.default_rng(0)
    cases = [deform_case(rng) for _ in range(24)]
    check_cases(cases, opset=19, rtol=1e-4, atol=1e-4)


def test_symbolic_batch_and_spatial_dims():
    rng = np.random.default_rng(1)
    cases = [deform_case(rng, symbolic=True) for _ in range(10)]
    # the large images keep every output dim >= 1 for the kernels and dilations drawn
    sizes = ({"n": 1, "_h": 7, "_w": 6}, {"n": 3, "_h": 10, "_w": 13})
    check_cases(_private(cases), sizes=_bindings(cases, sizes), opset=22, rtol=1e-4, atol=1e-4)


def test_float64_and_float16():
    rng = np.random.default_rng(2)
    check_cases([deform_case(rng, "float64") for _ in range(6)], opset=22, rtol=1e-10,
                atol=1e-10)
    # onnxruntime sums float16 in float16: compare loosely
    check_cases([deform_case(rng, "float16", const_w=True) for _ in range(6)], opset=22,
                rtol=2e-2, atol=3e-2)


def test_offsets_from_a_conv_over_the_input():
    """The detection-model pattern: offset and mask come from Convs over the same input, so
    their dims are the output's (symbolic H and W), and the DeformConv follows."""
    rng = np.random.default_rng(3)
    c, m, og = 4, 6, 2
    w_off = (rng.standard_normal((og * 2 * 9, c, 3, 3)) * 0.5).astype(np.float32)
    w_mask = rng.standard_normal((og * 9, c, 3, 3)).astype(np.float32)
    weight = rng.standard_normal((m, c // 2, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    geometry = {"pads": [1, 1, 1, 1], "strides": [2, 2]}
    nodes = [helper.make_node("Conv", ["x", "w_off"], ["off"], **geometry),
             helper.make_node("Conv", ["x", "w_mask"], ["logits"], **geometry),
             helper.make_node("Sigmoid", ["logits"], ["mask"]),
             helper.make_node("DeformConv", ["x", "w", "off", "b", "mask"], ["y"], group=2,
                              offset_group=og, kernel_shape=[3, 3], **geometry)]
    model = make_model(nodes, {"x": (np.float32, ["batch", c, "h", "w"])}, {"y": np.float32},
                       {"w_off": w_off, "w_mask": w_mask, "w": weight, "b": bias}, opset=19)
    compiled = None
    # the second size has more output positions than one task of the column build takes
    for shape in ((1, c, 9, 7), (2, c, 30, 27)):
        x = rng.standard_normal(shape).astype(np.float32)
        compiled = assert_matches_ort(model, {"x": x}, rtol=1e-4, atol=1e-4, compiled=compiled)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's arithmetic on inf
def test_non_finite_inputs_outside_the_samples_stay_out():
    """Corners outside the image read 0 (they are skipped, not multiplied by a zero weight):
    an inf or NaN at X[0, 0], where an outside corner's index is clamped to, must not leak into
    the output, while the ones that are sampled propagate. Checked against onnx's reference
    (GridSample with zeros padding): onnxruntime 1.32 returns NaN everywhere here."""
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    x[0, 0, 0, 0], x[0, 1, 0, 0], x[0, 1, 4, 3] = np.inf, np.nan, -np.inf
    off = rng.choice([-30.0, -1.5, 0.0, 0.25, 40.0], (1, 18, 6, 5)).astype(np.float32)
    nodes = [helper.make_node("DeformConv", ["x", "w", "off"], ["y"], pads=[1, 1, 1, 1])]
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    model = make_model(nodes, {"x": (np.float32, [1, 2, 6, 5]), "off": (np.float32, [1, 18, 6, 5])},
                       {"y": np.float32}, {"w": w}, opset=19)
    want = ReferenceEvaluator(model).run(None, {"x": x, "off": off})[0]
    got = cuvil.compile(model).run({"x": x, "off": off})["y"]
    assert np.isfinite(want).any() and not np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_backend_node_tests():
    tests = backend_cases("deformconv", ["DeformConv"])
    assert len(tests) == 4
    check_backend_cases(tests)


# -- errors ----------------------------------------------------------------------------------


def _model(inputs, **attrs):
    # no onnx shape inference here: it would reject the broken models before cuvil sees them
    graph = helper.make_graph(
        [helper.make_node("DeformConv", [n for n, _ in inputs], ["y"], name="dc", **attrs)], "bad",
        [helper.make_tensor_value_info(n, 1, list(s)) for n, s in inputs],
        [helper.make_tensor_value_info("y", 1, None)])
    graph.output[0].type.tensor_type.shape.SetInParent()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def test_errors():
    x, w, off = ("x", [1, 4, 5, 5]), ("w", [2, 4, 3, 3]), ("off", [1, 18, 3, 3])
    with pytest.raises(UnsupportedOpError, match=r"'dc' \(DeformConv\).*1 spatial dims; cuvil "
                                                 r"compiles 2-D DeformConv only"):
        cuvil.compile(_model([("x", [1, 4, 5]), ("w", [2, 4, 3]), ("off", [1, 6, 3])]))
    with pytest.raises(ModelError, match=r"'dc' \(DeformConv\): offset dim 1"):
        cuvil.compile(_model([x, w, ("off", [1, 9, 3, 3])]))
    with pytest.raises(ModelError, match=r"offset dim 2 \(output height"):
        cuvil.compile(_model([x, w, ("off", [1, 18, 5, 3])]))
    with pytest.raises(ModelError, match=r"mask dim 1"):
        cuvil.compile(_model([x, w, off, ("b", [2]), ("mask", [1, 18, 3, 3])]))
    with pytest.raises(ModelError, match=r"4 input channels do not split into offset_group = 3"):
        cuvil.compile(_model([x, w, ("off", [1, 54, 3, 3])], offset_group=3))
    with pytest.raises(ModelError, match=r"input channels vs weight channels x group"):
        cuvil.compile(_model([x, w, off], group=2))
    with pytest.raises(ModelError, match=r"B .* should have shape \[2\]"):
        cuvil.compile(_model([x, w, off, ("b", [3])]))
    with pytest.raises(ModelError, match=r"kernel_shape \[2, 2\] does not match"):
        cuvil.compile(_model([x, w, off], kernel_shape=[2, 2]))
