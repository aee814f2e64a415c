"""Classify the bundled held-out digits with the installed, cuvil-compiled `digits` package.

Needs only numpy and the `digits` wheel built from this folder (no cuvil, torch, onnx or
onnxruntime). It reads ``data/samples.npz`` (written by ``train.py``: 20 test images that the
model never saw in training, their labels, and onnxruntime's probabilities for them), prints
each prediction with its probability and the true label, and the accuracy.

Exit status: 0 if the compiled model agrees with onnxruntime (same predicted digit for every
sample and probabilities within ``--tolerance``), 1 otherwise. So it doubles as a smoke test
of the installed wheel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import digits
import numpy as np

DEFAULT_SAMPLES = Path(__file__).resolve().parent / "data" / "samples.npz"


def describe(tensors) -> str:
    specs = tensors.values() if isinstance(tensors, dict) else tensors
    return ", ".join(f"{t.name}: {np.dtype(t.dtype)} {list(t.shape)}" for t in specs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("samples", nargs="?", type=Path, default=DEFAULT_SAMPLES)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest allowed |compiled - onnxruntime| probability difference (default 1e-4)",
    )
    args = parser.parse_args(argv)

    data = np.load(args.samples)
    images = data["images"].astype(np.float32)  # [N, 1, 8, 8], pixels in [0, 1]
    labels = data["labels"]
    reference = data["probabilities"]

    model = digits.classifier
    print(f"inputs:  {describe(model.inputs)}")
    print(f"outputs: {describe(model.outputs)}")

    probs = np.asarray(model(images))  # one output -> one array, [N, 10]
    by_name = model.run({"image": images})["probabilities"]
    single = np.concatenate([np.asarray(model(images[i : i + 1])) for i in range(len(images))])

    predicted = probs.argmax(axis=1)
    print()
    print(" #  predicted  probability  true")
    for i, (p, y) in enumerate(zip(predicted, labels)):
        mark = "" if p == y else "   <- wrong"
        print(f"{i:2d}  {p:9d}  {probs[i, p]:11.4f}  {y:4d}{mark}")
    accuracy = float((predicted == labels).mean())
    print(f"\naccuracy: {int((predicted == labels).sum())}/{len(labels)} = {accuracy:.2%}")

    problems = []
    if probs.shape != reference.shape or probs.dtype != np.float32:
        problems.append(
            f"output is {probs.dtype} {probs.shape}, expected float32 {reference.shape}"
        )
    else:
        diff = float(np.abs(probs - reference).max())
        print(f"max |compiled - onnxruntime| = {diff:.2e}")
        if diff > args.tolerance:
            problems.append(f"probabilities differ from onnxruntime by {diff:.2e}")
        if not np.array_equal(predicted, reference.argmax(axis=1)):
            problems.append("predicted digits differ from onnxruntime's")
        if not np.allclose(by_name, probs, rtol=0, atol=1e-6):
            problems.append("classifier.run({'image': x}) differs from classifier(x)")
        if not np.allclose(single, probs, rtol=0, atol=1e-6):
            problems.append("batch-of-one results differ from the full batch")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
