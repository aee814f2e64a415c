"""MaxPool (with Indices), AveragePool, LpPool and the global pools against onnxruntime:
seeded random shapes and attributes (odd sizes, asymmetric pads, every auto_pad, strides
larger than the kernel, dilations, ceil_mode, count_include_pad, storage_order, 1-D to 3-D),
symbolic batch and spatial dims checked at several sizes, float16, float64 and 8-bit ints;
MaxRoiPool and MaxUnpool.

Where onnxruntime departs from the ONNX spec (SAME padding with dilations: it sizes the pads
from the undilated kernel; SAME padding that would be negative: it refuses or shifts the
windows, where cuvil clamps the padding at 0 as onnxruntime's Conv and TensorFlow do), the
oracle runs the same pooling with the explicit pads the spec's formula gives.

Cases are batched (one compile per test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper, numpy_helper

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


def test_unit_stride_2d_pools_in_vectors():
    """2-D float32 pools with unit strides compute rows of outputs in vectors (Inception's
    3x3 pad-1 branches, 7x7 averages): rows wider than a vector and narrower, padded edges
    counted or not, symbolic batch and spatial dims."""
    cases = []
    for op, kernel, pads, extra in (
            ("AveragePool", [3, 3], [1, 1, 1, 1], {}),
            ("AveragePool", [3, 3], [1, 2, 0, 1], {"count_include_pad": 1}),
            ("AveragePool", [7, 7], [0, 0, 0, 0], {}),
            ("MaxPool", [3, 3], [1, 1, 1, 1], {}),
            ("MaxPool", [2, 5], [0, 2, 1, 2], {"ceil_mode": 1})):
        for dims in (["n", 2, 9, 40], ["n", 3, "_s0", "_s1"]):
            cases.append(Case(op, ["x"], {"kernel_shape": kernel, "pads": pads, **extra},
                              feeds={"x": ("float32", dims)}))
    sizes = ({"n": 1, "_s0": 7, "_s1": 7}, {"n": 2, "_s0": 14, "_s1": 35})
    check_cases(cases, sizes=sizes, opset=OPSET)


def test_strided_2d_pools_by_rows():
    """2-D pools with strides or dilations (and float32 or 8-bit max pools, whose compute
    dtype is the output's) take each output row's inner columns in passes over the row:
    CRNN's 2 x 2 / 2 MaxPool, ResNet's 3 x 3 / 2 with padding, averages counting the padding
    or not, a dilated kernel, ceil_mode's last window past the input, stride 3 over odd
    widths, an int8 max pool; symbolic spatial dims, rows too narrow for any inner column."""
    cases = []
    for op, attrs, dtype in (
            ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}, "float32"),
            ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
             "float32"),
            ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 2]},
             "float32"),
            ("AveragePool", {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 1],
                             "count_include_pad": 1}, "float32"),
            ("MaxPool", {"kernel_shape": [2, 2], "strides": [1, 1], "dilations": [2, 2]},
             "float32"),
            ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 3], "ceil_mode": 1}, "float32"),
            ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2]}, "int8")):
        for dims in (["n", 3, 8, 31], ["n", 2, "_s0", "_s1"]):
            cases.append(Case(op, ["x"], attrs, feeds={"x": (dtype, dims)}))
    sizes = ({"n": 1, "_s0": 4, "_s1": 3}, {"n": 2, "_s0": 9, "_s1": 40})
    check_cases(cases, sizes=sizes, opset=OPSET)


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
    # padded: tap by tap along rows (ceil_mode, uneven pads, dilation; symbolic batch)
    padded = [Case("MaxPool", ["x"], {"kernel_shape": [3, 3], "strides": [2, 2],
                                      "pads": [1, 1, 1, 1]}, feeds={"x": ("uint8", ["n", 3, 9, 8])}),
              Case("MaxPool", ["x"], {"kernel_shape": [2, 3], "strides": [2, 1], "ceil_mode": 1,
                                      "pads": [0, 2, 1, 1], "dilations": [1, 2]},
                   feeds={"x": ("int8", ["n", 2, 7, 9])})]
    check_cases(padded, sizes=[{"n": 1}, {"n": 2}], opset=OPSET)


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


# -- MaxUnpool -------------------------------------------------------------------------------


def _unpool_data(kernel, strides, pads):
    """X values, and distinct flat indices into the unpooled tensor of X's (bound) shape."""
    def make(rng, dtype, shape):
        if np.dtype(dtype) != np.int64:
            return rng.standard_normal(shape).astype(dtype)
        r = len(kernel)
        spatial = [(d - 1) * s - pads[a] - pads[r + a] + k
                   for a, (d, s, k) in enumerate(zip(shape[2:], strides, kernel))]
        total = int(np.prod([*shape[:2], *spatial]))
        return rng.choice(total, int(np.prod(shape)), replace=False).reshape(shape).astype(np.int64)
    return make


def unpool(x, kernel, strides=None, pads=None, output_shape=None, dtype="float32", oracle="ort"):
    r = len(kernel)
    attrs = {"kernel_shape": kernel}
    if strides is not None:
        attrs["strides"] = strides
    if pads is not None:
        attrs["pads"] = pads
    inputs, consts = ["x", "i"], {}
    if output_shape is not None:
        inputs.append("shape")
        consts["shape"] = np.array(output_shape, np.int64)
    return Case("MaxUnpool", inputs, attrs, feeds={"x": (dtype, x), "i": ("int64", x)},
                consts=consts, oracle=oracle,
                data=_unpool_data(kernel, strides or [1] * r, pads or [0] * (2 * r)))


def test_max_unpool():
    cases = [unpool(["n", 3, "_s0", "_s1"], [2, 2], [2, 2]),
             unpool(["n", 2, "_s0", 4], [3, 2], [2, 1], [1, 0, 1, 1]),
             unpool([2, 2, 5], [2], None, None),
             unpool([1, 2, 2, 3, 2], [2, 2, 2], [2, 2, 2]),
             unpool(["n", 2, 3, 2], [2, 2], [2, 2], dtype="float64", oracle="reference"),
             unpool([1, 2, 3, 2], [3, 3], [2, 2], [1, 1, 1, 1], dtype="float16",
                    oracle="reference")]
    check_cases(cases, sizes=SIZES, opset=11)
    tests = []
    for t in backend_cases("maxunpool", ["MaxUnpool"]):
        # output_shape is needed at compile time: bind it as the conformance suite does
        model = onnx.ModelProto()
        model.CopyFrom(t.model)
        g = model.graph
        data_sets = t.data_sets
        if len(g.node[0].input) > 2:
            name = g.node[0].input[2]
            g.initializer.append(numpy_helper.from_array(np.asarray(data_sets[0][0][2]), name))
            keep = [vi for vi in g.input if vi.name != name]
            del g.input[:]
            g.input.extend(keep)
            data_sets = [(ins[:2], outs) for ins, outs in data_sets]
        tests.append(SimpleNamespace(name=t.name, model=model, data_sets=data_sets, rtol=t.rtol,
                                     atol=t.atol))
    assert len(tests) == 2
    check_backend_cases(tests)


def test_max_unpool_with_output_shape():
    from onnx.reference import ReferenceEvaluator
    from oracle import run_ort

    # (onnx's shape inference leaves these outputs unshaped: typed by hand here)
    shapes = {"a": ([1, 2, 3, 3], [1, 2, 6, 6]), "b": ([2, 1, 2, 3], [2, 1, 5, 7])}
    nodes, inputs, outputs, inits = [], [], [], []
    for p, (x, out) in shapes.items():
        nodes.append(helper.make_node("MaxUnpool", [p + "x", p + "i", p + "s"], [p + "y"],
                                      kernel_shape=[2, 2], strides=[2, 2]))
        inputs += [helper.make_tensor_value_info(p + "x", 1, x),
                   helper.make_tensor_value_info(p + "i", 7, x)]
        outputs.append(helper.make_tensor_value_info(p + "y", 1, out))
        inits.append(numpy_helper.from_array(np.array(out, np.int64), p + "s"))
    model = helper.make_model(helper.make_graph(nodes, "unpool", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    make = _unpool_data([2, 2], [2, 2], [0, 0, 0, 0])
    rng = np.random.default_rng(5)
    feeds = {p + n: make(rng, dt, x) for p, (x, _) in shapes.items()
             for n, dt in (("x", "float32"), ("i", "int64"))}
    got = cuvil.compile(model).run(feeds)
    ref = dict(zip(["ay", "by"], ReferenceEvaluator(model).run(None, feeds)))
    # output_shape = the unpooled shape: onnxruntime agrees; larger: onnx's reference (see
    # MaxUnpool's docstring for how they differ)
    np.testing.assert_array_equal(got["ay"], run_ort(model, feeds)[0])
    np.testing.assert_array_equal(got["by"], ref["by"])


def test_max_unpool_output_shape_from_the_input_dims():
    from onnx.reference import ReferenceEvaluator

    graph = helper.make_graph(
        [helper.make_node("Shape", ["like"], ["s"]),
         helper.make_node("MaxUnpool", ["x", "i", "s"], ["y"], kernel_shape=[2, 2], strides=[2, 2])],
        "unpool", [helper.make_tensor_value_info("x", 1, ["n", 1, 2, 2]),
                   helper.make_tensor_value_info("i", 7, ["n", 1, 2, 2]),
                   helper.make_tensor_value_info("like", 1, ["n", 1, "h", "w"])],
        [helper.make_tensor_value_info("y", 1, ["n", 1, "h", "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    compiled = cuvil.compile(model)
    rng = np.random.default_rng(3)
    for n, h, w in ((1, 4, 4), (2, 5, 7)):
        feeds = {"x": rng.standard_normal((n, 1, 2, 2)).astype(np.float32),
                 "i": rng.choice(n * 16, (n, 1, 2, 2), replace=False).astype(np.int64),
                 "like": np.zeros((n, 1, h, w), np.float32)}
        np.testing.assert_array_equal(compiled.run(feeds)["y"],
                                      ReferenceEvaluator(model).run(None, feeds)[0])
    with pytest.raises(ValueError, match="at least the unpooled dim"):
        compiled.run({**feeds, "like": np.zeros((2, 1, 3, 7), np.float32)})


def test_max_unpool_errors():
    def model(shape=(1, 1, 2, 2), output_shape=None, **attrs):
        ins = ["x", "i"] + (["s"] if output_shape is not None else [])
        inits = [] if output_shape is None else [
            numpy_helper.from_array(np.array(output_shape, np.int64), "s")]
        graph = helper.make_graph([helper.make_node("MaxUnpool", ins, ["y"], name="up", **attrs)],
                                  "bad", [helper.make_tensor_value_info("x", 1, list(shape)),
                                          helper.make_tensor_value_info("i", 7, list(shape))],
                                  [helper.make_tensor_value_info("y", 1, [None] * len(shape))],
                                  inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
        m.ir_version = 8
        return m

    with pytest.raises(ModelError, match=r"'up' \(MaxUnpool\): kernel_shape \[2\] must be 2"):
        cuvil.compile(model(kernel_shape=[2]))
    with pytest.raises(ModelError, match=r"output_shape\[3\] = 3 is smaller than the unpooled dim 4"):
        cuvil.compile(model(output_shape=[1, 1, 4, 3], kernel_shape=[2, 2], strides=[2, 2]))
    compiled = cuvil.compile(model(kernel_shape=[2, 2], strides=[2, 2]))
    x = np.ones((1, 1, 2, 2), np.float32)
    with pytest.raises(ValueError, match=r"'up' \(MaxUnpool\): index out of range"):
        compiled.run({"x": x, "i": np.array([0, 5, 16, 1], np.int64).reshape(1, 1, 2, 2)})
