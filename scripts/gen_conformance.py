"""Run the ONNX conformance suite and write docs/conformance.md and docs/conformance.json.

    python scripts/gen_conformance.py                 # everything, os.cpu_count() workers
    python scripts/gen_conformance.py --kinds node    # only onnx's node tests
    python scripts/gen_conformance.py --profile 40    # also profile 40 compiles in-process
    python scripts/gen_conformance.py --from-json docs/conformance.json   # rewrite, no run
    python scripts/gen_conformance.py --families      # print the ai.onnx.ml / com.microsoft
                                                      # section alone, no run

The report's section on the families beyond onnx's node tests (ai.onnx.ml, com.microsoft) is
read from the op registry and the test files (tests/conformance/families.py), so it renders
without a run and is the same for the same sources.

The cases, the out-of-scope list and the targets are those of tests/conformance (the same
collection the CI gate runs). Setting CUVIL_OPT_LEVEL (0-3) changes the LLVM optimization
level of every compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conformance import families, report, runner, scope  # noqa: E402


def profile(cases: list[runner.Case], n: int) -> dict[str, Any]:
    """Where compile time goes, over the first `n` in-scope cases that compile.

    Measured in CPU seconds (this process, plus its child processes for zig), so that the
    shares do not depend on how busy the machine is.
    """
    import cProfile
    import pstats
    import resource

    from cuvil.onnx_backend import CuvilBackend

    def children_cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    prof = cProfile.Profile(time.process_time)
    compiled = 0
    cpu0, kids0, wall0 = time.process_time(), children_cpu(), time.perf_counter()
    for case in (c for c in cases if not c.scope):
        if compiled >= n:
            break
        model = case.model()
        bind = {}
        if case.data_sets:
            inits = {i.name for i in model.graph.initializer}
            names = [vi.name for vi in model.graph.input if vi.name not in inits]
            feeds = dict(zip(names, case.data_sets[0][0]))
            names_to_bind = case.bind if case.bind is not None else scope.compile_time_inputs(model)
            bind = {k: feeds[k] for k in names_to_bind if k in feeds}
        prof.enable()
        try:
            CuvilBackend.prepare(model, bind=bind or None)
            compiled += 1
        except Exception:
            pass
        finally:
            prof.disable()
    if not compiled:
        return {}
    cpu, kids = time.process_time() - cpu0, children_cpu() - kids0
    stats = pstats.Stats(prof)
    # cumulative time of the functions that mark each stage
    marks = {
        "import (frontend, shape rules, constant folding)": ("importer.py", "import_model"),
        "constant folding (onnx ReferenceEvaluator; part of import)": ("fold_constants.py",
                                                                        "fold_node"),
        "passes": ("passes/__init__.py", "run_passes"),
        "memory plan": ("plan_memory.py", "plan_memory"),
        "LLVM IR building (llvmlite.ir)": ("module.py", "build_module"),
        "LLVM O3 + object emission (a worker process)": ("toolchains/llvm.py",
                                                         "emit_object_isolated"),
        "sympy (its own functions' time)": ("sympy", None),
        "library loading (ctypes)": ("_loader.py", "__init__"),
    }
    stages: dict[str, float] = {}
    for label, (file_part, func) in marks.items():
        total = 0.0
        for (filename, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
            if file_part not in filename or (func is not None and name != func):
                continue
            # a whole package: its functions' own time (cumulative times would overlap)
            total += ct if func is not None else _tt
        stages[label] = round(total, 2)
    stages["zig subprocesses (embed weights + link; CPU of child processes)"] = round(kids, 2)
    return {"cases": compiled, "cpu_s": round(cpu + kids, 2),
            "wall_s": round(time.perf_counter() - wall0, 2), "stages": stages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="node,light," + ",".join(runner.MODEL_KINDS),
                        help="comma-separated: node, light, pytorch-converted, pytorch-operator, simple")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N compiles in this process and report the stages")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="rewrite the docs from an earlier run's conformance.json, no run")
    parser.add_argument("--rerun-failed", type=Path, metavar="FILE",
                        help="keep the passes of an earlier run's conformance.json and run only "
                             "the other in-scope cases again")
    parser.add_argument("--families", action="store_true",
                        help="print the section on ai.onnx.ml and com.microsoft and exit (no run)")
    args = parser.parse_args(argv)

    if args.families:
        print("\n".join(families.render()))
        return 0
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        report.write_docs(data["results"], data["meta"], args.out)
        return 0

    start = time.perf_counter()
    load_before = os.getloadavg()[1]
    # the light models' dense copies (about 1.2 GB), made by the workers, removed at the end
    light_folder = tempfile.TemporaryDirectory(prefix="cuvil-light-")
    cases = runner.all_cases([k.strip() for k in args.kinds.split(",") if k.strip()],
                             Path(light_folder.name))
    collected = time.perf_counter() - start
    in_scope = sum(1 for c in cases if not c.scope)
    print(f"collected {len(cases)} cases ({in_scope} in scope) in {collected:.0f} s", file=sys.stderr)

    def progress(r: dict[str, Any], done: int, total: int) -> None:
        if done % 50 == 0 or done == total or r["kind"] != "node":
            print(f"[{done}/{total}] {time.perf_counter() - start:.0f} s  {r['id']}: {r['status']}"
                  f" ({r['compile_s']:.1f} s)", file=sys.stderr)

    kept: dict[str, dict[str, Any]] = {}
    previous: dict[str, Any] = {}
    if args.rerun_failed:
        previous = json.loads(args.rerun_failed.read_text())
        kept = {r["id"]: r for r in previous["results"] if r["status"] == "pass"}
    again = [c for c in cases if c.id not in kept or c.scope]
    fresh = {r["id"]: r for r in runner.run_all(again, workers=args.workers, progress=progress)}
    light_folder.cleanup()
    results = [fresh.get(c.id) or kept[c.id] for c in cases]
    wall = time.perf_counter() - start
    meta = report.run_meta(results, args.workers, wall, collected, load_before)
    if previous:  # the times of the full run; say how many cases ran again
        for key in ("wall_s", "compile_s", "run_s", "cpu_s", "load_avg", "profile"):
            meta[key] = previous["meta"].get(key)
        meta["compile_s"] = round(sum(r["compile_s"] for r in results), 1)
        meta["rerun"] = {"cases": sum(1 for c in again if not c.scope), "wall_s": round(wall, 1)}
    if args.profile:
        meta["profile"] = profile([c for c in cases if c.kind == "node"], args.profile) or None
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_docs(results, meta, args.out)
    for group, t in sorted(runner.summarize(results).items()):
        print(f"{group}: {t['passed']}/{t['in_scope']} = {report.pct(t)}", file=sys.stderr)
    print(f"wrote {args.out / 'conformance.md'} ({wall / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
