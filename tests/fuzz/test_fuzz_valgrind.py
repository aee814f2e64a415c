"""Fuzzed calls to both call-boundary models under valgrind's memcheck: the model libraries
(the compiled code and the C runtime) must read and write only the arrays they are given and
their workspace, never read memory they did not write, and leave no output element unwritten.

The libraries are compiled here (for the dispatching CPU baseline, since valgrind emulates no
AVX-512), and called in a worker child that runs under valgrind; onnxruntime runs here, on the
same inputs as converted for the call. The last test ends the child: valgrind's exit status is
99 when it reported an error (tests/fuzz/valgrind-python.supp hides the interpreter's own).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import budget
from fuzz_calls import MODELS, build_call
from fuzz_strategies import call_spec, valid_spec
from fuzz_tasks import _compare, _session
from fuzz_worker import HERE, Worker, WorkerDied
from host_tools import needs, tool
from hypothesis import given, settings

from cuvil.compiler.driver import compile_model
from cuvil.runtime import Model

ERROR_EXIT = 99
pytestmark = [pytest.mark.slow, needs("valgrind")]  # needs: before `libraries` compiles anything


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Model]]:
    """Each model's library path, and the model loaded here (to build the same calls)."""
    out = {}
    for key, make in MODELS.items():
        compiled = compile_model(make(), key, tmp_path_factory.mktemp(key))
        compiled.library.with_suffix(".json").write_text(json.dumps(compiled.signature))
        out[key] = (str(compiled.library), Model(compiled.library, compiled.signature))
    return out


@pytest.fixture(scope="module")
def memcheck() -> Iterator[Worker]:
    worker = Worker(prefix=[tool("valgrind"), "--quiet", f"--error-exitcode={ERROR_EXIT}",
                            f"--suppressions={HERE / 'valgrind-python.supp'}", "--num-callers=30"],
                    env={"PYTHONMALLOC": "malloc"})  # malloc for every object: memcheck sees them
    yield worker
    worker.close()


def _check(memcheck: Worker, libraries: dict[str, tuple[str, Model]], key: str,
           spec: dict[str, Any]) -> str:
    library, model = libraries[key]
    try:
        outcome, detail = memcheck.run("call", key, spec, library, False, timeout=600)
    except WorkerDied as exc:
        pytest.fail(str(exc))
    assert outcome != "bug", detail
    if outcome == "ran":
        got, nans = detail
        session = _session(MODELS[key]().SerializeToString())
        want = session.run(None, build_call(model, spec).converted)
        names = [o.name for o in session.get_outputs()]
        diff = _compare(names, want, got)
        assert diff is None, diff
        assert nans == {n: bool(np.isnan(w).any()) for n, w in zip(names, want)}
    return outcome


@pytest.mark.parametrize("key", sorted(MODELS))
def test_a_plain_call_under_valgrind(memcheck: Worker, libraries, key: str) -> None:
    assert _check(memcheck, libraries, key, valid_spec(key, 3)) == "ran"


@settings(max_examples=budget(30))
@given(spec=call_spec("static"))
def test_fuzzed_calls_to_a_static_model_under_valgrind(memcheck: Worker, libraries,
                                                       spec: dict[str, Any]) -> None:
    _check(memcheck, libraries, "static", spec)


@settings(max_examples=budget(30))
@given(spec=call_spec("symbolic"))
def test_fuzzed_calls_to_a_symbolic_model_under_valgrind(memcheck: Worker, libraries,
                                                         spec: dict[str, Any]) -> None:
    _check(memcheck, libraries, "symbolic", spec)


def test_valgrind_reported_no_errors(memcheck: Worker) -> None:
    code = memcheck.close(timeout=300)
    assert code != ERROR_EXIT, f"valgrind reported memory errors:\n{memcheck.stderr_tail(20000)}"
    assert code == 0, f"the worker under valgrind exited with status {code}:\n{memcheck.stderr_tail()}"
