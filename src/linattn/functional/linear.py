"""Kernel ("linear") attention in bidirectional, causal and recurrent form, plus its reference.

Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv 2006.16236): with sim(q, k) = phi(q).phi(k),

    out_i = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T (F, Dv),   z = sum_j phi(k_j) (F,)

over all keys (bidirectional, O(N F Dv)) or over j <= i (causal). Causal attention is an RNN whose
state is (S, z); a call with Nq = 1 and a state is one generation step of cost O(F Dv).

Dimension legend: B batch, H heads, N/Nq/Nk positions, D query/key width, Dv value width,
F feature width, E = Dv + 1 (values with a column of ones appended, so one product gives the
numerator S and the normaliser z together; the causal attention keeps that column implicit),
C chunk length, Nc number of chunks, R rows (of the B*H sequences) in a tile.

The causal form is the no-gate specialisation of the decayed engine (``decayed.py``), chunked as in
the chunkwise forms of later linear-attention work: inside a chunk the C x C masked score matrix is
formed explicitly, across chunks a running state carries the sum. It never builds the (N, F, E)
prefix-sum tensor the plain cumsum form needs (30+ GB at N = 65536), its backward recomputes the
intra-chunk scores instead of storing them, and it runs tile by tile (a few thousand positions at a
time, the ``tile_positions`` knob) so that no temporary is larger than a tile. Causal
``linear_attention`` has normalisation and an elementwise feature map fused into the same pass.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_recurrent_args,
    compute_dtype,
    no_autocast,
    sanitize_padded,
    shape_str,
)
from .decayed import decayed_product
from .decayed_state import DecayedState
from .feature_maps import ELEMENTWISE_MAPS, FeatureMap, resolve_feature_map
from .gated import gated_linear_attention
from .recurrence import prefix_sums
from .strategy import check_strategy
from .sharding import ShardForm, ShardPart
from .normaliser import (
    divide_by_normaliser,
    divide_by_normaliser_,
    normalise,
    normaliser_floor,
)
from .varlen import check_cu_seqlens, segment_cumsum, segment_sum, varlen_layout

__all__ = [
    "LinearAttentionState",
    "causal_linear_product",
    "check_linear_state",
    "linear_attention",
    "linear_attention_reference",
]

# The causal form is the decayed engine's no-gate specialisation (decayed.py), where its two knobs,
# chunk_size and tile_positions, are described.


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


def causal_linear_product(
    a: Tensor,
    kf: Tensor,
    w: Tensor,
    s0: Tensor | None = None,
    *,
    chunk_size: int = 64,
    tile_positions: int = 4096,
    strategy: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Causal prefix product ``o_i = a_i . (s0 + sum_{j <= i} kf_j w_j^T)`` in O(N) memory.

    The shared engine of every causal kernel attention (linear, FAVOR, ...). No normalisation:
    callers append a ones column to ``w`` to get the normaliser in the same pass.

    Args:
        a: ``(B, H, N, F)`` query features.
        kf: ``(B, H, N, F)`` key features.
        w: ``(B, H, N, E)`` values.
        s0: ``(B, H, F, E)`` state carried in from earlier positions, or None for zeros.
        chunk_size: chunk length C of the algorithm (any C >= 1 gives the same result; 64 is
            among the fastest for the usual widths, see the comment at the top of this file).
        tile_positions: about how many positions the algorithm works on at a time (>= 1; any
            value gives the same result, smaller tiles keep temporaries small).
        strategy: ``"auto"`` (default: by the device), ``"cpu"`` (tiles of ``tile_positions``) or
            ``"accelerator"`` (one tile of the whole input: launches that do not grow with N); any
            choice gives the same result up to rounding (``linattn.functional.recurrence``).

    Returns:
        ``o (B, H, N, E)`` and the final state ``(B, H, F, E)``. Both are differentiable with
        respect to a, kf, w and s0 (once; no double backward).
    """
    fn = "causal_linear_product"
    check_positive_int(fn, "chunk_size", chunk_size)
    check_positive_int(fn, "tile_positions", tile_positions)
    check_strategy(fn, strategy)
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
    return decayed_product(a, kf, w, s0, chunk_size=chunk_size, tile_positions=tile_positions, strategy=strategy)


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


def check_linear_state(
    fn: str, state, B: int, H: int, Fd: int, Dv: int, device, *, scaled: bool = False
) -> None:
    """Validate a resumed :class:`LinearAttentionState` for inputs of batch B, H heads, feature
    width Fd and value width Dv on ``device``; ``scaled``: the mechanism keeps a log_scale (FAVOR+),
    else it must be None. Raises TypeError or ValueError naming the field and the shapes."""
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


def _state_from(s: Tensor, dv: int) -> LinearAttentionState:
    return LinearAttentionState(S=s[..., :dv], z=s[..., dv])


def _decoding_step(fn, q, k, v, feature_map, state, return_state, dt):
    """One position from ``state``: S += phi(k)^T v, z += phi(k), o = phi(q) S / phi(q) z.

    At decoding sizes every operation costs more in overhead than in arithmetic, so this counts
    operations: S and z stay apart (joining [S, z] and [v, 1] each step was a third of them), a
    named map computes phi(q) and phi(k) in one call (every named map acts on the last dimension
    alone), and the normaliser guard divides in place
    (:func:`~linattn.functional.normaliser.divide_by_normaliser_`). (Timings of these choices:
    docs/benchmarks/README.md, "History".)
    """
    if isinstance(feature_map, str):
        f = resolve_feature_map(fn, feature_map)(torch.stack([q, k]).to(dt))  # (2, B, H, 1, F)
        qf, kf = f[0], f[1]
    else:
        qf, kf = _features(fn, feature_map, q, k, None, dt)
    B, H, _, Fd = qf.shape
    check_linear_state(fn, state, B, H, Fd, v.shape[-1], q.device)
    S = torch.addcmul(state.S.to(dt), kf.transpose(-1, -2), v.to(dt))  # (B, H, F, Dv)
    z = state.z.to(dt) + kf[:, :, 0]  # (B, H, F)
    floor = normaliser_floor(qf, z[:, :, None])  # (B, H, 1, 1)
    out = divide_by_normaliser_(qf @ S, qf @ z[..., None], floor).to(q.dtype)
    return (out, LinearAttentionState(S=S, z=z)) if return_state else out


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
    chunk_size: int = 64,
    tile_positions: int | None = None,
    cu_seqlens: Tensor | None = None,
    strategy: str = "auto",
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
        chunk_size: causal only, a tuning knob: the chunk length C of the chunked algorithm (as
            in :func:`causal_linear_product`). Any C >= 1 gives the same result; a call of at most
            C positions is one chunk, computed directly.
        tile_positions: causal only, a tuning knob: about how many positions the chunked
            algorithm works on at a time (as in :func:`causal_linear_product`); any value >= 1
            gives the same result. None: 4096.
        cu_seqlens: causal only (ValueError with ``causal=False``). None, or integer (int32 or int64) ``(n + 1,)``
            offsets ``[0, c_1, ..., T]`` of n documents packed along N (non-decreasing; empty
            documents allowed), flash-attention's varlen convention. Then B must be 1 (inputs
            ``(1, H, T, *)``), no key is seen across a document boundary, and ``initial_state``
            and the returned state hold one state per document, ``S (n, H, F, Dv)``,
            ``z (n, H, F)``: the result equals one call per document (outputs, gradients,
            states). The numerator runs on :func:`~linattn.functional.gated.gated_linear_attention`'s
            path of the decayed engine (zero decays, a reset at each document's start; both knobs
            are passed on), the normaliser is a per-document running sum of the key features
            (``linattn.functional.varlen``), guarded as in every other form.
            The isolation holds for finite inputs; a NaN or inf can cross into the documents that
            share its chunk (and, through the normaliser's running sums, later ones): see
            ``linattn.functional.varlen``.
        strategy: causal only, how the chunked algorithm runs on the device (any choice gives the
            same result up to rounding): ``"cpu"``, tiles of ``tile_positions`` in cache;
            ``"accelerator"``, the whole input at once, so the number of kernel launches does not
            grow with N (``linattn.functional.recurrence``); ``"auto"`` (default), ``"cpu"`` on a
            CPU and ``"accelerator"`` on CUDA, MPS, XPU, ... With half inputs the accelerator's
            products take half operands (tensor cores) when no gradient will be taken; a forward
            that will be differentiated keeps float32 operands, which its backward's cancellations
            through the normaliser need (``linattn.functional.strategy``).

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype, and with ``return_state`` a
        :class:`LinearAttentionState`. Sums are accumulated in float32 for half inputs. A query
        with no key of positive similarity gets zeros.
    """
    fn = "linear_attention"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    check_recurrent_args(fn, causal, initial_state, return_state)
    check_positive_int(fn, "chunk_size", chunk_size)
    if tile_positions is not None:
        check_positive_int(fn, "tile_positions", tile_positions)
    check_strategy(fn, strategy)
    if cu_seqlens is not None:
        if not causal:
            raise ValueError(f"{fn}: cu_seqlens (packed documents) needs causal=True: the bidirectional form has "
                             "no packed variant")
        with no_autocast(q.device.type):
            return _linear_varlen(fn, q, k, v, feature_map, key_padding_mask, initial_state, return_state,
                                  chunk_size, 4096 if tile_positions is None else tile_positions, cu_seqlens, strategy)
    with no_autocast(q.device.type):
        return _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state,
                                 chunk_size, 4096 if tile_positions is None else tile_positions, strategy)


def _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state,
                      chunk_size, tile_positions, strategy="auto"):
    dt = compute_dtype(q.dtype)
    dv = v.shape[-1]
    if initial_state is not None and q.shape[2] == 1 and key_padding_mask is None:
        return _decoding_step(fn, q, k, v, feature_map, initial_state, return_state, dt)
    # Causal sequences longer than one chunk go to the tiled Function, which computes an
    # elementwise phi itself. One chunk or less (a generation step, a short prompt) is that
    # algorithm's intra-chunk product alone, written out below: there the tiled machinery's
    # hundred small ops would cost more than the arithmetic. So are inputs without a row
    # (B*H = 0), which have no tile to assemble a result from and cost nothing in any form.
    tiled = causal and q.shape[2] > chunk_size and q.shape[0] * q.shape[1] > 0
    fusable = isinstance(feature_map, str) and feature_map in ELEMENTWISE_MAPS and key_padding_mask is None
    if tiled and fusable:
        phi, qf, kf = ELEMENTWISE_MAPS[feature_map], q.to(dt), k.to(dt)
    else:
        phi, (qf, kf) = None, _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    if not causal:
        w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, Nk, E): [v, 1]
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E)
        return normalise(qf @ s, dv, q.dtype, normaliser_floor(qf, s[..., dv].unsqueeze(-2)))
    s0 = None
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        check_linear_state(fn, initial_state, B, H, Fd, dv, q.device)
        s0 = torch.cat([initial_state.S.to(dt), initial_state.z.to(dt)[..., None]], dim=-1)
    if tiled:
        # the features are kept for the backward only when a gradient will be taken, and not under
        # torch.compile: they live on the autograd context (the backward overwrites them), which a
        # compiled backward graph does not take as an input
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qf, kf, v, s0))
        keep = grad and not torch.compiler.is_compiling()
        name = "" if phi is None else feature_map
        # Half operands (the accelerator's, for half inputs) only without a gradient to take. Through
        # the normaliser, d out_i / d phi(q_i) is (S_i - z_i out_i^T) / d_i, a difference of terms up
        # to |mean v| / std v * sqrt(i) times larger; the backward forms S and z again in float32,
        # and an output from half operands did not cancel against them: bf16 q gradients 5-10x the
        # CPU strategy's error at N = 4096-16384 (docs/benchmarks/tensor_cores/gradients.md)
        out, s_final = decayed_product(qf, kf, v, s0, normalise=True, phi=name, keep=keep, chunk_size=chunk_size,
                                       tile_positions=tile_positions, strategy=strategy,
                                       input_dtype=dt if grad else q.dtype)
        out = out.to(q.dtype)
    else:  # o = tril(phi(q) phi(k)^T) [v, 1] + phi(q) s0, N <= C (N = 0 included)
        w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        o = (qf @ kf.transpose(-1, -2)).tril_() @ w
        s_final = kf.transpose(-1, -2) @ w
        z_seen = prefix_sums(kf.detach(), 2)  # (B, H, N, F): the normaliser state at each position
        if s0 is not None:
            o, s_final = o + qf @ s0, s_final + s0
            z_seen = z_seen + s0[..., dv].detach().unsqueeze(-2)
        out = normalise(o, dv, q.dtype, normaliser_floor(qf, z_seen))
    if return_state:
        return out, _state_from(s_final, dv)
    return out


def _linear_varlen(fn, q, k, v, feature_map, key_padding_mask, initial_state, return_state, chunk_size,
                   tile_positions, cu_seqlens, strategy="auto"):
    """Causal kernel attention of packed documents (``cu_seqlens``): ``q, k (1, H, T, D)``,
    ``v (1, H, T, Dv)`` -> ``(1, H, T, Dv)`` and, with ``return_state``, per-document states.

    The numerator ``phi(q_i) . S_i`` is gated_linear_attention's packed product with zero decays,
    the decayed engine's per-head log-decay path (the documents' starts are resets, which the no-gate
    specialisation's prefix sums cannot express), with the value width Dv as given (a ones column
    for the normaliser would make it Dv + 1, which slows the products); the normaliser ``phi(q_i) . z_i`` and the guard's ``z_i`` come from one
    per-document running sum of phi(k) (:func:`~linattn.functional.varlen.segment_cumsum`), a few
    elementwise passes; the division is :func:`~linattn.functional.normaliser.divide_by_normaliser`,
    the guard of every other form.
    """
    cu = check_cu_seqlens(fn, cu_seqlens, q)
    dt = compute_dtype(q.dtype)
    dv = v.shape[-1]
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)  # (1, H, T, F)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    n, H, Fd = cu.shape[0] - 1, qf.shape[1], qf.shape[-1]
    S0 = z0 = None
    if initial_state is not None:
        check_linear_state(fn, initial_state, n, H, Fd, dv, q.device)
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
    res = gated_linear_attention(qf, kf, v, qf.new_zeros(qf.shape[:3]), scale=1.0, cu_seqlens=cu,
                                 initial_state=None if S0 is None else DecayedState(S0),
                                 return_state=return_state, chunk_size=chunk_size, tile_positions=tile_positions,
                                 strategy=strategy)
    num, S = res if return_state else (res, None)
    lay = varlen_layout(cu, q.shape[2], Fd, write_states=False, read_states=False)
    z_seen = segment_cumsum(kf, lay, initial=z0)  # (1, H, T, F): the normaliser state each query sees
    den = torch.linalg.vecdot(qf, z_seen).unsqueeze(-1)  # (1, H, T, 1)
    out = divide_by_normaliser(num, den, normaliser_floor(qf, z_seen)).to(q.dtype)
    if return_state:
        return out, LinearAttentionState(S=S.s, z=segment_sum(kf, lay, initial=z0))
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
    check_recurrent_args(fn, causal, initial_state, return_state)
    dt = compute_dtype(q.dtype)
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    seen = torch.ones(q.shape[2], k.shape[2], dtype=dt, device=q.device)  # (Nq, Nk): key j visible to query i
    if causal:
        seen = seen.tril()
    sim = (qf @ kf.transpose(-1, -2)) * seen  # (B, H, Nq, Nk)
    num = sim @ v  # (B, H, Nq, Dv)
    den = sim.sum(-1, keepdim=True)  # (B, H, Nq, 1)
    z_seen = seen @ kf  # (B, H, Nq, F): the normaliser state each query sees
    S = kf.transpose(-1, -2) @ v  # (B, H, F, Dv)
    z = kf.sum(-2)  # (B, H, F)
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        check_linear_state(fn, initial_state, B, H, Fd, v.shape[-1], q.device)
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
        num = num + qf @ S0
        den = den + (qf @ z0[..., None])
        z_seen = z_seen + z0[:, :, None]
        S, z = S + S0, z + z0
    # the normaliser's magnitude is raised to its floor as in the fast forms (normaliser_floor)
    floor = normaliser_floor(qf, z_seen)
    den = torch.where(den.abs() >= floor, den, floor.copysign(den))
    out = (num / torch.where(den.abs() >= torch.finfo(dt).tiny, den, torch.ones_like(den))).to(q.dtype)
    if return_state:
        return out, LinearAttentionState(S=S, z=z)
    return out


# ---------------------------------------------------------------------------------------------
# Context parallelism: the state summary (functional/sharding.py)
# ---------------------------------------------------------------------------------------------


def _shard_summarize(fn: str, first: bool, initial_state, tensors: tuple, options: dict) -> ShardPart:
    """A shard's sums ``S = phi(k)^T v``, ``z = sum phi(k)`` (the transition is the identity)."""
    q, k, v = tensors
    options = {**options, "causal": True}
    if first:
        out, st = linear_attention(q, k, v, initial_state=initial_state, return_state=True, **options)
        S, z = st.S, st.z
    else:
        check_qkv(fn, q, k, v, causal=True)
        # the options are checked here too, by a call on no position: a later rank calls the
        # functional form only after the exchange, and a bad option must stop it before
        linear_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], **options)
        dt = compute_dtype(q.dtype)
        kf = resolve_feature_map(fn, options["feature_map"])(k.to(dt))  # (B, H, N, F)
        if not isinstance(kf, Tensor) or kf.dim() != 4 or kf.shape[:3] != k.shape[:3]:
            got = shape_str(kf) if isinstance(kf, Tensor) else type(kf).__name__
            raise ValueError(f"{fn}: feature_map must map k {shape_str(k)} to (B, H, N, F), got {got}")
        kf = kf.to(dt)
        out, S, z = None, kf.transpose(-1, -2) @ v.to(dt), kf.sum(2)  # (B, H, F, Dv), (B, H, F)
    B, H, Fd, Dv = S.shape
    return ShardPart([S, z], [B, H, q.shape[-1], Dv, Fd], out, (tensors, options))


def _shard_fold(state: list[Tensor] | None, summary: list[Tensor]) -> list[Tensor]:
    if state is None:
        return summary
    return [state[0] + summary[0], state[1] + summary[1]]


def _shard_finish(kept, state: list[Tensor]) -> Tensor:
    (q, k, v), options = kept
    return linear_attention(q, k, v, initial_state=LinearAttentionState(*state), **options)


SHARDING = ShardForm("linear_attention", ("B", "H", "D", "Dv", "F"), _shard_summarize, _shard_fold, _shard_finish,
                     lambda state: LinearAttentionState(*state), ("q", "k", "v"))
"""Causal linear attention over a sequence sharded along N: a shard's summary is its sums
``(phi(k)^T v, sum phi(k))``, ``B H F (Dv + 1)`` numbers; a later rank's output is a second call
from the state before its shard (the normaliser divides the output, so a correction added
afterwards could not be exact). Options: ``feature_map``, ``chunk_size``, ``tile_positions``."""
