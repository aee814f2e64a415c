"""cuvil against onnxruntime, measured in one run on this machine.

For each model: compile time, latency per batch size (median of repeated calls, both
multithreaded with their defaults), the ratio cuvil / onnxruntime (< 1: cuvil is faster),
start-up (a fresh process from launch to its first prediction, for a generated package vs. an
onnxruntime session) and the peak resident memory of those processes.

    python benchmarks/compare.py                      # the bundled digits model + light models
    python benchmarks/compare.py path/to/model.onnx --batch 1 8

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
DEFAULT_MODELS = [ROOT / "examples" / "digits" / "models" / "classifier.onnx",
                  LIGHT / "light_squeezenet.onnx", LIGHT / "light_resnet50.onnx"]


def median_ms(fn, repeat: int, min_seconds: float = 1.0) -> float:
    fn()  # warm up (first-touch of memory, thread pools)
    times = []
    deadline = time.perf_counter() + min_seconds
    while len(times) < repeat or time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if len(times) >= 10 * repeat:
            break
    return float(np.median(times) * 1000)


def input_feeds(model: onnx.ModelProto, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in tt.shape.dim]
        if shape and tt.shape.dim[0].HasField("dim_value") and batch != shape[0]:
            shape[0] = batch
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def static_batch(model: onnx.ModelProto) -> int | None:
    inits = {i.name for i in model.graph.initializer}  # old exporters list weights as inputs
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            return dims[0].dim_value
    return None


def measure_process(code: str, cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """Wall time (ms) of a fresh interpreter running `code`, and its peak RSS (MB)."""
    script = (
        "import resource, sys, time\n" + code +
        "\nprint('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    times, rss = [], 0.0
    for _ in range(5):
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, check=True,
                             capture_output=True, text=True).stdout
        times.append(time.perf_counter() - t)
        rss = max(rss, int(out.split("RSS")[-1]) / 1024)
    return float(np.median(times) * 1000), rss


def bench_model(path: Path, batches: list[int], workdir: Path) -> dict:
    import onnxruntime as ort

    from cuvil.build_backend._package import render_init
    from cuvil.compiler.driver import compile_model
    from cuvil.runtime import _loader

    path = path.resolve()
    model = onnx.load(str(path))
    name = "model"
    t = time.perf_counter()
    compiled = compile_model(str(path), name, workdir / "build", target=None)
    compile_s = time.perf_counter() - t
    fixed = static_batch(model)
    sizes = [fixed] if fixed else batches

    # a generated package, as a user installs it, for the start-up measurement
    pkg = workdir / "pkg" / "bench_pkg"
    pkg.mkdir(parents=True)
    (pkg / compiled.library.name).write_bytes(compiled.library.read_bytes())
    manifest = {"abi_version": _loader.ABI_VERSION, "models": [compiled.signature]}
    (pkg / "_models.json").write_text(json.dumps(manifest))
    (pkg / "_cuvil_runtime.py").write_text(Path(_loader.__file__).read_text())
    (pkg / "__init__.py").write_text(render_init("bench_pkg", [compiled.signature], "host"))
    cuvil_model = _loader.Model(compiled.library, compiled.signature)

    opts = ort.SessionOptions()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    rows = []
    for batch in sizes:
        feeds = input_feeds(model, batch)
        expected = sess.run(None, feeds)
        got = cuvil_model.run(feeds)
        err = max(float(np.max(np.abs(got[o.name] - e))) if e.size else 0.0
                  for o, e in zip(cuvil_model.outputs, expected))
        repeat = 20 if np.prod(next(iter(feeds.values())).shape) < 1e5 else 5
        c_ms = median_ms(lambda f=feeds: cuvil_model.run(f), repeat)
        o_ms = median_ms(lambda f=feeds: sess.run(None, f), repeat)
        rows.append({"batch": batch, "cuvil_ms": c_ms, "ort_ms": o_ms, "ratio": c_ms / o_ms,
                     "max_abs_diff": err})

    feeds = input_feeds(model, sizes[0])
    np.savez(workdir / "feeds.npz", **feeds)
    env = {**os.environ, "PYTHONPATH": str(workdir / "pkg")}
    cuvil_start = measure_process(
        "import numpy as np\nf = dict(np.load('feeds.npz'))\nimport bench_pkg\n"
        "bench_pkg.model.run(f)\n", workdir, env)
    ort_start = measure_process(
        "import numpy as np\nf = dict(np.load('feeds.npz'))\nimport onnxruntime as ort\n"
        f"s = ort.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'])\n"
        "s.run(None, f)\n", workdir, env)
    return {"model": path.name, "compile_s": compile_s, "runs": rows,
            "library_kb": compiled.library.stat().st_size / 1024,
            "startup_ms": {"cuvil": cuvil_start[0], "ort": ort_start[0]},
            "peak_rss_mb": {"cuvil": cuvil_start[1], "ort": ort_start[1]}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path, default=DEFAULT_MODELS)
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    for path in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            r = bench_model(path, args.batch, Path(tmp))
        results.append(r)
        print(f"\n{r['model']}: compiled in {r['compile_s']:.1f} s, library {r['library_kb']:.0f} KB")
        for row in r["runs"]:
            print(f"  batch {row['batch']:>4}: cuvil {row['cuvil_ms']:8.3f} ms  onnxruntime "
                  f"{row['ort_ms']:8.3f} ms  ratio {row['ratio']:5.2f}  "
                  f"(max |diff| {row['max_abs_diff']:.2e})")
        s, m = r["startup_ms"], r["peak_rss_mb"]
        print(f"  fresh process to first prediction: cuvil {s['cuvil']:.0f} ms, onnxruntime "
              f"{s['ort']:.0f} ms; peak RSS cuvil {m['cuvil']:.0f} MB, onnxruntime {m['ort']:.0f} MB")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
