"""scikit-learn's bundled 8 x 8 digits (1,797 images, values 0..16): a tiny stand-in for MNIST in tests."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from linattn.datasets.common import DataIntegrityError, MissingDataError

INSTALL_HINT = "pip install scikit-learn"
DIGITS_COUNT = 1797
DIGITS_LEVELS = 17  # pixel values 0..16


@lru_cache(maxsize=1)
def digits_images() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: images ``(1797, 64)`` uint8 in 0..16, row-major 8 x 8; labels ``(1797,)``.

    Raises:
        MissingDataError: scikit-learn is not installed.
        DataIntegrityError: the count or the value range differs from scikit-learn's bundled set.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MissingDataError(f"scikit-learn is not installed; install it with: {INSTALL_HINT}") from None
    d = load_digits()
    x, y = d.data, d.target
    if x.shape != (DIGITS_COUNT, 64) or x.min() < 0 or x.max() >= DIGITS_LEVELS or np.any(x != np.rint(x)):
        raise DataIntegrityError(f"sklearn digits: images {x.shape} with values {x.min()}..{x.max()}; expected "
                                 f"({DIGITS_COUNT}, 64) integers in 0..{DIGITS_LEVELS - 1}")
    return x.astype(np.uint8), y.astype(np.int64)
