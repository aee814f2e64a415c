"""GridSample (opsets 16, 20) and RoiAlign (10, 16) against onnxruntime, and against onnx's
reference evaluator where onnxruntime lacks the case (GridSample in 1-D, cubic in 3-D, integer
and float16 inputs); onnx's backend node tests; errors a model or a call can cause.

Grids hold random positions inside and well outside [-1, 1] plus exact borders (-1, 0, 1)
and half-pixel points, where rounding and padding decide. Cases are batched (one compile per
test) by `batch_oracle.check_cases`.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_oracle import Case, backend_cases, check_backend_cases, check_cases
from onnx import helper

import cuvil
from cuvil.errors import ModelError, UnsupportedOpError

#: symbolic dims ("_h", "_w"... are private to each case) and the sizes each test runs them at
SIZES = ({"n": 1, "_h": 5, "_w": 6, "_d": 3, "_p": 4, "_q": 7},
         {"n": 3, "_h": 1, "_w": 9, "_d": 4, "_p": 1, "_q": 2},
         {"n": 2, "_h": 8, "_w": 2, "_d": 1, "_p": 6, "_q": 5})


def _image_or_grid(rng, dtype, shape):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-100, 100, shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if len(shape) >= 3 and shape[-1] in (1, 2, 3) and shape[-1] == len(shape) - 2:
        # a grid: mostly inside, some far outside, some on exact borders and half pixels
        g = rng.uniform(-1.6, 1.6, shape)
        flat = g.reshape(-1)
        special = rng.random(flat.shape) < 0.25
        flat[special] = rng.choice([-1.0, 1.0, 0.0, -0.5, 0.5, -3.25, 2.5], special.sum())
        return g.astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def gs(mode, padding, align, x, grid, *, dtype="float32", gdtype=None, oracle="ort", label=""):
    return Case("GridSample", ["x", "grid"],
                {"mode": mode, "padding_mode": padding, "align_corners": align},
                feeds={"x": (dtype, x), "grid": (gdtype or ("float32" if dtype != "float64"
                                                            else "float64"), grid)},
                data=_image_or_grid, oracle=oracle, label=label)


def _each(modes, x, grid, aligns=(0, 1), **kw):
    """Every mode x padding; align_corners cycles through `aligns`."""
    pairs = [(m, p) for m in modes for p in ("zeros", "border", "reflection")]
    return [gs(m, p, aligns[i % len(aligns)], x, grid, **kw) for i, (m, p) in enumerate(pairs)]


def test_grid_sample_opset_16_names():
    check_cases(_each(("bilinear", "nearest", "bicubic"), [2, 2, 4, 7], [2, 3, 5, 2]), opset=16)


def test_grid_sample_opset_20_symbolic_dims():
    cases = [c for a in (0, 1) for c in _each(("linear", "nearest", "cubic"), ["n", 2, "_h", "_w"],
                                               ["n", "_p", "_q", 2], aligns=(a,))]
    # onnxruntime has 3-D linear and nearest; cubic in 3-D is checked against the reference
    cases += _each(("linear", "nearest"), ["n", 2, "_d", "_h", "_w"], ["n", 2, "_p", 3, 3])
    cases += [gs("linear", "zeros", 0, [1, 3, 1, 1], [1, 2, 2, 2], label="1x1 image"),
              gs("cubic", "border", 1, [2, 3, 4, 5], [2, 6, 1, 2], dtype="float64")]
    check_cases(cases, sizes=SIZES[:2], opset=20)


def test_grid_sample_against_the_reference():
    # (the reference clamps a cubic sample's coordinate under "border" padding, onnxruntime and
    # PyTorch only its taps' indices: border is left out of the cubic cases here)
    cases = [gs("cubic", p, a, [1, 2, 3, 4, 3], [1, 2, 2, 3, 3], oracle="reference")
             for p in ("zeros", "reflection") for a in (0, 1)]
    cases += [c for c in _each(("linear", "nearest", "cubic"), [2, 2, 5], [2, 4, 1],
                               oracle="reference", label="1-D")
              if c.attrs["mode"] != "cubic" or c.attrs["padding_mode"] != "border"]
    cases += [gs("nearest", p, i % 2, [2, 3, 4, 5], [2, 3, 4, 2], dtype=dt, oracle="reference")
              for i, (dt, p) in enumerate(zip(("int32", "uint8", "int64", "bool"),
                                              ("zeros", "border", "reflection", "zeros")))]
    check_cases(cases, opset=20)
    half = [gs(m, p, 0, [1, 2, 4, 5], [1, 3, 3, 2], dtype="float16", oracle="reference")
            for m in ("linear", "nearest") for p in ("zeros", "reflection")]
    check_cases(half, opset=20, rtol=1e-2, atol=1e-2)


# -- RoiAlign --------------------------------------------------------------------------------


def _roi_data(rng, dtype, shape):
    if np.dtype(dtype) == np.int64:  # batch indices
        return rng.integers(0, 2, shape).astype(dtype)
    if len(shape) == 2 and shape[1] == 4:
        # (x1, y1, x2, y2) inside, across and beyond a 9 x 11 image; some tiny, some points
        lo = rng.uniform(-3, 12, (shape[0], 2))
        hi = lo + rng.uniform(0, 8, (shape[0], 2)) * (rng.random((shape[0], 1)) < 0.9)
        return np.concatenate([lo, hi], axis=1).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def roi(attrs, x=(2, 3, 9, 11), rois="_r", dtype="float32", oracle="ort"):
    return Case("RoiAlign", ["x", "rois", "idx"], attrs,
                feeds={"x": (dtype, list(x)), "rois": (dtype, [rois, 4]), "idx": ("int64", [rois])},
                data=_roi_data, oracle=oracle)


def test_roi_align():
    cases = []
    for opset_16 in (False, True):
        for mode in ("avg", "max"):
            for ratio in (0, 1, 2, 3):
                attrs = {"mode": mode, "sampling_ratio": ratio, "output_height": 3,
                         "output_width": 2, "spatial_scale": 0.5 if ratio % 2 else 1.0}
                if opset_16:
                    attrs["coordinate_transformation_mode"] = ("half_pixel" if ratio < 2
                                                               else "output_half_pixel")
                cases.append((opset_16, roi(attrs)))
    cases.append((True, roi({"output_height": 2, "output_width": 4}, x=("n", 2, "_h", "_w"))))
    cases.append((True, roi({"output_height": 2, "output_width": 2}, dtype="float64")))
    sizes = [{"_r": 1, "n": 2, "_h": 9, "_w": 11}, {"_r": 7, "n": 3, "_h": 4, "_w": 13}]
    check_cases([c for new, c in cases if not new], sizes=sizes, opset=10)
    check_cases([c for new, c in cases if new], sizes=sizes, opset=16)


def test_backend_node_tests():
    tests = backend_cases("gridsample", ["GridSample"]) + backend_cases("roialign", ["RoiAlign"])
    assert len(tests) >= 21
    check_backend_cases(tests)


# -- errors ----------------------------------------------------------------------------------


def _model(op, inputs, opset, **attrs):
    # no onnx shape inference here: it would reject the broken models before cuvil sees them
    graph = helper.make_graph(
        [helper.make_node(op, [n for n, _, _ in inputs], ["y"], **attrs)], "bad",
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", inputs[0][1], None)])
    graph.output[0].type.tensor_type.shape.SetInParent()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


F, I64, I32 = 1, 7, 6


def test_grid_sample_errors():
    x, grid = ("x", F, [1, 1, 4, 4]), ("grid", F, [1, 3, 3, 2])
    with pytest.raises(ModelError, match=r"'y' \(GridSample\): mode 'bilinear' is not one of "
                                         r"\['linear', 'nearest', 'cubic'\]"):
        cuvil.compile(_model("GridSample", [x, grid], 20, mode="bilinear"))
    with pytest.raises(ModelError, match="mode 'linear' is not one of"):
        cuvil.compile(_model("GridSample", [x, grid], 16, mode="linear"))
    with pytest.raises(ModelError, match="padding_mode 'mirror'"):
        cuvil.compile(_model("GridSample", [x, grid], 20, padding_mode="mirror"))
    with pytest.raises(ModelError, match="grid's last dim"):
        cuvil.compile(_model("GridSample", [x, ("grid", F, [1, 3, 3, 3])], 20))
    with pytest.raises(ModelError, match="batch of X and grid"):
        cuvil.compile(_model("GridSample", [x, ("grid", F, [2, 3, 3, 2])], 20))
    with pytest.raises(ModelError, match="must be 4-D"):
        cuvil.compile(_model("GridSample", [("x", F, [1, 1, 2, 4, 4]), ("grid", F, [1, 2, 3, 3, 3])],
                             16))
    with pytest.raises(UnsupportedOpError, match=r"interpolates.*int32"):
        cuvil.compile(_model("GridSample", [("x", I32, [1, 1, 4, 4]), grid], 20))


def test_roi_align_errors():
    x, rois, idx = ("x", F, [1, 1, 5, 5]), ("rois", F, [2, 4]), ("idx", I64, [2])
    with pytest.raises(ModelError, match=r"'y' \(RoiAlign\): mode 'sum'"):
        cuvil.compile(_model("RoiAlign", [x, rois, idx], 16, mode="sum"))
    with pytest.raises(ModelError, match="rois columns"):
        cuvil.compile(_model("RoiAlign", [x, ("rois", F, [2, 5]), idx], 16))
    with pytest.raises(ModelError, match="rows of rois and batch_indices"):
        cuvil.compile(_model("RoiAlign", [x, rois, ("idx", I64, [3])], 16))
    compiled = cuvil.compile(_model("RoiAlign", [x, rois, idx], 16, output_height=2,
                                    output_width=2))
    feeds = {"x": np.ones((1, 1, 5, 5), np.float32),
             "rois": np.array([[0, 0, 2, 2], [1, 1, 4, 4]], np.float32)}
    with pytest.raises(ValueError, match=r"RoiAlign.*index out of range"):
        compiled.run({**feeds, "idx": np.array([0, 1], np.int64)})
    np.testing.assert_allclose(compiled.run({**feeds, "idx": np.zeros(2, np.int64)})["y"],
                               np.ones((2, 1, 2, 2), np.float32))
