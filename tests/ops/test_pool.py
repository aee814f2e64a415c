"""MaxPool (with Indices), AveragePool, LpPool and the global pools against onnxruntime:
seeded random shapes and attributes (odd sizes, asymmetric pads, every auto_pad, strides
larger than the kernel, dilations, ceil_mode, count_include_pad, storage_order, 1-D to 3-D),
symbolic batch and spatial dims checked at several sizes, float16, float64 and 8-bit ints.

Where onnxruntime departs from the ONNX spec (SAME padding with dilations: it sizes the pads
from the undilated kernel; SAME padding that would be negative: it refuses or shifts the
windows, where cuvil clamps the padding at 0 as onnxruntime's Conv and TensorFlow do), the
oracle runs the same pooling with the explicit pads the spec's formula gives.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError

OPSET = 19  # AveragePool takes dilations from opset 19 on
F16 = {"rtol": 2e-3, "atol": 2e-3}
#: symbolic dims ("_s<axis>" are private to each case) and the sizes each test runs them at
SIZES = ({"n": 1, "_s0": 7, "_s1": 6, "_s2": 5}, {"n": 3, "_s0": 10, "_s1": 13, "_s2": 8},
         {"n": 2, "_s0": 5, "_s1": 9, "_s2": 11})


def pool_case(rng: np.random.Generator, op: str, r: int, dtype: str = "float32",
              symbolic: bool = False) -> Case:
    kernel = [int(rng.integers(1, 4)) for _ in range(r)]
    attrs: dict = {"kernel_shape": kernel}
    strides = [int(rng.integers(1, 4)) for _ in range(r)] if rng.random() < 0.6 else [1] * r
    dilations = [int(rng.integers(1, 3)) for _ in range(r)] if rng.random() < 0.5 else [1] * r
    if strides != [1] * r or rng.random() < 0.2:
        attrs["strides"] = strides
    if dilations != [1] * r or rng.random() < 0.2:
        attrs["dilations"] = dilations
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    mode = str(rng.choice(["NOTSET", "NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    if mode != "NOTSET":
        attrs["auto_pad"] = mode
    elif rng.random() < 0.7:
        # onnxruntime wants pads smaller than the kernel
        attrs["pads"] = [int(rng.integers(0, k)) for k in kernel * 2]
    if rng.random() < 0.5:
        attrs["ceil_mode"] = 1
    if op == "AveragePool" and rng.random() < 0.5:
        attrs["count_include_pad"] = 1
    if op == "LpPool" and rng.random() < 0.7:
        attrs["p"] = int(rng.choice([1, 2, 3]))
    spatial = [e + int(rng.integers(0, 6)) for e in extent]
    dims: list = spatial
    if symbolic:
        dims = [f"_s{a}" if rng.random() < 0.7 else d for a, d in enumerate(spatial)]
    case = Case(op, ["x"], attrs, feeds={"x": (dtype, ["n" if symbolic else int(rng.integers(1, 3)),
                                                      int(rng.integers(1, 4)), *dims])})
    if mode.startswith("SAME"):
        totals = [(-(-n // s) - 1) * s + e - n for n, s, e in zip(spatial, strides, extent)]
        if max(dilations) > 1 or min(totals) < 0:
            if symbolic:
                return pool_case(rng, op, r, dtype, symbolic)
            totals = [max(0, t) for t in totals]
            small = [t // 2 for t in totals]
            big = [t - h for t, h in zip(totals, small)]
            case.oracle_attrs = {k: v for k, v in attrs.items() if k not in ("auto_pad", "ceil_mode")}
            case.oracle_attrs["pads"] = small + big if mode == "SAME_UPPER" else big + small
    return case


def _ties(rng, dtype, shape):
    return rng.integers(-2, 3, size=shape).astype(dtype)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_random(op):
    rng = np.random.default_rng({"MaxPool": 1, "AveragePool": 2, "LpPool": 3}[op])
    check_cases([pool_case(rng, op, r) for r in (1, 2, 3) for _ in range(4)], opset=OPSET)


def test_max_pool_indices():
    rng = np.random.default_rng(4)
    cases = []
    for i, r in enumerate((1, 1, 2, 2, 2, 2, 3, 3, 3)):
        c = pool_case(rng, "MaxPool", r)
        c.outputs = ["y", "indices"]
        if i % 2:
            c.attrs["storage_order"] = 1
            if c.oracle_attrs is not None:
                c.oracle_attrs["storage_order"] = 1
        if i % 3 == 0:
            c.data = _ties  # the first maximum wins
        cases.append(c)
    check_cases(cases, opset=OPSET)


def test_symbolic_batch_and_spatial_dims():
    rng = np.random.default_rng(5)
    cases = [pool_case(rng, op, r, symbolic=True)
             for op in ("MaxPool", "AveragePool", "LpPool") for r in (1, 2, 3)]
    check_cases(cases, sizes=SIZES, opset=OPSET)


def test_float16():
    rng = np.random.default_rng(6)
    cases = [pool_case(rng, op, r, "float16") for op in ("MaxPool", "AveragePool", "LpPool")
             for r in (1, 2)]
    check_cases(cases, opset=OPSET, **F16)


def test_int8_and_uint8_max_pool():
    rng = np.random.default_rng(7)
    cases = [pool_case(rng, "MaxPool", r, dtype) for dtype in ("int8", "uint8") for r in (1, 2, 3)]
    check_cases(cases, opset=OPSET)


def test_float64():
    # onnxruntime has float64 MaxPool only; the reference runs the others with plain attributes
    # (its SAME and ceil_mode handling has bugs of its own)
    rng = np.random.default_rng(8)
    cases = [pool_case(rng, "MaxPool", r, "float64") for r in (1, 2, 3)]
    for op in ("AveragePool", "LpPool"):
        for r in (1, 2, 3):
            c = pool_case(rng, op, r, "float64")
            for key in ("auto_pad", "ceil_mode", "dilations"):
                c.attrs.pop(key, None)
            c.oracle_attrs = None
            c.oracle = "reference"
            cases.append(c)
    check_cases(cases, opset=OPSET, rtol=1e-10, atol=1e-10)


def test_global_pools():
    cases = []
    for op in ("GlobalMaxPool", "GlobalAveragePool", "GlobalLpPool"):
        for shape in ([2, 3, 7], ["n", 3, "_s0", 5], ["n", 2, 3, "_s1", 4], [1, 1, 1, 1, 1]):
            cases.append(Case(op, ["x"], {}, feeds={"x": ("float32", shape)}))
        cases.append(Case(op, ["x"], {}, feeds={"x": ("float16", ["n", 3, "_s0", 5])}))
        if op != "GlobalLpPool":  # neither onnxruntime nor the reference has it for float64
            # (the reference's GlobalMaxPool is right for 4-D inputs only)
            cases.append(Case(op, ["x"], {}, feeds={"x": ("float64", ["n", 3, "_s0", 4])},
                              oracle="reference"))
    cases.append(Case("GlobalLpPool", ["x"], {"p": 3}, feeds={"x": ("float32", [2, 3, 4, 5])}))
    cases.append(Case("GlobalLpPool", ["x"], {"p": 1}, feeds={"x": ("float32", [2, 3, 4, 5])}))
    check_cases([c for c in cases if c.feeds["x"][0] != "float16"], sizes=SIZES)
    check_cases([c for c in cases if c.feeds["x"][0] == "float16"], sizes=SIZES, **F16)


def test_backend_node_tests():
    # (MaxPool, AveragePool and LpPool backend tests are run by the conformance suite: their
    # generators take several seconds each)
    tests = (backend_cases("globalaveragepool", ["GlobalAveragePool"])
             + backend_cases("globalmaxpool", ["GlobalMaxPool"]))
    assert len(tests) >= 4
    check_backend_cases(tests)


# -- errors a model can cause -----------------------------------------------------------------


def _model(op, shape=(1, 1, 5, 5), **attrs):
    # no onnx shape inference here: it would reject the broken attributes before cuvil sees them
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "bad",
                              [helper.make_tensor_value_info("x", 1, list(shape))],
                              [helper.make_tensor_value_info("y", 1, [None] * len(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def test_errors():
    no_kernel = _model("MaxPool", kernel_shape=[2, 2])
    del no_kernel.graph.node[0].attribute[:]
    with pytest.raises(ModelError, match="kernel_shape"):
        cuvil.compile(no_kernel)
    with pytest.raises(ModelError, match="smaller than the window"):
        cuvil.compile(_model("AveragePool", kernel_shape=[6, 2]))
    with pytest.raises(ModelError, match="2 entries"):
        cuvil.compile(_model("MaxPool", kernel_shape=[2, 2], strides=[1, 1, 1]))
    with pytest.raises(ModelError, match="p = 0"):
        cuvil.compile(_model("LpPool", kernel_shape=[2, 2], p=0))


def _rois_or_image(rng, dtype, shape):
    if len(shape) == 2 and shape[1] == 5:
        # (batch index, x1, y1, x2, y2): inside, across and beyond the image, some reversed
        rois = np.empty(shape)
        rois[:, 0] = rng.integers(0, 2, shape[0])
        rois[:, 1:] = rng.uniform(-4, 26, (shape[0], 4))
        return rois.astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def test_max_roi_pool():
    cases = []
    for i, (pooled, scale) in enumerate([([2, 2], 1.0), ([3, 1], 0.5), ([1, 4], 0.25),
                                         ([4, 3], 0.5)]):
        dtype = "float16" if i == 3 else "float32"
        attrs = {"pooled_shape": pooled} if scale == 1.0 else {"pooled_shape": pooled,
                                                              "spatial_scale": scale}
        cases.append(Case("MaxRoiPool", ["x", "rois"], attrs, data=_rois_or_image,
                          feeds={"x": (dtype, [2, 3, 9, 11]), "rois": (dtype, ["r", 5])}))
    check_cases(cases, sizes=[{"r": 1}, {"r": 9}], **F16)  # (maxima are exact in float32)


def test_max_roi_pool_rejects_a_batch_index_out_of_range():
    model = _model("MaxRoiPool", pooled_shape=[2, 2])
    model.graph.node[0].input.append("rois")
    model.graph.input.append(helper.make_tensor_value_info("rois", 1, [1, 5]))
    compiled = cuvil.compile(model)
    x = np.zeros((1, 1, 5, 5), np.float32)
    with pytest.raises(ValueError, match="MaxRoiPool"):
        compiled.run({"x": x, "rois": np.array([[1, 0, 0, 2, 2]], np.float32)})
    assert compiled.run({"x": x, "rois": np.array([[0, 0, 0, 2, 2]], np.float32)})["y"].shape == \
        (1, 1, 2, 2)
