"""scikit-learn models trained here on its bundled data, converted with skl2onnx (ai.onnx.ml),
compiled with cuvil: labels equal and scores within 1e-5 of onnxruntime and of scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest

import cuvil
from cuvil.errors import ModelError

skl2onnx = pytest.importorskip("skl2onnx")
ort = pytest.importorskip("onnxruntime")
datasets = pytest.importorskip("sklearn.datasets")

from sklearn.compose import ColumnTransformer  # noqa: E402
from sklearn.ensemble import (  # noqa: E402
    GradientBoostingClassifier,
    GradientBoostingRegressor,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge  # noqa: E402
from sklearn.pipeline import Pipeline, make_pipeline  # noqa: E402
from sklearn.preprocessing import (  # noqa: E402
    Binarizer,
    Normalizer,
    OneHotEncoder,
    StandardScaler,
)
from sklearn.svm import LinearSVC  # noqa: E402

ML_OPSET = {"": 17, "ai.onnx.ml": 3}


def _data(name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = getattr(datasets, f"load_{name}")(return_X_y=True)
    return x.astype(np.float32), y


def _final(model):
    return model.steps[-1][1] if isinstance(model, Pipeline) else model


def _convert(model, x: np.ndarray, opset=ML_OPSET):
    final = _final(model)
    options = {id(final): {"zipmap": False}} if hasattr(final, "predict_proba") else None
    return skl2onnx.to_onnx(model, x[:1], options=options, target_opset=opset)


def _check(model, x: np.ndarray, opset=ML_OPSET, atol: float = 1e-5, rtol: float = 1e-6):
    onnx_model = _convert(model, x, opset)
    compiled = cuvil.compile(onnx_model)
    session = ort.InferenceSession(onnx_model.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in onnx_model.graph.output]
    feed = {onnx_model.graph.input[0].name: x}
    expected = dict(zip(names, session.run(None, feed)))
    got = compiled.run(feed)
    for name in names:
        assert got[name].shape == expected[name].shape, name
        assert got[name].dtype == expected[name].dtype, name
        if got[name].dtype.kind == "f":
            np.testing.assert_allclose(got[name], expected[name], atol=atol, rtol=rtol, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    final = _final(model)
    if "label" in got:
        np.testing.assert_array_equal(got["label"], model.predict(x))
        if hasattr(final, "predict_proba"):
            np.testing.assert_allclose(got["probabilities"], model.predict_proba(x), atol=atol)
    else:
        out = got[names[0]]
        np.testing.assert_allclose(out.reshape(len(x), -1)[:, 0], model.predict(x).ravel(),
                                   atol=atol, rtol=rtol)
    return onnx_model


@pytest.mark.parametrize("data", ["iris", "breast_cancer"])
def test_logistic_regression(data):
    x, y = _data(data)
    _check(make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y), x)


@pytest.mark.parametrize("data", ["iris", "breast_cancer"])
def test_linear_svc(data):
    x, y = _data(data)
    model = LinearSVC(max_iter=5000).fit(StandardScaler().fit_transform(x), y)
    x = StandardScaler().fit_transform(x).astype(np.float32)
    _check(model, x)


def test_linear_regressors_with_transforms():
    x, y = _data("diabetes")
    _check(LinearRegression().fit(x, y), x, rtol=1e-5)
    _check(make_pipeline(Normalizer("l1"), Ridge()).fit(x, y), x, rtol=1e-5)
    # (not Normalizer("max"): scikit-learn divides by the largest magnitude, onnxruntime and
    # the ONNX-ML spec by the largest value)
    _check(make_pipeline(Binarizer(threshold=0.01), Ridge()).fit(x, y), x, rtol=1e-5)


def test_imputer_with_missing_values():
    x, y = _data("diabetes")
    x = x.copy()
    x[::5, 2] = np.nan
    x[::7, 0] = np.nan
    _check(make_pipeline(SimpleImputer(), Normalizer(), Ridge()).fit(x, y), x, rtol=1e-5)


@pytest.mark.parametrize("data", ["iris", "breast_cancer", "digits"])
def test_random_forest_classifier(data):
    x, y = _data(data)
    _check(RandomForestClassifier(n_estimators=20, max_depth=8, random_state=0).fit(x, y), x)


@pytest.mark.parametrize("data", ["iris", "breast_cancer"])
def test_gradient_boosting_classifier(data):
    x, y = _data(data)
    _check(GradientBoostingClassifier(n_estimators=20, random_state=0).fit(x, y), x)


def test_tree_regressors():
    x, y = _data("diabetes")
    for model in (RandomForestRegressor(n_estimators=20, max_depth=6, random_state=0),
                  GradientBoostingRegressor(n_estimators=20, random_state=0)):
        _check(model.fit(x, y), x, atol=1e-3, rtol=1e-5)


def test_pipeline_with_column_transformer_and_one_hot():
    rng = np.random.default_rng(0)
    n = 300
    numeric = rng.normal(size=(n, 3)).astype(np.float32)
    numeric[rng.random(n) < 0.1, 1] = np.nan
    category = rng.integers(0, 4, size=(n, 1)).astype(np.float32)
    x = np.hstack([numeric, category])
    y = ((np.nan_to_num(numeric[:, 0]) + (category[:, 0] == 2)) > 0.5).astype(np.int64)
    model = Pipeline([
        ("prep", ColumnTransformer([
            ("num", make_pipeline(SimpleImputer(), StandardScaler()), [0, 1, 2]),
            ("cat", OneHotEncoder(handle_unknown="ignore"), [3]),
        ])),
        ("clf", LogisticRegression()),
    ]).fit(x, y)
    _check(model, x)


def test_zipmap_is_refused_with_the_converter_option_to_drop_it():
    x, y = _data("iris")
    model = LogisticRegression(max_iter=1000).fit(x, y)
    onnx_model = skl2onnx.to_onnx(model, x[:1], target_opset=ML_OPSET)
    with pytest.raises(ModelError, match="zipmap': False"):
        cuvil.compile(onnx_model)
