"""digit_reader: reads handwritten digits (8x8 grey images) with a model compiled by cuvil.

    >>> labels, confidence = digit_reader.read_digits(pixels)  # pixels 0..16, [N, 8, 8]

`classifier` is the compiled model itself (float32 [batch, 1, 8, 8] -> [batch, 10]).
"""

__version__ = "1.1.0"

# cuvil generates `_cuvil_models` (the package has its own __init__.py); re-export the model
from ._cuvil_models import classifier
from .process import preprocess, read_digits

__all__ = ["classifier", "preprocess", "read_digits"]
