"""The LLVM work of a compile, in parallel: each CPU copy's model module and the kernels it
calls (kernels/objects.py), compiled to object files.

LLVM runs in worker processes (toolchains/llvm.py); here a pool of threads, one per CPU this
process may use, keeps that many workers busy at once, while the compile goes on generating
the next copy's IR. The pool lives as long as the compile: a process that compiled once keeps
no threads.

A kernel's object code depends only on its symbol (which carries a digest of its target, see
driver.kernel_tag) and on cuvil's code, so each is compiled once per process and, with a
`KernelCache`, once per cuvil version for every build sharing that cache.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cuvil.compiler.kernels.objects import KernelRequest, kernel_module_ir
from cuvil.toolchains import llvm

__all__ = ["KernelCache", "ObjectJobs", "parallel_jobs"]


class KernelCache(Protocol):
    """Kernel object code kept between processes, by kernel symbol (the build backend's
    compile cache provides one, keyed also by cuvil's code)."""

    def load(self, symbol: str) -> bytes | None: ...

    def store(self, symbol: str, code: bytes) -> None: ...


def parallel_jobs() -> int:
    """How many LLVM jobs run at once: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


#: kernel object code of this process: (symbol, machine) -> its job's (code, from the cache)
_kernels: dict[tuple[Any, ...], Future[tuple[bytes, bool]]] = {}
_kernels_lock = threading.Lock()


def _forget_jobs_after_fork() -> None:
    # the parent's threads are not the child's: a job they were running never ends here
    global _kernels, _kernels_lock
    _kernels = {key: f for key, f in _kernels.items() if f.done()}
    _kernels_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_jobs_after_fork)

#: bytes of kernel code kept (a kernel object is some 10-100 KB)
KERNEL_CACHE_BYTES = 256 << 20


@dataclass
class ObjectJobs:
    """The object files one compile waits for. `model` and `kernel` start jobs in a group
    (an arch); `wait` writes the files, returns their paths by group and counts what the jobs
    did."""

    kernel_cache: KernelCache | None = None
    compiled: int = 0  # modules LLVM compiled
    cached: int = 0  # kernels read from the kernel cache
    reused: int = 0  # kernels this process had compiled (or was compiling) already
    _pending: list[tuple[str, Path, Future[tuple[bytes, bool]]]] = field(default_factory=list)
    _started: list[Future[tuple[bytes, bool]]] = field(default_factory=list)  # by this compile
    _pool: ThreadPoolExecutor | None = None

    def _submit(self, job: Callable[..., tuple[bytes, bool]],
                *args: Any) -> Future[tuple[bytes, bool]]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(parallel_jobs(), thread_name_prefix="cuvil-llvm")
        return self._pool.submit(job, *args)

    def model(self, group: str, path: Path, ir_text: str, machine: Mapping[str, Any]) -> None:
        future = self._submit(lambda: (llvm.emit_object_isolated(ir_text, dict(machine)), False))
        self._pending.append((group, path, future))
        self._started.append(future)

    def kernel(self, group: str, path: Path, request: KernelRequest, triple: str,
               data_layout: str, features: str, machine: Mapping[str, Any]) -> None:
        key = (request.symbol, tuple(sorted(machine.items())))
        with _kernels_lock:
            future = _kernels.get(key)
            if future is None or (future.done() and future.exception() is not None):
                _trim()
                future = _kernels[key] = self._submit(
                    _kernel_code, request, triple, data_layout, features, dict(machine),
                    self.kernel_cache)
                self._started.append(future)
            else:
                self.reused += 1
        self._pending.append((group, path, future))

    def wait(self) -> dict[str, list[Path]]:
        """Every object file written, by group, in the order the jobs started; the first
        job's error raised once all have ended."""
        for _, _, future in self._pending:
            future.exception()  # all finished before any file is written or error raised
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        paths: dict[str, list[Path]] = {}
        for group, path, future in self._pending:
            path.write_bytes(future.result()[0])
            paths.setdefault(group, []).append(path)
        for future in self._started:
            from_cache = future.result()[1]
            self.cached += from_cache
            self.compiled += not from_cache
        self._pending.clear()
        self._started.clear()
        return paths


def _kernel_code(request: KernelRequest, triple: str, data_layout: str, features: str,
                 machine: dict[str, Any], cache: KernelCache | None) -> tuple[bytes, bool]:
    if cache is not None:
        code = cache.load(request.symbol)
        if code is not None:
            return code, True
    code = llvm.emit_object_isolated(kernel_module_ir(request, triple, data_layout, features),
                                     machine, request.optimize)
    if cache is not None:
        cache.store(request.symbol, code)
    return code, False


def _trim() -> None:
    """Drop finished kernels once they hold more than KERNEL_CACHE_BYTES (caller holds the
    lock)."""
    done = [f for f in _kernels.values() if f.done() and f.exception() is None]
    if sum(len(f.result()[0]) for f in done) > KERNEL_CACHE_BYTES:
        for key in [k for k, f in _kernels.items() if f.done()]:
            del _kernels[key]
