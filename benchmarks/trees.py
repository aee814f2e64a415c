"""Tree ensembles (ai.onnx.ml TreeEnsembleClassifier/Regressor) through cuvil and onnxruntime
in one run: scikit-learn forests trained on its bundled data (converted with skl2onnx), and
LightGBM and XGBoost gradient boosting (converted with onnxmltools) trained on 10,000 rows of
`make_classification` / `make_regression` (on the small bundled sets boosting stops splitting
after a few hundred trees, and later trees are stumps), timed at batch 1 and batch 1,000 and
at each thread count. Reports each engine's median latency (calls interleaved in blocks, as
`suite.py` takes them) and the ratio cuvil / onnxruntime (< 1: cuvil is faster).

    python benchmarks/trees.py                 # 1,000 trees each, 1 and 2 threads
    python benchmarks/trees.py --trees 200 --depth 6 --threads 1
    python benchmarks/trees.py --models lightgbm,xgboost

Each family is trained and converted in a process of its own, which writes the .onnx files
and the rows to time on to a cache (`--out`, default build/bench/trees/): LightGBM's and
XGBoost's OpenMP threads spin after training and would take a core from the timings, so this
process never loads them. A cached family is reused (`--retrain` trains it again).
LightGBM and XGBoost cases are left out when those packages (or onnxmltools) are missing.

Figures vary with the machine and its load; they belong in notes, not in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
BATCHES = (1, 1000)


# --- training: in a child process (`--train FAMILY`) ------------------------------------------


def _datasets() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_breast_cancer, load_diabetes, make_classification, make_regression

    return {"breast_cancer": load_breast_cancer(return_X_y=True),
            "diabetes": load_diabetes(return_X_y=True),
            "classification": make_classification(n_samples=10000, n_features=20,
                                                  n_informative=10, random_state=0),
            "regression": make_regression(n_samples=10000, n_features=20, n_informative=10,
                                          noise=10.0, random_state=0)}


def _sklearn_cases(trees: int, depth: int, data: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, ONNX model) for a random forest classifier and regressor."""
    from skl2onnx import to_onnx
    from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

    x, y = data["breast_cancer"]
    clf = RandomForestClassifier(n_estimators=trees, max_depth=depth, random_state=0,
                                 n_jobs=-1).fit(x, y)
    xr, yr = data["diabetes"]
    reg = RandomForestRegressor(n_estimators=trees, max_depth=depth, random_state=0,
                                n_jobs=-1).fit(xr, yr)
    opset = {"": 17, "ai.onnx.ml": 3}
    return [("RandomForestClassifier breast_cancer",
             to_onnx(clf, x[:1].astype(np.float32), options={id(clf): {"zipmap": False}},
                     target_opset=opset)),
            ("RandomForestRegressor diabetes",
             to_onnx(reg, xr[:1].astype(np.float32), target_opset=opset))]


def _boosting_cases(framework: str, trees: int, depth: int,
                    data: dict[str, Any]) -> list[tuple[str, Any]]:
    """(label, ONNX model) for a LightGBM or XGBoost binary classifier and regressor."""
    from onnxmltools import convert_lightgbm, convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    module = __import__(framework)
    (x, y), (xr, yr) = data["classification"], data["regression"]
    if framework == "lightgbm":
        # num_leaves as a full tree of `depth` levels would have; min_child_samples low so
        # that the later trees still split
        kw = {"n_estimators": trees, "max_depth": depth, "num_leaves": 2 ** depth,
              "min_child_samples": 2, "verbose": -1, "random_state": 0}
        clf, reg = module.LGBMClassifier(**kw).fit(x, y), module.LGBMRegressor(**kw).fit(xr, yr)
    else:
        kw = {"n_estimators": trees, "max_depth": depth, "random_state": 0}
        clf, reg = module.XGBClassifier(**kw).fit(x, y), module.XGBRegressor(**kw).fit(xr, yr)
    types = [("X", FloatTensorType([None, x.shape[1]]))]
    # onnxmltools 1.16 converts up to opset 15
    if framework == "lightgbm":
        pair = (convert_lightgbm(clf, initial_types=types, target_opset=15, zipmap=False),
                convert_lightgbm(reg, initial_types=types, target_opset=15))
    else:
        pair = (convert_xgboost(clf, initial_types=types, target_opset=15),
                convert_xgboost(reg, initial_types=types, target_opset=15))
    name = {"lightgbm": "LGBM", "xgboost": "XGB"}[framework]
    return [(f"{name}Classifier classification", pair[0]),
            (f"{name}Regressor regression", pair[1])]


def train(family: str, trees: int, depth: int, out: Path) -> None:
    """Train and convert one family's models; write each as <n>.onnx beside the rows it is
    timed on (<n>.npy, float32) and an index.json of labels."""
    data = _datasets()
    if family == "sklearn":
        cases = _sklearn_cases(trees, depth, data)
    else:
        cases = _boosting_cases(family, trees, depth, data)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for n, (label, model) in enumerate(cases):
        x = data[label.split()[-1]][0].astype(np.float32)
        np.save(out / f"{n}.npy", np.resize(x, (max(BATCHES), x.shape[1])))
        (out / f"{n}.onnx").write_bytes(model.SerializeToString())
        index.append(label)
    (out / "index.json").write_text(json.dumps(index))


def trained(family: str, args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label, .onnx path) of a family's models, trained in a child process unless cached."""
    where = Path(args.out) / f"{family}-{args.trees}x{args.depth}"
    if args.retrain or not (where / "index.json").exists():
        done = subprocess.run([sys.executable, __file__, "--train", family, "--trees",
                               str(args.trees), "--depth", str(args.depth), "--out", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:]
            print(f"(no {family} cases: {last[0] if last else done.returncode})")
            return []
    labels = json.loads((where / "index.json").read_text())
    return [(label, where / f"{n}.onnx") for n, label in enumerate(labels)]


# --- timing: this process loads cuvil and onnxruntime only ------------------------------------


def forest_size(onnx_model: Any) -> tuple[int, int]:
    """(trees, nodes) of the model's tree ensemble."""
    for node in onnx_model.graph.node:
        for attr in node.attribute:
            if attr.name == "nodes_treeids":
                return len(set(attr.ints)), len(attr.ints)
    return 0, 0


def max_diff(ours: dict[str, np.ndarray], theirs: list[np.ndarray]) -> float:
    """The largest difference of any output (labels included) from onnxruntime's."""
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
               for a, b in zip(ours.values(), theirs))


def load_text() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--models", default="sklearn,lightgbm,xgboost",
                        help="comma-separated: sklearn, lightgbm, xgboost")
    parser.add_argument("--threads", default="1,2",
                        help="thread counts: cuvil's model.num_threads and onnxruntime's "
                             "intra_op_num_threads (default 1,2)")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of calls per engine and configuration (default 1)")
    parser.add_argument("--out", default=str(HERE.parent / "build" / "bench" / "trees"),
                        help="cache of trained models (default build/bench/trees/)")
    parser.add_argument("--retrain", action="store_true", help="train cached families again")
    parser.add_argument("--train", help=argparse.SUPPRESS)  # the child process's job
    args = parser.parse_args()
    if args.train:
        train(args.train, args.trees, args.depth, Path(args.out))
        return

    import onnx
    import onnxruntime as ort

    sys.path.insert(0, str(HERE))
    import suite

    # onnxmltools declares the LightGBM classifier's label as [1]: onnxruntime warns on every
    # batch of more rows
    ort.set_default_logger_severity(3)

    import cuvil

    cases = [case for family in args.models.split(",") for case in trained(family, args)]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"{args.trees} trees, max depth {args.depth}; {load_text()}")
    print(f"{'model':40} {'batch':>6} {'threads':>7} {'cuvil us':>10} {'ort us':>10} "
          f"{'cuvil/ort':>9} {'max diff':>9}")
    for label, path in cases:
        onnx_model = onnx.load(str(path))
        rows = np.load(path.with_suffix(".npy"))
        start = time.perf_counter()
        compiled = cuvil.compile(onnx_model)
        compile_s = time.perf_counter() - start
        name = onnx_model.graph.input[0].name
        for count in threads:
            session = suite.ort_session(path, count)
            compiled.num_threads = count
            for batch in BATCHES:
                feed = {name: np.ascontiguousarray(rows[:batch])}
                diff = max_diff(compiled.run(feed), session.run(None, feed))
                times = suite.interleaved(
                    {"cuvil": lambda f=feed, m=compiled: m.run(f),
                     "ort": lambda f=feed, s=session: s.run(None, f)},
                    args.budget, min_runs=5)
                ours, theirs = (float(np.median(times[e])) for e in ("cuvil", "ort"))
                print(f"{label:40} {batch:>6} {count:>7} {ours * 1e6:>10.1f} "
                      f"{theirs * 1e6:>10.1f} {ours / theirs:>9.2f} {diff:>9.2g}", flush=True)
            del session
        trees, nodes = forest_size(onnx_model)
        print(f"{'':40} ({trees} trees, {nodes / max(trees, 1):.0f} nodes a tree; "
              f"cuvil compile {compile_s:.1f} s)")
    print(load_text())


if __name__ == "__main__":
    main()
