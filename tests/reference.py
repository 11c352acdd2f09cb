"""Independent O(N^2) references written from the formulas, for the tests only.

They share no code with linattn: the feature maps, masks and normalisation are spelled out again
here so that a bug in the library cannot hide in both the fast form and what it is compared with.
Run them in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def phi(name: str, x: Tensor) -> Tensor:
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))
    if name == "relu":
        return torch.clamp(x, min=0.0)
    if name == "cos":
        norm = torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-12)
        return torch.cat([torch.ones_like(x[..., :1]), x / norm], dim=-1)
    if name == "softmax":
        e = torch.exp(x - x.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    raise KeyError(name)


def allowed_matrix(nq: int, nk: int, B: int, causal: bool, mask: Tensor | None) -> Tensor:
    """(B, 1, Nq, Nk) bool: may query i attend key j."""
    allowed = torch.ones(B, 1, nq, nk, dtype=torch.bool)
    if causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        allowed = allowed & (j <= i)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    return allowed


def _zero_padded(x: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return x
    return torch.where(mask[:, None, :, None], x, torch.zeros_like(x))


def weighted_average(sim: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """out_i = sum_j sim_ij v_j / sum_j sim_ij over allowed j; 0 where the sum of weights is 0."""
    sim = torch.where(allowed, sim, torch.zeros_like(sim))
    num = sim @ v
    den = sim.sum(-1, keepdim=True)
    safe = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe, torch.zeros_like(num))


def kernel_attention(q, k, v, feature_map, causal=False, mask=None, S0=None, z0=None):
    """Returns out and the final (S, z) state."""
    B, _, nq, _ = q.shape
    nk = k.shape[2]
    fq = phi(feature_map, q)
    fk = phi(feature_map, _zero_padded(k, mask))
    v = _zero_padded(v, mask)
    allowed = allowed_matrix(nq, nk, B, causal, mask)
    sim = torch.where(allowed, fq @ fk.transpose(-1, -2), torch.zeros(()))
    num = sim @ v
    den = sim.sum(-1, keepdim=True)
    if mask is not None:  # the state holds real keys only
        fk = torch.where(mask[:, None, :, None], fk, torch.zeros_like(fk))
    S = fk.transpose(-1, -2) @ v
    z = fk.sum(-2)
    if S0 is not None:
        num = num + fq @ S0
        den = den + fq @ z0[..., None]
        S, z = S + S0, z + z0
    safe = torch.where(den != 0, den, torch.ones_like(den))
    out = torch.where(den != 0, num / safe, torch.zeros_like(num))
    return out, S, z


def softmax_attention(q, k, v, causal=False, mask=None, scale=None):
    B, _, nq, d = q.shape
    nk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = _zero_padded(k, mask), _zero_padded(v, mask)
    allowed = allowed_matrix(nq, nk, B, causal, mask)
    logits = (q @ k.transpose(-1, -2)) * scale
    shift = torch.where(allowed, logits, torch.full_like(logits, -1e300)).max(-1, keepdim=True).values
    sim = torch.exp(torch.where(allowed, logits - shift, torch.full_like(logits, -1e300)))
    return weighted_average(sim, v, allowed)


def efficient_attention(q, k, v, mask=None):
    B, _, nq, _ = q.shape
    nk = k.shape[2]
    k, v = _zero_padded(k, mask), _zero_padded(v, mask)
    rq = phi("softmax", q)  # softmax over the features of each query
    real = torch.ones_like(k, dtype=torch.bool) if mask is None else mask[:, None, :, None].expand_as(k)
    kk = torch.where(real, k, torch.full_like(k, -1e300))
    ek = torch.where(real, torch.exp(kk - kk.max(-2, keepdim=True).values), torch.zeros_like(k))
    col = ek.sum(-2, keepdim=True)
    rk = ek / torch.where(col > 0, col, torch.ones_like(col))  # softmax over positions per column
    return (rq @ rk.transpose(-1, -2)) @ v


def favor_phi(kind: str, x: Tensor, W: Tensor, scale: float) -> Tensor:
    """Performer features from the formulas (arXiv 2009.14794), kind in positive / trig / relu."""
    m = W.shape[0]
    if kind == "relu":
        return torch.clamp(x @ W.T, min=0.0) / math.sqrt(m)
    xs = x * math.sqrt(scale)
    u = xs @ W.T
    sq = (xs * xs).sum(-1, keepdim=True)
    if kind == "positive":
        return torch.exp(u - sq / 2) / math.sqrt(m)
    return torch.exp(sq / 2) * torch.cat([torch.sin(u), torch.cos(u)], -1) / math.sqrt(m)


def favor_attention(q, k, v, W, kind, causal=False, mask=None, scale=None, trig_floor=None):
    """Explicit phi(Q) phi(K)^T V, normalised; returns out and the final (S, z) = sums over real keys.

    trig: the normaliser is clamped at trig_floor * exp(||q'||^2/2) * max_visible exp(||k'||^2/2),
    the last factor held constant under differentiation.
    """
    B, _, nq, d = q.shape
    nk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = _zero_padded(k, mask), _zero_padded(v, mask)
    fq, fk = favor_phi(kind, q, W, scale), favor_phi(kind, k, W, scale)
    allowed = allowed_matrix(nq, nk, B, causal, mask)
    sim = torch.where(allowed, fq @ fk.transpose(-1, -2), torch.zeros(()))
    num, den = sim @ v, sim.sum(-1, keepdim=True)
    if kind == "trig":
        wk = torch.exp((k * k).sum(-1) * scale / 2)[:, :, None, :]
        heaviest = torch.where(allowed, wk, torch.zeros(())).max(-1, keepdim=True).values
        wq = torch.exp((q * q).sum(-1, keepdim=True) * scale / 2)
        den = torch.maximum(den, trig_floor * heaviest.detach() * wq)  # the heaviest weight is a constant
        out = torch.where(heaviest > 0, num / torch.where(heaviest > 0, den, torch.ones(())), torch.zeros(()))
    else:
        safe = torch.where(den != 0, den, torch.ones_like(den))
        out = torch.where(den != 0, num / safe, torch.zeros_like(num))
    if mask is not None:
        fk = torch.where(mask[:, None, :, None], fk, torch.zeros_like(fk))
    return out, fk.transpose(-1, -2) @ v, fk.sum(-2)
def local_attention(q, k, v, window, causal=False, mask=None, scale=None):
    """Softmax attention with an explicit (N, N) band mask: |i - j| <= window (causal: 0 <= i - j <= window)."""
    n = q.shape[2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    band = ((i - j) >= 0) & ((i - j) <= window) if causal else (i - j).abs() <= window
    B, _, nq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = _zero_padded(k, mask), _zero_padded(v, mask)
    allowed = allowed_matrix(nq, n, B, False, mask) & band
    logits = (q @ k.transpose(-1, -2)) * scale
    shift = torch.where(allowed, logits, torch.full_like(logits, -1e300)).max(-1, keepdim=True).values
    sim = torch.exp(torch.where(allowed, logits - shift, torch.full_like(logits, -1e300)))
    return weighted_average(sim, v, allowed)


def linformer_attention(q, k, v, E, F, mask=None, scale=None):
    """softmax(q (E k)^T * scale) (F v) written with explicit sums; padded keys dropped first."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = _zero_padded(k, mask), _zero_padded(v, mask)
    kp = torch.einsum("pn,bhnd->bhpd", E, k)
    vp = torch.einsum("pn,bhne->bhpe", F, v)
    logits = torch.einsum("bhid,bhpd->bhip", q, kp) * scale
    w = torch.exp(logits - logits.max(-1, keepdim=True).values)
    w = w / w.sum(-1, keepdim=True)
    return torch.einsum("bhip,bhpe->bhie", w, vp)


def shared_qk_attention(qk, v, causal=False, mask=None, scale=None):
    """Full softmax attention with q = qk, k = qk / |qk|, never attending to oneself unless there is
    nothing else (then the output is one's own value; zeros for a padded position)."""
    B, _, n, d = qk.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qk, v = _zero_padded(qk, mask), _zero_padded(v, mask)
    k = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True)).clamp_min(1e-300)
    allowed = allowed_matrix(n, n, B, causal, mask) & ~torch.eye(n, dtype=torch.bool)
    if mask is not None:  # a padded position attends nothing
        allowed = allowed & mask[:, None, :, None]
    logits = (qk @ k.transpose(-1, -2)) * scale
    shift = torch.where(allowed, logits, torch.full_like(logits, -1e300)).max(-1, keepdim=True).values
    sim = torch.exp(torch.where(allowed, logits - shift, torch.full_like(logits, -1e300)))
    out = weighted_average(sim, v, allowed)
    alone = ~allowed.any(-1, keepdim=True)
    return torch.where(alone, v, out)


def lsh_buckets(qk, rotations, n_buckets):
    """Angular LSH: argmax over the first n_buckets of [x R, -x R] for unit x; (B, H, R, N)."""
    k = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True)).clamp_min(1e-300)
    out = []
    for r in range(rotations.shape[1]):
        xr = k @ rotations[:, r, :]
        out.append(torch.cat([xr, -xr], -1)[..., :n_buckets].argmax(-1))
    return torch.stack(out, 2)


def lsh_attention_loops(qk, v, buckets, bucket_size, causal=False, mask=None, scale=None):
    """Reformer attention one query at a time: in round r, query i attends the real positions j != i
    of its bucket whose rank in the bucket (among real positions, by position) is in i's chunk or
    the chunk before (j < i too when causal); rounds combined by log-sum-exp. Slow: tiny inputs."""
    B, H, n, d = qk.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qk, v = _zero_padded(qk, mask), _zero_padded(v, mask)
    k = qk / torch.sqrt((qk * qk).sum(-1, keepdim=True)).clamp_min(1e-300)
    real = torch.ones(B, n, dtype=torch.bool) if mask is None else mask
    rows = []
    for b in range(B):
        for h in range(H):
            outs = []
            for i in range(n):
                if not real[b, i]:
                    outs.append(torch.zeros_like(v[b, h, i]))
                    continue
                round_out, round_lse = [], []
                for r in range(buckets.shape[2]):
                    hb = buckets[b, h, r]
                    members = [j for j in range(n) if real[b, j] and hb[j] == hb[i]]  # by position
                    rank = {j: t for t, j in enumerate(members)}
                    ci = rank[i] // bucket_size
                    keys = [j for j in members if j != i and rank[j] // bucket_size in (ci, ci - 1)
                            and (not causal or j < i)]
                    if not keys:
                        continue
                    logits = (k[b, h, keys] @ qk[b, h, i]) * scale
                    lse = torch.logsumexp(logits, 0)
                    round_out.append(torch.exp(logits - lse) @ v[b, h, keys])
                    round_lse.append(lse)
                if not round_out:
                    outs.append(v[b, h, i])
                    continue
                w = torch.softmax(torch.stack(round_lse), 0)
                outs.append((w[:, None] * torch.stack(round_out)).sum(0))
            rows.append(torch.stack(outs))
    return torch.stack(rows).view(B, H, n, -1)
