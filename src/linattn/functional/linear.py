"""Kernel ("linear") attention in bidirectional, causal and recurrent form, plus its reference.

Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv 2006.16236): with sim(q, k) = phi(q).phi(k),

    out_i = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T (F, Dv),   z = sum_j phi(k_j) (F,)

over all keys (bidirectional, O(N F Dv)) or over j <= i (causal). Causal attention is an RNN whose
state is (S, z); a call with Nq = 1 and a state is one generation step of cost O(F Dv).

Dimension legend: B batch, H heads, N/Nq/Nk positions, D query/key width, Dv value width,
F feature width, E = Dv + 1 (values with a column of ones appended, so one matmul produces the
numerator S and the normaliser z together), C chunk length, Nc number of chunks.

The causal form is chunked (as in the chunkwise forms of later linear-attention work): inside a chunk
the C x C masked score matrix is formed explicitly, across chunks a running state carries the sum.
It never builds the (N, F, E) prefix-sum tensor the plain cumsum form needs (30+ GB at N = 65536),
and it has its own backward that recomputes the intra-chunk scores instead of storing them.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import check_key_padding_mask, check_qkv, compute_dtype, no_autocast, sanitize_padded
from .feature_maps import FeatureMap, resolve_feature_map

__all__ = [
    "LinearAttentionState",
    "causal_linear_product",
    "linear_attention",
    "linear_attention_reference",
]

# Chunk length of the causal algorithm. Work is N*C*(F+E) inside chunks plus N*F*E across them,
# and storage N*C + N*F*E/C, so C near F balances the two. Timed for C in 32..256 at N = 16384,
# D = 64 on 2 CPU cores: 64 is among the fastest and keeps the causal peak memory lowest.
CAUSAL_CHUNK_SIZE = 64


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal kernel attention after some prefix of keys.

    Attributes:
        S: ``(B, H, F, Dv)`` sum of phi(k_j) v_j^T.
        z: ``(B, H, F)`` sum of phi(k_j).

        log_scale: ``(B, H)`` or None. When set, the sums are ``S * exp(log_scale)`` and
            ``z * exp(log_scale)``: kernels with exponential features (FAVOR+, ``favor.py``) keep
            their state divided by a running maximum so that it never overflows. None (the
            ``linear_attention`` case) means a scale of 1.

    All are float32 when the inputs are float16/bfloat16 (the sums must not lose precision),
    otherwise the input dtype.
    """

    S: Tensor
    z: Tensor
    log_scale: Tensor | None = None


# ---------------------------------------------------------------------------------------------
# The causal product o_i = a_i . (s0 + sum_{j<=i} kf_j w_j^T), chunked, with its own backward.
# ---------------------------------------------------------------------------------------------


def _chunked(x: Tensor, n_pad: int, C: int) -> Tensor:
    """``(B, H, N, X)`` -> ``(B*H*Nc, C, X)``, zero rows appended to fill the last chunk.

    Zero rows contribute nothing to any sum; outputs for them are cropped by the caller.
    """
    if n_pad:
        x = F.pad(x, (0, 0, 0, n_pad))
    return x.reshape(-1, C, x.shape[-1])


def _unchunk(x: Tensor, B: int, H: int, N: int) -> Tensor:
    """``(B*H*Nc, C, X)`` -> ``(B, H, N, X)``, dropping the fill rows."""
    out = x.reshape(B, H, -1, x.shape[-1])
    return out if out.shape[2] == N else out[:, :, :N]


# Memory note: with glibc's default malloc every large temporary is a fresh mmap whose pages fault
# in on first touch, which costs as much as the arithmetic here. Hence the in-place updates
# (baddbmm_, tril_, chunk loops writing into existing buffers) wherever autograd allows it.


def _chunk_states(kc: Tensor, wc: Tensor, s0: Tensor | None, BH: int) -> tuple[Tensor, Tensor]:
    """States before each chunk, ``s_excl[c] = s0 + sum_{c' < c} kc[c']^T wc[c']``, as
    ``(B*H*Nc, F, E)``, and the final state ``(B*H, F, E)``."""
    Fd, E = kc.shape[-1], wc.shape[-1]
    s_excl = torch.bmm(kc.transpose(1, 2), wc).view(BH, -1, Fd, E)  # each chunk's contribution
    s_final = s_excl[:, -1].clone()
    _exclusive_prefix_sum_(s_excl, s0)
    s_final += s_excl[:, -1]
    return s_excl.view(-1, Fd, E), s_final


class _CausalLinearProduct(torch.autograd.Function):
    # Memory plan (it is what keeps the causal peak below fast-transformers' C++ kernel): only the
    # inputs are saved. The C x C scores and the per-chunk states are rebuilt in backward, one at a
    # time, each freed before the next large buffer is made. Two extra bmm buy ~2*N*C floats.

    @staticmethod
    def forward(ctx, a: Tensor, kf: Tensor, w: Tensor, s0: Tensor | None, chunk_size: int):
        # Autocast would run these bmm in half precision and accumulate the state there; the
        # caller already chose the compute dtype (float32 for half inputs).
        with no_autocast(a.device.type):
            return _CausalLinearProduct._forward(ctx, a, kf, w, s0, chunk_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do: Tensor | None, ds_final: Tensor | None):
        with no_autocast(ctx.device_type):
            return _CausalLinearProduct._backward(ctx, do, ds_final)

    @staticmethod
    def _forward(ctx, a: Tensor, kf: Tensor, w: Tensor, s0: Tensor | None, chunk_size: int):
        ctx.device_type = a.device.type
        B, H, N, Fd = a.shape
        E = w.shape[-1]
        C = min(chunk_size, N)
        nc = -(-N // C)
        n_pad = nc * C - N
        ac, kc, wc = (_chunked(x, n_pad, C) for x in (a, kf, w))  # (B*H*Nc, C, F|F|E)
        s_excl, s_final = _chunk_states(kc, wc, s0, B * H)
        scores = torch.bmm(ac, kc.transpose(1, 2)).tril_()  # (B*H*Nc, C, C): j <= i in a chunk
        o = torch.bmm(ac, s_excl).baddbmm_(scores, wc)  # inter-chunk + intra-chunk, (.., C, E)
        ctx.save_for_backward(ac, kc, wc, s0)
        ctx.meta = (B, H, N)
        return _unchunk(o, B, H, N), s_final.view(B, H, Fd, E)

    @staticmethod
    def _backward(ctx, do: Tensor | None, ds_final: Tensor | None):
        ac, kc, wc, s0 = ctx.saved_tensors
        B, H, N = ctx.meta
        C, Fd = ac.shape[1], ac.shape[2]
        E = wc.shape[-1]
        nc = ac.shape[0] // (B * H)
        need_a, need_k, need_w, need_s0 = ctx.needs_input_grad[:4]
        need_g = need_k or need_w or need_s0  # the state gradients g feed dk, dw and ds0
        if do is None:
            do = ac.new_zeros(B, H, N, E)
        doc = _chunked(do, nc * C - N, C)  # (B*H*Nc, C, E)
        da = dk = dw = ds0 = None
        if need_g:
            # g[c] = d loss / d (kc[c]^T wc[c]): that contribution sits in the state of every
            # later chunk and in the final state. Start from d loss / d s_excl[c] = ac^T doc.
            g = torch.bmm(ac.transpose(1, 2), doc).view(B * H, nc, Fd, E)
            ds0 = _reverse_exclusive_prefix_sum_(g, ds_final).view(B, H, Fd, E)
            g = g.view(-1, Fd, E)
        if need_a or need_k:
            dscores = torch.bmm(doc, wc.transpose(1, 2)).tril_()  # (B*H*Nc, C, C)
        if need_k:
            dk = _unchunk(torch.bmm(wc, g.transpose(1, 2)).baddbmm_(dscores.transpose(1, 2), ac), B, H, N)
        if need_w:
            dw = torch.bmm(kc, g)
        if need_g:
            del g
        if need_w:
            scores = torch.bmm(ac, kc.transpose(1, 2)).tril_()
            dw = _unchunk(dw.baddbmm_(scores.transpose(1, 2), doc), B, H, N)
            del scores
        if need_a:
            da = torch.bmm(dscores, kc)
            del dscores
            s_excl, _ = _chunk_states(kc, wc, s0, B * H)
            da = _unchunk(da.baddbmm_(doc, s_excl.transpose(1, 2)), B, H, N)
        return da, dk, dw, ds0 if (s0 is not None and need_s0) else None, None


def _exclusive_prefix_sum_(x: Tensor, start: Tensor | None) -> None:
    """In place along dim 1 of ``x (BH, Nc, F, E)``: ``x[:, c] <- start + sum_{c' < c} x[:, c']``.

    A loop over chunks writing into the buffer it reads: as fast as torch.cumsum here and it
    allocates nothing (see the memory note above).
    """
    running, spare = x[:, 0].clone(), torch.empty_like(x[:, 0])
    if start is None:
        x[:, 0].zero_()
    else:
        x[:, 0].copy_(start.reshape(x[:, 0].shape))
    for c in range(1, x.shape[1]):
        spare.copy_(x[:, c])
        torch.add(x[:, c - 1], running, out=x[:, c])
        running, spare = spare, running


def _reverse_exclusive_prefix_sum_(x: Tensor, end: Tensor | None) -> Tensor:
    """In place along dim 1 of ``x (BH, Nc, F, E)``: ``x[:, c] <- end + sum_{c' > c} x[:, c']``.

    Returns ``end + sum_c x[:, c]`` (the gradient of an initial state that feeds every chunk).
    """
    last = x.shape[1] - 1
    running, spare = x[:, last].clone(), torch.empty_like(x[:, last])
    if end is None:
        x[:, last].zero_()
    else:
        x[:, last].copy_(end.reshape(x[:, last].shape))
    for c in range(last - 1, -1, -1):
        spare.copy_(x[:, c])
        torch.add(x[:, c + 1], running, out=x[:, c])
        running, spare = spare, running
    return x[:, 0] + running


def causal_linear_product(
    a: Tensor,
    kf: Tensor,
    w: Tensor,
    s0: Tensor | None = None,
    *,
    chunk_size: int = CAUSAL_CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """Causal prefix product ``o_i = a_i . (s0 + sum_{j <= i} kf_j w_j^T)`` in O(N) memory.

    The shared engine of every causal kernel attention (linear, FAVOR, ...). No normalisation:
    callers append a ones column to ``w`` to get the normaliser in the same pass.

    Args:
        a: ``(B, H, N, F)`` query features.
        kf: ``(B, H, N, F)`` key features.
        w: ``(B, H, N, E)`` values.
        s0: ``(B, H, F, E)`` state carried in from earlier positions, or None for zeros.
        chunk_size: chunk length C of the algorithm (any C >= 1 gives the same result).

    Returns:
        ``o (B, H, N, E)`` and the final state ``(B, H, F, E)``. Both are differentiable with
        respect to a, kf, w and s0 (once; no double backward).
    """
    fn = "causal_linear_product"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{fn}: chunk_size must be >= 1, got {chunk_size}")
    if a.dim() != 4 or a.shape != kf.shape:
        raise ValueError(f"{fn}: a and kf must both be (B, H, N, F), got a {tuple(a.shape)} and kf {tuple(kf.shape)}")
    if w.dim() != 4 or w.shape[:3] != a.shape[:3]:
        raise ValueError(f"{fn}: w must be (B, H, N, E) with the B, H, N of a {tuple(a.shape)}, got {tuple(w.shape)}")
    if not (a.dtype == kf.dtype == w.dtype):
        raise TypeError(f"{fn}: a, kf and w must share one dtype, got {a.dtype}, {kf.dtype}, {w.dtype}")
    B, H, _, Fd = a.shape
    if s0 is not None and (tuple(s0.shape) != (B, H, Fd, w.shape[-1]) or s0.dtype != a.dtype):
        raise ValueError(
            f"{fn}: s0 must be (B, H, F, E) = {(B, H, Fd, w.shape[-1])} of dtype {a.dtype}, "
            f"got {tuple(s0.shape)} {s0.dtype}"
        )
    if a.shape[2] == 0:
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E) zeros, attached to the graph
        s_final = s if s0 is None else s0 + s
        return a @ s_final, s_final
    return _CausalLinearProduct.apply(a, kf, w, s0, chunk_size)


# ---------------------------------------------------------------------------------------------
# linear_attention
# ---------------------------------------------------------------------------------------------


def _features(
    fn: str,
    feature_map: Union[str, FeatureMap],
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None,
    dt: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """phi(q) ``(B,H,Nq,F)`` and phi(k) ``(B,H,Nk,F)`` in dtype ``dt``, padded keys' features zeroed."""
    phi = resolve_feature_map(fn, feature_map)
    qf = phi(q.to(dt))
    kf = phi(sanitize_padded(k, key_padding_mask).to(dt))
    for name, x, f in (("q", q, qf), ("k", k, kf)):
        if not isinstance(f, Tensor) or f.dim() != 4 or f.shape[:3] != x.shape[:3]:
            got = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
            raise ValueError(
                f"{fn}: feature_map must map {name} {tuple(x.shape)} to (B, H, N, F) with the same "
                f"B, H, N; got {got}"
            )
    if qf.shape[-1] != kf.shape[-1]:
        raise ValueError(
            f"{fn}: feature_map gave different widths F for q {tuple(qf.shape)} and k {tuple(kf.shape)}"
        )
    if qf.dtype != dt or kf.dtype != dt:
        qf, kf = qf.to(dt), kf.to(dt)
    # phi(0) need not be 0 (elu + 1 gives 1): remove padded keys from the sums explicitly.
    kf = sanitize_padded(kf, key_padding_mask)
    return qf, kf


def _check_state(
    fn: str, state, B: int, H: int, Fd: int, Dv: int, device, *, scaled: bool = False
) -> None:
    """Validate a resumed state; ``scaled``: the mechanism keeps a log_scale (else it must be None)."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"{fn}: initial_state must be a LinearAttentionState (as returned with return_state=True), "
            f"got {type(state).__name__}"
        )
    checks = [("S", state.S, (B, H, Fd, Dv)), ("z", state.z, (B, H, Fd))]
    if state.log_scale is not None:
        if not scaled:
            raise ValueError(
                f"{fn}: initial_state.log_scale is set (a state of favor_attention?); this mechanism's "
                "states have log_scale None"
            )
        checks.append(("log_scale", state.log_scale, (B, H)))
    for name, t, shape in checks:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{fn}: initial_state.{name} must be a floating-point tensor")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{fn}: initial_state.{name} must have shape {shape} for these inputs "
                f"(B, H, F, Dv) = {(B, H, Fd, Dv)}, got {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{fn}: initial_state.{name} is on {t.device}, inputs on {device}")


def _check_state_args(fn: str, causal: bool, initial_state, return_state: bool) -> None:
    if not causal and (initial_state is not None or return_state):
        raise ValueError(
            f"{fn}: initial_state and return_state belong to the recurrent form and need causal=True"
        )


class _Normalise(torch.autograd.Function):
    """``o (..., Dv+1) -> o[..., :Dv] / o[..., Dv]`` with a zero normaliser replaced by 1.

    Its own backward writes the gradient of numerator and normaliser into one buffer instead of
    autograd's two zero-filled slice gradients (a measurable cost at long N on CPU).
    """

    @staticmethod
    def forward(ctx, o: Tensor, dv: int):
        den = o[..., dv:]  # (..., 1)
        inv = torch.where(den != 0, den, torch.ones_like(den)).reciprocal_()  # (..., 1)
        out = o[..., :dv] * inv
        ctx.save_for_backward(out, inv)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        out, inv = ctx.saved_tensors
        do = torch.empty(*out.shape[:-1], out.shape[-1] + 1, dtype=out.dtype, device=out.device)
        torch.mul(g, inv, out=do[..., :-1])
        # d out_e / d den = -out_e / den
        do[..., -1:] = torch.linalg.vecdot(g, out, dim=-1).unsqueeze(-1).mul_(inv).neg_()
        return do, None


def _normalise(o: Tensor, dv: int, out_dtype: torch.dtype) -> Tensor:
    """Split ``o (..., Dv+1)`` into numerator and normaliser and divide.

    A zero normaliser means no key with positive similarity (all padding, or disjoint relu
    supports); with non-negative features the numerator is then zero too, so dividing by 1
    returns zeros and keeps every gradient finite instead of producing 0/0.
    """
    return _Normalise.apply(o, dv).to(out_dtype)


def _state_from(s: Tensor, dv: int) -> LinearAttentionState:
    return LinearAttentionState(S=s[..., :dv], z=s[..., dv])


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Kernel attention ``out_i = phi(q_i) S / phi(q_i) z`` (Katharopoulos et al., arXiv 2006.16236).

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        feature_map: ``"elu"`` (elu+1), ``"relu"``, ``"cos"`` ([1, x/||x||], sim = 1 + cos),
            ``"softmax"`` (over features) or a callable ``(..., D) -> (..., F)`` with non-negative
            output.
        causal: sums over keys j <= i only (needs Nq == Nk). Chunked, O(N) memory.
        key_padding_mask: bool ``(B, Nk)``, True = a real key that may be attended, False = padding.
            Padded keys leave numerator and normaliser alike; their content (even NaN) never reaches
            an output or a real input's gradient.
        initial_state: causal only: the state after an earlier prefix, to resume from.
        return_state: causal only: also return the state after the last key.

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype, and with ``return_state`` a
        :class:`LinearAttentionState`. Sums are accumulated in float32 for half inputs. A query
        with no key of positive similarity gets zeros.
    """
    fn = "linear_attention"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    _check_state_args(fn, causal, initial_state, return_state)
    with no_autocast(q.device.type):
        return _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state)


def _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state):
    dt = compute_dtype(q.dtype)
    dv = v.shape[-1]
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, Nk, E): [v, 1]
    if not causal:
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E)
        return _normalise(qf @ s, dv, q.dtype)
    s0 = None
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        _check_state(fn, initial_state, B, H, Fd, dv, q.device)
        s0 = torch.cat([initial_state.S.to(dt), initial_state.z.to(dt)[..., None]], dim=-1)
    o, s_final = causal_linear_product(qf, kf, w, s0)
    out = _normalise(o, dv, q.dtype)
    if return_state:
        return out, _state_from(s_final, dv)
    return out


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Plain O(Nq*Nk) kernel attention from the formula: an explicit similarity matrix
    ``phi(q) phi(k)^T``, masked, each row normalised. Same contract as :func:`linear_attention`;
    tests trust this one, in float64."""
    fn = "linear_attention_reference"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    _check_state_args(fn, causal, initial_state, return_state)
    dt = compute_dtype(q.dtype)
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    sim = qf @ kf.transpose(-1, -2)  # (B, H, Nq, Nk)
    if causal:
        sim = sim.tril()
    num = sim @ v  # (B, H, Nq, Dv)
    den = sim.sum(-1, keepdim=True)  # (B, H, Nq, 1)
    S = kf.transpose(-1, -2) @ v  # (B, H, F, Dv)
    z = kf.sum(-2)  # (B, H, F)
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        _check_state(fn, initial_state, B, H, Fd, v.shape[-1], q.device)
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
        num = num + qf @ S0
        den = den + (qf @ z0[..., None])
        S, z = S + S0, z + z0
    out = (num / torch.where(den != 0, den, torch.ones_like(den))).to(q.dtype)
    if return_state:
        return out, LinearAttentionState(S=S, z=z)
    return out
