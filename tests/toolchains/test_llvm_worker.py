"""LLVM's optimizer and code generator in a worker process (cuvil.toolchains.llvm): the same
object code as in this process, LLVM's errors as RuntimeErrors, workers reused, recycled after
their jobs, ended when idle and with their parent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from llvmlite import ir

from cuvil.toolchains import get_target, machine_options, target_machine
from cuvil.toolchains import llvm as worker_module
from cuvil.toolchains.llvm import emit_object, emit_object_isolated

ROOT = Path(__file__).resolve().parents[2]


def add_one_ir() -> str:
    module = ir.Module("add_one")
    module.triple = get_target(None).arches[0].llvm_triple
    i32 = ir.IntType(32)
    fn = ir.Function(module, ir.FunctionType(i32, [i32]), "add_one")
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.ret(builder.add(fn.args[0], ir.Constant(i32, 1)))
    return str(module)


def machine() -> dict:
    return machine_options(get_target(None).arches[0])


def worker_pids() -> list[int]:
    return [w.proc.pid for w in worker_module._idle]


@pytest.fixture
def fresh_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No idle worker from earlier tests: the next job starts one with this test's settings."""
    monkeypatch.delenv(worker_module.IN_PROCESS_VAR, raising=False)
    worker_module._stop_workers()
    yield
    worker_module._stop_workers()


def test_the_worker_emits_what_this_process_emits(fresh_workers: None) -> None:
    text = add_one_ir()
    here = emit_object(text, target_machine(get_target(None).arches[0]))
    assert emit_object_isolated(text, machine()) == here
    assert len(worker_pids()) == 1  # it waits for the next job


def test_llvm_errors_come_back_as_runtime_errors_and_the_worker_goes_on(
        fresh_workers: None) -> None:
    with pytest.raises(RuntimeError, match="expected instruction opcode"):
        emit_object_isolated("define i32 @f() {\n  bogus\n}\n", machine())
    pid = worker_pids()
    assert emit_object_isolated(add_one_ir(), machine())
    assert worker_pids() == pid


def test_workers_are_recycled_after_their_jobs(fresh_workers: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "MAX_JOBS", 2)
    pids = []
    for _ in range(3):
        emit_object_isolated(add_one_ir(), machine())
        pids.append(tuple(worker_pids()))
    # the first worker ends after its second job; the third starts another
    assert pids[1] == () and len(pids[0]) == len(pids[2]) == 1 and pids[0] != pids[2]


def test_an_idle_worker_exits_and_the_next_job_starts_another(
        fresh_workers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "IDLE_SECONDS", 0.3)
    emit_object_isolated(add_one_ir(), machine())
    [first] = worker_module._idle
    deadline = time.monotonic() + 20
    while first.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.proc.returncode == 0
    assert emit_object_isolated(add_one_ir(), machine())  # its pipe is closed: a new worker
    assert worker_pids() != [first.proc.pid]


def test_in_process_when_asked(fresh_workers: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(worker_module.IN_PROCESS_VAR, "1")
    assert emit_object_isolated(add_one_ir(), machine())
    assert worker_pids() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_with_their_parent() -> None:
    code = textwrap.dedent("""
        import numpy as np, onnx
        from onnx import helper
        import cuvil
        from cuvil.toolchains import llvm
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])], "relu",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        y = cuvil.compile(model).run({"x": np.array([-1, 2, -3, 4], np.float32)})["y"]
        assert list(y) == [0, 2, 0, 4]
        print(*[w.proc.pid for w in llvm._idle])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(worker_module.IN_PROCESS_VAR, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [pid] = map(int, done.stdout.split())
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pid), "the LLVM worker outlived its parent"


def running(pid: int) -> bool:
    """The process exists and is no zombie (a container's init may not reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
