"""Train the loan-risk pipeline and export it to ONNX with skl2onnx.

Data: a synthetic table of 3,000 loan applicants, made here with a fixed seed (scikit-learn
bundles no mixed numeric + categorical table). Each row is float32 [5]:

    0 age          years                       (about 5% missing: NaN)
    1 income       thousands a year            (about 5% missing: NaN)
    2 debt_ratio   monthly debt / income
    3 employment   0 salaried, 1 self-employed, 2 contract, 3 unemployed
    4 region       0..4

The label is a risk class, 0 low, 1 medium, 2 high, drawn from a noisy score of the columns.

Model: a scikit-learn Pipeline::

    ColumnTransformer(
        numeric  [0, 1, 2]: SimpleImputer(median) -> StandardScaler,
        category [3, 4]:    OneHotEncoder(handle_unknown="ignore"),
    ) -> GradientBoostingClassifier(100 trees a class, depth 3)

exported by skl2onnx with ``zipmap=False`` for the final classifier (opset 17, ai.onnx.ml 3):
input ``applicant`` float32 [batch, 5], outputs ``label`` int64 [batch] and
``probabilities`` float32 [batch, 3].

Run ``python train.py`` (needs scikit-learn, skl2onnx, onnx, onnxruntime). It checks that
onnxruntime's labels equal scikit-learn's and its probabilities are within 1e-5, then writes
``models/classifier.onnx`` and ``data/samples.npz``: 40 held-out applicants (with missing
values and an unknown region) and onnxruntime's labels and probabilities for them (keys
``applicants``, ``label``, ``probabilities``), which ``check.py`` compares with the wheel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE / "models" / "classifier.onnx"
SAMPLES_PATH = HERE / "data" / "samples.npz"

SEED = 0
ROWS = 3000
SAMPLES = 40
OPSET = {"": 17, "ai.onnx.ml": 3}
COLUMNS = ["age", "income", "debt_ratio", "employment", "region"]


def make_table(rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    age = rng.uniform(18, 75, rows)
    income = rng.lognormal(3.8, 0.5, rows)
    debt_ratio = rng.beta(2, 5, rows)
    employment = rng.choice(4, rows, p=[0.6, 0.2, 0.15, 0.05])
    region = rng.integers(0, 5, rows)
    score = (2.5 * debt_ratio - 0.012 * (income - 45) - 0.01 * (age - 45)
             + np.array([0.0, 0.3, 0.4, 1.2])[employment] + 0.15 * (region == 3)
             + rng.normal(0, 0.2, rows))
    label = np.digitize(score, np.quantile(score, [0.5, 0.8])).astype(np.int64)
    x = np.column_stack([age, income, debt_ratio, employment, region]).astype(np.float32)
    for column in (0, 1):
        x[rng.random(rows) < 0.05, column] = np.nan
    return x, label


def build_pipeline():
    from sklearn.compose import ColumnTransformer
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.impute import SimpleImputer
    from sklearn.pipeline import Pipeline, make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler

    return Pipeline([
        ("prepare", ColumnTransformer([
            ("numeric", make_pipeline(SimpleImputer(strategy="median"), StandardScaler()), [0, 1, 2]),
            ("category", OneHotEncoder(handle_unknown="ignore"), [3, 4]),
        ])),
        ("classify", GradientBoostingClassifier(n_estimators=100, max_depth=3, random_state=SEED)),
    ])


def export(pipeline):
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    classifier = pipeline.steps[-1][1]
    # zipmap=False: the probabilities as a float tensor, not a list of {class: probability}
    # maps (ZipMap), which a cuvil library cannot return
    return to_onnx(pipeline, initial_types=[("applicant", FloatTensorType([None, len(COLUMNS)]))],
                   options={id(classifier): {"zipmap": False}}, target_opset=OPSET)


def main() -> None:
    import onnx
    import onnxruntime as ort
    from sklearn.model_selection import train_test_split

    x, y = make_table(ROWS, np.random.default_rng(SEED))
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED,
                                                        stratify=y)
    pipeline = build_pipeline().fit(x_train, y_train)
    print(f"scikit-learn test accuracy: {pipeline.score(x_test, y_test):.3f}")

    onnx_model = export(pipeline)
    onnx.checker.check_model(onnx_model, full_check=True)
    MODEL_PATH.parent.mkdir(parents=True, exist_ok=True)
    MODEL_PATH.write_bytes(onnx_model.SerializeToString())
    ops = sorted({f"{n.domain or 'ai.onnx'}:{n.op_type}" for n in onnx_model.graph.node})
    print(f"wrote {MODEL_PATH.relative_to(HERE)} ({MODEL_PATH.stat().st_size} bytes): {', '.join(ops)}")

    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    label, probabilities = session.run(["label", "probabilities"], {"applicant": x_test})
    difference = float(np.abs(probabilities - pipeline.predict_proba(x_test)).max())
    print(f"max |onnxruntime - scikit-learn| probability: {difference:.1e}")
    if not np.array_equal(label, pipeline.predict(x_test)) or difference > 1e-5:
        raise SystemExit("onnxruntime and scikit-learn disagree")

    samples = x_test[:SAMPLES].copy()
    samples[0, 4] = 7  # a region the encoder never saw: all its one-hot columns are 0
    samples[1, 0] = samples[2, 1] = np.nan  # imputed with the training medians
    label, probabilities = session.run(["label", "probabilities"], {"applicant": samples})
    SAMPLES_PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(SAMPLES_PATH, applicants=samples, label=label, probabilities=probabilities)
    print(f"wrote {SAMPLES_PATH.relative_to(HERE)} ({SAMPLES} applicants, "
          f"{int(np.isnan(samples).any(axis=1).sum())} with missing values)")


if __name__ == "__main__":
    main()
