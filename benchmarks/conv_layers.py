"""Single Conv + ReLU layers (ResNet-50's, SqueezeNet's and other small maps' shapes)
through cuvil and onnxruntime in one run.

Where whole-model figures (`suite.py`) say "slower", this says which layer shape is: it
reports each layer's median time per call, GFLOP/s and the ratio cuvil / onnxruntime (< 1:
cuvil is faster), and which path cuvil took (winograd F(m) or im2col). At one thread
(`CUVIL_NUM_THREADS=1`, the default here) both run on the calling thread and are timed in
its CPU time (`time.thread_time`), so other processes on the core do not count; at more
threads, in wall time, with a pause after onnxruntime's calls (its workers spin ~50 ms after
a run and would take a core from cuvil's next ones). The engines alternate in rounds.

    python benchmarks/conv_layers.py                 # every layer below
    python benchmarks/conv_layers.py --small         # the 3x3 layers at 14x14 and below
    CUVIL_NUM_THREADS=2 python benchmarks/conv_layers.py --small
    python benchmarks/conv_layers.py --resnet50      # each distinct conv of ResNet-50, with
                                                     # its count and the summed times
    python benchmarks/conv_layers.py --resnet50 --precision bf16   # cuvil's bf16 kernels

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("CUVIL_NUM_THREADS", "1")

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import cuvil

#: (in channels, out channels, kernel, input size, stride[, pads]; pads default to kernel // 2):
#: ResNet-50's, its strided 3x3s, its 1x1s at 7x7 (N = 49 positions), SqueezeNet's stem, its
#: last 1x1 and a squeeze layer; then (--small) the 3x3 layers of small feature maps
#: (SqueezeNet's at 13x13, ResNet-50's, VGG-19's and Inception v2's at 14x14 and 7x7)
LAYERS = [(3, 64, 7, 224, 2), (64, 64, 3, 56, 1), (64, 256, 1, 56, 1), (128, 128, 3, 28, 1),
          (256, 256, 3, 14, 1), (1024, 256, 1, 14, 1), (512, 512, 3, 7, 1),
          (128, 128, 3, 56, 2), (256, 256, 3, 28, 2), (512, 512, 3, 14, 2), (2048, 512, 1, 7, 1),
          (512, 2048, 1, 7, 1), (3, 64, 3, 224, 2, 0), (512, 1000, 1, 13, 1), (128, 16, 1, 55, 1)]
SMALL = [(64, 256, 3, 13, 1), (48, 192, 3, 13, 1), (256, 256, 3, 14, 1), (512, 512, 3, 14, 1),
         (96, 128, 3, 14, 1), (160, 192, 3, 14, 1), (512, 512, 3, 7, 1), (192, 320, 3, 7, 1),
         (224, 224, 3, 7, 1), (64, 96, 3, 28, 1), (128, 128, 3, 28, 1)]

#: every distinct conv of ResNet-50 (v1.5, onnx's light_resnet50) and how often it occurs:
#: (in, out, kernel, input size, stride, pads, count)
RESNET50 = [(3, 64, 7, 224, 2, 3, 1), (64, 64, 1, 56, 1, 0, 1), (64, 64, 3, 56, 1, 1, 3),
            (64, 256, 1, 56, 1, 0, 4), (256, 64, 1, 56, 1, 0, 2), (256, 128, 1, 56, 1, 0, 1),
            (128, 128, 3, 56, 2, 1, 1), (256, 512, 1, 56, 2, 0, 1), (128, 512, 1, 28, 1, 0, 4),
            (512, 128, 1, 28, 1, 0, 3), (128, 128, 3, 28, 1, 1, 3), (512, 256, 1, 28, 1, 0, 1),
            (256, 256, 3, 28, 2, 1, 1), (512, 1024, 1, 28, 2, 0, 1), (256, 1024, 1, 14, 1, 0, 6),
            (1024, 256, 1, 14, 1, 0, 5), (256, 256, 3, 14, 1, 1, 5), (1024, 512, 1, 14, 1, 0, 1),
            (512, 512, 3, 14, 2, 1, 1), (1024, 2048, 1, 14, 2, 0, 1), (512, 2048, 1, 7, 1, 0, 3),
            (2048, 512, 1, 7, 1, 0, 2), (512, 512, 3, 7, 1, 1, 2)]


def conv_relu(cin: int, cout: int, k: int, size: int, stride: int, pad: int | None = None,
              batch: int = 1):
    rng = np.random.default_rng(0)
    pad = k // 2 if pad is None else pad
    out = (size + 2 * pad - k) // stride + 1
    w = numpy_helper.from_array(rng.standard_normal((cout, cin, k, k)).astype(np.float32) * 0.1, "w")
    b = numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride] * 2),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, cin, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, cout, out, out])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), out


def timed(fn, *args, calls: int, cpu: bool) -> list[float]:
    clock = time.thread_time if cpu else time.perf_counter
    times = []
    for _ in range(calls):
        t = clock()
        fn(*args)
        times.append(clock() - t)
    return times


def path_of(compiled, x: np.ndarray) -> str:
    ops = [n.op for n in compiled.profile({"x": x}, runs=1).nodes]
    return ops[0].split("+")[0].removeprefix("Conv").strip("()") or "im2col"


def main() -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="only the small 3x3 layers")
    parser.add_argument("--resnet50", action="store_true",
                        help="ResNet-50's distinct convs, with counts and summed times")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--precision", choices=("float32", "bf16"), default="float32",
                        help="cuvil's precision (bf16: its kernels where the CPU has them)")
    args = parser.parse_args()
    threads = int(os.environ["CUVIL_NUM_THREADS"])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    cpu = threads == 1
    print(f"{threads} thread(s), batch {args.batch}, {'CPU' if cpu else 'wall'} time, "
          f"cuvil in {args.precision}")
    print(f"{'layer':<26} {'path':<10} {'cuvil ms':>9} {'GF/s':>5} {'ort ms':>8} {'GF/s':>5} "
          f"{'ratio':>6} {'max err':>8}")
    layers = ([(*layer, 1) for layer in (SMALL if args.small else LAYERS)] if not args.resnet50
              else [(cin, cout, k, size, stride, pad, count)
                    for cin, cout, k, size, stride, pad, count in RESNET50])
    totals = [0.0, 0.0, 0.0]  # GFLOP, cuvil ms, onnxruntime ms, each times the layer's count
    for cin, cout, k, size, stride, *pad, count in layers:
        model, out = conv_relu(cin, cout, k, size, stride, *pad, batch=args.batch)
        compiled = cuvil.compile(model, precision=args.precision)
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal((args.batch, cin, size, size)).astype(np.float32)
        ref = sess.run(None, {"x": x})[0]
        err = float(np.abs(compiled(x) - ref).max() / np.abs(ref).max())
        gflop = 2 * cin * cout * k * k * out * out * args.batch / 1e9
        calls = max(3, int(2 / gflop))  # about 20 ms per engine and round at 100 GFLOP/s
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours += timed(compiled, x, calls=calls, cpu=cpu)
            theirs += timed(sess.run, None, {"x": x}, calls=calls, cpu=cpu)
            time.sleep(0.1)  # onnxruntime's spinning workers
        ours_ms, theirs_ms = float(np.median(ours) * 1e3), float(np.median(theirs) * 1e3)
        totals = [totals[0] + gflop * count, totals[1] + ours_ms * count,
                  totals[2] + theirs_ms * count]
        name = (f"{cin}->{cout} {k}x{k}/{stride}{'' if not pad or args.resnet50 else f' p{pad[0]}'}"
                f" at {size}x{size}{f' x{count}' if args.resnet50 else ''}")
        print(f"{name:<26} {path_of(compiled, x):<10} {ours_ms:9.3f} {gflop / ours_ms * 1e3:5.0f} "
              f"{theirs_ms:8.3f} {gflop / theirs_ms * 1e3:5.0f} {ours_ms / theirs_ms:6.2f} "
              f"{err:8.1e}", flush=True)
    if args.resnet50:
        gflop, ours_ms, theirs_ms = totals
        print(f"{'all convs':<26} {'':<10} {ours_ms:9.3f} {gflop / ours_ms * 1e3:5.0f} "
              f"{theirs_ms:8.3f} {gflop / theirs_ms * 1e3:5.0f} {ours_ms / theirs_ms:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
