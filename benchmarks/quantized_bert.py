"""int8 BERT against float32: cuvil and onnxruntime on the same quantized models, in one run.

The suite's BERT (benchmarks/zoo.py, default `bert`) is quantized two ways with
onnxruntime's tools: `quantize_dynamic` (MatMulInteger + DynamicQuantizeLinear, int8
weights: the form shipped transformer models use) and `quantize_static` in QDQ format
(per-channel int8 weights, int8 activations, min-max ranges from random token ids). Each
model is built into a wheel by `cuvil build` and run in this process beside an onnxruntime
session of the same file, on the same inputs, every engine and model interleaved in blocks
with the suite's settling between them (suite.interleaved). The table gives the median, the
IQR, each engine's speed-up of int8 over its own float32, and how far each output is from
onnxruntime's on the same model and from the float32 model's.

    python benchmarks/quantized_bert.py                            # bert, 1 thread, batch 1
    python benchmarks/quantized_bert.py --threads 1,2 --quick
    python benchmarks/quantized_bert.py --models bert_optimized --variants float32,dynamic
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite
import zoo

VARIANTS = ("float32", "dynamic", "qdq")


def quantize_dynamic(source: Path, out: Path) -> Path:
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic

    if not out.exists():
        partial = out.with_suffix(".partial.onnx")
        ort_quantize_dynamic(str(source), str(partial), weight_type=QuantType.QInt8)
        partial.replace(out)
    return out


def rel_diff(got: np.ndarray, ref: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert", help="zoo names, comma-separated (default bert)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--threads", default="1", help="thread counts, comma-separated (default 1)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calibration", type=int, default=8, help="QDQ calibration feeds")
    parser.add_argument("--quick", action="store_true", help="short time budgets: a smoke run")
    parser.add_argument("--out", type=Path, default=zoo.ROOT / "build" / "bench" / "quantized_bert")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}: pick from {', '.join(VARIANTS)}")
    threads = [int(t) for t in args.threads.split(",")]
    budget, min_runs = (0.25, 3) if args.quick else (1.5, 10)
    out = args.out.resolve()
    cache = out.parent / "models"  # the suite's cache of exported models
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for name in args.models.split(","):
        zoo_bench = zoo.get(name, cache)
        bench = zoo.Bench(zoo_bench.name, zoo.unshare_weights(zoo_bench.path, out / f"{name}.onnx"),
                          zoo_bench.source, zoo_bench.sizes)
        model = onnx.load(str(bench.path))
        paths = {"float32": bench.path}
        if "dynamic" in variants:
            paths["dynamic"] = quantize_dynamic(bench.path, out / f"{bench.name}_dynamic.onnx")
        if "qdq" in variants:
            paths["qdq"] = zoo.quantize_qdq(bench, model, out / f"{bench.name}_qdq.onnx",
                                            args.calibration)
        feeds = bench.feeds(model, args.batch)
        engines: dict[str, tuple[Any, Any]] = {}
        built_info: dict[str, Any] = {}
        for variant in variants:
            vb = zoo.Bench(f"{bench.name}_{variant}", paths[variant], bench.source, bench.sizes)
            start = time.perf_counter()
            built = suite.build_wheel(vb, vb.pins(onnx.load(str(vb.path))), out / "work" / vb.name)
            built_info[variant] = {"build_s": time.perf_counter() - start,
                                   "library_kb": built["library_kb"]}
            print(f"{vb.name}: built in {built_info[variant]['build_s']:.1f} s, library "
                  f"{built['library_kb']:.0f} KB", flush=True)
            engines[variant] = (suite.cuvil_model(built), paths[variant])
        for count in threads:
            calls: dict[str, Callable[[], Any]] = {}
            outputs: dict[str, np.ndarray] = {}
            for variant, (ours, path) in engines.items():
                session = suite.ort_session(path, count)
                ours.num_threads = count
                out_name = session.get_outputs()[0].name
                outputs[f"ort {variant}"] = session.run(None, feeds)[0]
                outputs[f"cuvil {variant}"] = ours.run(feeds)[out_name]
                calls[f"cuvil {variant}"] = lambda m=ours, f=feeds: m.run(f)
                calls[f"ort {variant}"] = lambda s=session, f=feeds: s.run(None, f)
            times = suite.interleaved(calls, budget, min_runs)
            rows = {key: suite.summary_ms(samples) for key, samples in times.items()}
            reference = outputs["ort float32"]
            for key, row in rows.items():
                engine, variant = key.split()
                row["speedup_vs_float32"] = rows[f"{engine} float32"]["median_ms"] / row["median_ms"]
                row["diff_vs_ort_same_model"] = rel_diff(outputs[key], outputs[f"ort {variant}"])
                row["diff_vs_float32"] = rel_diff(outputs[key], reference)
            result = {"model": bench.name, "threads": count, "batch": args.batch,
                      "builds": built_info, "rows": rows}
            results.append(result)
            print(table(result), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text("\n\n".join(table(r) for r in results) + "\n")
    print(f"wrote {out / 'results.md'}, {out / 'results.json'}")
    return 0


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['threads']} thread(s), batch {result['batch']}:", "",
             ("| engine | model | median ms | IQR ms | x float32 | rel diff vs ort (same model) "
              "| rel diff vs float32 |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, row in result["rows"].items():
        engine, variant = key.split()
        lines.append(f"| {engine} | {variant} | {row['median_ms']:.2f} | {row['iqr_ms']:.2f} | "
                     f"{row['speedup_vs_float32']:.2f} | {row['diff_vs_ort_same_model']:.1e} | "
                     f"{row['diff_vs_float32']:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
