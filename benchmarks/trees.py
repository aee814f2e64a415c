"""Tree ensembles (ai.onnx.ml TreeEnsembleClassifier/Regressor) through cuvil and onnxruntime
in one run: scikit-learn forests trained on its bundled data (converted with skl2onnx), and
LightGBM and XGBoost gradient boosting (converted with onnxmltools) trained on 10,000 rows of
`make_classification` / `make_regression` (on the small bundled sets boosting stops splitting
after a few hundred trees, and later trees are stumps), timed at batch 1 and batch 1,000.
Reports each engine's best-of-5 mean latency and the ratio cuvil / onnxruntime (< 1: cuvil
is faster).

    python benchmarks/trees.py                 # 1,000 trees each
    python benchmarks/trees.py --trees 200 --depth 6
    python benchmarks/trees.py --models lightgbm,xgboost

LightGBM and XGBoost cases are left out when those packages (or onnxmltools) are missing.

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from skl2onnx import to_onnx
from sklearn.datasets import (
    load_breast_cancer,
    load_diabetes,
    make_classification,
    make_regression,
)
from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

import cuvil


def best_mean(call: Callable[[], object], seconds: float = 0.5) -> float:
    """The best of 5 rounds' mean call time, each round about `seconds` / 5 long."""
    call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-7)
    n = max(1, int(seconds / 5 / once))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - start) / n)
    return best


def sklearn_cases(trees: int, depth: int) -> list[tuple[str, object]]:
    """(label, ONNX model) for a random forest classifier and regressor."""
    x, y = load_breast_cancer(return_X_y=True)
    clf = RandomForestClassifier(n_estimators=trees, max_depth=depth, random_state=0,
                                 n_jobs=-1).fit(x, y)
    x, y = load_diabetes(return_X_y=True)
    reg = RandomForestRegressor(n_estimators=trees, max_depth=depth, random_state=0,
                                n_jobs=-1).fit(x, y)
    opset = {"": 17, "ai.onnx.ml": 3}
    return [
        ("RandomForestClassifier breast_cancer",
         to_onnx(clf, FEATURES["breast_cancer"][:1], options={id(clf): {"zipmap": False}},
                 target_opset=opset)),
        ("RandomForestRegressor diabetes", to_onnx(reg, FEATURES["diabetes"][:1], target_opset=opset)),
    ]


def boosting_cases(framework: str, trees: int, depth: int) -> list[tuple[str, object]]:
    """(label, ONNX model) for a LightGBM or XGBoost binary classifier and regressor."""
    try:
        from onnxmltools import convert_lightgbm, convert_xgboost
        from onnxmltools.convert.common.data_types import FloatTensorType
        module = __import__(framework)
    except ImportError as error:
        print(f"(no {framework} cases: {error})")
        return []
    x, y, xr, yr = FEATURES["classification"], LABELS["classification"], \
        FEATURES["regression"], LABELS["regression"]
    if framework == "lightgbm":
        # num_leaves as a full tree of `depth` levels would have; min_child_samples low so
        # that the later trees still split on these small data sets
        kw = {"n_estimators": trees, "max_depth": depth, "num_leaves": 2 ** depth,
              "min_child_samples": 2, "verbose": -1, "random_state": 0}
        clf, reg = module.LGBMClassifier(**kw).fit(x, y), module.LGBMRegressor(**kw).fit(xr, yr)
    else:
        kw = {"n_estimators": trees, "max_depth": depth, "random_state": 0}
        clf, reg = module.XGBClassifier(**kw).fit(x, y), module.XGBRegressor(**kw).fit(xr, yr)

    def convert(model, data: str, **options):
        types = [("X", FloatTensorType([None, FEATURES[data].shape[1]]))]
        # onnxmltools 1.16 converts up to opset 15
        if framework == "lightgbm":
            return convert_lightgbm(model, initial_types=types, target_opset=15, **options)
        return convert_xgboost(model, initial_types=types, target_opset=15)

    name = {"lightgbm": "LGBM", "xgboost": "XGB"}[framework]
    return [(f"{name}Classifier classification", convert(clf, "classification", zipmap=False)),
            (f"{name}Regressor regression", convert(reg, "regression"))]


_CLASSIFICATION = make_classification(n_samples=10000, n_features=20, n_informative=10,
                                      random_state=0)
_REGRESSION = make_regression(n_samples=10000, n_features=20, n_informative=10, noise=10.0,
                              random_state=0)
FEATURES = {"breast_cancer": load_breast_cancer(return_X_y=True)[0].astype(np.float32),
            "diabetes": load_diabetes(return_X_y=True)[0].astype(np.float32),
            "classification": _CLASSIFICATION[0].astype(np.float32),
            "regression": _REGRESSION[0].astype(np.float32)}
LABELS = {"classification": _CLASSIFICATION[1], "regression": _REGRESSION[1]}


def forest_size(onnx_model) -> tuple[int, int]:
    """(trees, nodes) of the model's tree ensemble."""
    for node in onnx_model.graph.node:
        for attr in node.attribute:
            if attr.name == "nodes_treeids":
                return len(set(attr.ints)), len(attr.ints)
    return 0, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--models", default="sklearn,lightgbm,xgboost",
                        help="comma-separated: sklearn, lightgbm, xgboost")
    args = parser.parse_args()
    cases = []
    for family in args.models.split(","):
        if family == "sklearn":
            cases += sklearn_cases(args.trees, args.depth)
        else:
            cases += boosting_cases(family, args.trees, args.depth)
    print(f"{args.trees} trees, max depth {args.depth}")
    print(f"{'model':40} {'batch':>6} {'cuvil us':>10} {'ort us':>10} {'cuvil/ort':>9}")
    for label, onnx_model in cases:
        data = FEATURES[label.split()[-1]]
        start = time.perf_counter()
        compiled = cuvil.compile(onnx_model)
        compile_s = time.perf_counter() - start
        session = ort.InferenceSession(onnx_model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        name = onnx_model.graph.input[0].name
        for batch in (1, 1000):
            feed = {name: np.resize(data, (batch, data.shape[1]))}
            ours = best_mean(functools.partial(compiled.run, feed))
            theirs = best_mean(functools.partial(session.run, None, feed))
            print(f"{label:40} {batch:>6} {ours * 1e6:>10.1f} {theirs * 1e6:>10.1f} "
                  f"{ours / theirs:>9.2f}")
        trees, nodes = forest_size(onnx_model)
        print(f"{'':40} ({trees} trees, {nodes / max(trees, 1):.0f} nodes a tree; "
              f"cuvil compile {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
