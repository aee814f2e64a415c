"""Detection post-processing against onnxruntime at batch 1: NonMaxSuppression and the Gather
of the kept boxes, at YOLOv8's size (8400 anchors, 80 classes) and on a small one.

    python benchmarks/nms_head.py [--runs 200]

Both engines run in this process on the same inputs, in alternating blocks; the figures are
median latencies per call and their ratio (onnxruntime / cuvil: above 1, cuvil is faster).
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import cuvil


def nms_head(anchors: int, classes: int, max_per_class: int = 100) -> onnx.ModelProto:
    n = helper.make_node
    inits = {"max_out": np.array([max_per_class], np.int64), "col0": np.array(0, np.int64),
             "col2": np.array(2, np.int64), "anchors": np.array(anchors, np.int64),
             "rows4": np.array([-1, 4], np.int64)}
    nodes = [
        n("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score_min"], ["selected"],
          center_point_box=1),
        n("Gather", ["selected", "col0"], ["batch_i"], axis=1),
        n("Gather", ["selected", "col2"], ["box_i"], axis=1),
        n("Mul", ["batch_i", "anchors"], ["rows"]),
        n("Add", ["rows", "box_i"], ["row"]),
        n("Reshape", ["boxes", "rows4"], ["all_boxes"]),
        n("Gather", ["all_boxes", "row"], ["kept"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "nms_head",
        [helper.make_tensor_value_info("boxes", T.FLOAT, ["batch", anchors, 4]),
         helper.make_tensor_value_info("scores", T.FLOAT, ["batch", classes, anchors]),
         helper.make_tensor_value_info("iou", T.FLOAT, [1]),
         helper.make_tensor_value_info("score_min", T.FLOAT, [1])],
        [helper.make_tensor_value_info("selected", T.INT64, ["k", 3]),
         helper.make_tensor_value_info("kept", T.FLOAT, ["k", 4])],
        [numpy_helper.from_array(a, k) for k, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds(anchors: int, classes: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Boxes on a 640x640 image; scores mostly low, as a detector's are."""
    centers = rng.uniform(0, 640, (1, anchors, 2))
    sizes = rng.uniform(8, 160, (1, anchors, 2))
    logits = rng.normal(-4.0, 2.0, (1, classes, anchors))
    return {"boxes": np.concatenate([centers, sizes], axis=2).astype(np.float32),
            "scores": (1 / (1 + np.exp(-logits))).astype(np.float32),
            "iou": np.array([0.45], np.float32), "score_min": np.array([0.25], np.float32)}


def median_latency(call, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for anchors, classes in [(8400, 80), (64, 3)]:
        model = nms_head(anchors, classes)
        x = feeds(anchors, classes, rng)
        compiled = cuvil.compile(model)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        compiled.num_threads = 1
        want, got = sess.run(None, x), compiled.run(x)
        assert all(np.array_equal(w, got[k]) for w, k in zip(want, ("selected", "kept")))
        cuvil_s, ort_s = [], []
        for _ in range(4):  # alternating blocks
            cuvil_s.append(median_latency(functools.partial(compiled.run, x), args.runs // 4))
            ort_s.append(median_latency(functools.partial(sess.run, None, x), args.runs // 4))
        c, o = float(np.median(cuvil_s)), float(np.median(ort_s))
        print(f"NMS head, {anchors} anchors x {classes} classes, batch 1, 1 thread, "
              f"{len(want[0])} boxes kept: cuvil {c * 1e3:.3f} ms, onnxruntime {o * 1e3:.3f} ms, "
              f"ratio {o / c:.2f}")


if __name__ == "__main__":
    main()
