"""quantize = "int8": config, calibration readers, the QDQ model onnxruntime's quantizer makes,
int8 accuracy on models trained here on scikit-learn's digits, the build backend's part and the
`cuvil inspect --quantization` report.

The oracle is onnxruntime: the float model's own predictions and held-out labels; the int8 model
runs through cuvil's compiled library once cuvil compiles QuantizeLinear/DequantizeLinear, and
through onnxruntime on the QDQ model until then.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from oracle import int8_oracle

import cuvil
import cuvil.build_backend as backend
from cuvil.build_backend.cache import model_key
from cuvil.cli import main
from cuvil.compiler.frontend.calibration import feeds_digest, input_specs, read_calibration
from cuvil.compiler.frontend.quantize import ONNXRUNTIME_REQUIREMENT, QuantizeSettings, quantize_model
from cuvil.compiler.ops import lookup
from cuvil.config import load_project
from cuvil.errors import ConfigError, MissingDependencyError
from cuvil.toolchains import get_target

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "examples" / "digits"
CNN = DIGITS / "models" / "classifier.onnx"
PROJECT = '[project]\nname = "digits-cuvil"\nversion = "1.0.0"\n'
MODEL = '[tool.cuvil.models.classifier]\nsource = "models/classifier.onnx"\n'
# int8 top-1 accuracy may lose at most this much against float32 (issue 12, item 4)
MAX_ACCURACY_LOSS = 0.005


def cuvil_compiles_qdq() -> bool:
    return all(lookup("", op, 13) is not None for op in ("QuantizeLinear", "DequantizeLinear"))


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits example's split (train.load_split: 1347 training, 450 held-out images)."""
    sys.path.insert(0, str(DIGITS))
    try:
        from train import load_split
    finally:
        sys.path.remove(str(DIGITS))
    return load_split()


def tiny_model(batch: int | str = "batch") -> onnx.ModelProto:
    """x float32 [batch, 4] and ids int64 [batch] -> y = relu(x @ W) + ids."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
         helper.make_node("Relu", ["h"], ["r"], name="relu"),
         helper.make_node("Cast", ["ids"], ["idf"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("Unsqueeze", ["idf", "axes"], ["idu"], name="unsqueeze"),
         helper.make_node("Add", ["r", "idu"], ["y"], name="add")],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [batch])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        [w, numpy_helper.from_array(np.array([1], np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def tiny_feeds(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((rows, 4)).astype(np.float32),
            "ids": rng.integers(0, 3, rows).astype(np.int64)}


def specs(batch: int | str = "batch") -> dict:
    return input_specs(tiny_model(batch), None, "tiny")


# --------------------------------------------------------------------------------- config


def make_project(root: Path, extra: str, files: dict[str, bytes] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(PROJECT + MODEL + extra, encoding="utf-8")
    for name, data in {"models/classifier.onnx": CNN.read_bytes(), **(files or {})}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_config_reads_the_quantization_keys(tmp_path: Path) -> None:
    root = make_project(tmp_path, 'quantize = "int8"\ncalibration = "data/cal.npz"\n'
                        'calibration-method = "entropy"\nkeep-float = ["/fc2/Gemm", "Softmax"]\n',
                        {"data/cal.npz": b"not read by config"})
    (model,) = load_project(root, environ={}).models
    assert model.calibration == root.resolve() / "data/cal.npz"
    assert (model.calibration_method, model.keep_float) == ("entropy", ("/fc2/Gemm", "Softmax"))
    root = make_project(tmp_path / "ep", 'quantize = "int8"\ncalibration = "digits.calib:feeds"\n')
    (model,) = load_project(root, environ={}).models
    assert model.calibration == "digits.calib:feeds"  # an entry point, imported at build time
    assert model.calibration_method == "minmax"


CONFIG_ERRORS = {
    "calibration without int8": (
        'calibration = "data/cal.npz"\n',
        ["tool.cuvil.models.classifier.calibration", "not quantized", 'Add quantize = "int8"']),
    "keep-float without int8": (
        'keep-float = ["Softmax"]\n',
        ["tool.cuvil.models.classifier.keep-float", "not quantized", "remove keep-float"]),
    "unknown calibration method": (
        'quantize = "int8"\ncalibration = "data/cal.npz"\ncalibration-method = "kl"\n',
        ["calibration-method", '"minmax", "percentile", "entropy"']),
    "keep-float not strings": (
        'quantize = "int8"\ncalibration = "data/cal.npz"\nkeep-float = "Softmax"\n',
        ["keep-float", "expected an array of strings"]),
    "calibration not a string": (
        'quantize = "int8"\ncalibration = 3\n', ["calibration", "got 3"]),
    "missing calibration file": (
        'quantize = "int8"\ncalibration = "data/other.npz"\n',
        ["calibration: cannot read", "other.npz", "Fix the path"]),
    "int8 without calibration": (
        'quantize = "int8"\n', ["calibration: missing", "module:function"]),
}


@pytest.mark.parametrize(("extra", "parts"), CONFIG_ERRORS.values(), ids=CONFIG_ERRORS.keys())
def test_config_errors(tmp_path: Path, extra: str, parts: list[str]) -> None:
    root = make_project(tmp_path, extra, {"data/cal.npz": b"x"})
    with pytest.raises(ConfigError) as info:
        load_project(root, environ={})
    for part in ["pyproject.toml", *parts]:
        assert part in str(info.value)


# ---------------------------------------------------------------------- calibration readers


def test_npz_rows_become_feeds_of_at_most_64(tmp_path: Path) -> None:
    data = tiny_feeds(130)
    np.savez(tmp_path / "cal.npz", **data)
    feeds = read_calibration(tmp_path / "cal.npz", specs())
    assert [len(f["x"]) for f in feeds] == [64, 64, 2]
    np.testing.assert_array_equal(np.concatenate([f["x"] for f in feeds]), data["x"])
    np.testing.assert_array_equal(np.concatenate([f["ids"] for f in feeds]), data["ids"])


def test_npz_of_a_fixed_batch_model_and_stacked_feeds(tmp_path: Path) -> None:
    np.savez(tmp_path / "rows.npz", **tiny_feeds(6))
    assert [len(f["x"]) for f in read_calibration(tmp_path / "rows.npz", specs(2))] == [2, 2, 2]
    stacked = {k: v.reshape(3, 2, *v.shape[1:]) for k, v in tiny_feeds(6).items()}
    np.savez(tmp_path / "stacked.npz", **stacked)
    feeds = read_calibration(tmp_path / "stacked.npz", specs(2))
    assert len(feeds) == 3
    np.testing.assert_array_equal(feeds[1]["x"], stacked["x"][1])


def test_entry_point_feeds(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "calib.py").write_text(textwrap.dedent("""\
        import numpy as np

        def feeds():
            for seed in range(3):
                rng = np.random.default_rng(seed)
                yield {"x": rng.standard_normal((5, 4)).astype(np.float32),
                       "ids": np.arange(5, dtype=np.int64)}

        def not_dicts():
            return [[1, 2]]

        value = 3
        """))
    feeds = read_calibration("mypkg.calib:feeds", specs(), search_path=[tmp_path])
    assert len(feeds) == 3
    np.testing.assert_array_equal(
        feeds[2]["x"], np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32))
    assert "mypkg" not in sys.modules  # forgotten: a later build reads edited files again
    errors = {
        "mypkg.nothere:feeds": ["cannot import 'mypkg.nothere'", "Python package"],
        "mypkg.calib:missing": ["has no 'missing'", "define it"],
        "mypkg.calib:value": ["'value' is a int, not a function"],
        "mypkg.calib:not_dicts": ["feed 0: list, expected a dict of input name -> array"],
    }
    for spec, parts in errors.items():
        with pytest.raises(ConfigError) as info:
            read_calibration(spec, specs(), search_path=[tmp_path])
        for part in [f"calibration entry point {spec!r}", *parts]:
            assert part in str(info.value)


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def test_calibration_file_errors(tmp_path: Path, fifo) -> None:
    good = tiny_feeds(8)
    (tmp_path / "text.npz").write_text("not a zip")
    np.save(tmp_path / "one.npy", good["x"])
    cases = {
        "missing file": (tmp_path / "absent.npz", ["absent.npz", "no such calibration file",
                                                   "np.savez('absent.npz', x=..., ids=...)"]),
        "not an npz": (tmp_path / "text.npz", ["text.npz", "not an .npz file", "np.savez"]),
        "a FIFO": (fifo(tmp_path / "pipe.npz"), ["pipe.npz", "is a FIFO (named pipe), not a file"]),
        "an npy array": (tmp_path / "one.npy", ["one.npy", "single .npy array", "np.savez"]),
        "missing input": (_npz(tmp_path / "a.npz", x=good["x"]),
                          ["a.npz", "no array for the model input 'ids'", "one array per input"]),
        "extra input": (_npz(tmp_path / "b.npz", **good, z=good["x"]),
                        ["b.npz", "'z' is not an input of the model", "remove it"]),
        "dtype": (_npz(tmp_path / "c.npz", x=good["x"].astype(np.float64), ids=good["ids"]),
                  ["c.npz", "input 'x' is float64", "x: float32[batch, 4]", "astype(np.float32)"]),
        "fixed dim": (_npz(tmp_path / "d.npz", x=good["x"][:, :3], ids=good["ids"]),
                      ["d.npz", "input 'x' has shape [8, 3]", "dim 1 must be 4"]),
        "rank": (_npz(tmp_path / "e.npz", x=good["x"].ravel(), ids=good["ids"]),
                 ["e.npz", "input 'x' has shape [32] (rank 1)", "x: float32[batch, 4] (rank 2)"]),
        "row counts": (_npz(tmp_path / "f.npz", x=good["x"], ids=good["ids"][:5]),
                       ["f.npz", "different numbers of samples", "x: 8, ids: 5"]),
        "no rows": (_npz(tmp_path / "g.npz", x=good["x"][:0], ids=good["ids"][:0]),
                    ["g.npz", "no samples"]),
    }
    for name, (path, parts) in cases.items():
        with pytest.raises(ConfigError) as info:
            read_calibration(path, specs())
        for part in parts:
            assert part in str(info.value), (name, str(info.value))
    with pytest.raises(ConfigError, match=r"7 samples.*batches of 2; give a multiple of 2"):
        read_calibration(_npz(tmp_path / "h.npz", **tiny_feeds(7)), specs(2))


def test_feed_dicts_are_checked() -> None:
    feed = tiny_feeds(4)
    with pytest.raises(ConfigError, match=r"calibration data, feed 1: input 'ids' is int32"):
        read_calibration([feed, {**feed, "ids": feed["ids"].astype(np.int32)}], specs())
    with pytest.raises(ConfigError, match="gave no feeds"):
        read_calibration([], specs())
    assert feeds_digest([feed]) != feeds_digest([{**feed, "x": feed["x"] + 1}])


# ------------------------------------------------------------------------ the QDQ model


def test_qdq_model_has_per_channel_symmetric_int8_weights_and_keeps_float_layers() -> None:
    x_train = digits_split()[0]
    qdq = quantize_model(CNN, QuantizeSettings([{"image": x_train[:64]}]))
    weights = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    producers = {o: n for n in qdq.graph.node for o in n.output}
    float_model = onnx.load(CNN)
    # what the package's session reports is the float model's, not the quantizer's
    assert (qdq.producer_name, qdq.producer_version) == (float_model.producer_name,
                                                         float_model.producer_version)
    assert list(qdq.metadata_props) == list(float_model.metadata_props)
    channels = {n.name: numpy_helper.to_array(
        next(t for t in float_model.graph.initializer if t.name == n.input[1])).shape[0]
        for n in float_model.graph.node if n.op_type in ("Conv", "Gemm")}
    for node in qdq.graph.node:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        dq = producers[node.input[1]]
        assert dq.op_type == "DequantizeLinear", node.name
        values, scale, zero = (weights[i] for i in dq.input)
        assert values.dtype == np.int8 and not zero.any()  # symmetric int8
        assert scale.shape == (channels[node.name],), node.name  # one scale per output channel
    # Conv-BatchNormalization was folded before quantizing; keep-float leaves layers alone
    assert "BatchNormalization" not in {n.op_type for n in qdq.graph.node}
    kept = quantize_model(CNN, QuantizeSettings([{"image": x_train[:64]}],
                                                keep_float=("/fc2/Gemm", "Conv")))
    producers = {o: n for n in kept.graph.node for o in n.output}
    for node in kept.graph.node:
        if node.op_type in ("Conv", "Gemm"):
            from_dq = node.input[1] in producers  # a float weight is an initializer
            assert from_dq == (node.name == "/fc1/Gemm"), node.name
    with pytest.raises(ConfigError, match=r"keep-float entry '/fc3/Gemm'.*close: '/fc2/Gemm'"):
        quantize_model(CNN, QuantizeSettings([{"image": x_train[:8]}], keep_float=("/fc3/Gemm",)))


def test_an_export_onnxruntime_cannot_infer_symbolically_still_quantizes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's attention export with symbolic batch and sequence stops onnxruntime's symbolic
    # shape inference ("Incomplete symbolic shape inference"); onnx's shape inference is enough
    model = onnx.load(REPO / "tests" / "data" / "transformer_encoder.onnx")
    rng = np.random.default_rng(5)
    feeds = [{"features": rng.standard_normal((2, 7, 12)).astype(np.float32),
              "padding": np.zeros((2, 7), bool)} for _ in range(4)]
    said: list[str] = []
    monkeypatch.chdir(tmp_path)
    qdq = quantize_model(model, QuantizeSettings(feeds), log=said.append)
    assert any("symbolic shape inference failed" in line for line in said), said
    assert not list(tmp_path.iterdir())  # nothing left in the working directory
    products = [n for n in qdq.graph.node if n.op_type in ("MatMul", "Gemm")]
    dequantized = {o for n in qdq.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    assert products and all(n.input[1] in dequantized for n in products)
    test = {"features": rng.standard_normal((3, 5, 12)).astype(np.float32),
            "padding": np.zeros((3, 5), bool)}
    (want,) = int8_oracle(qdq)(test)
    (got,) = cuvil.compile(qdq).run(test).values()
    np.testing.assert_allclose(got, want, atol=0.05 * float(np.abs(want).max()))


def test_missing_onnxruntime_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` fails
    monkeypatch.setitem(sys.modules, "onnxruntime.quantization", None)
    with pytest.raises(MissingDependencyError, match=r"needs onnxruntime.*pip install \"onnxruntime"):
        cuvil.compile(CNN, quantize="int8", calibration=[{"image": np.zeros((1, 1, 8, 8), np.float32)}])


# ---------------------------------------------------------------------------- accuracy


def _mlp_model(x_train: np.ndarray, y_train: np.ndarray) -> onnx.ModelProto:
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPClassifier

    classifier = MLPClassifier(hidden_layer_sizes=(32,), max_iter=200, random_state=0)
    with warnings.catch_warnings():  # it may say it has not quite converged: not our concern
        warnings.simplefilter("ignore")
        classifier.fit(x_train, y_train)
    return to_onnx(classifier, x_train[:1], options={"zipmap": False}, target_opset=17)


def _int8_probabilities(model: onnx.ModelProto | Path, feeds: list[dict[str, np.ndarray]],
                        test: dict[str, np.ndarray], output: str) -> np.ndarray:
    """The int8 model's `output` on `test`: cuvil's library once it compiles QDQ models, else
    onnxruntime on the QDQ model cuvil's quantization step makes."""
    if cuvil_compiles_qdq():
        compiled = cuvil.compile(model, quantize="int8", calibration=feeds)
        return compiled.run(test)[output]
    qdq = quantize_model(model, QuantizeSettings(feeds))
    session = ort.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([output], test)[0]


def _accuracies(model: onnx.ModelProto | Path, name: str, x_train: np.ndarray, x_test: np.ndarray,
                y_test: np.ndarray, output: str) -> tuple[float, float]:
    # 256 training images, in feeds of 64, calibrate; the 450 held-out images measure
    feeds = [{name: x_train[i:i + 64]} for i in range(0, 256, 64)]
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    float_top1 = session.run([output], {name: x_test})[0].argmax(1)
    int8_top1 = _int8_probabilities(model, feeds, {name: x_test}, output).argmax(1)
    return float((float_top1 == y_test).mean()), float((int8_top1 == y_test).mean())


def test_int8_accuracy_on_held_out_digits() -> None:
    x_train, x_test, y_train, y_test = digits_split()
    results = {
        "digits CNN (examples/digits)": _accuracies(CNN, "image", x_train, x_test, y_test,
                                                    "probabilities"),
        "sklearn MLPClassifier (64-32-10)": _accuracies(
            _mlp_model(x_train.reshape(len(x_train), -1), y_train), "X",
            x_train.reshape(len(x_train), -1), x_test.reshape(len(x_test), -1), y_test,
            "probabilities"),
    }
    engine = "cuvil" if cuvil_compiles_qdq() else "onnxruntime on the QDQ model"
    for model, (float_accuracy, int8_accuracy) in results.items():
        print(f"{model}: float32 {100 * float_accuracy:.2f}%, int8 ({engine}) "
              f"{100 * int8_accuracy:.2f}% top-1 on {len(y_test)} held-out images")
        assert float_accuracy > 0.95, model  # the models learned the task
        assert int8_accuracy >= float_accuracy - MAX_ACCURACY_LOSS, model


# -------------------------------------------------------------------------- build backend


def test_build_requirements_name_onnxruntime_for_int8(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    plain = make_project(tmp_path / "plain", "")
    monkeypatch.chdir(plain)
    assert backend.get_requires_for_build_wheel() == []
    quantized = make_project(tmp_path / "int8", 'quantize = "int8"\ncalibration = "cal.npz"\n',
                             {"cal.npz": b"x"})
    monkeypatch.chdir(quantized)
    assert backend.get_requires_for_build_wheel() == [ONNXRUNTIME_REQUIREMENT]
    assert backend.get_requires_for_build_editable() == [ONNXRUNTIME_REQUIREMENT]
    assert backend.get_requires_for_build_sdist() == []
    assert ONNXRUNTIME_REQUIREMENT.startswith("onnxruntime")


def test_cache_key_covers_calibration_and_settings(tmp_path: Path) -> None:
    x_train = digits_split()[0]
    root = make_project(tmp_path, 'quantize = "int8"\ncalibration = "cal.npz"\n')
    np.savez(root / "cal.npz", image=x_train[:16])
    target = get_target(None)

    def key(feeds_digest: str | None = None) -> str:
        project = load_project(root, environ={})
        return model_key(project, project.models[0], target, feeds_digest=feeds_digest)

    first = key()
    assert key() == first
    np.savez(root / "cal.npz", image=x_train[16:32])
    changed = key()
    assert changed != first
    keys = {changed}
    for extra in ('calibration-method = "percentile"\n', 'keep-float = ["Softmax"]\n'):
        (root / "pyproject.toml").write_text(PROJECT + MODEL + 'quantize = "int8"\n'
                                             'calibration = "cal.npz"\n' + extra)
        keys.add(key())
    assert len(keys) == 3
    assert key("a") != key("b")  # an entry point's feeds


@pytest.mark.slow
def test_wheel_of_an_int8_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not cuvil_compiles_qdq():
        pytest.skip("cuvil does not compile QuantizeLinear/DequantizeLinear yet (branch qops)")
    import zipfile

    x_train, x_test, _, _ = digits_split()
    root = make_project(tmp_path / "project", 'quantize = "int8"\ncalibration = "data/cal.npz"\n'
                        'inputs = { image = ["batch", 1, 8, 8] }\n')
    (root / "data").mkdir()
    np.savez(root / "data" / "cal.npz", image=x_train[:128])
    monkeypatch.chdir(root)
    monkeypatch.setenv("CUVIL_CACHE", "0")
    name = backend.build_wheel(str(tmp_path / "dist"))
    target = tmp_path / "installed"
    with zipfile.ZipFile(tmp_path / "dist" / name) as wheel:
        wheel.extractall(target)
    monkeypatch.syspath_prepend(str(target))
    try:
        import digits

        got = digits.classifier(x_test)
    finally:  # later tests import their own `digits` package
        for module in [m for m in sys.modules if m == "digits" or m.startswith("digits.")]:
            del sys.modules[module]
    qdq = quantize_model(CNN, QuantizeSettings(root / "data" / "cal.npz"))
    session = ort.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"image": x_test})[0]
    assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.99


# ------------------------------------------------------------------------------- report


def test_inspect_quantization_reports_every_layer(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    x_train = digits_split()[0]
    np.savez(tmp_path / "cal.npz", image=x_train[:128])
    assert main(["inspect", str(CNN), "--quantization", "--calibration",
                 str(tmp_path / "cal.npz")]) == 0
    out = capsys.readouterr().out
    assert "on 128 calibration samples (2 feeds, minmax ranges)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    for layer in ("/conv1/Conv", "/conv2/Conv", "/fc1/Gemm", "/fc2/Gemm"):
        relative, snr = float(rows[layer][3]), float(rows[layer][4])
        assert 0 < relative < 0.05 and snr > 25, rows[layer]
    # the output's agreement, against both models run here by onnxruntime
    qdq = quantize_model(CNN, QuantizeSettings(tmp_path / "cal.npz"))
    feed = {"image": x_train[:128]}
    exact = ort.SessionOptions()  # QDQ pairs computed as written, not fused into QLinear ops
    exact.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(CNN), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(qdq.SerializeToString(), exact,
                               providers=["CPUExecutionProvider"]).run(None, feed)[0]
    agreement = 100 * (ref.argmax(1) == got.argmax(1)).mean()
    assert rows["probabilities"][-1] == f"{agreement:.2f}%"
    relative = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert float(rows["probabilities"][1]) == pytest.approx(relative, abs=2e-4)
    with pytest.raises(SystemExit):
        main(["inspect", str(CNN), "--quantization", "--calibration-method", "kl"])
    assert main(["inspect", str(CNN), "--quantization"]) == 2
    assert "needs --calibration" in capsys.readouterr().err


def test_inspect_quantization_of_a_project(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_project(tmp_path, 'quantize = "int8"\ncalibration = "digits.calib:feeds"\n'
                        'keep-float = ["/fc2/Gemm"]\n')
    (root / "digits").mkdir()
    (root / "digits" / "__init__.py").write_text("")
    (root / "digits" / "calib.py").write_text(
        "import numpy as np\n\ndef feeds():\n"
        "    return [{'image': np.full((4, 1, 8, 8), v, np.float32)} for v in (0.0, 0.5, 1.0)]\n")
    assert main(["inspect", str(root), "--quantization"]) == 0
    out = capsys.readouterr().out
    assert "model classifier (classifier.onnx): int8 against float on 12 calibration samples" in out
    fc2 = next(line for line in out.splitlines() if line.strip().startswith("/fc2/Gemm"))
    assert fc2.split()[2] == "no"  # kept in float
    (root / "pyproject.toml").write_text(PROJECT + MODEL)
    assert main(["inspect", str(root), "--quantization"]) == 2
    assert 'no model sets quantize = "int8"' in capsys.readouterr().err


def test_compile_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match=r'quantize = "int8" needs calibration data'):
        cuvil.compile(CNN, quantize="int8")
    with pytest.raises(ConfigError, match=r"calibration data or keep-float given, but quantize"):
        cuvil.compile(CNN, calibration="cal.npz")
    with pytest.raises(ConfigError, match=r"quantize = 'int4' is not one of"):
        cuvil.compile(CNN, quantize="int4")


def test_backend_reads_an_entry_point_once_and_keys_on_its_feeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuvil.build_backend import _package
    from cuvil.compiler import driver

    root = make_project(tmp_path, 'quantize = "int8"\ncalibration = "digits.calib:feeds"\n')
    (root / "digits").mkdir()
    (root / "digits" / "__init__.py").write_text("")
    (root / "digits" / "calib.py").write_text(
        "import numpy as np\n\ndef feeds():\n"
        "    return [{'image': np.full((2, 1, 8, 8), 0.5, np.float32)}]\n")
    project = load_project(root, environ={})
    seen = []

    def fake_compile(source, name, workdir, options, **kwargs):
        seen.append(dataclasses.asdict(options))
        library = Path(workdir) / "lib.so"
        library.parent.mkdir(parents=True, exist_ok=True)
        library.write_bytes(b"lib")
        return driver.CompiledModel(name, library, {"library": "lib.so"})

    monkeypatch.setattr(driver, "compile_model", fake_compile)
    keys = []
    monkeypatch.setattr(_package, "model_key",
                        lambda *args, **kwargs: keys.append(kwargs["feeds_digest"]) or "k")

    class Cache:
        folder = tmp_path

        def load(self, key, log):
            return None

        def store(self, key, library, signature, log):
            pass

        def kernels(self, log):
            return None

    _package._compile(project, project.models[0], get_target(None), tmp_path / "work",
                      lambda message: None, Cache(), natives=dict)
    (call,) = seen
    (feed,) = call["calibration"]  # the generator's feeds, read once, handed over
    np.testing.assert_array_equal(feed["image"], np.full((2, 1, 8, 8), 0.5, np.float32))
    assert keys == [feeds_digest(call["calibration"])]
    assert (call["quantize"], call["calibration_method"]) == ("int8", "minmax")
