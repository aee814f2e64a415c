"""int8 against float32, cuvil against onnxruntime, on QDQ models onnxruntime's quantizer makes.

For each model (a float ONNX file and a maker of its random inputs) this builds QDQ models as a
user does with onnxruntime.quantization: `quant_pre_process`, then `quantize_static` (QDQ
format, int8 activations, symmetric per-channel int8 weights, a few random calibration
batches). Models with BatchNormalization get two: "folded" (the pre-processing's graph
optimizations fold it into the convolutions) and "bn" (`skip_optimization=True`: it stays a
quantized op between Q/DQ pairs, as many shipped QDQ models have it). Then, in this process,
on the same inputs, batch 1, at each thread count: cuvil float32, cuvil int8, onnxruntime
float32 and onnxruntime int8, interleaved in blocks with the settling of benchmarks/suite.py.

    python benchmarks/quantized.py                          # light_resnet50, threads 1 and 2
    python benchmarks/quantized.py --models path/to/model.onnx --threads 1 --quick
    python benchmarks/quantized.py --cpu x86-64-v3          # cuvil's AVX2 copy (no VNNI)

Printed per model, variant and thread count: the median ms of each engine, int8's speed-up
over float32 for each engine, cuvil int8 / onnxruntime int8 (< 1: cuvil is faster), and how
cuvil's int8 outputs agree with onnxruntime's on `--agree` random inputs (top-1 agreement of
the first output, its largest difference, in steps of its quantization scale when it is a
DequantizeLinear's output). Figures depend on the machine's load: compare ratios.

A model is a `Source`; `MODELS` lists the makers by name (add one there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
import onnx.version_converter
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite
import zoo

Feeds = dict[str, np.ndarray]


@dataclass
class Source:
    """A float model and its inputs: `feeds(seed)` gives one batch-1 feed dict."""

    name: str
    path: Path
    feeds: Callable[[int], Feeds]


def random_feeds(path: Path) -> Callable[[int], Feeds]:
    """Standard-normal floats (random token ids for integer inputs) at the model's shapes,
    batch 1, other free dims refused (zoo.Bench.pins)."""
    bench = zoo.Bench(path.stem, path, "file")
    model = onnx.load(str(path), load_external_data=False)
    return lambda seed: bench.feeds(model, 1, seed)


# -- model makers ------------------------------------------------------------------------------


def light_resnet50(cache: Path) -> Source:
    """The onnx package's light ResNet-50 with seeded random weights in place of its constant
    ones (every weight 0.02: all logits equal, top-1 means nothing) and its 2-input Sum as Add
    (what current exporters write for the residual; onnxruntime's quantizer leaves Sum in
    float), at opset 13 (per-channel quantization needs it). He-scaled conv weights;
    BatchNormalization near identity, the last of each residual branch scaled down so that
    activations do not grow block after block."""
    path = cache / "light_resnet50_random.onnx"
    if not path.exists():
        model = onnx.load(str(zoo.LIGHT / "light_resnet50.onnx"))
        rng = np.random.default_rng(0)
        made = {n.output[0]: n for n in model.graph.node if n.op_type == "ConstantOfShape"}
        shapes = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        users = {name: [n for n in model.graph.node if name in n.input] for name in made}
        values = {}
        for name, node in made.items():
            shape = tuple(int(d) for d in shapes[node.input[0]])
            reader = users[name][0]
            slot = list(reader.input).index(name)
            if reader.op_type in ("Conv", "Gemm") and slot == 1:
                fan_in = int(np.prod(shape[1:]))
                v = rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)
            elif reader.op_type == "BatchNormalization":
                last = "branch2c" in reader.output[0] or "branch2c" in name
                v = {1: rng.uniform(0.5, 1.5, shape) * (0.2 if last else 1.0),
                     2: rng.normal(0, 0.1, shape), 3: rng.normal(0, 0.1, shape),
                     4: rng.uniform(0.5, 1.5, shape)}[slot]
            else:
                v = rng.normal(0, 0.1, shape)
            values[name] = numpy_helper.from_array(v.astype(np.float32), name)
        nodes = []
        for node in model.graph.node:
            if node.op_type == "ConstantOfShape":
                continue
            if node.op_type == "Sum" and len(node.input) == 2:
                node = onnx.helper.make_node("Add", list(node.input), list(node.output),
                                             name=node.name)
            nodes.append(node)
        kept = {i for n in nodes for i in n.input}
        model.graph.ClearField("node")
        model.graph.node.extend(nodes)
        inits = [t for t in model.graph.initializer if t.name in kept]
        model.graph.ClearField("initializer")
        model.graph.initializer.extend([*inits, *values.values()])
        # weights listed as graph inputs too (an old exporter's habit) would be overridable
        # inputs to onnxruntime: not folded, not quantized as constants; the ConstantOfShape
        # shapes are read by nothing now
        weights = {t.name for t in model.graph.initializer}
        data = [vi for vi in model.graph.input if vi.name not in weights and vi.name in kept]
        model.graph.ClearField("input")
        model.graph.input.extend(data)
        model.ir_version = max(model.ir_version, 7)  # weights need not be graph inputs
        # opset 13: per-axis QuantizeLinear/DequantizeLinear (per-channel weights)
        model = onnx.version_converter.convert_version(model, 13)
        onnx.checker.check_model(model)
        cache.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path))
    return Source("light_resnet50", path, random_feeds(path))


#: name -> maker(cache folder) of a Source
MODELS: dict[str, Callable[[Path], Source]] = {"light_resnet50": light_resnet50}


def source(name: str, cache: Path) -> Source:
    if name in MODELS:
        return MODELS[name](cache)
    path = Path(name)
    if path.suffix != ".onnx" or not path.exists():
        raise SystemExit(f"{name}: neither a model of {', '.join(MODELS)} nor an .onnx file")
    return Source(path.stem, path, random_feeds(path))


# -- quantizing --------------------------------------------------------------------------------


def quantize(src: Source, variant: str, out: Path, batches: int) -> Path:
    """The QDQ model of `src` ("folded": pre-processed with onnxruntime's optimizations;
    "bn": without them, BatchNormalization kept), calibrated on `batches` random feeds."""
    from onnxruntime import quantization as q
    from onnxruntime.quantization.shape_inference import quant_pre_process

    path = out / f"{src.name}.{variant}.{batches}.qdq.onnx"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)

    class Reader(q.CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter([src.feeds(1000 + i) for i in range(batches)])

        def get_next(self) -> Feeds | None:
            return next(self.feeds, None)

    with tempfile.TemporaryDirectory(prefix="quantized-bench-") as tmp:
        prepared = Path(tmp) / "pre.onnx"
        quant_pre_process(str(src.path), str(prepared), skip_optimization=variant == "bn")
        q.quantize_static(str(prepared), str(path), Reader(), quant_format=q.QuantFormat.QDQ,
                          per_channel=True, activation_type=q.QuantType.QInt8,
                          weight_type=q.QuantType.QInt8,
                          extra_options={"WeightSymmetric": True})
    return path


def variants(src: Source) -> list[str]:
    model = onnx.load(str(src.path), load_external_data=False)
    has_bn = any(n.op_type == "BatchNormalization" for n in model.graph.node)
    return ["folded", "bn"] if has_bn else ["folded"]


# -- agreement ---------------------------------------------------------------------------------


def output_step(path: Path) -> float | None:
    """The scale of the DequantizeLinear writing the model's first output, if one does."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    first = model.graph.output[0].name
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and first in node.output \
                and node.input[1] in inits and inits[node.input[1]].size == 1:
            return float(inits[node.input[1]].reshape(-1)[0])
    return None


def agreement(ours: Any, session: Any, src: Source, count: int,
              step: float | None) -> dict[str, float]:
    same, worst = 0, 0.0
    name = session.get_outputs()[0].name
    for i in range(count):
        feeds = src.feeds(2000 + i)
        got = np.asarray(ours.run(feeds)[name], np.float64)
        ref = np.asarray(session.run([name], feeds)[0], np.float64)
        top = lambda v: v.reshape(v.shape[0], -1).argmax(axis=1)  # noqa: E731
        same += int(np.array_equal(top(got), top(ref)))
        worst = max(worst, float(np.max(np.abs(got - ref))))
    result = {"top1": same / count, "max_diff": worst}
    if step:
        result["steps"] = worst / step
    return result


# -- the run -----------------------------------------------------------------------------------


ENGINES = ("cuvil_fp32", "cuvil_int8", "ort_fp32", "ort_int8")


def measure(src: Source, variant: str, qdq: Path, threads: list[int], args: argparse.Namespace,
            float_model: Any) -> list[dict[str, Any]]:
    from cuvil.compiler.driver import compile_in_process

    start = time.perf_counter()
    int8_model = compile_in_process(str(qdq), name=f"{src.name}_{variant}_int8", cpu=args.cpu)
    print(f"{src.name} {variant}: cuvil int8 compiled in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    feeds = src.feeds(0)
    step = output_step(qdq)
    rows = []
    for count in threads:
        sessions = {"ort_fp32": suite.ort_session(src.path, count),
                    "ort_int8": suite.ort_session(qdq, count)}
        float_model.num_threads = count
        int8_model.num_threads = count
        calls = {"cuvil_fp32": lambda: float_model.run(feeds),
                 "cuvil_int8": lambda: int8_model.run(feeds),
                 "ort_fp32": lambda s=sessions["ort_fp32"]: s.run(None, feeds),
                 "ort_int8": lambda s=sessions["ort_int8"]: s.run(None, feeds)}
        times = suite.interleaved(calls, args.budget, args.min_runs)
        ms = {e: suite.summary_ms(times[e])["median_ms"] for e in ENGINES}
        row = {"model": src.name, "variant": variant, "threads": count, **ms,
               "cuvil_speedup": ms["cuvil_fp32"] / ms["cuvil_int8"],
               "ort_speedup": ms["ort_fp32"] / ms["ort_int8"],
               "int8_ratio": ms["cuvil_int8"] / ms["ort_int8"],
               **agreement(int8_model, sessions["ort_int8"], src, args.agree, step)}
        rows.append(row)
        print(line(row), flush=True)
    return rows


HEADER = ("| model | variant | threads | cuvil fp32 ms | cuvil int8 ms | ort fp32 ms | ort int8 ms "
          "| cuvil int8 speed-up | ort int8 speed-up | cuvil/ort int8 | top-1 agree | max diff |")


def line(row: dict[str, Any]) -> str:
    steps = f" ({row['steps']:.2f} steps)" if "steps" in row else ""
    return (f"| {row['model']} | {row['variant']} | {row['threads']} | {row['cuvil_fp32']:.1f} "
            f"| {row['cuvil_int8']:.1f} | {row['ort_fp32']:.1f} | {row['ort_int8']:.1f} "
            f"| {row['cuvil_speedup']:.2f}x | {row['ort_speedup']:.2f}x | {row['int8_ratio']:.2f} "
            f"| {row['top1']:.0%} | {row['max_diff']:.3g}{steps} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated names ({', '.join(MODELS)}) or .onnx paths")
    parser.add_argument("--variants", default="",
                        help="folded,bn (default: both for models with BatchNormalization)")
    parser.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    parser.add_argument("--calibration", type=int, default=4,
                        help="random calibration batches (default 4)")
    parser.add_argument("--agree", type=int, default=8,
                        help="random inputs the agreement is measured on (default 8)")
    parser.add_argument("--quick", action="store_true", help="short time budgets: a smoke run")
    parser.add_argument("--cpu", default="native",
                        help="the CPU cuvil compiles for (default: this one; x86-64-v3: the AVX2 "
                             "copy, whose int8 kernels use no VNNI)")
    parser.add_argument("--out", type=Path, default=zoo.ROOT / "build" / "bench" / "quantized",
                        help="generated models (default build/bench/quantized/)")
    args = parser.parse_args(argv)
    args.budget, args.min_runs = (0.25, 3) if args.quick else (1.5, 10)
    threads = [int(t) for t in args.threads.split(",")]
    from cuvil.compiler.driver import compile_in_process

    print(f"cuvil compiled for cpu {args.cpu}")
    print(HEADER)
    print("|" + " --- |" * (HEADER.count("|") - 1), flush=True)
    for name in (n.strip() for n in args.models.split(",") if n.strip()):
        src = source(name, args.out)
        float_model = compile_in_process(str(src.path), name=f"{src.name}_fp32", cpu=args.cpu)
        for variant in [v for v in args.variants.split(",") if v] or variants(src):
            qdq = quantize(src, variant, args.out, args.calibration)
            measure(src, variant, qdq, threads, args, float_model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
