"""Long loops of calls, loads and compiles leave no memory, threads or file descriptors behind
(issue 10). Linux only: the figures come from /proc. Bounds are loose enough for a shared
machine and tight enough to catch a leak of a library, a workspace or a thread per step."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil.runtime._loader import Model

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(width: int = 64) -> object:
    weights = np.random.default_rng(0).standard_normal((width, width)).astype(np.float32)
    w = numpy_helper.from_array(weights, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", width])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def rss_kb() -> int:
    """Resident memory after returning freed heap to the OS, so that only live memory counts."""
    gc.collect()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def pool_threads() -> int:
    """The thread pool's workers (they name themselves); other libraries in the test process
    (OpenMP, onnxruntime) start and end threads of their own."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            count += f.read().strip() == "cuvil-pool"
    return count


def mapped_libraries(name: str) -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if line.rstrip().endswith(name)
                    or line.rstrip().endswith(name + " (deleted)")})


def test_calls_keep_memory_threads_and_descriptors_flat() -> None:
    model = cuvil.compile(tiny_model())
    model.num_threads = 2
    x = np.random.default_rng(1).standard_normal((512, 64)).astype(np.float32)
    out = {"z": np.empty((512, 64), np.float32)}
    for _ in range(300):  # warm: plans, per-thread workspaces, the pool
        model.run({"x": x})
        model.run({"x": x}, out=out)
    before = (rss_kb(), fds(), pool_threads())
    for _ in range(3000):
        model.run({"x": x})
        model.run({"x": x}, out=out)
    after = (rss_kb(), fds(), pool_threads())
    assert after[0] - before[0] < 1024, f"RSS grew by {after[0] - before[0]} KB over 6000 calls"
    assert after[1] == before[1]
    # one pool per process, of at most a worker per CPU beside the caller
    assert after[2] <= max(before[2], (os.cpu_count() or 1) - 1)


def test_dropped_models_unload_their_library(tmp_path: Path) -> None:
    from cuvil.compiler.driver import compile_model

    compiled = compile_model(tiny_model(), "tiny", tmp_path)
    library, signature = compiled.library, compiled.signature
    x = np.ones((8, 64), np.float32)

    def load_copy() -> None:
        folder = tempfile.mkdtemp(prefix="cuvil-leak-")
        try:
            copy = Path(folder) / library.name
            shutil.copyfile(library, copy)
            Model(copy, signature).run({"x": x})
        finally:
            shutil.rmtree(folder)

    for _ in range(3):
        load_copy()
    before = (rss_kb(), fds())
    for _ in range(40):
        load_copy()
    assert rss_kb() - before[0] < 1024
    assert fds() == before[1]
    # the first library of the process stays (its thread pool serves the others), no copy does
    assert mapped_libraries(library.name) <= 2


def small_model() -> object:
    """Quick to compile (no GEMM kernel), so a loop of compiles stays short."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["y"], ["z"])],
        "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 64])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_compiles_release_their_libraries_and_files() -> None:
    model = tiny_model()
    for _ in range(2):
        cuvil.compile(model).run({"x": np.ones((4, 64), np.float32)})
    before = (rss_kb(), fds())
    count = 10
    folders = []
    for _ in range(count):
        compiled = cuvil.compile(model)
        compiled.run({"x": np.ones((4, 64), np.float32)})
        folders.append(Path(compiled._keep_alive.name))  # its build folder, a temporary one
        del compiled
    assert fds() == before[1]
    assert not any(folder.exists() for folder in folders)
    # building the LLVM IR of the GEMM kernel raises the heap's high-water mark over the first
    # ~30 compiles; a library or weights kept per compile would show far more
    grown = rss_kb() - before[0]
    assert grown / count < 1536, f"RSS grew by {grown / count:.0f} KB per compile"


@pytest.mark.slow  # many compiles in a row
def test_a_long_loop_of_compiles_keeps_memory_flat() -> None:
    # LLVM's new pass manager keeps ~90 KB per pipeline run that nothing frees: in this
    # process, 30 compiles grew by ~2.8 MB; LLVM now runs in a worker process
    model = small_model()
    x = np.ones((4, 64), np.float32)
    for _ in range(6):
        cuvil.compile(model).run({"x": x})
    before = (rss_kb(), fds(), threads())
    count = 30
    for _ in range(count):
        cuvil.compile(model).run({"x": x})
    grown = rss_kb() - before[0]
    assert grown < 1024, f"RSS grew by {grown} KB over {count} compiles"
    assert (fds(), threads()) == before[1:]


def test_workers_exit_when_idle_and_the_process_exits_cleanly() -> None:
    code = textwrap.dedent("""
        import os, time, numpy as np, onnx
        import cuvil
        model = cuvil.compile(onnx.load(os.environ["MODEL"]))
        model.num_threads = 2
        model.run({"x": np.ones((4096, 64), np.float32)})
        busy = len(os.listdir("/proc/self/task"))
        for _ in range(50):  # workers exit after about a second without work
            time.sleep(0.1)
            if len(os.listdir("/proc/self/task")) == 1:
                break
        print(busy, len(os.listdir("/proc/self/task")))
        model.run({"x": np.ones((4096, 64), np.float32)})  # the pool starts again
    """)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tiny.onnx"
        path.write_bytes(tiny_model().SerializeToString())
        env = {**os.environ, "MODEL": str(path), "CUVIL_NUM_THREADS": "2",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    busy, idle = map(int, done.stdout.split())
    assert busy >= 2 and idle == 1
