"""Performer FAVOR+: random-feature softmax attention and generalised (ReLU) attention.

Choromanski et al. 2020, "Rethinking Attention with Performers" (arXiv 2009.14794). With a random
projection ``W (m, D)`` whose rows are Gaussian, and ``x' = x * scale^(1/2)``,

    positive:  phi(x) = exp(W x' - ||x'||^2 / 2) / sqrt(m)                      (F = m)
    trig:      phi(x) = exp(||x'||^2 / 2) [sin(W x'), cos(W x')] / sqrt(m)     (F = 2m)
    relu:      phi(x) = relu(W x) / sqrt(m)                                     (F = m)

The first two are unbiased estimators of the softmax kernel, E[phi(q) . phi(k)] = exp(scale q.k),
so attention with them tends to ``softmax_attention(q, k, v, scale=scale)`` as m grows; positive
features have no sign problem and a small error where the kernel is small (the paper's Lemma 2).
Orthogonal rows (``favor_projection``) lower the variance further. ``relu`` is the paper's
generalised attention with kernel relu(W q) . relu(W k); it is homogeneous, so ``scale`` has no
effect on its output.

Attention is then kernel attention with these features (``linear.py``): O(N m Dv), and causal
attention is an RNN with state (S, z) of width F.

Stabiliser. exp(W x' - ||x'||^2/2) overflows or underflows in float32 for moderate inputs. Every
factor that is common to all keys a query sees cancels between the numerator and the normaliser,
so:
- each query's features are divided by their own maximum (a per-query factor);
- each key's features are divided by ``e^{m_j}``, where ``m_j`` is the running maximum, over the
  real keys up to j, of the keys' log-magnitudes ``c_j = max_r (W k'_j)_r - ||k'_j||^2/2``
  (trig: ``||k'_j||^2/2``). Causal and recurrent forms carry the state at that running scale,
  so the stabiliser of position i depends on no later position and every exponent is <= 0.
  Rescaling the state from ``m_{i-1}`` to ``m_i`` is the per-head decay ``e^{m_{i-1} - m_i} <= 1``:
  the decayed engine (``decayed.py``) runs it as its running-scale specialisation, whose exponents
  are differences of the given ``m`` (docs/design/one_engine.md); packed documents (``cu_seqlens``)
  take its log-decay path, which has the resets they need.
  performer-pytorch takes one maximum over the whole sequence instead, which lets a future key
  push earlier features into underflow. The bidirectional form uses the maximum over
  all real keys (there is no future to leak).
The stabiliser receives no gradient: it cancels exactly in the normalised output.

Where the estimate breaks down. The stabiliser keeps every feature <= 1 and the largest at 1,
but it cannot widen float's range below: at large inputs (``||x'|| ~ 100`` per head) each
query's and key's features are nearly one-hot, every other entry below e^-103 (float32) and so
exactly 0. A query whose top feature is among no visible key's top features then gets numerator
and normaliser 0, and returns zeros (95% of the rows of a (1, 8, 256, 64) input scaled by 100 in
float32, 0.6% in float64). That is the estimator, not the arithmetic: the variance of positive
random features grows like ``exp(||q'||^2 + ||k'||^2)`` (arXiv 2009.14794, Lemma 2), so at such
scales it carries almost no information whatever the precision. The normaliser floor
(``_positive_floor``) keeps the gradients of these rows finite.

Dimension legend as in ``checks.py``; m = ``num_features``, F = feature width (m or 2m), E = Dv + 1.
"""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_recurrent_args,
    check_scale,
    compute_dtype,
    finite_max,
    no_autocast,
    sanitize_padded,
)
from .decayed_state import DecayedState
from .decayed import decayed_product
from .strategy import check_strategy, resolve_strategy
from .gated import gated_linear_attention
from .linear import LinearAttentionState, causal_linear_product, check_linear_state
from .normaliser import divide_by_normaliser_, normalise, normaliser_floor
from .recurrence import prefix_sums
from .sharding import ShardForm, ShardPart
from .varlen import VarlenLayout, check_cu_seqlens, segment_cumsum, varlen_layout

__all__ = [
    "FAVOR_FEATURES",
    "FAVOR_KERNELS",
    "TRIG_NORMALISER_FLOOR",
    "favor_attention",
    "favor_attention_reference",
    "favor_features",
    "favor_projection",
]

FAVOR_KERNELS = ("softmax", "relu")
FAVOR_FEATURES = ("positive", "trig")

# Trig features estimate the kernel by sums of cosines, so a normaliser estimate can be ~0 or
# negative although the true one is positive. After stabilisation the heaviest key a query sees has
# weight 1 and every |phi(q).phi(k)| <= that weight, so the normaliser is clamped below at this
# fraction of the heaviest key's weight: |out_i| <= sum_j |v_j| / floor, always finite. Like the
# stabiliser, the floor is a guard held constant under differentiation.
TRIG_NORMALISER_FLOOR = 1e-3


def favor_projection(
    num_features: int,
    head_dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """A ``(num_features, head_dim)`` random projection for FAVOR+.

    Orthogonal (default): blocks of ``head_dim`` rows, each block an orthonormal basis drawn
    uniformly (QR of a Gaussian matrix with the sign of R's diagonal fixed), every row then scaled by
    an independent chi(head_dim) norm (the norm of a Gaussian vector), so each row is marginally
    N(0, I) and rows within a block are exactly orthogonal. The last block is cut to fit.
    ``orthogonal=False``: i.i.d. N(0, 1) entries.

    Drawn on the CPU in float64 from ``generator`` and then cast, so one generator state gives the
    same matrix (up to rounding) for every dtype and device.
    """
    fn = "favor_projection"
    for name, val in (("num_features", num_features), ("head_dim", head_dim)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {val!r}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"{fn}: generator must be a CPU torch.Generator, got one on {generator.device}")
    m, d = num_features, head_dim
    f64 = torch.float64
    if orthogonal:
        gauss = torch.randn(-(-m // d), d, d, generator=generator, dtype=f64)  # (blocks, d, d)
        q, r = torch.linalg.qr(gauss)
        sign = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(f64)  # (blocks, d)
        rows = (q * sign[:, None, :]).transpose(1, 2)  # orthonormal rows, Haar-distributed per block
        norms = torch.randn(m, d, generator=generator, dtype=f64).norm(dim=1, keepdim=True)  # chi(d)
        w = rows.reshape(-1, d)[:m] * norms
    else:
        w = torch.randn(m, d, generator=generator, dtype=f64)
    return w.to(dtype=dtype or torch.get_default_dtype(), device=device)


class _ExpFeatures(torch.autograd.Function):
    """``f = exp(u - shift) * c`` for ``u (..., m)``, ``shift (..., 1)``, in one buffer.

    Autograd would keep three (B, H, N, m) temporaries alive for this line; these are the
    largest tensors of FAVOR+, and on CPU each fresh one costs page faults as well as memory.
    The result overwrites ``u``: callers pass the projection ``x W^T`` and read nothing else
    from it afterwards, and its matmul keeps x and W (not u) for backward.
    Backward: ``du = g * f`` and ``dshift = -sum_m du``.
    """

    @staticmethod
    def forward(ctx, u: Tensor, shift: Tensor, c: float) -> Tensor:
        f = u.sub_(shift - math.log(c)).exp_()  # c folded into the (..., 1) shift: one pass fewer
        ctx.mark_dirty(u)
        ctx.save_for_backward(f)
        return f

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (f,) = ctx.saved_tensors
        # g is the fresh gradient from the one consumer of f (the causal product or a matmul):
        # scaled in place, one (..., m) buffer fewer. Broadcast or shared gradients are not.
        du = g.mul_(f) if g.is_contiguous() and g.shape == f.shape else g * f
        dshift = du.sum(-1, keepdim=True).neg_() if ctx.needs_input_grad[1] else None
        return du, dshift, None


def _exp_features(u: Tensor, shift: Tensor, c: float) -> Tensor:
    """:class:`_ExpFeatures` (overwriting ``u``); without a graph to build (decoding) the same
    arithmetic without the Function, whose per-call cost shows at decoding sizes and whose
    ``mark_dirty`` torch.compile cannot trace."""
    if torch.compiler.is_compiling():  # the compiler fuses the expression itself; it cannot trace mark_dirty
        return torch.exp(u - (shift - math.log(c)))
    if torch.is_grad_enabled() and (u.requires_grad or shift.requires_grad):
        return _ExpFeatures.apply(u, shift, c)
    return u.sub_(shift - math.log(c)).exp_()


def _check_kind(fn: str, kernel: str, features: str) -> None:
    if kernel not in FAVOR_KERNELS:
        raise ValueError(f"{fn}: unknown kernel {kernel!r}; known: {list(FAVOR_KERNELS)}")
    if features not in FAVOR_FEATURES:
        raise ValueError(f"{fn}: unknown features {features!r}; known: {list(FAVOR_FEATURES)}")
    if kernel == "relu" and features != "positive":
        raise ValueError(
            f"{fn}: features={features!r} applies to kernel='softmax' only; kernel='relu' has one "
            "feature map, relu(W x) (leave features='positive')"
        )


def _check_projection(fn: str, projection, q: Tensor) -> None:
    if not isinstance(projection, Tensor) or not projection.is_floating_point():
        got = projection.dtype if isinstance(projection, Tensor) else type(projection).__name__
        raise TypeError(f"{fn}: projection must be a floating-point tensor (m, D), got {got}")
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1] or projection.shape[0] < 1:
        raise ValueError(
            f"{fn}: projection must have shape (m, D) with D = {q.shape[-1]} (the last dim of q "
            f"{tuple(q.shape)}) and m >= 1, got {tuple(projection.shape)}"
        )
    if projection.device != q.device:
        raise ValueError(f"{fn}: projection is on {projection.device}, q on {q.device}")


def favor_features(
    x: Tensor,
    projection: Tensor,
    *,
    kernel: str = "softmax",
    features: str = "positive",
    scale: float | None = None,
) -> Tensor:
    """The unstabilised feature map phi(x) ``(..., F)`` of ``x (..., D)`` (formulas at the top).

    Plain and direct: for inspection, for the reference form and for tests. It overflows where the
    attention functions do not (they never form it).
    """
    fn = "favor_features"
    _check_kind(fn, kernel, features)
    m = projection.shape[0]
    if kernel == "relu":
        return torch.relu(x @ projection.T) / math.sqrt(m)
    xs = x * check_scale(fn, scale, x.shape[-1]) ** 0.5
    u = xs @ projection.T  # (..., m)
    half_sq = xs.square().sum(-1, keepdim=True) / 2  # (..., 1)
    if features == "positive":
        return torch.exp(u - half_sq) / math.sqrt(m)
    return torch.exp(half_sq) * torch.cat([torch.sin(u), torch.cos(u)], dim=-1) / math.sqrt(m)


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    kernel: str = "softmax",
    features: str = "positive",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = 64,
    tile_entries: int = 1 << 20,
    cu_seqlens: Tensor | None = None,
    strategy: str = "auto",
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """FAVOR+ attention: kernel attention with the random features of ``projection``.

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        projection: ``(m, D)`` random projection, e.g. :func:`favor_projection`. Shared by all
            heads; cast to the compute dtype.
        kernel: ``"softmax"`` (estimates exp(scale q.k)) or ``"relu"`` (generalised attention).
        features: for the softmax kernel, ``"positive"`` (FAVOR+, F = m) or ``"trig"``
            (sin/cos, F = 2m). The trig normaliser estimate can be <= 0; it is clamped below at
            ``TRIG_NORMALISER_FLOOR`` times the weight of the heaviest key the query sees, so the
            output stays finite (and is unreliable for such rows, as the estimator is).
        causal: sums over keys j <= i only (needs Nq == Nk). Chunked, O(N) memory.
        key_padding_mask: bool ``(B, Nk)``, True = a real key that may be attended, False =
            padding. Padded keys leave numerator, normaliser and stabiliser alike.
        scale: logit scale of the softmax kernel; None means ``1/sqrt(D)`` as in
            ``softmax_attention``. No effect with ``kernel="relu"``.
        initial_state: causal only: the state after an earlier prefix, to resume from.
        return_state: causal only: also return the state after the last key. Its ``S`` and
            ``z`` are ``sum_j phi(k_j) v_j^T`` and ``sum_j phi(k_j)`` divided by
            ``exp(log_scale)``.
        chunk_size: causal only, a tuning knob: the chunk length C of the chunked causal product
            (the decayed engine's, ``linattn.functional.decayed``). Any C >= 1 gives the same
            result up to rounding.
        tile_entries: a tuning knob: about how many (position, feature) entries of the feature
            tensors one tile holds (>= 1). Larger calls run tile by tile, a few sequences or heads
            at a time and, causal, blocks of positions that resume from the previous block's
            state; any value gives the same result up to rounding.
        cu_seqlens: causal only (ValueError otherwise). None, or integer (int32 or int64) ``(n + 1,)`` offsets
            ``[0, c_1, ..., N]`` of n documents packed along N (batch size 1; see
            :mod:`linattn.functional.varlen`): every document is computed as if alone (its own
            running scale, no key of another document), in one chunked run whose cost grows with
            N. ``initial_state`` / ``return_state`` then hold one state per document (batch n).
            The call is not cut into tiles.
        strategy: causal only, how the chunked product runs on the device (any choice gives the
            same result up to rounding): ``"cpu"``, tiles of ``tile_entries`` and a sequential
            recurrence across chunks; ``"accelerator"``, the whole input at once and the chunk
            states as a log-depth scan, so the number of kernel launches does not grow with N
            (``linattn.functional.recurrence``); ``"auto"`` (default), ``"cpu"`` on a CPU and
            ``"accelerator"`` on CUDA, MPS, XPU, ...

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype, and with ``return_state`` a
        :class:`LinearAttentionState` of width F. Sums are float32 for half inputs. A query with
        no real key gets zeros.
    """
    fn = "favor_attention"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    check_recurrent_args(fn, causal, initial_state, return_state)
    _check_kind(fn, kernel, features)
    _check_projection(fn, projection, q)
    scale = check_scale(fn, scale, q.shape[-1])
    check_positive_int(fn, "chunk_size", chunk_size)
    check_positive_int(fn, "tile_entries", tile_entries)
    check_strategy(fn, strategy)
    strategy = resolve_strategy(strategy, q.device)
    if strategy == "accelerator":  # one piece: every product over the whole input
        tile_entries = max(tile_entries, q.shape[0] * q.shape[1] * max(q.shape[2], k.shape[2], 1)
                           * projection.shape[0] * 2)
    if cu_seqlens is not None:
        if not causal:
            raise ValueError(f"{fn}: cu_seqlens (packed documents) needs causal=True")
        cu_seqlens = check_cu_seqlens(fn, cu_seqlens, q)  # int64
        with no_autocast(q.device.type):
            return _favor(fn, q, k, v, projection, kernel, features, True, key_padding_mask, scale, initial_state,
                          return_state, chunk_size, cu_seqlens, strategy)
    with no_autocast(q.device.type):
        return _tiled(fn, q, k, v, projection, kernel, features, causal, key_padding_mask, scale,
                      initial_state, return_state, chunk_size, tile_entries, strategy)


# Why tiles (the tile_entries knob): FAVOR's feature tensors are (B, H, N, F) with F in the
# hundreds: at B = 1, H = 8, N = 4096, m = 256 each is 32 MiB, the size from which glibc's malloc
# maps fresh pages for every new temporary (and faults them in again on every call). Working on
# tiles of about tile_entries (position, feature) entries - a few sequences at a time and, in
# causal form, blocks of positions that carry the recurrent state from one to the next - keeps
# every temporary small enough to be recycled. The default, 2^20 (tiles of one head at that size,
# 4 MiB features), was timed against one piece (docs/benchmarks/README.md, "History"). Tests pass
# small values to exercise many tiles at small sizes.


def _tiled(fn, q, k, v, projection, kernel, features, causal, mask, scale, initial_state, return_state,
           chunk_size, tile_entries, strategy="auto"):
    """Run :func:`_favor` tile by tile (about ``tile_entries`` entries each) and join the results.

    Tiles are groups of whole batch rows when a batch row fits, else groups of heads of one batch
    row; causal tiles are further cut into blocks of positions, each resuming from the state of
    the block before (the split-and-resume property, so the result is the same as in one piece).

    Each input is cut by one ``split`` (of its batch dim, or of its flattened batch*head dim):
    autograd then joins each input's gradient in one ``cat``. Indexing would give every piece a
    zero-filled gradient of the whole input, and nested cuts (rows, then heads, then blocks) one
    more full copy per level, a measurable share of FAVOR's forward+backward at long N.
    """
    B, H, nq, _ = q.shape
    nk = k.shape[2]
    Fd = projection.shape[0] * (2 if features == "trig" else 1)
    per_head = max(nq, nk, 1) * Fd
    per_batch = per_head * H
    if per_batch * B <= tile_entries or max(nq, nk) == 0:
        return _favor(fn, q, k, v, projection, kernel, features, causal, mask, scale, initial_state, return_state,
                      chunk_size, strategy=strategy)
    fields = None
    if initial_state is not None:
        log_scale = initial_state.log_scale
        if log_scale is None:  # read as 0
            log_scale = initial_state.z.new_zeros(initial_state.z.shape[:2])
        fields = (initial_state.S, initial_state.z, log_scale)
    by_rows = per_batch <= tile_entries
    if by_rows:  # groups of `step` batch rows: (b, H, ...)
        step = tile_entries // per_batch
        tiles = list(zip(*(x.split(step, dim=0) for x in (q, k, v))))
        masks = [None] * len(tiles) if mask is None else list(mask.split(step, dim=0))
        states = [None] * len(tiles) if fields is None else list(zip(*(f.split(step, dim=0) for f in fields)))
    else:  # per batch row, groups of `step` heads (the last one smaller): (1, h, ...)
        step = max(1, tile_entries // per_head)
        sizes = [min(step, H - h) for h in range(0, H, step)]
        rows = [b for b in range(B) for _ in sizes]

        def cut(x: Tensor) -> list[Tensor]:
            return [t[None] for t in x.flatten(0, 1).split(sizes * B, dim=0)]

        tiles = list(zip(cut(q), cut(k), cut(v)))
        masks = [None if mask is None else mask[b : b + 1] for b in rows]
        states = [None] * len(tiles) if fields is None else list(zip(*(cut(f) for f in fields)))
    block = max(64, tile_entries // Fd // 64 * 64) if causal else max(nq, 1)
    outs, finals = [], []
    for (qt, kt, vt), mt, st in zip(tiles, masks, states):
        st = None if st is None else LinearAttentionState(*st)
        if not causal:
            outs.append(_favor(fn, qt, kt, vt, projection, kernel, features, False, mt, scale, None, False,
                               chunk_size))
            continue
        if nq <= block:  # one block: no cut (a one-piece split still copies its gradient)
            parts = [(qt, kt, vt, mt)]
        else:
            parts = zip(qt.split(block, dim=2), kt.split(block, dim=2), vt.split(block, dim=2),
                        [None] * -(-nq // block) if mt is None else mt.split(block, dim=1))
        pieces = []
        for qp, kp, vp, mp in parts:
            o, st = _favor(fn, qp, kp, vp, projection, kernel, features, True, mp, scale, st, True, chunk_size,
                           strategy=strategy)
            pieces.append(o)
        outs.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
        finals.append(st)

    def join(parts: list[Tensor]) -> Tensor:
        """Per-tile pieces ``(b, H, ...)`` or ``(1, h, ...)`` -> ``(B, H, ...)``."""
        if by_rows:
            return torch.cat(parts, dim=0)
        return torch.cat([p[0] for p in parts], dim=0).unflatten(0, (B, H))

    out = join(outs)
    if not return_state:
        return out
    return out, LinearAttentionState(*(join([st[f] for st in finals]) for f in range(3)))


def _favor(fn, q, k, v, projection, kernel, features, causal, mask, scale, initial_state, return_state,
           chunk_size, cu_seqlens=None, strategy="auto"):
    dt, out_dtype = compute_dtype(q.dtype), q.dtype
    B, H, nq, _ = q.shape
    dv = v.shape[-1]
    W = projection.to(dt)
    m = W.shape[0]
    Fd = 2 * m if features == "trig" else m
    inv_root_m = 1.0 / math.sqrt(m)
    q = q.to(dt)
    k = sanitize_padded(k, mask).to(dt)
    v = sanitize_padded(v, mask).to(dt)
    w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, Nk, E): [v, 1]
    real = None if mask is None else mask[:, None, :]  # (B, 1, Nk)

    lay = None
    if cu_seqlens is not None:
        lay = varlen_layout(cu_seqlens, k.shape[2], 0, write_states=False, read_states=False)
    n_states = B if lay is None else lay.n  # one state per document when packed
    s0 = log_scale0 = None
    if initial_state is not None:
        check_linear_state(fn, initial_state, n_states, H, Fd, dv, q.device, scaled=True)
        if (causal and nq == 1 and mask is None and kernel == "softmax" and features == "positive"
                and initial_state.log_scale is not None and lay is None):
            return _decoding_step(q, k, v, W, scale, initial_state, return_state, out_dtype)
        s0 = torch.cat([initial_state.S.to(dt), initial_state.z.to(dt)[..., None]], dim=-1)
        if initial_state.log_scale is not None:
            log_scale0 = initial_state.log_scale.to(dt).detach()

    if kernel == "relu":
        Wm = W * inv_root_m  # relu is homogeneous: fold 1/sqrt(m) into the projection
        qf = torch.relu(q @ Wm.T)  # (B, H, Nq, m)
        kf = torch.relu(k @ Wm.T)  # (B, H, Nk, m); padded keys are 0 -> relu(0) = 0
        if not causal:
            s = kf.transpose(-1, -2) @ w  # (B, H, m, E)
            return _finish(qf @ s, dv, features, out_dtype, normaliser_floor(qf, s[..., dv].unsqueeze(-2)))
        if s0 is not None and log_scale0 is not None:
            s0 = s0 * torch.exp(log_scale0)[..., None, None]
        if lay is None:
            o, s_final = causal_linear_product(qf, kf, w, s0, chunk_size=chunk_size, strategy=strategy)
            z_seen = prefix_sums(kf.detach(), 2)  # (B, H, N, m): the normaliser state at each position
            if s0 is not None:
                z_seen = z_seen + s0[..., dv].detach().unsqueeze(-2)
        else:  # packed: the gated engine, no decay, reset at every document (varlen.py)
            o, st = gated_linear_attention(qf, kf, w, qf.new_zeros(qf.shape[:3]), scale=1.0, cu_seqlens=cu_seqlens,
                                           initial_state=None if s0 is None else DecayedState(s0),
                                           return_state=True, chunk_size=chunk_size, strategy=strategy)
            s_final = st.s
            z_seen = segment_cumsum(kf.detach(), lay, initial=None if s0 is None else s0[..., dv].detach())
        out = _finish(o, dv, features, out_dtype, normaliser_floor(qf, z_seen))
        if return_state:
            return out, _state(s_final, dv, torch.zeros(n_states, H, dtype=dt, device=q.device))
        return out

    uq, uk, half_sq = _projections(q, k, W, scale)
    if features == "positive":
        # Per-query stabiliser: exp(u - max u) cancels with the dropped exp(-||q'||^2/2).
        qf = _exp_features(uq, uq.amax(-1, keepdim=True).detach(), inv_root_m)
        c = uk.amax(-1) - half_sq[..., 0]  # (B, H, Nk): each key's log-magnitude
    else:
        # exp(||q'||^2/2) is a per-query factor: dropped, it cancels.
        qf = torch.cat([torch.sin(uq), torch.cos(uq)], dim=-1) * inv_root_m  # (B, H, Nq, 2m)
        c = half_sq[..., 0]
    c = c.detach()
    if real is not None:
        c = c.masked_fill(~real, float("-inf"))

    def key_features(log_scale: Tensor) -> Tensor:
        """Key features divided by ``e^{log_scale (B, H, Nk)}``; every exponent <= 0 and padded
        keys get exp(-inf) = 0 (by masking the exponent, so no inf * 0 in backward)."""
        if features == "positive":
            shift = half_sq + log_scale[..., None]  # (B, H, Nk, 1), differentiable through half_sq
            if real is not None:
                shift = shift.masked_fill(~real[..., None], float("inf"))
            return _exp_features(uk, shift, inv_root_m)  # (B, H, Nk, m)
        expo = half_sq - log_scale[..., None]
        if real is not None:
            expo = expo.masked_fill(~real[..., None], float("-inf"))
        mag = torch.exp(expo) * inv_root_m  # (B, H, Nk, 1)
        return torch.cat([torch.sin(uk), torch.cos(uk)], dim=-1) * mag  # (B, H, Nk, 2m)

    if not causal:
        top = c.amax(-1) if c.shape[-1] else c.new_zeros(B, H)  # (B, H)
        top = torch.where(torch.isfinite(top), top, 0.0)  # no real key: any finite scale
        kf = key_features(top[..., None].expand_as(c))
        o = qf @ (kf.transpose(-1, -2) @ w)  # (B, H, Nq, E)
        return _finish(o, dv, features, out_dtype, _positive_floor(m, dt))

    if lay is not None:
        return _packed_softmax_kernel(qf, c, w, key_features, s0, log_scale0, lay, cu_seqlens, dv, features,
                                      out_dtype, _positive_floor(m, dt), chunk_size, return_state, strategy)

    # Causal: the running maximum, from the carried state's scale onwards.
    run = torch.cummax(c, dim=-1).values if c.shape[-1] else c  # (B, H, N)
    if log_scale0 is not None:
        run = torch.maximum(run, log_scale0[..., None])
    # Positions before any real key (and no state) hold zero sums: any finite scale below every
    # later one serves; the lowest finite value keeps the sequence non-decreasing.
    run = torch.where(torch.isfinite(run), run, torch.finfo(dt).min)
    kf = key_features(run)
    if s0 is not None and log_scale0 is not None and run.shape[-1]:
        s0 = s0 * torch.exp(log_scale0 - run[..., 0])[..., None, None]  # to the scale of position 0
    if run.shape[-1] <= 1 or run.numel() == 0:
        # one decoding step, or no position or row: the product in closed form, not a 64-row chunk
        s_final = kf.transpose(-1, -2) @ w  # (B, H, F, E), at the scale of the last position
        if s0 is not None:
            s_final = s_final + s0
        o = qf @ s_final  # (B, H, 1, E)
    else:
        o, s_final = decayed_product(qf, kf, w, s0, running_log_scale=run, chunk_size=chunk_size, strategy=strategy,
                                     input_dtype=out_dtype)
    out = _finish(o, dv, features, out_dtype, _positive_floor(m, dt))
    if not return_state:
        return out
    if run.shape[-1]:
        final_scale = run[..., -1]
    else:
        final_scale = log_scale0 if log_scale0 is not None else torch.zeros(B, H, dtype=dt, device=q.device)
    return out, _state(s_final, dv, final_scale)


def _document_major_key(doc: Tensor, c: Tensor) -> Tensor:
    """``(1, H, T)`` keys ordered by document first, then by ``c (1, H, T)`` (-inf allowed, no NaN):
    their cumulative maximum's positions are each document's running arg-max of c.

    For float32 c (the compute dtype of float32 and half inputs) an exact integer key, without
    float64 or a host read: c's bits mapped to an unsigned order-preserving 32-bit integer (a
    negative float's bits flipped whole, a positive one's sign bit set), below the document index
    shifted by 32 bits, in int64. For float64 c (float64 inputs) the key is float64 too:
    ``doc * spread + c`` with ``spread`` wider than c's range (read from the host)."""
    if c.dtype == torch.float32:
        u = c.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the bits, unsigned
        order = torch.where(u >= 0x80000000, 0xFFFFFFFF - u, u + 0x80000000)  # monotone in c
        return (doc.to(torch.int64) << 32) + order
    finite = torch.isfinite(c)
    span = (c[finite].max() - c[finite].min()).item() if bool(finite.any()) else 0.0
    return doc.to(torch.float64) * (2.0 * span + 1.0) + c.to(torch.float64)  # -inf stays -inf


def _packed_softmax_kernel(qf, c, w, key_features, s0, log_scale0, lay: VarlenLayout, cu_seqlens, dv, features,
                           out_dtype, floor, chunk_size, return_state, strategy="auto"):
    """The causal softmax-kernel path of packed documents: ``qf (1, H, T, F)``, key log-magnitudes
    ``c (1, H, T)`` (-inf at padding), ``w (1, H, T, E)``, ``key_features(run) -> kf``, per-document
    ``s0 (n, H, F, E)`` and ``log_scale0 (n, H)`` (or None) -> the output and, with
    ``return_state``, the per-document states.

    Every document gets its own running maximum, exactly as alone: a cumulative maximum of a key
    ordered by document, then by c (:func:`_document_major_key`), over the packed sequence (so that
    a later document's keys outrank every earlier one's) whose arg-max positions are then
    read back in c itself, so the scale is a key's own log-magnitude, never a rounded sum; an
    arg-max in an earlier document means the document has no real key yet. The rescale between
    consecutive positions of a document is its log decay (0 at a document's start, where the state
    is reset, its initial state first brought to the scale of its first position).
    """
    doc = lay.doc  # (T,)
    arg = torch.cummax(_document_major_key(doc, c), dim=-1).indices  # (1, H, T)
    run = torch.where(doc[arg] == doc, c.gather(-1, arg), c.new_full((), float("-inf")))
    if log_scale0 is not None:
        run = torch.maximum(run, log_scale0.t()[None].index_select(2, doc))  # (1, H, T)
    run = torch.where(torch.isfinite(run), run, torch.finfo(run.dtype).min)
    kf = key_features(run)
    starts = lay.starts  # (n,)
    nonempty = cu_seqlens[1:] > starts  # (n,)
    if s0 is not None and log_scale0 is not None:
        first = run[0].index_select(1, starts.clamp(max=max(lay.T - 1, 0))).t() if lay.T else log_scale0  # (n, H)
        first = torch.where(nonempty[:, None], first, log_scale0)
        s0 = s0 * torch.exp(log_scale0 - first)[..., None, None]  # each document's at its first position's scale
    log_decay = torch.cat([run[..., :1].new_zeros(run[..., :1].shape), run[..., :-1] - run[..., 1:]], dim=-1)
    log_decay = log_decay.masked_fill(lay.resets[:, 0], 0.0)  # the reset replaces it there (T = Tx here)
    o, st = gated_linear_attention(qf, kf, w, log_decay, scale=1.0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                   strategy=strategy,
                                   initial_state=None if s0 is None else DecayedState(s0), return_state=True)
    out = _finish(o, dv, features, out_dtype, floor)
    if not return_state:
        return out
    last = run[0].index_select(1, (cu_seqlens[1:] - 1).clamp(min=0)).t() if lay.T else None  # (n, H)
    empty_scale = log_scale0 if log_scale0 is not None else st.s.new_zeros(lay.n, qf.shape[1])
    final_scale = empty_scale if last is None else torch.where(nonempty[:, None], last, empty_scale)
    return out, _state(st.s, dv, final_scale)


def _projections(q: Tensor, k: Tensor, W: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``u = x' W^T`` for queries and keys with ``x' = x scale^(1/2)`` (``W (m, D)``), and
    ``||k'||^2 / 2``: ``uq (B, H, Nq, m)``, ``uk (B, H, Nk, m)``, ``half_sq (B, H, Nk, 1)``."""
    Wr = W * scale**0.5  # (m, D): u = x' W^T = x Wr^T
    return q @ Wr.T, k @ Wr.T, k.square().sum(-1, keepdim=True) * (scale / 2)


def _decoding_step(q: Tensor, k: Tensor, v: Tensor, W: Tensor, scale: float, state: LinearAttentionState,
                   return_state: bool, out_dtype: torch.dtype):
    """One unpadded position of positive softmax-kernel FAVOR+ from ``state``: ``q, k (B, H, 1, D)``,
    ``v (B, H, 1, Dv)``, all in the compute dtype; the arithmetic of the causal path of
    :func:`_favor` for N = 1, with S and z kept apart.

    The general path joins [S, z] and [v, 1] and rescales, adds and splits the joined (B, H, m,
    Dv + 1) state: four full passes over it and two copies per step. Here the state is rescaled
    and updated once each (S r + phi(k)^T v, z r + phi(k)), and numerator and normaliser are two
    small products; what remains is mostly the two passes over S and per-operation overhead.
    (Timings: docs/benchmarks/README.md, "History".)
    """
    inv_root_m = 1.0 / math.sqrt(W.shape[0])
    dt = q.dtype
    uq, uk, half_sq = _projections(q, k, W, scale)  # (B, H, 1, m), (B, H, 1, m), (B, H, 1, 1)
    qf = _exp_features(uq, uq.amax(-1, keepdim=True).detach(), inv_root_m)
    c = (uk.amax(-1) - half_sq[..., 0]).detach()  # (B, H, 1): the key's log-magnitude
    log_scale0 = state.log_scale.to(dt).detach()[..., None]  # (B, H, 1)
    # the running maximum after this key; the lowest finite value where both are -inf (no key yet)
    run = torch.maximum(c, log_scale0)
    run = torch.where(torch.isfinite(run), run, torch.finfo(dt).min)
    kf = _exp_features(uk, half_sq + run[..., None], inv_root_m)  # (B, H, 1, m), exponents <= 0
    r = torch.exp(log_scale0 - run)  # (B, H, 1): the carried sums to the new scale, <= 1
    S = torch.addcmul(state.S.to(dt) * r[..., None], kf.transpose(-1, -2), v)  # (B, H, m, Dv)
    z = torch.addcmul(kf[:, :, 0], state.z.to(dt), r)  # (B, H, m)
    out = divide_by_normaliser_(qf @ S, qf @ z[..., None], _positive_floor(W.shape[0], dt)).to(out_dtype)
    if not return_state:
        return out
    return out, LinearAttentionState(S=S, z=z, log_scale=run[..., 0])


def _positive_floor(m: int, dtype: torch.dtype) -> Tensor:
    """The normaliser floor of positive softmax-kernel features, ``1 / (m sqrt(finfo.max))``: the
    :func:`~linattn.functional.linear.normaliser_floor` ``max|phi(q)| max|z| / sqrt(finfo.max)``
    with ``max|z|`` replaced by its lower bound ``1 / sqrt(m)`` (the heaviest visible key's
    largest feature), and ``max|phi(q)| = 1 / sqrt(m)``: the stabiliser pins both. Known without a
    pass over the features, and the same in every form."""
    return torch.tensor(torch.finfo(dtype).max ** -0.5 / m, dtype=dtype)


def _finish(o: Tensor, dv: int, features: str, out_dtype: torch.dtype, floor: Tensor | None = None) -> Tensor:
    """Numerator / normaliser of ``o (..., Dv+1)``.

    Trig: the normaliser is clamped (see ``TRIG_NORMALISER_FLOOR``). Positive and relu: the
    normaliser is >= 0, divided as in kernel attention (``normaliser.normalise``), raised to
    ``floor`` where it falls below it (huge inputs whose features are nearly one-hot in different
    directions): such rows shrink towards zero with finite gradients instead of overflowing.
    """
    if features == "trig":
        return (o[..., :dv] / o[..., dv:].clamp_min(TRIG_NORMALISER_FLOOR)).to(out_dtype)
    return normalise(o, dv, out_dtype, floor)


def _state(s: Tensor, dv: int, log_scale: Tensor) -> LinearAttentionState:
    return LinearAttentionState(S=s[..., :dv], z=s[..., dv], log_scale=log_scale)


def favor_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    kernel: str = "softmax",
    features: str = "positive",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Plain O(Nq Nk) FAVOR attention: explicit ``phi(Q) phi(K)^T``, masked, rows normalised.

    No stabiliser, so only for moderate inputs (float64 in tests). The trig normaliser is clamped
    at ``TRIG_NORMALISER_FLOOR`` times the heaviest visible key's weight, as in the fast forms.
    """
    fn = "favor_attention_reference"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    _check_kind(fn, kernel, features)
    _check_projection(fn, projection, q)
    scale = check_scale(fn, scale, q.shape[-1])
    dt = compute_dtype(q.dtype)
    q, k, v, W = q.to(dt), k.to(dt), v.to(dt), projection.to(dt)
    qf = favor_features(q, W, kernel=kernel, features=features, scale=scale)
    kf = favor_features(sanitize_padded(k, key_padding_mask), W, kernel=kernel, features=features, scale=scale)
    nq, nk = q.shape[2], k.shape[2]
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed[None, None]  # (1, 1, Nq, Nk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    sim = torch.where(allowed, qf @ kf.transpose(-1, -2), 0.0)  # (B, H, Nq, Nk)
    num = sim @ sanitize_padded(v, key_padding_mask)
    den = sim.sum(-1, keepdim=True)
    if features == "trig" and kernel == "softmax":
        # the floor in these (unstabilised) units: the heaviest visible key's weight times the
        # query's own magnitude exp(||q'||^2/2)
        xs_q, xs_k = q * scale**0.5, k * scale**0.5
        wk = torch.exp(xs_k.square().sum(-1) / 2)[:, :, None, :]  # (B, H, 1, Nk)
        heaviest = finite_max(torch.where(allowed, wk, 0.0), -1)
        wq = torch.exp(xs_q.square().sum(-1, keepdim=True) / 2)
        # the heaviest key's weight is held constant (it is the stabiliser); the query's own
        # magnitude is a common factor of every term, as in the fast forms, where it is dropped
        den = torch.maximum(den, TRIG_NORMALISER_FLOOR * heaviest.detach() * wq)
        den = torch.where(heaviest > 0, den, 1.0)
    else:
        # the floor of the fast forms: eps * max phi(q_i) * (positive features: the heaviest visible
        # key's largest feature, which the stabiliser pins; relu: max |z_i|, z_i = sum of the
        # visible keys' features), here in unstabilised units
        seen = allowed.to(dt)  # (B or 1, 1, Nq, Nk)
        if kernel == "softmax":
            heaviest = finite_max(seen * kf.detach().amax(-1)[:, :, None, :], -1)  # (B, H, Nq, 1)
            floor = normaliser_floor(qf, heaviest)
        else:
            floor = normaliser_floor(qf, seen @ kf.detach())
        den = torch.maximum(den, floor)
        den = torch.where(den >= torch.finfo(dt).tiny, den, 1.0)
    return (num / den).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Context parallelism: the state summary (functional/sharding.py)
# ---------------------------------------------------------------------------------------------


def _shard_summarize(fn: str, first: bool, initial_state, tensors: tuple, options: dict) -> ShardPart:
    """A shard's sums and their log_scale (the functional form's own stabiliser), from zero on a
    later rank; a later rank's output is a second call from the state before its shard."""
    q, k, v, projection = tensors
    options = {**options, "causal": True}
    out, st = favor_attention(q, k, v, projection, initial_state=initial_state if first else None,
                              return_state=True, **options)
    log_scale = st.log_scale
    if q.shape[2] == 0 and not (first and initial_state is not None):
        # an empty shard's sums are 0 at any scale: the lowest finite one never raises the scale of
        # a combination (the functional form reports 0)
        log_scale = torch.full_like(log_scale, torch.finfo(log_scale.dtype).min)
    B, H, Fd, Dv = st.S.shape
    values = [B, H, q.shape[-1], Dv, Fd, check_scale(fn, options.get("scale"), q.shape[-1])]
    return ShardPart([st.S, st.z, log_scale], values, out if first else None, (tensors, options))


def _shard_fold(state: list[Tensor] | None, summary: list[Tensor]) -> list[Tensor]:
    """Sums at the larger of two log_scales, the other rescaled by exp of a difference <= 0. The
    stabiliser gets no gradient, as in the functional form."""
    S_j, z_j, c_j = summary
    c_j = c_j.detach()
    if state is None:
        return [S_j, z_j, c_j]
    S, z, c = state
    top = torch.maximum(c, c_j)  # (B, H)
    a, b = torch.exp(c - top), torch.exp(c_j - top)  # both <= 1
    return [S * a[..., None, None] + S_j * b[..., None, None], z * a[..., None] + z_j * b[..., None], top]


def _shard_finish(kept, state: list[Tensor]) -> Tensor:
    (q, k, v, projection), options = kept
    S, z, c = state
    return favor_attention(q, k, v, projection, initial_state=LinearAttentionState(S, z, c), **options)


SHARDING = ShardForm("favor_attention", ("B", "H", "D", "Dv", "F", "scale"), _shard_summarize, _shard_fold,
                     _shard_finish, lambda state: LinearAttentionState(*state), ("q", "k", "v", "projection"))
"""Causal FAVOR+ over a sequence sharded along N: a shard's summary is its sums and their
log_scale, ``B H (F (Dv + 1) + 1)`` numbers; summaries combine at the larger log_scale, as the
functional form's running maximum does. Options: ``kernel``, ``features``, ``scale``,
``chunk_size``, ``tile_entries``."""
