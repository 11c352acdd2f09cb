"""Efficient Attention (Shen et al., arXiv 1812.01243), bidirectional only.

    E(Q, K, V) = rho_q(Q) (rho_k(K)^T V)

with rho_q the softmax over the D features of each query row and rho_k the softmax over the Nk
positions of each key column. Cost O(N D Dv) in time, O(N (D + Dv) + D Dv) in memory.

Dimension legend: B batch, H heads, Nq queries, Nk keys, D query/key width, Dv value width.

There is no causal form: rho_k normalises every key column over the whole sequence, so the
weight of key j depends on keys after j. A prefix-normalised variant would be a different
mechanism, and we do not pretend otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_key_padding_mask, check_qkv, compute_dtype, finite_max, no_autocast, sanitize_padded

__all__ = ["efficient_attention", "efficient_attention_reference"]

_NO_CAUSAL = (
    "efficient_attention has no causal form: its key softmax normalises each key feature over the "
    "whole sequence, so every key's weight depends on later keys. Use linear_attention or "
    "favor_attention for causal models."
)


def _key_logits(k: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Key logits with padded positions at -inf, so they get zero weight in the sequence softmax."""
    if key_padding_mask is None:
        return k
    return k.masked_fill(~key_padding_mask[:, None, :, None], float("-inf"))


def _softmax_over_keys(logits: Tensor) -> Tensor:
    """Softmax over dim -2 that returns zeros (not NaN) for a column whose every entry is -inf, and
    an empty ``(B, H, 0, D)`` for no keys at all (whose context sum is then zeros)."""
    col_max = finite_max(logits, -2).detach()  # (B, H, 1, D)
    e = torch.exp(logits - col_max)  # exp(-inf) = 0 for padding
    total = e.sum(-2, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def _validate(fn, q, k, v, causal, key_padding_mask) -> None:
    if causal:
        raise ValueError(_NO_CAUSAL)
    check_qkv(fn, q, k, v, causal=False)
    check_key_padding_mask(fn, key_padding_mask, k)


def _prepare(q, k, v, key_padding_mask):
    dt = compute_dtype(q.dtype)
    k = sanitize_padded(k, key_padding_mask).to(dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    rho_q = torch.softmax(q.to(dt), dim=-1)  # (B, H, Nq, D)
    rho_k = _softmax_over_keys(_key_logits(k, key_padding_mask))  # (B, H, Nk, D)
    return rho_q, rho_k, v


def efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Efficient Attention ``softmax_D(q) (softmax_Nk(k)^T v)`` (Shen et al., arXiv 1812.01243).

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        causal: must be False; there is no causal form (raises ValueError saying why).
        key_padding_mask: bool ``(B, Nk)``, True = a real key that may be attended, False = padding.
            Padded keys get zero weight in the key softmax; their content never reaches the output.

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype (computed in float32 for half inputs). With no real
        key the output is zeros.
    """
    _validate("efficient_attention", q, k, v, causal, key_padding_mask)
    with no_autocast(q.device.type):
        rho_q, rho_k, v = _prepare(q, k, v, key_padding_mask)
        context = rho_k.transpose(-1, -2) @ v  # (B, H, D, Dv): a sum over the sequence
        return (rho_q @ context).to(q.dtype)


def efficient_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The same formula with the product taken the quadratic way, ``(rho_q rho_k^T) v`` through an
    explicit (Nq, Nk) weight matrix, and the key softmax written out. Tests trust this one."""
    _validate("efficient_attention_reference", q, k, v, causal, key_padding_mask)
    dt = compute_dtype(q.dtype)
    k = sanitize_padded(k, key_padding_mask).to(dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    eq = torch.exp(q.to(dt) - q.to(dt).amax(-1, keepdim=True))
    rho_q = eq / eq.sum(-1, keepdim=True)
    real = torch.ones_like(k, dtype=torch.bool)
    if key_padding_mask is not None:
        real = real & key_padding_mask[:, None, :, None]
    shift = finite_max(torch.where(real, k, float("-inf")), -2)  # (B, H, 1, D)
    ek = torch.where(real, torch.exp(k - shift), torch.zeros_like(k))
    col = ek.sum(-2, keepdim=True)
    rho_k = ek / torch.where(col > 0, col, torch.ones_like(col))
    weights = rho_q @ rho_k.transpose(-1, -2)  # (B, H, Nq, Nk)
    return (weights @ v).to(q.dtype)
