"""Pre- and post-processing around the compiled classifier."""

from __future__ import annotations

import numpy as np

from ._cuvil_models import classifier

MAX_PIXEL = 16  # scikit-learn's digits count 0..16 ink per pixel


def preprocess(pixels: np.ndarray) -> np.ndarray:
    """Images of 0..16 pixel values, shaped [8, 8], [N, 8, 8] or [N, 64], as the model's
    float32 [N, 1, 8, 8] input scaled to [0, 1]."""
    array = np.asarray(pixels)
    if array.shape[-2:] != (8, 8):
        array = array.reshape(-1, 8, 8)
    if array.min(initial=0) < 0 or array.max(initial=0) > MAX_PIXEL:
        raise ValueError(f"pixel values must lie in 0..{MAX_PIXEL}")
    return (array.reshape(-1, 1, 8, 8) / MAX_PIXEL).astype(np.float32)


def read_digits(pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The digit in each image and the model's probability for it."""
    probabilities = classifier(preprocess(pixels))
    labels = probabilities.argmax(axis=1)
    return labels, probabilities[np.arange(len(labels)), labels]
