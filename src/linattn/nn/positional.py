"""Position encodings: sinusoidal table (Vaswani et al., arXiv 1706.03762) and rotary embeddings
(RoFormer, Su et al., arXiv 2104.09864).

Dimension legend: B batch, H heads, N positions, D head width (even for rotary), C model width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional.varlen import int64_offsets

__all__ = ["apply_rotary", "document_positions", "rotary_angles", "sinusoidal_table"]


def document_positions(cu_seqlens: Tensor, T: int) -> Tensor:
    """The position of every packed token within its own document, ``(T,)`` int64, for documents
    packed along one sequence of ``T`` tokens with offsets ``cu_seqlens = [0, c_1, ..., T]`` (see
    :mod:`linattn.functional.varlen`): positions restart at 0 at every document, so a document gets
    the same position encodings packed as alone. ``T`` is the caller's length (the inputs' shape),
    so nothing is read from ``cu_seqlens`` on the host. Any integer dtype; checked offsets
    (:func:`linattn.functional.varlen.check_cu_seqlens`): unchecked ones fail or mislead here."""
    cu_seqlens = int64_offsets(cu_seqlens)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (n,)
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T)  # (T,) its document's offset
    return torch.arange(T, device=cu_seqlens.device) - starts


def sinusoidal_table(n_positions: int, dim: int, *, base: float = 10000.0, device=None,
                     dtype=None) -> Tensor:
    """``(n_positions, dim)``: sin in even columns, cos in odd ones, frequencies base^(-2i/dim)."""
    pos = torch.arange(n_positions, device=device, dtype=torch.float64)[:, None]  # (N, 1)
    freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)  # (ceil(C/2),)
    table = torch.zeros(n_positions, dim, device=device, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table.to(dtype or torch.get_default_dtype())


def rotary_angles(positions: Tensor, dim: int, *, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin ``(N, dim/2)`` of the angles ``p * base^(-2i/dim)`` for ``positions (N,)``.

    Computed in float64 whatever the model dtype: at p in the tens of thousands a float32 angle is
    off by ~1e-3 rad. Every position's angle is computed alone, so a position gets bitwise the same
    angle in a whole-sequence forward and in a one-token step.
    """
    if dim % 2:
        raise ValueError(f"rotary_angles: dim must be even (dimensions are rotated in pairs), got {dim}")
    freq = base ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)
    ang = positions.to(torch.float64)[:, None] * freq[None, :]  # (N, dim/2)
    return torch.cos(ang), torch.sin(ang)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x_i, x_{i + D/2})`` of ``x (B, H, N, D)`` by the angles of ``cos, sin (N, D/2)``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, N, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
