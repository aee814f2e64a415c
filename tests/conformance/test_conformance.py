"""The ONNX conformance gate: onnx's node tests and shipped model tests through cuvil.

Default (CI): one slow test runs every case (onnx's node tests, the light_* models,
pytorch-converted, pytorch-operator and simple) in worker processes, writes the report
(conformance.md/.json, as `scripts/gen_conformance.py` does for docs/) to build/conformance/,
and fails when a pass rate falls below its target in `scope.TARGETS` (>= 90% of the node
cases in scope, every light model, >= 95% of pytorch-converted + pytorch-operator), listing
the failures and their causes.

CUVIL_CONFORMANCE=models runs only the shipped models (about 3 min on 2 cores), for a quick
local check. Per-case mode, to see failures one by one (and select them with -k):

    CUVIL_CONFORMANCE=cases python -m pytest tests/conformance -k "relu or light"
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx
import pytest

from conformance import report, runner, scope

MODE = os.environ.get("CUVIL_CONFORMANCE", "")
PER_CASE = MODE == "cases"
MODELS_ONLY = MODE == "models"
#: where the gate writes the report of its run (the repository's build/ is not committed)
REPORT_DIR = Path(__file__).resolve().parents[2] / "build" / "conformance"


@functools.cache
def _cases() -> tuple[runner.Case, ...]:
    light = tempfile.mkdtemp(prefix="cuvil-light-")  # the light models' dense copies
    atexit.register(shutil.rmtree, light, True)
    return tuple(runner.all_cases(light_folder=Path(light)))


# -- the scope data itself -------------------------------------------------------------------


def test_categories_name_real_operators_and_give_reasons():
    keys = [c.key for c in scope.CATEGORIES]
    assert len(keys) == len(set(keys))
    for cat in scope.CATEGORIES:
        assert cat.reason.strip() and cat.title.strip(), cat.key
        for op in cat.ops:
            domain, _, op_type = op.rpartition(":")
            known = onnx.defs.has(op_type, domain) if domain else any(
                onnx.defs.has(op_type, d) for d in ("", "ai.onnx.preview.training", "ai.onnx.ml"))
            assert known, f"category {cat.key}: {op} is not an ONNX operator"
        for dt in cat.dtypes:
            assert dt in set(onnx.TensorProto.DataType.keys()), f"category {cat.key}: {dt}"


def test_compile_time_inputs_are_inputs_of_the_schemas():
    for op_type, indices in scope.COMPILE_TIME_INPUTS.items():
        schema = onnx.defs.get_schema(op_type)
        assert all(0 <= i < len(schema.inputs) for i in indices), (op_type, indices)


def test_classify_reads_ops_types_and_names():
    from onnx import helper

    def model(node, in_type=onnx.TensorProto.FLOAT, out_type=onnx.TensorProto.FLOAT):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", in_type, [2])],
                              [helper.make_tensor_value_info("y", out_type, [2])])
        return helper.make_model(g)

    relu = helper.make_node("Relu", ["x"], ["y"])
    assert scope.classify(model(relu), "test_relu") is None
    assert scope.classify(model(relu, onnx.TensorProto.BFLOAT16), "t").key == "dtype"
    assert scope.classify(model(relu), "test_training_dropout_x").key == "random"
    adam = helper.make_node("Adam", ["x"], ["y"], domain="ai.onnx.preview.training")
    assert scope.classify(model(adam), "t").key == "training"
    cast = helper.make_node("Cast", ["x"], ["y"], to=onnx.TensorProto.FLOAT8E4M3FN)
    assert scope.classify(model(cast), "t").key == "dtype"


def test_compile_time_inputs_are_bound_only_when_they_are_graph_inputs():
    from onnx import helper

    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    vis = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
           helper.make_tensor_value_info("shape", onnx.TensorProto.INT64, [1])]
    out = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [6])]
    as_input = helper.make_model(helper.make_graph([node], "g", vis, out))
    assert scope.compile_time_inputs(as_input) == ["shape"]
    init = onnx.numpy_helper.from_array(__import__("numpy").array([6], "int64"), "shape")
    as_init = helper.make_model(helper.make_graph([node], "g", vis[:1], out, [init]))
    assert scope.compile_time_inputs(as_init) == []


# -- the gate --------------------------------------------------------------------------------


def _report(results, totals) -> str:
    lines = ["conformance below target:"]
    for group, t in sorted(totals.items()):
        target = f" (target {t['target']:.0%})" if t["target"] is not None else ""
        lines.append(f"  {group}: {t['passed']}/{t['in_scope']} in scope passed = {t['rate']:.1%}"
                     f"{target}")
    failures = [r for r in results if r["status"] == "fail"]
    causes = collections.Counter(u.split(" (opset")[0] for r in failures
                                 for u in r.get("unsupported", []))
    if causes:
        lines.append("  unsupported operators (failing cases): " + ", ".join(
            f"{op} ({n})" for op, n in causes.most_common(25)))
    lines.append("  failures (first 60; docs/conformance.md lists all):")
    lines += [f"    {r['id']}: {r['error'][:200]}" for r in failures[:60]]
    return "\n".join(lines)


def _gate(kinds: tuple[str, ...], groups: tuple[str, ...], tmp_path: Path) -> None:
    start, load_before = time.perf_counter(), os.getloadavg()[1]
    # the workers make the light models' dense copies here (about 1.2 GB, not kept)
    with tempfile.TemporaryDirectory(dir=tmp_path) as light:
        cases = runner.all_cases(kinds, Path(light))
        collected = time.perf_counter() - start
        results = runner.run_all(cases)
    totals = runner.summarize(results)
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    meta = report.run_meta(results, os.cpu_count() or 1, time.perf_counter() - start, collected,
                           load_before)
    report.write_docs(results, meta, REPORT_DIR)
    print(f"conformance report: {REPORT_DIR / 'conformance.md'}")
    for group in groups:
        assert group in totals, f"no {group} cases were collected: is the onnx package complete?"
    assert all(totals[g]["meets_target"] for g in groups), _report(results, totals)


@pytest.mark.slow
@pytest.mark.skipif(PER_CASE or MODELS_ONLY, reason="CUVIL_CONFORMANCE selects another gate")
def test_conformance_meets_targets(tmp_path):
    _gate(("node", "light", *runner.MODEL_KINDS), tuple(scope.TARGETS), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not MODELS_ONLY, reason="the full gate covers the models too; "
                    "CUVIL_CONFORMANCE=models runs only them")
def test_model_conformance_meets_targets(tmp_path):
    """The shipped models only (light_*, pytorch-converted, pytorch-operator)."""
    _gate(("light", "pytorch-converted", "pytorch-operator"), ("light", "pytorch"), tmp_path)


@pytest.mark.slow
def test_a_case_that_ends_its_worker_fails_alone(tmp_path):
    """A case whose worker dies (here: over its time limit) is reported; the others still run."""
    import dataclasses

    light = [c for c in runner.light_cases(tmp_path) if c.name == "test_squeezenet"]
    others = [c for c in runner.model_cases("pytorch-operator")
            if c.name in ("test_operator_basic", "test_operator_exp")]
    assert light and len(others) == 2
    doomed = dataclasses.replace(light[0], timeout=1)  # compiling it takes far longer
    results = {r["id"]: r for r in runner.run_all([doomed, *others], workers=2)}
    assert results[doomed.id]["stage"] == "crash"
    assert "time limit" in results[doomed.id]["error"]
    assert all(results[c.id]["stage"] != "crash" for c in others)


# -- one test per case (CUVIL_CONFORMANCE=cases) ---------------------------------------------

if PER_CASE:

    class _Worker:
        """One worker process for the session, replaced when a case kills it."""

        def __init__(self, markers: str) -> None:
            self.markers = markers
            self.pool = runner._pool(1, markers)

        def run(self, case: runner.Case) -> dict:
            import concurrent.futures as cf

            try:
                return self.pool.submit(runner._work, case).result()
            except cf.process.BrokenProcessPool:
                self.pool = runner._pool(1, self.markers)
                return runner._crashed(case, "the worker process died (crash, or over the "
                                             f"{case.timeout} s time limit)")

    @pytest.fixture(scope="module")
    def worker(tmp_path_factory):
        w = _Worker(str(tmp_path_factory.mktemp("markers")))
        yield w
        w.pool.shutdown()

    @pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
    def test_case(case: runner.Case, worker) -> None:
        if case.scope:
            cat = scope.category(case.scope)
            pytest.skip(f"out of scope ({cat.title}): {cat.reason}")
        result = worker.run(case)
        if result["status"] != "pass":
            pytest.fail(f"{case.id} ({result['stage']}): {result['error']}\n"
                        f"{result.get('traceback', '')}", pytrace=False)
