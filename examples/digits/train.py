"""Train the digits classifier and export it to ONNX.

Data: scikit-learn's bundled digits set (``sklearn.datasets.load_digits``, 1797 grey 8x8
images of the digits 0-9, no download). Pixels (0..16) are scaled to [0, 1] by ``x / 16``.

Split (reproduce it with :func:`load_split`, which does not need torch)::

    train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)

giving 1347 training and 450 test images. Images are float32 arrays shaped [N, 1, 8, 8]
(NCHW), labels int64 digits.

Model (about 3.7k parameters), input ``image`` float32 [batch, 1, 8, 8], output
``probabilities`` float32 [batch, 10] (softmax over the ten digits)::

    Conv(1->8, 3x3, pad 1) + BatchNorm + ReLU + MaxPool 2x2      -> [8, 4, 4]
    Conv(8->16, 3x3, pad 1) + ReLU + AveragePool 2x2             -> [16, 2, 2]
    Flatten + Linear(64->32) + ReLU + Dropout(0.2) + Linear(32->10) + Softmax

Run ``python train.py`` (needs torch, onnx, onnxruntime, scikit-learn). It trains with a
fixed seed on one thread, exports ``models/classifier.onnx`` with the TorchScript exporter
(opset 17, dynamic batch dimension), checks the file with ``onnx.checker``, verifies with
onnxruntime that the ONNX model's test predictions equal torch's, and writes
``data/samples.npz``: 20 held-out test images (two per digit) with their labels and the
onnxruntime probabilities as reference outputs (keys ``images``, ``labels``,
``probabilities``), used by ``predict.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE / "models" / "classifier.onnx"
SAMPLES_PATH = HERE / "data" / "samples.npz"

SEED = 0
OPSET = 17
EPOCHS = 60
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 1e-4
SAMPLES_PER_DIGIT = 2
MIN_ACCURACY = 0.95
# The op types the exported graph may contain (BatchNormalization is normally folded into
# the first Conv by the exporter in eval mode).
ALLOWED_OPS = {
    "Conv", "BatchNormalization", "Relu", "MaxPool", "AveragePool", "GlobalAveragePool",
    "Flatten", "Reshape", "Gemm", "MatMul", "Add", "Softmax", "Identity",
}  # fmt: skip


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(x_train, x_test, y_train, y_test)`` for the digits data.

    Images are float32 [N, 1, 8, 8] scaled to [0, 1] (``x / 16``); labels are int64.
    The split is ``train_test_split(test_size=0.25, random_state=0, stratify=y)``:
    1347 training and 450 test images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y
    )
    return x_train, x_test, y_train, y_test


def build_model():
    from collections import OrderedDict

    from torch import nn

    # Named layers give readable initializer and node names in the ONNX graph
    # ("conv2.weight", "/fc1/Gemm", ...).
    layers = OrderedDict(
        conv1=nn.Conv2d(1, 8, kernel_size=3, padding=1),
        bn1=nn.BatchNorm2d(8),
        relu1=nn.ReLU(),
        pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(8, 16, kernel_size=3, padding=1),
        relu2=nn.ReLU(),
        pool2=nn.AvgPool2d(2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(16 * 2 * 2, 32),
        relu3=nn.ReLU(),
        dropout=nn.Dropout(0.2),
        fc2=nn.Linear(32, 10),
        softmax=nn.Softmax(dim=1),
    )
    return nn.Sequential(layers)


def train(x_train: np.ndarray, y_train: np.ndarray, epochs: int = EPOCHS):
    """Train the CNN deterministically; return it in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    model = build_model()
    # The model ends in Softmax, so train on log-probabilities with NLL (= cross-entropy).
    loss_fn = nn.NLLLoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    xs = torch.from_numpy(x_train)
    ys = torch.from_numpy(y_train)
    generator = torch.Generator().manual_seed(SEED)

    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(xs), generator=generator)
        total = 0.0
        for start in range(0, len(xs), BATCH_SIZE):
            idx = order[start : start + BATCH_SIZE]
            optimizer.zero_grad()
            probs = model(xs[idx])
            loss = loss_fn(torch.log(probs.clamp_min(1e-12)), ys[idx])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        scheduler.step()
        if (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1:3d}  train loss {total / len(xs):.4f}")

    model.eval()
    return model


def predict_torch(model, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def export(model, path: Path) -> None:
    """Export with the TorchScript (non-dynamo) exporter, opset 17, dynamic batch."""
    import warnings

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(1, 1, 8, 8, dtype=torch.float32)
    with warnings.catch_warnings():
        # The legacy exporter is chosen on purpose: it gives a small graph of plain ops.
        warnings.filterwarnings(
            "ignore", "You are using the legacy TorchScript", DeprecationWarning
        )
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=["image"],
            output_names=["probabilities"],
            dynamic_axes={"image": {0: "batch"}, "probabilities": {0: "batch"}},
        )


def check_onnx(path: Path):
    import onnx

    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    ops = sorted({node.op_type for node in model.graph.node})
    unexpected = set(ops) - ALLOWED_OPS
    if unexpected:
        raise SystemExit(f"unexpected op types in {path.name}: {sorted(unexpected)}")
    return model, ops


def predict_onnxruntime(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (probs,) = session.run(["probabilities"], {"image": x})
    return probs


def pick_samples(x_test: np.ndarray, y_test: np.ndarray) -> np.ndarray:
    """Indices of the first SAMPLES_PER_DIGIT test images of each digit, in test order."""
    chosen = [np.flatnonzero(y_test == d)[:SAMPLES_PER_DIGIT] for d in range(10)]
    return np.sort(np.concatenate(chosen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    args = parser.parse_args()

    x_train, x_test, y_train, y_test = load_split()
    print(f"train {x_train.shape} test {x_test.shape}")

    model = train(x_train, y_train, epochs=args.epochs)
    n_params = sum(p.numel() for p in model.parameters())
    torch_probs = predict_torch(model, x_test)
    torch_acc = float((torch_probs.argmax(1) == y_test).mean())
    print(f"parameters: {n_params}")
    print(f"torch test accuracy: {torch_acc:.4f}")

    export(model, MODEL_PATH)
    onnx_model, ops = check_onnx(MODEL_PATH)
    opsets = {o.domain or "ai.onnx": o.version for o in onnx_model.opset_import}
    print(f"exported {MODEL_PATH.relative_to(HERE)} ({MODEL_PATH.stat().st_size} bytes)")
    print(f"opset: {opsets}  ir_version: {onnx_model.ir_version}")
    print(f"ops: {', '.join(ops)}")

    ort_probs = predict_onnxruntime(MODEL_PATH, x_test)
    ort_acc = float((ort_probs.argmax(1) == y_test).mean())
    max_diff = float(np.abs(ort_probs - torch_probs).max())
    print(f"onnxruntime test accuracy: {ort_acc:.4f}  (max |onnxruntime - torch| = {max_diff:.2e})")
    if not np.array_equal(ort_probs.argmax(1), torch_probs.argmax(1)) or ort_acc != torch_acc:
        raise SystemExit("onnxruntime and torch predictions differ")
    if ort_acc < MIN_ACCURACY:
        raise SystemExit(f"test accuracy {ort_acc:.4f} is below {MIN_ACCURACY}")

    idx = pick_samples(x_test, y_test)
    SAMPLES_PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        SAMPLES_PATH,
        images=np.ascontiguousarray(x_test[idx]),
        labels=y_test[idx],
        probabilities=ort_probs[idx],
    )
    print(
        f"wrote {SAMPLES_PATH.relative_to(HERE)} ({len(idx)} samples, "
        f"{SAMPLES_PATH.stat().st_size} bytes)"
    )


if __name__ == "__main__":
    main()
