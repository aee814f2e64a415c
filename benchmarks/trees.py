"""Tree ensembles (ai.onnx.ml TreeEnsembleClassifier/Regressor) through cuvil and onnxruntime
in one run: scikit-learn forests trained on its bundled data, converted with skl2onnx, timed
at batch 1 and batch 1,000. Reports each engine's best-of-5 mean latency and the ratio
cuvil / onnxruntime (< 1: cuvil is faster).

    python benchmarks/trees.py                 # 1,000 trees
    python benchmarks/trees.py --trees 200 --depth 6

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
from sklearn.datasets import load_breast_cancer, load_diabetes
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=8)
    args = parser.parse_args()
    cases = []
    x, y = load_breast_cancer(return_X_y=True)
    clf = RandomForestClassifier(n_estimators=args.trees, max_depth=args.depth, random_state=0,
                                 n_jobs=-1).fit(x, y)
    cases.append(("RandomForestClassifier breast_cancer", clf, x.astype(np.float32),
                  {id(clf): {"zipmap": False}}))
    x, y = load_diabetes(return_X_y=True)
    reg = RandomForestRegressor(n_estimators=args.trees, max_depth=args.depth, random_state=0,
                                n_jobs=-1).fit(x, y)
    cases.append(("RandomForestRegressor diabetes", reg, x.astype(np.float32), None))
    print(f"{args.trees} trees, max depth {args.depth}")
    print(f"{'model':40} {'batch':>6} {'cuvil us':>10} {'ort us':>10} {'cuvil/ort':>9}")
    for label, model, data, options in cases:
        onnx_model = to_onnx(model, data[:1], options=options,
                             target_opset={"": 17, "ai.onnx.ml": 3})
        start = time.perf_counter()
        compiled = cuvil.compile(onnx_model)
        compile_s = time.perf_counter() - start
        session = ort.InferenceSession(onnx_model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        name = onnx_model.graph.input[0].name
        for batch in (1, 1000):
            feed = {name: np.resize(data, (batch, data.shape[1])).astype(np.float32)}
            ours = best_mean(functools.partial(compiled.run, feed))
            theirs = best_mean(functools.partial(session.run, None, feed))
            print(f"{label:40} {batch:>6} {ours * 1e6:>10.1f} {theirs * 1e6:>10.1f} "
                  f"{ours / theirs:>9.2f}")
        print(f"{'':40} (cuvil compile {compile_s:.1f} s)")


if __name__ == "__main__":
    main()
