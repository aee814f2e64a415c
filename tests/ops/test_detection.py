"""A YOLO-style detection head ending in NonMaxSuppression and a Gather of the kept boxes,
against onnxruntime: a symbolic batch, run-time IoU and score thresholds, inputs that keep no
box, one and many; both box formats (center_point_box).

onnx's NonMaxSuppression node tests run in the conformance suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from oracle import run_ort

import cuvil

RNG = np.random.default_rng(20261205)
CLASSES = 3
GRID = 8  # 16x16 image, stride 2: 64 anchors


def yolo_head(center_point_box: int = 1, max_per_class: int = 5) -> onnx.ModelProto:
    """image [batch, 3, 16, 16] -> conv -> [batch, 4 + classes, 64] -> boxes [batch, 64, 4]
    and sigmoid scores [batch, classes, 64] -> NMS -> the kept boxes, scores and classes."""
    anchors = GRID * GRID
    n = helper.make_node
    inits = {
        "w": RNG.standard_normal((4 + CLASSES, 3, 3, 3)).astype(np.float32) * 0.5,
        "bias": RNG.standard_normal(4 + CLASSES).astype(np.float32) * 0.1,
        "flat": np.array([0, 4 + CLASSES, anchors], np.int64),
        "zero": np.array([0], np.int64), "four": np.array([4], np.int64),
        "end": np.array([4 + CLASSES], np.int64), "one": np.array([1], np.int64),
        "scale": np.array(16.0, np.float32),
        "max_out": np.array([max_per_class], np.int64),
        "col0": np.array(0, np.int64), "col1": np.array(1, np.int64),
        "col2": np.array(2, np.int64),
        "anchors": np.array(anchors, np.int64), "classes": np.array(CLASSES, np.int64),
        "rows4": np.array([-1, 4], np.int64), "rows1": np.array([-1], np.int64),
    }
    nodes = [
        n("Conv", ["image", "w", "bias"], ["feat"], pads=[1, 1, 1, 1], strides=[2, 2]),
        n("Reshape", ["feat", "flat"], ["pred"]),                       # [b, 4 + c, 64]
        n("Slice", ["pred", "zero", "four", "one"], ["box_raw"]),
        n("Slice", ["pred", "four", "end", "one"], ["cls_raw"]),
        n("Sigmoid", ["box_raw"], ["box_unit"]),
        n("Mul", ["box_unit", "scale"], ["box_px"]),
        n("Transpose", ["box_px"], ["boxes"], perm=[0, 2, 1]),          # [b, 64, 4]
        n("Sigmoid", ["cls_raw"], ["scores"]),                          # [b, c, 64]
        n("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_min"], ["selected"],
          center_point_box=center_point_box),
        # the kept boxes: row (batch * 64 + box) of the boxes as [b * 64, 4]
        n("Gather", ["selected", "col0"], ["batch_i"], axis=1),
        n("Gather", ["selected", "col1"], ["class_i"], axis=1),
        n("Gather", ["selected", "col2"], ["box_i"], axis=1),
        n("Mul", ["batch_i", "anchors"], ["batch_rows"]),
        n("Add", ["batch_rows", "box_i"], ["row"]),
        n("Reshape", ["boxes", "rows4"], ["all_boxes"]),
        n("Gather", ["all_boxes", "row"], ["kept_boxes"], axis=0),       # [n, 4]
        # and their scores: element ((batch * classes + class) * 64 + box)
        n("Mul", ["batch_i", "classes"], ["bc"]),
        n("Add", ["bc", "class_i"], ["bc2"]),
        n("Mul", ["bc2", "anchors"], ["bc3"]),
        n("Add", ["bc3", "box_i"], ["score_at"]),
        n("Reshape", ["scores", "rows1"], ["all_scores"]),
        n("Gather", ["all_scores", "score_at"], ["kept_scores"], axis=0),
        n("Unsqueeze", ["kept_scores", "one"], ["score_col"]),
        n("Cast", ["class_i"], ["class_f"], to=T.FLOAT),
        n("Unsqueeze", ["class_f", "one"], ["class_col"]),
        n("Concat", ["kept_boxes", "score_col", "class_col"], ["detections"], axis=1),  # [n, 6]
    ]
    graph = helper.make_graph(
        nodes, "yolo_head",
        [helper.make_tensor_value_info("image", T.FLOAT, ["batch", 3, 16, 16]),
         helper.make_tensor_value_info("iou", T.FLOAT, [1]),
         helper.make_tensor_value_info("score_min", T.FLOAT, [1])],
        [helper.make_empty_tensor_value_info(o) for o in ("selected", "detections", "scores")],
        [numpy_helper.from_array(a, k) for k, a in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


@pytest.fixture(scope="module")
def head():
    model = yolo_head()
    return model, cuvil.compile(model)


def _check(model, compiled, feeds) -> int:
    want = run_ort(model, feeds)
    got = compiled.run(feeds)
    for info, w in zip(compiled.outputs, want):
        have = got[info.name]
        assert have.shape == w.shape, (info.name, have.shape, w.shape)
        np.testing.assert_allclose(have, w, rtol=1e-5, atol=1e-6, err_msg=info.name)
    return len(want[0])


def _images(batch: int) -> np.ndarray:
    return RNG.standard_normal((batch, 3, 16, 16)).astype(np.float32)


@pytest.mark.parametrize("batch", [1, 2])
def test_none_one_and_many_boxes_match_onnxruntime(head, batch) -> None:
    model, compiled = head
    image = _images(batch)
    scores = run_ort(model, {"image": image, "iou": np.array([0.5], np.float32),
                             "score_min": np.array([0.0], np.float32)})[2]
    top = np.sort(scores.reshape(-1))[::-1]
    kept = {}
    for label, iou, score_min in [("none", 0.5, 1.0), ("one", 0.5, (top[0] + top[1]) / 2),
                                  ("many", 0.5, 0.0), ("all overlapping", 0.0, 0.0),
                                  ("none suppressed", 1.0, 0.2)]:
        feeds = {"image": image, "iou": np.array([iou], np.float32),
                 "score_min": np.array([score_min], np.float32)}
        kept[label] = _check(model, compiled, feeds)
    assert kept["none"] == 0 and kept["one"] == 1
    assert kept["many"] > CLASSES * batch and kept["many"] <= 5 * CLASSES * batch


def test_outputs_describe_the_bound_of_the_kept_boxes(head) -> None:
    _, compiled = head
    selected, detections, _ = compiled.outputs
    assert selected.data_dependent == (0,) and selected.max_shape == ("15*batch", 3)
    assert detections.data_dependent == (0,) and detections.max_shape == ("15*batch", 6)


def test_corner_boxes_and_a_run_time_limit() -> None:
    """center_point_box = 0 (corners, either one first) with the box limit a graph input."""
    n = helper.make_node
    model = helper.make_model(helper.make_graph(
        [n("NonMaxSuppression", ["boxes", "scores", "limit", "iou"], ["selected"])], "nms",
        [helper.make_tensor_value_info("boxes", T.FLOAT, ["b", 40, 4]),
         helper.make_tensor_value_info("scores", T.FLOAT, ["b", 2, 40]),
         helper.make_tensor_value_info("limit", T.INT64, [1]),
         helper.make_tensor_value_info("iou", T.FLOAT, [1])],
        [helper.make_tensor_value_info("selected", T.INT64, ["k", 3])]),
        opset_imports=[helper.make_opsetid("", 11)])
    compiled = cuvil.compile(model)
    assert compiled.outputs[0].max_shape == ("80*b", 3)
    for limit, batch in [(0, 1), (3, 2), (100, 1)]:
        boxes = RNG.uniform(0, 10, (batch, 40, 4)).astype(np.float32)
        feeds = {"boxes": boxes, "scores": RNG.random((batch, 2, 40)).astype(np.float32),
                 "limit": np.array([limit], np.int64), "iou": np.array([0.3], np.float32)}
        _check(model, compiled, feeds)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the wheel-building tests target x86_64 Linux")
def test_the_head_through_a_built_wheel(tmp_path, monkeypatch) -> None:
    """The generated package (its checksum, header and loader copy) returns the kept boxes in
    their actual number, for the C ABI's bounded buffers."""
    import cuvil.build_backend as backend

    root = tmp_path / "project"
    root.mkdir()
    model = yolo_head()
    onnx.save(model, str(root / "head.onnx"))
    (root / "pyproject.toml").write_text(
        '[project]\nname = "heads"\nversion = "0.1"\n\n[tool.cuvil]\npackage = "heads"\n\n'
        '[tool.cuvil.models.yolo]\nsource = "head.onnx"\n')
    monkeypatch.chdir(root)
    monkeypatch.setenv("CUVIL_CPU", "x86-64")  # one copy of the code: a quick compile
    monkeypatch.setenv("CUVIL_CACHE", "0")
    with zipfile.ZipFile(root / "dist" / backend.build_wheel(str(root / "dist"))) as archive:
        archive.extractall(tmp_path / "site")
        header = archive.read("heads/yolo.h").decode()
    assert "#define CUVIL_YOLO_NUM_DATA_DIMS 1" in header
    assert "int64_t *dims, void *workspace);" in header and "buffer for 15*batch x 3" in header
    image = _images(2)
    feeds = {"image": image, "iou": np.array([0.5], np.float32),
             "score_min": np.array([0.3], np.float32)}
    np.savez(tmp_path / "feeds.npz", **feeds)
    code = ("import sys, numpy as np, heads; f = dict(np.load(sys.argv[1])); "
            "out = heads.yolo.run(f); np.savez(sys.argv[2], **out)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "feeds.npz"),
                           str(tmp_path / "got.npz")], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "got.npz")
    for name, want in zip(("selected", "detections", "scores"), run_ort(model, feeds)):
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
