"""Exact softmax attention: the O(N^2) baseline every linattn benchmark compares against.

Dimension legend: B batch, H heads, Nq queries, Nk keys, D query/key width, Dv value width.

The fast form calls ``torch.nn.functional.scaled_dot_product_attention`` so that the baseline is
the best softmax PyTorch offers on the device (a fused, memory-efficient kernel on CPU and GPU),
not a strawman. The reference form writes the formula out with an explicit (Nq, Nk) score matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_key_padding_mask, check_qkv, check_scale, compute_dtype, sanitize_padded
from .sharding import GatherForm
from .varlen import check_cu_seqlens, document_lengths, varlen_layout

__all__ = ["softmax_attention", "softmax_attention_reference"]


def _allowed(
    q: Tensor, k: Tensor, *, causal: bool, key_padding_mask: Tensor | None, doc: Tensor | None = None
) -> Tensor | None:
    """Bool mask broadcastable to (B, H, Nq, Nk), True where query i may attend key j, or None.
    ``doc (N,)``: the document of every packed position (queries and keys are the same positions)."""
    nq, nk = q.shape[2], k.shape[2]
    allowed = None
    if key_padding_mask is not None:
        allowed = key_padding_mask[:, None, None, :]  # (B, 1, 1, Nk)
    if causal:
        tril = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril_()
        allowed = tril if allowed is None else allowed & tril  # (B, 1, Nq, Nk)
    if doc is not None:
        same = doc[:, None] == doc[None, :]  # (N, N)
        allowed = same if allowed is None else allowed & same
    return allowed


def _has_key(q: Tensor, *, causal: bool, key_padding_mask: Tensor | None) -> Tensor | None:
    """Bool (B, 1, Nq, 1): whether query i has at least one key it may attend, or None if all do
    (of one document, when the input is packed)."""
    if key_padding_mask is None:
        return None  # causal alone: query i always sees key i
    if causal:
        has = key_padding_mask.cumsum(-1) > 0  # (B, N): a real key at or before i
    else:
        has = key_padding_mask.any(-1, keepdim=True).expand(-1, q.shape[2])  # (B, Nq)
    return has[:, None, :, None]


def _check_packed(fn: str, q: Tensor, k: Tensor, cu_seqlens: Tensor) -> None:
    """Packed documents need the queries and keys to be the same positions."""
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: with cu_seqlens the queries and keys are the same packed positions, got Nq = "
                         f"{q.shape[2]} and Nk = {k.shape[2]}")
    check_cu_seqlens(fn, cu_seqlens, q)


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Exact softmax attention ``softmax(q k^T * scale) v``.

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        causal: query i attends keys j <= i (needs Nq == Nk).
        key_padding_mask: bool ``(B, Nk)``, True = a real key that may be attended, False = padding.
            Padded keys' content (even NaN) never reaches an output or a real input's gradient.
        scale: logit scale, ``1/sqrt(D)`` when None.
        cu_seqlens: integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., N]`` of n documents packed along N
            (batch size 1, queries and keys the same positions, see
            :mod:`linattn.functional.varlen`): a query attends only keys of its own document.
            Computed one document at a time (SDPA per document: the cost is the sum of the
            documents' squared lengths, never N^2); a Python loop over documents, which softmax's
            own cost dwarfs.

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype. A query with no key to attend gets zeros.
    """
    fn = "softmax_attention"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    scale = check_scale(fn, scale, q.shape[-1])
    if cu_seqlens is not None:
        _check_packed(fn, q, k, cu_seqlens)
        lengths = document_lengths(cu_seqlens)  # read once per cu_seqlens tensor, not once per layer
        masks = [None] * len(lengths) if key_padding_mask is None else key_padding_mask.split(lengths, dim=1)
        return torch.cat([softmax_attention(qd, kd, vd, causal=causal, key_padding_mask=md, scale=scale)
                          for qd, kd, vd, md in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2),
                                                    masks)], dim=2)
    B, H, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    if nq == 0 or nk == 0:
        # No keys: every query gets zeros; the matmul keeps the result attached to q, k and v.
        return (q @ k.transpose(-1, -2)) @ v  # (B, H, Nq, Dv) of zeros
    k = sanitize_padded(k, key_padding_mask)
    v = sanitize_padded(v, key_padding_mask)
    has_key = _has_key(q, causal=causal, key_padding_mask=key_padding_mask)
    if key_padding_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    else:
        allowed = _allowed(q, k, causal=causal, key_padding_mask=key_padding_mask)
        # Rows with no real key would be softmax over nothing (NaN). Let them see every (zeroed)
        # key so the kernel stays finite, then zero their output below: the gradient through
        # torch.where into those rows is exactly zero.
        allowed = allowed | ~has_key
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    if has_key is not None:
        out = torch.where(has_key, out, out.new_zeros(()))
    return out


def softmax_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Plain O(Nq*Nk) softmax attention written from the formula; same contract as
    :func:`softmax_attention` (packed documents: keys of another document masked out). Tests trust
    this one: run it in float64."""
    fn = "softmax_attention_reference"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    scale = check_scale(fn, scale, q.shape[-1])
    doc = None
    if cu_seqlens is not None:
        _check_packed(fn, q, k, cu_seqlens)
        doc = varlen_layout(cu_seqlens, k.shape[2], 0, write_states=False, read_states=False).doc  # (N,)
    k = sanitize_padded(k, key_padding_mask)
    v = sanitize_padded(v, key_padding_mask)
    dt = compute_dtype(q.dtype)
    scores = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale  # (B, H, Nq, Nk)
    allowed = _allowed(q, k, causal=causal, key_padding_mask=key_padding_mask, doc=doc)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach() if scores.shape[-1] else scores.sum(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # exp(-inf) = 0 for disallowed keys
    denom = weights.sum(-1, keepdim=True)
    weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return (weights @ v.to(dt)).to(q.dtype)


SHARDING = GatherForm("softmax_attention")
"""Causal softmax attention over a sequence sharded along N: a rank gathers every earlier rank's keys
and values (``linattn.distributed.softmax_attention``)."""
