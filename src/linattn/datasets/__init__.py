"""Offline datasets read from installed packages (nothing is downloaded at run time).

Each loader verifies what it read (counts, sizes, checksums) and raises
:class:`MissingDataError` naming the package to install when the data is absent.
This tier imports nothing from the rest of linattn; experiments and conversion import it.
"""

from linattn.datasets.common import DataIntegrityError, MissingDataError
from linattn.datasets.shakespeare import (
    SHAKESPEARE_HELD_OUT,
    shakespeare_lines,
    shakespeare_plays,
    shakespeare_split,
)

__all__ = [
    "DataIntegrityError",
    "MissingDataError",
    "SHAKESPEARE_HELD_OUT",
    "shakespeare_lines",
    "shakespeare_plays",
    "shakespeare_split",
]
