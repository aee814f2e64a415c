"""One op at a time: cuvil against onnxruntime and OpenVINO on the FLOP-carrying ops' shapes.

Each row is a one-node (or tiny) ONNX model with dense random weights, built with onnx.helper
(saved under --out/models/ for other tools), compiled by cuvil in this process
(for this CPU, or the one `--cpu` names) and run beside an onnxruntime session and OpenVINO's CPU
plugin on the same input, the engines interleaved in blocks with the suite's settling
(`suite.interleaved`), at each thread count. Where a model is slow, this says which op
shape it owes its time to.

    python benchmarks/ops.py                                      # every family, threads 1 and 2
    python benchmarks/ops.py --families convtranspose2d,matmul --threads 1 --quick
    python benchmarks/ops.py --families lstm --shapes 1 --engines cuvil,onnxruntime

Printed and written (results.md, results.json in --out) per shape and thread count: GFLOP,
the median ms of each engine, cuvil's GFLOP/s and its share of the FMA peak of that many
cores (peak.py), cuvil / onnxruntime and cuvil / the faster of onnxruntime and OpenVINO
(< 1: cuvil is faster), and the largest difference of cuvil's and OpenVINO's outputs from
onnxruntime's, relative to its largest output. Figures vary with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops
import peak
import report
import suite
import zoo

OPSET = 17
#: what a shape's maker returns: its label, its model and the model's feeds
Made = tuple[str, onnx.ModelProto, dict[str, np.ndarray]]
Maker = Callable[[], Made]


@dataclass
class Op:
    family: str
    shape: str  # the label in the table
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]],
           weights: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A graph of `nodes` whose last node's first output is the model's output, with the shape
    onnx infers (the checker wants one); its inputs standard-normal float32 feeds of these
    shapes."""
    output = nodes[-1].output[0]
    graph = helper.make_graph(
        nodes, "op", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, n) for n, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    del model.graph.value_info[:]  # only the output's
    rng = np.random.default_rng(1)
    return model, {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}


def _weight(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Dense random weights scaled so that outputs of standard-normal inputs are about 1."""
    return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)


# --- the families ------------------------------------------------------------------------------


def conv_transpose(cin: int, cout: int, size: int, k: int, s: int, p: int, groups: int = 1,
                   output_padding: int = 0, dims: int = 2) -> Made:
    rng = np.random.default_rng(0)
    w = _weight(rng, (cin, cout // groups, *[k] * dims), cin // groups * k ** dims // s ** dims)
    attrs: dict[str, Any] = {"kernel_shape": [k] * dims, "strides": [s] * dims, "pads": [p] * 2 * dims,
                             "group": groups}
    if output_padding:
        attrs["output_padding"] = [output_padding] * dims
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    model, feeds = _model([node], {"x": [1, cin, *[size] * dims]},
                          {"w": w, "b": rng.normal(0, 0.1, cout).astype(np.float32)})
    side = f"{size}x{size}" if dims == 2 else f"{size} frames"
    label = (f"{cin}->{cout} {side} k{k} s{s} p{p}" + (f" groups {groups}" if groups > 1 else "")
             + (f" output_padding {output_padding}" if output_padding else ""))
    return label, model, feeds


def conv(cin: int, cout: int, size: int, k: int, groups: int = 1, stride: int = 1,
         dims: int = 2) -> Made:
    rng = np.random.default_rng(0)
    w = _weight(rng, (cout, cin // groups, *[k] * dims), cin // groups * k ** dims)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k] * dims, strides=[stride] * dims,
                            pads=[k // 2] * 2 * dims, group=groups)
    model, feeds = _model([node], {"x": [1, cin, *[size] * dims]},
                          {"w": w, "b": rng.normal(0, 0.1, cout).astype(np.float32)})
    side = f"{size}x{size}" if dims == 2 else f"{size} frames"
    kind = "depthwise " if groups == cin == cout else f"groups {groups} " if groups > 1 else ""
    return f"{kind}{cin}->{cout} {side} k{k}" + (f" s{stride}" if stride > 1 else ""), model, feeds


def matmul(m: int, k: int, n: int) -> Made:
    """x [M, K] @ a constant W [K, N]: a transformer's linear layer over M tokens."""
    w = _weight(np.random.default_rng(0), (k, n), k)
    model, feeds = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": [m, k]}, {"w": w})
    return f"M {m}, {k}x{n}", model, feeds


def gemm(m: int, k: int, n: int) -> Made:
    """Gemm(x [M, K], W [N, K], bias, transB=1): nn.Linear as exporters write it for 2-D inputs."""
    rng = np.random.default_rng(0)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)
    model, feeds = _model([node], {"x": [m, k]},
                          {"w": _weight(rng, (n, k), k), "b": rng.normal(0, 0.1, n).astype(np.float32)})
    return f"M {m}, {k}x{n} transB + bias", model, feeds


def batched_matmul(a: list[int], b: list[int]) -> Made:
    """Both operands are inputs, as attention's Q @ K^T and P @ V."""
    model, feeds = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a, "b": b}, {})
    return f"{a} @ {b}", model, feeds


def einsum(equation: str, a: list[int], b: list[int], weight: bool = False) -> Made:
    """An Einsum of an input by an input, or by a constant weight (`weight`)."""
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation)
    w = {"b": _weight(np.random.default_rng(0), tuple(b), b[0])} if weight else {}
    model, feeds = _model([node], {"a": a} if weight else {"a": a, "b": b}, w)
    return f"{equation} {a}, {b}{' (weight)' if weight else ''}", model, feeds


def recurrent(op: str, hidden: int, seq: int, batch: int) -> Made:
    """One LSTM or GRU layer (input width = hidden) over [seq, batch, hidden]; GRU with
    linear_before_reset=1, as torch exports it."""
    gates = 4 if op == "LSTM" else 3
    rng = np.random.default_rng(0)
    weights = {"W": _weight(rng, (1, gates * hidden, hidden), hidden),
               "R": _weight(rng, (1, gates * hidden, hidden), hidden),
               "B": rng.normal(0, 0.1, (1, 2 * gates * hidden)).astype(np.float32)}
    extra: dict[str, Any] = {"linear_before_reset": 1} if op == "GRU" else {}
    node = helper.make_node(op, ["x", "W", "R", "B"], ["y"], hidden_size=hidden, **extra)
    model, feeds = _model([node], {"x": [seq, batch, hidden]}, weights)
    return f"hidden {hidden}, seq {seq}, batch {batch}", model, feeds


def qdq_matmul(m: int, k: int, n: int) -> Made:
    """MatMul in the QDQ form onnxruntime's quantize_static writes: x quantized to int8 and
    back, the weight int8 per output column with DequantizeLinear(axis=1), the product
    quantized to int8 and back (zero points 0, scales from the ranges of this input)."""
    rng = np.random.default_rng(0)
    w = _weight(rng, (k, n), k)
    w_scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)  # the feed _model makes
    x_scale = np.float32(np.abs(x).max() / 127)
    y_scale = np.float32(np.abs(x @ w).max() / 127)
    zero = np.array(0, np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zero"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["p"]),
             helper.make_node("QuantizeLinear", ["p", "y_scale", "zero"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "y_scale", "zero"], ["y"])]
    weights = {"x_scale": np.array(x_scale), "y_scale": np.array(y_scale), "zero": zero,
               "wq": np.round(w / w_scale).astype(np.int8), "w_scale": w_scale,
               "w_zero": np.zeros(n, np.int8)}
    model, feeds = _model(nodes, {"x": [m, k]}, weights)
    return f"M {m}, {k}x{n} int8 per-channel", model, feeds


def qdq_conv(cin: int, cout: int, size: int, k: int, stride: int = 1) -> Made:
    """Conv in the same QDQ form (int8 activations, int8 weights per output channel): the
    convolutions of an int8 ResNet."""
    rng = np.random.default_rng(0)
    w = _weight(rng, (cout, cin, k, k), cin * k * k)
    w_scale = (np.abs(w).reshape(cout, -1).max(axis=1) / 127).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((1, cin, size, size)).astype(np.float32)
    x_scale = np.float32(np.abs(x).max() / 127)
    y_scale = np.float32(x_scale * np.abs(w).sum(axis=(1, 2, 3)).max() / 127 / 4)
    zero = np.array(0, np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zero"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["p"], kernel_shape=[k, k],
                              strides=[stride, stride], pads=[k // 2] * 4),
             helper.make_node("QuantizeLinear", ["p", "y_scale", "zero"], ["pq"]),
             helper.make_node("DequantizeLinear", ["pq", "y_scale", "zero"], ["y"])]
    weights = {"x_scale": np.array(x_scale), "y_scale": np.array(y_scale), "zero": zero,
               "wq": np.round(w / w_scale[:, None, None, None]).astype(np.int8),
               "w_scale": w_scale, "w_zero": np.zeros(cout, np.int8)}
    model, feeds = _model(nodes, {"x": [1, cin, size, size]}, weights)
    side = f"{size}x{size} k{k}" + (f" s{stride}" if stride > 1 else "")
    return f"{cin}->{cout} {side} int8 per-channel", model, feeds


TRANSFORMER_KN = [(384, 1536), (1536, 384), (768, 768), (1024, 4096)]

#: family -> makers of its shapes, in order (--quick takes the first two of each)
FAMILIES: dict[str, list[Maker]] = {
    "convtranspose2d": [
        lambda: conv_transpose(384, 192, 16, 4, 2, 1),  # a ViT decoder's first upsampling
        lambda: conv_transpose(64, 32, 64, 2, 2, 0),  # a U-Net's
        lambda: conv_transpose(128, 128, 32, 4, 2, 1, groups=2),
        lambda: conv_transpose(64, 32, 32, 3, 2, 1, output_padding=1),
        lambda: conv_transpose(256, 64, 8, 16, 8, 4),  # FCN-style 8x upsampling
    ],
    "convtranspose1d": [
        lambda: conv_transpose(512, 256, 32, 16, 8, 4, dims=1),  # HiFi-GAN's first upsampling
        lambda: conv_transpose(128, 64, 2048, 4, 2, 1, dims=1),  # and its third
    ],
    "matmul": [lambda m=m, k=k, n=n: matmul(m, k, n) for m in (1, 64, 257, 512) for k, n in TRANSFORMER_KN],
    "gemm": [lambda m=m, k=k, n=n: gemm(m, k, n) for m in (1, 64) for k, n in TRANSFORMER_KN],
    "batched_matmul": [
        lambda: batched_matmul([12, 128, 64], [12, 64, 128]),  # attention scores, 12 heads
        lambda: batched_matmul([12, 128, 128], [12, 128, 64]),  # probabilities @ values
        lambda: batched_matmul([8, 12, 128, 64], [8, 12, 64, 128]),  # the scores at batch 8
    ],
    "einsum": [
        lambda: einsum("bhqd,bhkd->bhqk", [1, 12, 128, 64], [1, 12, 128, 64]),
        lambda: einsum("bhqk,bhkd->bhqd", [1, 12, 128, 128], [1, 12, 128, 64]),
        lambda: einsum("bld,dn->bln", [1, 128, 768], [768, 768], weight=True),
    ],
    "conv_grouped": [
        lambda: conv(256, 256, 28, 3, groups=32),  # ResNeXt's 32 x 8d
        lambda: conv(128, 128, 56, 3, groups=32),
    ],
    "conv_depthwise": [
        lambda: conv(32, 32, 112, 3, groups=32), lambda: conv(32, 32, 112, 5, groups=32),
        lambda: conv(512, 512, 14, 3, groups=512), lambda: conv(512, 512, 14, 5, groups=512),
    ],
    "conv1d": [
        lambda: conv(256, 256, 1000, 3, dims=1),
        lambda: conv(80, 256, 200, 3, stride=2, dims=1),  # gru_speech's subsampling
    ],
    "lstm": [lambda b=b: recurrent("LSTM", 256, 100, b) for b in (1, 8)],
    "gru": [lambda b=b: recurrent("GRU", 256, 100, b) for b in (1, 8)],
    "qdq_matmul": [
        lambda: qdq_matmul(64, 768, 768), lambda: qdq_matmul(257, 1024, 4096),
        lambda: qdq_matmul(1, 768, 768),
    ],
    "qdq_conv": [  # ResNet-50's stages
        lambda: qdq_conv(64, 64, 56, 3), lambda: qdq_conv(256, 64, 56, 1),
        lambda: qdq_conv(128, 128, 28, 3), lambda: qdq_conv(256, 256, 14, 3),
        lambda: qdq_conv(512, 512, 7, 3), lambda: qdq_conv(1024, 256, 14, 1),
    ],
}


def ops(families: list[str], per_family: int) -> list[tuple[str, int, Maker]]:
    """(family, index in it, maker) of the first `per_family` shapes of each family (0: all)."""
    return [(family, index, make) for family in families
            for index, make in enumerate(FAMILIES[family][:per_family or None])]


# --- measuring ---------------------------------------------------------------------------------


def measure(family: str, index: int, made: Made, args: argparse.Namespace,
            best_peak: float) -> list[dict[str, Any]]:
    """Rows of one op at each thread count."""
    from cuvil.compiler.driver import compile_in_process

    label, model, feeds = made
    path = args.out / "models" / f"{family}_{index}.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    gflop = flops.count_flops(model, feeds)[0] / 1e9
    base: dict[str, Any] = {"family": family, "shape": label, "gflop": gflop, "model": str(path)}
    ours = None
    if "cuvil" in args.engines:
        try:
            start = time.perf_counter()
            ours = compile_in_process(str(path), name=f"op_{family}_{index}", cpu=args.cpu)
            base["compile_s"] = time.perf_counter() - start
        except Exception as exc:  # report it, time the others
            base["cuvil_error"] = _message(exc)
    rows = []
    for threads in args.threads:
        row = {**base, "threads": threads}
        session = suite.ort_session(path, threads)
        expected = session.run(None, feeds)
        names = [o.name for o in session.get_outputs()]
        calls: dict[str, Callable[[], Any]] = {"ort": lambda s=session: s.run(None, feeds)}
        if ours is not None:
            try:
                ours.num_threads = threads
                row["cuvil_diff"] = suite.max_rel_diff(ours.run(feeds), expected, names)
                calls["cuvil"] = lambda m=ours: m.run(feeds)
            except Exception as exc:
                row["cuvil_error"] = _message(exc)
        if "openvino" in args.engines:
            try:
                theirs = suite.OpenVino(path, {n: list(v.shape) for n, v in feeds.items()}, threads)
                row["openvino_diff"] = suite.max_rel_diff(theirs.run(feeds), expected, names)
                calls["openvino"] = lambda o=theirs: o.run(feeds)
            except Exception as exc:
                row["openvino_error"] = _message(exc)
        times = suite.interleaved(calls, args.budget, args.min_runs)
        for engine, samples in times.items():
            row[engine] = suite.summary_ms(samples)["median_ms"]
        row["best"] = "openvino" if row.get("openvino", math.inf) < row["ort"] else "ort"
        if "cuvil" in row:
            row["cuvil_gflops"] = gflop / (row["cuvil"] / 1e3)
            row["peak_fraction"] = row["cuvil_gflops"] / (best_peak * threads) if best_peak else None
            row["ratio"] = row["cuvil"] / row["ort"]
            row["ratio_best"] = row["cuvil"] / row[row["best"]]
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _message(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _f(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


COLUMNS = ("| family | shape | threads | GFLOP | cuvil ms | ort ms | ov ms | cuvil GFLOP/s | % peak "
           "| cuvil/ort | cuvil/best | diff cuvil | diff ov | notes |")

RULE = "| --- | --- |" + " ---: |" * 11 + " --- |"


def _line(row: dict[str, Any]) -> str:
    fraction = row.get("peak_fraction")
    percent = None if fraction is None else 100 * fraction
    notes = "; ".join(f"{e}: {row[f'{e}_error']}" for e in ("cuvil", "openvino") if f"{e}_error" in row)
    return (f"| {row['family']} | {row['shape']} | {row['threads']} | {row['gflop']:.3g} | "
            f"{_f(row.get('cuvil'), '.3f')} | {row['ort']:.3f} | {_f(row.get('openvino'), '.3f')} | "
            f"{_f(row.get('cuvil_gflops'), '.1f')} | {_f(percent, '.0f')} | "
            f"{_f(row.get('ratio'), '.2f')} | {_f(row.get('ratio_best'), '.2f')} | "
            f"{_f(row.get('cuvil_diff'), '.1e')} | {_f(row.get('openvino_diff'), '.1e')} | "
            f"{notes.replace('|', '/')} |")


def geomeans(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for threads in sorted({r["threads"] for r in rows}):
        for key, label in (("ratio", "cuvil/ort"), ("ratio_best", "cuvil/best")):
            ratios = [r[key] for r in rows if r["threads"] == threads and r.get(key)]
            if ratios:
                g = math.exp(sum(map(math.log, ratios)) / len(ratios))
                lines.append(f"geomean {label} at {threads} thread{'s' * (threads > 1)}: {g:.2f} "
                             f"(over {len(ratios)} shapes)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, of {', '.join(FAMILIES)} (default all)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--quick", action="store_true",
                        help="short time budgets (0.25 s per engine) and the first 2 shapes of each family")
    parser.add_argument("--shapes", type=int, default=None,
                        help="the first N shapes of each family (default all; --quick 2; 0: all)")
    parser.add_argument("--engines", default=",".join(suite.ENGINES),
                        help="cuvil,onnxruntime,openvino (default all; onnxruntime always runs)")
    parser.add_argument("--cpu", default="native",
                        help="the CPU cuvil compiles for (default: this one; x86-64-v3: its AVX2 "
                             "copy, whose int8 kernels use no VNNI)")
    parser.add_argument("--out", type=Path, default=zoo.ROOT / "build" / "bench" / "ops",
                        help="results and the op models (default build/bench/ops/)")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if unknown := set(families) - set(FAMILIES):
        parser.error(f"unknown families {sorted(unknown)}: pick from {', '.join(FAMILIES)}")
    args.engines = {e.strip() for e in args.engines.split(",") if e.strip()} | {"onnxruntime"}
    if args.engines - set(suite.ENGINES):
        parser.error(f"unknown engines {sorted(args.engines - set(suite.ENGINES))}")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.budget, args.min_runs = (0.25, 3) if args.quick else (1.0, 10)
    per_family = args.shapes if args.shapes is not None else 2 if args.quick else 0
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    info = suite.machine()
    info["cuvil_cpu"] = args.cpu
    info["fma_scaling_start"] = peak.fma_scaling(2)
    info["peak_gflops_one_core"] = peak.measure_peak(0.5 if args.quick else 1.5)
    print(report.header(info), flush=True)
    peaks = info["peak_gflops_one_core"]
    # the AVX2 copy's share of the AVX2 peak, not of a wider one it cannot use
    best_peak = (peaks.get("AVX2+FMA", 0.0) if args.cpu.startswith("x86-64-v3")
                 else max(peaks.values(), default=0.0))
    print(COLUMNS)
    print(RULE, flush=True)
    rows: list[dict[str, Any]] = []
    for family, index, make in ops(families, per_family):
        try:
            rows += measure(family, index, make(), args, best_peak)
        except Exception:  # a shape onnxruntime cannot run, say: show it, go on
            traceback.print_exc()
    info["load_average_end"] = os.getloadavg()
    summary = geomeans(rows)
    print("\n".join(summary))
    table = [COLUMNS, RULE, *map(_line, rows)]
    (args.out / "results.md").write_text(
        "# cuvil vs onnxruntime and OpenVINO, op by op\n\n" + report.header(info).replace("\n", "  \n")
        + "\n\n" + "\n".join(table) + "\n\n" + "".join(f"- {line}\n" for line in summary))
    (args.out / "results.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1, default=str))
    print(f"wrote {args.out / 'results.md'}, {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
