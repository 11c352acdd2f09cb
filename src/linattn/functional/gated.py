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
    at_most,
    check_key_groups,
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_scale,
    check_values,
    compute_dtype,
    expand_key_heads,
    no_autocast,
    shape_str,
)
from .decayed import decayed_product
from .grouped import grouped_decayed_product
from .strategy import HALF_DTYPES, check_strategy, operand_dtype, resolve_strategy
from .decayed_state import DecayedState, check_decayed_state, result_without_positions
from .sharding import ShardForm, ShardPart, cumulative_decay
from .varlen import check_cu_seqlens, int64_offsets, varlen_layout

__all__ = ["gated_linear_attention", "gated_linear_attention_reference"]


def _check_log_decay(fn: str, log_decay, q: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Validate ``log_decay`` and return it as ``(B, H, N, G)`` (G = 1 or D) in the compute dtype,
    padded positions replaced by 0 (an identity step; their content, even NaN, is never read).

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: wrong shape or device, or an entry of a real position that is positive or NaN
            (-inf is allowed: a decay of exactly 0, a full reset).
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
    with torch.no_grad():  # at_most is False where positive or NaN
        check_values(at_most(g, 0.0), lambda: f"{fn}: log_decay must be <= 0 (a decay exp(log_decay) in [0, 1]; "
                     f"-inf is a decay of 0) at every real position, got {g[~(g <= 0)][0].item():.6g}")
    return g


def _check_value_terms(fn: str, value_scale, skip, v: Tensor) -> None:
    """``value_scale``: None or a floating ``(B, H, N)`` tensor on v's device; ``skip``: None or a
    floating ``(H,)`` one. ValueError naming the argument and the shapes otherwise."""
    for name, t, want in (("value_scale", value_scale, tuple(v.shape[:3])), ("skip", skip, (v.shape[1],))):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != want or not t.is_floating_point() or t.device != v.device:
            want_str = "(" + ", ".join(map(str, want)) + ("," if len(want) == 1 else "") + ")"
            raise ValueError(f"{fn}: {name} must be a floating tensor of shape {want_str} on v's device "
                             f"{v.device} (v {shape_str(v)}), got {t.dtype} {shape_str(t)} on {t.device}")


def _real(t: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``t (B, H, N, *)`` with padded positions set to 0 (never read, even a NaN there)."""
    if key_padding_mask is None:
        return t
    return torch.where(key_padding_mask[:, None, :, None], t, t.new_zeros(()))


def _scaled_values(v: Tensor, value_scale: Tensor | None, key_padding_mask: Tensor | None) -> Tensor:
    """``v * value_scale`` per head and position (the values the state takes), zeros at padding."""
    return v if value_scale is None else _real(v * value_scale.to(v.dtype).unsqueeze(-1), key_padding_mask)


def _with_skip(out: Tensor, skip: Tensor | None, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``out + skip_h v`` in out's dtype; a padded position's output stays zeros."""
    if skip is None:
        return out
    return out + _real(skip.to(out.dtype)[:, None, None] * v.to(out.dtype), key_padding_mask)


def _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state, *, scaled=True, cu_seqlens=None):
    """Checks, then ``q * scale`` (``q`` and the scale with ``scaled=False``), ``k, v (B, H, N, *)``, ``g (B, H, N, G)`` and ``s0 (B, H, D, Dv)``
    or None, all in the compute dtype, padded positions zeroed (q too: their output is zeros).
    With ``cu_seqlens`` (checked here), B = 1 and ``s0`` has one state per document, ``(n, H, D, Dv)``.
    Grouped value heads (q, k with Hk heads, v with H) come back as H heads (:func:`expand_key_heads`)."""
    q, k = expand_key_heads(fn, q, k, v)
    check_qkv(fn, q, k, v, causal=True)
    n_states = q.shape[0]
    if cu_seqlens is not None:
        n_states = check_cu_seqlens(fn, cu_seqlens, q).shape[0] - 1
    check_key_padding_mask(fn, key_padding_mask, k)
    scale = check_scale(fn, scale, q.shape[-1])
    g = _check_log_decay(fn, log_decay, q, key_padding_mask)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    s0 = None
    if initial_state is not None:
        check_decayed_state(fn, initial_state, n_states, H, D, Dv, q.device)
    dt = compute_dtype(q.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if scaled:
        q = q * scale
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, :, None]  # (B, 1, N, 1)
        zero = q.new_zeros(())
        q, k, v = (torch.where(real, t, zero) for t in (q, k, v))
    if initial_state is not None:
        s0 = initial_state.s.to(dt)
    return (q, k, v, g, s0) if scaled else (q, k, v, g, s0, scale)


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
    value_scale: Tensor | None = None,
    skip: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """The recurrence of :func:`gated_linear_attention` run position by position, straight from
    the formula. Same contract (minus ``chunk_size``); tests trust this one, in float64."""
    fn = "gated_linear_attention_reference"
    in_dtype = q.dtype
    _check_value_terms(fn, value_scale, skip, v)
    raw_v = v
    q, k, v, g, s0 = _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state)
    v = _scaled_values(v, value_scale, key_padding_mask)
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    if B * H * N == 0:  # no step at all: as in gated_linear_attention
        out, s = result_without_positions((q, k, v, g), s0, (B, H, N, Dv), (B, H, D, Dv))
    else:
        s = q.new_zeros(B, H, D, Dv) if s0 is None else s0  # (B, H, D, Dv)
        outs = []
        for t in range(N):
            s = torch.exp(g[:, :, t]).unsqueeze(-1) * s + k[:, :, t, :, None] * v[:, :, t, None, :]
            outs.append((q[:, :, t, None, :] @ s).squeeze(-2))  # (B, H, Dv)
        out = torch.stack(outs, dim=2)
    out = _with_skip(out, skip, raw_v, key_padding_mask).to(in_dtype)
    return (out, DecayedState(s)) if return_state else out



# The chunked form is the decayed engine's (decayed.py): a gate per head or per key channel.



def _recurrent_step(q, k, v, g, s0):
    """One position (N = 1) from a state: O(D*Dv), no chunk machinery. Shapes as the chunked form."""
    s = torch.addcmul(k.transpose(-1, -2) * v, torch.exp(g).transpose(-1, -2), s0)  # (B, H, D, Dv)
    return q @ s, s

def _varlen(q, k, v, g, s0, scale, cu_seqlens, return_state, chunk_size, knobs, strategy, input_dtype):
    """Packed documents (see ``varlen.py``): ``q, k (1, H, T, D)``, ``v (1, H, T, Dv)``,
    ``g (1, H, T, G)``, ``s0 (n, H, D, Dv)`` or None, prepared (compute dtype, padding zeroed) ->
    ``(1, H, T, Dv)`` and the per-document final states ``(n, H, D, Dv)`` (None unless
    ``return_state``). One run of the chunked form on the expanded sequence: -inf log decays at the
    documents' starts, D positions writing each initial state and D reading each final one.
    T, H >= 1: gated_linear_attention answers inputs without a position itself."""
    H, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    lay = varlen_layout(cu_seqlens, q.shape[2], D, write_states=s0 is not None, read_states=return_state)
    if lay.gather is not None:
        # inserted positions read and write with scale 1: scale the real queries here instead
        q = lay.expand(q * scale, lay.zeros(q), lay.basis(q))
        k = lay.expand(k, lay.basis(k), lay.zeros(k))
        v = lay.expand(v, None if s0 is None else lay.state_rows(s0), lay.zeros(v))
        g = lay.expand(g, lay.zeros(g), lay.zeros(g))
        scale = 1.0
    out, _ = decayed_product(q, k, v, log_decay=lay.with_resets(g), scale=scale, chunk_size=chunk_size,
                             sub_chunk_size=knobs[0], tile_positions=knobs[1], strategy=strategy,
                             input_dtype=input_dtype)
    return lay.packed(out), (lay.states(out) if return_state else None)


def _grouped_route(q, v, log_decay, key_padding_mask, initial_state, return_state, cu_seqlens) -> bool:
    """Whether a call runs :func:`grouped_decayed_product`: grouped value heads (q and k with fewer
    heads than v) and a decay per head, as Mamba-2's SSD has them, without padding; packed
    documents only without states (they become resets, -inf log decays at the documents' starts).
    Every other call repeats q and k per head (``expand_key_heads``) for the general engine."""
    return (isinstance(q, Tensor) and isinstance(v, Tensor) and q.dim() == 4 and v.dim() == 4
            and 0 < q.shape[1] < v.shape[1] and isinstance(log_decay, Tensor) and log_decay.dim() == 3
            and key_padding_mask is None
            and (cu_seqlens is None or (initial_state is None and not return_state)))


def _grouped(fn, q, k, v, log_decay, scale, initial_state, return_state, chunk_size, strategy, cu_seqlens,
             value_scale, skip):
    """:func:`gated_linear_attention` on the grouped route: checks (as the general route's, on one
    head of each group), then the engine -> ``(out (B, H, N, Dv), state (B, H, D, Dv))``."""
    B, Hk, N, D = q.shape
    H, Dv = v.shape[1], v.shape[-1]
    if not (isinstance(k, Tensor) and k.dim() == 4):
        check_qkv(fn, q, k, v, causal=True)  # names what k is
    m = check_key_groups(fn, q, k, v)
    check_qkv(fn, q, k, v[:, ::m], causal=True)  # one value head per group: the shapes, dtypes, devices
    if cu_seqlens is not None:
        cu_seqlens = int64_offsets(check_cu_seqlens(fn, cu_seqlens, q))
    scale = check_scale(fn, scale, D)
    g = _check_log_decay(fn, log_decay, v, None).squeeze(-1)  # (B, H, N): v has q's B, N and the H heads
    if initial_state is not None:
        check_decayed_state(fn, initial_state, B, H, D, Dv, q.device)
    dt = compute_dtype(q.dtype)
    strategy = resolve_strategy(strategy, q.device)
    operand = HALF_DTYPES.get(operand_dtype(strategy, q.dtype))
    q, k, v = (q * scale).to(dt), k.to(dt), v.to(dt)
    s0 = None if initial_state is None else initial_state.s.to(dt)
    if cu_seqlens is not None:  # every document starts from zeros: a reset at its first position
        starts = torch.zeros(N + 1, dtype=torch.bool, device=q.device).index_fill_(0, cu_seqlens[:-1], True)[:N]
        g = torch.where(starts, g.new_full((), float("-inf")), g)
    value_scale, skip = (None if t is None else t.to(dt) for t in (value_scale, skip))
    return grouped_decayed_product(q, k, v, g, s0, chunk_size=GROUPED_CHUNK_SIZE if chunk_size is None else chunk_size,
                                   strategy=strategy, operand=operand, value_scale=value_scale, skip=skip)


# The grouped route's chunk length (why: docs/benchmarks/README.md, History)
GROUPED_CHUNK_SIZE = 64


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
    chunk_size: int | None = None,
    sub_chunk_size: int = 4,
    tile_positions: int = 4096,
    cu_seqlens: Tensor | None = None,
    strategy: str = "auto",
    value_scale: Tensor | None = None,
    skip: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Gated linear attention ``S_t = exp(log_decay_t) * S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``.

    Causal only: the decay is a recurrence in time, so there is no ``causal`` argument and no
    bidirectional form. Chunked (O(N) memory, a loop over chunks, never over positions) with its
    own backward; gradients reach q, k, v, log_decay and ``initial_state.s`` (once; no double
    backward). A call with N = 1 and an ``initial_state`` is the recurrent form: one step of cost
    O(D*Dv), without the chunk machinery.

    Args:
        q: ``(B, H, N, D)`` queries, or ``(B, Hk, N, D)`` with H a multiple of Hk (grouped value
            heads: value head h reads query/key head ``h // (H / Hk)``). With a decay per head and
            no ``key_padding_mask`` (Mamba-2's SSD), a group's heads share its scores and its state
            products (``linattn.functional.grouped``; packed documents there only without states);
            otherwise q and k are repeated inside, their gradients summed over each group.
        k: ``(B, H, N, D)`` keys (``(B, Hk, N, D)`` with q).
        v: ``(B, H, N, Dv)`` values.
        log_decay: ``(B, H, N)``, one gate per head and position (RetNet, Mamba-2, simple GLA), or
            ``(B, H, N, D)``, one per key channel, scaling the rows of S (GLA). Entries must be
            <= 0 (ValueError for a positive or NaN entry); -inf is a decay of 0, a full reset.
            Inside the chunked form an entry below -40 is a reset, a decay of exactly 0 (exp(-40)
            is 4e-18; its gradient is taken as 0), and the cumulative log decays of a chunk are
            held as small decays plus a count of resets in the compute dtype (no float64), so a
            huge decay early in a chunk does not drown the digits of small ones after it
            (``linattn.functional.log_decays``). Any floating dtype.
        scale: the factor of the readout; None is ``1/sqrt(D)``.
        key_padding_mask: bool ``(B, N)``, True = a real position, False = padding. A padded
            position is an identity step (no decay, no write; its content, even NaN, is never
            read) and its output is zeros.
        initial_state: the :class:`DecayedState` after an earlier prefix, to resume from (None:
            zeros).
        return_state: also return the :class:`DecayedState` after the last position.
        chunk_size: a tuning knob, the chunk length C of the algorithm; any C >= 1 gives the
            same result. None: 64 for a per-head gate, 32 for a per-channel one (why:
            docs/benchmarks/README.md, History).
        sub_chunk_size: a tuning knob of the per-channel gate, the sub-chunk length c (the largest
            divisor of C up to it); any value >= 1 gives the same result. The explicit pairs of a
            sub-chunk grow as c per position, the factored products between sub-chunks as C / c.
        tile_positions: a tuning knob, about how many positions (all B*H rows together) one tile
            of chunks holds; any value >= 1 gives the same result. Temporaries stay a few MiB,
            recycled and in cache, instead of tensors over the whole sequence.
        cu_seqlens: None, or integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., T]`` of n documents packed
            along N (non-decreasing; empty documents allowed), flash-attention's varlen convention.
            Then B must be 1 (inputs ``(1, H, T, *)``), no information crosses a document
            boundary, and ``initial_state`` and the returned state hold one state per document,
            ``s (n, H, D, Dv)``: the result equals one call per document (outputs, gradients,
            states), in one chunked run over T positions (plus n*D per kind of state asked for;
            see ``linattn.functional.varlen``). ``key_padding_mask`` ``(1, T)`` works alike.
            Also the engine for other mechanisms' packed inputs: pass their features as q, k,
            their values as v, their log decays (zeros for none) and ``scale=1.0``.
        strategy: how the chunked form runs on the device; any choice gives the same result up to
            rounding. ``"cpu"``: tiles of ``tile_positions`` in cache and a sequential loop over
            chunks (the least arithmetic); ``"accelerator"``: every chunk at once in a few large
            products and the recurrence across chunks as a log-depth scan, so the number of
            kernel launches grows with log N, not N (``linattn.functional.recurrence``);
            ``"auto"`` (default): ``"cpu"`` on a CPU, ``"accelerator"`` on CUDA, MPS, XPU, ...
        value_scale: None, or ``(B, H, N)`` (``(1, H, T)`` packed): the values enter the state as
            ``value_scale_t * v_t``, a number per head and position (Mamba-2's step sizes dt).
        skip: None, or ``(H,)``: ``skip_h * v_t`` (the values before ``value_scale``) is added to
            each output (Mamba-2's D); a padded position's output stays zeros. With both, Mamba-2's
            SSD is ``gated_linear_attention(C, B, x, A * dt, scale=1.0, value_scale=dt, skip=D)``,
            and on the grouped route (B and C shared by a group of heads) both are applied chunk by
            chunk in cache instead of as passes of their own over the whole sequence.

    Causality and document isolation hold for finite q, k, v: a NaN or inf at a real position t
    can reach the outputs of earlier positions in t's chunk (blocked products: 0 * inf is NaN),
    and, packed, of the other documents sharing that chunk. Not guarded (it would cost every
    call); a padded position's content is never read, whatever it is.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` a :class:`DecayedState`.
        Half inputs (float16, bfloat16) are computed in float32 (state, cumulative decays, every
        chunk product); the state is float32 for them, else the input dtype.
        Inputs without a position (B, H or N = 0; T = 0 when packed) give the empty output and the
        state after no step: a new tensor equal to ``initial_state.s`` (zeros without one), both in
        the graph of every input as for any other call (zero gradients; the identity to
        ``initial_state.s``).
    """
    fn = "gated_linear_attention"
    if chunk_size is not None:
        check_positive_int(fn, "chunk_size", chunk_size)
    check_positive_int(fn, "sub_chunk_size", sub_chunk_size)
    check_positive_int(fn, "tile_positions", tile_positions)
    check_strategy(fn, strategy)
    in_dtype = q.dtype
    if isinstance(v, Tensor) and v.dim() == 4:
        _check_value_terms(fn, value_scale, skip, v)
    if _grouped_route(q, v, log_decay, key_padding_mask, initial_state, return_state, cu_seqlens) and \
            q.shape[0] * v.shape[1] * q.shape[2] > 0 and not (q.shape[2] == 1 and initial_state is not None):
        with no_autocast(q.device.type):
            out, s = _grouped(fn, q, k, v, log_decay, scale, initial_state, return_state, chunk_size, strategy,
                              cu_seqlens, value_scale, skip)
        out = out.to(in_dtype)
        return (out, DecayedState(s)) if return_state else out
    raw_v = v
    with no_autocast(q.device.type):
        q, k, v, g, s0, scale = _prepare(fn, q, k, v, log_decay, scale, key_padding_mask, initial_state,
                                         scaled=False, cu_seqlens=cu_seqlens)
        v = _scaled_values(v, value_scale, key_padding_mask)
        cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
        B, H, N, D = q.shape
        Dv = v.shape[-1]
        if B * H * N == 0:
            # No position in any sequence, in every form (packed too: T = 0 or H = 0). The chunked
            # engine cannot lay out zero rows or positions in chunks; the result is the state
            # after no step, and it must stay in the graph as any other call's does.
            n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
            out, s = result_without_positions((q, k, v, g), s0, (B, H, N, Dv), (n, H, D, Dv))
        elif cu_seqlens is not None:
            out, s = _varlen(q, k, v, g, s0, scale, cu_seqlens, return_state, chunk_size,
                             (sub_chunk_size, tile_positions), strategy, in_dtype)
        elif N == 1 and s0 is not None:
            out, s = _recurrent_step(q * scale, k, v, g, s0)
        else:
            out, s = decayed_product(q, k, v, s0, log_decay=g, scale=scale, chunk_size=chunk_size,
                                     sub_chunk_size=sub_chunk_size, tile_positions=tile_positions,
                                     strategy=strategy, input_dtype=in_dtype)
        out = _with_skip(out, skip, raw_v, key_padding_mask)
    out = out.to(in_dtype)
    return (out, DecayedState(s)) if return_state else out


# ---------------------------------------------------------------------------------------------
# Context parallelism: the state summary (functional/sharding.py)
# ---------------------------------------------------------------------------------------------


def _shard_summarize(fn: str, first: bool, initial_state, tensors: tuple, options: dict) -> ShardPart:
    """A shard's total decay ``exp(sum of log_decay)`` ``(B, H, G)`` and its state from zero. A later
    rank keeps its local output and the decay from its shard's start to each position: the state
    after position t is ``exp(b_t) * S_in + (local state)_t``, so its output is the local one plus
    ``scale (q_t * exp(b_t))^T S_in`` (exact, one product, every exponent <= 0)."""
    q, k, v, log_decay = tensors
    q, k = expand_key_heads(fn, q, k, v)  # grouped value heads: the correction reads q per value head
    scale = options.get("scale")
    if first:
        out, st = gated_linear_attention(q, k, v, log_decay, initial_state=initial_state, return_state=True,
                                         **options)
    else:
        check_qkv(fn, q, k, v, causal=True)
        dt = compute_dtype(q.dtype)  # the correction is added before the cast to the input dtype
        out, st = gated_linear_attention(q.to(dt), k.to(dt), v.to(dt), log_decay, return_state=True, **options)
    s = st.s  # (B, H, D, Dv)
    G = 1 if log_decay.dim() == 3 else q.shape[-1]
    kept = None
    if first:
        decay = s.new_zeros(*s.shape[:2], G)  # rank 0's transition is never read
    else:
        gate = (log_decay.unsqueeze(-1) if G == 1 else log_decay).to(s.dtype)  # (B, H, N, G)
        to_t = cumulative_decay(gate, 2)  # (B, H, N, G): the decay from the shard's start to t, <= 1
        decay = to_t[:, :, -1] if q.shape[2] else s.new_ones(*s.shape[:2], G)  # (B, H, G)
        kept = (out, q, to_t, check_scale(fn, scale, q.shape[-1]))
    values = [s.shape[0], s.shape[1], q.shape[-1], s.shape[-1], G, check_scale(fn, scale, q.shape[-1])]
    return ShardPart([decay, s], values, out if first else None, kept)


def _shard_fold(state: list[Tensor] | None, summary: list[Tensor]) -> list[Tensor]:
    if state is None:
        return summary
    decay, s = summary
    return [decay, decay[..., None] * state[1] + s]  # (B, H, G, 1): every row (G = 1) or row d (G = D)


def _shard_finish(kept, state: list[Tensor]) -> Tensor:
    out, q, to_t, scale = kept
    s_in = state[1]
    return (out + scale * ((q.to(s_in.dtype) * to_t) @ s_in)).to(q.dtype)  # q_t * exp(b_t): (B, H, N, D)


SHARDING = ShardForm("gated_linear_attention", ("B", "H", "D", "Dv", "G", "scale"), _shard_summarize,
                     _shard_fold, _shard_finish, lambda state: DecayedState(state[1]), ("q", "k", "v", "log_decay"))
"""Gated linear attention over a sequence sharded along N: a shard's summary is its total decay and
its state from zero, ``B H (D Dv + G)`` numbers; one functional call per rank. Options: ``scale``,
``chunk_size``."""
