"""20,000 UniProt protein sequences from the Debian package ``mmseqs2-examples``.

Installed with ``apt-get install --no-install-recommends mmseqs2-examples`` (``make setup`` does it
when run as root): ``/usr/share/doc/mmseqs2/example-data/DB.fasta.gz``, mean length 453, max 8081.
Residues map to a 25-token vocabulary: padding/separator 0, the 20 standard amino acids, then X for
unknown, B/Z/U/O/J merged into X (rare: ambiguous or non-standard residues). The held-out split is
every 10th record in file order (deterministic, by record, so no sequence is in both splits).
"""

from __future__ import annotations

import gzip
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from linattn.datasets.common import DataIntegrityError, MissingDataError, sha256_of

INSTALL_HINT = "apt-get install --no-install-recommends mmseqs2-examples"
PROTEINS_PATH = Path("/usr/share/doc/mmseqs2/example-data/DB.fasta.gz")
# Pinned from Debian's mmseqs2-examples DB.fasta.gz.
PROTEINS_SHA256 = "92a65aa435f5d3e0f33eb47d87910fe7fc6033a28bf4ed1367094377d791d567"
PROTEINS_COUNT = 20_000
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
# id 0 separates concatenated sequences (the "end of protein" token); 1..20 the standard residues; 21 X.
PROTEIN_VOCAB = ("<sep>",) + tuple(AMINO_ACIDS) + ("X",)
HELD_OUT_EVERY = 10

_TABLE = np.full(256, PROTEIN_VOCAB.index("X"), dtype=np.uint8)
for _i, _a in enumerate(AMINO_ACIDS, start=1):
    _TABLE[ord(_a)] = _TABLE[ord(_a.lower())] = _i


def _path() -> Path:
    return Path(os.environ.get("LINATTN_PROTEINS_FASTA", PROTEINS_PATH))


@lru_cache(maxsize=2)
def _records(path: Path) -> tuple[tuple[str, str], ...]:
    if not path.is_file():
        raise MissingDataError(f"{path} not found: the protein sequences come from the Debian package "
                               f"mmseqs2-examples; install it with: {INSTALL_HINT}")
    raw = path.read_bytes()
    digest = sha256_of([raw])
    if digest != PROTEINS_SHA256:
        raise DataIntegrityError(f"{path} has SHA-256 {digest}, expected {PROTEINS_SHA256} (mmseqs2-examples)")
    records, name, parts = [], None, []
    for line in gzip.decompress(raw).decode("ascii").splitlines():
        if line.startswith(">"):
            if name is not None:
                records.append((name, "".join(parts)))
            name, parts = line[1:].split()[0], []
        elif line:
            parts.append(line.strip())
    if name is not None:
        records.append((name, "".join(parts)))
    if len(records) != PROTEINS_COUNT:
        raise DataIntegrityError(f"{path}: {len(records)} records, expected {PROTEINS_COUNT}")
    return tuple(records)


def protein_sequences(split: str = "all") -> list[tuple[str, str]]:
    """``[(accession, residues), ...]`` in file order; ``split`` is ``"all"``, ``"train"`` or ``"held_out"``
    (every :data:`HELD_OUT_EVERY`-th record, 2,000 of them).

    Raises:
        MissingDataError: mmseqs2-examples is not installed.
        DataIntegrityError: the file's checksum or record count differs.
    """
    if split not in ("all", "train", "held_out"):
        raise ValueError(f"split must be 'all', 'train' or 'held_out', got {split!r}")
    records = _records(_path())
    if split == "all":
        return list(records)
    held = split == "held_out"
    return [r for i, r in enumerate(records) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held]


def protein_tokens(split: str) -> np.ndarray:
    """The sequences of ``split`` concatenated into one uint8 token stream, each preceded by the
    separator 0 (so a model sees where a protein starts); ids index :data:`PROTEIN_VOCAB`."""
    seqs = protein_sequences(split)
    parts = []
    for _, residues in seqs:
        parts.append(np.zeros(1, dtype=np.uint8))
        parts.append(_TABLE[np.frombuffer(residues.encode("ascii"), dtype=np.uint8)])
    return np.concatenate(parts)
