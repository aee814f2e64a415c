"""Memory of a call (cuvil/runtime/_loader.py): the workspace is kept per thread and reused,
a call allocates nothing but its outputs (nothing at all with `out=`), and `out=` writes into
caller arrays after checking them. onnxruntime is the oracle for every output; tracemalloc,
which sees numpy's buffers, measures what a call allocates."""

from __future__ import annotations

import ctypes
import gc
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.compiler.driver import compile_model
from cuvil.config import CompileOptions
from cuvil.runtime._loader import Model

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "models" / "classifier.onnx"
TOL = {"rtol": 1e-4, "atol": 1e-6}
SLACK = 4096  # bytes of Python objects a call may create and drop (lists, small ints, ...)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return compile_model(str(DIGITS), "classifier", tmp_path_factory.mktemp("mem"),
                         CompileOptions(inputs={"image": ("batch", 1, 8, 8)}))


@pytest.fixture
def model(digits: Any) -> Model:
    return Model(digits.library, digits.signature)  # fresh: no workspace yet


@pytest.fixture(scope="module")
def oracle() -> Callable[[np.ndarray], np.ndarray]:
    sess = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"image": x})[0]


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 1, 8, 8), dtype=np.float32)


def workspace_size(digits: Any, batch: int) -> int:
    """The library's own answer, through its C ABI (not the Python caller's formula)."""
    lib = ctypes.CDLL(str(digits.library))
    size = lib.cuvil_classifier_workspace_size
    size.restype, size.argtypes = ctypes.c_int64, [ctypes.c_void_p]
    return int(size((ctypes.c_int64 * 1)(batch)))


@pytest.fixture
def traced() -> Iterator[Callable[[Callable[[], Any]], tuple[Any, int]]]:
    """Run a function; return its result and the most bytes held at once during it beyond
    what was held before (its result included)."""
    tracemalloc.start()

    def measure(f: Callable[[], Any]) -> tuple[Any, int]:
        # a garbage collection inside f would free older objects and hide what f allocated
        # (seen in CI: a peak 21 KB below the new workspace); collect first, then hold it off
        gc.collect()
        gc.disable()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            result = f()
            return result, tracemalloc.get_traced_memory()[1] - before
        finally:
            gc.enable()

    yield measure
    tracemalloc.stop()


def test_workspace_grows_to_the_largest_batch_and_is_reused(model: Model, digits: Any, oracle,
                                                            traced) -> None:
    largest, held = 0, 0  # the largest batch so far and its workspace
    for n in (1, 64, 700, 3, 700, 256, 1, 900, 2, 900):
        x = images(n, seed=n)
        want = oracle(x)
        got, peak = traced(lambda: model(x))  # noqa: B023 (called right here)
        np.testing.assert_allclose(got, want, **TOL)
        ws = workspace_size(digits, n)
        if n > largest:  # grows: the old workspace is freed, a new one allocated
            assert peak >= ws - held + got.nbytes, (n, peak, ws)
            largest, held = n, ws
        else:  # reused: only the output is new
            assert got.nbytes <= peak < got.nbytes + SLACK, (n, peak, ws)
            assert ws > SLACK  # so a fresh workspace could not hide in the slack


def test_a_call_with_out_allocates_nothing(model: Model, oracle, traced) -> None:
    x = images(512)
    buf = np.empty((512, 10), np.float32)
    model(x, out=buf)  # first call: workspace and the plan for this shape
    for _ in range(5):
        got, peak = traced(lambda: model(x, out=buf))
        assert got is buf and peak < SLACK, peak
        result, peak = traced(lambda: model.run({"image": x}, out={"probabilities": buf}))
        assert result["probabilities"] is buf and peak < SLACK, peak
    np.testing.assert_allclose(buf, oracle(x), **TOL)
    got, peak = traced(lambda: model(x))  # without out=: the output, nothing more
    assert got.nbytes <= peak < got.nbytes + SLACK


def test_concurrent_calls_with_growing_and_shrinking_batches(model: Model, oracle) -> None:
    # 8 threads, each with its own sequence of batch sizes, half of them writing into out=
    sizes = [(1, 700, 7), (256, 33, 900), (64, 5, 512), (3, 128, 1), (700, 2, 64),
             (9, 300, 17), (512, 1, 256), (40, 800, 4)]
    inputs = {n: images(n, seed=n) for s in sizes for n in s}
    expected = {n: oracle(x) for n, x in inputs.items()}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            bufs = {n: np.empty((n, 10), np.float32) for n in sizes[i]}
            for _ in range(10):
                for n in sizes[i]:
                    got = model(inputs[n], out=bufs[n]) if i % 2 else model(inputs[n])
                    np.testing.assert_allclose(got, expected[n], **TOL)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_out_is_filled_and_returned(model: Model, oracle) -> None:
    x = images(6)
    want = oracle(x)
    buf = np.full((6, 10), np.nan, np.float32)
    assert model(x, out=buf) is buf
    np.testing.assert_allclose(buf, want, **TOL)
    for out in ((np.empty((6, 10), np.float32),), [np.empty((6, 10), np.float32)], [None]):
        got = model(image=x, out=out)
        assert out[0] is None or got is out[0]
        np.testing.assert_allclose(got, want, **TOL)
    inner = np.zeros((8, 10), np.float32)[1:7]  # a contiguous slice of a bigger array
    assert model.run({"image": x}, out={"probabilities": inner})["probabilities"] is inner
    np.testing.assert_allclose(inner, want, **TOL)


def _misaligned(shape: tuple[int, ...]) -> np.ndarray:
    raw = np.zeros(int(np.prod(shape)) * 4 + 1, np.uint8)
    return raw[1:].view(np.float32).reshape(shape)


@pytest.mark.parametrize(("make_out", "error", "words"), [
    (lambda x: np.empty((4, 10), np.float64), ValueError, ["dtype float32", "float64"]),
    (lambda x: np.empty((5, 10), np.float32), ValueError, ["shape [4, 10]", "[5, 10]"]),
    (lambda x: np.empty((10, 4), np.float32).T, ValueError, ["C-contiguous"]),
    (lambda x: np.empty((4, 20), np.float32)[:, ::2], ValueError, ["C-contiguous"]),
    (lambda x: _misaligned((4, 10)), ValueError, ["aligned"]),
    (lambda x: np.broadcast_to(np.float32(0), (4, 10)), ValueError, ["read-only"]),
    (lambda x: x.reshape(-1)[:40].reshape(4, 10), ValueError, ["shares memory", "'image'"]),
    (lambda x: [[0.0] * 10] * 4, TypeError, ["numpy array", "list"]),
])
def test_bad_out_raises_naming_the_output_and_the_fix(model: Model, oracle, make_out, error,
                                                      words) -> None:
    x = images(4)
    out = make_out(x)
    calls = [lambda: model(x, out=(out,)), lambda: model.run({"image": x},
                                                             out={"probabilities": out})]
    if isinstance(out, np.ndarray):  # a bare non-array is a bad container: the next test
        calls.append(lambda: model(x, out=out))
    for call in calls:
        with pytest.raises(error) as info:
            call()
        for w in ["'probabilities'", *words]:
            assert w in str(info.value), (w, str(info.value))
    np.testing.assert_allclose(model(x), oracle(x), **TOL)  # the model still works


def test_bad_out_containers(model: Model) -> None:
    x = images(2)
    buf = np.empty((2, 10), np.float32)
    with pytest.raises(TypeError, match="out must be an array or a tuple of one array"):
        model(x, out=(buf, buf))
    with pytest.raises(ValueError, match=r"unknown outputs \['nope'\]"):
        model.run({"image": x}, out={"nope": buf})
    with pytest.raises(TypeError, match="dict of output name"):
        model.run({"image": x}, out=[buf])  # type: ignore[arg-type]


# -- models with two outputs ----------------------------------------------------------------
def _two_outputs(second: str) -> onnx.ModelProto:
    """relu = Relu(x @ w), sum = x @ w + `second` (an input's name)."""
    w = numpy_helper.from_array(
        np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Relu", ["h"], ["relu"]),
         helper.make_node("Add", ["h", second], ["sum"])],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16]),
                helper.make_tensor_value_info(second, TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("relu", TensorProto.FLOAT, ["n", 8]),
         helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["n", 8])],
        initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _compile_two(tmp: Path, second: str) -> tuple[Model, Any]:
    path = tmp / f"two_{second}.onnx"
    onnx.save(_two_outputs(second), path)
    compiled = compile_model(str(path), "two", tmp / second)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return Model(compiled.library, compiled.signature), sess


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, Any]:
    return _compile_two(tmp_path_factory.mktemp("two"), "b")


def feeds_of_two(n: int, second: str = "b") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"x": rng.standard_normal((n, 16)).astype(np.float32),
            second: rng.standard_normal((n, 8)).astype(np.float32)}


def test_out_for_several_outputs(two: tuple[Model, Any]) -> None:
    model, sess = two
    feeds = feeds_of_two(5)
    want = sess.run(None, feeds)
    relu, total = np.empty((5, 8), np.float32), np.empty((5, 8), np.float32)
    got = model(feeds["x"], feeds["b"], out=(relu, total))
    assert got[0] is relu and got[1] is total
    got = model(**feeds, out=[None, total])  # None: allocate that one
    assert got[0] is not relu and got[1] is total
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **TOL)
    relu[:] = total[:] = np.nan
    result = model.run(feeds, out={"relu": relu, "sum": total})
    assert result["relu"] is relu and result["sum"] is total
    only = model.run(feeds, out={"sum": total})  # a subset: the rest allocated
    assert only["sum"] is total and only["relu"] is not relu
    for g, w in [(relu, want[0]), (total, want[1]), (only["relu"], want[0])]:
        np.testing.assert_allclose(g, w, **TOL)
    with pytest.raises(TypeError, match=r"a tuple or list of 2 arrays .*got a tuple of 1"):
        model(**feeds, out=(relu,))
    with pytest.raises(TypeError, match="got ndarray"):
        model(**feeds, out=relu)
    with pytest.raises(ValueError, match="out for output 'sum' shares memory with out for "
                                         "output 'relu'"):
        model(**feeds, out=(relu, relu))
    with pytest.raises(ValueError, match="'sum' shares memory with input 'b'"):
        model.run(feeds, out={"sum": feeds["b"]})


def test_an_input_named_out_keeps_its_keyword(tmp_path: Path) -> None:
    model, sess = _compile_two(tmp_path, "out")
    feeds = feeds_of_two(3, "out")
    want = sess.run(None, feeds)
    for got in (model(feeds["x"], out=feeds["out"]), model(**feeds)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, **TOL)
    total = np.empty((3, 8), np.float32)
    assert model.run(feeds, out={"sum": total})["sum"] is total  # run's out= for outputs
    np.testing.assert_allclose(total, want[1], **TOL)
