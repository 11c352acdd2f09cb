"""Local (sliding-window) softmax attention in bidirectional, causal and recurrent form, plus its
reference.

Query i attends with softmax to the keys j with |i - j| <= window (causal: i - window <= j <= i),
as in the sliding-window attention of Longformer (Beltagy et al., arXiv 2004.05150) and Image
Transformer / Sparse Transformer local attention. Positions are those of the sequence (padding
counts as a position), so queries and keys must be the same sequence: Nq == Nk.

Dimension legend: B batch, H heads, N positions, D query/key width, Dv value width, W window,
C block length, Nb number of query blocks, M blocks of keys looked back (and ahead) from a block,
K = (M + 1) C (causal) or (2M + 1) C (bidirectional) keys seen by one query block, L key positions
(with a state: the W carried keys then the N new ones), Nd documents packed into one sequence of
N positions (``cu_seqlens``), Nd' the documents of one head group, R their head queries padded
to the group's length.

The fast form is blocked: queries in blocks of C attend the K keys of their own block and the M
blocks before (and after) it. Each block's (C, K) band mask is built from the block's key validity,
and the whole thing is one call of PyTorch's fused softmax kernel (SDPA) over B*Nb small problems.
Time O(N K D), memory O(N K) bits of mask plus O(N D) copies of k and v: never an N x N matrix.

Recurrent form (causal): the state is a ring buffer of the last W keys and values, slot p % W
holding position p, with their validity and the number of positions seen. A call with a state
continues the sequence: query i of the call is position ``state.pos + i``. One token then costs
O(W D) whatever its position, and a sequence split anywhere and resumed equals the whole.

Packed documents (``cu_seqlens``, flash-attention's varlen convention): Nd documents lie back to
back in one sequence of batch size 1, document d at positions ``[cu_seqlens[d], cu_seqlens[d+1])``,
and no query sees a key of another document. The blocked form takes a document id per position and
adds ``doc(key) == doc(query)`` to each block's mask, so the cost stays O(N K D) however many
documents there are. A state then holds one ring per document (batch dimension Nd). Only the
first min(W, length) queries of a document (its head) reach back into its state, so they are
computed apart: each head against its own W state keys and its first keys, documents grouped by
head length rounded up to a power of two (one SDPA call per group, at most log2(W) + 1 groups;
the rounding at most doubles a head, so the heads cost O(N W D) in all), and their outputs replace
those of the blocked pass, which saw no state.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_qkv,
    check_recurrent_args,
    check_scale,
    compute_dtype,
    no_autocast,
    sanitize_padded,
)
from .sharding import HaloForm
from .varlen import check_cu_seqlens, int64_offsets

__all__ = ["LocalAttentionState", "local_attention", "local_attention_reference"]

# Block length bounds: the block length is the window, clamped to [MIN_BLOCK, MAX_BLOCK]. A causal
# query block of C rows sees K = (M+1) C keys of which W+1 are in a row's band: smaller blocks
# waste fewer scores but give the fused kernel smaller tiles. 128 was the best compromise for
# causal and bidirectional calls at a long sequence and a window of 256 (timings:
# docs/benchmarks/README.md, "History"). The lower bound keeps tiny windows from making tiny
# tiles.
MIN_BLOCK = 32
MAX_BLOCK = 128


class LocalAttentionState(NamedTuple):
    """Recurrent state of causal local attention: a ring buffer of the last ``W = window`` keys.

    Attributes:
        k: ``(B, H, W, D)`` keys; slot ``p % W`` holds position p for the W positions before ``pos``.
        v: ``(B, H, W, Dv)`` values, same slots.
        valid: bool ``(B, W)``: True where the slot holds a real key (False for padding and for
            slots before the first position).
        pos: number of positions seen so far (padding included); the next query is position ``pos``.

    ``k`` and ``v`` keep the input dtype and stay attached to the graph of the inputs they came
    from, so gradients flow from a later call back into an earlier one.

    With packed documents (``cu_seqlens``) the batch dimension is the document (B = Nd) and ``pos``
    is shared: each document's ring is laid out as if its last position were ``pos - 1``. Only the
    distances between positions matter, so a ring rolled to another ``pos`` is the same state; its
    oldest-first contents are what a call on the document alone returns.
    """

    k: Tensor
    v: Tensor
    valid: Tensor
    pos: int


def _check_window(fn: str, window) -> int:
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{fn}: window must be an int (the largest distance |i - j| attended), got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"{fn}: window must be >= 1 (the largest distance |i - j| attended), got {window}")
    return window


def _check_args(fn, q, k, v, window, causal, key_padding_mask, initial_state, return_state, cu_seqlens) -> int:
    check_qkv(fn, q, k, v, causal=causal)
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{fn}: local attention needs as many queries as keys (query i sits at position i of the "
            f"key sequence), got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    check_key_padding_mask(fn, key_padding_mask, k)
    window = _check_window(fn, window)
    check_recurrent_args(fn, causal, initial_state, return_state)
    batch = q.shape[0]
    if cu_seqlens is not None:
        batch = check_cu_seqlens(fn, cu_seqlens, q).shape[0] - 1
    if initial_state is not None:
        _check_state(fn, initial_state, q, v, window, batch, cu_seqlens is not None)
    return window


def _check_state(fn: str, state, q: Tensor, v: Tensor, window: int, B: int, packed: bool) -> None:
    """``B``: the state's batch size, q's or, with packed documents (``packed``), their number."""
    note = f" (one ring per document: {B} documents in cu_seqlens)" if packed else ""
    if not isinstance(state, LocalAttentionState):
        raise TypeError(
            f"{fn}: initial_state must be a LocalAttentionState (as returned with return_state=True), "
            f"got {type(state).__name__}"
        )
    _, H, _, D = q.shape
    Dv = v.shape[-1]
    for name, t, shape in (("k", state.k, (B, H, window, D)), ("v", state.v, (B, H, window, Dv))):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{fn}: initial_state.{name} must be a floating-point tensor")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{fn}: initial_state.{name} must have shape {shape} for these inputs and "
                f"window={window}{note}, got {tuple(t.shape)}"
            )
        if t.device != q.device:
            raise ValueError(f"{fn}: initial_state.{name} is on {t.device}, inputs on {q.device}")
    if not isinstance(state.valid, Tensor) or state.valid.dtype != torch.bool or tuple(state.valid.shape) != (B, window):
        got = (f"{state.valid.dtype} {tuple(state.valid.shape)}" if isinstance(state.valid, Tensor)
               else type(state.valid).__name__)
        raise ValueError(f"{fn}: initial_state.valid must be a bool tensor of shape {(B, window)}{note}, got {got}")
    if isinstance(state.pos, bool) or not isinstance(state.pos, int) or state.pos < 0:
        raise ValueError(f"{fn}: initial_state.pos must be an int >= 0, got {state.pos!r}")


# ---------------------------------------------------------------------------------------------
# Key sequence and state bookkeeping, shared by the fast and the reference form.
# ---------------------------------------------------------------------------------------------


def _ordered(state: LocalAttentionState) -> tuple[Tensor, Tensor, Tensor]:
    """The state's keys, values and validity oldest first: index i holds position pos - W + i."""
    shift = -(state.pos % state.k.shape[2])
    return (state.k.roll(shift, dims=2), state.v.roll(shift, dims=2), state.valid.roll(shift, dims=1))


def _key_sequence(k, v, key_padding_mask, initial_state):
    """Keys ``(B,H,L,D)``, values ``(B,H,L,Dv)`` and validity ``(B,L)`` the queries may see, and the
    offset of query 0 in them: the state's W keys (oldest first) then the new ones."""
    B, _, N, _ = k.shape
    valid = key_padding_mask if key_padding_mask is not None else torch.ones(B, N, dtype=torch.bool, device=k.device)
    k = sanitize_padded(k, key_padding_mask)
    v = sanitize_padded(v, key_padding_mask)
    if initial_state is None:
        return k, v, valid, 0
    k0, v0, valid0 = _ordered(initial_state)
    W = k0.shape[2]
    return (torch.cat([k0.to(k.dtype), k], 2), torch.cat([v0.to(v.dtype), v], 2),
            torch.cat([valid0, valid], 1), W)


def _next_state(keys, values, valid, window: int, pos: int) -> LocalAttentionState:
    """The ring buffer after a key sequence ending at position ``pos - 1``: its last W entries,
    empty (invalid, zero) slots in front when it is shorter than W, rolled into ring order."""
    L = keys.shape[2]
    if L < window:
        keys = F.pad(keys, (0, 0, window - L, 0))
        values = F.pad(values, (0, 0, window - L, 0))
        valid = F.pad(valid, (window - L, 0), value=False)
    keys, values, valid = keys[:, :, -window:], values[:, :, -window:], valid[:, -window:]
    shift = pos % window  # ordered index i is position pos - W + i, which lives in slot (pos + i) % W
    return LocalAttentionState(keys.roll(shift, dims=2), values.roll(shift, dims=2), valid.roll(shift, dims=1), pos)


# ---------------------------------------------------------------------------------------------
# local_attention
# ---------------------------------------------------------------------------------------------


class _Windows(torch.autograd.Function):
    """Overlapping key windows: ``x (B, H, L, X)`` -> ``(B*Nb, H, K, X)`` where window b holds
    positions ``[b C - front, b C - front + K)`` of x, zeros outside it.

    One copy forward; backward adds the K / C slices of each window gradient back into place.
    (``F.pad`` + ``Tensor.unfold`` give the same, but their backward fills and copies several
    full-size buffers, a large share of the whole call at long N.)
    """

    @staticmethod
    def forward(ctx, x: Tensor, front: int, C: int, K: int, nb: int):
        B, H, L, X = x.shape
        Lp = (nb - 1) * C + K
        xp = x.new_empty(B, H, Lp, X)  # zero only the padding: every fill of a large buffer costs
        xp[:, :, :front].zero_()
        xp[:, :, front + L:].zero_()
        xp[:, :, front:front + L] = x
        s = xp.stride()
        win = xp.as_strided((B, nb, H, K, X), (s[0], C * s[2], s[1], s[2], s[3]))  # (B, Nb, H, K, X)
        ctx.meta = (B, H, L, X, front, C, K, nb)
        return win.reshape(B * nb, H, K, X)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        B, H, L, X, front, C, K, nb = ctx.meta
        gp = g.new_empty(B, H, (nb - 1) * C + K, X)
        gp[:, :, nb * C:].zero_()
        g = g.view(B, nb, H, K // C, C, X)
        gp[:, :, :nb * C].view(B, H, nb, C, X).copy_(g[:, :, :, 0].transpose(1, 2))
        for p in range(1, K // C):  # the p-th C-slice of window b is block b + p of the padded keys
            gp[:, :, p * C:(p + nb) * C].view(B, H, nb, C, X).add_(g[:, :, :, p].transpose(1, 2))
        return gp[:, :, front:front + L], None, None, None, None


def _blocked(q: Tensor, keys: Tensor, values: Tensor, valid: Tensor, offset: int, *,
             window: int, causal: bool, scale: float, valid_queries: bool, doc: Tensor | None = None,
             longest: int | None = None) -> Tensor:
    """Query i (position ``offset + i`` of the key sequence) attends the valid keys within
    ``window`` positions. ``q (B,H,N,D)``, ``keys (B,H,L,D)``, ``values (B,H,L,Dv)``,
    ``valid (B,L)`` -> ``(B,H,N,Dv)``; zeros for a query with no valid key in its band.

    ``doc``: int64 ``(B, L)`` document id of each key position; query i then sees only the keys
    with ``doc == doc[:, offset + i]``. ``longest``: the longest document's length (with ``doc``),
    or None (blocks then sized by the window). ``valid_queries``: every query's own key position is
    valid (no padding mask), so every query has a key.
    """
    B, H, N, D = q.shape
    L, Dv = keys.shape[2], values.shape[-1]
    # No distance seen exceeds L - 1, nor a document's length - 1: a window larger than that must
    # not mean larger blocks.
    w_eff = min(window, L - 1 if longest is None else longest - 1)
    C = min(max(w_eff, MIN_BLOCK), MAX_BLOCK, N)
    M = -(-w_eff // C)
    nb = -(-N // C)
    K = (M + 1) * C if causal else (2 * M + 1) * C
    # Query block b sees keys [b C, b C + K) of the key sequence padded in front by M C - offset,
    # where its query ii sits at index M C + ii.
    front = M * C - offset
    kw = _Windows.apply(keys, front, C, K, nb)  # (B*Nb, H, K, D)
    vw = _Windows.apply(values, front, C, K, nb)  # (B*Nb, H, K, Dv)
    # (B*Nb, H, C, D): blocks in the batch dimension so that a (B*Nb, 1, C, K) mask broadcasts over heads
    if nb * C != N:
        q = F.pad(q, (0, 0, 0, nb * C - N))
    qb = q.view(B, H, nb, C, D).transpose(1, 2).reshape(B * nb, H, C, D)

    ii = torch.arange(C, device=q.device)[:, None] + M * C
    t = torch.arange(K, device=q.device)[None, :]
    dist = ii - t  # (C, K): query position minus key position
    band = (dist >= 0) & (dist <= window) if causal else dist.abs() <= window
    back = (nb - 1) * C + K - front - L
    valid = F.pad(valid, (front, back), value=False)
    allowed = band & valid.unfold(1, K, C)[:, :, None, :]  # (B, Nb, C, K)
    if doc is not None:
        doc_k = F.pad(doc, (front, back), value=-1).unfold(1, K, C)  # (B, Nb, K)
        doc_q = doc_k[:, :, M * C:M * C + C]  # (B, Nb, C): query ii of a block is its key M C + ii
        allowed = allowed & (doc_q[:, :, :, None] == doc_k[:, :, None, :])
    # Every query sees its own key unless it is padding (whatever the window, documents or a
    # state), so only a padding mask or the fill of the last block leaves one without a key: known
    # without a host read.
    every_query_has_key = valid_queries and nb * C == N
    if not every_query_has_key:
        has_key = allowed.any(-1, keepdim=True)  # (B, Nb, C, 1)
        # A query with no valid key would be softmax over nothing (NaN): let it see every (zeroed)
        # key of its window and zero its output below, so forward and gradients stay finite.
        allowed = allowed | ~has_key
    out = F.scaled_dot_product_attention(qb, kw, vw, attn_mask=allowed.view(B * nb, 1, C, K), scale=scale)
    if not every_query_has_key:
        out = torch.where(has_key.view(B * nb, 1, C, 1), out, out.new_zeros(()))
    out = out.view(B, nb, H, C, Dv).transpose(1, 2).reshape(B, H, nb * C, Dv)  # (B, H, Nb C, Dv)
    return out if nb * C == N else out[:, :, :N]


def _document_ids(cu_seqlens: Tensor, n: int) -> Tensor:
    """int64 ``(N,)``: the document of each packed position (empty documents own none)."""
    docs = torch.arange(cu_seqlens.numel() - 1, device=cu_seqlens.device)
    return torch.repeat_interleave(docs, cu_seqlens.diff(), output_size=n)


def _state_heads(out: Tensor, q: Tensor, keys: Tensor, values: Tensor, valid: Tensor,
                 state: LocalAttentionState, cu: list[int], *, window: int, scale: float) -> Tensor:
    """``out (1, H, N, Dv)`` with each document's head queries (its first min(W, length)) replaced by
    their attention over the document's state and its own first keys; the other queries never
    reach back to a state, so the blocked pass got them right.

    ``q (1,H,N,D)``, ``keys (1,H,N,D)``, ``values (1,H,N,Dv)``, ``valid (1,N)`` (packed, padding
    zeroed), ``state`` one ring per document, ``cu`` the offsets as a list. Returns ``(1,H,N,Dv)``.
    """
    W = window
    H, dev = q.shape[1], q.device
    k0, v0, valid0 = _ordered(state)  # (Nd, H, W, D), (Nd, H, W, Dv), (Nd, W); index i: position i - W
    heads = [min(W, b - a) for a, b in zip(cu[:-1], cu[1:])]
    # Group documents by head length rounded up to a power of two (at most W): one SDPA call per
    # group, and no head padded to more than twice its length, however the lengths are mixed.
    groups: dict[int, list[int]] = {}
    for d, h in enumerate(heads):
        if h:
            groups.setdefault(min(1 << (h - 1).bit_length(), W), []).append(d)
    starts_all = torch.tensor(cu[:-1], device=dev)
    heads_all = torch.tensor(heads, device=dev)
    for R, members in sorted(groups.items()):
        docs = torch.tensor(members, device=dev)  # (Nd',)
        r = torch.arange(R, device=dev)
        qpos = starts_all[docs, None] + r  # (Nd', R): packed position of head query r
        real = r < heads_all[docs, None]  # (Nd', R): False for the padding of a shorter head
        idx = torch.where(real, qpos, 0)  # gather positions (padding rows read position 0, unused)
        # index_select, not advanced indexing: its backward (index_add) is the cheaper scatter
        take = lambda x: x.index_select(2, idx.flatten()).view(H, -1, R, x.shape[-1]).transpose(0, 1)  # noqa: E731
        qh = take(q)  # (Nd', H, R, D)
        kh = torch.cat([k0.index_select(0, docs).to(q.dtype), take(keys)], 2)  # (Nd', H, W + R, D)
        vh = torch.cat([v0.index_select(0, docs).to(q.dtype), take(values)], 2)  # (Nd', H, W + R, Dv)
        ok = torch.cat([valid0[docs], valid[0][idx] & real], 1)  # (Nd', W + R)
        dist = (W + r)[:, None] - torch.arange(W + R, device=dev)[None, :]  # (R, W + R): head query r is key W + r
        allowed = (dist >= 0) & (dist <= W) & ok[:, None, :]  # (Nd', R, W + R)
        has_key = allowed.any(-1, keepdim=True)  # (Nd', R, 1)
        # as in _blocked: a query with no valid key sees every (zeroed) key, its output zeroed below
        allowed = allowed | ~has_key
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed[:, None], scale=scale)
        o = torch.where(has_key[:, None], o, o.new_zeros(()))  # (Nd', H, R, Dv)
        rows = real.flatten().nonzero().squeeze(1)  # the real head queries among the Nd' R
        o = o.transpose(0, 1).reshape(1, H, -1, o.shape[-1]).index_select(2, rows)  # (1, H, heads, Dv)
        out = out.index_copy(2, qpos.flatten()[rows], o)
    return out


def _packed_next_state(keys: Tensor, values: Tensor, valid: Tensor, state: LocalAttentionState | None,
                       cu_seqlens: Tensor, window: int, pos: int) -> LocalAttentionState:
    """One ring per document after packed keys ``(1,H,N,D)``, values ``(1,H,N,Dv)``, validity
    ``(1,N)`` (padding zeroed): the last W positions of [its state, its keys], taken from the state
    where the document is shorter than W (empty slots without a state), rolled for a shared
    ``pos``. Returns a state of batch Nd: k ``(Nd,H,W,D)``, v ``(Nd,H,W,Dv)``, valid ``(Nd,W)``."""
    W = window
    _, H, N, D = keys.shape
    Dv = values.shape[-1]
    starts, ends = cu_seqlens[:-1, None], cu_seqlens[1:, None]  # (Nd, 1)
    p = ends - W + torch.arange(W, device=keys.device)  # (Nd, W): packed position of ordered slot i
    inside = p >= starts  # (Nd, W): slot i holds one of the document's own keys
    if N:
        at = p.clamp(min=0)
        new_k = keys[0][:, at].transpose(0, 1)  # (Nd, H, W, D)
        new_v = values[0][:, at].transpose(0, 1)  # (Nd, H, W, Dv)
        new_valid = valid[0][at] & inside  # (Nd, W)
    else:
        new_k = keys.new_zeros(p.shape[0], H, W, D)
        new_v = values.new_zeros(p.shape[0], H, W, Dv)
        new_valid = inside
    if state is None:
        old_k, old_v, old_valid = new_k.new_zeros(()), new_v.new_zeros(()), torch.zeros_like(inside)
    else:
        k0, v0, valid0 = _ordered(state)
        s = (p - starts + W).clamp(0, W - 1)  # (Nd, W): the state's ordered index of position p
        old_k = k0.to(keys.dtype).gather(2, s[:, None, :, None].expand(-1, H, -1, D))
        old_v = v0.to(values.dtype).gather(2, s[:, None, :, None].expand(-1, H, -1, Dv))
        old_valid = valid0.gather(1, s)
    ring_k = torch.where(inside[:, None, :, None], new_k, old_k)
    ring_v = torch.where(inside[:, None, :, None], new_v, old_v)
    ring_valid = torch.where(inside, new_valid, old_valid)
    shift = pos % W  # ordered index i is position pos - W + i, which lives in slot (pos + i) % W
    return LocalAttentionState(ring_k.roll(shift, dims=2), ring_v.roll(shift, dims=2),
                               ring_valid.roll(shift, dims=1), pos)


def _decoding_step(q: Tensor, k: Tensor, v: Tensor, state: LocalAttentionState, scale: float,
                   return_state: bool):
    """One unpadded query at position ``pos = state.pos``: ``q, k (B, H, 1, D)``, ``v (B, H, 1, Dv)``.

    It sees positions pos - W .. pos: the W ring slots (the valid ones) and itself. Softmax does not
    depend on the order of its keys, so the ring is used as it lies, not rolled into order, and one
    SDPA over [ring, new key] replaces the general path's rolls, block windows and band mask (at
    B = 1, H = 8, W = 256, D = 64 most of a step's time). The new key then takes slot pos % W,
    which held position pos - W, the one that leaves the window.
    """
    dt = compute_dtype(q.dtype)
    W = state.k.shape[2]
    keys = torch.cat([state.k.to(k.dtype), k], 2)  # (B, H, W + 1, D)
    values = torch.cat([state.v.to(v.dtype), v], 2)
    allowed = F.pad(state.valid, (0, 1), value=True)[:, None, None, :]  # (B, 1, 1, W + 1): itself always
    out = F.scaled_dot_product_attention(q.to(dt), keys.to(dt), values.to(dt), attn_mask=allowed,
                                         scale=scale).to(q.dtype)
    if not return_state:
        return out
    slot = state.pos % W
    valid = state.valid.clone()
    valid[:, slot] = True
    ring = lambda x, new: torch.cat([x[:, :, :slot], new, x[:, :, slot + 1 : W]], 2)  # noqa: E731
    return out, LocalAttentionState(ring(keys, k), ring(values, v), valid, state.pos + 1)


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    initial_state: LocalAttentionState | None = None,
    return_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, LocalAttentionState]]:
    """Sliding-window softmax attention: query i attends the keys j with ``|i - j| <= window``
    (causal: ``i - window <= j <= i``), in O(N * window) time and memory.

    Args:
        q: ``(B, H, N, D)`` queries; query i sits at position i (after the state's, if any).
        k: ``(B, H, N, D)`` keys of the same positions.
        v: ``(B, H, N, Dv)`` values.
        window: largest distance attended, >= 1. Bidirectional queries see up to 2 window + 1 keys,
            causal ones up to window + 1 (themselves included).
        causal: attend only to the left (and to the key at the query's own position).
        key_padding_mask: bool ``(B, N)``, True = a real key that may be attended, False = padding.
            Padded positions still count as positions; their content (even NaN) never reaches an
            output or a real input's gradient.
        scale: logit scale, ``1/sqrt(D)`` when None.
        initial_state: causal only: the state after an earlier part of the sequence; the call
            continues it (query i is position ``initial_state.pos + i``). With ``cu_seqlens``, one
            ring per document (batch Nd), each continued by its document.
        return_state: causal only: also return the state after the last position (with
            ``cu_seqlens``, one ring per document, ``pos`` = the state's ``pos`` (0 without one) +
            the longest document's length; see :class:`LocalAttentionState`).
        cu_seqlens: integer (int32 or int64) ``(Nd + 1,)`` offsets ``[0, ..., N]`` of Nd documents packed back to back
            (flash-attention's varlen convention; empty documents allowed), with B = 1: document d
            is positions ``[cu_seqlens[d], cu_seqlens[d+1])`` and no query sees another document.
            Equals one call per document, at the cost of one call on N positions. Causal or
            bidirectional (within each document); checked by :func:`linattn.functional.varlen.check_cu_seqlens`.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype (computed in float32 for half inputs), and with
        ``return_state`` a :class:`LocalAttentionState`. A query with no real key in its window
        gets zeros.
    """
    fn = "local_attention"
    window = _check_args(fn, q, k, v, window, causal, key_padding_mask, initial_state, return_state, cu_seqlens)
    cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
    scale = check_scale(fn, scale, q.shape[-1])
    with no_autocast(q.device.type):
        if cu_seqlens is not None:
            return _packed_local(q, k, v, key_padding_mask, initial_state, cu_seqlens, window=window,
                                 causal=causal, scale=scale, return_state=return_state)
        if initial_state is not None and q.shape[2] == 1 and key_padding_mask is None:
            return _decoding_step(q, k, v, initial_state, scale, return_state)
        keys, values, valid, offset = _key_sequence(k, v, key_padding_mask, initial_state)
        N = q.shape[2]
        if N == 0:
            out = (q @ k.transpose(-1, -2)) @ v  # (B, H, 0, Dv), attached to the graph
        else:
            dt = compute_dtype(q.dtype)
            out = _blocked(q.to(dt), keys.to(dt), values.to(dt), valid, offset, window=window, causal=causal,
                           scale=scale, valid_queries=key_padding_mask is None).to(q.dtype)
        if return_state:
            pos = (initial_state.pos if initial_state is not None else 0) + N
            return out, _next_state(keys, values, valid, window, pos)
        return out


def _packed_local(q, k, v, key_padding_mask, initial_state, cu_seqlens, *, window: int, causal: bool,
                  scale: float, return_state: bool):
    """:func:`local_attention` on packed documents (arguments checked): the blocked pass with a
    document mask, then the heads of the documents against their states (see the module docstring)."""
    N = q.shape[2]
    cu = longest = None
    if initial_state is not None or return_state:  # a state's rings and positions are per document
        cu = cu_seqlens.tolist()
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    keys, values, valid, _ = _key_sequence(k, v, key_padding_mask, None)
    if N == 0:
        out = (q @ k.transpose(-1, -2)) @ v  # (1, H, 0, Dv), attached to the graph
    else:
        dt = compute_dtype(q.dtype)
        qc, kc, vc = q.to(dt), keys.to(dt), values.to(dt)
        doc = _document_ids(cu_seqlens, N)[None]  # (1, N)
        # Without a state nothing is read from cu_seqlens on the host: the blocks are then sized by
        # the window rather than by the longest document (the document mask is exact either way).
        out = _blocked(qc, kc, vc, valid, 0, window=window, causal=causal, scale=scale,
                       valid_queries=key_padding_mask is None, doc=doc, longest=longest)
        if initial_state is not None:
            out = _state_heads(out, qc, kc, vc, valid, initial_state, cu, window=window, scale=scale)
        out = out.to(q.dtype)
    if return_state:
        pos = (initial_state.pos if initial_state is not None else 0) + longest
        return out, _packed_next_state(keys, values, valid, initial_state, cu_seqlens, window, pos)
    return out


def local_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    initial_state: LocalAttentionState | None = None,
    return_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, LocalAttentionState]]:
    """Plain O(N * L) local attention from the definition: the full (N, L) score matrix over the
    state's keys and the new ones, an explicit band mask, each row normalised. Same contract as
    :func:`local_attention`; tests trust this one, in float64.

    With ``cu_seqlens`` the keys are every document's state (Nd W keys, if any) then the N packed
    ones, each with its document and its position in that document (a state's at -W .. -1), and
    the mask adds ``same document``."""
    fn = "local_attention_reference"
    window = _check_args(fn, q, k, v, window, causal, key_padding_mask, initial_state, return_state, cu_seqlens)
    cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
    scale = check_scale(fn, scale, q.shape[-1])
    dt = compute_dtype(q.dtype)
    N = q.shape[2]
    if cu_seqlens is None:
        keys, values, valid, offset = _key_sequence(k, v, key_padding_mask, initial_state)
        i = torch.arange(N, device=q.device)[:, None] + offset  # (N, 1) query positions
        j = torch.arange(keys.shape[2], device=q.device)[None, :]  # (1, L) key positions
        same = True
    else:
        keys, values, valid, _ = _key_sequence(k, v, key_padding_mask, None)
        n = cu_seqlens.numel() - 1
        doc = _document_ids(cu_seqlens, N)  # (N,)
        rel = torch.arange(N, device=q.device) - cu_seqlens[doc]  # (N,) position in its document
        key_doc, key_rel = doc, rel
        if initial_state is not None:
            k0, v0, valid0 = _ordered(initial_state)  # (Nd, H, W, D), (Nd, H, W, Dv), (Nd, W)
            W = k0.shape[2]
            H = k0.shape[1]
            keys = torch.cat([k0.to(keys.dtype).transpose(0, 1).reshape(1, H, n * W, -1), keys], 2)  # (1, H, Nd W + N, D)
            values = torch.cat([v0.to(values.dtype).transpose(0, 1).reshape(1, H, n * W, -1), values], 2)
            valid = torch.cat([valid0.reshape(1, n * W), valid], 1)  # (1, Nd W + N)
            slots = torch.arange(W, device=q.device)
            key_doc = torch.cat([torch.arange(n, device=q.device).repeat_interleave(W), doc])
            key_rel = torch.cat([(slots - W).repeat(n), rel])
        i, j = rel[:, None], key_rel[None, :]  # (N, 1), (1, L)
        same = doc[:, None] == key_doc[None, :]  # (N, L)
    L = keys.shape[2]
    band = ((j <= i) & (j >= i - window)) if causal else ((i - j).abs() <= window)  # (N, L)
    allowed = band & same & valid[:, None, None, :]  # (B, 1, N, L)
    scores = (q.to(dt) @ keys.to(dt).transpose(-1, -2)) * scale  # (B, H, N, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach() if L else scores.sum(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(-1, keepdim=True)
    out = ((weights / torch.where(denom > 0, denom, torch.ones_like(denom))) @ values.to(dt)).to(q.dtype)
    if return_state:
        start = initial_state.pos if initial_state is not None else 0
        if cu_seqlens is None:
            return out, _next_state(keys, values, valid, window, start + N)
        longest = int(cu_seqlens.diff().max())
        packed_keys, packed_values, packed_valid, _ = _key_sequence(k, v, key_padding_mask, None)
        return out, _packed_next_state(packed_keys, packed_values, packed_valid, initial_state, cu_seqlens,
                                       window, start + longest)
    return out


SHARDING = HaloForm("local_attention")
"""Causal sliding-window attention over a sequence sharded along N: a rank fetches the ``window``
keys and values before its shard (``linattn.distributed.local_attention``). Options: ``window``."""
