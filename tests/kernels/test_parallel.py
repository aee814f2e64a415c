"""The runtime thread pool behind `Emitter.parallel_loop`, linked and called for real.

A tiny hand-built module doubles a vector inside a parallel loop; numpy is the oracle. It is
called from several Python threads at once (the pool must let concurrent callers through),
with the pool disabled, in a forked child (whose pool threads do not survive fork), and
unloaded while its workers wait for work (they must be gone before the code is unmapped).
`parallel_threads` must give the pool's size outside loops and 1 inside a loop's body.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir

from cuvil.compiler.codegen.module import hide_declarations
from cuvil.compiler.driver import RUNTIME_SOURCE
from cuvil.compiler.ir import TensorType, Value, symbol
from cuvil.compiler.kernels.emitter import I32, PTR, Emitter
from cuvil.compiler.kernels.target import KernelTarget
from cuvil.toolchains.llvm import emit_object


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cuvil.toolchains import get_target, target_machine, zig

    target = get_target(None)
    arch = target.arches[0]
    tm = target_machine(arch)
    module = ir.Module("par")
    module.triple = arch.llvm_triple
    module.data_layout = str(tm.target_data)
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, PTR]), "cuvil_par_double")
    n = symbol("n")
    x = Value("x", TensorType(np.float32, (n, 3)))
    y = Value("y", TensorType(np.float32, (n, 3)))
    k = Emitter(module, fn, fn.args[2], ["n"], {x: fn.args[0], y: fn.args[1]},
                KernelTarget(module.triple))
    with k.parallel_loop(n, cost=1 << 20) as i:
        xv, yv = k.view(x), k.view(y)
        with k.loop(3) as j:
            v = k.load(xv, [i, j])
            k.store(yv, [i, j], k.b.fadd(v, v))
    k.b.ret(ir.Constant(I32, 0))
    # threads[0]: what a loop started outside any loop would get; threads[1 + i]: inside one
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, PTR]), "cuvil_par_threads")
    t = Value("t", TensorType(np.int64, (n + 1,)))
    k = Emitter(module, fn, fn.args[2], ["n"], {t: fn.args[0]}, KernelTarget(module.triple))
    k.store(k.view(t), [k.i64(0)], k.parallel_threads())
    with k.parallel_loop(n, cost=1 << 20) as i:
        k.store(k.view(t), [k.b.add(i, k.i64(1))], k.parallel_threads())
    k.b.ret(ir.Constant(I32, 0))
    out = tmp_path_factory.mktemp("par")
    obj = out / "par.o"
    obj.write_bytes(emit_object(hide_declarations(str(module), "unused"), tm))
    rt = zig.compile_c(RUNTIME_SOURCE, out / "rt.o", arch)
    return zig.link_library(target, [obj, rt], out / "_par.so", libs=("m", "pthread"))


def call(lib: ctypes.CDLL, x: np.ndarray) -> np.ndarray:
    y = np.empty_like(x)
    dims = (ctypes.c_int64 * 1)(x.shape[0])
    fn = lib.cuvil_par_double
    fn.argtypes = [ctypes.c_void_p] * 3
    assert fn(x.ctypes.data, y.ctypes.data, dims) == 0
    return y


def test_parallel_loop_matches_numpy(library: Path) -> None:
    lib = ctypes.CDLL(str(library))
    for rows in (1, 2, 7, 1000, 100_003):
        x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        np.testing.assert_array_equal(call(lib, x), x * 2)


def test_concurrent_callers(library: Path) -> None:
    lib = ctypes.CDLL(str(library))
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(20):
                x = rng.standard_normal((int(rng.integers(1, 50_000)), 3)).astype(np.float32)
                np.testing.assert_array_equal(call(lib, x), x * 2)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("threads", ["1", "3"])
def test_thread_count_and_fork(library: Path, threads: str) -> None:
    script = f"""
import ctypes, os, sys
import numpy as np
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_parallel import call
lib = ctypes.CDLL({str(library)!r})
x = np.arange(300_000, dtype=np.float32).reshape(-1, 3)
assert (call(lib, x) == 2 * x).all()
pid = os.fork()
if pid == 0:
    ok = (call(lib, x) == 2 * x).all()
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.WEXITSTATUS(status) == 0, status
print("ok")
"""
    env = {**os.environ, "CUVIL_NUM_THREADS": threads}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_unloading_the_library_stops_its_workers(library: Path) -> None:
    script = f"""
import _ctypes, ctypes, os, sys, time
import numpy as np
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_parallel import call
tasks = lambda: len(os.listdir("/proc/self/task"))
base = tasks()
lib = ctypes.CDLL({str(library)!r})
x = np.arange(300_000, dtype=np.float32).reshape(-1, 3)
assert (call(lib, x) == 2 * x).all()
started = tasks() - base
_ctypes.dlclose(lib._handle)
left = tasks() - base
time.sleep(1.5)  # a worker still waiting would wake into unmapped code
print(started, left)
"""
    env = {**os.environ, "CUVIL_NUM_THREADS": "3"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["2", "0"]


def loop_threads(lib: ctypes.CDLL, n: int) -> list[int]:
    out = np.zeros(n + 1, np.int64)
    dims = (ctypes.c_int64 * 1)(n)
    fn = lib.cuvil_par_threads
    fn.argtypes = [ctypes.c_void_p] * 3
    assert fn(out.ctypes.data, None, dims) == 0
    return out.tolist()


@pytest.mark.parametrize("threads", ["1", "3"])
def test_parallel_threads_is_the_pool_size_outside_loops_and_one_inside(library: Path,
                                                                        threads: str) -> None:
    script = f"""
import ctypes, sys, threading
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_parallel import call, loop_threads
import numpy as np
lib = ctypes.CDLL({str(library)!r})
seen = loop_threads(lib, 50)
assert seen == [{threads}] + [1] * 50, seen
# from several threads at once: a caller that meets the pool busy is told 1, never more
# than the pool has, and the loops still compute right
outside, errors = set(), []
def work():
    try:
        for _ in range(50):
            got = loop_threads(lib, 20)
            outside.add(got[0])
            assert got[1:] == [1] * 20, got
            x = np.arange(30_000, dtype=np.float32).reshape(-1, 3)
            assert (call(lib, x) == 2 * x).all()
    except BaseException as exc:
        errors.append(exc)
workers = [threading.Thread(target=work) for _ in range(4)]
for w in workers: w.start()
for w in workers: w.join()
assert not errors, errors[0]
assert outside <= {{1, {threads}}}, outside
print("ok")
"""
    env = {**os.environ, "CUVIL_NUM_THREADS": threads}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
