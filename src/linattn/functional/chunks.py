"""The chunk layout of the chunked causal engines: how R independent rows of N positions are cut
into Nc chunks of C positions and worked on a tile of consecutive chunks at a time.

The chunked forms of gated linear attention (gated.py) and of the delta rule (delta.py) share it:
inputs are viewed as ``(R, Nc, C, X)`` (a view when C divides N; else the last chunk is filled with
zero positions, which every engine here treats as identity steps: no decay, no write, and their
outputs are dropped), and a tile's inputs are taken chunk-major, ``(m, R, C, X)``, so that the
sequential loop over its chunks reads and writes the ``(R, ...)`` slice of one chunk for all rows
at once, and the states saved between chunks or tiles (``(Nc + 1, R, D, Dv)``, or one per tile)
index the same way. A tile holds ``per_tile`` chunks: the batched per-chunk temporaries (C x C
scores, D x D transitions) then exist for one tile only, small whatever N is, and in cache; an
engine can write them into :class:`TileBuffers` that every tile reuses.

Dimension legend: R rows (B*H), N positions, C chunk length, Nc chunks, m chunks of one tile,
X any trailing shape (none for a gate of one value a position).

Row tiles (:meth:`ChunkLayout.by_rows`) are the other order, for an engine whose chunk states are
prefix sums rather than a recurrence (no gate: linear attention's product): a tile is either a group
of whole rows or a block of consecutive chunks of one row, so that its inputs, ``(R, N, X)`` in
memory, are a ``(r*m, C, X)`` view that batched matmuls read and write in place (no copy in, no
copy out), and the state is carried from block to block of a row. Only the last chunk of a row is
ever filled, and only a tile holding it is copied.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ChunkLayout", "TileBuffers", "cumsum_in_chunks", "release_kept_buffers"]

_KEPT = threading.local()


class TileBuffers:
    """Named buffers that the tiles of one call reuse, one tile after another: ``buffers(name,
    *shape)`` is a ``shape`` view of the buffer ``name``, made (dtype and device of ``like``) for
    the first tile that asks, and handed again to every later tile (the last may be smaller).

    Why: a fresh tensor of a few MiB is page-faulted on every allocation on a CPU (glibc hands a
    large freed block back to the OS, and maps it again for the next), and a tile's temporaries
    are that large at real widths (16 heads of 128: 2 MiB each); written into the first tile's
    buffers, later tiles fault nothing. A name must stand for one tensor at a time: a tile asks
    again only once the earlier view is dead."""

    def __init__(self, like: Tensor) -> None:
        self.dtype, self.device = like.dtype, like.device  # not like itself: kept buffers would keep it alive
        self.buffers: dict[str, Tensor] = {}

    @staticmethod
    def kept(like: Tensor) -> "TileBuffers":
        """The calling thread's buffers for ``like``'s dtype on the CPU, kept from call to call, so
        that a call's first tile faults nothing either (a new set for other devices, whose
        allocators keep freed memory themselves). They hold what the largest tile asked for, a few
        tiles' temporaries (tens of MiB at 16 heads of 128), until :func:`release_kept_buffers`.
        Per thread: calls on two threads at once never share one. A call must not run inside
        another on the same thread (the engines here never do)."""
        if like.device.type != "cpu":
            return TileBuffers(like)
        kept = _KEPT.__dict__.setdefault("buffers", {})
        buffers = kept.get(like.dtype)
        if buffers is None:
            buffers = kept[like.dtype] = TileBuffers(like)
        return buffers

    def __call__(self, name: str, *shape: int) -> Tensor:
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return buf[:numel].view(shape)


def release_kept_buffers() -> None:
    """Free the calling thread's kept tile buffers (:meth:`TileBuffers.kept`)."""
    _KEPT.__dict__.pop("buffers", None)


@functools.lru_cache(maxsize=64)
def _ones_triangle(C: int, reverse: bool, exclusive: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(C, C)``: entry (t, s) 1 where position s's term is in position t's sum (:func:`cumsum_in_chunks`),
    0 elsewhere; made once per shape, dtype and device, and only read."""
    ones = torch.ones(C, C, dtype=dtype, device=device)
    skip = 1 if exclusive else 0
    return ones.triu_(skip) if reverse else ones.tril_(-skip)


def cumsum_in_chunks(x: Tensor, dim: int, *, reverse: bool = False, exclusive: bool = False) -> Tensor:
    """The cumulative sums of ``x`` along ``dim`` (-1 or -2), the C positions of a chunk: from the
    chunk's start, or with ``reverse`` from its end, each position's own term included, or not with
    ``exclusive``. A new tensor of x's shape.

    One product with a ``(C, C)`` triangle of ones, a sum of at most C terms like a cumsum's: one
    launch where a reverse sum as flip, cumsum, flip took three (docs/benchmarks/cumsum). For finite
    terms, as gradients are: the triangle's zeros would turn an infinite term into NaN across its
    chunk (a sum of log decays, which may be -inf, is a cumsum)."""
    if dim not in (-1, -2):
        raise ValueError(f"cumsum_in_chunks: dim must be -1 or -2, got {dim}")
    ones = _ones_triangle(x.shape[dim], reverse, exclusive, x.dtype, x.device)
    return torch.matmul(ones, x) if dim == -2 else torch.matmul(x, ones.t())


class ChunkLayout(NamedTuple):
    """``R`` rows of ``N`` positions in ``Nc`` chunks of ``C``, ``per_tile`` chunks to a tile; a row
    tile (:meth:`by_rows`) holds ``rows_per_tile`` rows, and then ``per_tile`` is Nc unless
    ``rows_per_tile`` is 1."""

    R: int
    N: int
    C: int
    Nc: int
    per_tile: int
    rows_per_tile: int = 0

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

    @staticmethod
    def whole(R: int, N: int, chunk_size: int) -> "ChunkLayout":
        """:meth:`of` with one tile of every chunk: the layout of an engine that works on the whole
        sequence at once (the accelerator strategy, the running-scale product)."""
        return ChunkLayout.of(R, N, chunk_size, chunks_per_tile=-(-N // min(chunk_size, N)))

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

    def new_chunked_like(self, x: Tensor) -> Tensor:
        """An uninitialised ``(R, Nc, C, *X)`` tensor for a result of ``x (R, N, *X)``'s shape
        written tile by tile, laid out in memory as ``x`` is when C divides N (a view of
        ``torch.empty_like(x)``; else :meth:`new_chunked`); :meth:`unchunked_like` gives the result.

        Why: a gradient laid out as its input is taken by autograd as it is, where one in another
        layout is copied into the input's (a leaf's ``.grad`` follows the leaf's strides): an
        ``(R, N, D)`` view of ``(B, N, H, D)`` inputs, transformers' layout, would otherwise cost a
        copy of every gradient."""
        if self.fill:
            return self.new_chunked(x, *x.shape[2:])
        return torch.empty_like(x).view(self.R, self.Nc, self.C, *x.shape[2:])

    def unchunked_like(self, xc: Tensor, x: Tensor) -> Tensor:
        """The ``(R, N, *X)`` result of ``xc`` from :meth:`new_chunked_like` of ``x``, in ``x``'s
        layout (a view, or with a filled last chunk a copy into ``torch.empty_like(x)``)."""
        if self.fill:
            return torch.empty_like(x).copy_(self.unchunked(xc))
        return xc.view(x.shape)

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
    def take_scaled(xc: Tensor, tile: slice, factor, out: Tensor | None = None) -> Tensor:
        """:meth:`take` of ``xc (R, Nc, C, X)`` times ``factor`` (a number, or ``(R, Nc, C)``, one per
        position) in the one pass that takes it: ``(m, R, C, X)``, chunk-major and contiguous, into
        ``out`` when given. (The product of the chunk-major view and a factor would keep the view's
        strides, and every batched product would then copy it first.)"""
        view = xc[:, tile].transpose(0, 1)
        if isinstance(factor, Tensor):
            factor = factor[:, tile].transpose(0, 1)[..., None]
        return torch.mul(view, factor, out=xc.new_empty(view.shape) if out is None else out)

    @staticmethod
    def put(dst: Tensor, tile: slice, src: Tensor) -> None:
        """Write chunk-major ``src`` (``(m, R, C, *X)``, or ``(m*R, C, *X)``) into chunks ``tile`` of
        ``dst (R, Nc, C, *X)``."""
        dst[:, tile].copy_(src.view(-1, dst.shape[0], *dst.shape[2:]).transpose(0, 1))

    # Row tiles --------------------------------------------------------------------------------

    @staticmethod
    def by_rows(R: int, N: int, chunk_size: int, tile_positions: int) -> "ChunkLayout":
        """Row tiles of about ``tile_positions`` positions: groups of whole rows when a row fits
        (chunks filled), else blocks of ``tile_positions // C`` chunks (at least one) of one row."""
        C = min(chunk_size, N)
        Nc = -(-N // C)
        if Nc * C <= tile_positions:
            return ChunkLayout(R, N, C, Nc, Nc, tile_positions // (Nc * C))
        return ChunkLayout(R, N, C, Nc, max(1, tile_positions // C), 1)

    def row_groups(self) -> list[slice]:
        """The rows of each row tile's group, in order."""
        return [slice(r, min(r + self.rows_per_tile, self.R)) for r in range(0, self.R, self.rows_per_tile)]

    def blocks(self) -> list[slice]:
        """The chunks of each block of a row group, in order (one block when groups are whole rows)."""
        return self.tiles()

    def positions(self, chunks: slice) -> slice:
        """The positions of ``chunks``, fill excluded."""
        return slice(chunks.start * self.C, min(chunks.stop * self.C, self.N))

    def fills(self, chunks: slice) -> bool:
        """Whether ``chunks`` hold the filled last chunk."""
        return bool(self.fill) and chunks.stop == self.Nc

    def block(self, x: Tensor, chunks: slice) -> Tensor:
        """Chunks ``chunks`` of a row group's ``x (r, N, X)`` as ``(r*m, C, X)``: a view, or a
        zero-filled copy when they hold the last chunk and it is filled."""
        return self.as_block(x[:, self.positions(chunks)], chunks)

    def as_block(self, xt: Tensor, chunks: slice) -> Tensor:
        """:meth:`block` of ``xt (r, n, X)``, the positions of ``chunks`` already taken."""
        if self.fills(chunks):
            xt = F.pad(xt, (0, 0, 0, self.fill))
        return xt.reshape(-1, self.C, xt.shape[-1])

    def target(self, dst: Tensor, chunks: slice) -> Tensor | None:
        """Chunks ``chunks`` of a row group's ``dst (r, N, X)`` as a ``(r*m, C, X)`` view to compute
        into, or None where the last chunk is filled (compute elsewhere, then :meth:`put_block`)."""
        if self.fills(chunks):
            return None
        return dst[:, self.positions(chunks)].view(-1, self.C, dst.shape[-1])

    def put_block(self, dst: Tensor, chunks: slice, src: Tensor) -> None:
        """Write ``src (r*m, C, X)`` into chunks ``chunks`` of a row group's ``dst (r, N, X)``."""
        pos = self.positions(chunks)
        dst[:, pos].copy_(src.view(dst.shape[0], -1, src.shape[-1])[:, : pos.stop - pos.start])

    def block_starts(self) -> int:
        """How many states a row-tiled forward keeps for its backward: the state before every block
        of a row but its first, for every row (0 when groups are whole rows)."""
        return (len(self.blocks()) - 1) * self.R if self.rows_per_tile == 1 else 0
