"""scikit-learn's SVC, SVR and OneClassSVM trained here on its bundled data, converted with
skl2onnx (SVMClassifier, SVMRegressor) and compiled with cuvil: labels equal onnxruntime's
and scikit-learn's; scores and probabilities within 1e-5 of scikit-learn (float64) and of
onnxruntime up to its own float32 error (up to ~3e-5 here: it sums kernels and runs the
pairwise coupling in float32, cuvil takes the decision values in float64)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import cuvil

skl2onnx = pytest.importorskip("skl2onnx")
ort = pytest.importorskip("onnxruntime")
datasets = pytest.importorskip("sklearn.datasets")

from sklearn.preprocessing import StandardScaler  # noqa: E402
from sklearn.svm import SVC, SVR, OneClassSVM  # noqa: E402

ML_OPSET = {"": 17, "ai.onnx.ml": 3}
#: onnxruntime's float32 error on these models (see the module docstring)
ORT_ATOL = 5e-5


def _data(name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = getattr(datasets, f"load_{name}")(return_X_y=True)
    x = x.astype(np.float32)
    if name == "breast_cancer":  # unscaled, its linear kernel sums cancel beyond float32
        x = StandardScaler().fit_transform(x).astype(np.float32)
    return x, y


def _run(model, x: np.ndarray) -> tuple[dict, dict]:
    options = {id(model): {"zipmap": False}} if isinstance(model, SVC) else None
    onnx_model = skl2onnx.to_onnx(model, x[:1], options=options, target_opset=ML_OPSET)
    session = ort.InferenceSession(onnx_model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in onnx_model.graph.output]
    feed = {onnx_model.graph.input[0].name: x}
    expected = dict(zip(names, session.run(None, feed)))
    got = cuvil.compile(onnx_model).run(feed)
    for name in names:
        assert got[name].shape == expected[name].shape, name
        assert got[name].dtype == expected[name].dtype, name
    return got, expected


@pytest.mark.parametrize("data,kernel,probability", [
    ("iris", "rbf", True), ("iris", "linear", False), ("breast_cancer", "sigmoid", False),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("iris", "rbf", False), ("iris", "linear", True), ("iris", "poly", False), ("iris", "poly", True),
        ("breast_cancer", "rbf", True), ("breast_cancer", "linear", False),
        ("breast_cancer", "poly", True)]),
])
def test_svc(data, kernel, probability):
    x, y = _data(data)
    with warnings.catch_warnings():  # probability=True is deprecated from scikit-learn 1.9
        warnings.simplefilter("ignore", FutureWarning)
        model = SVC(kernel=kernel, probability=probability, random_state=0).fit(x, y)
        got, expected = _run(model, x)
        reference = model.predict_proba(x) if probability else model.decision_function(x)
    np.testing.assert_array_equal(got["label"], expected["label"])
    np.testing.assert_array_equal(got["label"], model.predict(x))
    scores = got["probabilities"]
    np.testing.assert_allclose(scores, expected["probabilities"], atol=ORT_ATOL)
    if not probability and reference.ndim == 1:  # binary: onnxruntime's [-s, s], s for class 0
        reference = np.stack([reference, -reference], axis=1)
    np.testing.assert_allclose(scores, reference, atol=1e-5, rtol=1e-5)


def test_svr():
    x, y = _data("diabetes")
    for kernel in ("rbf", "linear", "poly"):
        model = SVR(kernel=kernel, C=10.0).fit(x, y)
        got, expected = _run(model, x)
        out = got["variable"]
        np.testing.assert_allclose(out, expected["variable"], rtol=1e-5, atol=ORT_ATOL,
                                   err_msg=kernel)
        np.testing.assert_allclose(out[:, 0], model.predict(x), rtol=1e-6, atol=1e-5,
                                   err_msg=kernel)


def test_one_class_svm():
    x, _ = _data("breast_cancer")
    model = OneClassSVM(nu=0.2).fit(x)
    got, expected = _run(model, x)
    np.testing.assert_array_equal(got["label"], expected["label"])
    np.testing.assert_array_equal(got["label"][:, 0], model.predict(x))
    np.testing.assert_allclose(got["scores"], expected["scores"], atol=ORT_ATOL)
    np.testing.assert_allclose(got["scores"][:, 0], model.decision_function(x), atol=1e-5)
