"""Check the installed digit-reader package against onnxruntime's reference results.

Reads ``data/pixels.npy`` (20 held-out digits as 0..16 pixels) and ``data/samples.npz``
(the same images scaled, with onnxruntime's probabilities for them), needs only numpy and the
installed wheel. Exit status 0 when the package reads the digits onnxruntime reads, with
probabilities within 1e-4; 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import digit_reader
import numpy as np

DATA = Path(__file__).resolve().parent / "data"


def main() -> int:
    reference = np.load(DATA / "samples.npz")["probabilities"]
    labels, confidence = digit_reader.read_digits(np.load(DATA / "pixels.npy"))
    expected = reference.argmax(axis=1)
    difference = float(np.abs(confidence - reference.max(axis=1)).max())
    print(f"digit_reader {digit_reader.__version__}: read {labels.tolist()}")
    print(f"max |probability - onnxruntime's| = {difference:.1e}")
    ok = np.array_equal(labels, expected) and difference <= 1e-4
    if not ok:
        print(f"error: onnxruntime reads {expected.tolist()}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
