"""Import the built package, run the model and compare with numpy's SoftClip; exit 0 if equal.

    pip install dist/softclip_cuvil-1.0.0-*.whl && python check.py
"""

import sys
from pathlib import Path

import numpy as np
import softclip

reference = np.load(Path(__file__).parent / "data" / "reference.npz")
w, alpha = reference["w"], float(reference["alpha"])
x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)

y = softclip.net(x)
want = alpha * np.tanh((x @ w) / alpha)
if y.shape != want.shape or not np.allclose(y, want, rtol=1e-5, atol=1e-6):
    print(f"softclip.net differs from numpy: max error {np.abs(y - want).max()}", file=sys.stderr)
    sys.exit(1)
print(f"softclip.net matches numpy on {x.shape[0]} rows (max |y| = {np.abs(y).max():.3f} < alpha = {alpha})")
