"""Delta-rule linear attention (DeltaNet, Gated DeltaNet, Kimi Delta Attention): a causal
recurrence with a chunked form, a recurrent step and a plain reference.

DeltaNet (Schlag et al. 2021; parallelised by Yang et al., arXiv 2406.06484), Gated DeltaNet
(Yang, Kautz and Hatamizadeh, arXiv 2412.06464) and Kimi Delta Attention (KDA, arXiv 2510.26692,
section 3) keep one matrix state per head and, at every position, first decay it, then move the
value it predicts for ``k_t`` a step ``beta_t`` towards ``v_t`` (one step of online regression):

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T        o_t = scale * S_t^T q_t

``g = log_decay``: 0 when None (DeltaNet), one value per head and position (Gated DeltaNet: the
diagonal is then a scalar and commutes with the delta step), or one per key channel (KDA: it
scales the rows of S). There is no bidirectional form: the state at position t is defined by a
recurrence in time, not by a sum over a set of keys. Queries and keys may have fewer heads than
the values (grouped value heads, ``linattn.functional.checks.expand_key_heads``).

Dimension legend: B batch, H heads, N positions, D query/key width, Dv value width, R = B*H rows
(independent sequences), C chunk length, Nc number of chunks, m chunks in a batch of chunks.

The chunked form (arXiv 2406.06484, section 3, with the decays of arXiv 2412.06464). Inside a chunk
starting from state S, write the state after position t (t = 1..C) as

    S_t = gamma_t S + sum_{i <= t} (gamma_t / gamma_i) k_i u_i^T,        gamma_t = exp(G_t),
    G_t = g_1 + ... + g_t (cumulative log decay within the chunk).

Putting that into the recurrence gives the "pseudo-values" u (the WY / UT representation):

    u_t = beta_t (v_t - gamma_t S^T k_t - sum_{i < t} (gamma_t / gamma_i) (k_t . k_i) u_i)
    (I + A) U = diag(beta) V - diag(beta gamma) K S,   A_ti = beta_t (gamma_t / gamma_i) k_t . k_i, i < t

so with ``T = (I + A)^-1`` (unit lower triangular, one C x C inverse per chunk, all chunks at once,
by halves down to 16 x 16 diagonal blocks that ``torch.linalg.solve_triangular`` inverts):
``U = Uv - W S`` with ``Uv = T diag(beta) V`` and ``W = T diag(beta gamma) K``, neither of which
depends on the state. Then

    O     = diag(gamma) Q S + P U,            P_ti = (gamma_t / gamma_i) q_t . k_i for i <= t, else 0
    S_end = gamma_C S + Kd^T U,              Kd_i = (gamma_C / gamma_i) k_i

Everything but the state is computed for many chunks at once in batched matrix products (T, Uv,
W, P, and afterwards O from the states); what is left sequential is a loop over chunks, never over
positions, with two ``(R, C|D, D) x (R, D, Dv)`` products per chunk: ``U = Uv - W S`` and
``S <- gamma_C S + Kd^T U``. Every ratio ``gamma_t / gamma_i`` is ``exp(G_t - G_i)`` with the
difference taken first (G held as small decays plus a count of resets, so that a large decay early
in a chunk does not drown the digits of the small ones after it without float64: log_decays.py)
and clamped to <= 0 before the exp, the entries above the
diagonal then zeroed: nothing exponentiated is ever above 0, so nothing overflows, even for decays
near -inf. For half inputs all of this runs in float32 (the state, the cumulative decays, the
inverses), and the output is cast back.

The backward (the custom op ``linattn::delta_rule_chunked_backward``) reads what the forward kept
when gradients flow: the inputs, the state before every block of chunks, and every chunk's ``T``,
``U`` (the pseudo-values ``Uv - W S``) and ``W``, with a decay per head or none also its scores
``E``, ``KK`` and ``P`` (about 3.3 times the size of v at C = 32, D = Dv = 128: memory stays
O(N)). Block by block backwards, it forms what it did not keep of the chunk-local scores again
(not the inverse), runs the state gradient back through ``dU = P^T dO + Kd dS_end``,
``dS = gamma_C dS_end + (gamma Q)^T dO - W^T dU``, chunk by chunk, then forms the state before
each chunk of the block again (one product a chunk, ``S <- gamma_C S + Kd^T U``) for the products
with it, and derives every other gradient in batched products (the derivation is written out at ``_block_backward``; the triangular
inverse's is ``dA = -T^T dT T^T``, which with ``U`` kept is ``-dRv U^T``, one product). Chunks and
blocks follow ``linattn.functional.chunks``, the layout the gated engine uses too.

The loop over chunks is the CPU strategy's (``strategy.py``). The accelerator's writes the same
recurrence as one affine map per chunk, ``S <- (Diag(gamma_C) - Kd^T W) S + Kd^T Uv`` (U = Uv - W S
put into the state update), and solves it for every chunk at once with the log-depth scan of
``recurrence.py``; the outputs and U then follow in one product each. Its backward runs the state
gradient's recurrence, ``dS = (Diag(gamma_C) - W^T Kd) dSn + (diag(gamma) Q)^T dO - W^T P^T dO``,
as a reverse scan, and forms the states again from the kept U (a diagonal recurrence). The engine's
stages (in-chunk scores, the triangular solve, the recurrence with the outputs, the state
gradients, the products with the states, the local gradients) are named functions, each with its
CPU and accelerator version where the two differ.

A gate per key channel (KDA, arXiv 2510.26692 section 3.1) changes only the chunk-local parts:
``gamma_t`` becomes a diagonal matrix ``Diag(exp(G_t))`` (G cumulative per channel), so the ratios
``gamma_t / gamma_i`` no longer factor out of ``k_t . k_i`` and ``q_t . k_i``. Those two decayed
score matrices, ``A_ti = beta_t sum_d k_td k_id exp(G_td - G_id)`` and
``P_ti = sum_d q_td k_id exp(G_td - G_id)``, are the per-channel gated engine's
(``decayed.channel_scores``: sub-chunks, every decay a product of exp(g), none above 1), both
from one call with q and k as two sets of queries against the keys k, so that everything on the
keys' side is formed once; their gradients are its backward's. ``W = T diag(beta) (K o gamma)``,
``Kd = K o gamma_C / gamma`` and the state's row decay ``gamma_C`` carry one value per channel
(``decayed.ChannelDecays``), and so does every decay gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import torch
from torch import Tensor

from .checks import (
    EngineOp,
    at_most,
    check_key_padding_mask,
    check_positive_int,
    expand_key_heads,
    check_qkv,
    check_scale,
    check_values,
    compute_dtype,
    no_autocast,
    sanitize_padded,
    shape_str,
)
from .chunks import ChunkLayout, TileBuffers, cumsum_in_chunks
from .decayed_state import DecayedState, check_decayed_state, result_without_positions
from .decayed import channel_decays, channel_scores, channel_scores_backward, sub_chunk_length
from .log_decays import RESET_LOG_DECAY, CumulativeLogDecay, flush_negligible, negligible_decay
from .recurrence import chunk_recurrence, prefix_sums
from .strategy import (EngineOptions, check_strategy, half_operand, mixed_bmm, operand_dtype, parts_bmm, resolve_strategy,
                       split_bmm)
from .sharding import ShardForm, ShardPart
from .varlen import check_cu_seqlens, int64_offsets, varlen_layout

__all__ = ["delta_rule_attention", "delta_rule_attention_reference"]

# ---------------------------------------------------------------------------------------------
# Argument checks shared by both forms
# ---------------------------------------------------------------------------------------------


# Default chunk length by strategy and the decay's width (why: the chunk_size argument of
# delta_rule_attention). The accelerator's chunks are longer: the log-depth scan costs a (D, D) x
# (D, D) product per chunk, so fewer chunks cut its share of the work, and longer chunks make
# larger in-chunk products, which then carry more than half of the forward's arithmetic in the
# inputs' half dtype (strategy.py).
CHUNK_SIZES = {"cpu": {"head": 32, "channel": 16}, "accelerator": {"head": 64, "channel": 64}}

# A decay's gradient telescopes the states' energies (_energies) over at most this many chunks
# between exact ones: a block can be long (a CPU block of narrow rows, the accelerator's whole
# sequence), and telescoped over 1024 chunks the log decays' gradient lost digits
# (docs/benchmarks/kda_energies/anchors.md).
ANCHOR_SPAN = 32

# Default block size (chunks_per_block=None): a block holds about this many (row, chunk) pairs times
# the width D + Dv, so 32 chunks at R = 8 rows and D = Dv = 64, where 32 was measured best, and 8 at
# R = 16, D = Dv = 128 (Qwen3.5-0.8B's width), where 32 chunks made every block's temporaries four
# times larger (16 MiB for [Uv, W] alone): a large fresh tensor is page-faulted on every call (glibc
# hands it back to the OS when freed), and that, not arithmetic, was a third of the prefill's time.
BLOCK_WIDTH = 2 ** 15


def _chunks_per_block(chunks_per_block: int | None, R: int, D: int, Dv: int) -> int:
    """``chunks_per_block``, or for None the default for R rows of widths D, Dv (:data:`BLOCK_WIDTH`)."""
    return max(1, BLOCK_WIDTH // (R * (D + Dv))) if chunks_per_block is None else chunks_per_block


def _check_gate(fn: str, name: str, x, q: Tensor, *, per_channel: bool = False) -> None:
    """``beta`` or ``log_decay``: a floating-point ``(B, H, N)`` tensor on q's device (``log_decay``
    also ``(B, H, N, D)`` with ``per_channel``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor (B, H, N), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(q.shape[:3]) and not (per_channel and tuple(x.shape) == tuple(q.shape)):
        also = f" or (B, H, N, D) = {tuple(q.shape)} (one per key channel, KDA)" if per_channel else ""
        raise ValueError(f"{fn}: {name} must have shape (B, H, N) = {tuple(q.shape[:3])}{also} for q "
                         f"{shape_str(q)}, got {shape_str(x)}")
    if x.device != q.device:
        raise ValueError(f"{fn}: {name} is on {x.device}, q on {q.device}")


def _check_l2norm_eps(fn: str, eps) -> None:
    """``qk_l2norm_eps``: None, or a finite number >= 0."""
    if eps is None:
        return
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{fn}: qk_l2norm_eps must be None or a number >= 0, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{fn}: qk_l2norm_eps must be a finite number >= 0, got {eps}")


def _l2_factor(x: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """``1 / sqrt(sum x^2 + eps)`` over the last dim of ``x (..., D)`` -> ``(...)``: the factor of the
    L2 normalisation of ``qk_l2norm_eps``, into ``out`` when given (then not differentiable). The
    norm by ``vector_norm``, which reads x once and writes only the norms (x * x would write a
    temporary as large as x)."""
    if out is None:
        return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square() + eps)
    return torch.linalg.vector_norm(x, dim=-1, out=out).square_().add_(eps).rsqrt_()


def _l2_normalized(x: Tensor, eps: float | None) -> Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dim (plain autograd), or x itself for eps None: for
    packed documents with states inserted, which cannot normalise inside the chunked op."""
    return x if eps is None else x * _l2_factor(x, eps)[..., None]


def _prepare(fn, q, k, v, beta, log_decay, scale, key_padding_mask, initial_state, cu_seqlens=None):
    """Validate every argument; return the compute dtype, the scale, ``beta``, ``log_decay``
    (or None), k and v in it, with padded positions made identity steps (beta = g = 0, k = v = 0;
    ``torch.where``, so NaN in padding cannot leak), and q (still in its dtype). Grouped value
    heads (q, k with Hk heads, v with H) come back as H heads (:func:`expand_key_heads`). With
    ``cu_seqlens`` (checked here), B = 1 and ``initial_state`` holds one state per document,
    ``(n, H, D, Dv)``."""
    q, k = expand_key_heads(fn, q, k, v)
    check_qkv(fn, q, k, v, causal=True)
    n_states = q.shape[0]
    if cu_seqlens is not None:
        n_states = check_cu_seqlens(fn, cu_seqlens, q).shape[0] - 1
    check_key_padding_mask(fn, key_padding_mask, k)
    _check_gate(fn, "beta", beta, q)
    if log_decay is not None:
        _check_gate(fn, "log_decay", log_decay, q, per_channel=True)
    B, H, N, D = q.shape
    if initial_state is not None:
        check_decayed_state(fn, initial_state, n_states, H, D, v.shape[-1], q.device)
    scale = check_scale(fn, scale, D)
    dt = compute_dtype(q.dtype)
    real = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, N)
    beta = beta.to(dt)
    if real is not None:
        beta = torch.where(real, beta, beta.new_zeros(()))
    with torch.no_grad():
        ok = (beta >= 0) & (beta <= 2)  # False where outside or NaN
        check_values(ok, lambda: f"{fn}: beta must lie in [0, 2] at every real position "
                     f"(|I - beta k k^T| <= 1 for unit keys), got {beta[~ok][0].item()}")
    if log_decay is not None:
        log_decay = log_decay.to(dt)
        if real is not None:
            where = real if log_decay.dim() == 3 else real[..., None]  # (B, 1, N[, 1])
            log_decay = torch.where(where, log_decay, log_decay.new_zeros(()))
        with torch.no_grad():
            check_values(at_most(log_decay, 0.0), lambda: f"{fn}: log_decay must be <= 0 (a decay exp(g) in [0, 1]) "
                         f"at every real position, got {log_decay[~(log_decay <= 0)][0].item()}")
    k = sanitize_padded(k, key_padding_mask).to(dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    return dt, scale, beta, log_decay, q, k, v


def _zero_padded_outputs(out: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """A padded position outputs zeros (its query is not read)."""
    return sanitize_padded(out, key_padding_mask)


# ---------------------------------------------------------------------------------------------
# The chunked form
# ---------------------------------------------------------------------------------------------


class _Scores(NamedTuple):
    """Chunk-local quantities of ``m`` chunks (see the module docstring) that neither depend on the
    state nor need the triangular inverse; the forward and the backward both form them.

    ``E (m, C, C)``: ``gamma_t / gamma_i = exp(G_t - G_i)`` for i <= t, 0 above the diagonal;
    ``gam (m, C)``: gamma_t; ``delta (m, C)``: gamma_C / gamma_t; ``gC (m,)``: gamma_C. These four
    are None without decay (E is then the lower-triangular ones matrix, applied as ``tril``).
    ``KK (m, C, C)``: k_t . k_i; ``P (m, C, C)``; ``Kd (m, C, D)``: delta k; ``GQ (m, C, D)``:
    gamma q. With a gate per key channel (KDA) gamma, delta ``(m, C, D)`` and gC ``(m, D)`` hold one
    decay per channel, E is None, KK holds the decayed ``k_t . k_i`` scores (``sum_d k_td k_id
    gamma_td / gamma_id``, i < t) and ``channel`` what their backward needs.
    """

    E: Tensor | None
    gam: Tensor | None
    delta: Tensor | None
    gC: Tensor | None
    KK: Tensor
    P: Tensor
    Kd: Tensor
    GQ: Tensor
    channel: tuple | None = None  # per key channel (KDA): (c, q and k stacked, the scores' saved parts, g)


class _Solved(NamedTuple):
    """The chunk-local products of the triangular inverse, ``m`` chunks: ``T (m, C, C)``,
    ``(I + A)^-1``; ``U (m, C, Dv)``: ``T diag(beta) V`` as the solve gives it, made the
    pseudo-values ``Uv - W S`` in place by the forward's loop over chunks; ``W (m, C, D)``:
    ``T diag(beta gamma) K``. The forward of a call gradients flow through writes them into the
    buffers the backward reads (:func:`_chunked_forward`): the backward forms neither the inverse
    nor the products again, and needs no state but the one before each block.

    There, with a decay per head or none, also three of the chunks' :class:`_Scores`, ``(m, C, C)``
    each: ``E`` (None without a decay), ``KK`` and ``P``, which the backward then takes as they are
    (a quarter of v's size each at C = 32, D = 128, where forming them again cost the backward two
    products and the decays' passes a block: docs/benchmarks/README.md, History); None elsewhere (a gate per key channel forms its scores
    again, with what their backward needs)."""

    T: Tensor
    U: Tensor
    W: Tensor
    E: Tensor | None = None
    KK: Tensor | None = None
    P: Tensor | None = None


def _unit_lower_inverse(A: Tensor, solve_block: int, out: Tensor | None = None) -> Tensor:
    """``(I + A)^-1`` ``(m, C, C)`` for strictly lower-triangular ``A (m, C, C)`` (its diagonal and
    upper part are not read), into ``out`` when given.

    By halves, ``[[L11, 0], [L21, L22]]^-1 = [[T11, 0], [-T22 L21 T11, T22]]``, down to diagonal
    blocks of at most ``solve_block`` rows, which ``torch.linalg.solve_triangular`` inverts, all
    chunks at once; the off-diagonal blocks are then batched matrix products (for large C faster
    than one triangular solve of the whole matrix; at C = 32 the one solve was faster).
    """
    m, C, _ = A.shape
    if C <= solve_block:
        eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(m, C, C)
        T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
        return T if out is None else out.copy_(T)
    h = C // 2
    T = A.new_empty(m, C, C) if out is None else out
    T11 = _unit_lower_inverse(A[:, :h, :h], solve_block)
    T22 = _unit_lower_inverse(A[:, h:, h:], solve_block)
    T[:, :h, h:] = 0
    T[:, :h, :h] = T11
    T[:, h:, h:] = T22
    T[:, h:, :h] = mixed_bmm(T22, torch.bmm(A[:, h:, :h], T11), None, negate=True)
    return T


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``a, b (..., X)`` of one shape, as a batch of ``(1, X) x (X, 1)``
    products for X <= 256 (no ``a * b`` temporary), else by ``vecdot``, which the products fell far
    behind for longer rows (docs/benchmarks/README.md, History)."""
    X = a.shape[-1]
    if X > 256 or not (a.is_contiguous() and b.is_contiguous()):  # a strided batch would be a copy
        return torch.linalg.vecdot(a, b)
    return torch.bmm(a.view(-1, 1, X), b.view(-1, X, 1)).view(a.shape[:-1])


def _scores(q: Tensor, k: Tensor, g: Tensor | None, buf: TileBuffers, sub_chunk_size: int = 4,
            qk: Tensor | None = None, kept: _Solved | None = None, form: bool = True,
            operand: torch.dtype | None = None, batched: bool = False, saves: bool = True) -> _Scores:
    """``q, k (m, C, D)`` (q already scaled), ``g (m, C)`` (per head), ``(m, C, D)`` (per key
    channel) or None -> :class:`_Scores`, its tensors in the tile buffers ``buf``
    (``sub_chunk_size``: the per-channel scores' sub-chunks), or E, KK and P in those of ``kept``
    (:class:`_Solved`) where it has them: formed there (``form``), or taken as they are. ``operand``:
    the products' operand dtype (:func:`~linattn.functional.strategy.mixed_bmm`), None for as they
    are; ``batched``: the accelerator strategy's scores: a per-channel gate's in its batched form
    (:func:`~linattn.functional.decayed.channel_scores`), and no decay factor flushed to 0 below
    :func:`~linattn.functional.log_decays.negligible_decay` (a CPU's choice: subnormal numbers slow
    a CPU's products, not an accelerator's); ``saves`` False (the forward): a per-channel gate's
    scores keep nothing for their backward (``channel``'s saved parts None)."""
    if g is not None and g.dim() == 3:
        return _channel_scores(q, k, g, sub_chunk_size, qk, operand, batched, saves)
    m, C, D = k.shape
    E = gam = delta = gC = None
    into = kept if kept is not None and kept.KK is not None else None  # E, KK, P live there
    take = into is not None and not form  # ... and the forward formed them
    if g is not None:
        # G (m, C) in the compute dtype, as small decays plus a count of resets (log decays below
        # -40), so that G_t - G_i after a large decay earlier in the chunk keeps the small decays'
        # digits without float64 (log_decays.py). G does not increase, so the differences are <= 0
        # on and below the diagonal; clamping those above it to 0 before the exp (then zeroing
        # them) keeps every exponentiated number <= 0.
        # On a CPU, factors below negligible_decay(dtype) are flushed to exactly 0: they would leave
        # subnormal numbers in the products below (log_decays.py), which a CPU computes several times
        # slower; an accelerator computes them at full speed, so the passes are left out there.
        G = CumulativeLogDecay.of(g, -1)
        if not take:
            E = G[:, :, None].sub(G[:, None, :], buf("E", m, C, C) if into is None else into.E,
                                  buf("E scratch", m, C, C))
            E = E.clamp_(max=0).exp_().tril_()  # (m, C, C)
        gam = G.exp()
        delta = (G[:, -1:] - G).exp_()
        if not batched:
            for factors in (E, gam, delta):
                if factors is not None:
                    flush_negligible(factors)  # in place
        gC = gam[:, -1]
    if take:
        E, KK, P = into.E, into.KK, into.P
    else:
        KK = mixed_bmm(k, k.transpose(1, 2), operand, out=buf("KK", m, C, C) if into is None else into.KK)
        P = mixed_bmm(q, k.transpose(1, 2), operand, out=buf("P", m, C, C) if into is None else into.P)
        P = P.tril_() if E is None else P.mul_(E)
    Kd = k if delta is None else torch.mul(k, delta[:, :, None], out=buf("Kd", m, C, D))
    GQ = q if gam is None else torch.mul(q, gam[:, :, None], out=buf("GQ", m, C, D))
    return _Scores(E, gam, delta, gC, KK, P, Kd, GQ)


def _channel_scores(q, k, g, sub_chunk_size, qk=None, operand=None, batched=False, saves=True) -> _Scores:
    """:func:`_scores` for a gate per key channel, ``g (m, C, D)`` (KDA). The decayed scores
    ``sum_d x_td y_id exp(G_td - G_id)`` of A (x = y = k) and P (x = q) are the per-channel gated
    engine's (:func:`~linattn.functional.decayed.channel_scores`: sub-chunks, no exponent above 0);
    gamma, delta and gamma_C carry one decay per channel. Every decay is a product of the decays
    exp(g) (:class:`~linattn.functional.decayed.ChannelDecays`), none an exp of a difference of
    cumulative sums: fewer passes, and no digit lost after a large decay. ``qk (m, 2, C, D)``: q and
    k stacked, when the caller took them so (:func:`_take_qk`; q and k are then its views)."""
    C = k.shape[1]
    c = sub_chunk_length(C, sub_chunk_size)
    decays = channel_decays(g, c, batched)
    # q and k as two sets of queries against the keys k: the decayed keys are formed once
    if qk is None:
        qk = torch.stack([q, k], dim=1)  # (m, 2, C, D)
    scores, saved = channel_scores(qk, k, decays, operand, batched, saves)  # (m, 2, C, C), i <= t
    P = scores[:, 0]  # (m, C, C): q_t . k_i decayed
    KK = scores[:, 1].tril_(-1)  # (m, C, C): k_t . k_i decayed, i < t
    before = decays.before()
    gam = decays.from_start(before)  # (m, C, D): gamma_t
    delta = decays.to_end()  # (m, C, D): gamma_C / gamma_t
    gC = decays.whole(before)  # (m, D)
    return _Scores(None, gam, delta, gC, KK, P, k * delta, q * gam, (c, qk, saved, g))


def _solve(x: _Scores, k: Tensor, bv: Tensor, b: Tensor, solve_block: int, buf: TileBuffers,
           out: _Solved | None = None, operand: torch.dtype | None = None, flush: bool = True) -> _Solved:
    """The triangular inverse of m chunks and its two products (:class:`_Solved`), into ``out``
    when given, else into the tile buffers ``buf``: ``k (m, C, D)``, ``bv (m, C, Dv)`` the values
    times beta (``diag(beta) V``, as the block took them), ``b (m, C)``, the chunks'
    :class:`_Scores` (``solve_block``: see :func:`_unit_lower_inverse`). The inverse in the compute
    dtype; its two products with operands in ``operand`` (None: as they are). ``flush`` (the CPU
    strategy): the inverse's negligible entries set to 0."""
    m, C, D = k.shape
    Dv = bv.shape[-1]
    bcol = b[:, :, None]
    A = buf("A", m, C, C)
    if x.channel is not None:  # KK is then the decayed scores, already strictly lower
        torch.mul(x.KK, bcol, out=A)
    else:
        # the unit diagonal is implicit
        (A.copy_(x.KK) if x.E is None else torch.mul(x.KK, x.E, out=A)).tril_(-1).mul_(bcol)
    out = out or _Solved(buf("T", m, C, C), buf("U", m, C, Dv), buf("W", m, C, D))
    T = _unit_lower_inverse(A, solve_block, out.T)  # (I + A)^-1
    # Entries negligible beside T's unit diagonal to exactly 0 on a CPU: under strong decays T holds
    # products of many small entries of A, down into the subnormal range, which every product with
    # T would then compute several times slower there (log_decays.negligible_decay)
    if flush:
        torch.hardshrink(T, negligible_decay(T.dtype), out=T)
    # Uv and W as two products, each contiguous: the sequential loop then turns Uv into U in place
    # (U = Uv - W S), and two (C, C) x (C, 128) products ran faster than one (C, C) x (C, 256) into a
    # [Uv, W] buffer at m = 128, C = 32 (0.47-0.54 ms against 0.57-0.59 ms, 2 threads)
    U = split_bmm(T, bv, operand, out=out.U)
    if x.channel is not None:  # W = T diag(beta) (gamma o K), gamma per key channel
        W = mixed_bmm(T, torch.mul(k, x.gam * bcol, out=buf("k w", m, C, D)), operand, out=out.W)
    else:  # W = (T diag(beta gamma)) K: the columns of T scaled, not the rows of K (C x C, not C x D)
        w = b if x.gam is None else b * x.gam
        W = mixed_bmm(torch.mul(T, w[:, None, :], out=buf("T w", m, C, C)), k, operand, out=out.W)
    return out._replace(T=T, U=U, W=W)


def _take(lay: ChunkLayout, xc: Tensor | None, tile: slice, buf: TileBuffers | None = None,
          name: str = "") -> Tensor | None:
    """A tile's chunks of ``xc (R, Nc, C, ...)`` as the block functions take them: chunk-major and
    contiguous, ``(m*R, C, ...)`` (the R rows of one chunk side by side); into the tile buffer
    ``name`` of ``buf`` when given."""
    if xc is None:
        return None
    if buf is None:
        return lay.take(xc, tile).flatten(0, 1)
    view = lay.view(xc, tile)
    return buf(name, *view.shape).copy_(view).flatten(0, 1)


def _take_stacked(lay: ChunkLayout, xc: Tensor, tile: slice, out: Tensor) -> Tensor:
    """:func:`_take` of ``xc (R, Nc, C, X)`` into the first C rows of ``out (m, R, 2C, X)``:
    ``(m*R, 2C, X)``, the second C rows of each chunk left to the caller."""
    C = xc.shape[2]
    out[:, :, :C] = lay.view(xc, tile)
    return out.flatten(0, 1)


def _take_product(lay: ChunkLayout, xc: Tensor, tile: slice, factor, out: Tensor) -> Tensor:
    """:func:`_take` of ``xc`` times ``factor`` (a number, or ``(R, Nc, C)`` per position) in the one
    pass that takes it (:meth:`ChunkLayout.take_scaled`), into ``out`` (``(m, R, C, X)``, rows of one
    chunk side by side): ``(m*R, C, X)``."""
    return lay.take_scaled(xc, tile, factor, out).flatten(0, 1)


def _qk_factors(scale: float, norms: tuple | None) -> tuple:
    """What a tile's q and k are taken times (:func:`_take_qk`), formed once a call: ``(scale, None)``,
    or with the L2 normalisation's factors ``(rq, rk)`` ``(scale * rq, rk)``."""
    return (scale, None) if norms is None else (norms[0] * scale if scale != 1.0 else norms[0], norms[1])


def _take_qk(lay: ChunkLayout, qc: Tensor, kc: Tensor, tile: slice, factors: tuple, per_channel: bool,
             buf: TileBuffers):
    """A tile's q and k times their ``factors`` (:func:`_qk_factors`) as :func:`_take` gives them,
    ``(m*R, C, D)`` each (in the tile buffers ``buf``), and with a gate per key channel also the one
    buffer ``(m*R, 2, C, D)`` they are views of (the per-channel scores take q and k as two sets of
    queries: written there once, not copied again), else None."""
    R, _, C, D = qc.shape
    m = tile.stop - tile.start
    fq, fk = factors
    if not per_channel:
        kb = _take(lay, kc, tile, buf, "k") if fk is None else _take_product(lay, kc, tile, fk, buf("k", m, R, C, D))
        return _take_product(lay, qc, tile, fq, buf("q", m, R, C, D)), kb, None
    qk = buf("qk", m, R, 2, C, D)
    _take_product(lay, qc, tile, fq, qk[:, :, 0])
    if fk is None:
        qk[:, :, 1] = lay.view(kc, tile)
    else:
        _take_product(lay, kc, tile, fk, qk[:, :, 1])
    qk = qk.view(m * R, 2, C, D)
    return qk[:, 0], qk[:, 1], qk


def _kept(kept: _Solved | None, tile: slice) -> _Solved | None:
    """A tile's chunks of the kept ``(Nc, R, C, *)`` buffers, ``(m*R, C, *)`` views (None stays None)."""
    return None if kept is None else _Solved(*(None if t is None else t[tile].flatten(0, 1) for t in kept))


def _block_forward(q, k, bv, b, g, S, opts: EngineOptions, buf, qk=None, kept=None, anchors=None):
    """One block of ``n`` chunks of all ``R`` rows, chunk-major: ``q, k (n*R, C, D)``, the values
    times beta ``bv (n*R, C, Dv)``, ``b, g (n*R, C)`` (g or None); ``S (R, D, Dv)``, the state before the block,
    updated in place to the state after it; ``buf``: the call's :class:`TileBuffers`; ``kept``: None,
    or the block's views of the buffers the backward reads (:class:`_Solved`), written here. Returns
    ``o (n*R, C, Dv)`` (a tile buffer).

    Three stages: the in-chunk scores (:func:`_scores`), the triangular solve (:func:`_solve`), and
    the recurrence across chunks with the outputs, by the strategy's own stage
    (:func:`_outputs_by_loop` on a CPU, :func:`_outputs_by_scan` on an accelerator).
    """
    n = q.shape[0] // S.shape[0]
    x = _scores(q, k, g, buf, opts.sub_chunk_size, qk=qk, kept=kept, operand=opts.operand,
                batched=opts.strategy == "accelerator", saves=False)
    sol = _solve(x, k, bv, b, opts.solve_block, buf, kept, operand=opts.operand, flush=opts.strategy == "cpu")
    # what the recurrence and the outputs read: the decays and scores that only the solve read are
    # let go (a gate per key channel's are several times q's size; the accelerator holds every chunk's)
    x = x._replace(E=None, gam=None, delta=None, KK=None, channel=None)
    if opts.strategy == "accelerator":
        return _outputs_by_scan(x, sol, S, n, opts.operand, anchors)
    return _outputs_by_loop(x, sol, S, n, buf)


def _outputs_by_loop(x: _Scores, sol: _Solved, S: Tensor, n: int, buf: TileBuffers) -> Tensor:
    """The recurrence across a block's ``n`` chunks and their outputs on a CPU: the loop over chunks
    carries the state ``S (R, D, Dv)``, ``U = Uv - W S``, ``S <- gamma_C S + Kd^T U``, and forms each
    chunk's outputs ``O = diag(gamma) Q S + P U`` while its state is in cache: one state updated in
    place (an in-place scale, not a copy to a new chunk's slot), none kept but the one after the
    block. ``sol.U`` becomes the pseudo-values. Returns ``o (n*R, C, Dv)`` (a tile buffer)."""
    m, C, Dv = sol.U.shape
    R, D = S.shape[0], S.shape[1]
    # each chunk's views made at once (unbind), not indexed op by op; U: Uv, made U chunk by chunk in place
    U, W = sol.U.view(n, R, C, Dv).unbind(), sol.W.view(n, R, C, D).unbind()
    KdT = x.Kd.view(n, R, C, D).transpose(2, 3).unbind()  # (R, D, C) each
    gC = None if x.gC is None else x.gC.view(n, R, -1, 1).unbind()  # (R, 1 | D, 1): per head or per key channel
    P, GQ = x.P.view(n, R, C, C).unbind(), x.GQ.view(n, R, C, D).unbind()
    o = buf("o", n, R, C, Dv)
    ol = o.unbind()
    for c in range(n):  # the only sequential part: three (R, C|D, D) x (R, D, Dv) products a chunk
        U[c].baddbmm_(W[c], S, alpha=-1)
        torch.bmm(P[c], U[c], out=ol[c]).baddbmm_(GQ[c], S)
        (S if gC is None else S.mul_(gC[c])).baddbmm_(KdT[c], U[c])
    return o.view(m, C, Dv)


def _transitions(x: _Scores, W: Tensor, n: int, operand: torch.dtype | None = None) -> Tensor:
    """Each chunk's transition of the state, ``Diag(gamma_C) - Kd^T W`` ``(n, R, D, D)`` (the state
    after the chunk is ``that S + Kd^T Uv``; ``gamma_C`` 1 without a decay, a number per head or one
    per key channel), from the chunks' :class:`_Scores` and ``W (n*R, C, D)``."""
    m, C, D = W.shape
    A = mixed_bmm(x.Kd.transpose(1, 2), W, operand, negate=True)  # (m, D, D)
    A.diagonal(dim1=1, dim2=2).add_(1.0 if x.gC is None else x.gC.view(m, -1))
    return A.view(n, m // n, D, D)


def _outputs_by_scan(x: _Scores, sol: _Solved, S: Tensor, n: int, operand: torch.dtype | None = None,
                     anchors: Tensor | None = None) -> Tensor:
    """:func:`_block_forward`'s loop over chunks for the accelerator: the state before every chunk
    at once from a log-depth scan of the chunks' affine maps ``S <- (Diag(gamma_C) - Kd^T W) S +
    Kd^T Uv`` (``recurrence.py``), then ``U = Uv - W S`` and ``O = P U + diag(gamma) Q S`` for all
    chunks in one product each. ``S (R, D, Dv)`` becomes the state after the block; ``sol.U`` the
    pseudo-values. Returns ``o (n*R, C, Dv)``. ``operand``: the products' operand dtype
    (:func:`~linattn.functional.strategy.mixed_bmm`; None: as they are); the scan, which carries
    the state across the whole sequence, runs in the compute dtype. ``anchors``: None, or
    ``(G - 1, R, D, Dv)`` to keep the states at :func:`_anchor_steps` in, for the backward."""
    m, C, Dv = sol.U.shape
    R, D = S.shape[0], S.shape[1]
    # Uv and the states in two half parts where they enter what the backward reads (the states it
    # forms again from the kept U = Uv - W S): rounded once, the chunks' rounding errors summed
    # along the states under weak decays, and bf16 gradients at N = 16384 were 2-4x the CPU
    # strategy's off float64 (docs/benchmarks/tensor_cores/gradients.md); the output's Q S takes one
    B = split_bmm(x.Kd.transpose(1, 2), sol.U, operand).view(n, R, D, Dv)  # Kd^T Uv
    states = chunk_recurrence(_transitions(x, sol.W, n, operand), B, S, strategy="accelerator",
                              consume=True)  # (n + 1, R, D, Dv)
    # the states rounded once for both of their products (float16: scaled into its range, then back)
    parts, scale = half_operand(states[:n].reshape(m, D, Dv), operand, split=True)
    WS, QS = parts_bmm(sol.W, parts, scale, operand), parts_bmm(x.GQ, parts[:1], scale, operand)
    U = sol.U.sub_(WS)  # the pseudo-values, in place (the backward reads them)
    S.copy_(states[n])
    if anchors is not None:
        anchors.copy_(states[_anchor_steps(n)])
    # U in two half parts: its rounding cost the bf16 output more digits than every other product
    # (the pseudo-values are a difference of larger terms); so does beta v's in the solve
    return split_bmm(x.P, U, operand).add_(QS)


def _qk_norms(lay: ChunkLayout, factors: Tensor | None) -> tuple | None:
    """The L2 normalisation's factors ``(2, R, N)`` (q's, k's: :func:`_take_qk_normalised`) laid out
    in chunks, ``(R, Nc, C)`` each, or None."""
    return None if factors is None else (lay.chunked(factors[0]), lay.chunked(factors[1]))


def _take_qk_normalised(lay: ChunkLayout, qc: Tensor, kc: Tensor, tile: slice, scale: float, eps: float,
                        per_channel: bool, buf: TileBuffers, l2c: Tensor):
    """:func:`_take_qk` in the forward with the L2 normalisation: the tile's q and k taken as they
    are, the factors ``r = 1 / sqrt(sum x^2 + eps)`` of every row formed from the taken tiles
    (:func:`_l2_factor`) and written into the tile's chunks of ``l2c (2, R, Nc, C)`` (q's, k's; the
    backward reads them), then the tiles scaled in place, q by ``scale r_q`` and k by ``r_k``. Why:
    the factors formed by a pass over the whole of q and k before the first tile read both from
    memory once more; the tiles are in cache."""
    R, _, C, _ = qc.shape
    m = tile.stop - tile.start
    qb, kb, qk = _take_qk(lay, qc, kc, tile, (1.0, None), per_channel, buf)  # as they are
    for i, (x, s) in enumerate(((qb, scale), (kb, 1.0))):
        r = _l2_factor(x, eps, buf("l2 factors", m * R, C))
        lay.view(l2c[i], tile).copy_(r.view(m, R, C))
        x.mul_((r if s == 1.0 else r.mul_(s))[:, :, None])
    return qb, kb, qk


def _chunked_forward(q, k, v, b, g, s0, scale, lay, opts: EngineOptions, keep=True, qk_eps=None):
    """``q, k (R, N, D)``, ``v (R, N, Dv)``, ``b, g (R, N)``, ``s0 (R, D, Dv)`` -> ``o (R, N, Dv)``,
    the states and what a backward reads, on the :class:`~linattn.functional.chunks.ChunkLayout`
    ``lay`` (its tiles are the blocks); ``opts``: the call's :class:`EngineOptions` (its strategy, its
    operand dtype, ``solve_block``: see :func:`_unit_lower_inverse`); ``qk_eps``:
    None, or the eps of the L2 normalisation of q and k (``qk_l2norm_eps``), applied as the tiles
    are taken.

    With ``keep`` (a backward will run): the states before every block and after the last (on the
    accelerator, whose one block is the whole sequence, also those at :func:`_anchor_steps` between:
    ``(_saved_states(lay, opts), R, D, Dv)``), and the chunk-local products of every chunk (:class:`_Solved` of
    ``(Nc, R, C, *)`` buffers, chunk-major, E, KK and P among them with a decay per head or
    none): together about 3.3 times the size of v at C = 32, D = Dv = 128 (the state before every
    chunk, which the backward also reads, would be D / C times it); without: ``(1, R, D, Dv)``,
    the final state, and None. Last, the L2 normalisation's factors ``(2, R, N)`` in v's dtype
    (:func:`_take_qk_normalised`), None for ``qk_eps`` None."""
    R, N, D = q.shape
    Dv = v.shape[-1]
    qc, kc, vc, bc, gc = (lay.chunked(t) for t in (q, k, v, b, g))
    o = lay.new_chunked_like(v)  # laid out as v: transformers' (B, N, H, Dv) comes back contiguous
    tiles = lay.tiles()
    accelerator = opts.strategy == "accelerator"
    states = v.new_empty(_saved_states(lay, opts) if keep else 1, R, D, Dv)
    states[0] = s0
    kept = None
    if keep:
        C = lay.C
        scores = g is None or g.dim() == 2  # E, KK and P kept too (not with a gate per key channel)
        kept = _Solved(v.new_empty(lay.Nc, R, C, C), v.new_empty(lay.Nc, R, C, Dv), v.new_empty(lay.Nc, R, C, D),
                       *((None if g is None else v.new_empty(lay.Nc, R, C, C), v.new_empty(lay.Nc, R, C, C),
                          v.new_empty(lay.Nc, R, C, C)) if scores else ()))
    per_channel = g is not None and g.dim() == 3
    buf = TileBuffers.kept(v)
    l2c = None if qk_eps is None else v.new_empty(2, R, lay.Nc, lay.C)  # the L2 factors, laid out in chunks
    factors = _qk_factors(scale, None)
    for i, blk in enumerate(tiles):
        # the state after the block; the accelerator's one block keeps its anchors between
        S = (states[-1] if accelerator else states[i + 1]).copy_(states[i]) if keep else states[0]
        if l2c is None:
            qb, kb, qk = _take_qk(lay, qc, kc, blk, factors, per_channel, buf)
        else:
            qb, kb, qk = _take_qk_normalised(lay, qc, kc, blk, scale, qk_eps, per_channel, buf, l2c)
        bv = _take_product(lay, vc, blk, bc, buf("bv", blk.stop - blk.start, R, lay.C, Dv))
        ob = _block_forward(qb, kb, bv, *(_take(lay, t, blk) for t in (bc, gc)), S, opts, buf, qk,
                            _kept(kept, blk), states[1:-1] if keep and accelerator else None)
        lay.put(o, blk, ob)
    l2 = None
    if l2c is not None:  # (2, R, N), contiguous as the op's fake says: a copy only with a filled last chunk
        l2 = l2c.view(2, R, lay.Nc * lay.C)[:, :, :N]
        l2 = l2.contiguous() if lay.fill else l2
    return lay.unchunked_like(o, v), states, kept, l2


def _block_backward(q, k, v, b, g, start, end, sol, st, do, dst, need_g, scale, into, buf, qk=None, norms=None,
                    opts: EngineOptions = EngineOptions(32), anchors: Tensor | None = None):
    """Gradients of one block (chunk-major, shapes as in :func:`_block_forward`), given
    ``do (n*R, 2C, Dv)``, each chunk's output gradient in its first C rows (the second C rows are
    a workspace, see :func:`_take_stacked`), the states before and after the block ``start, end
    (R, D, Dv)``, the block's kept
    :class:`_Solved` ``sol`` (U the pseudo-values), a workspace ``st (R, Dv, D)`` in which the state
    before each chunk is formed again, and ``dst (n + 1, R, D, Dv)`` holding in ``dst[n]`` the gradient of
    the state after the block; ``dst[c]`` receives that of the state before chunk c; q is ``scale``
    times the queries. Writes ``dq`` (of the queries before the scale), ``dk`` and ``dv`` into
    ``into``, three chunk-major ``(n, R, C, D | D | Dv)`` views of the gradients' own tensors (each
    one's last pass writes there: no copy afterwards), and returns ``db (n*R, C)`` and
    ``dg (n*R, C)`` (None unless ``need_g``); ``buf``: the call's :class:`TileBuffers`; ``norms``:
    None, or with the L2 normalisation the block's chunks of what q and k were taken times,
    ``(scale r_q, r_k) (n*R, C)`` (:func:`_qk_factors`; q and k are then the normalised ones, and
    the gradients written are those of the unnormalised, see :func:`_unnormalized_grad`).
    ``anchors``: the accelerator's, the forward's states at :func:`_anchor_steps` ``(G - 1, R, D,
    Dv)``, from which the states are formed again.

    Per chunk, with S the state before it and dSn the gradient of the state after it, from
    ``U = Uv - W S``, ``O = diag(gamma) Q S + P U``, ``Sn = gamma_C S + Kd^T U``:

        dU  = P^T dO + Kd dSn,   dS = gamma_C dSn + (diag(gamma) Q)^T dO - W^T dU
              (run backwards chunk by chunk; then, forwards, the states again for [dO; dRv] S^T)
        dP  = dO U^T (lower),    dKd = U dSn^T,    dgamma_C = <S, dSn> (see :func:`_energies`)
        dQ  = diag(gamma) dO S^T + (dP o E) K
        [dRv, dRw] = T^T [dU, -dU S^T]               (X = T Rhs, so dRhs = T^T dX)
        dA  = -strictly-lower([dRv, dRw] [Uv, W]^T)  (T = (I + A)^-1, so dA = -T^T dT T^T)
            = -strictly-lower(dRv U^T)                (dRw = -dRv S^T and U = Uv - W S)
        dV  = diag(beta) dRv
        dK  = diag(beta gamma) dRw + (Z + Z^T) K + (dP o E)^T Q + diag(delta) dKd,
              Z = diag(beta) (dA o E)                (A = diag(beta) (K K^T o E), strictly lower)
        dbeta_t = dRv_t . v_t + gamma_t dRw_t . k_t + sum_i (dA o E o K K^T)_ti
        dG  through E (rowsum minus colsum of dE o E, from A and P), gamma, delta and gamma_C;
        dg  = the reverse cumulative sum of dG within the chunk (G = cumsum g).
    """
    m, C, D = q.shape
    R, Dv = st.shape[0], st.shape[1]  # st: (R, Dv, D)
    n = m // R
    x = _scores(q, k, g, buf, opts.sub_chunk_size, qk=qk, kept=sol, form=False, batched=opts.strategy == "accelerator")
    U = sol.U
    # dO arrived in the first half of a (m, 2C, Dv) buffer whose second half receives dRv: the
    # products of both with S^T and with U^T are then one product each (S and U read once)
    dof = do[:, :C]
    # P^T dO straight into dU and (diag(gamma) Q)^T dO into dst[:n], where each chunk's gradients
    # then accumulate in place: no separate buffers, and no out= pass that copies them over
    dU = torch.bmm(x.P.transpose(1, 2), dof, out=buf("dU", m, C, Dv))
    torch.bmm(x.GQ.transpose(1, 2), dof, out=dst[:n].view(m, D, Dv))
    accelerator = opts.strategy == "accelerator"
    (_state_grads_by_scan if accelerator else _state_grads_by_loop)(x, sol, dU, dst, n)
    # [dRv, dRw] = T^T [dU, -dU S^T] = [T^T dU, -(T^T dU) S^T]: T^T multiplies dU alone, and
    # neither [dUv, dW] nor [dRv, dRw] is assembled in a (m, C, Dv + D) buffer
    dRv = torch.bmm(sol.T.transpose(1, 2), dU, out=buf("dRv", m, C, Dv))
    do[:, C:] = dRv
    # dO S^T and dRv S^T = -dRw: two products into two buffers, not one of [dO; dRv], so that their
    # rows' dot products with q and k below are batched products too (of a (m, 2C, D) buffer's
    # halves, torch.linalg.vecdot formed a temporary). With a decay, the exact energies <S_b, dS_b>
    # at the ends b of ANCHOR_SPAN chunks from the block's end (_energies telescopes the others
    # from them): a number per head, or per key channel one per row of the state
    dOS, mdRw = buf("dO S^T", m, C, D), buf("-dRw", m, C, D)  # mdRw: the sign rides on its factors
    energy = None
    by_row = x.channel is not None
    if accelerator:
        states = _state_products_by_scan(x, U, start, dof, dRv, n, dOS, mdRw, anchors)
        if need_g and x.gC is not None:
            ends = slice(_anchor_steps(n).start, n + 1, ANCHOR_SPAN)  # the anchors and the block's end
            energy = _Anchors(_state_dots(states[ends], dst[ends], by_row), ANCHOR_SPAN)
        del states  # every chunk's state: freed before the gradients' temporaries are formed
    else:
        if need_g and x.gC is not None:
            energy = _Anchors(dst.new_empty(-(-n // ANCHOR_SPAN), R, *((D,) if by_row else ())), ANCHOR_SPAN)
            _state_dots(end[None], dst[n:], by_row, out=energy.values[-1:])
        _state_products_by_loop(x, U, start, st, dof, dRv, n, dOS, mdRw,
                                None if energy is None else (energy.values, by_row, dst))
    # [dO; dRv] U^T = [dP; -dA] (dP: d loss / d P)
    XU = torch.bmm(do, U.transpose(1, 2), out=buf("[dO; dRv] U^T", m, 2 * C, C))
    qf, kf, vf, bf = q, k, v, b
    dSn = dst[1:].reshape(m, D, Dv)
    dq_to, dk_to, dv_to = into
    if x.channel is not None:
        # dk's and dv's last passes write into their targets; dq's last is its scale
        dq, dk, db, dg = _channel_block_grads(x, sol, qf, kf, vf, bf, dRv, dOS, mdRw, XU, dSn, energy, need_g,
                                              dk_to if norms is None else None, dv_to)
        if norms is None:
            torch.mul(dq.view(dq_to.shape), scale, out=dq_to)  # the block saw scale * q
        else:
            _unnormalized_grad(dq.mul_(norms[0][:, :, None]), qf, scale, dq_to)
            _unnormalized_grad(dk.mul_(norms[1][:, :, None]), kf, 1.0, dk_to)
        return db, dg
    return _head_block_grads(x, sol, q, k, v, b, g, dRv, dOS, mdRw, XU, dSn, energy, need_g, scale, into, buf,
                             norms)


def _state_grads_by_loop(x: _Scores, sol: _Solved, dU: Tensor, dst: Tensor, n: int) -> None:
    """:func:`_block_backward`'s state gradients on a CPU, chunk by chunk backwards (no state needed):
    with ``dU = P^T dO`` and ``dst[:n] = (diag(gamma) Q)^T dO`` on entry, ``dU += Kd dS_{c+1}`` and
    ``dS_c = gamma_C dS_{c+1} + dst_c - W^T dU_c``, in place in ``dst (n + 1, R, D, Dv)``."""
    m, C, D = sol.W.shape
    R, Dv = dst.shape[1], dst.shape[-1]
    # the loop's per-chunk views made at once (unbind), not indexed op by op
    dUl, WTl = dU.view(n, R, C, Dv).unbind(), sol.W.view(n, R, C, D).transpose(2, 3).unbind()
    Kdl, dSl = x.Kd.view(n, R, C, D).unbind(), dst.unbind()
    gCl = None if x.gC is None else x.gC.view(n, R, -1, 1).unbind()  # (R, 1 | D, 1): per head or per key channel
    for c in reversed(range(n)):
        dUl[c].baddbmm_(Kdl[c], dSl[c + 1])
        if gCl is None:
            dSl[c].add_(dSl[c + 1])
        else:
            dSl[c].addcmul_(dSl[c + 1], gCl[c])
        dSl[c].baddbmm_(WTl[c], dUl[c], alpha=-1)


def _state_products_by_loop(x: _Scores, U: Tensor, start: Tensor, st: Tensor, dO: Tensor, dRv: Tensor, n: int,
                            dOS: Tensor, mdRw: Tensor, anchors: tuple | None = None) -> None:
    """:func:`_block_backward`'s products with the states on a CPU: the state before each chunk formed
    again from ``start (R, D, Dv)`` and the kept pseudo-values ``U`` (one product a chunk), in place
    in one workspace ``st (R, Dv, D)`` that stays in cache (a state kept for every chunk of the
    block, read again by one batched product, took longer), and with it ``dO S^T`` and ``dRv S^T``
    (into ``dOS``, ``mdRw (n*R, C, D)``).

    The state is formed transposed, S^T (R, Dv, D) contiguous: a product with a transposed view as
    its right factor (dO S^T with S^T a view) ran 1.4x as long as with a contiguous one
    (docs/benchmarks/README.md, History), and the update S^T <- gamma_C S^T + U^T Kd reads U^T as a
    left factor, which costs nothing; gamma_C, per head or per key channel, scales S^T's columns.

    ``anchors``: None, or ``(values, by_row, dS)``: the exact energies ``<S_b, dS_b>`` of the states
    before the chunks b of :func:`_anchor_steps` go into ``values[0], values[1], ...`` as the loop
    forms them (:class:`_Anchors`; ``dS (n + 1, R, D, Dv)`` the state gradients)."""
    m, C, D = x.Kd.shape
    R, Dv = start.shape[0], start.shape[-1]
    Ul, Kdl = U.view(n, R, C, Dv).unbind(), x.Kd.view(n, R, C, D).unbind()
    dOSl, mdRwl = dOS.view(n, R, C, D).unbind(), mdRw.view(n, R, C, D).unbind()
    dol, dRvl = dO.view(n, R, C, Dv).unbind(), dRv.view(n, R, C, Dv).unbind()
    gCT = None if x.gC is None else x.gC.view(n, R, 1, -1).unbind()  # (R, 1, 1 | D): scales S^T's columns
    ST = st.copy_(start.transpose(1, 2))
    anchored = range(n)[_anchor_steps(n)] if anchors is not None else range(0)
    for c in range(n):
        if c in anchored:
            values, by_row, dS = anchors
            j = anchored.index(c)
            _state_dots(ST.transpose(1, 2)[None], dS[c:c + 1], by_row, out=values[j:j + 1])
        torch.bmm(dol[c], ST, out=dOSl[c])
        torch.bmm(dRvl[c], ST, out=mdRwl[c])
        if c < n - 1:  # S^T <- gamma_C S^T + U^T Kd
            (ST if gCT is None else ST.mul_(gCT[c])).baddbmm_(Ul[c].transpose(1, 2), Kdl[c])


def _state_grads_by_scan(x: _Scores, sol: _Solved, dU: Tensor, dst: Tensor, n: int) -> None:
    """:func:`_block_backward`'s backward loop for the accelerator: with ``dU = P^T dO`` and
    ``dst[:n] = (diag(gamma) Q)^T dO`` on entry, the state gradients ``dS_c = A_c^T dS_{c+1} +
    dst_c - W^T dU_c`` (``A_c`` the chunk's transition, :func:`_transitions`) for every chunk from
    one reverse scan, written into ``dst[:n]``, then ``dU += Kd dS_{c+1}`` in one product."""
    m, C, D = sol.W.shape
    R, Dv = dst.shape[1], dst.shape[-1]
    inputs = torch.baddbmm(dst[:n].view(m, D, Dv), sol.W.transpose(1, 2), dU, alpha=-1).view(n, R, D, Dv)
    chunk_recurrence(_transitions(x, sol.W, n), inputs, dst[n], strategy="accelerator", reverse=True, out=dst,
                     consume=True)
    dU.baddbmm_(x.Kd, dst[1:].reshape(m, D, Dv))


def _state_products_by_scan(x: _Scores, U: Tensor, start: Tensor, dO: Tensor, dRv: Tensor, n: int,
                            dOS: Tensor, mdRw: Tensor, anchors: Tensor | None = None) -> Tensor:
    """:func:`_block_backward`'s forward loop for the accelerator: the state before every chunk again,
    from ``start (R, D, Dv)`` and the kept pseudo-values ``U (n*R, C, Dv)`` (``S <- gamma_C S +
    Kd^T U``: a diagonal recurrence, one scan), then ``dO S^T`` and ``dRv S^T`` (``dO, dRv (n*R, C,
    Dv)``) into ``dOS``, ``mdRw`` ``(n*R, C, D)``, one product each for all chunks. Returns the
    states ``(n + 1, R, D, Dv)``, entry c the one before chunk c, entry n the block's end.

    ``anchors``: the forward's states at :func:`_anchor_steps` ``(G - 1, R, D, Dv)``: the scan
    starts again from each (a step into one is ``S = 0 S + anchor``). Why: the forward's states came
    from the scan of the full transitions, ``(gamma_C - Kd^T W) S + Kd^T Uv``, whose rounding the
    recurrence on the kept U does not repeat, and does not damp either: formed again over the whole
    sequence they drifted from the forward's, q's gradient with them (float32, weak decays: 1.5e-6
    against float64 at N = 4096, 5.6e-6 at 65536, up to 18x the CPU strategy's, whose loop repeats
    its forward's operations exactly: docs/benchmarks/kda_energies/state_anchors.md). Now they
    drift over a span at most."""
    m, C, D = x.Kd.shape
    R, Dv = start.shape[0], start.shape[-1]
    A = None if x.gC is None else x.gC.view(n, R, -1, 1)  # (n, R, 1 | D, 1)
    added = torch.bmm(x.Kd.transpose(1, 2), U).view(n, R, D, Dv)
    if anchors is not None and anchors.shape[0]:
        at = _anchor_steps(n)
        into = slice(at.start - 1, n - 1, ANCHOR_SPAN)  # the steps that end at an anchor
        A = start.new_ones(n, R, 1, 1) if A is None else A.clone()
        A[into] = 0
        added[into] = anchors
    states = chunk_recurrence(A, added, start, strategy="accelerator", consume=True)
    ST = states[:n].reshape(m, D, Dv).transpose(1, 2)
    torch.bmm(dO, ST, out=dOS)
    torch.bmm(dRv, ST, out=mdRw)
    return states


class _Anchors(NamedTuple):
    """Exact energies ``<S_b, dS_b>`` at the ends b of spans of ``span`` chunks counted from a
    block's end (the last span ends at the block's end, the first may be shorter): ``values
    (G, R)``, or ``(G, R, D)`` row by row of the state with a gate per key channel, for
    :func:`_energies`."""

    values: Tensor
    span: int


def _state_dots(S: Tensor, dS: Tensor, by_row: bool, out: Tensor | None = None) -> Tensor:
    """``<S_i, dS_i>`` of ``(G, R, D, Dv)`` states and gradients (any strides): ``(G, R)``, or by rows
    ``(G, R, D)``, into ``out`` when given."""
    if by_row:
        return torch.linalg.vecdot(S, dS, out=out)
    return torch.sum(torch.linalg.vecdot(S, dS), -1, out=out)


def _anchor_steps(n: int) -> slice:
    """The chunks ``b`` (of a block of ``n``) before which the states are anchored: every
    :data:`ANCHOR_SPAN` counted back from the block's end (the end itself excluded), ``ceil(n /
    ANCHOR_SPAN) - 1`` of them: the ends of :func:`_energies`' spans but the last."""
    first = n % ANCHOR_SPAN or ANCHOR_SPAN
    return slice(first, n, ANCHOR_SPAN)


def _saved_states(lay: ChunkLayout, opts: EngineOptions) -> int:
    """How many states the forward keeps for the backward: the one before every block and the one
    after the last; on the accelerator, whose one block is the whole sequence, also those at
    :func:`_anchor_steps` (between the first and the last), which its backward forms the states again
    from (:func:`_state_products_by_scan`)."""
    if opts.strategy == "accelerator":
        return -(-lay.Nc // ANCHOR_SPAN) + 1
    return len(lay.tiles()) + 1


def _energies(anchors: _Anchors, change: Tensor) -> Tensor:
    """``<S_c+1, dS_c+1>`` ``(n, R)`` for the chunks c of a block, the state after each and its
    gradient, from exact ones at the ends of spans of :data:`ANCHOR_SPAN` chunks (``anchors``; a CPU
    block's last span ends at the block's end, and the accelerator's block is the whole sequence) and each
    chunk's ``change (n, R)``, ``<S_c, dS_c> - <S_c+1, dS_c+1>``; with a gate per key channel the
    same row by row of the state, ``(G, R, D)`` anchors and ``change (n, R, D)`` (gamma_C then
    scales S's rows, and each identity below holds for each row).

    Why: a decay's gradient needs ``gamma_C <S_c, dS_c+1>`` for every chunk, one pass
    over two (D, Dv) states each; but from the chunk's recurrences,
    ``S_c+1 = gamma_C S_c + Kd^T U`` and ``dS_c = gamma_C dS_c+1 + (diag(gamma) Q)^T dO - W^T dU``,
    ``gamma_C <S_c, dS_c+1> = <S_c+1, dS_c+1> - <Kd, dKd>`` and
    ``<S_c, dS_c> = gamma_C <S_c, dS_c+1> + sum_t gamma_t dgamma_t``: the change is
    ``sum_t (gamma_t dgamma_t - ddelta_t)``, chunk-local sums the backward forms anyway, and one
    pass over two states a span replaces one a chunk. Sums are taken within a span only (from its
    own end): a rounding error that of a few chunks' sums, not of the whole sequence's."""
    values, span = anchors
    n = change.shape[0]  # values: ceil(n / span) of them
    G = values.shape[0]
    pad = G * span - n  # the first span is the short one: zeros before it change nothing
    if pad:
        change = torch.cat([change.new_zeros(pad, *change.shape[1:]), change])
    spans = change.view(G, span, *change.shape[1:])
    later = prefix_sums(spans.flip(1), 1).flip(1).sub_(spans)  # sum over the span's chunks after each
    return later.add_(values.unsqueeze(1)).view(G * span, *change.shape[1:])[pad:]


def _unnormalized_grad(rgrad: Tensor, xb: Tensor, s: float, out: Tensor) -> None:
    """The gradient of the unnormalised x, into ``out (n, R, C, D)``, from ``rgrad (m, C, D)``, r times
    the gradient of the block's ``xb = s r x`` times s (r, s: the normalisation's factors and the
    scale), and ``xb``: for ``x^ = r x``, ``dx = s r (G - (x^ . G) x^)`` with G the gradient of xb,
    which is ``rgrad - (xb . rgrad / s^2) xb``."""
    c = _rowdot(xb, rgrad)  # (m, C)
    if s != 1.0:
        c.div_(s * s)
    torch.addcmul(rgrad.view(out.shape), xb.view(out.shape), c.view(*out.shape[:3], 1), value=-1, out=out)


def _head_block_grads(x: _Scores, sol: _Solved, qf, kf, vf, bf, g, dRv, dOS, mdRw, XU, dSn, energy, need_g, scale,
                      into, buf, norms):
    """The end of :func:`_block_backward` without a gate or with one per head: from the products
    it formed (``dRv (m, C, Dv)``, ``dOS, mdRw (m, C, D)``: dO S^T and dRv S^T, ``XU (m, 2C, C)`` =
    [dO; dRv] U^T, overwritten, ``dSn (m, D, Dv)``, ``energy``: :class:`_Anchors` or None), every gradient
    through the scores and the solve: writes dq, dk, dv into ``into`` and returns ``db``, ``dg``."""
    m, C, D = qf.shape
    n, R = into[0].shape[:2]
    U = sol.U
    dq_to, dk_to, dv_to = into
    dP, dAE = XU[:, :C], XU[:, C:].neg_().tril_(-1)  # dA
    # dP o P: through P, both dE o E (the decays' gradient) and the parts of the queries' and the
    # keys' gradients along themselves (the normalisation's, below)
    YP = torch.mul(dP, x.P, out=buf("dP P", m, C, C)) if need_g or norms is not None else None
    dP = dP.tril_() if x.E is None else dP.mul_(x.E)  # now d loss / d (Q K^T)
    dKd = torch.bmm(U, dSn.transpose(1, 2), out=buf("dKd", m, C, D))
    if x.E is not None:
        dAE.mul_(x.E)  # dA o E
    bcol = bf[:, :, None]
    Z = torch.mul(dAE, bcol, out=buf("Z", m, C, C))  # d loss / d (K K^T), strictly lower
    Z += buf("Z^T", m, C, C).copy_(Z.transpose(1, 2))  # K K^T is symmetric: both of its factors get the gradient
    dAEK = dAE.mul_(x.KK)  # dA o E o KK
    db = _rowdot(dRv, vf).add_(dAEK.sum(-1))
    t_w = _rowdot(mdRw, kf).neg_()  # d loss / d (beta gamma)_t, (m, C)
    gam, dlt = (1.0, 1.0) if x.gam is None else (x.gam, x.delta)  # (m, C) or numbers
    sums = None
    if need_g or norms is not None:
        # Y = dE o E = YK + YP (Z o KK is YK + YK^T, YK = diag(beta) dA o E o KK), summed as one
        # matrix: YK and YP cancel entry by entry where they meet, and rows summed apart lost the
        # log decays' gradient digits in float64 (docs/benchmarks/README.md, History). Its row and
        # column sums and YP's row sums, and the rows' dot products with the last terms.
        YP_rows = YP.sum(-1)
        Y = dAEK.mul_(bcol).add_(YP)
        sums = (Y.sum(-1), Y.sum(-2), YP_rows, _rowdot(qf, dOS), _rowdot(kf, dKd))
    # Each position's factors ride on the C x C operands and the columns of the last terms, not on
    # passes over dq and dk: the gradients of the unscaled (and, normalised, of the unnormalised)
    # queries are written as fq o (dP K + gamma o dO S^T) with fq = scale (times r_q normalised),
    # and the keys' as fk o (Z K + dP^T Q + beta gamma o dRw + delta o dKd) with fk = 1 (r_k
    # normalised). Normalised, the unnormalised x's gradient is that minus c xb, c = xb . that / s^2
    # (xb = s r x the block's queries or keys, s the scale: _unnormalized_grad), and each such dot
    # product is a sum of the row and column sums above (xb_t . (dP K)_t = sum_i dP_ti P_ti,
    # xb_t . (Z K)_t = sum_i Z_ti KK_ti, ...): the correction costs no pass over dq or dk to find c,
    # and rides on Z's (zero) diagonal for the keys, on one multiply-add for the queries.
    fq = scale if norms is None else norms[0][:, :, None]  # a number, or (m, C, 1)
    fk = None if norms is None else norms[1][:, :, None]  # None, or (m, C, 1)
    dPq = dP if norms is None and scale == 1.0 else torch.mul(dP, fq, out=buf("dP fq", m, C, C))
    dPk = dP if fk is None else torch.mul(dP, fk.view(m, 1, C), out=buf("dP fk", m, C, C))
    if fk is not None:
        rY, cY, rP, qdOS, kdKd = sums  # xb_t . (Z K + dP^T Q)_t = rowsum(YK) + colsum(YK) + colsum(YP)
        ck = (rY - rP).add_(cY).addcmul_(t_w, bf if x.gam is None else bf * gam).add_(kdKd * dlt).mul_(norms[1])
        cq = (rP + gam * qdOS).mul_(norms[0]).div_(scale * scale)  # (xb . rgrad) / s^2, see _unnormalized_grad
        Z.mul_(fk).diagonal(dim1=1, dim2=2).sub_(ck)
    dq = torch.bmm(dPq, kf, out=buf("dq", m, C, D))
    dk = torch.bmm(Z, kf, out=buf("dk", m, C, D)).baddbmm_(dPk.transpose(1, 2), qf)
    if fk is not None:
        dq.addcmul_(qf, cq[:, :, None], value=-1)

    def blocked(t):  # (m, C, X) -> (n, R, C, X), as the targets index
        return t.view(n, R, C, t.shape[-1])

    torch.mul(blocked(dRv), blocked(bcol), out=dv_to)
    # the factors of the last terms, (m, C, 1) or numbers: gamma fq (dO S^T), -beta gamma fk (-dRw),
    # delta fk (dKd); gamma and delta are 1 without a decay
    gcol, dcol = (1.0, 1.0) if x.gam is None else (x.gam[:, :, None], x.delta[:, :, None])
    mbg = (bcol if x.gam is None else bcol * gcol).neg()
    if fk is not None:
        mbg, dcol = mbg.mul_(fk), dcol * fk
    dk.addcmul_(mdRw, mbg)
    # the last term of dq and of dk goes straight into its target
    for acc, term, factor, last in ((dq, dOS, gcol * fq, dq_to), (dk, dKd, dcol, dk_to)):
        if isinstance(factor, Tensor):
            torch.addcmul(blocked(acc), blocked(term), blocked(factor), out=last)
        else:
            torch.add(blocked(acc), blocked(term), alpha=factor, out=last)
    dg = None
    if x.gam is None:
        db.add_(t_w)
    else:
        if need_g:
            # G_t enters through E (E_ti = exp(G_t - G_i): rowsum minus colsum of dE o E, which is
            # YK + YP), gamma, delta = exp(G_C - G) and gamma_C (in gamma_C S).
            rY, cY, _, qdOS, kdKd = sums
            dgam = qdOS.addcmul_(bf, t_w)  # d loss / d gamma_t
            ddel = kdKd.mul_(x.delta)  # (d loss / d delta_t) delta_t
            dG = rY.sub_(cY).addcmul_(dgam, x.gam).sub_(ddel)
            # gamma_C's: gamma_C <S, dSn> + sum_t ddel_t at the chunk's last position, which is
            # <Sn, dSn>, the next chunk's "energy": telescoped from the block's end (see above)
            dG[:, -1].add_(_energies(energy, torch.mul(dgam, x.gam).sum(-1).sub_(ddel.sum(-1)).view(n, R)).view(m))
            # G = cumsum(g); 0 at a reset (a decay of exactly 0 there: the sums leave only noise)
            dg = cumsum_in_chunks(dG, -1, reverse=True).masked_fill_(g < RESET_LOG_DECAY, 0)
        db.addcmul_(t_w, x.gam)
    return db, dg


def _channel_block_grads(x: _Scores, sol: _Solved, q, k, v, b, dRv, dOS, mdRw, XU, dSn, energy, need_g,
                         dk_to: Tensor | None, dv_to: Tensor):
    """The end of :func:`_block_backward` for a gate per key channel (KDA): the same gradients,
    with the decayed scores' through the per-channel engine's backward
    (:func:`~linattn.functional.decayed.channel_scores_backward`) and one decay per channel in
    gamma, delta and gamma_C. A per-channel cumulative decay G_td enters a score
    ``sum_d x_td y_id exp(G_td - G_id)`` as ``x_td dx_td - y_id dy_id`` (dx, dy the score's
    gradients with respect to its two factors), and gamma, delta and gamma_C as in the per-head
    case, channel by channel. ``dRv (m, C, Dv)``, ``dOS, mdRw (m, C, D)``: dO S^T and dRv S^T
    (mdRw overwritten), ``XU (m, 2C, C)`` = [dO; dRv] U^T (overwritten), ``dSn (m, D, Dv)``,
    ``energy``: :class:`_Anchors`, <S, dS> row by row (None unless ``need_g``), as
    :func:`_block_backward` formed them. Writes v's gradient into ``dv_to`` and k's into ``dk_to``
    when given, chunk-major ``(n, R, C, Dv | D)`` views of their targets (a temporary of k's
    otherwise); returns ``dq, dk (m, C, D)``, ``db (m, C)`` and ``dg (m, C, D)``."""
    c, qk, saved, g = x.channel
    m, C, D = q.shape
    dKd = torch.bmm(sol.U, dSn.transpose(1, 2))  # (m, C, D)
    dRw = mdRw.neg_()  # dRw = -dRv S^T, as in _block_backward
    # the gradients of P and of KK, as channel_scores gave them: [dP; -dA] from _block_backward is
    # laid out as (m, 2, C, C)
    dscores = XU.view(m, 2, C, C)
    dA = dscores[:, 1].neg_().tril_(-1)  # d loss / d A, A = diag(beta) KK
    bcol = b[:, :, None]
    kdRw = k * dRw
    db = torch.linalg.vecdot(dRv, v, dim=-1).add_((dA * x.KK).sum(-1)).add_(torch.linalg.vecdot(kdRw, x.gam, dim=-1))
    dA.mul_(bcol)  # now d loss / d KK
    # dxs[:, 0]: through q's side of P, dxs[:, 1]: through KK's query-side factor k; dkey: through
    # the key side of both
    dxs, dkey = channel_scores_backward(qk, k, c, saved, dscores)
    dq, d1 = dxs[:, 0], dxs[:, 1]
    dq.addcmul_(dOS, x.gam)
    torch.mul(dRv.view(dv_to.shape), bcol.view(*dv_to.shape[:3], 1), out=dv_to)
    # k's gradient: dkey + d1 + (beta gamma) dRw + delta dKd; its parts through the two ends of
    # the scores, through W (beta gamma k) and through Kd (delta k)
    bg = bcol * x.gam
    u = d1.addcmul(dRw, bg)  # through the query side of KK and through W
    t = dKd.mul_(x.delta)  # through Kd
    dg = None
    if need_g:
        # G_td enters: a score as x_td dx_td - k_id dkey_id; gamma_t (in GQ and W) as
        # gamma_t d loss / d gamma_t, delta_t (in Kd) as -delta_t d loss / d delta_t at t and
        # +delta_t d loss / d delta_t at C, gamma_C (the state's row decay) at C. With dq already
        # holding q's part through GQ: dG = q dq + k (u - dkey - t), plus the terms at C.
        dG = (u - dkey).sub_(t).mul_(k).addcmul_(q, dq)
        # At C, gamma_C <S, dSn> + sum_t ddel_t (ddel = delta d loss / d delta = Kd o dKd) row by
        # row is <Sn, dSn>, the next chunk's energy, telescoped from the block's end as per head
        # (_energies), with the change sum_t (gamma_t dgamma_t - ddel_t) channel by channel: one
        # pass over two states a block instead of a product of the two a chunk, and on the CPU the
        # state kept transposed as for every other gate (_state_products_by_loop)
        # gamma dgamma = GQ o dO S^T + beta gamma k o dRw, ddel = k o t
        change = torch.mul(kdRw, bg).addcmul_(x.GQ, dOS).addcmul_(k, t, value=-1).sum(1)  # (m, D)
        R = energy.values.shape[1]
        dG[:, -1].add_(_energies(energy, change.view(m // R, R, D)).view(m, D))
        # G = cumsum(g) along the chunk; 0 at a reset (a decay of exactly 0 there)
        dg = cumsum_in_chunks(dG, -2, reverse=True).masked_fill_(g < RESET_LOG_DECAY, 0)
    dkey.add_(u)
    dk = dkey.add_(t) if dk_to is None else torch.add(dkey.view(dk_to.shape), t.view(dk_to.shape), out=dk_to)
    return dq, dk, db, dg


def _chunked_backward(q, k, v, b, g, states, kept, do, ds_final, scale, lay, need_g, l2=None,
                      opts: EngineOptions = EngineOptions(32)):
    """Gradients of :func:`_chunked_forward` from what it kept (``states``, the state before every
    block, ``kept``, its :class:`_Solved` buffers, and ``l2``, the L2 normalisation's factors of q
    and k ``(2, R, N)`` or None without one): ``dq, dk (R, N, D)``, ``dv (R, N, Dv)``,
    ``db, dg (R, N)`` (dg None unless ``need_g``) and ``ds0 (R, D, Dv)``, block by block backwards,
    with one pair of state workspaces for all blocks."""
    R, N, D = q.shape
    Dv = v.shape[-1]
    qc, kc, vc, bc, gc, doc = (lay.chunked(t) for t in (q, k, v, b, g, do))
    # the gradients laid out as the inputs are (no copy by autograd into the inputs' layout)
    dq, dk, dv, db = (lay.new_chunked_like(t) for t in (q, k, v, b))
    dg = lay.new_chunked_like(g) if need_g else None
    per_channel = g is not None and g.dim() == 3
    accelerator = opts.strategy == "accelerator"
    tiles = lay.tiles()
    most = max(blk.stop - blk.start for blk in tiles)
    buf = TileBuffers.kept(v)
    st, dst_all = buf("st", R, Dv, D), buf("dst", most + 1, R, D, Dv)
    factors = _qk_factors(scale, _qk_norms(lay, l2))
    ds = ds_final
    for i in reversed(range(len(tiles))):
        blk = tiles[i]
        n = blk.stop - blk.start
        dst = dst_all[:n + 1]
        dst[n] = ds  # ds: ds_final, or dst_all[0] of the block after this one (n >= 1: no overlap)
        qb, kb, qk = _take_qk(lay, qc, kc, blk, factors, per_channel, buf)
        into = tuple(lay.view(grad, blk) for grad in (dq, dk, dv))
        do_blk = _take_stacked(lay, doc, blk, buf("[dO; dRv]", n, R, 2 * lay.C, Dv))
        # the states before and after the block (the accelerator's one block: its anchors between)
        start, end, anchors = (states[0], states[-1], states[1:-1]) if accelerator else (states[i], states[i + 1], None)
        db_blk, dg_blk = _block_backward(qb, kb, _take(lay, vc, blk, buf, "v"), *(_take(lay, t, blk) for t in (bc, gc)),
                                         start, end, _kept(kept, blk), st, do_blk, dst,
                                         need_g, scale, into, buf, qk,
                                         None if l2 is None else tuple(_take(lay, f, blk) for f in factors),
                                         opts, anchors)
        lay.put(db, blk, db_blk)
        if dg_blk is not None:
            lay.put(dg, blk, dg_blk)
        ds = dst[0]

    dg = None if dg is None else lay.unchunked_like(dg, g)
    return (*(lay.unchunked_like(d, t) for d, t in ((dq, q), (dk, k), (dv, v), (db, b))), dg, ds.clone())


# The chunked form as a torch.library custom op with its own autograd: torch.compile then sees one
# op with a shape function (no chunk loop to unroll, so a model compiles in seconds and whole), and
# eager autograd runs the same two functions. On rows ``(R, N, ...)``; g may be None (no decay); s0
# is a tensor (zeros when there was no initial state). Saves the inputs, the states before every
# block and after the last (and the accelerator's anchors between), the chunk-local products T, U, W of every chunk and, unless the gate is
# per key channel, its scores E, KK, P (_Solved; E an empty tensor without a decay, all three
# empty with a gate per key channel), and the L2 normalisation's factors of q and k, and
# recomputes the rest of the chunk-local quantities and the states inside a block in the backward.
def _delta_rule_forward(q, k, v, b, g, s0, scale, keep_states, qk_eps, options):
    """-> ``o (R, N, Dv)`` (laid out as v, see :meth:`ChunkLayout.new_chunked_like`), the final state
    ``(R, D, Dv)``, and what the backward reads: the states
    before every block and after the last, and on the accelerator its anchors between
    (:func:`_saved_states`), the chunks' ``T, U, W``
    ``(Nc, R, C, C | Dv | D)`` and ``E, KK, P`` ``(Nc, R, C, C)`` (:class:`_Solved`) and the L2
    normalisation's factors of q and k ``(2, R, N)`` (each ``(0,)`` without ``keep_states``, a
    call no gradient flows through; E also without a decay, E, KK and P also with a gate per key
    channel, the factors also without ``qk_eps``)."""
    opts = EngineOptions.decode(options)
    lay = _layout(q, opts)
    o, states, kept, l2 = _chunked_forward(q, k, v, b, g, s0, scale, lay, opts, keep_states, qk_eps)
    if not keep_states:
        return o, states[-1].clone(), *(v.new_empty(0) for _ in range(8))
    return o, states[-1].clone(), states, *(v.new_empty(0) if t is None else t for t in (*kept, l2))


_delta_rule_chunked = EngineOp(
    "linattn::delta_rule_chunked",
    "(Tensor q, Tensor k, Tensor v, Tensor b, Tensor? g, Tensor s0, float scale, bool keep_states, float? qk_eps, "
    "str options) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _delta_rule_forward)


@_delta_rule_chunked.register_fake
def _(q, k, v, b, g, s0, scale, keep_states, qk_eps, options):
    R, N, D = q.shape
    Dv = v.shape[-1]
    opts = EngineOptions.decode(options)
    lay = _layout(q, opts)
    C, Nc = lay.C, lay.Nc
    if not keep_states:
        return torch.empty_like(v), v.new_empty(R, D, Dv), *(v.new_empty(0) for _ in range(8))
    l2 = v.new_empty(0) if qk_eps is None else v.new_empty(2, R, N)
    scores = g is None or g.dim() == 2  # E, KK, P kept (E only with a decay)
    E = v.new_empty(Nc, R, C, C) if scores and g is not None else v.new_empty(0)
    KK, P = (v.new_empty(Nc, R, C, C) if scores else v.new_empty(0) for _ in range(2))
    return (torch.empty_like(v), v.new_empty(R, D, Dv), v.new_empty(_saved_states(lay, opts), R, D, Dv),
            v.new_empty(Nc, R, C, C), v.new_empty(Nc, R, C, Dv), v.new_empty(Nc, R, C, D), E, KK, P, l2)


def _delta_rule_backward(q, k, v, b, g, states, T, U, W, E, KK, P, l2, do, ds_final, scale, qk_eps, need_g, options):
    """-> ``dq, dk, dv, db, dg, ds0`` (dg ``(0,)`` unless ``need_g``)."""
    opts = EngineOptions.decode(options)
    lay = _layout(q, opts)
    # do as it comes (an expanded or transposed gradient too): it is only read by the copies
    # into each block's buffer
    scores = g is None or g.dim() == 2  # E, KK, P kept by the forward (E only with a decay)
    kept = _Solved(T, U, W, *((E if g is not None else None, KK, P) if scores else ()))
    dq, dk, dv, db, dg, ds0 = _chunked_backward(q, k, v, b, g, states, kept, do, ds_final, scale,
                                                lay, need_g, None if qk_eps is None else l2, opts)
    # each gradient in its input's layout (ChunkLayout.new_chunked_like), as the fake says
    return dq, dk, dv, db, b.new_empty(0) if dg is None else dg, ds0


_delta_rule_chunked_backward = EngineOp(
    "linattn::delta_rule_chunked_backward",
    "(Tensor q, Tensor k, Tensor v, Tensor b, Tensor? g, Tensor states, Tensor T, Tensor U, Tensor W, Tensor E, "
    "Tensor KK, Tensor P, Tensor l2, Tensor do, Tensor ds_final, float scale, float? qk_eps, bool need_g, "
    "str options) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _delta_rule_backward, backward=True)


@_delta_rule_chunked_backward.register_fake
def _(q, k, v, b, g, states, T, U, W, E, KK, P, l2, do, ds_final, scale, qk_eps, need_g, options):
    dg = torch.empty_like(g) if need_g else b.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(b), dg, \
        ds_final.new_empty(ds_final.shape)


def _layout(q: Tensor, opts: EngineOptions) -> ChunkLayout:
    """The chunked op's layout of ``q (R, N, D)``: blocks of ``opts.per_tile`` chunks on the CPU
    strategy (temporaries in cache), one block of every chunk for the accelerator (its recurrence
    is then one scan over the whole sequence)."""
    R, N = q.shape[0], q.shape[1]
    if opts.strategy == "accelerator":
        return ChunkLayout.whole(R, N, opts.chunk_size)
    return ChunkLayout.of(R, N, opts.chunk_size, chunks_per_tile=opts.per_tile)


def _needs_states(*tensors) -> bool:
    """Whether a backward may run through a chunked call on these inputs: only then are the states
    and the chunk-local products kept (:func:`_chunked_forward`)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _delta_rule_setup(ctx, inputs, output):
    q, k, v, b, g, s0, scale, keep_states, qk_eps, options = inputs
    if not keep_states:  # _needs_states decided no gradient flows through this call
        raise RuntimeError("linattn::delta_rule_chunked: called with keep_states=False on inputs that need "
                           "gradients; its caller must pass _needs_states(...)")
    ctx.save_for_backward(q, k, v, b, g, *output[2:])
    ctx.knobs = (scale, qk_eps)
    ctx.options = options
    ctx.mark_non_differentiable(*output[2:])
    # unused outputs' gradients stay None: materialised, the kept tensors' would be zero-filled
    # tensors as large as themselves on every backward
    ctx.set_materialize_grads(False)


def _delta_rule_autograd(ctx, do, ds_final, *_kept):
    q, k, v, b, g, states, T, U, W, E, KK, P, l2 = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if ds_final is None:
        ds_final = v.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
    need_g = g is not None and ctx.needs_input_grad[4]
    dq, dk, dv, db, dg, ds0 = _delta_rule_chunked_backward(q, k, v, b, g, states, T, U, W, E, KK, P, l2, do, ds_final,
                                                           *ctx.knobs, need_g, ctx.options)
    return dq, dk, dv, db, dg if need_g else None, ds0, None, None, None, None


_delta_rule_chunked.register_autograd(_delta_rule_autograd, setup_context=_delta_rule_setup)


# ---------------------------------------------------------------------------------------------
# Public forms
# ---------------------------------------------------------------------------------------------

def _step(q, k, v, beta, log_decay, scale, s0, qk_eps=None):
    """One position, ``N == 1``: ``S = (I - beta k k^T) Diag(exp(g)) S0 + beta k v^T``,
    ``o = scale S^T q``, in O(D Dv) with plain autograd. ``q, k (B, H, 1, D)``, ``v (B, H, 1, Dv)``,
    ``beta (B, H, 1)``, ``g (B, H, 1)`` or ``(B, H, 1, D)``, ``s0 (B, H, D, Dv)``, all in the compute
    dtype; ``qk_eps``: the L2 normalisation of q and k (``qk_l2norm_eps``), or None.

    Written as ``S = S' + k^T (beta (v - k S'))`` with S' the decayed state: one outer product added
    in the same pass (``baddbmm``), two passes over the state fewer than expanding
    ``(I - beta k k^T) S'`` (a decoding step at 16 heads of 128 is mostly such passes)."""
    B, H, _, D = k.shape
    Dv = v.shape[-1]
    s = s0
    if log_decay is not None:  # per head (B, H, 1, 1), or per key channel on the rows (B, H, D, 1)
        s = torch.exp(log_decay)[..., None] * s if log_decay.dim() == 3 else torch.exp(log_decay).transpose(-1, -2) * s
    if qk_eps is not None:  # the normalised k; q's factor rides on the read-out
        k = k * _l2_factor(k, qk_eps)[..., None]
        scale = scale * _l2_factor(q, qk_eps)[..., None]  # (B, H, 1, 1)
    u = beta[..., None] * (v - k @ s)  # beta (v - k S'), (B, H, 1, Dv)
    s = torch.baddbmm(s.reshape(B * H, D, Dv), k.reshape(B * H, 1, D).transpose(1, 2), u.reshape(B * H, 1, Dv))
    s = s.view(B, H, D, Dv)
    return (q @ s) * scale, s


def _varlen(q, k, v, beta, log_decay, scale, s0, cu_seqlens, return_state, options, qk_eps):
    """Packed documents (see ``varlen.py``): ``q, k (1, H, T, D)``, ``v (1, H, T, Dv)``,
    ``beta, log_decay (1, H, T)`` (log_decay or None), ``s0 (n, H, D, Dv)`` or None, prepared ->
    ``(1, H, T, Dv)`` and the per-document final states ``(n, H, D, Dv)`` (None unless
    ``return_state``). One run of the chunked form on the expanded sequence: -inf log decays at the
    documents' starts (so DeltaNet runs the decayed path, with zero decays elsewhere), D positions
    with beta = 1 replacing the rows of each initial state, D with beta = 0 reading each final one.
    T, H >= 1: delta_rule_attention answers inputs without a position itself. ``qk_eps``: the L2
    normalisation of q and k (``qk_l2norm_eps``), inside the chunked op when no position is
    inserted, else here beforehand (an inserted position's unit query or key must stay unit)."""
    H, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    lay = varlen_layout(cu_seqlens, q.shape[2], D, write_states=s0 is not None, read_states=return_state)
    per_channel = log_decay is not None and log_decay.dim() == 4  # KDA: g (1, H, T, D)
    g = beta.new_zeros(beta.shape) if log_decay is None else log_decay
    b = beta.unsqueeze(-1)  # (1, H, T, 1)
    g = g if per_channel else g.unsqueeze(-1)  # (1, H, T, 1 | D)
    if lay.gather is not None:
        q, k, qk_eps = _l2_normalized(q, qk_eps), _l2_normalized(k, qk_eps), None
        # inserted positions read with scale 1: scale the real queries here instead
        q, scale = lay.expand(q * scale, lay.zeros(q), lay.basis(q)), 1.0
        k = lay.expand(k, lay.basis(k), lay.zeros(k))
        v = lay.expand(v, None if s0 is None else lay.state_rows(s0), lay.zeros(v))
        b = lay.expand(b, lay.ones(b), lay.zeros(b))
        g = lay.expand(g, lay.zeros(g), lay.zeros(g))
    g = lay.with_resets(g)
    Tx = lay.total
    g = g.view(H, Tx, D) if per_channel else g.view(H, Tx)
    o, *_ = _delta_rule_chunked(q[0], k[0], v[0], b.view(H, Tx), g, q.new_zeros(H, D, Dv), scale,
                                _needs_states(q, k, v, b, g), qk_eps, options)  # rows (H, Tx, *): B = 1
    o = o.unsqueeze(0)  # (1, H, Tx, Dv)
    return lay.packed(o), (lay.states(o) if return_state else None)


def delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    log_decay: Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    chunks_per_block: int | None = None,
    solve_block: int = 32,
    sub_chunk_size: int = 4,
    cu_seqlens: Tensor | None = None,
    qk_l2norm_eps: float | None = None,
    strategy: str = "auto",
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Causal delta-rule attention (DeltaNet, Gated DeltaNet), chunked, O(N) memory:
    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    Causal only: there is no bidirectional form (and no ``causal`` argument): the state is defined
    by a recurrence in time.

    Forms: the chunked form of arXiv 2406.06484 (WY / UT representation, one C x C triangular
    inverse per chunk, all chunks at once, see the module docstring) with its own backward; and, for
    ``N == 1`` with an ``initial_state`` (a generation step), the recurrence itself, O(D Dv).

    Args:
        q: ``(B, H, N, D)`` queries, or ``(B, Hk, N, D)`` with H a multiple of Hk (grouped value
            heads, as Qwen3-Next and Qwen3.5: value head h reads query/key head ``h // (H / Hk)``;
            q and k are repeated inside, their gradients summed over each group).
        k: ``(B, H, N, D)`` keys (``(B, Hk, N, D)`` with q), expected L2-normalised (``||k_t|| = 1``). Why: with a unit key and
            ``beta`` in [0, 2] the transition ``I - beta k k^T`` has eigenvalues 1 (D - 1 times) and
            ``1 - beta`` in [-1, 1], so its spectral norm is <= 1 and the state cannot grow from step
            to step; with longer keys it can blow up exponentially. The function does not normalise
            them (a layer does, as DeltaNet's recipe says).
        v: ``(B, H, N, Dv)`` values.
        beta: ``(B, H, N)`` write strength in [0, 2] at every real position (ValueError otherwise):
            0 leaves the state as it is, 1 replaces the value stored under k by v, 2 reflects it.
        log_decay: None (DeltaNet); ``(B, H, N)``, the log of the decay ``exp(g_t)`` applied to
            the whole state before the write (Gated DeltaNet, arXiv 2412.06464); or ``(B, H, N, D)``,
            one per key channel, applied to the rows of the state before the write (Kimi Delta
            Attention, arXiv 2510.26692; in the chunked form the decayed in-chunk scores are the
            per-channel gated engine's, with its sub-chunks). Entries <= 0 (-inf is a decay of 0;
            a positive entry raises ValueError). Inside the chunked form an entry
            below -40 is a reset, a decay of exactly 0 (exp(-40) is 4e-18; its gradient is taken as
            0): see ``linattn.functional.log_decays``.
        scale: multiplies the read-out; None means ``1/sqrt(D)``.
        key_padding_mask: bool ``(B, N)``, True = a real position, False = padding. A padded
            position is an identity step (no decay, no write: its beta and log_decay are taken as 0,
            its q, k, v are never read, even NaN) and outputs zeros.
        initial_state: the :class:`~linattn.functional.decayed_state.DecayedState` after an earlier
            prefix, to resume from (None: zeros). Gradients flow into it.
        return_state: also return the state after the last position.
        chunk_size: a tuning knob, the chunk length C of the chunked form. Any C >= 1 gives the same
            result up to rounding. None: 32 without a decay or with one per head (the C x C products
            and the triangular inverses cost C per position, the sequential loop over chunks and the
            saved states N / C, and at C = 32 the first still dominates), 16 with one per key channel
            (its sub-chunked decayed scores grow faster with C). Timings: docs/benchmarks/README.md,
            History. On the accelerator strategy 64 and 32 (:data:`CHUNK_SIZES`: the scan's
            ``(D, D)`` products per chunk are then fewer).
        chunks_per_block: a tuning knob, how many chunks (all rows together) the chunked form
            works on at a time; any value >= 1 gives the same result. The batched per-chunk
            temporaries (C x C scores, D x D transitions) then exist for one block only. None:
            about ``2**15 / (B H (D + Dv))`` (at least 1): 32 at H = 8, D = Dv = 64, 8 at H = 16,
            D = Dv = 128 (timings: docs/benchmarks/README.md, History).
        solve_block: a tuning knob, the largest diagonal block of a chunk's triangular inverse
            that ``torch.linalg.solve_triangular`` inverts directly (larger ones by halves, as
            batched products); any value >= 1 gives the same result up to rounding. The default
            solves a chunk of the default length whole, which ran faster than by halves of 16
            (timings: docs/benchmarks/README.md, History).
        sub_chunk_size: a tuning knob of a gate per key channel (KDA), the length of the sub-chunks
            of its decayed scores (the largest divisor of C up to it; as in
            ``gated_linear_attention``); any value >= 1 gives the same result up to rounding.
        cu_seqlens: None, or integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., T]`` of n documents packed
            along N (non-decreasing; empty documents allowed), flash-attention's varlen convention.
            Then B must be 1 (inputs ``(1, H, T, *)``), no information crosses a document
            boundary, and ``initial_state`` and the returned state hold one state per document,
            ``s (n, H, D, Dv)``: the result equals one call per document (outputs, gradients,
            states), in one chunked run over T positions (plus n*D per kind of state asked for;
            see ``linattn.functional.varlen``). ``key_padding_mask`` ``(1, T)`` works alike.
            Without ``log_decay`` this runs the decayed path (zero decays, -inf at boundaries).
        qk_l2norm_eps: None (q and k are used as given), or eps >= 0: every query and key is first
            L2-normalised, ``x / sqrt(sum x^2 + eps)`` over its D channels (flash-linear-attention's
            and transformers' ``use_qk_l2norm_in_kernel``, with eps 1e-6 there), and the gradients
            are those of the unnormalised q and k. In the chunked form the normalisation is applied
            as each block's q and k are taken, and its gradient as each block's dq and dk are
            written: no normalised copy of q and k, and no pass of its own over their gradients.
            (Not ``F.normalize``, whose eps bounds the norm from below: the two differ for norms
            near sqrt(eps).)
        strategy: how the chunked form runs on the device; any choice gives the same result up to
            rounding. ``"cpu"``: blocks of ``chunks_per_block`` chunks in cache and a sequential
            loop over chunks (the least arithmetic); ``"accelerator"``: every chunk at once in a
            few large products and the recurrence across chunks as a log-depth scan of the chunks'
            ``(D, D)`` transitions, so the number of kernel launches grows with log N, not N, for
            about ``D / C`` times the loop's arithmetic (``linattn.functional.recurrence``);
            ``"auto"`` (default): ``"cpu"`` on a CPU, ``"accelerator"`` on CUDA, MPS, XPU, ...
            ``chunks_per_block`` is the CPU strategy's knob only.

    Causality and document isolation hold for finite inputs within the contract (unit keys, beta
    in [0, 2]): a NaN or inf at a real position t, or a state that overflows because keys far
    longer than unit norm make it grow, can reach the outputs of earlier positions in t's chunk
    (each chunk is solved as a whole), and, packed, of the other documents sharing that chunk.
    Not guarded (it would cost every call); a padded position's content is never read.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the
        :class:`~linattn.functional.decayed_state.DecayedState` after position N,
        ``s (B, H, D, Dv)``. Half inputs (float16, bfloat16) are computed with the state, the
        cumulative decays and the triangular solves in float32; the returned state is float32 then.
        Differentiable (once; no double backward) in q, k, v, beta, log_decay and initial_state.s.
        Inputs without a position (B, H or N = 0; T = 0 when packed) give the empty output and the
        state after no step: a new tensor equal to ``initial_state.s`` (zeros without one), both in
        the graph of every input as for any other call (zero gradients; the identity to
        ``initial_state.s``).
    """
    fn = "delta_rule_attention"
    _check_l2norm_eps(fn, qk_l2norm_eps)
    check_strategy(fn, strategy)
    run = resolve_strategy(strategy, q.device) if isinstance(q, Tensor) else "cpu"
    if chunk_size is None:
        kind = "channel" if isinstance(log_decay, Tensor) and log_decay.dim() == 4 else "head"
        chunk_size = CHUNK_SIZES[run][kind]
    check_positive_int(fn, "chunk_size", chunk_size)
    if chunks_per_block is not None:
        check_positive_int(fn, "chunks_per_block", chunks_per_block)
    check_positive_int(fn, "solve_block", solve_block)
    check_positive_int(fn, "sub_chunk_size", sub_chunk_size)
    with no_autocast(q.device.type):
        in_dtype = q.dtype
        dt, scale, beta, log_decay, q, kx, vx = _prepare(fn, q, k, v, beta, log_decay, scale, key_padding_mask,
                                                         initial_state, cu_seqlens)
        cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
        B, H, N, D = q.shape
        Dv = v.shape[-1]
        s0 = None if initial_state is None else initial_state.s.to(dt)
        qx = sanitize_padded(q, key_padding_mask).to(dt)
        if B * H * N == 0:
            # No position in any sequence, in every form (packed too: T = 0 or H = 0). The chunked
            # engine cannot lay out zero rows or positions in chunks; the result is the state
            # after no step, and it must stay in the graph as any other call's does.
            n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
            gates = (beta,) if log_decay is None else (beta, log_decay)
            out, s = result_without_positions((qx, kx, vx, *gates), s0, (B, H, N, Dv), (n, H, D, Dv))
        elif cu_seqlens is not None:
            options = EngineOptions(chunk_size, run, operand_dtype(run, in_dtype),
                                    _chunks_per_block(chunks_per_block, H, D, Dv), sub_chunk_size, solve_block).encode()
            out, s = _varlen(qx, kx, vx, beta, log_decay, scale, s0, cu_seqlens, return_state, options, qk_l2norm_eps)
        elif N == 1 and s0 is not None:  # the recurrent step
            out, s = _step(qx, kx, vx, beta, log_decay, scale, s0, qk_l2norm_eps)
        else:
            def rows(t):  # (B, H, N, ...) -> (R, N, ...)
                return t.reshape(B * H, N, *t.shape[3:])

            s0r = vx.new_zeros(B * H, D, Dv) if s0 is None else s0.reshape(B * H, D, Dv)
            options = EngineOptions(chunk_size, run, operand_dtype(run, in_dtype),
                                    _chunks_per_block(chunks_per_block, B * H, D, Dv), sub_chunk_size, solve_block)
            o, s, *_ = _delta_rule_chunked(rows(qx), rows(kx), rows(vx), rows(beta),
                                           None if log_decay is None else rows(log_decay), s0r, scale,
                                           _needs_states(qx, kx, vx, beta, log_decay, s0r), qk_l2norm_eps,
                                           options.encode())
            out, s = o.view(B, H, N, Dv), s.view(B, H, D, Dv)
        out = _zero_padded_outputs(out, key_padding_mask).to(in_dtype)
    return (out, DecayedState(s)) if return_state else out


def delta_rule_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    log_decay: Tensor | None = None,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
    qk_l2norm_eps: float | None = None,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """The recurrence itself, position by position (a Python loop over N, O(N D Dv)): what the
    tests trust, in float64. Same arguments, checks and returns as :func:`delta_rule_attention`
    (no ``chunk_size``)."""
    fn = "delta_rule_attention_reference"
    _check_l2norm_eps(fn, qk_l2norm_eps)
    in_dtype = q.dtype
    dt, scale, beta, log_decay, q, k, v = _prepare(fn, q, k, v, beta, log_decay, scale, key_padding_mask,
                                                   initial_state)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    s0 = None if initial_state is None else initial_state.s.to(dt)
    q = sanitize_padded(q, key_padding_mask).to(dt)
    if qk_l2norm_eps is not None:  # x / sqrt(sum x^2 + eps), written out
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + qk_l2norm_eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + qk_l2norm_eps)
    if B * H * N == 0:  # no step at all: as in delta_rule_attention
        gates = (beta,) if log_decay is None else (beta, log_decay)
        out, s = result_without_positions((q, k, v, *gates), s0, (B, H, N, Dv), (B, H, D, Dv))
    else:
        s = q.new_zeros(B, H, D, Dv) if s0 is None else s0  # (B, H, D, Dv)
        outs = []
        for t in range(N):
            kt, vt = k[:, :, t, :, None], v[:, :, t, None, :]  # (B, H, D, 1), (B, H, 1, Dv)
            bt = beta[:, :, t, None, None]  # (B, H, 1, 1)
            if log_decay is not None:  # Diag(alpha_t) S: all of S (per head) or its rows (per key channel)
                gt = log_decay[:, :, t, None, None] if log_decay.dim() == 3 else log_decay[:, :, t, :, None]
                s = torch.exp(gt) * s
            s = s - bt * kt @ (kt.transpose(-1, -2) @ s)  # (I - beta k k^T) Diag(alpha) S, (B, H, D, Dv)
            s = s + bt * kt @ vt
            outs.append(scale * (q[:, :, t, None, :] @ s))  # (B, H, 1, Dv)
        out = torch.cat(outs, dim=2)
    out = _zero_padded_outputs(out, key_padding_mask).to(in_dtype)
    return (out, DecayedState(s)) if return_state else out


# ---------------------------------------------------------------------------------------------
# Context parallelism: the state summary (functional/sharding.py)
# ---------------------------------------------------------------------------------------------


def _shard_summarize(fn: str, first: bool, initial_state, tensors: tuple, options: dict) -> ShardPart:
    """A shard's transition ``M_r (D, D)`` (the product of its ``exp(g_t) (I - beta_t k_t k_t^T)``)
    and its state from zero, from ONE functional call with values ``[v, 0]`` from the state
    ``[0 | I]`` (width Dv + D): its final state is ``[S_r | M_r]``, and its output's last D columns
    are ``scale M_t^T q_t``, so a later rank's output from ``S_in`` is the first Dv columns plus
    ``(scale M_t^T q_t)^T S_in``."""
    q, k, v, beta = tensors
    q, k = expand_key_heads(fn, q, k, v)  # grouped value heads: the extended call's state is per value head
    log_decay, scale = options.get("log_decay"), options.get("scale")
    kept = None
    if first:
        out, st = delta_rule_attention(q, k, v, beta, initial_state=initial_state, return_state=True, **options)
        B, H, D, Dv = st.s.shape
        s, M = st.s, st.s.new_zeros(B, H, D, D)  # rank 0's transition is never read
    else:
        check_qkv(fn, q, k, v, causal=True)
        dt = compute_dtype(q.dtype)  # the correction is added before the cast to the input dtype
        B, H, N, D = q.shape
        Dv = v.shape[-1]
        v_ext = torch.cat([v.to(dt), v.new_zeros(B, H, N, D, dtype=dt)], dim=-1)  # (B, H, N, Dv + D)
        eye = torch.eye(D, dtype=dt, device=q.device).expand(B, H, D, D)
        s0 = torch.cat([v.new_zeros(B, H, D, Dv, dtype=dt), eye], dim=-1)  # [0 | I], (B, H, D, Dv + D)
        o_ext, st = delta_rule_attention(q.to(dt), k.to(dt), v_ext, beta, initial_state=DecayedState(s0),
                                         return_state=True, **options)
        out, reads = None, o_ext[..., Dv:]  # scale M_t^T q_t (B, H, N, D)
        s, M = st.s[..., :Dv], st.s[..., Dv:]
        kept = (o_ext[..., :Dv], reads, q.dtype)
    values = [B, H, D, Dv, float(log_decay is not None), check_scale(fn, scale, q.shape[-1])]
    return ShardPart([M, s], values, out, kept)


def _shard_fold(state: list[Tensor] | None, summary: list[Tensor]) -> list[Tensor]:
    if state is None:
        return summary
    M, s = summary
    return [M, M @ state[1] + s]


def _shard_finish(kept, state: list[Tensor]) -> Tensor:
    out, reads, dtype = kept
    return (out + reads @ state[1]).to(dtype)


SHARDING = ShardForm("delta_rule_attention", ("B", "H", "D", "Dv", "log_decay given", "scale"), _shard_summarize,
                     _shard_fold, _shard_finish, lambda state: DecayedState(state[1]), ("q", "k", "v", "beta"))
"""The delta rule (DeltaNet, Gated DeltaNet) over a sequence sharded along N: a shard's summary is
its transition and its state from zero, ``B H D (D + Dv)`` numbers; one functional call per rank.
Options: ``log_decay`` (a tensor of this rank's positions, or None), ``scale``, ``chunk_size``."""
