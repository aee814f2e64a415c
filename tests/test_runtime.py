"""The generated package's caller (cuvil/runtime/_loader.py) on the example model: input
checks, non-contiguous inputs, concurrent calls, and the ABI checksum refusal at import.
onnxruntime is the oracle for every output."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cuvil.compiler.driver import compile_model
from cuvil.runtime._loader import Model

MODEL = Path(__file__).resolve().parent.parent / "examples" / "digits" / "models" / "classifier.onnx"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory):
    return compile_model(str(MODEL), "classifier", tmp_path_factory.mktemp("rt"),
                         inputs={"image": ["batch", 1, 8, 8]})


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
    (np.zeros((0, 1, 8, 8), np.float32), ["'image'", "dim 0", "batch"]),
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


def test_concurrent_calls_from_many_threads(model: Model, oracle) -> None:
    inputs = [images(n, seed=n) for n in (1, 3, 7, 16, 33, 64, 2, 5)]
    expected = [oracle(x) for x in inputs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(25):
                np.testing.assert_allclose(model(inputs[i]), expected[i], rtol=1e-4, atol=1e-6)
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
