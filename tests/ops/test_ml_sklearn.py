"""scikit-learn models trained here on its bundled data, converted with skl2onnx (ai.onnx.ml),
and LightGBM and XGBoost models converted with onnxmltools, compiled with cuvil: labels equal
and scores within 1e-5 of onnxruntime and of the framework itself."""

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
    HistGradientBoostingClassifier,
    HistGradientBoostingRegressor,
    RandomForestClassifier,
    RandomForestRegressor,
)
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge  # noqa: E402
from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor  # noqa: E402
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


def _check(model, x: np.ndarray, *, ops: tuple[str, ...], opset=ML_OPSET, atol: float = 1e-5,
           rtol: float = 1e-6):
    return _compare(_convert(model, x, opset), model, x, ops=ops, atol=atol, rtol=rtol)


def _compare(onnx_model, model, x: np.ndarray, *, ops: tuple[str, ...], atol: float = 1e-5,
             rtol: float = 1e-6):
    """cuvil against onnxruntime (every output) and against `model` itself (its predictions).

    `ops` are ai.onnx.ml operators the converted model must hold: the test fails when a
    converter stops writing them (docs/conformance.md lists the tests by these names)."""
    written = {n.op_type for n in onnx_model.graph.node if n.domain == "ai.onnx.ml"}
    assert set(ops) <= written, f"the converter wrote {sorted(written)}"
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
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)
    _check(model, x, ops=("Scaler", "LinearClassifier"))  # and Normalizer for several classes


@pytest.mark.parametrize("data", ["iris", "breast_cancer"])
def test_linear_svc(data):
    x, y = _data(data)
    model = LinearSVC(max_iter=5000).fit(StandardScaler().fit_transform(x), y)
    x = StandardScaler().fit_transform(x).astype(np.float32)
    _check(model, x, ops=("LinearClassifier",))


def test_linear_regressors_with_transforms():
    x, y = _data("diabetes")
    _check(LinearRegression().fit(x, y), x, rtol=1e-5, ops=("LinearRegressor",))
    _check(make_pipeline(Normalizer("l1"), Ridge()).fit(x, y), x, rtol=1e-5,
           ops=("Normalizer", "LinearRegressor"))
    # (not Normalizer("max"): scikit-learn divides by the largest magnitude, onnxruntime and
    # the ONNX-ML spec by the largest value)
    _check(make_pipeline(Binarizer(threshold=0.01), Ridge()).fit(x, y), x, rtol=1e-5,
           ops=("Binarizer", "LinearRegressor"))


def test_imputer_with_missing_values():
    x, y = _data("diabetes")
    x = x.copy()
    x[::5, 2] = np.nan
    x[::7, 0] = np.nan
    _check(make_pipeline(SimpleImputer(), Normalizer(), Ridge()).fit(x, y), x, rtol=1e-5,
           ops=("Imputer", "Normalizer", "LinearRegressor"))


@pytest.mark.parametrize("data", ["iris", "breast_cancer", "digits"])
def test_random_forest_classifier(data):
    x, y = _data(data)
    _check(RandomForestClassifier(n_estimators=20, max_depth=8, random_state=0).fit(x, y), x,
           ops=("TreeEnsembleClassifier",))


@pytest.mark.parametrize("data", ["iris", "breast_cancer"])
def test_gradient_boosting_classifier(data):
    x, y = _data(data)
    _check(GradientBoostingClassifier(n_estimators=20, random_state=0).fit(x, y), x,
           ops=("TreeEnsembleClassifier",))


def test_tree_regressors():
    x, y = _data("diabetes")
    for model in (RandomForestRegressor(n_estimators=20, max_depth=6, random_state=0),
                  GradientBoostingRegressor(n_estimators=20, random_state=0)):
        _check(model.fit(x, y), x, atol=1e-3, rtol=1e-5, ops=("TreeEnsembleRegressor",))


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
    _check(model, x,
           ops=("ArrayFeatureExtractor", "Imputer", "Scaler", "OneHotEncoder", "LinearClassifier"))


def test_zipmap_is_refused_with_the_converter_option_to_drop_it():
    x, y = _data("iris")
    model = LogisticRegression(max_iter=1000).fit(x, y)
    onnx_model = skl2onnx.to_onnx(model, x[:1], target_opset=ML_OPSET)
    assert "ZipMap" in {n.op_type for n in onnx_model.graph.node}
    with pytest.raises(ModelError, match="zipmap': False"):
        cuvil.compile(onnx_model)


def _mixed_table(n: int = 400, classes: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Three numeric columns with NaNs and one integer category column (0-5)."""
    rng = np.random.default_rng(1)
    numeric = rng.normal(size=(n, 3)).astype(np.float32)
    numeric[rng.random((n, 3)) < 0.1] = np.nan
    category = rng.integers(0, 6, size=(n, 1)).astype(np.float32)
    score = np.nan_to_num(numeric[:, 0]) + np.isin(category[:, 0], [1, 4])
    y = (score > 0.5).astype(np.int64)
    if classes == 3:
        y += np.nan_to_num(numeric[:, 1]) > 0
    return np.hstack([numeric, category]), y


@pytest.fixture
def hist_gradient_boosting_converts(monkeypatch):
    """skl2onnx 1.20 writes each HistGradientBoosting leaf's missing-value track as a Python
    bool, which onnx's make_attribute refuses ("Expected an int, got a boolean"): cast it."""
    from skl2onnx.common import tree_ensemble

    add_node = tree_ensemble.add_node

    def add_node_with_int_tracks(*args, nodes_missing_value_tracks_true=0, **kwargs):
        return add_node(*args, nodes_missing_value_tracks_true=int(nodes_missing_value_tracks_true),
                        **kwargs)

    monkeypatch.setattr(tree_ensemble, "add_node", add_node_with_int_tracks)


@pytest.mark.usefixtures("hist_gradient_boosting_converts")
@pytest.mark.parametrize("data", ["iris", "breast_cancer", "mixed"])
def test_hist_gradient_boosting_classifier(data):
    # "mixed" has NaNs: the trees learn which way missing values go (missing-value tracks)
    x, y = _mixed_table(classes=3) if data == "mixed" else _data(data)
    _check(HistGradientBoostingClassifier(max_iter=30, random_state=0).fit(x, y), x,
           ops=("TreeEnsembleClassifier",))


@pytest.mark.usefixtures("hist_gradient_boosting_converts")
def test_hist_gradient_boosting_regressor():
    x, y = _data("diabetes")
    x = x.copy()
    x[::6, 3] = np.nan
    _check(HistGradientBoostingRegressor(max_iter=30, random_state=0).fit(x, y), x,
           atol=1e-3, rtol=1e-5, ops=("TreeEnsembleRegressor",))


def test_k_neighbors():
    # skl2onnx writes these with Scan (pairwise distances), TopK and ArrayFeatureExtractor
    x, y = _data("iris")
    _check(KNeighborsClassifier(5).fit(x, y), x, ops=("ArrayFeatureExtractor",))
    x, y = _data("breast_cancer")
    # held-out rows. (Not weights="distance": skl2onnx 1.20 writes uniform votes for it, and
    # onnxruntime and cuvil then agree with each other, not with scikit-learn.)
    model = make_pipeline(StandardScaler(), KNeighborsClassifier(7))
    _check(model.fit(x[::2], y[::2]), x[1::2], ops=("Scaler", "ArrayFeatureExtractor"))
    x, y = _data("diabetes")
    _check(KNeighborsRegressor(5).fit(x, y), x, rtol=1e-5, ops=("ArrayFeatureExtractor",))


# -- LightGBM and XGBoost, converted with onnxmltools ---------------------------------------------

def _onnxmltools(framework: str):
    pytest.importorskip(framework)
    return pytest.importorskip("onnxmltools")


BOOSTING_DATA = ["iris", "breast_cancer", "mixed", "mixed-3"]


def _boosting_case(framework: str, data: str):
    """(model, x, y, fit kwargs): an untrained classifier and one of BOOSTING_DATA."""
    if framework == "lightgbm":
        import lightgbm

        model, fit = lightgbm.LGBMClassifier(n_estimators=40, verbose=-1), {"categorical_feature": [3]}
    else:
        import xgboost

        model, fit = xgboost.XGBClassifier(n_estimators=40), {}
    if data.startswith("mixed"):
        return (model, *_mixed_table(classes=3 if data == "mixed-3" else 2), fit)
    return (model, *_data(data), {})


def _float_input(x: np.ndarray):
    from onnxmltools.convert.common.data_types import FloatTensorType

    return [("X", FloatTensorType([None, x.shape[1]]))]


@pytest.mark.parametrize("data", BOOSTING_DATA)
def test_lightgbm_classifier(data):
    onnxmltools = _onnxmltools("lightgbm")
    model, x, y, fit = _boosting_case("lightgbm", data)
    model.fit(x, y, **fit)  # "mixed": a categorical column, written as chains of BRANCH_EQ
    # onnxmltools 1.16 converts up to opset 15
    onnx_model = onnxmltools.convert_lightgbm(model, initial_types=_float_input(x), zipmap=False,
                                              target_opset=15)
    _compare(onnx_model, model, x, ops=("TreeEnsembleClassifier",))


@pytest.mark.parametrize("data", BOOSTING_DATA)
def test_xgboost_classifier(data):
    onnxmltools = _onnxmltools("xgboost")
    model, x, y, fit = _boosting_case("xgboost", data)
    model.fit(x, y, **fit)
    onnx_model = onnxmltools.convert_xgboost(model, initial_types=_float_input(x), target_opset=15)
    _compare(onnx_model, model, x, ops=("TreeEnsembleClassifier",))


@pytest.mark.parametrize("objective", ["regression", "poisson"])
def test_lightgbm_regressor(objective):
    onnxmltools = _onnxmltools("lightgbm")
    import lightgbm

    x, y = _data("diabetes")
    model = lightgbm.LGBMRegressor(n_estimators=40, objective=objective, verbose=-1).fit(x, y)
    onnx_model = onnxmltools.convert_lightgbm(model, initial_types=_float_input(x), target_opset=15)
    # poisson: Exp after the trees
    _compare(onnx_model, model, x, atol=1e-3, rtol=1e-5, ops=("TreeEnsembleRegressor",))


@pytest.mark.parametrize("objective", ["reg:squarederror", "count:poisson"])
def test_xgboost_regressor(objective):
    onnxmltools = _onnxmltools("xgboost")
    import xgboost

    x, y = _data("diabetes")
    x = x.copy()
    x[::6, 3] = np.nan
    model = xgboost.XGBRegressor(n_estimators=40, objective=objective).fit(x, y)
    onnx_model = onnxmltools.convert_xgboost(model, initial_types=_float_input(x), target_opset=15)
    # xgboost sums its trees in another order: up to ~1e-6 relative
    _compare(onnx_model, model, x, atol=1e-3, rtol=1e-5, ops=("TreeEnsembleRegressor",))
