"""Optional extras: what each group of commands needs beyond the core install, checked before work.

``pip install linattn`` installs the attention code and nothing that draws a figure. The commands
that write plots (``linattn demo``, ``linattn bench sweep|full|favor --what approx`` and every
``linattn experiment``) call :func:`require_extra` before they start measuring or training, so
that a missing library fails in the first second with the command to install it, instead of
after minutes of work at the moment the plot is drawn.

This module imports nothing beyond the standard library: checking for a package must not import it.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "MissingExtraError", "require_extra"]

# extra name (as in pyproject.toml's [project.optional-dependencies]) -> the import names it provides
# that the commands check for; tests/test_extras.py holds this table and pyproject.toml to each other.
EXTRAS: dict[str, tuple[str, ...]] = {
    "bench": ("matplotlib",),
    "experiments": ("matplotlib",),
    "transformers": ("transformers",),
}
# what each extra's packages are for, in the message of a missing one
PURPOSES: dict[str, str] = {"bench": "for its plots", "experiments": "for its plots",
                            "transformers": "the Hugging Face models it runs"}


class MissingExtraError(ModuleNotFoundError):
    """A command needs a package of an optional extra that is not installed."""


def require_extra(extra: str, *, command: str) -> None:
    """Raise :class:`MissingExtraError` naming ``command``, the missing packages and the extra to
    install, unless every package of ``extra`` can be imported.

    Looks the packages up without importing them (``importlib.util.find_spec``); a package set
    to None in ``sys.modules`` counts as missing, as it does for ``import``.
    """
    if extra not in EXTRAS:
        raise ValueError(f"require_extra: unknown extra {extra!r}; known: {sorted(EXTRAS)}")
    missing = [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"{command} needs {', '.join(missing)} ({PURPOSES[extra]}), which is not installed; nothing was run. "
            f"Install the optional extra: pip install 'linattn[{extra}]'",
            name=missing[0],
        )
