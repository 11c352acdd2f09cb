"""Context parallelism for the layers that are not a fixed-size recurrence: what a rank needs of the
positions BEFORE its shard, fetched by one differentiable all-gather.

A model sharded along N (every rank of a group holds a contiguous shard of the same sequences,
ranks in order) runs its recurrent mechanisms with :mod:`linattn.distributed.context` (one summary
per rank). Three layer kinds need more than a summary:

- a short causal convolution of kernel K reads the K - 1 inputs before each position: the shard's
  first K - 1 positions read the end of the previous rank's shard (:func:`halo`);
- sliding-window attention of window W reads the W keys and values before each query: the shard's
  first W queries read the previous rank's last W keys and values, or, when that shard is shorter
  than W, also earlier ranks' (:func:`local_attention`, a halo of width W turned into the
  functional form's ring-buffer state);
- softmax attention reads every earlier key: :func:`softmax_attention` gathers every rank's keys
  and values, O(N) memory per rank, the price of exact softmax layers in a hybrid stack.

Every function here is collective: each rank of the group calls it with its own shard, and when one
rank runs backward through its result, every rank must (the gather's backward is an all-reduce).
The result of every rank is tied to the gathered tensor (:func:`linattn.distributed.depend_on`),
also where it reads nothing gathered (rank 0), so that its backward joins. Before the data, the
ranks exchange their shard sizes (one small all-gather of float64 numbers); a shard whose sizes
other than N differ from the others' raises a ValueError on every rank instead of a hang.

:class:`ContextParallel` is what a model's forward takes: the group and the global position of the
rank's first token, which only absolute positions (learned, sinusoidal, rotary) need; the
mechanisms here learn the lengths of the other shards from the size exchange and never read it.
:func:`check_context_parallel` checks once per forward that the offsets are the running sums of
the shard lengths.

Dimension legend: B batch, H heads, N this rank's positions, D query/key width, Dv value width,
W window (the halo's width), R the flattened non-position sizes of a halo's input, P ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..functional.checks import check_qkv, check_scale, compute_dtype, no_autocast
from ..functional import local, softmax
from ..functional.local import LocalAttentionState
from ..functional.sharding import GatherForm, HaloForm, ShardForm
from .context import all_gather_differentiable, depend_on, group_place, sharded

__all__ = [
    "ContextParallel",
    "Halo",
    "check_context_parallel",
    "halo",
    "local_attention",
    "softmax_attention",
]

_PREFIX = "linattn.distributed."
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)


class ContextParallel(NamedTuple):
    """This rank's place in a sequence sharded along N over a process group.

    Attributes:
        group: the process group whose ranks hold the shards, in rank order (None: the default
            group).
        offset: the global position of this rank's first token: the sum of the lengths of the
            shards of ranks 0 .. rank - 1 (0 on rank 0). With equal shards of n tokens,
            ``rank * n``.
    """

    group: object = None
    offset: int = 0

    def attend(self, form, tensors: tuple, options: dict) -> Tensor:
        """The causal form of a mechanism over this rank's shard: what a layer calls in place of the
        functional form, given the mechanism's sharded form (``form``, from
        :mod:`linattn.functional.sharding`: the module attribute ``SHARDING`` of its functional
        file) and the functional form's inputs (``tensors``, q first) and options. The kind of
        ``form`` picks the exchange: a state summary (:func:`linattn.distributed.context.sharded`,
        every recurrent mechanism), the keys and values of the ranks before (softmax), or a halo of
        them (sliding window). Collective."""
        if not options.get("causal", True):
            raise ValueError("ContextParallel.attend: a sharded sequence is causal; got causal=False")
        if isinstance(form, ShardForm):
            fn = _PREFIX + form.name
            where = group_place(fn, self.group)
            if where is None:  # the whole sequence is this shard: the functional form itself
                return form.summarize(fn, True, None, tensors, options).out
            return sharded(fn, form, where, tensors, options)
        # the sharded layers below are causal by definition: they take no causal option
        layer_options = {k: v for k, v in options.items() if k != "causal"}
        if isinstance(form, GatherForm):
            return softmax_attention(*tensors, group=self.group, **layer_options)
        if isinstance(form, HaloForm):
            return local_attention(*tensors, group=self.group, **layer_options)
        raise TypeError(f"ContextParallel.attend: form must be a ShardForm, GatherForm or HaloForm "
                        f"(linattn.functional.sharding), got {type(form).__name__}")

    def halo(self, x: Tensor, width: int, *, dim: int) -> "Halo":
        """:func:`halo` over this context's group: the ``width`` positions before this rank's shard
        of ``x`` along ``dim``. Collective."""
        return halo(x, width, dim=dim, group=self.group)


class Halo(NamedTuple):
    """The positions just before this rank's shard.

    Attributes:
        values: the input's layout with ``width`` positions along its position dimension: position
            ``start - width + i`` of the whole sequence at index i (``start`` this shard's first
            position); zeros where there is no such position (before position 0).
        valid: bool ``(width,)``, True where index i holds a real position.
    """

    values: Tensor
    valid: Tensor


def _sizes(fn: str, where, x: Tensor, dim: int, what: str) -> list[int]:
    """The size exchange: one all-gather of ``[N, dtype, other sizes]`` per rank (float64, on the
    CPU for gloo, on ``x``'s device otherwise). Raises the same ValueError on every rank when the
    ranks' tensors differ in anything but the size along ``dim``; returns every rank's N."""
    group, rank, P = where
    other = [s for i, s in enumerate(x.shape) if i != dim % x.dim()]
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else x.device
    mine = torch.tensor([x.shape[dim], code, x.dim(), *other], dtype=torch.float64, device=device)
    # tensors of different ranks (numbers of dimensions) cannot be gathered: pad to a fixed length
    mine = F.pad(mine, (0, 16 - mine.numel()), value=-1.0) if mine.numel() <= 16 else mine[:16]
    rows = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()  # (P, 16)
    if len({tuple(row[1:]) for row in table}) > 1:
        shown = "; ".join(f"rank {j}: {_DTYPES[int(row[1])] if row[1] < len(_DTYPES) else 'another dtype'} "
                          f"{[int(s) for s in row[3:3 + int(row[2]) - 1]]}" for j, row in enumerate(table))
        raise ValueError(f"{fn}: the ranks' {what} must differ in N (the positions) alone, but their dtypes or "
                         f"other sizes differ ({shown})")
    return [int(row[0]) for row in table]


def check_context_parallel(fn: str, context_parallel, n: int, *, device: torch.device | None = None) -> list[int]:
    """Check ``context_parallel`` and that the ranks' offsets are the running sums of their shard
    lengths: one all-gather of ``(offset, n)`` per rank. Collective: every rank of the group calls
    it; a bad offset on one rank raises the same ValueError on every rank.

    Args:
        fn: the caller's name, for the messages.
        context_parallel: a :class:`ContextParallel`.
        n: this rank's number of positions.
        device: where the two numbers travel for backends other than gloo (nccl: a CUDA device).

    Returns:
        every rank's number of positions, in rank order (``[n]`` without a process group).
    """
    if not isinstance(context_parallel, ContextParallel):
        raise TypeError(f"{fn}: context_parallel must be a linattn.distributed.ContextParallel(group, offset), "
                        f"got {type(context_parallel).__name__}")
    offset = context_parallel.offset
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{fn}: context_parallel.offset must be an int >= 0, got {offset!r}")
    where = group_place(fn, context_parallel.group)
    if where is None:
        if offset != 0:
            raise ValueError(f"{fn}: context_parallel.offset = {offset} but there is no group of several ranks "
                             "(no initialised process group, or one rank): the only shard is the whole sequence, "
                             "at offset 0")
        return [n]
    group, rank, P = where
    if dist.get_backend(group) == "gloo" or device is None:
        device = torch.device("cpu")
    mine = torch.tensor([offset, n], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()  # (P, 2)
    lengths = [row[1] for row in table]
    expected = [sum(lengths[:j]) for j in range(P)]
    if [row[0] for row in table] != expected:
        shown = ", ".join(f"rank {j}: offset {row[0]}, {row[1]} positions" for j, row in enumerate(table))
        raise ValueError(f"{fn}: context_parallel offsets must be the running sums of the shard lengths "
                         f"(shards contiguous, in rank order: {expected}), got {shown}")
    return lengths


def _gather_halo(fn: str, where, x: Tensor, width: int, dim: int, what: str) -> tuple[Halo, list[int]]:
    """:func:`halo` with a group of several ranks; also every rank's N."""
    group, rank, P = where
    lengths = _sizes(fn, where, x, dim, what)
    w = min(width, max(lengths))  # a wider halo than the longest shard would only send padding
    y = x.movedim(dim, 0)  # (N, ...)
    rest = y.shape[1:]
    R = rest.numel()
    flat = y.reshape(y.shape[0], R)  # (N, R); R spelled out: N may be 0
    take = min(w, flat.shape[0])
    tail = F.pad(flat[flat.shape[0] - take:], (0, 0, w - take, 0))  # (w, R): the shard's last rows, zeros in front
    rows = all_gather_differentiable(tail, group=group).reshape(P * w, R)  # rank j's row i at j * w + i
    # the positions before this shard, newest first: rank r-1's last rows, then rank r-2's, ...
    idx = []
    for j in range(rank - 1, -1, -1):
        have = min(w, lengths[j])
        need = width - len(idx)
        idx += [j * w + i for i in range(w - 1, w - 1 - min(have, need), -1)]
        if len(idx) == width:
            break
    idx.reverse()
    got = rows[torch.tensor(idx, dtype=torch.long, device=x.device)]  # (m, R)
    got = depend_on(F.pad(got, (0, 0, width - len(idx), 0)), rows)  # (width, R); tied for rank 0
    valid = torch.zeros(width, dtype=torch.bool, device=x.device)
    valid[width - len(idx):] = True
    return Halo(got.reshape(width, *rest).movedim(0, dim), valid), lengths


def halo(x: Tensor, width: int, *, dim: int, group=None) -> Halo:
    """The ``width`` positions just before this rank's shard of a sequence sharded along ``dim``.

    Rank r sends its last ``min(width, N_r)`` positions (padded to the longest shard's, when that
    is shorter than ``width``) in one differentiable all-gather and keeps the ``width`` positions
    before its own shard: rank r-1's last ones, and earlier ranks' when rank r-1's shard is
    shorter. Gradients flow back to the ranks that own those positions. Collective (see the module
    docstring); shards may have any lengths, 0 included.

    Args:
        x: this rank's shard, positions along ``dim`` (N may differ between ranks; every other size
            and the dtype must agree: checked).
        width: how many positions before the shard, >= 0.
        dim: the position dimension of ``x``.
        group: the process group (None: the default group).

    Returns:
        a :class:`Halo`: ``values`` of ``x``'s shape with ``width`` along ``dim`` (zeros before
        position 0), and its ``valid`` ``(width,)``. Without a group of several ranks: zeros, none
        valid.
    """
    fn = _PREFIX + "halo"
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"{fn}: width must be an int >= 0, got {width!r}")
    if not isinstance(x, Tensor) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{fn}: dim = {dim} is not a dimension of x "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    where = group_place(fn, group)
    if where is None:
        shape = list(x.shape)
        shape[dim] = width
        return Halo(x.new_zeros(shape), torch.zeros(width, dtype=torch.bool, device=x.device))
    return _gather_halo(fn, where, x, width, dim, "inputs")[0]


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    group=None,
    scale: float | None = None,
) -> Tensor:
    """Causal sliding-window attention (:func:`linattn.functional.local_attention` with
    ``causal=True``) over one sequence sharded along N across the ranks of ``group``.

    A halo exchange: one all-gather of every rank's last ``min(W, N)`` keys and values (:func:`halo`
    of ``[k, v]``); the W positions before this shard become the functional form's ring-buffer
    state (:class:`LocalAttentionState`, ``pos`` the shard's first global position), from which
    this rank's queries continue. Exchanges ``B H min(W, N_max) (D + Dv)`` numbers per rank, and
    as many back in the backward.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys.
        v: ``(B, H, N, Dv)`` this rank's values (B, H, D, Dv and dtype alike on every rank; N may
            differ, 0 included).
        window: W, the largest distance attended (query i sees positions i - W .. i).
        group: the process group (None: the default group); no initialised group or a group of
            one rank: exactly the functional call.
        scale: logit scale, None: ``1/sqrt(D)``.

    Returns:
        ``(B, H, N, Dv)`` this rank's outputs, differentiable in q, k, v of every rank.
    """
    fn = _PREFIX + "local_attention"
    where = group_place(fn, group)
    if where is None:
        return local.local_attention(q, k, v, window=window, causal=True, scale=scale)
    check_qkv(fn, q, k, v, causal=True)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{fn}: window must be an int >= 1, got {window!r}")
    D = q.shape[-1]
    (kv, valid), lengths = _gather_halo(fn, where, torch.cat([k, v], dim=-1), window, 2, "keys and values")
    start = sum(lengths[:where[1]])  # this shard's first global position
    # ordered index i is position start - W + i; the ring keeps position p in slot p % W
    shift = start % window
    ring = kv.roll(shift, dims=2)  # (B, H, W, D + Dv)
    state = LocalAttentionState(ring[..., :D], ring[..., D:], valid.roll(shift, 0).expand(q.shape[0], window), start)
    out = local.local_attention(q, k, v, window=window, causal=True, scale=scale, initial_state=state)
    return depend_on(out, kv)  # an empty shard's output reads no state: tie it all the same


def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    scale: float | None = None,
) -> Tensor:
    """Causal softmax attention (:func:`linattn.functional.softmax_attention` with ``causal=True``)
    over one sequence sharded along N across the ranks of ``group``, by gathering keys and values.

    Softmax has no fixed-size summary of the past, so every rank's keys and values travel: one
    differentiable all-gather of ``[k, v]`` (padded to the longest shard), after which rank r's
    queries, at global positions ``start .. start + N - 1``, attend keys ``0 .. start + N - 1``
    under a causal mask shifted by ``start`` (one SDPA call with a boolean mask). Costs per rank:
    ``B H N_max (D + Dv)`` numbers sent and ``P`` times that received and held (O(N) of the whole
    sequence for keys and values), ``O(N_r (start + N_r))`` scores (the last rank does the most
    work), and in the backward an all-reduce of the gathered keys' and values' gradient.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys.
        v: ``(B, H, N, Dv)`` this rank's values (B, H, D, Dv and dtype alike on every rank; N may
            differ, 0 included).
        group: the process group (None: the default group); no initialised group or a group of
            one rank: exactly the functional call.
        scale: logit scale, None: ``1/sqrt(D)``.

    Returns:
        ``(B, H, N, Dv)`` this rank's outputs, differentiable in q, k, v of every rank.
    """
    fn = _PREFIX + "softmax_attention"
    where = group_place(fn, group)
    if where is None:
        return softmax.softmax_attention(q, k, v, causal=True, scale=scale)
    check_qkv(fn, q, k, v, causal=True)
    scale = check_scale(fn, scale, q.shape[-1])
    group, rank, P = where
    D = q.shape[-1]
    kv = torch.cat([k, v], dim=-1)  # (B, H, N, D + Dv)
    lengths = _sizes(fn, where, kv, 2, "keys and values")
    n_max = max(lengths)
    padded = F.pad(kv, (0, 0, 0, n_max - kv.shape[2]))  # (B, H, N_max, D + Dv)
    rows = all_gather_differentiable(padded, group=group)  # (P, B, H, N_max, D + Dv)
    # the earlier ranks' keys from the gather, this rank's own (the same numbers, a shorter graph)
    kv_all = torch.cat([rows[j, :, :, :lengths[j]] for j in range(rank)] + [kv], dim=2)  # (B, H, start + N, D + Dv)
    start = kv_all.shape[2] - kv.shape[2]
    N = q.shape[2]
    with no_autocast(q.device.type):
        dt = compute_dtype(q.dtype)
        keys, values = kv_all[..., :D].to(dt), kv_all[..., D:].to(dt)
        i = torch.arange(N, device=q.device)[:, None] + start  # (N, 1): the queries' global positions
        j = torch.arange(kv_all.shape[2], device=q.device)[None, :]  # (1, start + N)
        if N == 0:
            out = (q.to(dt) @ keys.transpose(-1, -2)) @ values  # (B, H, 0, Dv), attached to the graph
        else:
            # every query sees at least its own key: no row of the mask is empty
            out = F.scaled_dot_product_attention(q.to(dt), keys, values, attn_mask=j <= i, scale=scale)
        out = out.to(q.dtype)
    return depend_on(out, rows)  # rank 0 reads no gathered row: tie it all the same
