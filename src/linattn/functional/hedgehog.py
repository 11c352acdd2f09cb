"""Hedgehog attention: learnable softmax feature maps, optionally beside a sliding softmax window.

Hedgehog (Zhang et al. 2024, "The Hedgehog & the Porcupine", arXiv 2402.04347) makes kernel
attention mimic softmax attention with a trainable feature map per head,

    phi(x) = [softmax(x W + b), softmax(-(x W + b))]        (softmax over the F features of each half)

so that phi(q) . phi(k) is positive, spiky and monotone in q.k the way exp(q.k) is, and is then
trained (distilled) to match a pretrained model's softmax weights. LoLCATs (Zhang et al. 2024,
arXiv 2410.10254) adds exact softmax over a sliding window of nearby keys and keeps Hedgehog for the
keys outside it, both in one normaliser. With a window W >= 1, query i weighs key j as

    w_ij = exp(s_ij - m_i)                   for |i - j| <= W  (s_ij = scale q_i.k_j)
    w_ij = g_h phi(q_i) . phi(k_j)           for |i - j| >  W

and ``out_i = sum_j w_ij v_j / sum_j w_ij``. ``m_i`` is the largest s_ij in query i's window, a
per-query stabiliser (no overflow), held constant under differentiation; being fixed per query it
is part of the definition (as in LoLCATs' code), so ``g_h = exp(log_gain_h)`` is learned relative to
the window's heaviest key. With W = 0 there is no window and every key is weighed by phi: plain
Hedgehog, where g cancels.

Cost: the linear part is two sums over all keys (O(N F Dv)); the window is computed in blocks of C
queries against the 3C keys of their own and neighbouring blocks (C >= W), O(N C D) time and memory;
the out-of-window linear mass is the total minus the in-window part. Never an N x N matrix.
Bidirectional only (the encoders it converts are bidirectional).

Every form computes in :func:`compute_dtype` of the inputs (float32 for float16/bfloat16, maps
cast along) with autocast off, and returns the input dtype: the sums over keys grow with N times
|v| (float16 overflows at N = 200, |v| = 2000) and the windowed form subtracts the in-window linear
mass from the total, which half precision cannot resolve.

Dimension legend as in ``checks.py``; F features per half (phi has 2F), C block length, Nb blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_key_padding_mask, check_qkv, compute_dtype, finite_max, no_autocast, sanitize_padded
from .normaliser import divide_by_normaliser, normaliser_floor

__all__ = [
    "HedgehogMaps",
    "hedgehog_attention",
    "hedgehog_attention_reference",
    "hedgehog_attention_weights",
    "hedgehog_features",
]

# The smallest block of queries: smaller blocks would make many tiny matrix products.
MIN_BLOCK = 32


class HedgehogMaps(NamedTuple):
    """The trainable parameters of Hedgehog attention for H heads.

    Attributes:
        q_weight: ``(H, D, F)`` query feature projection.
        q_bias: ``(H, F)``.
        k_weight: ``(H, D, F)`` key feature projection.
        k_bias: ``(H, F)``.
        log_gain: ``(H,)`` log of g, the weight of the linear part relative to the window (unused
            without a window).
    """

    q_weight: Tensor
    q_bias: Tensor
    k_weight: Tensor
    k_bias: Tensor
    log_gain: Tensor


def hedgehog_features(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``x (B, H, N, D)``, ``weight (H, D, F)``, ``bias (H, F)`` -> ``phi(x) (B, H, N, 2F)``, each
    half a softmax over its F features (so phi(q) . phi(k) lies in (0, 2])."""
    z = torch.einsum("bhnd,hdf->bhnf", x, weight) + bias[:, None, :]  # (B, H, N, F)
    return torch.cat([torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)], dim=-1)


def _check(fn: str, q, k, v, maps: HedgehogMaps, window, key_padding_mask) -> None:
    check_qkv(fn, q, k, v, causal=False)
    check_key_padding_mask(fn, key_padding_mask, k)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: needs as many queries as keys (a window is about positions), got q "
                         f"{tuple(q.shape)} and k {tuple(k.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{fn}: window must be an int >= 0 (0: no softmax window), got {window!r}")
    H, D = q.shape[1], q.shape[3]
    for name in ("q_weight", "k_weight"):
        w = getattr(maps, name)
        if w.dim() != 3 or w.shape[:2] != (H, D):
            raise ValueError(f"{fn}: maps.{name} must be (H, D, F) = ({H}, {D}, F), got {tuple(w.shape)}")
    Fdim = maps.q_weight.shape[2]
    for name in ("q_bias", "k_bias"):
        if tuple(getattr(maps, name).shape) != (H, Fdim):
            raise ValueError(f"{fn}: maps.{name} must be (H, F) = ({H}, {Fdim}), got {tuple(getattr(maps, name).shape)}")
    if maps.k_weight.shape[2] != Fdim:
        raise ValueError(f"{fn}: q_weight and k_weight need the same F, got {Fdim} and {maps.k_weight.shape[2]}")
    if tuple(maps.log_gain.shape) != (H,):
        raise ValueError(f"{fn}: maps.log_gain must be (H,) = ({H},), got {tuple(maps.log_gain.shape)}")


def _in_dtype(maps: HedgehogMaps, dt: torch.dtype) -> HedgehogMaps:
    return HedgehogMaps(*(t.to(dt) for t in maps))


def hedgehog_attention_weights(
    q: Tensor, k: Tensor, maps: HedgehogMaps, *, window: int = 0,
    key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """The normalised attention weights ``(B, H, N, N)`` of :func:`hedgehog_attention`, built
    explicitly (O(N^2)): the reference, and the student's weights when distilling toward softmax
    weights on short inputs. Padded keys (``key_padding_mask`` False) get weight 0. Computed in
    float32 for half inputs, returned in the input dtype."""
    dt = compute_dtype(q.dtype)
    with no_autocast(q.device.type):
        w = _weights(q.to(dt), k.to(dt), _in_dtype(maps, dt), window=window,
                     key_padding_mask=key_padding_mask, scale=scale)
    return w.to(q.dtype)


def _weights(q: Tensor, k: Tensor, maps: HedgehogMaps, *, window: int, key_padding_mask: Tensor | None,
             scale: float | None) -> Tensor:
    """:func:`hedgehog_attention_weights` in the dtype of its arguments."""
    N = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = torch.ones(q.shape[0], N, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    keep = keep[:, None, None, :]  # (B, 1, 1, N)
    fq, fk = hedgehog_features(q, maps.q_weight, maps.q_bias), hedgehog_features(k, maps.k_weight, maps.k_bias)
    a = fq @ fk.transpose(-1, -2)  # (B, H, N, N)
    # the normaliser floor of the fast form: of phi alone, with z the sum of every real key's phi
    z = (fk * keep[:, :, 0, :, None]).sum(2, keepdim=True)  # (B, H, 1, 2F)
    if window == 0:
        w = a.masked_fill(~keep, 0.0)
        floor = normaliser_floor(fq, z)
    else:
        pos = torch.arange(N, device=q.device)
        band = (pos[:, None] - pos[None, :]).abs() <= window  # (N, N)
        s = (q @ k.transpose(-1, -2)) * scale  # (B, H, N, N)
        inside = band & keep
        m = finite_max(s.masked_fill(~inside, float("-inf")), -1).detach()
        e = torch.exp((s - m).masked_fill(~inside, float("-inf")))
        gain = maps.log_gain.exp()[None, :, None, None]
        w = e + gain * a.masked_fill(band | ~keep, 0.0)
        floor = _windowed_floor(e.detach().sum(-1, keepdim=True), gain.detach(), fq, z)
    return divide_by_normaliser(w, w.sum(dim=-1, keepdim=True), floor)


def _windowed_floor(window_mass: Tensor, gain: Tensor, fq: Tensor, z: Tensor) -> Tensor:
    """The normaliser floor with a window, ``(..., 1)``: :func:`normaliser_floor` of the linear
    part times the gain, plus the same fraction of the window's own softmax mass (>= 1 whenever
    the window holds a real key: its heaviest key has weight exactly 1). The windowed normaliser
    subtracts the in-window linear mass from the total, so it can cancel; this keeps its floor
    on the scale of what it is made of. ``window_mass (..., 1)``, ``gain`` broadcastable."""
    rel = torch.finfo(fq.dtype).max ** -0.5
    return normaliser_floor(fq, z) * gain + window_mass * rel


def hedgehog_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, maps: HedgehogMaps, *, window: int = 0,
    key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """Plain O(N^2) Hedgehog attention from the formula (weights times values); tests trust it."""
    _check("hedgehog_attention_reference", q, k, v, maps, window, key_padding_mask)
    dt = compute_dtype(q.dtype)
    with no_autocast(q.device.type):
        k, v = sanitize_padded(k, key_padding_mask).to(dt), sanitize_padded(v, key_padding_mask).to(dt)
        w = _weights(q.to(dt), k, _in_dtype(maps, dt), window=window, key_padding_mask=key_padding_mask,
                     scale=scale)  # (B, H, N, N)
        return (w @ v).to(q.dtype)


def hedgehog_attention(
    q: Tensor, k: Tensor, v: Tensor, maps: HedgehogMaps, *, window: int = 0,
    key_padding_mask: Tensor | None = None, scale: float | None = None,
) -> Tensor:
    """Hedgehog attention (see the module docstring), linear in N; bidirectional.

    Args:
        q: ``(B, H, N, D)`` queries.
        k: ``(B, H, N, D)`` keys.
        v: ``(B, H, N, Dv)`` values.
        maps: the feature maps and gains, :class:`HedgehogMaps`.
        window: W, the largest distance |i - j| weighed by exact softmax; 0 for none.
        key_padding_mask: bool ``(B, N)``, True = a real key that may be attended, False = padding
            (left out of numerator and normaliser alike).
        scale: logit scale of the window's softmax; None means 1/sqrt(D).

    Returns:
        ``(B, H, N, Dv)`` in the input dtype (computed in float32 for half inputs).
    """
    _check("hedgehog_attention", q, k, v, maps, window, key_padding_mask)
    dt = compute_dtype(q.dtype)
    with no_autocast(q.device.type):
        out = _hedgehog(q.to(dt), sanitize_padded(k, key_padding_mask).to(dt),
                        sanitize_padded(v, key_padding_mask).to(dt), _in_dtype(maps, dt),
                        window=window, key_padding_mask=key_padding_mask, scale=scale)
    return out.to(q.dtype)


def _hedgehog(q: Tensor, k: Tensor, v: Tensor, maps: HedgehogMaps, *, window: int,
              key_padding_mask: Tensor | None, scale: float | None) -> Tensor:
    """:func:`hedgehog_attention` in the dtype of its arguments, padded keys and values zeroed."""
    B, H, N, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    fq = hedgehog_features(q, maps.q_weight, maps.q_bias)  # (B, H, N, 2F)
    fk = hedgehog_features(k, maps.k_weight, maps.k_bias)
    if key_padding_mask is not None:
        fk = sanitize_padded(fk, key_padding_mask)  # padded keys add nothing
    S = torch.einsum("bhnf,bhne->bhfe", fk, v)  # (B, H, 2F, Dv)
    z = fk.sum(dim=2)  # (B, H, 2F)
    num_lin = fq @ S  # (B, H, N, Dv)
    den_lin = torch.einsum("bhnf,bhf->bhn", fq, z)  # (B, H, N)
    floor_lin = normaliser_floor(fq, z[:, :, None])  # (B, H, N, 1)
    if window == 0:
        return divide_by_normaliser(num_lin, den_lin[..., None], floor_lin)

    C = max(window, MIN_BLOCK)
    Nb = -(-N // C)
    fill = Nb * C - N
    keep = torch.ones(B, N, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    # keys padded by one block on each side (and the fill), so block b sees blocks b-1, b, b+1
    keep_p = F.pad(keep, (C, C + fill), value=False)  # (B, (Nb + 2) C)

    def blocks(x: Tensor) -> Tensor:  # (B, H, N, X) -> queries (B, H, Nb, C, X)
        return F.pad(x, (0, 0, 0, fill)).view(B, H, Nb, C, x.shape[-1])

    def neighbourhood(x: Tensor) -> Tensor:  # (B, H, N, X) -> keys (B, H, Nb, 3C, X)
        xp = F.pad(x, (0, 0, C, C + fill)).view(B, H, Nb + 2, C, x.shape[-1])
        return torch.cat([xp[:, :, :-2], xp[:, :, 1:-1], xp[:, :, 2:]], dim=3)

    kw, vw, fkw = neighbourhood(k), neighbourhood(v), neighbourhood(fk)  # (B, H, Nb, 3C, .)
    kp = keep_p.view(B, Nb + 2, C)
    keep_w = torch.cat([kp[:, :-2], kp[:, 1:-1], kp[:, 2:]], dim=2)  # (B, Nb, 3C)
    r = torch.arange(C, device=q.device)
    c = torch.arange(3 * C, device=q.device) - C
    band = (r[:, None] - c[None, :]).abs() <= window  # (C, 3C): query r of a block vs key c - C
    inside = band & keep_w[:, None, :, None, :]  # (B, 1, Nb, C, 3C)
    s = blocks(q) @ kw.transpose(-1, -2) * scale  # (B, H, Nb, C, 3C)
    m = finite_max(s.masked_fill(~inside, float("-inf")), -1).detach()
    e = torch.exp((s - m).masked_fill(~inside, float("-inf")))  # window softmax weights
    a = (blocks(fq) @ fkw.transpose(-1, -2)).masked_fill(~inside, 0.0)  # linear weights inside the window
    gain = maps.log_gain.exp()[None, :, None, None]  # (1, H, 1, 1)
    num_w = (e - gain[..., None] * a) @ vw  # (B, H, Nb, C, Dv)
    den_w = (e - gain[..., None] * a).sum(dim=-1)  # (B, H, Nb, C)
    num = num_w.reshape(B, H, Nb * C, v.shape[-1])[:, :, :N] + gain * num_lin  # Dv spelled out: Nb = 0 at N = 0
    den = den_w.reshape(B, H, Nb * C)[:, :, :N] + gain[..., 0] * den_lin
    window_mass = e.detach().sum(-1).reshape(B, H, Nb * C)[:, :, :N, None]  # (B, H, N, 1)
    floor = _windowed_floor(window_mass, gain.detach(), fq, z[:, :, None])
    return divide_by_normaliser(num, den[..., None], floor)
