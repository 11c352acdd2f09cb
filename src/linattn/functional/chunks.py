"""The chunk layout of the chunked causal engines: how R independent rows of N positions are cut
into Nc chunks of C positions and worked on a tile of consecutive chunks at a time.

The chunked forms of gated linear attention (gated.py) and of the delta rule (delta.py) share it:
inputs are viewed as ``(R, Nc, C, X)`` (a view when C divides N; else the last chunk is filled with
zero positions, which every engine here treats as identity steps: no decay, no write, and their
outputs are dropped), and a tile's inputs are taken chunk-major, ``(m, R, C, X)``, so that the
sequential loop over its chunks reads and writes the ``(R, ...)`` slice of one chunk for all rows
at once, and the states saved between chunks (``(Nc + 1, R, D, Dv)``) index the same way. A tile
holds ``per_tile`` chunks: the batched per-chunk temporaries (C x C scores, D x D transitions)
then exist for one tile only, small whatever N is, and in cache.

Dimension legend: R rows (B*H), N positions, C chunk length, Nc chunks, m chunks of one tile,
X any trailing shape (none for a gate of one value a position).
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor

__all__ = ["ChunkLayout"]


class ChunkLayout(NamedTuple):
    """``R`` rows of ``N`` positions in ``Nc`` chunks of ``C``, ``per_tile`` chunks to a tile."""

    R: int
    N: int
    C: int
    Nc: int
    per_tile: int

    @staticmethod
    def of(R: int, N: int, chunk_size: int, *, chunks_per_tile: int | None = None,
           tile_positions: int | None = None) -> "ChunkLayout":
        """The layout for chunks of ``min(chunk_size, N)`` positions (N >= 1) with tiles of
        ``chunks_per_tile`` chunks, or of about ``tile_positions`` positions (all R rows together)."""
        if (chunks_per_tile is None) == (tile_positions is None):
            raise TypeError("ChunkLayout.of: give exactly one of chunks_per_tile and tile_positions")
        C = min(chunk_size, N)
        per = chunks_per_tile if chunks_per_tile is not None else max(1, tile_positions // (R * C))
        return ChunkLayout(R, N, C, -(-N // C), per)

    @property
    def fill(self) -> int:
        """Zero positions appended to fill the last chunk."""
        return self.Nc * self.C - self.N

    def chunked(self, x: Tensor | None) -> Tensor | None:
        """``x (R, N, *X)`` -> ``(R, Nc, C, *X)``: a view when C divides N, else a zero-filled copy."""
        if x is None:
            return None
        if self.fill:
            x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, self.fill])
        return x.reshape(self.R, self.Nc, self.C, *x.shape[2:])

    def new_chunked(self, like: Tensor, *X: int) -> Tensor:
        """An uninitialised ``(R, Nc, C, *X)`` tensor (dtype and device of ``like``) for outputs
        written tile by tile (:meth:`put`)."""
        return like.new_empty(self.R, self.Nc, self.C, *X)

    def unchunked(self, xc: Tensor) -> Tensor:
        """``xc (R, Nc, C, *X)`` -> ``(R, N, *X)``, fill positions dropped (a view)."""
        return xc.reshape(self.R, self.Nc * self.C, *xc.shape[3:])[:, :self.N]

    def tiles(self) -> list[slice]:
        """The chunks of each tile, in order."""
        return [slice(c, min(c + self.per_tile, self.Nc)) for c in range(0, self.Nc, self.per_tile)]

    @staticmethod
    def view(xc: Tensor, tile: slice) -> Tensor:
        """Chunks ``tile`` of ``xc (R, Nc, C, *X)``, chunk-major: a ``(m, R, C, *X)`` view."""
        return xc[:, tile].transpose(0, 1)

    @staticmethod
    def take(xc: Tensor | None, tile: slice) -> Tensor | None:
        """Chunks ``tile`` of ``xc (R, Nc, C, *X)``, chunk-major and contiguous: ``(m, R, C, *X)``."""
        return None if xc is None else xc[:, tile].transpose(0, 1).contiguous()

    @staticmethod
    def put(dst: Tensor, tile: slice, src: Tensor) -> None:
        """Write chunk-major ``src`` (``(m, R, C, *X)``, or ``(m*R, C, *X)``) into chunks ``tile`` of
        ``dst (R, Nc, C, *X)``."""
        dst[:, tile].copy_(src.view(-1, dst.shape[0], *dst.shape[2:]).transpose(0, 1))
