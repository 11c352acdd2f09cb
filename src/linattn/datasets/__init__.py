"""Offline datasets read from installed packages (nothing is downloaded at run time).

Each loader verifies what it read (counts, sizes, checksums) and raises
:class:`MissingDataError` naming the package to install when the data is absent.
This tier imports nothing from the rest of linattn; experiments and conversion import it.
"""

from linattn.datasets.common import DataIntegrityError, MissingDataError
from linattn.datasets.digits import digits_images
from linattn.datasets.mnist import MNIST_PIXELS, mnist_images
from linattn.datasets.proteins import PROTEIN_VOCAB, protein_sequences, protein_tokens
from linattn.datasets.shakespeare import (
    SHAKESPEARE_HELD_OUT,
    shakespeare_lines,
    shakespeare_plays,
    shakespeare_split,
)

__all__ = [
    "DataIntegrityError",
    "MNIST_PIXELS",
    "MissingDataError",
    "PROTEIN_VOCAB",
    "SHAKESPEARE_HELD_OUT",
    "digits_images",
    "mnist_images",
    "protein_sequences",
    "protein_tokens",
    "shakespeare_lines",
    "shakespeare_plays",
    "shakespeare_split",
]
