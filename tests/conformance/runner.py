"""Collect onnx's backend test cases, run them through `cuvil.onnx_backend`, and sum up.

Cases:
- node: every case of `onnx.backend.test.case.node.collect_testcases(None)` (the data onnx
  writes to `onnx/backend/test/data/node/`), with each case's own rtol/atol;
- light: the light_* models of `onnx/backend/test/data/light/` (the `real/` tests run on
  local files), as dense-weight copies (tests/light_models.py: the originals' splat weights
  make every output 1/1000), made in the worker into the folder `light_cases` is given; the
  input is seeded random, the expected output onnxruntime's on the same copy, and a copy
  whose softmax comes out nearly flat fails;
- pytorch-converted, pytorch-operator, simple: `<dir>/model.onnx` with
  `test_data_set_*/{input,output}_*.pb`.

`run_all` runs cases in worker processes; a worker that crashes or hangs (SIGALRM ends it)
costs only its own case, which is re-run alone and reported as crashed.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import json
import os
import re
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import light_models
import numpy as np
import onnx
from onnx import numpy_helper

from conformance import scope

__all__ = [
    "MODEL_KINDS",
    "Case",
    "all_cases",
    "light_cases",
    "model_cases",
    "node_cases",
    "run_all",
    "run_case",
    "summarize",
]

DATA_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data"
MODEL_KINDS = ("pytorch-converted", "pytorch-operator", "simple")
#: seconds a case may take (compile + run) before its worker is ended
NODE_TIMEOUT = 300
#: cases a worker runs before its pool is replaced
CASES_PER_WORKER = 100
MODEL_TIMEOUT = 1800


@dataclass
class Case:
    id: str  # "<kind>/<name>"
    kind: str  # node | light | pytorch-converted | pytorch-operator | simple
    name: str
    rtol: float
    atol: float
    op: str = ""  # node cases: the operator under test (also for the *_expanded variants)
    model_bytes: bytes | None = None  # node cases
    model_path: str | None = None  # model cases
    data_sets: list[tuple[list[Any], list[Any]]] | None = None  # node cases
    source_path: str | None = None  # light: the original model, of which model_path is a copy
    #: graph inputs bound to their test values before compiling (scope.COMPILE_TIME_INPUTS);
    #: None: derived from the model
    bind: list[str] | None = None
    scope: str | None = None  # out-of-scope category key, None when in scope
    timeout: int = NODE_TIMEOUT

    def model(self) -> onnx.ModelProto:
        if self.source_path is not None:
            assert self.model_path is not None
            light_models.dense_copy(Path(self.source_path), Path(self.model_path))
        if self.model_bytes is not None:
            m = onnx.ModelProto()
            m.ParseFromString(self.model_bytes)
            return m
        assert self.model_path is not None
        return onnx.load(self.model_path, load_external_data=False)


# ------------------------------------------------------------------------------ collecting


def _to_array(x: Any) -> Any:
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    return x


def node_cases() -> list[Case]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        raw = collect_testcases(None)
    by_name = {c.name: c for c in raw}
    cases = []
    for c in raw:
        # an *_expanded case is its op's function body: it tests the op of the base case, is in
        # scope when that is, and binds the inputs the base case binds (a window's size...)
        base = by_name.get(re.sub(r"_expanded(_ver\d+)?$", "", c.name), c)
        op = base.model.graph.node[0].op_type if len(base.model.graph.node) == 1 else "?"
        graph_inputs = {vi.name for vi in c.model.graph.input}
        bind = [n for n in scope.compile_time_inputs(base.model) if n in graph_inputs]
        cat = scope.classify(c.model, c.name) or scope.classify(base.model, base.name)
        cases.append(Case(
            id=f"node/{c.name}", kind="node", name=c.name, rtol=c.rtol, atol=c.atol, op=op,
            bind=bind, model_bytes=c.model.SerializeToString(),
            data_sets=[([_to_array(a) for a in ins], [_to_array(a) for a in outs])
                       for ins, outs in c.data_sets],
            scope=cat.key if cat else None,
        ))
    return cases


def light_cases(folder: Path) -> list[Case]:
    """The light models' cases; their dense copies are made (when a case runs) into `folder`."""
    cases = []
    for data_json in sorted((DATA_DIR / "real").glob("*/data.json")):
        info = json.loads(data_json.read_text())
        url = info.get("url", "")
        if not url.startswith("onnx/backend/test/data/light/"):
            continue
        path = DATA_DIR / "light" / Path(url).name
        if not path.is_file():
            continue
        name = data_json.parent.name
        cat = scope.classify(onnx.load(str(path)), name)
        cases.append(Case(
            id=f"light/{name}", kind="light", name=name, rtol=info.get("rtol", 1e-3),
            atol=info.get("atol", 1e-7), source_path=str(path),
            model_path=str(folder / f"{path.stem}_dense.onnx"), scope=cat.key if cat else None,
            timeout=MODEL_TIMEOUT,
        ))
    return cases


def model_cases(kind: str) -> list[Case]:
    cases = []
    for case_dir in sorted((DATA_DIR / kind).iterdir()):
        model_path = case_dir / "model.onnx"
        if not model_path.is_file():
            continue
        rtol, atol = 1e-3, 1e-7  # onnx's loader defaults, unless data.json says otherwise
        if (case_dir / "data.json").is_file():
            info = json.loads((case_dir / "data.json").read_text())
            rtol, atol = info.get("rtol", rtol), info.get("atol", atol)
        cat = scope.classify(onnx.load(str(model_path)), case_dir.name)
        cases.append(Case(
            id=f"{kind}/{case_dir.name}", kind=kind, name=case_dir.name, rtol=rtol, atol=atol,
            model_path=str(model_path), scope=cat.key if cat else None, timeout=MODEL_TIMEOUT,
        ))
    return cases


def all_cases(kinds: Iterable[str] = ("node", "light", *MODEL_KINDS),
              light_folder: Path | None = None) -> list[Case]:
    """The cases of `kinds`; light ones need `light_folder`, where their copies go."""
    cases: list[Case] = []
    for kind in kinds:
        if kind == "node":
            cases += node_cases()
        elif kind == "light":
            if light_folder is None:
                raise ValueError("the light cases need a folder for their dense copies")
            cases += light_cases(light_folder)
        else:
            cases += model_cases(kind)
    return cases


# --------------------------------------------------------------------------------- running


def _read_pb(path: str) -> np.ndarray:
    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def _numbered(folder: str, prefix: str) -> list[str]:
    files = glob.glob(os.path.join(folder, f"{prefix}_*.pb"))
    return sorted(files, key=lambda p: int(re.findall(r"_(\d+)\.pb$", p)[0]))


def _data_sets(case: Case, model: onnx.ModelProto) -> list[tuple[list[Any], list[Any]]]:
    if case.data_sets is not None:
        return case.data_sets
    if case.kind == "light":
        import onnxruntime as ort

        feeds = light_models.random_feeds(model, seed=0)
        session = ort.InferenceSession(case.model_path, providers=["CPUExecutionProvider"])
        expected = session.run(None, feeds)
        problem = light_models.spread_problem(expected[0])
        if problem:  # the copy would test as little as the splat original
            raise ValueError(f"the dense copy of {case.name} is degenerate: {problem}")
        return [(list(feeds.values()), expected)]
    folder = os.path.dirname(case.model_path or "")
    sets = []
    for ds in sorted(glob.glob(os.path.join(folder, "test_data_set_*"))):
        sets.append(([_read_pb(p) for p in _numbered(ds, "input")],
                     [_read_pb(p) for p in _numbered(ds, "output")]))
    return sets


def compare(outputs: Sequence[Any], expected: Sequence[Any], names: Sequence[str], rtol: float,
            atol: float) -> str | None:
    """None when `outputs` match `expected` as onnx's backend tests compare; else why not."""
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, expected {len(expected)}"
    for i, (have, want) in enumerate(zip(outputs, expected)):
        label = f"output {i} ({names[i]!r})" if i < len(names) else f"output {i}"
        if isinstance(want, np.generic):  # some cases store scalars as numpy scalars
            want = np.asarray(want)
        if not isinstance(want, np.ndarray):
            return f"{label}: expected a {type(want).__name__}, not a tensor"
        have = np.asarray(have)
        if have.shape != want.shape:
            return f"{label}: shape {list(have.shape)}, expected {list(want.shape)}"
        if have.dtype != want.dtype:
            return f"{label}: dtype {have.dtype}, expected {want.dtype}"
        if want.dtype.kind in "fc":
            ok = np.isclose(have, want, rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = have == want
        if not np.all(ok):
            bad = np.flatnonzero(~np.asarray(ok))
            j = int(bad[0])
            diff = ""
            if want.dtype.kind in "fc":
                with np.errstate(invalid="ignore"):
                    diff = f", max abs diff {np.nanmax(np.abs(have - want)):.3g}"
            idx = tuple(int(x) for x in np.unravel_index(j, want.shape)) if want.ndim else ()
            return (f"{label}: {bad.size}/{want.size} elements differ (rtol={rtol:g}, "
                    f"atol={atol:g}{diff}); first at {list(idx)}: got {have.flat[j]!r}, expected "
                    f"{want.flat[j]!r}")
    return None


#: the importer's lines "  <domain> <op> (opset <n>): used by ..."
_UNSUPPORTED = re.compile(r"^\s+(\S+) (\S+) \(opset (\d+)\): used by", re.MULTILINE)
_PATH = re.compile(r"(/[^\s'\"():,]+)+/(site-packages|dist-packages)/")
_TMP = re.compile(r"/tmp/[^\s'\"():,]*")


def clean(text: str) -> str:
    """A message without this machine's paths (site-packages prefixes, temp dirs)."""
    text = _PATH.sub("", text)
    return _TMP.sub("<tmp>", text)


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:  # "cannot compile N operator(s): <the first>"
        text += " " + lines[1]
    return clean(f"{type(exc).__name__}: {text}")


def run_case(case: Case) -> dict[str, Any]:
    """Prepare, run and compare one case; never raises (the result says what happened)."""
    result: dict[str, Any] = {"id": case.id, "kind": case.kind, "name": case.name, "op": case.op,
                              "scope": case.scope, "status": "fail", "stage": "load", "error": "",
                              "compile_s": 0.0, "run_s": 0.0}
    cpu_start = _cpu_seconds()
    try:
        _run_case(case, result)
    finally:
        # CPU time of this process and its children (zig): unlike wall time, it does not
        # grow when other work shares the machine
        result["cpu_s"] = round(_cpu_seconds() - cpu_start, 3)
    return result


def _cpu_seconds() -> float:
    try:
        import resource
    except ImportError:  # Windows has no resource module
        return time.process_time()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _run_case(case: Case, result: dict[str, Any]) -> None:
    from cuvil.onnx_backend import CuvilBackend

    try:
        model = case.model()
        data_sets = _data_sets(case, model)
        to_bind = case.bind if case.bind is not None else scope.compile_time_inputs(model)
        inits = {i.name for i in model.graph.initializer}
        input_names = [vi.name for vi in model.graph.input if vi.name not in inits]
        output_names = [vi.name for vi in model.graph.output]
        reps: dict[bytes, Any] = {}
        for inputs, expected in data_sets:
            feeds = dict(zip(input_names, (_to_array(a) for a in inputs)))
            bind = {n: feeds.pop(n) for n in to_bind if n in feeds}
            key = b"".join(np.ascontiguousarray(a).tobytes() + str(a.dtype).encode()
                           for a in bind.values())
            if key not in reps:
                result["stage"] = "compile"
                start = time.perf_counter()
                source = case.model_path if case.model_bytes is None and not bind else model
                reps[key] = CuvilBackend.prepare(source, "CPU", bind=bind or None)
                result["compile_s"] += time.perf_counter() - start
            result["stage"] = "run"
            start = time.perf_counter()
            outputs = reps[key].run(feeds)
            result["run_s"] += time.perf_counter() - start
            result["stage"] = "compare"
            problem = compare(list(outputs), [_to_array(e) for e in expected], output_names,
                              case.rtol, case.atol)
            if problem:
                result["error"] = clean(problem)
                return
        result["status"] = "pass"
        result["stage"] = ""
    except Exception as exc:
        result["error"] = first_line(exc)
        missing = _UNSUPPORTED.findall(str(exc))
        if missing:
            result["unsupported"] = sorted({f"{op} (opset {v})" if d in ("", "ai.onnx")
                                            else f"{d}:{op} (opset {v})" for d, op, v in missing})
        result["error_type"] = type(exc).__name__
        result["traceback"] = clean("".join(traceback.format_exception(type(exc), exc,
                                                                        exc.__traceback__))[-4000:])


# ---------------------------------------------------------------------------- in parallel

_MARKERS: str | None = None


def _init_worker(markers: str) -> None:
    global _MARKERS
    _MARKERS = markers
    warnings.simplefilter("ignore")
    import cuvil.onnx_backend  # noqa: F401  (pay the imports once per worker)


def _work(case: Case) -> dict[str, Any]:
    marker = Path(_MARKERS or tempfile.gettempdir()) / f"{os.getpid()}.running"
    marker.write_text(case.id)
    # SIGALRM's default action ends the process: a hang becomes a crash of this case only
    signal.alarm(case.timeout)
    try:
        return run_case(case)
    finally:
        signal.alarm(0)
        marker.unlink()


def _crashed(case: Case, note: str) -> dict[str, Any]:
    return {"id": case.id, "kind": case.kind, "name": case.name, "op": case.op,
            "scope": case.scope, "status": "fail", "stage": "crash", "error": note,
            "compile_s": 0.0, "run_s": 0.0}


def _pool(workers: int, markers: str) -> cf.ProcessPoolExecutor:
    import multiprocessing

    kwargs: dict[str, Any] = {"max_workers": workers, "initializer": _init_worker,
                              "initargs": (markers,),
                              "mp_context": multiprocessing.get_context("spawn")}
    return cf.ProcessPoolExecutor(**kwargs)


def run_all(cases: Sequence[Case], workers: int | None = None,
            progress: Callable[[dict[str, Any], int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run every in-scope case in worker processes; results in the order of `cases`.

    Out-of-scope cases are not run: their result says which category excludes them.
    """
    workers = workers or os.cpu_count() or 1
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for c in cases:
        if c.scope:
            results[c.id] = {"id": c.id, "kind": c.kind, "name": c.name, "op": c.op,
                             "scope": c.scope, "status": "out-of-scope", "stage": "",
                             "error": "", "compile_s": 0.0, "run_s": 0.0}
        else:
            todo.append(c)
    # longest first, so that big models do not end the run alone
    todo.sort(key=lambda c: c.kind == "node")
    total = len(todo)

    def done(r: dict[str, Any]) -> None:
        results[r["id"]] = r
        if progress:
            progress(r, len(results) - (len(cases) - total), total)

    # Each batch gets a new pool, so that workers stay fresh-ish (every case leaves a loaded
    # library behind). Not max_tasks_per_child: its worker replacement can hang on 3.11.
    batch_size = workers * CASES_PER_WORKER
    with tempfile.TemporaryDirectory(prefix="cuvil-conformance-") as markers:
        for first in range(0, len(todo), batch_size):
            _run_batch(todo[first:first + batch_size], workers, markers, results, done)
    return [results[c.id] for c in cases]


def _run_batch(batch: list[Case], workers: int, markers: str, results: dict[str, Any],
               done: Callable[[dict[str, Any]], None]) -> None:
    """Run `batch` in one pool; re-run alone each case that was running when a worker died."""
    pending = batch
    failed_pools = 0
    while pending:
        with _pool(min(workers, len(pending)), markers) as pool:
            futures = {pool.submit(_work, c): c for c in pending}
            for f in cf.as_completed(futures):
                with contextlib.suppress(cf.process.BrokenProcessPool):
                    done(f.result())
        left = [c for c in pending if c.id not in results]
        suspects = set()
        for m in Path(markers).glob("*.running"):
            suspects.add(m.read_text())
            m.unlink()
        if left and not suspects:  # the pool broke with no case running
            failed_pools += 1
            if failed_pools >= 2:
                for c in left:
                    done(_crashed(c, "the worker processes could not start"))
                break
        for c in left:
            if c.id not in suspects:
                continue
            with _pool(1, markers) as alone:
                try:
                    done(alone.submit(_work, c).result())
                except cf.process.BrokenProcessPool:
                    done(_crashed(c, f"the worker process died (crash, or over the "
                                     f"{c.timeout} s time limit)"))
            for m in Path(markers).glob("*.running"):
                m.unlink()
        pending = [c for c in left if c.id not in results]


# ------------------------------------------------------------------------------ summing up


def _group(kind: str) -> str:
    return "pytorch" if kind.startswith("pytorch") else kind


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals per group (node, light, pytorch, simple): in scope, passed, rate, target."""
    totals: dict[str, dict[str, Any]] = {}
    for r in results:
        t = totals.setdefault(_group(r["kind"]), {"cases": 0, "in_scope": 0, "passed": 0,
                                                  "failed": 0, "out_of_scope": 0})
        t["cases"] += 1
        if r["status"] == "out-of-scope":
            t["out_of_scope"] += 1
            continue
        t["in_scope"] += 1
        t["passed" if r["status"] == "pass" else "failed"] += 1
    for group, t in totals.items():
        t["rate"] = t["passed"] / t["in_scope"] if t["in_scope"] else 1.0
        t["target"] = scope.TARGETS.get(group)
        t["meets_target"] = t["target"] is None or t["rate"] >= t["target"]
    return totals
