"""The one progress display of every long command (training, the sweep, the demo, experiments,
distillation): a tqdm bar on standard error, shown only on a terminal.

Below every tier (no linattn imports; tqdm is imported when a bar is made, not with linattn).
What a run must keep (losses, timings) goes to its files, never only to the bar: a run under
``nohup`` or CI, whose standard error is not a terminal, shows no bar and loses nothing.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar", "say"]


def progress_bar(total: float | None = None, *, desc: str = "", unit: str = "it", quiet: bool = False,
                 initial: float = 0, **options: Any):
    """A tqdm bar of ``total`` units on stderr; disabled when ``quiet`` or when stderr is not a
    terminal. ``options`` go to tqdm (``bar_format``, ``postfix``, ...). Use as a context manager
    or call ``close()``; ``set_postfix_str`` carries the current numbers (loss, tokens/s)."""
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=disable, file=sys.stderr,
                dynamic_ncols=True, leave=True, **options)


def say(*parts: Any, quiet: bool = False) -> None:
    """A line on stdout (headers, results, where the output went), flushed at once; nothing when
    ``quiet``. Progress goes to :func:`progress_bar`, not here."""
    if not quiet:
        print(*parts, flush=True)
