"""The decayed engine's specialisation for keys shared by a group of heads with a decay per head:
Mamba-2's state-space duality (SSD, arXiv 2405.21060), where the m heads of a group read the
same queries (C) and keys (B) and differ in their values and their scalar decays.

Repeating the group's queries and keys for each head (what grouped value heads cost elsewhere,
``checks.expand_key_heads``) would form the same ``C x C`` scores m times and run every state
product head by head, as m small products of ``(D, C) x (C, Dv)``. Here a group is one row: the
scores are formed once, and the m heads' values lie side by side as the columns of one
``(D, m Dv)`` state, so the products that carry the state (into it, and from it to the outputs) are
single large products of width ``m Dv`` per chunk. A decay per head scales the state's columns:
the recurrence across chunks is :func:`linattn.functional.recurrence.chunk_recurrence` on the
transposed state, whose rows the decays scale (a "diagonal" transition), with its two strategies.

The work goes a tile of chunks at a time: the tile's outputs within its chunks (the ``C x C``
decay masks of every head formed there, again in the backward rather than kept), what its chunks
add to the state, the state carried across them, and the tile's states read by its queries. On a
CPU a tile holds about a MiB of masks or states, so that every pass over them and every state
product runs in cache: a chunk's state products at Mamba-2 1.3B's width run several times faster
than the same products batched over the whole sequence, whose operands stream from memory. On an
accelerator the tile is the whole sequence (memory O(N C H), linear in N): few large launches, the
recurrence a log-depth scan. Decays inside a chunk are running products of the steps' decays (or
sums of their logs), never differences of cumulative sums: a large decay, or a reset (-inf, what
packed documents put at their starts), costs no digit of the others. Factors below 2**-40 are
flushed to 0 in float32, as in the decayed engine.

With half inputs on the accelerator the forward's products take half operands with float32
accumulation (tensor cores: :func:`linattn.functional.strategy.mixed_bmm`), the state read from two
half parts (:func:`~linattn.functional.strategy.split_bmm`, as the decayed engine reads it); masks,
decays, states and the backward stay float32.

Dimension legend: B batch, Hk groups, m heads per group, H = Hk m heads, N positions (padded to Np,
a multiple of C), D key width (SSD's state size), Dv value width (head_dim), R = B Hk rows,
Nc chunks, n a tile's chunks, C chunk length, W = m Dv a row's value columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_positive_int
from .chunks import TileBuffers, cumsum_in_chunks
from .log_decays import flush_low
from .recurrence import chunk_recurrence, prefix_sums
from .strategy import mixed_bmm, split_bmm

__all__ = ["grouped_decayed_product"]


def _segment_decays(a: Tensor, out: Tensor | None = None) -> Tensor:
    """``(.., C) -> (.., C, C)`` (into ``out`` when given): entry ``[i, j]`` the decay from position
    j to i, ``exp(a[j+1] + .. + a[i])`` for j <= i (1 on the diagonal), and 1 above it (the caller's
    causal mask zeroes those: one pass fewer here): a running product of the steps' decays (factors
    in [0, 1]: no digit lost to a large decay, none to a difference)."""
    C = a.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1)
    steps = a.exp().unsqueeze(-1).expand(*a.shape, C)
    x = torch.where(strict, steps, steps.new_ones(()), out=out)  # [i, j] = exp(a[i]) for i > j
    return x.cumprod_(-2)


def _suffix_sums(a: Tensor) -> Tensor:
    """``(.., C)``: entry j the sum of ``a[j+1 ..]`` (0 at the end), without differences."""
    return F.pad(prefix_sums(a.flip(-1), -1, rounded_once=True), (1, 0))[..., :-1].flip(-1)


class _Layout:
    """A call's shapes and the views between the engine's layouts; ``n`` a tile's number of chunks."""

    def __init__(self, q: Tensor, v: Tensor, chunk_size: int):
        B, Hk, N, D = q.shape
        H, Dv = v.shape[1], v.shape[-1]
        self.B, self.Hk, self.m, self.N, self.D, self.Dv = B, Hk, H // Hk, N, D, Dv
        self.C = min(chunk_size, max(N, 1))
        self.Nc = -(-N // self.C)
        self.pad = self.Nc * self.C - N
        self.R, self.W = B * Hk, self.m * Dv

    def chunks(self, x: Tensor) -> Tensor:
        """``(B, heads, N, *)`` -> ``(B heads, Nc, C, *)`` (zeros after the end: identity steps)."""
        if self.pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, self.pad))
        return x.reshape(x.shape[0] * x.shape[1], self.Nc, self.C, *x.shape[3:])

    def head_chunks(self, v: Tensor) -> Tensor:
        """``v (B, H, N, Dv)`` -> ``(R, m, Nc, C, Dv)``."""
        return self.chunks(v).view(self.R, self.m, self.Nc, self.C, self.Dv)

    def heads(self, x: Tensor) -> Tensor:
        """``(R, n, C, W)`` -> ``(R, m, n, C, Dv)`` (a view)."""
        return x.view(self.R, x.shape[1], self.C, self.m, self.Dv).permute(0, 3, 1, 2, 4)

    def columns_scaled(self, vh: Tensor, scale: Tensor, ws: TileBuffers, name: str) -> Tensor:
        """``vh (R, m, n, C, Dv)`` times ``scale (R, m, n, C)`` with the group's heads side by side,
        ``(R, n, C, W)``, in one pass (into the workspace's buffer ``name``)."""
        n = vh.shape[2]
        out = ws(name, self.R, n, self.C, self.m, self.Dv)
        torch.mul(vh.permute(0, 2, 3, 1, 4), scale.permute(0, 2, 3, 1).unsqueeze(-1), out=out)
        return out.view(self.R, n, self.C, self.W)

    def transitions(self, T: Tensor) -> Tensor:
        """``T (R, m, n)`` chunk decays -> the recurrence's diagonal transitions ``(n, R, W, 1)`` on
        the transposed state (one decay per head, repeated over its Dv columns)."""
        n = T.shape[-1]
        return T.permute(2, 0, 1)[..., None, None].expand(n, self.R, self.m, self.Dv, 1).reshape(n, self.R, self.W, 1)

    def transposed_state(self, s: Tensor) -> Tensor:
        """``s (B, H, D, Dv)`` -> ``(R, W, D)``."""
        return s.reshape(self.R, self.m, self.D, self.Dv).permute(0, 1, 3, 2).reshape(self.R, self.W, self.D)

    def state(self, St: Tensor) -> Tensor:
        """``(R, W, D)`` -> ``s (B, H, D, Dv)``."""
        return St.reshape(self.R, self.m, self.Dv, self.D).transpose(-1, -2).reshape(
            self.B, self.Hk * self.m, self.D, self.Dv)

    def values_like(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """A new ``(B, H, Nc C, Dv)`` tensor for outputs or values' gradients in ``v``'s layout, and
        its ``(R, m, Nc, C, Dv)`` view: position-major (the ``(B, N, H, Dv)`` memory of transformers'
        and mamba_ssm's layers) when v is so and B is 1 (their rows then still fold into one
        dimension), else contiguous. A caller that hands over such values gets its outputs and
        gradients back without a transposing copy of either."""
        H, Np = self.Hk * self.m, self.Nc * self.C
        if self.B == 1 and v.stride(1) == self.Dv and v.stride(2) == H * self.Dv and v.stride(3) == 1:
            full = v.new_empty(self.B, Np, H, self.Dv).transpose(1, 2)
        else:
            full = v.new_empty(self.B, H, Np, self.Dv)
        return full, full.view(self.R, self.m, self.Nc, self.C, self.Dv)


def _decays(a: Tensor, flush: bool = True):
    """``a (R, m, Nc, C)`` log decays -> the decay from each chunk's start to each position
    ``E (R, m, Nc, C)``, from each position to the chunk's end ``Wd (R, m, Nc, C)`` and over the
    whole chunk ``T (R, m, Nc)`` (``flush``: :func:`~linattn.functional.log_decays.flush_low`; Mamba-2's
    decays at initialisation reach exp(-6) a step, and unflushed the CPU's scan took 2x as long)."""
    E = prefix_sums(a, -1, rounded_once=True)
    T = flush_low(E[..., -1].exp(), flush)
    return flush_low(E.exp_(), flush), flush_low(_suffix_sums(a).exp_(), flush), T


# A CPU tile holds about this many entries of its largest per-chunk temporaries (the heads' C x C
# decay masks, the chunks' (W, D) states: 1 MiB in float32; why: docs/benchmarks/README.md, History),
# so that its passes over them, and the state products, run in cache instead of memory
TILE_ENTRIES = 1 << 18


def _tiles(lay: _Layout, strategy: str, chunks_per_tile: int | None) -> list[slice]:
    """The tiles of chunks, in order: every chunk at once on an accelerator (few large launches); on a
    CPU about :data:`TILE_ENTRIES` entries of masks (``R m C^2`` a chunk) or states (``R W D``)."""
    if chunks_per_tile is None:
        per_chunk = lay.R * max(lay.m * lay.C * lay.C, lay.W * lay.D)
        chunks_per_tile = lay.Nc if strategy == "accelerator" else max(1, TILE_ENTRIES // per_chunk)
    t = max(1, min(lay.Nc, chunks_per_tile))
    return [slice(c0, min(c0 + t, lay.Nc)) for c0 in range(0, lay.Nc, t)]


def _product(a: Tensor, b: Tensor, out: Tensor, operand: torch.dtype | None = None, *, split: bool = False) -> Tensor:
    """``a @ b`` over leading batch dimensions into ``out`` (contiguous); with a half ``operand``
    the product takes half operands and accumulates in float32 (:func:`mixed_bmm`; with ``split``
    b in two half parts, :func:`split_bmm`)."""
    if operand is None:
        return torch.matmul(a, b, out=out)
    lead = out.shape[:-2]
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    (split_bmm if split else mixed_bmm)(a3, b3, operand, out=out.view(-1, *out.shape[-2:]))
    return out


def _masked_scores(G: Tensor, a: Tensor, ws: TileBuffers, flush: bool = True) -> tuple[Tensor, Tensor]:
    """A tile's decay masks ``L`` and masked scores ``M = L * tril(G)`` ``(R, m, n, C, C)`` from the
    group's causal scores ``G (R, n, C, C)`` and the log decays ``a (R, m, n, C)`` (``flush``:
    :func:`~linattn.functional.log_decays.flush_low`)."""
    shape = (*a.shape, a.shape[-1])
    L = flush_low(_segment_decays(a, out=ws("L", *shape)), flush)
    return L, torch.mul(L, G.unsqueeze(1), out=ws("M", *shape))


def _within_backward(G: Tensor, a: Tensor, vh: Tensor, dyh: Tensor, ws: TileBuffers, flush: bool = True):
    """A tile's within-chunk gradients (``y = M @ vh``): by the values ``(R, m, n, C, Dv)``, by the
    group's scores ``(R, n, C, C)`` and by the log decays ``(R, m, n, C)``, the masks formed again."""
    L, M = _masked_scores(G, a, ws, flush)
    dv = torch.matmul(M.transpose(-1, -2), dyh, out=ws("dv", *vh.shape))
    dM = torch.matmul(dyh, vh.transpose(-1, -2), out=ws("dM", *M.shape))  # (R, m, n, C, C)
    dG = L.mul_(dM).sum(1).tril_()
    dL = dM.mul_(M).tril_(-1)  # d log L below the diagonal (log L is 0 on it, M is 0 above it)
    # log L[i, j] = sum a(j, i]: a[s] is in it for j < s <= i, the rows i >= s less their columns j >= s
    da = cumsum_in_chunks(dL.sum(-1).sub_(dL.sum(-2)), -1, reverse=True)
    return dv, dG, da


class _Prepared:
    """The chunked views and per-chunk decays both passes start from."""

    def __init__(self, q, k, v, a, lay: _Layout, value_scale: Tensor | None, skip: Tensor | None, strategy: str):
        self.flush = strategy == "cpu"  # the decay factors' negligible ones set to 0: a CPU's choice (flush_low)
        self.qc, self.kc = lay.chunks(q), lay.chunks(k)  # (R, Nc, C, D)
        self.xh = lay.head_chunks(v)  # (R, m, Nc, C, Dv): the values before value_scale
        self.dt = None if value_scale is None else lay.chunks(value_scale).view(lay.R, lay.m, lay.Nc, lay.C, 1)
        # (R, m, 1, 1, 1): each head's skip
        self.skip = None if skip is None else skip.view(1, lay.Hk, lay.m).expand(lay.B, -1, -1).reshape(
            lay.R, lay.m, 1, 1, 1)
        self.ac = lay.chunks(a).view(lay.R, lay.m, lay.Nc, lay.C)
        self.E, self.Wd, self.T = _decays(self.ac, self.flush)
        self.G = (self.qc @ self.kc.transpose(-1, -2)).tril_()  # (R, Nc, C, C), once per group, causal

    def values(self, tt: slice, ws: TileBuffers) -> tuple[Tensor, Tensor]:
        """A tile's values as given ``(R, m, n, C, Dv)`` and as the recurrence takes them (times
        value_scale, formed in the workspace: in cache, not a pass over the whole sequence)."""
        x = self.xh[:, :, tt]
        return x, (x if self.dt is None else torch.mul(x, self.dt[:, :, tt], out=ws("v", *x.shape)))


def _forward(q, k, v, a, s0, value_scale, skip, lay: _Layout, strategy: str, tiles: list[slice], keep: bool,
             operand: torch.dtype | None):
    """The outputs ``(B, H, N, Dv)`` and the transposed states ``(R, W, D)``: with ``keep`` those
    before every chunk and after the last ``(Nc + 1, R, W, D)`` (what the backward reads), else
    the final one. ``operand``: None, or the half dtype of the products' operands.

    A tile at a time: its outputs within the chunks, what its chunks add to the state, the state
    carried across them (:func:`chunk_recurrence`), and every state of the tile read by the queries.
    On a CPU a tile's states are about a MiB, so the state products run in cache."""
    p = _Prepared(q, k, v, a, lay, value_scale, skip, strategy)
    t = tiles[0].stop
    S = q.new_empty(lay.Nc + 1 if keep else t + 1, lay.R, lay.W, lay.D)
    if s0 is None:
        S[0].zero_()
    else:
        S[0] = lay.transposed_state(s0)
    y, yh = lay.values_like(v)
    ws = TileBuffers(q)  # the tiles' temporaries, reused tile after tile (page faults: chunks.TileBuffers)
    for i, tt in enumerate(tiles):
        n = tt.stop - tt.start
        states = S[tt.start: tt.stop + 1] if keep else S[: n + 1]
        if not keep and i:
            states[0] = S[t]  # the last tile's final state (every tile but the last is full)
        x, vh = p.values(tt, ws)
        yt = _product(_masked_scores(p.G[:, tt], p.ac[:, :, tt], ws, p.flush)[1], vh, ws("y", *vh.shape), operand)
        # what each chunk adds to the transposed state: (v * decay to the chunk's end)^T k, (R, n, W, D)
        vw = lay.columns_scaled(vh, p.Wd[:, :, tt], ws, "vw")
        Ut = _product(vw.transpose(-1, -2), p.kc[:, tt], ws("U", lay.R, n, lay.W, lay.D), operand)
        chunk_recurrence(lay.transitions(p.T[:, :, tt]), Ut.transpose(0, 1), states[0], strategy=strategy,
                         out=states, consume=True)
        # the states read, (R, n, C, W)
        Z = _product(p.qc[:, tt], states[:-1].transpose(0, 1).transpose(-1, -2), ws("Z", lay.R, n, lay.C, lay.W),
                     operand, split=True)
        yt.addcmul_(lay.heads(Z), p.E[:, :, tt].unsqueeze(-1))
        if p.skip is not None:
            yt.addcmul_(x, p.skip)
        yh[:, :, tt] = yt
    return y[:, :, : lay.N], (S if keep else S[tiles[-1].stop - tiles[-1].start])


def _backward(q, k, v, a, s0, value_scale, skip, S, dy, ds, lay: _Layout, strategy: str, tiles: list[slice]):
    """Gradients of ``(q, k, v, a, s0, value_scale, skip)`` from those of the outputs
    ``dy (B, H, N, Dv)`` and the final state ``ds (B, H, D, Dv)`` or None; ``S`` the forward's
    transposed states. The tiles in reverse, the state's gradient carried back across them (the
    reverse recurrence)."""
    p = _Prepared(q, k, v, a, lay, value_scale, skip, strategy)
    # a cotangent broadcast from a scalar (a sum's, strides 0) made dense once: read as it is, a CPU's
    # bmm copies it matrix by matrix (256 copies a 4096 packed positions)
    dyh = lay.head_chunks(dy.contiguous())  # (R, m, Nc, C, Dv)
    dq, dk = torch.empty_like(p.qc), torch.empty_like(p.kc)
    dv, dvh = lay.values_like(v)
    da, dE, dWd = torch.empty_like(p.ac), torch.empty_like(p.ac), torch.empty_like(p.ac)
    dT = torch.empty_like(p.T)
    dscale = None if p.dt is None else torch.empty_like(p.dt)
    dskip = None if p.skip is None else q.new_zeros(lay.R, lay.m)
    t = tiles[0].stop
    g = q.new_empty(t + 1, lay.R, lay.W, lay.D)  # the tile's state gradients; entry n the seed
    seed = g[t]
    if ds is None:
        seed.zero_()
    else:
        seed.copy_(lay.transposed_state(ds))
    ws = TileBuffers(q)  # the tiles' temporaries, reused tile after tile (page faults: chunks.TileBuffers)
    for tt in reversed(tiles):
        n = tt.stop - tt.start
        St = S[tt].transpose(0, 1)  # (R, n, W, D): the states before the tile's chunks
        qc, kc, dyt = p.qc[:, tt], p.kc[:, tt], dyh[:, :, tt]
        x, vh = p.values(tt, ws)
        E, Wd, T = p.E[:, :, tt], p.Wd[:, :, tt], p.T[:, :, tt]
        wide, narrow = (lay.R, n, lay.C, lay.W), (lay.R, n, lay.C, lay.D)
        # from the state read: y += heads(q S_c) * E
        Z = torch.matmul(qc, St.transpose(-1, -2), out=ws("Z", *wide))
        dE[:, :, tt] = lay.heads(Z).mul_(dyt).sum(-1)
        dZ = lay.columns_scaled(dyt, E, ws, "dZ")  # (R, n, C, W)
        dqt = torch.matmul(dZ, St, out=ws("dq", *narrow))
        # the loss's gradient by each S_c from its read, transposed, (R, n, W, D)
        dSt_read = torch.matmul(dZ.transpose(-1, -2), qc, out=ws("dS", lay.R, n, lay.W, lay.D))
        gs = g[: n + 1]
        # gs[c]: the gradient by the state before chunk c of the tile; gs[n] after its last
        chunk_recurrence(lay.transitions(T), dSt_read.transpose(0, 1), seed, strategy=strategy, reverse=True, out=gs,
                         consume=True)
        dU = gs[1:].transpose(0, 1)  # (R, n, W, D): what chunk c added reaches the state after it
        dSt_read.copy_(dU).mul_(St)  # the buffer is free again: the products of the tile's states and gradients
        dT[:, :, tt] = dSt_read.sum(-1).view(lay.R, n, lay.m, lay.Dv).sum(-1).transpose(1, 2) * T  # d log T
        # the chunks' additions: Ut = (vh * Wd)^T k
        dkt = torch.matmul(lay.columns_scaled(vh, Wd, ws, "vw"), dU, out=ws("dk", *narrow))
        dvw = lay.heads(torch.matmul(kc, dU.transpose(-1, -2), out=ws("Z", *wide)))  # (R, m, n, C, Dv)
        dv_within, dG, da[:, :, tt] = _within_backward(p.G[:, tt], p.ac[:, :, tt], vh, dyt, ws, p.flush)
        if p.dt is None and p.skip is None:
            torch.addcmul(dv_within, dvw, Wd.unsqueeze(-1), out=dvh[:, :, tt])
        else:  # the gradient by the scaled values, then by value_scale, the values and skip
            dvs = dv_within.addcmul_(dvw, Wd.unsqueeze(-1))
            if p.dt is not None:
                dscale[:, :, tt] = torch.mul(dvs, x, out=ws("dv*x", *x.shape)).sum(-1, keepdim=True)
                dvs.mul_(p.dt[:, :, tt])
            if p.skip is not None:
                dvs.addcmul_(dyt, p.skip)
                dskip += torch.mul(dyt, x, out=ws("dv*x", *x.shape)).sum((2, 3, 4))
            dvh[:, :, tt] = dvs
        dWd[:, :, tt] = dvw.mul_(vh).sum(-1) * Wd  # d log Wd
        torch.add(dqt, torch.matmul(dG, kc), out=dq[:, tt])
        torch.add(dkt, torch.matmul(dG.transpose(-1, -2), qc), out=dk[:, tt])
        seed = gs[0]  # copied into the next tile's last entry before anything overwrites it
    ds0 = None if s0 is None else lay.state(seed)
    # the other log decays: log E[i] = sum a[..i], log Wd[j] = sum a(j..], log T = sum a
    da += cumsum_in_chunks(dE.mul_(p.E), -1, reverse=True)  # a[t] is in log E[i] for i >= t
    da += cumsum_in_chunks(dWd, -1, exclusive=True)  # a[t] is in log Wd[j] for j < t
    da += dT.unsqueeze(-1)
    unchunk = lambda x, heads: x.reshape(lay.B, heads, lay.Nc * lay.C, *x.shape[3:])[:, :, : lay.N]  # noqa: E731
    by_position = lambda x: x.reshape(lay.B, lay.Hk * lay.m, lay.Nc * lay.C)[:, :, : lay.N]  # noqa: E731
    return (unchunk(dq, lay.Hk), unchunk(dk, lay.Hk), dv[:, :, : lay.N], by_position(da), ds0,
            None if dscale is None else by_position(dscale),
            None if dskip is None else dskip.view(lay.B, lay.Hk * lay.m).sum(0))


class _GroupedDecayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, s0, value_scale, skip, chunk_size, strategy, chunks_per_tile, keep, operand):
        lay = _Layout(q, v, chunk_size)
        tiles = _tiles(lay, strategy, chunks_per_tile)
        y, S = _forward(q, k, v, a, s0, value_scale, skip, lay, strategy, tiles, keep, operand)
        if keep:
            ctx.save_for_backward(q, k, v, a, s0, value_scale, skip, S)
        ctx.lay, ctx.strategy, ctx.tiles = lay, strategy, tiles
        return y, lay.state(S[-1] if keep else S)

    @staticmethod
    def backward(ctx, dy, ds):
        q, k, v, a, s0, value_scale, skip, S = ctx.saved_tensors
        dy = torch.zeros_like(v) if dy is None else dy
        grads = _backward(q, k, v, a, s0, value_scale, skip, S, dy, ds, ctx.lay, ctx.strategy, ctx.tiles)
        return (*grads, None, None, None, None, None)


def grouped_decayed_product(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor | None, *,
                            chunk_size: int, strategy: str,
                            chunks_per_tile: int | None = None, operand: torch.dtype | None = None,
                            value_scale: Tensor | None = None, skip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``S_t = exp(log_decay_t) S_{t-1} + k_t (c_t v_t)^T``, ``o_t = S_t^T q_t + d v_t`` per head,
    the m heads of a group sharing q and k, ``c_t`` the value_scale (1 without) and ``d`` the skip (0
    without): Mamba-2's step sizes dt and its D, applied chunk by chunk in cache rather than as
    passes of their own over the values and the outputs. Prepared inputs (checked, the compute
    dtype, q scaled):

    Args:
        q, k: ``(B, Hk, N, D)``; v: ``(B, H, N, Dv)``, H a multiple of Hk (head h in group h // m).
        log_decay: ``(B, H, N)``, <= 0 (-inf a reset).
        s0: ``(B, H, D, Dv)`` or None (zeros).
        chunk_size: C; strategy: ``"cpu"`` or ``"accelerator"`` (resolved), the recurrence's and the
            tiles'.
        chunks_per_tile: None (the strategy's tile: about a MiB on a CPU, everything on an
            accelerator) or the chunks a tile holds (>= 1).
        operand: None, or a half dtype for the forward products' operands (float32 accumulation;
            the accelerator's half inputs: :func:`linattn.functional.strategy.operand_dtype`).
        value_scale: None or ``(B, H, N)``; skip: None or ``(H,)``.

    Returns ``(o (B, H, N, Dv), final state (B, H, D, Dv))``, differentiable in every input. Without
    gradients (none asked, or grad mode off) only the states of one tile are held, not every chunk's.
    """
    if chunks_per_tile is not None:
        check_positive_int("grouped_decayed_product", "chunks_per_tile", chunks_per_tile)
    inputs = (q, k, v, log_decay, s0, value_scale, skip)
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    contiguous = lambda t: None if t is None else t.contiguous()  # noqa: E731
    # v as it is: its chunks are a view where its layout allows (values_like)
    return _GroupedDecayed.apply(q.contiguous(), k.contiguous(), v, log_decay.contiguous(), contiguous(s0),
                                 contiguous(value_scale), contiguous(skip), chunk_size, strategy, chunks_per_tile,
                                 keep, operand)
