"""LLVM's optimizer and code generator: LLVM IR text in, object code out.

`emit_object` runs them in this process. `emit_object_isolated` runs them in a worker child
process, which the compile driver uses: LLVM's new pass manager, as llvmlite drives it, keeps
~80-200 KB per pipeline run that nothing frees (building the pipeline alone keeps ~25 KB), so a
process compiling model after model grew by ~0.5 MB a compile. A worker serves one compile at
a time, exits after `MAX_JOBS` jobs (taking what LLVM kept with it) or `IDLE_SECONDS` without
work, and at the latest when its parent does (its stdin closes). Starting one costs a fraction
of a second (0.8 s on a loaded 2-core host), once per process while compiles keep coming.

This module imports only the standard library and llvmlite, and a worker loads only it and
cuvil.toolchains (not the compiler, onnx or numpy), so that it starts quickly.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any

__all__ = ["IDLE_SECONDS", "MAX_JOBS", "create_target_machine", "emit_object",
           "emit_object_isolated"]

#: jobs (one per CPU variant) a worker runs before it exits, bounding what LLVM keeps in it
MAX_JOBS = 200
#: a worker with nothing to do for this long exits
IDLE_SECONDS = 30.0
#: set to 1 to run LLVM in the compiling process, as `emit_object` does
IN_PROCESS_VAR = "CUVIL_LLVM_IN_PROCESS"

_init_lock = threading.Lock()
_initialized = False


def _llvm() -> Any:
    global _initialized
    import llvmlite.binding as llvm

    if not _initialized:
        with _init_lock:
            if not _initialized:
                llvm.initialize_all_targets()
                llvm.initialize_all_asmprinters()
                _initialized = True
    return llvm


def create_target_machine(triple: str, cpu: str, features: str, opt_level: int) -> Any:
    """An llvmlite TargetMachine for position-independent code; RuntimeError for a triple
    LLVM does not know."""
    target = _llvm().Target.from_triple(triple)
    return target.create_target_machine(cpu=cpu, features=features, opt=opt_level, reloc="pic",
                                        codemodel="default")


def emit_object(ir_text: str, target_machine: Any, opt_level: int = 3,
                optimize: bool = True) -> bytes:
    """Optimize the module for the target machine and return its object code (here).
    `optimize=False` skips LLVM's IR pipeline (the code generator still works at the target
    machine's level): for IR that is already as it should run, such as hand-vectorized kernels.
    LLVM's context is global: one thread at a time runs LLVM in a process."""
    llvm = _llvm()
    with _in_process_lock:
        mod = llvm.parse_assembly(ir_text)
        mod.verify()
        if optimize:
            pto = llvm.PipelineTuningOptions(speed_level=opt_level)
            pto.loop_vectorization = opt_level >= 2
            pto.slp_vectorization = opt_level >= 2
            pb = llvm.create_pass_builder(target_machine, pto)
            pb.getModulePassManager().run(mod, pb)
        return bytes(target_machine.emit_object(mod))


_in_process_lock = threading.Lock()


def emit_object_isolated(ir_text: str, machine: dict[str, Any], optimize: bool = True) -> bytes:
    """`emit_object` in a worker process; `machine` holds `create_target_machine`'s arguments.
    An error LLVM raises there is raised here as a RuntimeError with LLVM's message. Calls
    from several threads run in parallel, each in a worker of its own."""
    global _unavailable
    for attempt in range(2):
        worker = None
        if not _unavailable and os.environ.get(IN_PROCESS_VAR) != "1":
            worker = _take_worker()
            _unavailable = worker is None  # no Python to start here (an embedding host)
        if worker is None:
            return emit_object(ir_text, create_target_machine(**machine), machine["opt_level"],
                               optimize)
        try:
            reply = worker.request((ir_text, machine, optimize))
        except _WorkerGone as gone:
            worker.discard()
            if attempt or not gone.idle:  # it crashed: say so; it exited as idle: a new one
                raise RuntimeError(f"LLVM's worker process failed: {gone}") from None
            continue
        except BaseException:  # interrupted mid-job: its reply would confuse the next job
            worker.discard()
            raise
        _give_back(worker)
        status, value = reply
        if status == "error":
            raise RuntimeError(value)
        return value
    raise AssertionError("unreachable")


#: a worker could not start once: LLVM runs in this process from then on
_unavailable = False


class _WorkerGone(Exception):
    def __init__(self, message: str, idle: bool) -> None:
        super().__init__(message)
        self.idle = idle


class _Worker:
    def __init__(self) -> None:
        # the parent's sys.path, so the worker finds llvmlite (and this module) as we do
        boot = (f"import sys; sys.path[:] = {sys.path!r}; "
                f"from cuvil.toolchains.llvm import _serve; _serve({MAX_JOBS}, {IDLE_SECONDS})")
        self.proc = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        self.pid = os.getpid()
        self.jobs = 0
        self.max_jobs = MAX_JOBS
        assert self.proc.stdout is not None
        try:
            ready = _receive(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            ready = None
        if ready != "ready":
            self.discard()
            raise _WorkerGone(f"it did not start (exit status {self.proc.returncode})", idle=False)

    def request(self, message: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _send(self.proc.stdin, message)
            reply = _receive(self.proc.stdout)
        except (BrokenPipeError, EOFError, OSError) as exc:
            code = self.proc.wait()
            raise _WorkerGone(f"exit status {code} ({type(exc).__name__})",
                              idle=code == 0 and self.jobs > 0) from None
        self.jobs += 1
        return reply

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None and self.jobs < self.max_jobs

    def discard(self) -> None:
        if self.pid != os.getpid():
            return  # a forked child's copy: the worker belongs to the parent
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take_worker() -> _Worker | None:
    """An idle worker, or a new one (concurrent compiles each get their own); None when no
    worker can start."""
    with _idle_lock:
        while _idle:
            worker = _idle.pop()
            if worker.alive():
                return worker
            worker.discard()
    if not sys.executable:
        return None
    try:
        return _Worker()
    except (OSError, _WorkerGone):
        return None


def _give_back(worker: _Worker) -> None:
    if not worker.alive():
        worker.discard()
        return
    with _idle_lock:
        _idle.append(worker)


@atexit.register
def _stop_workers() -> None:
    """End idle workers with the process (an EOF on their stdin), without waiting long."""
    with _idle_lock:
        workers = [w for w in _idle if w.pid == os.getpid()]
        _idle.clear()
    for worker in workers:
        try:
            worker.proc.stdin.close()  # type: ignore[union-attr]
            worker.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            pass
        worker.discard()


def _forget_workers_after_fork() -> None:
    # the pipes are shared with the parent, which keeps using its workers
    global _idle, _idle_lock
    _idle, _idle_lock = [], threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers_after_fork)


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("no reply")
    (size,) = struct.unpack("<Q", header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a partial reply")
    return pickle.loads(data)


def _serve(max_jobs: int, idle_seconds: float) -> None:
    """The worker's loop: requests on stdin, replies on stdout, until EOF, `idle_seconds`
    without a request or `max_jobs` jobs. Anything else writing to stdout (LLVM, a library)
    goes to stderr instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _llvm()
    _send(replies, "ready")
    machines: dict[tuple[Any, ...], Any] = {}
    for _ in range(max_jobs):
        if sys.platform != "win32":  # select takes no pipes there: no idle exit
            ready, _, _ = select.select([requests], [], [], idle_seconds)
            if not ready:
                return
        try:
            ir_text, machine, optimize = _receive(requests)
        except EOFError:
            return
        try:
            key = tuple(sorted(machine.items()))
            if key not in machines:
                machines[key] = create_target_machine(**machine)
            reply: tuple[str, Any] = ("ok", emit_object(ir_text, machines[key],
                                                        machine["opt_level"], optimize))
        except Exception as exc:  # LLVM's errors (a module that does not verify...)
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _send(replies, reply)
