"""Single Conv + ReLU layers (ResNet-50's and SqueezeNet's shapes) through cuvil and
onnxruntime in one run.

Where whole-model figures (`suite.py`) say "slower", this says which layer shape is: it
reports each layer's median latency, GFLOP/s and the ratio cuvil / onnxruntime (< 1: cuvil
is faster). CUVIL_NUM_THREADS=1 runs both on one thread (onnxruntime's intra-op threads
follow it), which takes the thread pools out of the comparison.

    python benchmarks/conv_layers.py
    CUVIL_NUM_THREADS=1 python benchmarks/conv_layers.py

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import os
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import cuvil

#: (in channels, out channels, kernel, input size, stride[, pads]; pads default to kernel // 2)
LAYERS = [(3, 64, 7, 224, 2), (64, 64, 3, 56, 1), (64, 256, 1, 56, 1), (128, 128, 3, 28, 1),
          (256, 256, 3, 14, 1), (1024, 256, 1, 14, 1), (512, 512, 3, 7, 1),
          # ResNet-50's strided 3x3s, its 1x1s at 7x7 (N = 49 positions), SqueezeNet's stem,
          # its last 1x1 and a squeeze layer
          (128, 128, 3, 56, 2), (256, 256, 3, 28, 2), (512, 512, 3, 14, 2), (2048, 512, 1, 7, 1),
          (512, 2048, 1, 7, 1), (3, 64, 3, 224, 2, 0), (512, 1000, 1, 13, 1), (128, 16, 1, 55, 1)]


def conv_relu(cin: int, cout: int, k: int, size: int, stride: int, pad: int | None = None):
    rng = np.random.default_rng(0)
    pad = k // 2 if pad is None else pad
    out = (size + 2 * pad - k) // stride + 1
    w = numpy_helper.from_array(rng.standard_normal((cout, cin, k, k)).astype(np.float32) * 0.1, "w")
    b = numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride] * 2),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, out, out])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), out


def median_ms(fn, *args, repeat: int = 20) -> float:
    # on one thread, the calling thread's CPU time: other processes on a shared host then
    # slow the figures less (onnxruntime runs its single intra-op thread on the caller too)
    clock = time.thread_time if os.environ.get("CUVIL_NUM_THREADS") == "1" else time.perf_counter
    fn(*args)
    times = []
    for _ in range(repeat):
        t = clock()
        fn(*args)
        times.append(clock() - t)
    return float(np.median(times) * 1000)


def main() -> int:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(os.environ.get("CUVIL_NUM_THREADS") or 0)
    print(f"{'layer':<28} {'cuvil ms':>9} {'GF/s':>5} {'ort ms':>8} {'GF/s':>5} {'ratio':>6}")
    for cin, cout, k, size, stride, *pad in LAYERS:
        model, out = conv_relu(cin, cout, k, size, stride, *pad)
        compiled = cuvil.compile(model)
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal((1, cin, size, size)).astype(np.float32)
        ours = median_ms(compiled, x)
        theirs = median_ms(sess.run, None, {"x": x})
        gflop = 2 * cin * cout * k * k * out * out / 1e9
        name = f"{cin}->{cout} {k}x{k}/{stride}{'' if not pad else f' p{pad[0]}'} at {size}x{size}"
        print(f"{name:<28} {ours:9.2f} {gflop / ours * 1e3:5.0f} {theirs:8.2f} "
              f"{gflop / theirs * 1e3:5.0f} {ours / theirs:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
