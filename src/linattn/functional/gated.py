"""Gated (decayed) linear attention: RetNet, Mamba-2 / simple GLA, GLA. Causal only.

One recurrence in time, with a decay per head and position or per key channel:

    S_t = exp(log_decay_t) * S_{t-1} + k_t v_t^T        (S_0 = initial_state, or zeros)
    o_t = scale * S_t^T q_t

``log_decay (B, H, N)`` is one gate per head and position (RetNet with a constant, arXiv
2307.08621; Mamba-2 / simple GLA with a data-dependent one, arXiv 2405.21060) and scales all of S;
``log_decay (B, H, N, D)`` is one gate per key channel (GLA, arXiv 2312.06635) and scales the rows
of S. There is no bidirectional form: the decay is a recurrence in time and has no meaning for a
key after the query, so there is no ``causal`` argument.

Dimension legend: B batch, H heads, N positions, D query/key width, Dv value width, R rows (the B*H
independent sequences), C chunk length, Nc chunks, m chunks of one tile, c sub-chunk length,
n = C / c sub-chunks per chunk, G gate width (1 for a per-head gate, D for a per-channel one).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_scale,
    check_values,
    compute_dtype,
    no_autocast,
    shape_str,
)
from .chunks import ChunkLayout
from .decayed_state import DecayedState, check_decayed_state, result_without_positions
from .log_decays import RESET_LOG_DECAY, CumulativeLogDecay
from .varlen import check_cu_seqlens, varlen_layout

__all__ = ["gated_linear_attention", "gated_linear_attention_reference"]


def _check_log_decay(fn: str, log_decay, q: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Validate ``log_decay`` and return it as ``(B, H, N, G)`` (G = 1 or D) in the compute dtype,
    padded positions replaced by 0 (an identity step; their content, even NaN, is never read).

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: wrong shape or device, or an entry of a real position that is positive or NaN
            (-inf is allowed: a decay of exactly 0, a full reset).
    """
    if not isinstance(log_decay, Tensor) or not log_decay.is_floating_point():
        got = log_decay.dtype if isinstance(log_decay, Tensor) else type(log_decay).__name__
        raise TypeError(f"{fn}: log_decay must be a floating-point tensor, got {got}")
    B, H, N, D = q.shape
    if tuple(log_decay.shape) == (B, H, N):
        g = log_decay.unsqueeze(-1)  # (B, H, N, 1)
    elif tuple(log_decay.shape) == (B, H, N, D):
        g = log_decay
    else:
        raise ValueError(
            f"{fn}: log_decay must have shape (B, H, N) = {(B, H, N)} (one gate per head and position) "
            f"or (B, H, N, D) = {(B, H, N, D)} (one per key channel) for q {shape_str(q)}, "
            f"got {shape_str(log_decay)}"
        )
    if log_decay.device != q.device:
        raise ValueError(f"{fn}: log_decay is on {log_decay.device}, q on {q.device}")
    g = g.to(compute_dtype(q.dtype))
    if key_padding_mask is not None:
        g = torch.where(key_padding_mask[:, None, :, None], g, g.new_zeros(()))
    with torch.no_grad():
        ok = g <= 0  # False where positive or NaN
        check_values(ok, lambda: f"{fn}: log_decay must be <= 0 (a decay exp(log_decay) in [0, 1]; -inf is a "
                     f"decay of 0) at every real position, got {g[~ok][0].item():.6g}")
    return g


def _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state, *, scaled=True, cu_seqlens=None):
    """Checks, then ``q * scale`` (``q`` and the scale with ``scaled=False``), ``k, v (B, H, N, *)``, ``g (B, H, N, G)`` and ``s0 (B, H, D, Dv)``
    or None, all in the compute dtype, padded positions zeroed (q too: their output is zeros).
    With ``cu_seqlens`` (checked here), B = 1 and ``s0`` has one state per document, ``(n, H, D, Dv)``."""
    check_qkv(fn, q, k, v, causal=True)
    n_states = q.shape[0]
    if cu_seqlens is not None:
        n_states = check_cu_seqlens(fn, cu_seqlens, q).shape[0] - 1
    check_key_padding_mask(fn, key_padding_mask, k)
    scale = check_scale(fn, scale, q.shape[-1])
    g = _check_log_decay(fn, log_decay, q, key_padding_mask)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    s0 = None
    if initial_state is not None:
        check_decayed_state(fn, initial_state, n_states, H, D, Dv, q.device)
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if scaled:
        q = q * scale
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, :, None]  # (B, 1, N, 1)
        zero = q.new_zeros(())
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))
    if initial_state is not None:
        s0 = initial_state.s.to(dt)
    return (q, k, v, g, s0) if scaled else (q, k, v, g, s0, scale)


def gated_linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    *,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """The recurrence of :func:`gated_linear_attention` run position by position, straight from
    the formula. Same contract (minus ``chunk_size``); tests trust this one, in float64."""
    fn = "gated_linear_attention_reference"
    in_dtype = q.dtype
    q, k, v, g, s0 = _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    if B * H * N == 0:  # no step at all: as in gated_linear_attention
        out, s = result_without_positions((q, k, v, g), s0, (B, H, N, Dv), (B, H, D, Dv))
    else:
        s = q.new_zeros(B, H, D, Dv) if s0 is None else s0  # (B, H, D, Dv)
        outs = []
        for t in range(N):
            s = torch.exp(g[:, :, t]).unsqueeze(-1) * s + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append((q[:, :, t, None, :] @ s).squeeze(-2))  # (B, H, Dv)
        out = torch.stack(outs, dim=2)
    out = out.to(in_dtype)
    return (out, DecayedState(s)) if return_state else out



# ---------------------------------------------------------------------------------------------
# The chunked causal form.
#
# Within a chunk, with b_t = log_decay_1 + ... + log_decay_t (cumulative from the chunk's start,
# <= 0 and non-increasing) and S_0 the state before the chunk:
#
#     o_t   = (q_t * exp(b_t))^T S_0 + sum_{s <= t} A_ts v_s,   A_ts = sum_d q_td k_sd exp(b_td - b_sd)
#     S_end = exp(b_C) * S_0 + sum_s (k_s * exp(b_C - b_s)) v_s^T
#
# Every exponent above is <= 0 once the entries with s > t are clamped to 0 before the exp (and
# zeroed after it): no exp(+large) anywhere, so huge decays give exact zeros rather than inf * 0 =
# NaN. b is held in the compute dtype as small decays plus a count of resets (log decays below
# -40, -inf included: log_decays.py), so its differences keep their digits without float64. Across
# chunks, S_end = exp(b_C) * S_0 + U is a loop over chunks (never over positions) of one addcmul.
#
# A per-head gate (G = 1) makes exp(b_t - b_s) one number per (t, s): A is (q k^T) * exp(masked
# differences), a C x C matrix. A per-channel gate (G = D) cannot be factored as exp(b_t) exp(-b_s)
# (exp(-b_s) overflows once the chunk has decayed by more than ~88 in float32), and the explicit
# (C, C, D) tensor of differences costs C*D exps per position. So the chunk is cut into sub-chunks
# of c positions (the GLA paper's secondary chunking, arXiv 2312.06635 sec. 4): a block of queries
# in sub-chunk i against keys in earlier sub-chunks factors safely through the cumulative decay r_i
# at the end of sub-chunk i-1, exp(b_t - b_s) = exp(b_t - r_i) * exp(r_i - b_s), both exponents
# <= 0 since s <= (end of i-1) < t, which makes it one bmm; only the c x c diagonal blocks are
# formed explicitly, and of them only the c (c - 1) / 2 pairs s < t (s = t has a decay of 1), D
# values each. The factor exp(r_{i-1} - b_s) is itself split at the end of the key's sub-chunk (see
# _intra_channel). Every factor within one sub-chunk (the diagonal pairs, and the factors to and from
# its ends) is a product of at most c decays exp(g) rather than an exp of a difference: one exp per
# position and channel, and no digit lost however large the decays before.
#
# Backward: the per-chunk states S_0 are saved (N/C of them, (D, Dv) each: O(N) memory), the chunk-
# local products are recomputed. The log decays need no product of their own. A term of an output
# (or of the final state) at t' that reads the key at s carries exp(B_t' - B_s) (B: cumulative log
# decay), so it reaches log_decay_t for s < t <= t' with the factor (term * dterm). For t in a
# chunk, sort those terms by where s and t' lie:
#   s, t' in the chunk:        reverse cumsum within the chunk of q*dq_intra - k*dk_intra
#                              (each pair adds at t' and takes away at s; intra: from A alone)
#   s before, t' in the chunk: reverse cumsum of q*dq_inter (dq_inter: through S_0)
#   s in, t' after the chunk:  exclusive cumsum of k*dk_inter (dk_inter: through S_end)
#   s before, t' after:        exp(b_C) * S_0 * dS_end summed over Dv, alike for the whole chunk.
# Every sum stays inside one chunk. The shorter identity dL/dB_t = q_t*dq_t - k_t*dk_t with one
# reverse cumsum over the whole sequence is the same sum regrouped, but it cancels terms across
# the whole sequence: where decays are near -1e4 (true gradient 0) its rounding error is that of
# a sum of N terms instead of C.
# ---------------------------------------------------------------------------------------------

# Default chunk length per gate width: one per head (A is (q k^T) times a C x C decay matrix) and
# one per key channel (sub-chunks, see above), each the fastest measured (docs/benchmarks, History).
# The other knobs' defaults are in gated_linear_attention's signature.
_CHUNK_SIZES = {"head": 64, "channel": 32}


def _sub_length(C: int, sub_chunk_size: int) -> int:
    """The sub-chunk length c: the largest divisor of C up to ``sub_chunk_size``."""
    return max(d for d in range(1, min(C, sub_chunk_size) + 1) if C % d == 0)


def _strict_upper(n: int, device) -> Tensor:
    """``(n, n)`` bool, True above the diagonal (s > t: a key after the query)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def _exp_masked(x: Tensor, upper: Tensor) -> Tensor:
    """``exp(x)``, in place in the temporary ``x``, with the entries where ``upper`` is True set to
    0. Those (a key after the query) are positive and are clamped to 0 before the exp, not masked
    to -inf: exp of -inf (and of any result below the normal range) takes a slow path on CPUs,
    several times the cost of an ordinary one."""
    return x.clamp_(max=0).exp_().masked_fill_(upper, 0)


def _intra_head(q: Tensor, k: Tensor, b: CumulativeLogDecay) -> tuple[Tensor, Tensor]:
    """Per-head gate: ``q, k (M, C, D)``, ``b (M, C, 1)`` -> ``A (M, C, C)`` and the masked
    decays ``E = exp(b_t - b_s)`` ``(M, C, C)`` (0 above the diagonal)."""
    E = _exp_masked(b - b.transpose(1, 2), _strict_upper(b.shape[1], b.device))  # exp(b_t - b_s)
    return torch.bmm(q, k.transpose(1, 2)).mul_(E), E


def _sub_chunk_pairs(a: Tensor) -> Tensor:
    """``a (M, n, c, D)`` per-position decays -> ``E (M, n, p, D)``: for every pair s < t of a
    sub-chunk, in ``torch.tril_indices(c, c, -1)`` order, the product ``a_{s+1} ... a_t`` =
    ``exp(b_t - b_s)``. Products of at most c - 1 factors in [0, 1]: no difference of sums, so no
    digit is lost and a reset (a = 0) gives an exact 0."""
    M, n, c, D = a.shape
    if c == 1:
        return a.new_empty(M, n, 0, D)
    runs = [None, a[:, :, 1:]]  # runs[d][:, :, t - d]: the product over (t - d, t], for t >= d
    for d in range(2, c):
        runs.append(runs[d - 1][:, :, 1:] * a[:, :, 1:c - d + 1])
    return torch.stack([runs[t - s][:, :, s] for t in range(1, c) for s in range(t)], dim=2)


def _intra_channel(q: Tensor, k: Tensor, g: Tensor, b: CumulativeLogDecay, c: int):
    """Per-channel gate: ``q, k (M, C, D)``, log decays ``g (M, C, D)`` and their cumulative sums
    ``b (M, C, D)`` -> ``A (M, C, C)`` and what the backward needs (sub-chunks of length ``c``, as
    described at the top of this section)."""
    M, C, D = q.shape
    n, P = C // c, C - c
    qs, ks, bs = (t.view(M, n, c, D) for t in (q, k, b))
    # the decays themselves, a reset an exact 0 (log_decays.py); clamped first, as exp of far
    # below its range takes a slow path on CPUs
    a = g.clamp(min=RESET_LOG_DECAY).exp_().masked_fill_(g < RESET_LOG_DECAY, 0).view(M, n, c, D)
    A = q.new_zeros(M, C, C)
    # Diagonal blocks, the pairs s < t of one sub-chunk only (p = c (c - 1) / 2 of them; s = t has
    # a decay of 1): E (M, n, p, D) = exp(b_t - b_s), as products of the decays between.
    ti, si = torch.tril_indices(c, c, -1, device=q.device)
    E = _sub_chunk_pairs(a)
    Ad = q.new_zeros(M, n, c * c)
    Ad.index_copy_(2, ti * c + si, (qs[:, :, ti] * E).mul_(ks[:, :, si]).sum(-1))
    Ad = Ad.view(M, n, c, c)
    # (M, n, c); copied rather than written with out= into the strided view, which torch.compile refuses
    Ad.diagonal(dim1=2, dim2=3).copy_(torch.linalg.vecdot(qs, ks))
    off = None
    if n > 1:
        # Queries of sub-chunk i >= 1 against keys s of sub-chunk j < i, with r_j = b at the end of
        # sub-chunk j: exp(b_t - b_s) = exp(b_t - r_{i-1}) exp(r_{i-1} - r_j) exp(r_j - b_s), every
        # exponent <= 0. Only the first and last factors are per position (one exp each); the
        # middle one is per pair of sub-chunks, 0 for j >= i.
        r = bs[:, :, -1:]  # (M, n, 1, D)
        # the per-position factors as products within a sub-chunk: exp(b_t - r_{i-1}) is
        # a_1 ... a_t of sub-chunk i (M, n-1, c, D), exp(r_j - b_s) is a_{s+1} ... a_c of sub-chunk j
        eq = a[:, 1:].cumprod(2)
        ek = torch.cat([a[:, :-1, 1:].flip(2).cumprod(2).flip(2), a.new_ones(M, n - 1, 1, D)], dim=2)
        # (M, n-1 (i), n-1 (j), D): exp(r_{i-1} - r_j), 0 for j >= i
        mid = _exp_masked(r[:, :-1] - r[:, :-1].transpose(1, 2), _strict_upper(n - 1, q.device)[:, :, None])
        qt = qs[:, 1:] * eq  # (M, n-1, c, D)
        kj = ks[:, :-1] * ek  # (M, n-1, c, D)
        kt = (mid.unsqueeze(3) * kj.unsqueeze(1)).view(M, n - 1, P, D)  # (M, n-1 (i), P, D)
        A.view(M, n, c, C)[:, 1:, :, :P] = qt @ kt.transpose(-1, -2)  # (M, n-1, c, P)
        off = (eq, ek, mid, qt, kt)
    A.view(M, n, c, n, c).diagonal(dim1=1, dim2=3).copy_(Ad.permute(0, 2, 3, 1))
    return A, (E, off)


def _intra_channel_backward(q: Tensor, k: Tensor, c: int, saved, dA: Tensor) -> tuple[Tensor, Tensor]:
    """``dq, dk (M, C, D)`` of the intra-chunk product ``A v`` of :func:`_intra_channel`, from
    ``dA (M, C, C)`` (entries above the diagonal are ignored)."""
    M, C, D = q.shape
    n, P = C // c, C - c
    E, off = saved
    qs, ks = q.view(M, n, c, D), k.view(M, n, c, D)
    dAd = dA.view(M, n, c, n, c).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # (M, n, c_t, c_s)
    ti, si = torch.tril_indices(c, c, -1, device=q.device)
    W = E.mul_(dAd.reshape(M, n, c * c)[:, :, ti * c + si].unsqueeze(-1))  # (M, n, p, D), E not needed again
    dd = dAd.diagonal(dim1=2, dim2=3).unsqueeze(-1)  # (M, n, c, 1): the pairs s = t
    dq = (ks * dd).index_add_(2, ti, W * ks[:, :, si]).view(M, C, D)
    dk = (qs * dd).index_add_(2, si, W.mul_(qs[:, :, ti])).view(M, C, D)
    if off is not None:
        eq, ek, mid, qt, kt = off
        dAo = dA.view(M, n, c, C)[:, 1:, :, :P]  # (M, n-1, c, P)
        dq.view(M, n, c, D)[:, 1:] += (dAo @ kt).mul_(eq)
        dkt = (dAo.transpose(-1, -2) @ qt).view(M, n - 1, n - 1, c, D)  # (M, i, j, c, D)
        dkj = dkt.mul_(mid.unsqueeze(3)).sum(1)  # (M, n-1 (j), c, D)
        dk.view(M, n, c, D)[:, :-1] += dkj.mul_(ek)
    return dq, dk


def _tile_decays(g: Tensor) -> tuple[CumulativeLogDecay, Tensor, Tensor]:
    """``g (m, R, C, G)`` -> cumulative ``b (m, R, C, G)``, ``exp(b) (m, R, C, G)`` and
    ``exp(b_C - b) (m, R, C, G)``, all in g's dtype; every exponent <= 0. b keeps the digits of
    small decays after a large one (a reset) without float64: see log_decays.py."""
    b = CumulativeLogDecay.of(g, 2)
    return b, b.exp(), (b[:, :, -1:] - b).exp_()


def _g_sum(x: Tensor, G: int) -> Tensor:
    """Sum ``x (..., D)`` over its last dimension for a per-head gate (G = 1), keep it for G = D."""
    return x.sum(-1, keepdim=True) if G == 1 else x


def _tile_intra(q: Tensor, k: Tensor, g: Tensor, b: CumulativeLogDecay, c: int):
    """``A (m, R, C, C)`` of a tile and what its backward needs, from its log decays ``g`` and
    their cumulative sums ``b`` ``(m, R, C, G)``."""
    m, R, C, D = q.shape
    q2, k2, g2, b2 = (t.reshape(m * R, C, t.shape[-1]) for t in (q, k, g, b))
    if b.shape[-1] == 1:
        A, saved = _intra_head(q2, k2, b2)
    else:
        A, saved = _intra_channel(q2, k2, g2, b2, c)
    return A.view(m, R, C, C), saved


def _gated_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s0: Tensor | None, chunk_size: int, scale: float,
                   sub_chunk_size: int, tile_positions: int) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked form: ``q, k (B, H, N, D)``, ``v (B, H, N, Dv)``, ``g (B, H, N, G)``,
    ``s0 (B, H, D, Dv)`` or None, all in one (compute) dtype -> ``o (B, H, N, Dv)``, the final
    state ``(B, H, D, Dv)`` and the states before every chunk and after the last,
    ``(Nc + 1, B*H, D, Dv)`` (what the backward needs besides the inputs). ``q`` is scaled tile
    by tile (a scaled copy of the whole q would be one more full-size tensor)."""
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    lay = ChunkLayout.of(B * H, N, chunk_size, tile_positions=tile_positions)
    R, C, Nc = lay.R, lay.C, lay.Nc
    q3, k3, v3, g3 = (lay.chunked(t.reshape(R, N, t.shape[-1])) for t in (q, k, v, g))  # (R, Nc, C, *)
    states = q.new_empty(Nc + 1, R, D, Dv)  # states[j]: the state before chunk j
    if s0 is None:
        states[0].zero_()
    else:
        states[0] = s0.reshape(R, D, Dv)
    o = lay.new_chunked(q, Dv)
    c = _sub_length(C, sub_chunk_size)
    for sl in lay.tiles():
        q_ = lay.view(q3, sl) * scale  # (m, R, C, D)
        k_, v_, g_ = (lay.take(t, sl) for t in (k3, v3, g3))
        b, eb, ek = _tile_decays(g_)
        u = (k_ * ek).transpose(-1, -2) @ v_  # (m, R, D, Dv): what the chunk writes
        a = eb[:, :, -1].unsqueeze(-1)  # (m, R, G, 1): its decay of the state before
        for j in range(sl.stop - sl.start):
            torch.addcmul(u[j], a[j], states[sl.start + j], out=states[sl.start + j + 1])
        A, _ = _tile_intra(q_, k_, g_, b, c)
        lay.put(o, sl, (q_ * eb) @ states[sl] + A @ v_)
    return lay.unchunked(o).reshape(B, H, N, Dv).contiguous(), states[Nc].reshape(B, H, D, Dv).clone(), states


def _gated_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, states: Tensor, do: Tensor, ds_final: Tensor,
                    has_s0: bool, chunk_size: int, scale: float, sub_chunk_size: int,
                    tile_positions: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`_gated_forward` given ``do (B, H, N, Dv)`` and ``ds_final (B, H, D, Dv)``:
    ``dq, dk, dv, dg`` shaped as their inputs and ``ds0 (B, H, D, Dv)`` (``(0,)`` without
    ``has_s0``). The chunk-local products are recomputed from the inputs and the saved states."""
    B, H, N, D = q.shape
    Dv, G = v.shape[-1], g.shape[-1]
    lay = ChunkLayout.of(B * H, N, chunk_size, tile_positions=tile_positions)
    R, C, Nc = lay.R, lay.C, lay.Nc
    q3, k3, v3, g3, do3 = (lay.chunked(t.reshape(R, N, t.shape[-1])) for t in (q, k, v, g, do))  # (R, Nc, C, *)
    T = q3.new_empty(Nc + 1, R, D, Dv)  # T[j]: gradient of states[j]
    T[Nc] = ds_final.reshape(R, D, Dv)
    dq3, dk3, dv3, dg3 = (lay.new_chunked(q, X) for X in (D, D, Dv, G))
    c = _sub_length(C, sub_chunk_size)
    for sl in reversed(lay.tiles()):
        q_ = lay.view(q3, sl) * scale  # (m, R, C, D)
        k_, v_, g_, do_ = (lay.take(t, sl) for t in (k3, v3, g3, do3))
        b, eb, ek = _tile_decays(g_)
        qd = q_ * eb
        gs = qd.transpose(-1, -2) @ do_  # (m, R, D, Dv): the outputs' gradient of the state before
        a = eb[:, :, -1].unsqueeze(-1)  # (m, R, G, 1)
        for j in reversed(range(sl.stop - sl.start)):
            torch.addcmul(gs[j], a[j], T[sl.start + j + 1], out=T[sl.start + j])
        s_, t_ = states[sl], T[sl.start + 1: sl.stop + 1]  # before, gradient after each chunk
        A, saved = _tile_intra(q_, k_, g_, b, c)
        dA = do_ @ v_.transpose(-1, -2)  # (m, R, C, C)
        lay.put(dv3, sl, (k_ * ek) @ t_ + A.transpose(-1, -2) @ do_)
        dq = (do_ @ s_.transpose(-1, -2)).mul_(eb)  # through the state before the chunk
        dk = (v_ @ t_.transpose(-1, -2)).mul_(ek)  # through the state after it
        y, z = _g_sum(q_ * dq, G), _g_sum(k_ * dk, G)  # (m, R, C, G)
        M = R * (sl.stop - sl.start)
        if G == 1:
            dP = dA.view(M, C, C).mul_(saved)  # saved: the masked decays E
            dqi = torch.bmm(dP, k_.reshape(M, C, D))
            dki = torch.bmm(dP.transpose(1, 2), q_.reshape(M, C, D))
        else:
            dqi, dki = _intra_channel_backward(q_.reshape(M, C, D), k_.reshape(M, C, D), c, saved,
                                               dA.view(M, C, C))
        dqi, dki = dqi.view_as(q_), dki.view_as(k_)
        x = _g_sum(q_ * dqi - k_ * dki, G)
        # Decay of the state through the whole chunk: (m, R, 1, G), the same for every position.
        whole = _g_sum((a * s_ * t_).sum(-1), G).unsqueeze(2)
        dg = (x + y).flip(2).cumsum(2).flip(2) + z.cumsum(2) - z + whole
        # 0 at a reset (a log decay below -40, -inf included): each term carries a decay of
        # exactly 0 there, but the cumulative sums above leave rounding noise
        lay.put(dg3, sl, dg.masked_fill_(g_ < RESET_LOG_DECAY, 0))
        lay.put(dq3, sl, dq.add_(dqi).mul_(scale))  # the tile saw scale * q
        lay.put(dk3, sl, dk + dki)
    ds0 = T[0].reshape(B, H, D, Dv) if has_s0 else T.new_empty(0)
    dq, dk, dv, dg = (lay.unchunked(t).reshape(B, H, N, t.shape[-1]).contiguous() for t in (dq3, dk3, dv3, dg3))
    return dq, dk, dv, dg, ds0


# The chunked form as a torch.library custom op with its own autograd: torch.compile then sees one
# op with a shape function (no chunk loop to unroll and no engine internals to trace, so a model
# compiles in seconds and whole), and eager autograd runs the same two functions.
@torch.library.custom_op("linattn::gated_chunked", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? s0, int chunk_size, float scale, "
                                "int sub_chunk_size, int tile_positions) -> (Tensor, Tensor, Tensor)")
def _gated_chunked(q, k, v, g, s0, chunk_size, scale, sub_chunk_size, tile_positions):
    with no_autocast(q.device.type):
        return _gated_forward(q, k, v, g, s0, chunk_size, scale, sub_chunk_size, tile_positions)


@_gated_chunked.register_fake
def _(q, k, v, g, s0, chunk_size, scale, sub_chunk_size, tile_positions):
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    Nc = -(-N // min(chunk_size, N))
    return q.new_empty(B, H, N, Dv), q.new_empty(B, H, D, Dv), q.new_empty(Nc + 1, B * H, D, Dv)


@torch.library.custom_op("linattn::gated_chunked_backward", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor g, Tensor states, Tensor do, Tensor ds_final, "
                                "bool has_s0, int chunk_size, float scale, int sub_chunk_size, int tile_positions) "
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _gated_chunked_backward(q, k, v, g, states, do, ds_final, has_s0, chunk_size, scale, sub_chunk_size,
                            tile_positions):
    with no_autocast(q.device.type):
        return _gated_backward(q, k, v, g, states, do, ds_final, has_s0, chunk_size, scale, sub_chunk_size,
                               tile_positions)


@_gated_chunked_backward.register_fake
def _(q, k, v, g, states, do, ds_final, has_s0, chunk_size, scale, sub_chunk_size, tile_positions):
    B, H, _, D = q.shape
    ds0 = q.new_empty(B, H, D, v.shape[-1]) if has_s0 else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), ds0


def _gated_setup(ctx, inputs, output):
    q, k, v, g, s0, chunk_size, scale, sub_chunk_size, tile_positions = inputs
    ctx.save_for_backward(q, k, v, g, output[2])
    ctx.knobs = (s0 is not None, chunk_size, scale, sub_chunk_size, tile_positions)
    ctx.mark_non_differentiable(output[2])
    # unused outputs' gradients stay None: materialised, the saved states' would be a zero-filled tensor
    # as large as the states themselves on every backward
    ctx.set_materialize_grads(False)


def _gated_autograd(ctx, do, ds_final, _dstates):
    q, k, v, g, states = ctx.saved_tensors
    has_s0 = ctx.knobs[0]
    do = torch.zeros_like(v) if do is None else do.to(v.dtype)
    if ds_final is None:
        ds_final = q.new_zeros(*q.shape[:2], *states.shape[2:])  # (B, H, D, Dv)
    dq, dk, dv, dg, ds0 = _gated_chunked_backward(q, k, v, g, states, do, ds_final, *ctx.knobs)
    return dq, dk, dv, dg, ds0 if has_s0 else None, None, None, None, None


_gated_chunked.register_autograd(_gated_autograd, setup_context=_gated_setup)


def _recurrent_step(q, k, v, g, s0):
    """One position (N = 1) from a state: O(D*Dv), no chunk machinery. Shapes as the chunked form."""
    s = torch.addcmul(k.transpose(-1, -2) * v, torch.exp(g).transpose(-1, -2), s0)  # (B, H, D, Dv)
    return q @ s, s

def _varlen(q, k, v, g, s0, scale, cu_seqlens, return_state, chunk_size, knobs):
    """Packed documents (see ``varlen.py``): ``q, k (1, H, T, D)``, ``v (1, H, T, Dv)``,
    ``g (1, H, T, G)``, ``s0 (n, H, D, Dv)`` or None, prepared (compute dtype, padding zeroed) ->
    ``(1, H, T, Dv)`` and the per-document final states ``(n, H, D, Dv)`` (None unless
    ``return_state``). One run of the chunked form on the expanded sequence: -inf log decays at the
    documents' starts, D positions writing each initial state and D reading each final one.
    T, H >= 1: gated_linear_attention answers inputs without a position itself."""
    H, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    lay = varlen_layout(cu_seqlens, q.shape[2], D, write_states=s0 is not None, read_states=return_state)
    if lay.gather is not None:
        # inserted positions read and write with scale 1: scale the real queries here instead
        q = lay.expand(q * scale, lay.zeros(q), lay.basis(q))
        k = lay.expand(k, lay.basis(k), lay.zeros(k))
        v = lay.expand(v, None if s0 is None else lay.state_rows(s0), lay.zeros(v))
        g = lay.expand(g, lay.zeros(g), lay.zeros(g))
        scale = 1.0
    out, _, _ = _gated_chunked(q, k, v, lay.with_resets(g), None, chunk_size, scale, *knobs)
    return lay.packed(out), (lay.states(out) if return_state else None)


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    *,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    sub_chunk_size: int = 4,
    tile_positions: int = 4096,
    cu_seqlens: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Gated linear attention ``S_t = exp(log_decay_t) * S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    Causal only: the decay is a recurrence in time, so there is no ``causal`` argument and no
    bidirectional form. Chunked (O(N) memory, a loop over chunks, never over positions) with its
    own backward; gradients reach q, k, v, log_decay and ``initial_state.s`` (once; no double
    backward). A call with N = 1 and an ``initial_state`` is the recurrent form: one step of cost
    O(D*Dv), without the chunk machinery.

    Args:
        q: ``(B, H, N, D)`` queries.
        k: ``(B, H, N, D)`` keys.
        v: ``(B, H, N, Dv)`` values.
        log_decay: ``(B, H, N)``, one gate per head and position (RetNet, Mamba-2, simple GLA), or
            ``(B, H, N, D)``, one per key channel, scaling the rows of S (GLA). Entries must be
            <= 0 (ValueError for a positive or NaN entry); -inf is a decay of 0, a full reset.
            Inside the chunked form an entry below -40 is a reset, a decay of exactly 0 (exp(-40)
            is 4e-18; its gradient is taken as 0), and the cumulative log decays of a chunk are
            held as small decays plus a count of resets in the compute dtype (no float64), so a
            huge decay early in a chunk does not drown the digits of small ones after it
            (``linattn.functional.log_decays``). Any floating dtype.
        scale: the factor of the readout; None is ``1/sqrt(D)``.
        key_padding_mask: bool ``(B, N)``, True = a real position, False = padding. A padded
            position is an identity step (no decay, no write; its content, even NaN, is never
            read) and its output is zeros.
        initial_state: the :class:`DecayedState` after an earlier prefix, to resume from (None:
            zeros).
        return_state: also return the :class:`DecayedState` after the last position.
        chunk_size: a tuning knob, the chunk length C of the algorithm; any C >= 1 gives the
            same result. None: 64 for a per-head gate, 32 for a per-channel one (why:
            docs/benchmarks/README.md, History).
        sub_chunk_size: a tuning knob of the per-channel gate, the sub-chunk length c (the largest
            divisor of C up to it); any value >= 1 gives the same result. The explicit pairs of a
            sub-chunk grow as c per position, the factored products between sub-chunks as C / c.
        tile_positions: a tuning knob, about how many positions (all B*H rows together) one tile
            of chunks holds; any value >= 1 gives the same result. Temporaries stay a few MiB,
            recycled and in cache, instead of tensors over the whole sequence.
        cu_seqlens: None, or int64 ``(n + 1,)`` offsets ``[0, c_1, ..., T]`` of n documents packed
            along N (non-decreasing; empty documents allowed), flash-attention's varlen convention.
            Then B must be 1 (inputs ``(1, H, T, *)``), no information crosses a document
            boundary, and ``initial_state`` and the returned state hold one state per document,
            ``s (n, H, D, Dv)``: the result equals one call per document (outputs, gradients,
            states), in one chunked run over T positions (plus n*D per kind of state asked for;
            see ``linattn.functional.varlen``). ``key_padding_mask`` ``(1, T)`` works alike.
            Also the engine for other mechanisms' packed inputs: pass their features as q, k,
            their values as v, their log decays (zeros for none) and ``scale=1.0``.

    Causality and document isolation hold for finite q, k, v: a NaN or inf at a real position t
    can reach the outputs of earlier positions in t's chunk (blocked products: 0 * inf is NaN),
    and, packed, of the other documents sharing that chunk. Not guarded (it would cost every
    call); a padded position's content is never read, whatever it is.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` a :class:`DecayedState`.
        Half inputs (float16, bfloat16) are computed in float32 (state, cumulative decays, every
        chunk product); the state is float32 for them, else the input dtype.
        Inputs without a position (B, H or N = 0; T = 0 when packed) give the empty output and the
        state after no step: a new tensor equal to ``initial_state.s`` (zeros without one), both in
        the graph of every input as for any other call (zero gradients; the identity to
        ``initial_state.s``).
    """
    fn = "gated_linear_attention"
    if chunk_size is not None:
        check_positive_int(fn, "chunk_size", chunk_size)
    check_positive_int(fn, "sub_chunk_size", sub_chunk_size)
    check_positive_int(fn, "tile_positions", tile_positions)
    in_dtype = q.dtype
    with no_autocast(q.device.type):
        q, k, v, g, s0, scale = _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state,
                                         scaled=False, cu_seqlens=cu_seqlens)
        B, H, N, D = q.shape
        Dv = v.shape[-1]
        if chunk_size is None:
            chunk_size = _CHUNK_SIZES["head" if g.shape[-1] == 1 else "channel"]
        if B * H * N == 0:
            # No position in any sequence, in every form (packed too: T = 0 or H = 0). The chunked
            # engine cannot lay out zero rows or positions in chunks; the result is the state
            # after no step, and it must stay in the graph as any other call's does.
            n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
            out, s = result_without_positions((q, k, v, g), s0, (B, H, N, Dv), (n, H, D, Dv))
        elif cu_seqlens is not None:
            out, s = _varlen(q, k, v, g, s0, scale, cu_seqlens, return_state, chunk_size,
                             (sub_chunk_size, tile_positions))
        elif N == 1 and s0 is not None:
            out, s = _recurrent_step(q * scale, k, v, g, s0)
        else:
            out, s, _ = _gated_chunked(q, k, v, g, s0, chunk_size, scale, sub_chunk_size, tile_positions)
    out = out.to(in_dtype)
    return (out, DecayedState(s)) if return_state else out
