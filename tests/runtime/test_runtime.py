"""The generated package's caller (cuvil/runtime/_loader.py) on the example model: input
checks, non-contiguous inputs, concurrent calls, the ABI checksum refusal at import, and the
one thread pool every loaded model shares (worker threads counted in /proc/self/task of a
fresh process). onnxruntime is the oracle for every output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cuvil.compiler.driver import compile_model
from cuvil.config import CompileOptions
from cuvil.runtime._loader import Model

MODEL = Path(__file__).resolve().parents[2] / "examples" / "digits" / "models" / "classifier.onnx"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory):
    return compile_model(str(MODEL), "classifier", tmp_path_factory.mktemp("rt"),
                         CompileOptions(inputs={"image": ("batch", 1, 8, 8)}))


@pytest.fixture(scope="module")
def model(compiled) -> Model:
    return Model(compiled.library, compiled.signature)


@pytest.fixture(scope="module")
def oracle():
    sess = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"image": np.ascontiguousarray(x)})[0]


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def test_non_contiguous_inputs_are_copied(model: Model, oracle) -> None:
    big = images(12)
    strided = big[::3]  # every third image: not C-contiguous
    assert not strided.flags.c_contiguous
    np.testing.assert_allclose(model(strided), oracle(strided), rtol=1e-4, atol=1e-6)
    transposed = np.ascontiguousarray(images(5).transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    np.testing.assert_allclose(model(transposed), oracle(transposed), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("bad", "words"), [
    (np.zeros((2, 1, 8, 8), np.float64), ["'image'", "float32", "float64"]),
    (np.zeros((1, 8, 8), np.float32), ["'image'", "rank 4", "[1, 8, 8]"]),
    (np.zeros((2, 3, 8, 8), np.float32), ["'image'", "dim 1", "must be 1", "got 3"]),
])
def test_bad_inputs_raise_value_errors_naming_the_input(model: Model, bad, words) -> None:
    with pytest.raises(ValueError) as info:
        model(bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_call_forms(model: Model, oracle) -> None:
    x = images(3)
    want = oracle(x)
    np.testing.assert_allclose(model(image=x), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.run({"image": x})["probabilities"], want, rtol=1e-4,
                               atol=1e-6)
    with pytest.raises(TypeError, match="missing"):
        model()
    with pytest.raises(ValueError, match="unknown inputs"):
        model.run({"image": x, "other": x})


def test_concurrent_calls_from_many_threads(model: Model, compiled, tmp_path: Path,
                                           oracle) -> None:
    # two libraries sharing the pool, one capped at one thread; batches of 64 and more run
    # parallel loops, so callers meet the pool busy and must run inline
    copy = tmp_path / "_copy.so"
    shutil.copy(compiled.library, copy)
    models = [model, Model(copy, compiled.signature, num_threads=1)]
    inputs = [images(n, seed=n) for n in (1, 700, 7, 256, 33, 64, 512, 5)]
    expected = [oracle(x) for x in inputs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(25):
                got = models[i % 2](inputs[i])
                np.testing.assert_allclose(got, expected[i], rtol=1e-4, atol=1e-6)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_checksum_mismatch_refuses_to_load(compiled, tmp_path: Path) -> None:
    library = tmp_path / compiled.library.name
    shutil.copy(compiled.library, library)
    expects_more = {**compiled.signature, "inputs": [
        {**compiled.signature["inputs"][0], "shape": ["batch", 1, 8, 9]}]}
    with pytest.raises(ImportError) as info:
        Model(library, expects_more)
    message = str(info.value)
    assert str(library) in message and "checksum mismatch" in message and "8, 9" in message


def test_a_file_that_is_not_the_models_library_is_refused(compiled, tmp_path: Path) -> None:
    other = {**compiled.signature, "name": "other"}
    with pytest.raises(ImportError, match="has no cuvil_other_abi_checksum"):
        Model(compiled.library, other)


# --------------------------------------------------------------------- the shared pool

_POOL_SCRIPT = """
import json, os, sys, time
import numpy as np
from cuvil.runtime._loader import Model

def workers():
    return len(os.listdir("/proc/self/task")) - base

base = len(os.listdir("/proc/self/task"))
signature = json.load(open(sys.argv[1]))
data = np.load(sys.argv[2])
x, want = data["x"], data["want"]
libraries = sys.argv[3:]
"""


def _run_pool_script(compiled, tmp_path: Path, oracle, copies: int, body: str,
                     threads: int = 4) -> list[str]:
    """Run `body` in a fresh interpreter with `copies` copies of the library (each a library
    of its own to the loader, with its own copy of the pool code); returns its output lines."""
    libraries = []
    for i in range(copies):
        libraries.append(tmp_path / f"_m{i}.so")
        shutil.copy(compiled.library, libraries[-1])
    (tmp_path / "sig.json").write_text(json.dumps(compiled.signature))
    x = images(256, seed=1)
    np.savez(tmp_path / "data.npz", x=x, want=oracle(x))
    env = {**os.environ, "CUVIL_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", _POOL_SCRIPT + body, str(tmp_path / "sig.json"),
                           str(tmp_path / "data.npz"), *map(str, libraries)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_twenty_models_share_one_pool_whose_workers_exit_when_idle(compiled, tmp_path: Path,
                                                                   oracle) -> None:
    out = _run_pool_script(compiled, tmp_path, oracle, 20, """
models = [Model(path, signature) for path in libraries]
for m in models:
    np.testing.assert_allclose(m(x), want, rtol=1e-4, atol=1e-6)
print(workers())
deadline = time.time() + 10
while workers() and time.time() < deadline:
    time.sleep(0.1)
print(workers())
np.testing.assert_allclose(models[7](x), want, rtol=1e-4, atol=1e-6)  # the pool restarts
""")
    peak, idle = map(int, out)
    assert 1 <= peak <= 3, f"{peak} worker threads for 20 models on a pool of 4 threads"
    assert idle == 0, f"{idle} workers still alive after 10 s idle"


def test_num_threads_caps_the_threads_of_one_model(compiled, tmp_path: Path, oracle) -> None:
    out = _run_pool_script(compiled, tmp_path, oracle, 2, """
capped = Model(libraries[0], signature, num_threads=1)
np.testing.assert_allclose(capped(x), want, rtol=1e-4, atol=1e-6)
print(workers())
capped.num_threads = 2
np.testing.assert_allclose(capped(x), want, rtol=1e-4, atol=1e-6)
print(workers())
np.testing.assert_allclose(Model(libraries[1], signature)(x), want, rtol=1e-4, atol=1e-6)
print(workers())
""")
    assert list(map(int, out)) == [0, 1, 3]


def test_num_threads_must_be_a_positive_int(model: Model) -> None:
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match="num_threads"):
            model.num_threads = bad
    model.num_threads = None


def test_process_exits_while_another_thread_runs_the_model(compiled, tmp_path: Path,
                                                           oracle) -> None:
    # the library's destructor stops and joins the workers at exit: it must not wait forever
    # for a job that a daemon thread is still submitting
    out = _run_pool_script(compiled, tmp_path, oracle, 2, """
import threading
models = [Model(path, signature) for path in libraries]
big = np.concatenate([x] * 8)

def spin(m):
    while True:
        m(big)

for m in models:
    threading.Thread(target=spin, args=(m,), daemon=True).start()
time.sleep(0.5)
print("exiting")
""")
    assert out == ["exiting"]


def test_a_big_endian_input_is_converted_not_misread(model: Model, oracle) -> None:
    # onnxruntime reads a big-endian array's bytes as if they were native; cuvil converts it
    # (the same values, losslessly) and must give what onnxruntime gives on the native copy
    x = images(4, seed=3)
    swapped = x.astype(">f4")
    assert swapped.dtype != np.float32 and swapped.dtype.name == "float32"
    np.testing.assert_allclose(model(swapped), oracle(swapped.astype("<f4")), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(model(swapped), model(x))


@pytest.mark.parametrize(("bad", "words"), [
    (np.zeros((2, 1, 8, 8), ">f8"), ["float64 (big-endian)", ".astype(np.float32)"]),
    (np.zeros((2, 1, 8, 8), np.float64), ["got float64;", ".astype(np.float32)"]),
    (np.zeros((2, 1, 8, 8), np.float64).tolist(), ["got a list of 2, which np.asarray makes float64",
                                                   "np.asarray(value, dtype=np.float32)"]),
])
def test_a_wrong_dtype_error_says_how_to_convert(model: Model, bad, words) -> None:
    with pytest.raises(ValueError, match="input 'image' must have dtype float32") as info:
        model(bad)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert "got float32" not in str(info.value)


def test_the_package_runtime_never_executes_manifest_text() -> None:
    """Issue 33: expressions read from `_models.json` (shapes, workspace, constraints, FLOPs) are
    parsed into steps (`_expression`, `_run`), never handed to eval or exec; and they give the
    values Python's arithmetic gives."""
    import ast

    from cuvil.runtime import _loader

    tree = ast.parse(Path(_loader.__file__).read_text())
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec"}, called & {"eval", "exec"}
    env = {"batch": 5, "seq": 7}
    for text, condition in [("batch*3 + seq // 2 - 1", False), ("max(batch, seq, 4) * -2", False),
                            ("min(batch*seq, 100) % 7", False), ("-(batch - seq) + +batch", False),
                            ("batch + 1 == seq and 1 <= batch < seq", True),
                            (" + ".join(["batch"] * 2000), False)]:
        program = _loader._expression(text, frozenset(env), "test", condition=condition)
        assert _loader._run(program, env) == eval(text, {"max": max, "min": min}, env), text
