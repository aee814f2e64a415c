"""Resize (opsets 10-19) and Upsample (7, 9) against onnxruntime.

Cases of one opset share a model (one compile); each has its own input and output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import cuvil
from cuvil.errors import UnsupportedOpError

RNG = np.random.default_rng(7)


@dataclass
class R:
    """One Resize/Upsample node: its attributes, input shape and scales/sizes/roi."""

    attrs: dict[str, Any]
    shape: tuple[int, ...]
    scales: list[float] | None = None
    sizes: list[int] | None = None
    roi: list[float] | None = None
    dtype: Any = np.float32
    op: str = "Resize"
    #: declared input shape when it differs from `shape` (str entries are symbolic)
    declared: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.op} {self.attrs} x{list(self.shape)} scales={self.scales} "
                f"sizes={self.sizes} roi={self.roi}")


def build(cases: list[R], opset: int) -> onnx.ModelProto:
    nodes, inputs, inits, outputs = [], [], [], []

    def const(name: str, values: Any, dtype: Any) -> str:
        inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    for i, c in enumerate(cases):
        p = f"c{i}_"
        attrs = dict(c.attrs)
        if c.op == "Upsample" and opset < 9:
            attrs["scales"] = [float(s) for s in c.scales or []]
            ins = [p + "x"]
        elif c.op == "Upsample" or opset < 11:
            ins = [p + "x", const(p + "scales", c.scales, np.float32)]
        else:
            roi = "" if c.roi is None else const(p + "roi", c.roi, np.float32)
            scales = "" if c.scales is None else const(p + "scales", c.scales, np.float32)
            sizes = "" if c.sizes is None else const(p + "sizes", c.sizes, np.int64)
            if opset < 13:  # roi and scales are not optional yet
                roi = roi or const(p + "roi", [], np.float32)
                scales = scales or const(p + "scales", [], np.float32)
            ins = [p + "x", roi, scales, sizes]
            while ins[-1] == "":
                ins.pop()
        nodes.append(helper.make_node(c.op, ins, [p + "y"], name=f"case{i}", **attrs))
        inputs.append(helper.make_tensor_value_info(
            p + "x", helper.np_dtype_to_tensor_dtype(np.dtype(c.dtype)),
            c.declared or list(c.shape)))
        outputs.append(helper.make_empty_tensor_value_info(p + "y"))
    graph = helper.make_graph(nodes, "resize", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset < 19 else 9
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    return model


def feeds_for(cases: list[R], shapes: list[tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    feeds = {}
    for i, c in enumerate(cases):
        shape = shapes[i] if shapes else c.shape
        x = RNG.standard_normal(shape) * 4
        feeds[f"c{i}_x"] = (np.round(x) if np.dtype(c.dtype).kind in "iu" else x).astype(c.dtype)
    return feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # onnx's inferred output shapes may differ from onnxruntime's
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def compare(cases: list[R], model: onnx.ModelProto, compiled: Any, feeds: dict[str, np.ndarray],
            rtol: float = 1e-5, atol: float = 2e-5) -> None:
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for i, c in enumerate(cases):
        a, b = got[f"c{i}_y"], want[f"c{i}_y"]
        assert a.shape == b.shape, f"case {i} ({c}): shape {a.shape} != {b.shape}"
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"case {i}: {c}")


def check(cases: list[R], opset: int) -> Any:
    model = build(cases, opset)
    compiled = cuvil.compile(model)
    compare(cases, model, compiled, feeds_for(cases))
    return compiled


COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
                    "half_pixel_symmetric")


def test_modes_and_coordinate_transforms_nchw() -> None:
    cases = []
    scale_sets = ([1, 1, 2.0, 1.5], [1, 1, 0.6, 0.8], [1, 1, 1.7, 0.5], [1, 1, 3, 1])
    for i, ctm in enumerate(COORDINATE_MODES):
        for j, mode in enumerate(("nearest", "linear", "cubic")):
            for scales in (scale_sets[(i + j) % 4], scale_sets[(i + j + 1) % 4]):
                # half_pixel_symmetric + nearest: onnxruntime's rounding at exact .5 ties is not
                # reproducible from its float32 formula; integer scales have no ties
                if ctm == "half_pixel_symmetric" and mode == "nearest":
                    scales = [1, 1, 3, 2]
                cases.append(R({"mode": mode, "coordinate_transformation_mode": ctm},
                               (2, 3, 7, 9), scales=scales))
    check(cases, opset=19)


def test_nearest_modes_and_sizes() -> None:
    cases = []
    all_sizes = ([2, 3, 14, 5], [2, 3, 3, 27], [2, 3, 9, 9], [2, 3, 13, 4])
    for i, nearest in enumerate(("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")):
        for j, ctm in enumerate(("half_pixel", "asymmetric", "align_corners")):
            for sizes in (all_sizes[(i + j) % 4], all_sizes[(i + j + 2) % 4]):
                cases.append(R({"mode": "nearest", "nearest_mode": nearest,
                                "coordinate_transformation_mode": ctm}, (2, 3, 7, 9), sizes=sizes))
    check(cases, opset=13)


def test_cubic_options_crop_and_resize_and_layouts() -> None:
    crop = {"coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": -3.0}
    roi = [0, 0, 0.2, -0.1, 1, 1, 1.1, 0.8]
    cases = [
        R({"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, (1, 2, 7, 9),
          scales=[1, 1, 1.6, 0.7]),
        R({"mode": "cubic", "exclude_outside": 1}, (1, 2, 5, 6), sizes=[1, 2, 3, 13]),
        R({"mode": "cubic", "cubic_coeff_a": -0.6, "coordinate_transformation_mode": "align_corners"},
          (2, 1, 6, 5), scales=[1, 1, 2.5, 0.9]),
        *[R({"mode": m, **crop}, (1, 2, 7, 9), sizes=[1, 2, 5, 11], roi=roi)
          for m in ("nearest", "linear", "cubic")],
        R({"mode": "linear", **crop}, (2, 6, 5), sizes=[4, 3, 8],
          roi=[0.1, 0.3, 0, 0.9, 0.6, 1.2]),
        # 2-D and 3-D inputs, NHWC, 5-D (trilinear)
        R({"mode": "linear"}, (7, 9), scales=[2, 0.7]),
        R({"mode": "cubic"}, (7, 9), scales=[1.3, 2]),
        R({"mode": "linear"}, (3, 7, 9), scales=[2, 1.5, 0.7]),
        R({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, (1, 5, 6, 3),
          scales=[1, 1.8, 0.5, 1]),
        R({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
          (1, 2, 3, 5, 4), scales=[1, 1, 2, 1.5, 0.75]),
        R({"mode": "nearest"}, (5,), scales=[2.6]),
        R({"mode": "nearest"}, (2, 3, 4, 5, 2), scales=[1, 2, 0.5, 1.5, 3]),
        # the output shape equals the input's: a copy, whatever the scales
        R({"mode": "linear"}, (1, 1, 5, 6), scales=[1, 1, 1.1, 1.1]),
    ]
    check(cases, opset=13)


def test_opset_18_axes_and_keep_aspect_ratio() -> None:
    cases = [
        R({"mode": "linear", "axes": [2, 3]}, (1, 2, 7, 9), scales=[1.5, 0.5]),
        R({"mode": "nearest", "axes": [-1, -2]}, (1, 2, 7, 9), sizes=[4, 12]),
        R({"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
          (1, 2, 7, 9), sizes=[20, 20]),
        R({"mode": "cubic", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"},
          (1, 2, 7, 9), sizes=[10, 5]),
        R({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
           "axes": [3]}, (1, 2, 4, 9), sizes=[5], roi=[0.25, 0.9]),
    ]
    check(cases, opset=18)


def test_opset_11_tf_half_pixel_for_nn_and_opset_10() -> None:
    check([R({"mode": "nearest", "coordinate_transformation_mode": "tf_half_pixel_for_nn"},
             (1, 2, 5, 7), scales=[1, 1, 1.6, 0.6]),
           R({"mode": "linear"}, (1, 2, 5, 7), sizes=[1, 2, 3, 12])], opset=11)
    check([R({"mode": "nearest"}, (1, 2, 7, 9), scales=[1, 1, 0.7, 2.5]),
           R({"mode": "nearest"}, (1, 2, 3, 4), scales=[1, 1, 2, 2]),
           R({"mode": "linear"}, (1, 2, 7, 9), scales=[1, 1, 0.6, 2.5])], opset=10)


def test_upsample() -> None:
    check([R({"mode": "nearest"}, (1, 2, 3, 4), scales=[1, 1, 2, 3], op="Upsample"),
           R({"mode": "linear"}, (1, 2, 3, 4), scales=[1, 1, 2.5, 1.5], op="Upsample")], opset=7)
    check([R({"mode": "nearest"}, (1, 2, 3, 4), scales=[1, 1, 1.5, 3], op="Upsample"),
           R({"mode": "linear"}, (2, 3, 4), scales=[1, 2, 2], op="Upsample")], opset=9)


def test_integer_dtypes_nearest() -> None:
    check([R({"mode": "nearest"}, (1, 2, 5, 6), scales=[1, 1, 1.5, 0.5], dtype=dt)
           for dt in (np.int32, np.int8, np.uint8)], opset=13)


def test_symbolic_dims() -> None:
    cases = [
        # scales on symbolic dims: output dims floor(h * s)
        R({"mode": "linear"}, (1, 3, 5, 6), scales=[1, 1, 2, 1.5], declared=["n", 3, "h", "w"]),
        R({"mode": "nearest"}, (1, 3, 5, 6), scales=[1, 1, 0.75, 3],
          declared=["n", 3, "h", "w"]),
        # fixed sizes from symbolic dims: the scales are computed at run time
        R({"mode": "cubic", "axes": [2, 3]}, (1, 2, 5, 6), sizes=[9, 4],
          declared=["n", 2, "h", "w"]),
        R({"mode": "nearest", "axes": [2, 3], "coordinate_transformation_mode": "align_corners"},
          (1, 2, 5, 6), sizes=[9, 4], declared=["n", 2, "h", "w"]),
    ]
    model = build(cases, opset=18)
    compiled = cuvil.compile(model)
    for n, h, w in ((1, 5, 6), (2, 9, 4), (3, 1, 11)):  # (9, 4): the sized cases just copy
        shapes = [(n, 3, h, w), (n, 3, h, w), (n, 2, h, w), (n, 2, h, w)]
        compare(cases, model, compiled, feeds_for(cases, shapes))


def test_antialias_downsampling() -> None:
    """antialias = 1 (opset 18): the linear/cubic filter is stretched by 1/scale when shrinking."""
    aa = {"antialias": 1}
    cases = []
    for mode in ("linear", "cubic"):
        m = {**aa, "mode": mode}
        cases += [
            # 2-D downsampling by non-integer factors, by sizes and by scales
            R(m, (1, 2, 37, 53), sizes=[1, 2, 16, 20]),
            R(m, (1, 1, 37, 53), scales=[1, 1, 0.45, 0.3]),
            # one axis up, one down; strong shrinking (wide windows)
            R(m, (1, 1, 17, 23), scales=[1, 1, 2.3, 0.3]),
            R(m, (2, 3, 17, 23), scales=[1, 1, 0.7, 1.6]),
            R(m, (1, 1, 64, 9), sizes=[1, 1, 7, 9]),
            # an axis whose length does not change although its scale is not 1
            R(m, (1, 1, 5, 53), scales=[1, 1, 1.1, 0.3]),
            # other coordinate modes; an output length of 1
            R({**m, "coordinate_transformation_mode": "align_corners"}, (1, 1, 37, 53),
              sizes=[1, 1, 16, 20]),
            R({**m, "coordinate_transformation_mode": "asymmetric"}, (1, 1, 37, 53),
              sizes=[1, 1, 16, 20]),
            R({**m, "coordinate_transformation_mode": "pytorch_half_pixel"}, (1, 1, 37, 53),
              sizes=[1, 1, 16, 1]),
            R({**m, "coordinate_transformation_mode": "half_pixel_symmetric"}, (1, 1, 37, 53),
              sizes=[1, 1, 16, 20]),
            R({**m, "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 5.0},
              (1, 1, 37, 53), sizes=[1, 1, 16, 20], roi=[0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3]),
            # 2-D input, NHWC, axes, keep_aspect_ratio_policy
            R(m, (17, 23), scales=[0.4, 0.6]),
            R(m, (1, 17, 23, 3), scales=[1, 0.4, 0.6, 1]),
            R({**m, "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}, (1, 2, 37, 53),
              sizes=[20, 20]),
        ]
    cubic = {**aa, "mode": "cubic"}
    cases += [
        R({**cubic, "exclude_outside": 1}, (1, 1, 37, 53), sizes=[1, 1, 16, 20]),
        R({**cubic, "exclude_outside": 1, "cubic_coeff_a": -0.5}, (1, 1, 37, 53), scales=[1, 1, 0.4, 1.5]),
        R({**cubic, "cubic_coeff_a": -0.5}, (1, 1, 37, 53), scales=[1, 1, 0.3, 1.7]),
        # trilinear: 3-D and 5-D
        R({**aa, "mode": "linear"}, (13, 17, 23), scales=[0.5, 0.4, 0.6]),
        R({**aa, "mode": "linear"}, (1, 2, 9, 17, 23), scales=[1, 1, 0.5, 0.4, 0.6]),
    ]
    check(cases, opset=19)


def test_antialias_symbolic_dims() -> None:
    """Symbolic lengths: the antialias windows and weights are computed at run time."""
    aa = {"antialias": 1, "axes": [2, 3]}
    cases = [
        # fixed sizes: the scales are computed at run time
        R({**aa, "mode": "linear"}, (1, 3, 37, 53), sizes=[16, 20], declared=["n", 3, "h", "w"]),
        R({**aa, "mode": "cubic"}, (1, 3, 37, 53), sizes=[16, 20], declared=["n", 3, "h", "w"]),
        R({**aa, "mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, (1, 3, 37, 53),
          sizes=[16, 20], declared=["n", 3, "h", "w"]),
        R({**aa, "mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
           "extrapolation_value": -2.0}, (1, 3, 37, 53), sizes=[16, 20], roi=[-0.1, 0.2, 0.8, 1.2],
          declared=["n", 3, "h", "w"]),
        # scales on symbolic dims (short binary fractions)
        R({**aa, "mode": "cubic"}, (1, 3, 37, 53), scales=[0.25, 0.75], declared=["n", 3, "h", "w"]),
        R({**aa, "mode": "linear", "coordinate_transformation_mode": "align_corners"}, (1, 3, 37, 53),
          scales=[0.375, 1.5], declared=["n", 3, "h", "w"]),
        R({**aa, "mode": "cubic"}, (1, 3, 37, 53), scales=[1.25, 0.5], declared=["n", 3, "h", "w"]),
    ]
    model = build(cases, opset=18)
    compiled = cuvil.compile(model)
    # (16, 20): the sized cases copy; (16, 41): one axis keeps its length; h = 3: 3 * 1.25 -> 3,
    # a length kept although the scale is not 1 (onnxruntime copies that axis)
    for n, h, w in ((1, 37, 53), (2, 16, 20), (1, 16, 41), (1, 61, 7), (1, 3, 11)):
        compare(cases, model, compiled, feeds_for(cases, [(n, 3, h, w)] * len(cases)))


def test_unsupported_configurations_are_named() -> None:
    model = build([R({"mode": "linear"}, (1, 1, 4, 4), scales=[1, 1, 2, 2], dtype=np.int32)],
                  opset=13)
    with pytest.raises(UnsupportedOpError, match=r"case0.*float32 input only"):
        cuvil.compile(model)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 4, 4])
    s = helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["a", "b", "c", "d"])
    graph = helper.make_graph([helper.make_node("Resize", ["x", "", "s"], ["y"], name="up")], "g",
                              [x, s], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    with pytest.raises(UnsupportedOpError, match=r"'up'.*scales.*must be known at compile time"):
        cuvil.compile(model)
    # a scale whose float32 product with a symbolic dim rounds unpredictably
    model = build([R({"mode": "nearest"}, (1, 1, 5, 5), scales=[1, 1, 0.7, 1],
                     declared=[1, 1, "h", 5])], opset=13)
    with pytest.raises(UnsupportedOpError, match=r"case0.*scale 0\.7.*symbolic dim h.*pin"):
        cuvil.compile(model)
    assert cuvil.compile(model, inputs={"c0_x": [1, 1, 10, 5]}).outputs[0].shape == (1, 1, 7, 5)


@pytest.mark.slow
def test_onnx_backend_node_tests() -> None:
    from batch_oracle import backend_cases, check_backend_cases
    from test_indexing import baked

    tests = [baked(t, {"Resize": [1, 2, 3], "Upsample": [1]})
             for t in backend_cases("resize", ["Resize"]) + backend_cases("upsample", ["Upsample"])]
    # onnx's expected data sizes align_corners by scale * length, onnxruntime (and cuvil) by
    # the integer output length: check these against onnxruntime instead
    ort_cases = [t for t in tests if t.name in ("test_resize_downsample_scales_linear_align_corners",
                                                "test_resize_downsample_scales_cubic_align_corners")]
    for t in ort_cases:
        compiled = cuvil.compile(t.model)
        feeds = {vi.name: a for vi, a in zip(t.model.graph.input, t.data_sets[0][0])}
        want = run_ort(t.model, feeds)
        for name, have in compiled.run(feeds).items():
            np.testing.assert_allclose(have, want[name], rtol=1e-5, atol=1e-6, err_msg=t.name)
    runnable = [t for t in tests if t not in ort_cases]
    assert len(runnable) >= 38
    check_backend_cases(runnable)
