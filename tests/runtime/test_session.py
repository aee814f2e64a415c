"""`Model.session()` (cuvil/runtime/_cuvil_session.py) against onnxruntime's InferenceSession on
the same ONNX file: outputs, names, shapes, types, metadata and the errors of bad calls."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.compiler.driver import compile_model
from cuvil.runtime import ManifestError, ModelSignature, abi_checksum
from cuvil.runtime._loader import Model

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _multi_output_model() -> onnx.ModelProto:
    """A symbolic batch shared by two inputs, an int64 input, an input dim the file leaves
    unnamed, four outputs (one sized by NonZero, one declared without names), and metadata."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
             helper.make_node("Relu", ["y"], ["r"]),
             helper.make_node("Cast", ["idx"], ["idx_f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["r", "idx_f"], ["t"]),
             helper.make_node("Add", ["t", "x2"], ["s"]),
             helper.make_node("NonZero", ["r"], ["nz"]),
             helper.make_node("Neg", ["z"], ["zn"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "multi", [vi("x", TensorProto.FLOAT, ["batch", 4]),
                         vi("idx", TensorProto.INT64, [1, 3]),
                         vi("z", TensorProto.FLOAT, [None]),
                         vi("x2", TensorProto.FLOAT, ["batch", 3])],
        [vi("s", TensorProto.FLOAT, ["batch", 3]), vi("nz", TensorProto.INT64, [2, None]),
         vi("r", TensorProto.FLOAT, [None, 3]), vi("zn", TensorProto.FLOAT, [None])], [w],
        doc_string="the graph's doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="cuvil-tests", producer_version="0.1",
                              doc_string="a model with several outputs", domain="ai.cuvil.test",
                              model_version=7)
    helper.set_model_props(model, {"author": "tests", "license": "MIT"})
    return model


def _plain_model() -> onnx.ModelProto:
    """Dim names that are no identifiers ("batch size", "?"), no version, no metadata."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((5, 2)).astype(np.float32), "W")
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "W"], ["m"]), helper.make_node("Sigmoid", ["m"], ["p"])],
        "plain", [vi("a", TensorProto.FLOAT, ["batch size", "?", 5])],
        [vi("p", TensorProto.FLOAT, ["batch size", "?", 2])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {"multi": _multi_output_model, "plain": _plain_model}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    folder = tmp_path_factory.mktemp("session")
    result = {}
    for name, make in MODELS.items():
        path = folder / f"{name}.onnx"
        onnx.save(make(), path)
        result[name] = (compile_model(str(path), name, folder / name), path)
    return result


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest, compiled: dict[str, tuple[Any, Path]]) -> tuple[Any, Any]:
    """(cuvil's session, onnxruntime's) on one model."""
    model, path = compiled[request.param]
    ours = Model(model.library, model.signature).session()
    return ours, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def multi(compiled: dict[str, tuple[Any, Path]]) -> tuple[Any, Any]:
    model, path = compiled["multi"]
    return (Model(model.library, model.signature).session(),
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]))


def feed(batch: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, 4)).astype(np.float32),
            "idx": rng.integers(-5, 5, (1, 3)),
            "z": rng.standard_normal(5).astype(np.float32),
            "x2": rng.standard_normal((batch, 3)).astype(np.float32)}


def described(args: list[Any]) -> list[tuple[str, Any, str]]:
    return [(a.name, a.shape, a.type) for a in args]


def test_inputs_and_outputs_are_described_as_onnxruntime_describes_them(pair: tuple[Any, Any]) -> None:
    ours, theirs = pair
    assert described(ours.get_inputs()) == described(theirs.get_inputs())
    assert described(ours.get_outputs()) == described(theirs.get_outputs())
    assert str(ours.get_inputs()[0]) == str(theirs.get_inputs()[0])  # NodeArg(name=..., ...)


def test_model_metadata_is_onnxruntime_s(pair: tuple[Any, Any]) -> None:
    ours, theirs = pair
    mine, its = ours.get_modelmeta(), theirs.get_modelmeta()
    for key in ("producer_name", "graph_name", "domain", "description", "graph_description",
                "version", "custom_metadata_map"):
        assert getattr(mine, key) == getattr(its, key), key


def test_providers_are_onnxruntime_s_cpu_provider(pair: tuple[Any, Any]) -> None:
    ours, theirs = pair
    assert ours.get_providers() == theirs.get_providers() == ["CPUExecutionProvider"]
    assert ours.get_provider_options() == theirs.get_provider_options()


@pytest.mark.parametrize("names", [None, [], ["s"], ["nz", "s"], ("zn", "r", "s", "nz"), ["r", "r"]])
@pytest.mark.parametrize("batch", [1, 3])
def test_run_returns_the_outputs_asked_for_in_their_order(multi: tuple[Any, Any], names: Any,
                                                          batch: int) -> None:
    ours, theirs = multi
    feeds = feed(batch, seed=batch)
    mine, its = ours.run(names, feeds), theirs.run(names, feeds)
    assert type(mine) is list and len(mine) == len(its)
    for a, b in zip(mine, its):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, **TOL)


def test_run_of_the_plain_model_matches_onnxruntime(compiled: dict[str, tuple[Any, Path]]) -> None:
    model, path = compiled["plain"]
    ours = Model(model.library, model.signature).session()
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    a = np.random.default_rng(2).standard_normal((2, 3, 5)).astype(np.float32)
    np.testing.assert_allclose(ours.run(["p"], {"a": a})[0], theirs.run(["p"], {"a": a})[0], **TOL)


def test_lists_are_converted_to_the_input_s_dtype_as_onnxruntime_does(multi: tuple[Any, Any]) -> None:
    ours, theirs = multi
    feeds: dict[str, Any] = feed(2)
    feeds["idx"] = [[1.7, -2.2, 3.0]]  # floats for an int64 input: both truncate
    feeds["x"] = feeds["x"].tolist()  # Python floats (float64) for a float32 input
    for a, b in zip(ours.run(None, feeds), theirs.run(None, feeds)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, **TOL)


def test_run_options_are_accepted_and_ignored(multi: tuple[Any, Any]) -> None:
    ours, theirs = multi
    options = ort.RunOptions()
    options.log_severity_level = 3
    np.testing.assert_allclose(ours.run(["s"], feed(), options)[0],
                               theirs.run(["s"], feed(), options)[0], **TOL)


def test_a_byte_swapped_array_is_read_by_its_values(multi: tuple[Any, Any]) -> None:
    # onnxruntime reads the bytes as native (a wrong answer); the values are what count
    ours, theirs = multi
    feeds = feed(2)
    swapped = {**feeds, "x": feeds["x"].astype(">f4")}
    np.testing.assert_allclose(ours.run(["s"], swapped)[0], theirs.run(["s"], feeds)[0], **TOL)


def test_num_threads_caps_the_calls_and_is_checked(compiled: dict[str, tuple[Any, Path]],
                                                   multi: tuple[Any, Any]) -> None:
    model, _ = compiled["multi"]
    one = Model(model.library, model.signature).session(num_threads=1)
    np.testing.assert_allclose(one.run(["s"], feed())[0], multi[1].run(["s"], feed())[0], **TOL)
    with pytest.raises(ValueError, match=r"session\(num_threads\) must be None or an int >= 1"):
        Model(model.library, model.signature).session(num_threads=0)


def _wrong(**change: Any) -> Callable[[], tuple[Any, dict[str, Any]]]:
    """A call with the feed of `feed()` changed: None drops an input."""
    def make() -> tuple[Any, dict[str, Any]]:
        feeds: dict[str, Any] = feed()
        for key, value in change.items():
            if value is None:
                del feeds[key]
            else:
                feeds[key] = value(feeds) if callable(value) else value
        return None, feeds
    return make


# (what is wrong, the call, does our message start with onnxruntime's own text, what ours names)
ERRORS: list[tuple[str, Any, bool, list[str]]] = [
    ("unknown output", lambda: (["s", "nope"], feed()), True, ["'s', 'nz', 'r', 'zn'"]),
    ("missing input", _wrong(idx=None, z=None), True, ["'x', 'idx', 'z', 'x2'"]),
    ("unknown input", _wrong(q=np.zeros(2, np.float32)), True, ["'x', 'idx', 'z', 'x2'"]),
    ("float64 for float32", _wrong(x=lambda f: f["x"].astype(np.float64)), True,
     ["'x'", ".astype(np.float32)"]),
    ("int32 for int64", _wrong(idx=lambda f: f["idx"].astype(np.int32)), True,
     ["'idx'", ".astype(np.int64)"]),
    ("rank", _wrong(x=lambda f: f["x"][None]), True, ["float32[batch, 4]", "[1, 3, 4]"]),
    ("fixed dim", _wrong(idx=np.zeros((1, 2), np.int64)), True, ["int64[1, 3]", "[1, 2]"]),
    ("several fixed dims", _wrong(idx=np.zeros((2, 2), np.int64)), True, ["[2, 2]"]),
    ("a Python float", _wrong(z=1.5), True, ["np.asarray(value, dtype=np.float32)", "'z'"]),
    ("a numpy scalar", _wrong(z=np.float32(1.5)), True, ["np.asarray"]),
    ("a tuple", _wrong(z=(1.0, 2.0)), True, ["np.asarray"]),
    ("batch differs between inputs", _wrong(x2=np.zeros((2, 3), np.float32)), False,
     ["'x2'", "batch"]),
    ("a string as output_names", lambda: ("s", feed()), False, ["output_names"]),
]


@pytest.mark.parametrize(("what", "call", "same_text", "names"), ERRORS, ids=[e[0] for e in ERRORS])
def test_a_bad_call_raises_what_onnxruntime_raises(multi: tuple[Any, Any], what: str, call: Any,
                                                   same_text: bool, names: list[str]) -> None:
    ours, theirs = multi
    output_names, feeds = call()
    with pytest.raises(Exception) as expected:  # onnxruntime's class is the oracle
        theirs.run(output_names, feeds)
    with pytest.raises(Exception) as got:
        ours.run(output_names, feeds)
    assert type(got.value).__name__ == type(expected.value).__name__, (got.value, expected.value)
    message = str(got.value)
    if same_text:  # code that matches onnxruntime's text keeps working
        assert message.startswith(str(expected.value)), (message, str(expected.value))
    for name in names:
        assert name in message, (name, message)


def test_the_exceptions_are_also_the_builtin_ones_that_fit(multi: tuple[Any, Any]) -> None:
    ours, _ = multi
    with pytest.raises(ValueError, match="INVALID_ARGUMENT"):
        ours.run(["nope"], feed())
    with pytest.raises(RuntimeError, match="FAIL"):
        ours.run(None, {**feed(), "x2": np.zeros((2, 3), np.float32)})


def test_an_input_feed_that_is_no_dict_is_a_type_error(multi: tuple[Any, Any]) -> None:
    with pytest.raises(TypeError, match="input_feed must be a dict"):
        multi[0].run(None, list(feed().values()))


# -- what the manifest records for the session ---------------------------------------------------


def test_the_metadata_and_onnx_shapes_are_outside_the_abi_checksum(
        compiled: dict[str, tuple[Any, Path]]) -> None:
    model, _ = compiled["multi"]
    sig = model.signature
    assert sig["metadata"]["producer_name"] == "cuvil-tests"
    stripped = {k: v for k, v in sig.items() if k != "metadata"}
    for key in ("inputs", "outputs"):
        stripped[key] = [{k: v for k, v in t.items() if k != "onnx_shape"} for t in sig[key]]
    assert abi_checksum(stripped) == abi_checksum(sig) == sig["checksum"]
    # a manifest without them (an older build) loads, and the session names what cuvil knows
    old = Model(model.library, stripped).session()
    assert described(old.get_inputs()) == [("x", ["batch", 4], "tensor(float)"),
                                           ("idx", [1, 3], "tensor(int64)"),
                                           ("z", ["z_0"], "tensor(float)"),
                                           ("x2", ["batch", 3], "tensor(float)")]
    assert old.get_outputs()[1].shape == [2, None]  # the data decides it: no symbol of the model
    assert old.get_modelmeta().graph_name == "multi" and old.get_modelmeta().producer_name == ""


@pytest.mark.parametrize(("change", "error"), [
    (lambda s: s["inputs"][0].update(onnx_shape=["batch"]), r"inputs\[0\]\.onnx_shape: 1 dims"),
    (lambda s: s["inputs"][0].update(onnx_shape=[-1, 4]), r"inputs\[0\]\.onnx_shape\[0\]"),
    (lambda s: s["metadata"].update(version="7"), r"metadata\.version: expected an integer"),
    (lambda s: s["metadata"].update(custom_metadata_map={"k": 1}),
     r"metadata\.custom_metadata_map\.k: expected a string"),
    (lambda s: s.update(metadata=[]), r"metadata: expected an object"),
])
def test_a_malformed_record_is_a_manifest_error_naming_the_key(
        compiled: dict[str, tuple[Any, Path]], change: Any, error: str) -> None:
    import copy

    sig = copy.deepcopy(compiled["multi"][0].signature)
    change(sig)
    with pytest.raises(ManifestError, match=error):
        ModelSignature.from_json(sig, "model")
