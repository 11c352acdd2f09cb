"""Parameter counts: a total and a per-module table."""

from __future__ import annotations

from torch import nn

__all__ = ["count_parameters", "parameter_table"]


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter entries of ``model``; a parameter shared by two modules (tied
    embeddings) counts once. Buffers (FAVOR's projection, sinusoidal tables) are not parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def parameter_table(model: nn.Module, *, depth: int = 2) -> str:
    """A markdown table of parameters per module, down to ``depth`` levels of names
    (``blocks.0.attn`` is depth 3), with each row's share of the total. A shared parameter is
    counted in the first module that owns it."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"parameter_table: depth must be an int >= 1, got {depth!r}")
    rows: dict[str, int] = {}
    for name, p in model.named_parameters():  # each shared parameter once
        prefix = ".".join(name.split(".")[:-1][:depth]) or "(root)"
        rows[prefix] = rows.get(prefix, 0) + p.numel()
    total = sum(rows.values())
    lines = ["| module | parameters | share |", "| --- | ---: | ---: |"]
    for prefix, n in rows.items():
        lines.append(f"| {prefix} | {n:,} | {100 * n / max(total, 1):.1f}% |")
    lines.append(f"| **total** | **{total:,}** | 100.0% |")
    return "\n".join(lines)
