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
    compute_dtype,
    no_autocast,
    shape_str,
)
from .decayed_state import DecayedState, check_decayed_state

__all__ = ["gated_linear_attention", "gated_linear_attention_reference"]


def _check_log_decay(fn: str, log_decay, q: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Validate ``log_decay`` and return it as ``(B, H, N, G)`` (G = 1 or D) in the compute dtype,
    padded positions replaced by 0 (an identity step; their content, even NaN, is never read).

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: wrong shape or device, or an entry of a real position that is positive or not
            finite (-inf would make the differences of cumulative log decays -inf - (-inf) = NaN;
            a large finite value such as -1e4 already decays to exactly 0).
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
        if bool((g > 0).any()):
            raise ValueError(f"{fn}: log_decay must be <= 0 (a decay exp(log_decay) <= 1), got a maximum "
                             f"of {g.max().item():.6g}")
        if not bool(torch.isfinite(g).all()):
            raise ValueError(f"{fn}: log_decay must be finite (use a large negative value such as -1e4 "
                             "for a full reset: its decay is exactly 0)")
    return g


def _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state):
    """Checks, then ``q * scale, k, v (B, H, N, *)``, ``g (B, H, N, G)`` and ``s0 (B, H, D, Dv)``
    or None, all in the compute dtype, padded positions zeroed (q too: their output is zeros)."""
    check_qkv(fn, q, k, v, causal=True)
    check_key_padding_mask(fn, key_padding_mask, k)
    scale = check_scale(fn, scale, q.shape[-1])
    g = _check_log_decay(fn, log_decay, q, key_padding_mask)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    s0 = None
    if initial_state is not None:
        check_decayed_state(fn, initial_state, B, H, D, Dv, q.device)
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt) * scale, k.to(dt), v.to(dt)
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, :, None]  # (B, 1, N, 1)
        zero = q.new_zeros(())
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))
    if initial_state is not None:
        s0 = initial_state.s.to(dt)
    return q, k, v, g, s0


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
    s = q.new_zeros(B, H, D, v.shape[-1]) if s0 is None else s0  # (B, H, D, Dv)
    outs = []
    for t in range(N):
        s = torch.exp(g[:, :, t]).unsqueeze(-1) * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, None, :] @ s).squeeze(-2))  # (B, H, Dv)
    out = torch.stack(outs, dim=2) if outs else q.new_zeros(B, H, 0, v.shape[-1])
    out = out.to(in_dtype)
    return (out, DecayedState(s)) if return_state else out


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
    chunk_size: int = 64,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Placeholder: the chunked form is being written; same contract as the reference."""
    check_positive_int("gated_linear_attention", "chunk_size", chunk_size)
    return gated_linear_attention_reference(q, k, v, log_decay, scale=scale, key_padding_mask=key_padding_mask,
                                            initial_state=initial_state, return_state=return_state)
