"""Linformer attention (Wang et al., arXiv 2006.04768), bidirectional only.

    out = softmax( q (E k)^T * scale ) (F v)

E and F are ``(P, Nk)`` projections along the sequence: they mix the Nk keys (values) into P
projected keys (values), so attention costs O(Nq P D + P Nk D) instead of O(Nq Nk D).

Dimension legend: B batch, H heads, Nq queries, Nk keys, P projected length, D query/key width,
Dv value width.

There is no causal form: every projected key is a combination of all Nk keys, so every output
depends on keys after its own position. Padded keys are zeroed before projecting, so they add
nothing to any projected key or value (which is what dropping their columns of E and F would do).
The module that owns E and F for a maximum length is :class:`linattn.nn.LinformerAttention`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_qkv,
    check_scale,
    compute_dtype,
    no_autocast,
    sanitize_padded,
    shape_str,
)
from .softmax import softmax_attention_reference

__all__ = ["linformer_attention", "linformer_attention_reference"]

_NO_CAUSAL = (
    "linformer_attention has no causal form: E and F mix all Nk keys and values into each projected "
    "one, so every output depends on later positions. Use local_attention, linear_attention or "
    "lsh_attention for causal models."
)


def _validate(fn, q, k, v, e_proj, f_proj, causal, key_padding_mask) -> None:
    if causal:
        raise ValueError(_NO_CAUSAL)
    check_qkv(fn, q, k, v, causal=False)
    check_key_padding_mask(fn, key_padding_mask, k)
    nk = k.shape[2]
    for name, p in (("e_proj", e_proj), ("f_proj", f_proj)):
        if not isinstance(p, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor of shape (P, Nk), got {type(p).__name__}")
        if p.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} must have the dtype of q, k and v ({q.dtype}), got {p.dtype}")
        if p.dim() != 2 or p.shape[1] != nk or p.shape[0] < 1:
            raise ValueError(
                f"{fn}: {name} must have shape (P, Nk) with P >= 1 and Nk = {nk} for k {shape_str(k)}, "
                f"got {shape_str(p)}"
            )
        if p.device != q.device:
            raise ValueError(f"{fn}: {name} is on {p.device} but q is on {q.device}")
    if e_proj.shape != f_proj.shape:
        raise ValueError(
            f"{fn}: e_proj and f_proj must have the same shape (P, Nk), got {shape_str(e_proj)} and {shape_str(f_proj)}"
        )


def _project(k, v, e_proj, f_proj, key_padding_mask, dt):
    """Projected keys ``E k (B,H,P,D)`` and values ``F v (B,H,P,Dv)``, padded keys left out."""
    k = sanitize_padded(k, key_padding_mask).to(dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    return e_proj.to(dt) @ k, f_proj.to(dt) @ v  # (P, Nk) @ (B, H, Nk, *) -> (B, H, P, *)


def linformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e_proj: Tensor,
    f_proj: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Linformer attention ``softmax(q (E k)^T * scale) (F v)`` (Wang et al., arXiv 2006.04768).

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        e_proj: ``(P, Nk)`` key projection E, dtype of q.
        f_proj: ``(P, Nk)`` value projection F, same shape.
        causal: must be False; there is no causal form (raises ValueError saying why).
        key_padding_mask: bool ``(B, Nk)``, True = a real key, False = padding. Padded keys and
            values are zeroed before projecting, so they contribute nothing (their content, even
            NaN, never reaches an output or a real input's gradient).
        scale: logit scale, ``1/sqrt(D)`` when None.

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype (computed in float32 for half inputs). Every query
        attends all P projected keys; with no real key these are all zero and so is the output.
    """
    fn = "linformer_attention"
    _validate(fn, q, k, v, e_proj, f_proj, causal, key_padding_mask)
    scale = check_scale(fn, scale, q.shape[-1])
    with no_autocast(q.device.type):
        dt = compute_dtype(q.dtype)
        kp, vp = _project(k, v, e_proj, f_proj, key_padding_mask, dt)
        return F.scaled_dot_product_attention(q.to(dt), kp, vp, scale=scale).to(q.dtype)


def linformer_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    e_proj: Tensor,
    f_proj: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The same formula through the explicit (Nq, P) softmax of
    :func:`softmax_attention_reference`. Tests trust this one, in float64."""
    fn = "linformer_attention_reference"
    _validate(fn, q, k, v, e_proj, f_proj, causal, key_padding_mask)
    scale = check_scale(fn, scale, q.shape[-1])
    dt = compute_dtype(q.dtype)
    kp, vp = _project(k, v, e_proj, f_proj, key_padding_mask, dt)
    return softmax_attention_reference(q.to(dt), kp, vp, scale=scale).to(q.dtype)
