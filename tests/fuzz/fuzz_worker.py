"""A child process that runs fuzz tasks, so that a crash (a segfault in compiled code, an abort
in a native library) fails one example instead of killing the test worker.

The parent sends `(task name, args)` pickled, length-prefixed, on the child's stdin; the child
calls `fuzz_tasks.<task>(*args)` and answers on a private copy of its stdout (fd 1 itself goes to
stderr, so prints from native code cannot corrupt the answers). When the child dies, the parent
raises `WorkerDied` with the signal and the end of the child's stderr, and starts a fresh child
for the next task.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

HERE = Path(__file__).resolve().parent
_HEADER = struct.Struct("<Q")


class WorkerDied(Exception):
    """The child exited or hung while running a task."""


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))


class Worker:
    """The parent's handle on one child; `prefix` runs it under a tool (valgrind)."""

    def __init__(self, prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.prefix = list(prefix)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the worker)

    def _start(self) -> subprocess.Popen[bytes]:
        root = HERE.parent.parent
        env = {**os.environ, **(self.env or {})}
        paths = [str(root), str(HERE), str(root / "tests"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        self.log.seek(0)
        self.log.truncate()
        return subprocess.Popen([*self.prefix, sys.executable, str(Path(__file__))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                env=env, cwd=tempfile.gettempdir())

    def stderr_tail(self, size: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-size:]

    def run(self, task: str, *args: Any, timeout: float = 300) -> Any:
        """The task's result; WorkerDied if the child crashed or took longer than `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _send(proc.stdin, (task, args))  # type: ignore[arg-type]
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            if not ready:
                proc.kill()
                proc.wait()
                raise WorkerDied(f"{task} took over {timeout} s (killed)\n{self.stderr_tail()}")
            status, value = _receive(proc.stdout)  # type: ignore[arg-type]
        except (EOFError, BrokenPipeError):
            code = proc.wait()
            why = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
            raise WorkerDied(f"the child running {task} died: {why}\n{self.stderr_tail()}") from None
        if status == "error":  # the task itself failed: a bug in the harness, not in cuvil
            raise RuntimeError(f"fuzz task {task} failed in the child:\n{value}")
        return value

    def close(self, timeout: float = 300) -> int:
        """End the child; its exit status (valgrind's --error-exitcode shows here)."""
        if self.proc is None:
            return 0
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code


def _serve() -> None:
    import traceback

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else written to stdout lands in the log
    requests = sys.stdin.buffer
    import fuzz_tasks

    while True:
        try:
            task, args = _receive(requests)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", getattr(fuzz_tasks, task)(*args))
        except Exception:
            answer = ("error", traceback.format_exc())
        _send(answers, answer)


if __name__ == "__main__":
    _serve()
