"""Check the installed loan_risk package against onnxruntime's reference results.

Reads ``data/samples.npz`` (written by ``train.py``: 40 held-out applicants, some with missing
values and one with a region the encoder never saw, and onnxruntime's labels and probabilities
for them); needs only numpy and the installed wheel. Exit status 0 when the package's labels
equal onnxruntime's and its probabilities are within 1e-5; 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import loan_risk
import numpy as np

SAMPLES = Path(__file__).resolve().parent / "data" / "samples.npz"
RISK = ["low", "medium", "high"]


def main() -> int:
    data = np.load(SAMPLES)
    label, probabilities = loan_risk.classifier(data["applicants"])
    for row, (k, p) in enumerate(zip(label[:5], probabilities[:5])):
        print(f"applicant {row}: {RISK[k]} risk ({p[k]:.3f})")
    difference = float(np.abs(probabilities - data["probabilities"]).max())
    same = bool(np.array_equal(label, data["label"]))
    print(f"{len(label)} applicants: labels {'equal' if same else 'DIFFER from'} onnxruntime's, "
          f"max |probability - onnxruntime's| = {difference:.1e}")
    return 0 if same and difference <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
