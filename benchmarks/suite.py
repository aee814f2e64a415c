"""cuvil against onnxruntime and OpenVINO on a set of models, measured on this machine in one run.

For each model the suite builds a wheel with `cuvil build` (the path a user takes), then,
in this process, runs cuvil's library, an onnxruntime session and OpenVINO's CPU plugin on
the same inputs, interleaved, at batch 1 and a larger batch and at each thread count; and,
in fresh processes, times launch -> first result and reads the peak RSS of cuvil and
onnxruntime. It writes results.md, results.json and ratios.png (matplotlib, from the `bench`
extra) to --out.

    python benchmarks/suite.py                          # every model, threads 1 and 2
    python benchmarks/suite.py --quick                  # a smoke run: short time budgets
    python benchmarks/suite.py --models light_resnet50,bert --threads 1 --out /tmp/bench
    python benchmarks/suite.py --models path/to/model.onnx --sizes seq=128
    python benchmarks/suite.py --models unet --engines cuvil,onnxruntime   # no OpenVINO

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops
import peak
import report
import zoo

ROOT = zoo.ROOT
LARGE_BATCH = 8


# --- timing -----------------------------------------------------------------------------------


def settle(limit_s: float = 0.5) -> None:
    """Wait until this process's threads are idle: onnxruntime's workers spin for about 50 ms
    after a run (measured here: a 100 ms sleep after a 2-thread run burns 50 ms of CPU), and
    a spinning worker of one engine takes a core from the other's next calls."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        cpu = time.process_time()
        time.sleep(0.01)
        if time.process_time() - cpu < 0.002:
            return


def interleaved(calls: dict[str, Callable[[], Any]], budget_s: float,
                min_runs: int) -> dict[str, list[float]]:
    """Seconds per call of each callable, taken in alternating blocks until the budget is spent.

    Blocks of about 100 ms (one call for slow models) alternate between the engines, so a
    load spike from the machine's other users hits both; between blocks the process settles
    until the last engine's worker threads stop spinning, so that they do not compete with
    the next engine's calls.
    """
    block = {}
    for name, call in calls.items():  # warm-up: first touch of memory, thread pools start
        call()
        start = time.perf_counter()
        call()
        block[name] = max(1, int(0.1 / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    spent = 0.0
    while spent < budget_s * len(calls) or min(len(t) for t in times.values()) < min_runs:
        for name, call in calls.items():
            settle()
            for _ in range(block[name]):
                start = time.perf_counter()
                call()
                took = time.perf_counter() - start
                times[name].append(took)
                spent += took
    return times


def summary_ms(times: list[float]) -> dict[str, float]:
    q1, median, q3 = np.percentile(np.asarray(times) * 1e3, [25, 50, 75])
    return {"median_ms": float(median), "iqr_ms": float(q3 - q1), "runs": len(times)}


# --- cuvil: a wheel built as a user builds it --------------------------------------------------


def build_wheel(bench: zoo.Bench, pins: dict[str, list[int | str]], work: Path) -> dict[str, Any]:
    """`cuvil build` on a generated model project; the wheel unpacked into work/site."""
    project = work / "project"
    shutil.rmtree(work, ignore_errors=True)
    project.mkdir(parents=True)
    # the source must lie inside the project (its sdist carries it)
    shutil.copyfile(bench.path, project / "model.onnx")
    inputs = ", ".join(f"{json.dumps(name)} = {json.dumps(dims)}" for name, dims in pins.items())
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "bench-model"\nversion = "0"\n\n[tool.cuvil]\npackage = "bench_model"\n\n'
        f"[tool.cuvil.models.model]\nsource = \"model.onnx\"\ninputs = {{ {inputs} }}\n")
    # a cold build (no compile cache): *build s* is what compiling the model costs
    env = {**os.environ, "CUVIL_CACHE": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cuvil", "build", str(project), "-o", str(work / "dist")],
                          env=env, capture_output=True, text=True)
    build_s = time.perf_counter() - start
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise BuildError(" ".join(lines[-3:]) if lines else f"cuvil build exited {done.returncode}")
    wheel = next((work / "dist").glob("*.whl"))
    site = work / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    # byte-compiled as pip installs a wheel (onnxruntime's modules have theirs): else every
    # fresh process compiles the package's sources again (PYTHONDONTWRITEBYTECODE keeps no .pyc)
    compileall.compile_dir(str(site), quiet=1)
    manifest = json.loads((site / "bench_model" / "_models.json").read_text())
    signature = manifest["models"][0]
    library = site / "bench_model" / signature["library"]
    return {"build_s": build_s, "wheel_kb": wheel.stat().st_size / 1024,
            "library_kb": library.stat().st_size / 1024, "site": site, "library": library,
            "signature": signature}


class BuildError(Exception):
    pass


def cuvil_model(built: dict[str, Any]) -> Any:
    """The wheel's library, loaded as the generated package loads it. Every cuvil library in
    a process shares one thread pool (sized once, from CUVIL_NUM_THREADS or the CPUs), so the
    thread count of a run is the model's per-call limit, `num_threads`."""
    from cuvil.runtime._loader import Model

    return Model(built["library"], built["signature"])


def ort_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OpenVino:
    """OpenVINO's CPU plugin on one model with its inputs reshaped to static `shapes` (as the
    suite pins them: batch included), in latency mode (one stream), float32 inference (no
    bf16 on CPUs that have it), `threads` inference threads; other properties at their
    defaults. `run` returns the outputs by the model's output names."""

    def __init__(self, path: Path, shapes: dict[str, list[int]], threads: int) -> None:
        import openvino

        core = openvino.Core()
        model = core.read_model(str(path))
        model.reshape({name: openvino.PartialShape(dims) for name, dims in shapes.items()})
        self.compiled = core.compile_model(model, "CPU", {
            "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "f32"})
        self.request = self.compiled.create_infer_request()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = self.request.infer(feeds)
        return {name: result[port] for port in self.compiled.outputs for name in port.get_names()}


ENGINES = ("cuvil", "onnxruntime", "openvino")


def best_yardstick(row: dict[str, Any]) -> str:
    """The faster of onnxruntime and OpenVINO in a row (onnxruntime when OpenVINO did not run)."""
    if "openvino" in row and row["openvino"]["median_ms"] < row["ort"]["median_ms"]:
        return "openvino"
    return "ort"


# --- fresh processes ---------------------------------------------------------------------------

_CHILD = """
import json, resource, sys, time
import numpy as np
feeds = dict(np.load(sys.argv[1]))
time.sleep({settle_s})
t0 = time.time()
{body}
t2 = time.time()
run()
t3 = time.time()
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")]
print(json.dumps({{"first_result": t3, "import_load_s": t2 - t0, "first_run_s": t3 - t2,
                  "cuvil_imported": "cuvil" in sys.modules,
                  "peak_rss_kb": hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""
_CUVIL_CHILD = "import bench_model\nrun = lambda: bench_model.model.run(feeds)"
_ORT_CHILD = ("import onnxruntime as ort\n"
              "session = ort.InferenceSession(sys.argv[2], providers=['CPUExecutionProvider'])\n"
              "run = lambda: session.run(None, feeds)")


#: seconds a fresh process waits after reading its inputs for the "numpy idle" start-up figure:
#: numpy's OpenBLAS threads spin for about 0.1 s after `import numpy` (2**28 cycles) before
#: they sleep, and on a 2-CPU machine one of them keeps a CPU the engine's threads then lack
BLAS_SETTLE_S = 0.5


def fresh_process(body: str, args: list[str], env: dict[str, str], repeats: int,
                  settle_s: float = 0.0) -> dict[str, Any]:
    """Launch -> first result (median of `repeats` launches) and peak RSS of a new interpreter
    that waits `settle_s` after reading its inputs (not counted in the engine's part).

    The peak is VmHWM, the high-water mark of the child's own address space: Linux carries
    ru_maxrss over exec, so a child spawned from this (large) process would report ours.
    """
    firsts, runs = [], []
    for _ in range(repeats):
        launched = time.time()
        child = _CHILD.format(body=body, settle_s=settle_s)
        out = subprocess.run([sys.executable, "-c", child, *args], env=env,
                             capture_output=True, text=True, check=True).stdout
        run = json.loads(out.strip().splitlines()[-1])
        firsts.append(run["first_result"] - launched - settle_s)
        runs.append(run)
    return {"first_result_ms": float(np.median(firsts) * 1e3),
            "import_load_ms": float(np.median([r["import_load_s"] for r in runs]) * 1e3),
            "first_run_ms": float(np.median([r["first_run_s"] for r in runs]) * 1e3),
            "peak_rss_mb": max(r["peak_rss_kb"] for r in runs) / 1024,
            "cuvil_imported": any(r["cuvil_imported"] for r in runs)}


# --- one model ---------------------------------------------------------------------------------


def max_rel_diff(got: dict[str, np.ndarray], expected: list[np.ndarray], names: list[str]) -> float:
    worst = 0.0
    for name, ref in zip(names, expected):
        if ref.size:
            diff = np.max(np.abs(got[name].astype(np.float64) - ref))
            worst = max(worst, float(diff / max(float(np.max(np.abs(ref))), 1e-30)))
    return worst


def bench_model(name: str, args: argparse.Namespace, peaks: dict[str, float]) -> dict[str, Any]:
    cache = args.out / "models"
    bench = zoo.get(name, cache, args.sizes)
    model = onnx.load(str(bench.path))
    pins = bench.pins(model)
    batches = [1, LARGE_BATCH] if any("batch" in dims for dims in pins.values()) else [1]
    result: dict[str, Any] = {"model": bench.name, "source": bench.source, "inputs": pins, "runs": []}
    work = args.out / "work" / bench.name
    built = None
    try:
        if "cuvil" in args.engines:
            built = build_wheel(bench, pins, work)
            result.update({k: built[k] for k in ("build_s", "wheel_kb", "library_kb")})
    except BuildError as exc:
        result["error"] = f"cuvil build failed: {exc}"
    best_peak = max(peaks.values(), default=0.0)
    ours = cuvil_model(built) if built else None
    for threads in args.threads:
        session = ort_session(bench.path, threads)
        if ours is not None:
            ours.num_threads = threads
        for batch in batches:
            feeds = bench.feeds(model, batch)
            gflop, complete = flops.count_flops(model, feeds)
            calls: dict[str, Callable[[], Any]] = {"ort": lambda f=feeds, s=session: s.run(None, f)}
            row: dict[str, Any] = {"threads": threads, "batch": batch, "gflop": gflop / 1e9,
                                   "gflop_complete": complete}
            expected = session.run(None, feeds)
            names = [o.name for o in session.get_outputs()]
            if ours is not None:
                try:
                    row["max_rel_diff"] = max_rel_diff(ours.run(feeds), expected, names)
                    calls["cuvil"] = lambda f=feeds, m=ours: m.run(f)
                except Exception as exc:  # a model that builds but cannot run: say so, go on
                    result.setdefault("error", f"cuvil run failed (batch {batch}): {exc}")
            if "openvino" in args.engines:
                try:
                    shapes = {name: list(array.shape) for name, array in feeds.items()}
                    theirs = OpenVino(bench.path, shapes, threads)
                    row["openvino_max_rel_diff"] = max_rel_diff(theirs.run(feeds), expected, names)
                    calls["openvino"] = lambda f=feeds, o=theirs: o.run(f)
                except Exception as exc:  # missing, or failing on this model: say so, go on
                    message = " ".join(str(exc).split())
                    result.setdefault("openvino_error", f"{type(exc).__name__}: {message[:300]}")
            times = interleaved(calls, args.budget, args.min_runs)
            for engine, samples in times.items():
                stats = summary_ms(samples)
                stats["gflops"] = gflop / 1e9 / (stats["median_ms"] / 1e3)
                stats["peak_fraction"] = stats["gflops"] / (best_peak * threads) if best_peak else None
                row[engine] = stats
            row["best"] = best_yardstick(row)
            if "cuvil" in row:
                row["ratio"] = row["cuvil"]["median_ms"] / row["ort"]["median_ms"]
                row["ratio_best"] = row["cuvil"]["median_ms"] / row[row["best"]]["median_ms"]
                if "openvino" in row:
                    row["ratio_openvino"] = row["cuvil"]["median_ms"] / row["openvino"]["median_ms"]
            result["runs"].append(row)
            print(report.run_line(bench.name, row), flush=True)
        session = None  # free it before the next thread count loads its own
    ours = None

    feeds_file = work / "feeds.npz"
    feeds_file.parent.mkdir(parents=True, exist_ok=True)
    np.savez(feeds_file, **bench.feeds(model, 1))
    base_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUVIL_NUM_THREADS")}
    children = {"ort": (_ORT_CHILD, [str(feeds_file), str(bench.path)], base_env)}
    if any("cuvil" in row for row in result["runs"] if row["batch"] == 1):
        # only the unpacked wheel on the path: the package must not need cuvil itself
        children["cuvil"] = (_CUVIL_CHILD, [str(feeds_file)],
                             {**base_env, "PYTHONPATH": str(built["site"])})
    # "fresh": the first call right after `import numpy`, as a script makes it; "fresh_idle":
    # the same once numpy's BLAS threads have stopped spinning (BLAS_SETTLE_S)
    for key, settle_s in (("fresh", 0.0), ("fresh_idle", BLAS_SETTLE_S)):
        result[key] = {engine: fresh_process(body, child_args, env, args.launches, settle_s)
                       for engine, (body, child_args, env) in children.items()}
    return result


# --- the run -----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import onnxruntime

    import cuvil
    try:
        import openvino
        openvino_version: str | None = openvino.__version__.split("-")[0]
    except ImportError:
        openvino_version = None
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "openvino": openvino_version,
            "cuvil": cuvil.__version__, "torch": zoo._has_torch(), "load_average_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(zoo.MODELS),
                        help="comma-separated suite names or .onnx paths (default: all)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--sizes", default="",
                        help="for .onnx paths: free non-batch dims by name, e.g. seq=128,height=224")
    parser.add_argument("--quick", action="store_true", help="short time budgets: a smoke run")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench",
                        help="results, generated models and builds (default build/bench/)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="engines to run, comma-separated (default all: cuvil,onnxruntime,openvino); "
                             "onnxruntime always runs, as the reference of the correctness check")
    parser.add_argument("--launches", type=int, default=None,
                        help="fresh processes per first-result figure, the median is kept "
                             "(default 5, --quick 1)")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.sizes = {k: int(v) for k, v in (p.split("=") for p in args.sizes.split(",") if p)}
    launches = args.launches
    args.budget, args.min_runs, args.launches = (0.25, 3, 1) if args.quick else (1.5, 10, 5)
    if launches is not None:
        if launches < 1:
            parser.error("--launches must be at least 1")
        args.launches = launches
    args.engines = {e.strip() for e in args.engines.split(",") if e.strip()} | {"onnxruntime"}
    if args.engines - set(ENGINES):
        parser.error(f"unknown engines {sorted(args.engines - set(ENGINES))}: pick from {', '.join(ENGINES)}")
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    for name in args.models:
        if not zoo.exists(name):
            parser.error(zoo.unknown(name))
    args.out.mkdir(parents=True, exist_ok=True)

    info = machine()
    peaks = peak.measure_peak(0.5 if args.quick else 1.5)
    info["peak_gflops_one_core"] = peaks
    info["fma_scaling_start"] = peak.fma_scaling(2)
    print(report.header(info), flush=True)
    results = []
    for name in args.models:
        start = time.perf_counter()
        try:
            result = bench_model(name, args, peaks)
        except zoo.Unavailable as exc:  # a model this machine cannot make: say why
            result = {"model": name, "skipped": str(exc), "runs": []}
        except Exception as exc:  # record and go on to the next model
            traceback.print_exc()
            result = {"model": name, "error": f"{type(exc).__name__}: {exc}", "runs": []}
        result["suite_s"] = time.perf_counter() - start
        # after the model's rows: a figure near 1 says its 2-thread rows met a shared core
        result["fma_scaling"] = peak.fma_scaling(2)
        results.append(result)
        print(report.model_line(result), flush=True)
    info["load_average_end"] = os.getloadavg()
    info["fma_scaling_end"] = peak.fma_scaling(2)
    info["quick"] = args.quick
    info["engines"] = sorted(args.engines)
    written = report.write(args.out, info, results)
    print(report.geomeans_text(results))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
