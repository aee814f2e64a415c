"""The light models' dense copies (tests/light_models.py) are real tests: their weights are
dense and of a sensible scale, their softmax is far from flat in onnxruntime, and a light case
whose copy comes out flat fails instead of passing on constants."""

from __future__ import annotations

from pathlib import Path

import light_models
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from conformance import runner

#: SqueezeNet (fire modules, concat) and ResNet-50 (50+ layers deep, residual BatchNorms)
NAMES = ("squeezenet", "resnet50")


def _source(name: str) -> Path:
    return light_models.LIGHT / f"{light_models.MODELS[name]}.onnx"


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("light")
    return {name: light_models.dense_copy(_source(name), folder / f"{name}.onnx") for name in NAMES}


def _probabilities(path: Path | str, seed: int) -> np.ndarray:
    model = onnx.load(str(path))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, light_models.random_feeds(model, seed))[0]


@pytest.mark.parametrize("name", NAMES)
def test_dense_copy_keeps_the_graph_and_makes_every_splat_dense(name: str, copies) -> None:
    source, dense = onnx.load(str(_source(name))), onnx.load(str(copies[name]))
    splats = {n.output[0] for n in source.graph.node if n.op_type == "ConstantOfShape"}
    assert splats and not any(n.op_type == "ConstantOfShape" for n in dense.graph.node)
    assert ([n.op_type for n in source.graph.node if n.op_type != "ConstantOfShape"]
            == [n.op_type for n in dense.graph.node])
    weights = {t.name: numpy_helper.to_array(t) for t in dense.graph.initializer}
    assert all(np.ptp(weights[s]) > 0 for s in splats), "a weight is still constant"
    last = max(i for i, n in enumerate(dense.graph.node) if n.op_type in ("Conv", "Gemm"))
    for i, node in enumerate(dense.graph.node):
        if node.op_type == "Conv" and i != last:  # the last one is rescaled for the logits
            w = weights[node.input[1]]
            he = np.sqrt(2.0 / np.prod(w.shape[1:]))
            assert abs(w.std() / he - 1) < 0.2 or w.size < 200, node.name
        if node.op_type == "BatchNormalization":
            assert weights[node.input[4]].min() > 0, f"{node.name}: variance not positive"


@pytest.mark.parametrize("name", NAMES)
def test_dense_copy_softmax_is_far_from_flat(name: str, copies) -> None:
    """On an input other than the one the last layer was scaled on; the splat original, by
    the same measure, is flat (so the measure can fail)."""
    p = _probabilities(copies[name], seed=7).reshape(-1)
    assert p.size == 1000 and np.all(np.isfinite(p))
    assert light_models.spread_problem(p) is None
    assert p.max() > 0.02 and -(p * np.log(p)).sum() < np.log(1000) - 1
    flat = _probabilities(_source(name), seed=7)
    assert np.ptp(flat) < 1e-6
    assert "nearly flat" in (light_models.spread_problem(flat) or "")


def test_dense_copy_is_the_same_every_time(copies, tmp_path: Path) -> None:
    again = light_models.dense_copy(_source("squeezenet"), tmp_path / "again.onnx")
    assert again.read_bytes() == copies["squeezenet"].read_bytes()


def test_a_light_case_on_a_flat_copy_fails(tmp_path: Path) -> None:
    """A light case compares with onnxruntime on the dense copy, and refuses one whose
    outputs are flat (here the splat original stands in the copy's place)."""
    case = next(c for c in runner.light_cases(tmp_path) if c.name == "test_squeezenet")
    assert case.model_path is not None and case.source_path == str(_source("squeezenet"))
    Path(case.model_path).write_bytes(_source("squeezenet").read_bytes())
    result = runner.run_case(case)
    assert result["status"] == "fail"
    assert "dense copy of test_squeezenet is degenerate" in result["error"]
    assert "nearly flat" in result["error"]


def test_spread_reads_logits_through_their_softmax() -> None:
    """DenseNet-121's graph ends at its logits: the same measure applies to their softmax."""
    logits = np.random.default_rng(0).normal(0, light_models.LOGIT_STD, 1000)
    p = np.exp(logits - logits.max())
    assert light_models.spread_problem(logits) is None
    assert light_models.spread_problem(p / p.sum()) is None
    assert "nearly flat" in (light_models.spread_problem(logits * 0.1) or "")
    assert "nearly flat" in (light_models.spread_problem(np.full(1000, 0.02)) or "")
    assert "not all finite" in (light_models.spread_problem(np.full(1000, np.nan)) or "")
