"""Run the ONNX conformance suite and write docs/conformance.md and docs/conformance.json.

    python scripts/gen_conformance.py                 # everything, os.cpu_count() workers
    python scripts/gen_conformance.py --kinds node    # only onnx's node tests
    python scripts/gen_conformance.py --profile 40    # also profile 40 compiles in-process

The cases, the out-of-scope list and the targets are those of tests/conformance (the same
collection the CI gate runs). Setting CUVIL_OPT_LEVEL (0-3) changes the LLVM optimization
level of every compile.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conformance import runner, scope  # noqa: E402

GROUP_TITLES = {
    "node": "Node tests (onnx.backend.test.case.node)",
    "light": "Light models (onnx/backend/test/data/light)",
    "pytorch": "pytorch-converted + pytorch-operator",
    "simple": "simple",
}


def _pct(t: dict[str, Any]) -> str:
    return f"{t['rate']:.1%}" if t["in_scope"] else "-"


def _cell(text: str, limit: int = 220) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cause_key(r: dict[str, Any]) -> str:
    """A failure's message with names and numbers taken out, to group alike failures."""
    text = r["error"].replace(r["name"], "<case>")
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", text)
    text = re.sub(r"\(opset N\)(: used by .*)?", "", text)
    return text[:160]


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
        "LLVM O3 + object emission": ("module.py", "emit_object"),
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


def write_docs(results: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path) -> None:
    totals = runner.summarize(results)
    # one result a line, so that diffs between runs stay readable
    rows = [json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                        for k, v in r.items() if k != "traceback"}, sort_keys=True)
            for r in results]
    (out_dir / "conformance.json").write_text(
        "{\n" + f'"meta": {json.dumps(meta, sort_keys=True)},\n'
        + f'"totals": {json.dumps(totals, sort_keys=True)},\n'
        + '"results": [\n' + ",\n".join(rows) + "\n]\n}\n")

    md: list[str] = []
    w = md.append
    w("# ONNX conformance")
    w("")
    w("Generated by `python scripts/gen_conformance.py` (do not edit by hand); machine-readable "
      "results are in `conformance.json`. The cases are onnx's own backend tests "
      f"(onnx {meta['onnx_version']}), run through `cuvil.onnx_backend` with each case's "
      "rtol/atol. `tests/conformance/test_conformance.py` gates on the targets: in CI for the "
      "shipped models, with `CUVIL_CONFORMANCE=full` for everything; `CUVIL_CONFORMANCE=cases "
      "python -m pytest tests/conformance -k NAME` runs cases one by one.")
    w("")
    w("## Totals")
    w("")
    w("| cases | in scope | passed | pass rate | target | out of scope |")
    w("| --- | ---: | ---: | ---: | ---: | ---: |")
    for group in ("node", "light", "pytorch", "simple"):
        t = totals.get(group)
        if not t:
            continue
        target = f"{t['target']:.0%}" if t["target"] is not None else "-"
        mark = "" if t["meets_target"] else " (below)"
        w(f"| {GROUP_TITLES[group]} | {t['in_scope']} | {t['passed']} | {_pct(t)} | "
          f"{target}{mark} | {t['out_of_scope']} |")
    w("")
    w(f"One full run took {meta['wall_s'] / 60:.1f} min of wall time with {meta['workers']} worker "
      f"processes ({meta['cpu_count']} CPUs); compiling took {meta['compile_s']:.0f} s and running "
      f"{meta['run_s']:.1f} s of worker time in total"
      + (f", with CUVIL_OPT_LEVEL={meta['opt_level']}" if meta.get("opt_level") else "") + "."
      + (f" The cases took {meta['cpu_s']:.0f} CPU seconds (compiler and zig), about "
         f"{meta['cpu_s'] / 60 / meta['cpu_count']:.1f} min on {meta['cpu_count']} idle CPUs."
         if meta.get("cpu_s") else "")
      + (f" The {meta['rerun']['cases']} cases that had not passed were run again afterwards "
         f"({meta['rerun']['wall_s'] / 60:.1f} min)." if meta.get("rerun") else "")
      + (f" The machine's load average was {meta['load_avg'][0]} before and {meta['load_avg'][1]} "
         "after the run (other processes competed for the CPUs, so times are upper bounds)."
         if meta.get("load_avg") and max(meta["load_avg"]) > meta["cpu_count"] else ""))
    w("")

    w("## Out of scope")
    w("")
    w("Cases in these categories are not run (`tests/conformance/scope.py` holds the list). "
      "Every other case is in scope, and an in-scope case that fails counts as a failure.")
    w("")
    counts = collections.Counter(r["scope"] for r in results if r["status"] == "out-of-scope")
    w("| category | cases | what | why |")
    w("| --- | ---: | --- | --- |")
    for cat in scope.CATEGORIES:
        what = ", ".join([*cat.ops, *(f"domain {d}" for d in cat.domains),
                          *(f"type {d}" for d in cat.dtypes),
                          *(k.replace("_type", "") for k in cat.kinds),
                          *(f"cases {p}" for p in cat.cases)])
        w(f"| {cat.title} | {counts.get(cat.key, 0)} | {_cell(what, 400)} | {cat.reason} |")
    w("")
    w("cuvil compiles shapes ahead of time, so inputs that decide output shapes must be "
      "constants. onnx's node tests feed them as graph inputs; the suite binds these inputs to "
      "their test values before compiling (`prepare(model, bind=...)`), as an exporter writes "
      "initializers: " + ", ".join(f"{op} {list(ix)}" for op, ix in
                                   sorted(scope.COMPILE_TIME_INPUTS.items())) + ".")
    w("")

    failures = [r for r in results if r["status"] == "fail"]
    missing = collections.Counter(re.sub(r" \(opset \d+\)$", "", u)
                                  for r in failures for u in r.get("unsupported", []))
    if missing:
        w("## Unsupported operators")
        w("")
        w("Operators the failing cases need, with the number of cases each one blocks:")
        w("")
        w(", ".join(f"{op}: {n}" for op, n in sorted(missing.items(), key=lambda x: (-x[1], x[0]))))
        w("")
    causes = collections.Counter(_cause_key(r) for r in failures)
    if causes:
        w("## Most frequent causes of failure")
        w("")
        w("| cases | cause (names and numbers elided) |")
        w("| ---: | --- |")
        for cause, n in causes.most_common(25):
            w(f"| {n} | {_cell(cause)} |")
        w("")

    w("## Node tests per operator")
    w("")
    w("Each `*_expanded` case (the op's function body) counts for its operator.")
    w("")
    w("| operator | passed | failed | out of scope |")
    w("| --- | ---: | ---: | ---: |")
    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        if r["kind"] == "node":
            per_op[r["op"]][r["status"]] += 1
    for op in sorted(per_op, key=str.lower):
        c = per_op[op]
        w(f"| {op} | {c['pass']} | {c['fail']} | {c['out-of-scope']} |")
    w("")

    w("## Models")
    w("")
    w("| model | result | compile s | run s | cause |")
    w("| --- | --- | ---: | ---: | --- |")
    for r in results:
        if r["kind"] == "node":
            continue
        status = {"pass": "pass", "fail": "FAIL"}.get(r["status"], "out of scope: " + str(r["scope"]))
        w(f"| {r['kind']}/{r['name']} | {status} | {r['compile_s']:.2f} | {r['run_s']:.3f} | "
          f"{_cell(r['error'])} |")
    w("")

    node_failures = [r for r in failures if r["kind"] == "node"]
    if node_failures:
        w("## Failing node cases")
        w("")
        w("| case | stage | cause (first line of the error) |")
        w("| --- | --- | --- |")
        for r in node_failures:
            w(f"| {r['name']} | {r['stage']} | {_cell(r['error'])} |")
        w("")

    slow = sorted((r for r in results if r["status"] != "out-of-scope"),
                  key=lambda r: -(r["compile_s"] + r["run_s"]))[:15]
    w("## Time")
    w("")
    w("Slowest cases (compile + run, seconds):")
    w("")
    w("| case | compile s | run s |")
    w("| --- | ---: | ---: |")
    for r in slow:
        w(f"| {r['id']} | {r['compile_s']:.2f} | {r['run_s']:.3f} |")
    w("")
    prof = meta.get("profile")
    if prof:
        w(f"Where compile time goes: {prof['cases']} node-case compiles profiled in one process, "
          f"{prof['cpu_s']:.1f} CPU seconds in all ({prof['wall_s']:.1f} s wall). Sympy's time is "
          "spread over the other Python stages.")
        w("")
        w("| stage | CPU s | share |")
        w("| --- | ---: | ---: |")
        for label, secs in sorted(prof["stages"].items(), key=lambda kv: -kv[1]):
            share = secs / prof["cpu_s"] if prof["cpu_s"] else 0
            w(f"| {label} | {secs:.2f} | {share:.0%} |")
        w("")
    (out_dir / "conformance.md").write_text("\n".join(md))


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
    args = parser.parse_args(argv)

    if args.from_json:
        data = json.loads(args.from_json.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        write_docs(data["results"], data["meta"], args.out)
        return 0

    import onnx

    start = time.perf_counter()
    load_before = os.getloadavg()[1]
    cases = runner.all_cases([k.strip() for k in args.kinds.split(",") if k.strip()])
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
    results = [fresh.get(c.id) or kept[c.id] for c in cases]
    wall = time.perf_counter() - start
    meta: dict[str, Any] = {
        "onnx_version": onnx.__version__,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "wall_s": round(wall, 1),
        "collect_s": round(collected, 1),
        "compile_s": round(sum(r["compile_s"] for r in results), 1),
        "run_s": round(sum(r["run_s"] for r in results), 2),
        "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in results), 1),
        "opt_level": os.environ.get("CUVIL_OPT_LEVEL") or None,
        # the machine's 5-minute load average before and after: other work slows a run down
        "load_avg": [round(load_before, 1), round(os.getloadavg()[1], 1)],
    }
    if previous:  # the times of the full run; say how many cases ran again
        for key in ("wall_s", "compile_s", "run_s", "cpu_s", "load_avg", "profile"):
            meta[key] = previous["meta"].get(key)
        meta["compile_s"] = round(sum(r["compile_s"] for r in results), 1)
        meta["rerun"] = {"cases": sum(1 for c in again if not c.scope), "wall_s": round(wall, 1)}
    if args.profile:
        meta["profile"] = profile([c for c in cases if c.kind == "node"], args.profile) or None
    args.out.mkdir(parents=True, exist_ok=True)
    write_docs(results, meta, args.out)
    for group, t in sorted(runner.summarize(results).items()):
        print(f"{group}: {t['passed']}/{t['in_scope']} = {_pct(t)}", file=sys.stderr)
    print(f"wrote {args.out / 'conformance.md'} ({wall / 60:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
