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

The ``C x C`` decay masks of every head are formed a tile of chunks at a time (on a CPU about a
MiB, in cache; on an accelerator every chunk at once: memory O(N C H), linear in N), again in the
backward rather than kept; the state products run over every chunk at once. Decays inside a chunk
are running products of the steps' decays (or sums of their logs), never differences of cumulative
sums: a large decay, or a reset (-inf, what packed documents put at their starts), costs no digit
of the others. Factors below 2**-40 are flushed to 0 in float32, as in the decayed engine.

Not yet here: half operands for tensor cores (every product is float32 for half inputs).

Dimension legend: B batch, Hk groups, m heads per group, H = Hk m heads, N positions (padded to Np,
a multiple of C), D key width (SSD's state size), Dv value width (head_dim), R = B Hk rows,
Nc chunks, C chunk length, W = m Dv a row's value columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .log_decays import flush_negligible
from .recurrence import chunk_recurrence

__all__ = ["grouped_decayed_product"]


def _segment_decays(a: Tensor) -> Tensor:
    """``(.., C) -> (.., C, C)``: entry ``[i, j]`` the decay from position j to i,
    ``exp(a[j+1] + .. + a[i])`` for j <= i (1 on the diagonal), and 1 above it (the caller's causal
    mask zeroes those: one pass fewer here): a running product of the steps' decays (factors in
    [0, 1]: no digit lost to a large decay, none to a difference)."""
    C = a.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1)
    x = a.exp().unsqueeze(-1).expand(*a.shape, C).masked_fill(~strict, 1.0)  # [i, j] = exp(a[i]) for i > j
    return x.cumprod_(-2)


def _suffix_sums(a: Tensor) -> Tensor:
    """``(.., C)``: entry j the sum of ``a[j+1 ..]`` (0 at the end), without differences."""
    return F.pad(a.flip(-1).cumsum(-1), (1, 0))[..., :-1].flip(-1)


class _Layout:
    """A call's shapes and the views between the engine's layouts."""

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

    def columns(self, x: Tensor) -> Tensor:
        """``(R, m, Nc, C, Dv)`` -> ``(R, Nc, C, W)``: the group's heads side by side (a copy)."""
        return x.permute(0, 2, 3, 1, 4).reshape(self.R, self.Nc, self.C, self.W)

    def heads(self, x: Tensor) -> Tensor:
        """``(R, Nc, C, W)`` -> ``(R, m, Nc, C, Dv)`` (a view)."""
        return x.view(self.R, self.Nc, self.C, self.m, self.Dv).permute(0, 3, 1, 2, 4)

    def output(self, y: Tensor) -> Tensor:
        """``(R, m, Nc, C, Dv)`` -> ``(B, H, N, Dv)``."""
        return y.reshape(self.B, self.Hk * self.m, self.Nc * self.C, self.Dv)[:, :, : self.N]


def _flush(factors: Tensor) -> Tensor:
    """Decay factors below :func:`linattn.functional.log_decays.negligible_decay` set to 0 in place,
    in a float32 compute dtype (float64 left as it is): left in, products of such factors fall into
    the subnormal range, where CPUs' matrix products run several times slower (Mamba-2's decays at
    initialisation reach exp(-6) a step: measured 2x on the whole scan)."""
    return factors if factors.dtype == torch.float64 else flush_negligible(factors)


def _decays(a: Tensor):
    """``a (R, m, Nc, C)`` log decays -> the decay from each chunk's start to each position
    ``E (R, m, Nc, C)``, from each position to the chunk's end ``Wd (R, m, Nc, C)`` and over the
    whole chunk ``T (R, m, Nc)``."""
    E = a.cumsum(-1)
    T = _flush(E[..., -1].exp())
    return _flush(E.exp_()), _flush(_suffix_sums(a).exp_()), T


def _transitions(T: Tensor, lay: _Layout) -> Tensor:
    """``T (R, m, Nc)`` -> the recurrence's diagonal transitions ``(Nc, R, W, 1)`` on the
    transposed state (one decay per head, repeated over its Dv columns)."""
    return T.permute(2, 0, 1)[..., None, None].expand(lay.Nc, lay.R, lay.m, lay.Dv, 1).reshape(lay.Nc, lay.R, lay.W, 1)


# A CPU tile of the within-chunk stage holds about this many decay-mask entries (1 MiB in float32;
# 1, 4 and 16 MiB measured at Mamba-2 1.3B width: the smallest fastest),
# so that its several passes over the masks stay in cache instead of memory
TILE_ENTRIES = 1 << 18


def _tile(lay: _Layout, strategy: str) -> int:
    """Chunks per tile of the within-chunk stage: every chunk at once on an accelerator (few large
    launches); on a CPU about :data:`TILE_ENTRIES` mask entries (``R m C^2`` per chunk)."""
    if strategy == "accelerator":
        return lay.Nc
    return max(1, min(lay.Nc, TILE_ENTRIES // (lay.R * lay.m * lay.C * lay.C)))


def _masked_scores(G: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """A tile's decay masks ``L`` and masked scores ``M = L * tril(G)`` ``(R, m, t, C, C)`` from the
    group's causal scores ``G (R, t, C, C)`` and the log decays ``a (R, m, t, C)``."""
    L = _flush(_segment_decays(a))
    return L, L * G.unsqueeze(1)


def _within(G: Tensor, ac: Tensor, vh: Tensor, lay: _Layout, tile: int) -> Tensor:
    """The outputs within the chunks, ``M @ vh`` ``(R, m, Nc, C, Dv)``, a tile of chunks at a time."""
    y = vh.new_empty(vh.shape)
    for c0 in range(0, lay.Nc, tile):
        t = slice(c0, c0 + tile)
        y[:, :, t] = _masked_scores(G[:, t], ac[:, :, t])[1] @ vh[:, :, t]
    return y


def _within_backward(G: Tensor, ac: Tensor, vh: Tensor, dyh: Tensor, lay: _Layout, tile: int):
    """The within-chunk stage's gradients: by the values ``(R, m, Nc, C, Dv)``, by the group's
    scores ``(R, Nc, C, C)`` and by the log decays ``(R, m, Nc, C)``, the masks formed again tile
    by tile."""
    dv, dG, da = torch.empty_like(vh), torch.empty_like(G), torch.empty_like(ac)
    for c0 in range(0, lay.Nc, tile):
        t = slice(c0, c0 + tile)
        L, M = _masked_scores(G[:, t], ac[:, :, t])
        dv[:, :, t] = M.transpose(-1, -2) @ dyh[:, :, t]
        dM = dyh[:, :, t] @ vh[:, :, t].transpose(-1, -2)  # (R, m, t, C, C)
        dG[:, t] = (dM * L).sum(1).tril_()
        dL = dM.mul_(M).tril_(-1)  # d log L below the diagonal (log L is 0 on it, M is 0 above it)
        # log L[i, j] = sum a(j, i]: a[s] is in it for j < s <= i, the rows i >= s less their columns j >= s
        da[:, :, t] = dL.sum(-1).flip(-1).cumsum(-1).flip(-1) - dL.sum(-2).flip(-1).cumsum(-1).flip(-1)
    return dv, dG, da


def _forward(q, k, v, a, s0, lay: _Layout, strategy: str):
    """The outputs ``(B, H, N, Dv)`` and the states before every chunk and after the last
    ``(Nc + 1, R, W, D)`` (transposed: a row per value column)."""
    qc, kc = lay.chunks(q), lay.chunks(k)  # (R, Nc, C, D)
    vh = lay.head_chunks(v)  # (R, m, Nc, C, Dv)
    ac = lay.chunks(a).view(lay.R, lay.m, lay.Nc, lay.C)
    E, Wd, T = _decays(ac)
    G = (qc @ kc.transpose(-1, -2)).tril_()  # (R, Nc, C, C), once per group, causal
    y = _within(G, ac, vh, lay, _tile(lay, strategy))  # (R, m, Nc, C, Dv)
    # what each chunk adds to the transposed state: (v * decay to the chunk's end)^T k, (R, Nc, W, D)
    Ut = _columns_scaled(vh, Wd, lay).transpose(-1, -2) @ kc
    seed = q.new_zeros(lay.R, lay.W, lay.D) if s0 is None else _transposed_state(s0, lay)
    S = chunk_recurrence(_transitions(T, lay), Ut.transpose(0, 1), seed, strategy=strategy)  # (Nc + 1, R, W, D)
    Z = qc @ S[:-1].transpose(0, 1).transpose(-1, -2)  # (R, Nc, C, W): every chunk's state read at once
    y.addcmul_(lay.heads(Z), E.unsqueeze(-1))
    return lay.output(y), S


def _columns_scaled(vh: Tensor, scale: Tensor, lay: _Layout) -> Tensor:
    """``lay.columns(vh * scale[..., None])`` in one pass: ``vh (R, m, Nc, C, Dv)``, ``scale (R, m, Nc, C)``."""
    out = vh.new_empty(lay.R, lay.Nc, lay.C, lay.m, lay.Dv)
    torch.mul(vh.permute(0, 2, 3, 1, 4), scale.permute(0, 2, 3, 1).unsqueeze(-1), out=out)
    return out.view(lay.R, lay.Nc, lay.C, lay.W)


def _transposed_state(s: Tensor, lay: _Layout) -> Tensor:
    """``s (B, H, D, Dv)`` -> ``(R, W, D)``."""
    return s.reshape(lay.R, lay.m, lay.D, lay.Dv).permute(0, 1, 3, 2).reshape(lay.R, lay.W, lay.D)


def _state(St: Tensor, lay: _Layout) -> Tensor:
    """``(R, W, D)`` -> ``s (B, H, D, Dv)``."""
    return St.reshape(lay.R, lay.m, lay.Dv, lay.D).transpose(-1, -2).reshape(lay.B, lay.Hk * lay.m, lay.D, lay.Dv)


def _backward(q, k, v, a, s0, S, dy, ds, lay: _Layout, strategy: str):
    """Gradients of ``(q, k, v, a, s0)`` from those of the outputs ``dy (B, H, N, Dv)`` and the final
    state ``ds (B, H, D, Dv)`` or None; ``S`` the forward's transposed states."""
    qc, kc = lay.chunks(q), lay.chunks(k)
    vh = lay.head_chunks(v)
    ac = lay.chunks(a).view(lay.R, lay.m, lay.Nc, lay.C)
    E, Wd, T = _decays(ac)
    dyh = lay.head_chunks(dy)  # (R, m, Nc, C, Dv)
    # from the state read: y += heads(q S_c) * E
    Z = qc @ S[:-1].transpose(0, 1).transpose(-1, -2)  # (R, Nc, C, W)
    dE = (lay.heads(Z) * dyh).sum(-1)  # (R, m, Nc, C)
    dZ = _columns_scaled(dyh, E, lay)  # (R, Nc, C, W)
    dq = dZ @ S[:-1].transpose(0, 1)  # (R, Nc, C, D)
    dSt_read = dZ.transpose(-1, -2) @ qc  # (R, Nc, W, D): the loss's gradient by each S_c, transposed
    seed = q.new_zeros(lay.R, lay.W, lay.D) if ds is None else _transposed_state(ds, lay)
    A = _transitions(T, lay)
    # g_c: the gradient by the state before chunk c; g_Nc the final state's
    g = chunk_recurrence(A, dSt_read.transpose(0, 1), seed, strategy=strategy, reverse=True)  # (Nc + 1, R, W, D)
    dU = g[1:].transpose(0, 1)  # (R, Nc, W, D): what chunk c added reaches the state after it
    dT = (g[1:] * S[:-1]).sum(-1).view(lay.Nc, lay.R, lay.m, lay.Dv).sum(-1).permute(1, 2, 0) * T  # d log T
    # the chunk's additions: Ut = (vh * Wd)^T k
    vw = _columns_scaled(vh, Wd, lay)  # (R, Nc, C, W)
    dk = vw @ dU  # (R, Nc, C, D)
    dvw = lay.heads(kc @ dU.transpose(-1, -2))  # (R, m, Nc, C, Dv)
    dv = dvw * Wd.unsqueeze(-1)
    dWd = (dvw * vh).sum(-1) * Wd  # d log Wd, (R, m, Nc, C)
    # within the chunks: y += M @ vh, M = tril(G) * L
    G = (qc @ kc.transpose(-1, -2)).tril_()
    dv_within, dG, da = _within_backward(G, ac, vh, dyh, lay, _tile(lay, strategy))
    dv = dv + dv_within
    dq = dq + dG @ kc
    dk = dk + dG.transpose(-1, -2) @ qc
    # the other log decays: log E[i] = sum a[..i], log Wd[j] = sum a(j..], log T = sum a
    da = da + (dE * E).flip(-1).cumsum(-1).flip(-1)  # a[t] is in log E[i] for i >= t
    da = da + F.pad(dWd.cumsum(-1), (1, 0))[..., :-1]  # a[t] is in log Wd[j] for j < t
    da = da + dT.unsqueeze(-1)
    ds0 = None if s0 is None else _state(g[0], lay)
    unchunk = lambda x, heads: x.reshape(lay.B, heads, lay.Nc * lay.C, *x.shape[3:])[:, :, : lay.N]  # noqa: E731
    dqo = unchunk(dq, lay.Hk)
    dko = unchunk(dk, lay.Hk)
    dvo = lay.output(dv)
    dao = da.reshape(lay.B, lay.Hk * lay.m, lay.Nc * lay.C)[:, :, : lay.N]
    return dqo, dko, dvo, dao, ds0


class _GroupedDecayed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, a, s0, chunk_size, strategy):
        lay = _Layout(q, v, chunk_size)
        y, S = _forward(q, k, v, a, s0, lay, strategy)
        ctx.save_for_backward(q, k, v, a, s0, S)
        ctx.lay, ctx.strategy = lay, strategy
        return y, _state(S[-1], lay)

    @staticmethod
    def backward(ctx, dy, ds):
        q, k, v, a, s0, S = ctx.saved_tensors
        dy = torch.zeros_like(v) if dy is None else dy.contiguous()
        grads = _backward(q, k, v, a, s0, S, dy, ds, ctx.lay, ctx.strategy)
        return (*grads, None, None)


def grouped_decayed_product(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, s0: Tensor | None, *,
                            chunk_size: int, strategy: str) -> tuple[Tensor, Tensor]:
    """``S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t`` per head, the m heads of
    a group sharing q and k. Prepared inputs (checked, the compute dtype, q scaled):

    Args:
        q, k: ``(B, Hk, N, D)``; v: ``(B, H, N, Dv)``, H a multiple of Hk (head h in group h // m).
        log_decay: ``(B, H, N)``, <= 0 (-inf a reset).
        s0: ``(B, H, D, Dv)`` or None (zeros).
        chunk_size: C; strategy: ``"cpu"`` or ``"accelerator"`` (resolved), the recurrence's.

    Returns ``(o (B, H, N, Dv), final state (B, H, D, Dv))``, differentiable in every input.
    """
    return _GroupedDecayed.apply(q.contiguous(), k.contiguous(), v.contiguous(), log_decay.contiguous(),
                                 None if s0 is None else s0.contiguous(), chunk_size, strategy)
