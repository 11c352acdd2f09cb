"""Context parallelism: one causal sequence sharded along N over the ranks of a process group.

LASP / LASP-2 (Sun et al., arXiv 2404.02882 and 2502.07563). A causal recurrent mechanism sees the
past only through a fixed-size state, and the map of one shard of positions on that state is
affine: ``S_out = A_r(S_in) + S_r``. Rank r holds positions ``[n_0 + ... + n_{r-1}, ... + n_r)``
of the sequence (shards in rank order, any lengths), computes its summary ``(A_r, S_r)``, and ONE
all-gather of the summaries gives every rank all of them. Rank r folds the summaries of ranks
0 .. r-1, in order, into its incoming state ``S_in`` and computes its outputs from it:

    linear attention   A_r = identity              S_r = (sum phi(k) v^T, sum phi(k)) of the shard
    FAVOR+             the same sums, kept divided by exp(log_scale) (a running maximum); two
                       summaries combine at the larger log_scale, the smaller one rescaled by
                       exp(smaller - larger) <= 1, never by exp of a positive difference
    gated linear       A_r(S) = diag(exp(sum of log_decay over the shard)) S, per head or per key
                       channel; S_r the shard's state from zero
    delta rule         A_r(S) = M_r S, M_r (D, D) the product of the shard's transitions
                       exp(g_t) (I - beta_t k_t k_t^T); S_r the shard's state from zero

Rank 0 needs no summary of its own: it runs its shard from ``initial_state`` with the functional
form and sends the state after its shard (``A_0`` is never used). Ranks r > 0:

- linear attention: ``S_r`` is one product ``phi(k)^T [v, 1]``; the outputs are a second call of
  :func:`linattn.functional.linear_attention` with ``initial_state = S_in`` (the normaliser divides
  the output, so a correction added afterwards cannot be exact without the undivided parts).
- FAVOR+: the summary is the functional call's returned state (its stabiliser is the functional
  form's own), the outputs a second call from ``S_in``.
- gated linear attention: one call from zero gives the local outputs and ``S_r``; since the state
  after position t of the shard is ``exp(b_t) * S_in + (local state)_t`` with ``b_t`` the cumulative
  log decay of the shard, the output is the local one plus ``scale (q_t * exp(b_t))^T S_in``: exact,
  one product, every exponent <= 0.
- delta rule: one call with values ``[v, 0]`` ((Dv + D) columns) from the state ``[0 | I]``: its
  final state is ``[S_r | M_r]``, and its output's last D columns are ``scale M_t^T q_t`` (the
  product of the transitions up to t, applied to q_t), so the output from ``S_in`` is the first Dv
  columns plus ``(scale M_t^T q_t)^T S_in``: exact, one call of width Dv + D instead of two calls.

The backward sends state gradients the other way: the all-gather is differentiable
(:func:`all_gather_differentiable`), its backward all-reduces (sums) the gradient of the gathered
summaries over the ranks and keeps this rank's slot, since every rank's loss may read every
summary. The total loss is the sum of the ranks' losses, as in data parallelism. Every rank must
therefore run backward through its result (output or returned state) when any rank does; rank 0,
whose output reads no summary, is tied to the gathered tensor with a zero-gradient term for that
reason.

Before the summaries, the ranks exchange a few numbers (``check_shards``): whether their local
work succeeded, whether they build a graph, their dtype and every size but N. A bad shard on one
rank then raises the same way on every rank (its own error there, a ValueError naming it on the
others) instead of leaving the others waiting in a collective.

Written for any backend (tensors stay on the inputs' device; the check uses a CPU tensor with
gloo, the inputs' device otherwise); tested with gloo on CPU only. nccl on CUDA is untested.

Dimension legend: B batch, H heads, N this rank's positions, D query/key width, Dv value width,
F feature width, G gate width (1 per head, D per key channel), P ranks in the group, L length of
one rank's flattened summary.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import delta, favor, gated, linear
from ..functional.checks import check_positive_int, check_qkv, check_scale, compute_dtype, no_autocast, shape_str
from ..functional.decayed_state import DecayedState
from ..functional.feature_maps import FeatureMap, resolve_feature_map
from ..functional.linear import LinearAttentionState

__all__ = [
    "all_gather_differentiable",
    "delta_rule_attention",
    "depend_on",
    "favor_attention",
    "gated_linear_attention",
    "group_place",
    "linear_attention",
]

_PREFIX = "linattn.distributed."
# dtypes the shard check can name (a code per dtype: the check exchanges numbers only)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    """``x (L,)`` -> ``(P, L)``, row j rank j's ``x``. Backward: the gathered gradient summed over
    the ranks (every rank's loss may read every row), row ``rank`` of it.

    An all-reduce of the whole ``(P, L)`` gradient costs more than a reduce-scatter would, but gloo
    has no reduce-scatter and the summaries are small; one code path serves every backend.
    (``torch.distributed.nn.functional.all_gather`` does the same over gloo, through an all-to-all,
    but is deprecated in this torch.)
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        x = x.contiguous()
        rows = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, x, group=group)
        return torch.stack(rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        g = g.contiguous().clone()  # all_reduce works in place; the incoming gradient is not ours
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g[ctx.rank], None


def all_gather_differentiable(x: Tensor, *, group=None) -> Tensor:
    """Every rank's ``x`` stacked in rank order, with a backward that sums the gradient over ranks.

    Args:
        x: any shape ``(...)``, the same shape and dtype on every rank of ``group``.
        group: the process group (None: the default group).

    Returns:
        ``(P, ...)``: row j is rank j's ``x``. Differentiable: the gradient reaching this rank's
        ``x`` is the sum over all ranks of the gradient of their row ``rank``, so the ranks' losses
        add up as one loss. Collective in both directions: every rank must call it, and when one
        rank runs backward through it, every rank must.
    """
    return _AllGather.apply(x, group)


def depend_on(x: Tensor, anchor: Tensor) -> Tensor:
    """``x`` unchanged, but with ``anchor`` in its graph (zero gradient): backward through ``x``
    then reaches the gather behind ``anchor``, whose backward is a collective every rank must join,
    also on a rank whose result reads no gathered value (rank 0's output)."""
    if not (anchor.requires_grad and torch.is_grad_enabled()):
        return x
    return x + anchor.reshape(-1)[:0].sum().to(x.dtype)  # + 0, from an empty slice of anchor


def group_place(fn: str, group) -> tuple[object, int, int] | None:
    """``(group, rank, P)`` to shard over, or None when the call is the functional one (no
    initialised process group, or a group of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"{fn}: group was given but torch.distributed has no initialised process group")
        return None
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{fn}: this process is not a member of group (its rank there is {rank})")
    return (group, rank, P) if P > 1 else None


def _check_device(group, q) -> torch.device:
    """Where the shard check's numbers live: CPU for gloo, the inputs' device for other backends
    (nccl needs CUDA tensors)."""
    if dist.get_backend(group) == "gloo" or not isinstance(q, Tensor):
        return torch.device("cpu")
    return q.device


def _show(name: str, value: float) -> str:
    if name == "dtype":
        return str(_DTYPES[int(value)]) if 0 <= value < len(_DTYPES) else "another dtype"
    return repr(value) if name == "scale" else str(int(value))


def _agree(fn: str, where, device: torch.device, names: tuple[str, ...], values: list[float] | None,
           grad: bool, error: BaseException | None) -> None:
    """The shard check: one all-gather of ``[failed, grad, *values]`` (float64, one row per rank);
    then, the same way on every rank, raise this rank's own ``error``, or a ValueError naming the
    ranks that failed, whose graph flags differ, or whose ``values`` (``names``: dtype and every size
    but N) differ."""
    group, rank, P = where
    mine = torch.tensor([float(error is not None), float(grad), *(values or [-1.0] * len(names))],
                        dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()  # (P, 2 + len(names))
    if error is not None:
        raise error
    failed = [j for j in range(P) if table[j][0]]
    if failed:
        raise ValueError(f"{fn}: rank(s) {failed} of the group rejected their shard (the error raised on "
                         "those ranks says why); no rank computes on")
    if len({row[1] for row in table}) > 1:
        flags = ", ".join(f"rank {j}: {'yes' if row[1] else 'no'}" for j, row in enumerate(table))
        raise ValueError(
            f"{fn}: some ranks build a graph for backward and others do not ({flags}); the backward "
            "exchanges state gradients between all ranks, so inputs must require grad on every rank or "
            "on none (and grad mode must agree)")
    bad = []
    for i, name in enumerate(names):
        column = [row[2 + i] for row in table]
        if len(set(column)) > 1:
            bad.append(f"{name} (" + ", ".join(f"rank {j}: {_show(name, c)}" for j, c in enumerate(column)) + ")")
    if bad:
        raise ValueError(f"{fn}: the ranks' shards must differ in N alone (q (B, H, N, D), v (B, H, N, Dv)), "
                         f"but they differ in " + "; ".join(bad))


def _dtype_code(t: Tensor) -> float:
    return float(_DTYPES.index(t.dtype)) if t.dtype in _DTYPES else float(len(_DTYPES))


def _run(fn: str, where, inputs: list, names: tuple[str, ...], check_shards: bool,
         local: Callable[[], tuple[list[Tensor], list[float]]]) -> tuple[Tensor, list[list[Tensor]]]:
    """Run this rank's ``local`` work (-> its summary's tensors, all in one dtype, and the values
    the shard check compares), check the shards, gather the summaries. ``inputs``: the call's
    tensors (q first; None and non-tensors are skipped), which decide whether this rank builds a
    graph. Returns the gathered ``(P, L)`` and, for each rank in order, its summary's tensors
    (views of that row)."""
    error = pieces = values = None
    try:
        pieces, values = local()
    except (ValueError, TypeError) as e:  # bad input: let the other ranks hear of it, not hang
        if not check_shards:
            raise
        error = e
    tracked = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    grad = torch.is_grad_enabled() and bool(tracked)
    flat = None if pieces is None else torch.cat([p.reshape(-1) for p in pieces])
    if check_shards:
        _agree(fn, where, _check_device(where[0], inputs[0]), names, values, grad, error)
    if grad and not flat.requires_grad:
        # an empty shard on rank 0 without an initial state sends constant zeros, yet this rank
        # must join the gather's backward all the same when the others run theirs
        flat = depend_on(flat, tracked[0])
    rows = all_gather_differentiable(flat, group=where[0])  # (P, L)
    shapes = [p.shape for p in pieces]  # the same on every rank: the check compared the sizes
    return rows, [_unpack(row, shapes) for row in rows.unbind(0)]


def _unpack(row: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """One rank's flattened summary ``(L,)`` -> its tensors of ``shapes``."""
    out, at = [], 0
    for s in shapes:
        n = s.numel()
        out.append(row[at:at + n].view(s))
        at += n
    return out


def _state_tensors(state, rank: int) -> list:
    """The tensors of ``initial_state`` where it is read (rank 0), else none."""
    return list(state) if rank == 0 and isinstance(state, tuple) else []


def _device_type(q) -> str:
    return q.device.type if isinstance(q, Tensor) else "cpu"


def _no_mask(fn: str, key_padding_mask) -> None:
    if key_padding_mask is not None:
        raise ValueError(f"{fn}: key_padding_mask is not supported in the context-parallel form (each "
                         "shard would need its own part of it); pass None")


# ---------------------------------------------------------------------------------------------
# The mechanisms
# ---------------------------------------------------------------------------------------------


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    group=None,
    key_padding_mask: Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = 64,
    tile_positions: int = 4096,
    check_shards: bool = True,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Causal kernel attention (:func:`linattn.functional.linear_attention` with ``causal=True``)
    over one sequence sharded along N across the ranks of ``group``: this rank's shard in, this
    rank's outputs out.

    Collective: every rank of the group calls it with its shard, shards in rank order (rank 0 holds
    the first positions), of any lengths (1 and 0 included). Exchanges one summary per rank,
    ``B H F (Dv + 1)`` numbers (docs/context_parallel.md). Tested with gloo on CPU; written for
    nccl on CUDA but untested there.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys.
        v: ``(B, H, N, Dv)`` this rank's values. B, H, D, Dv and the dtype must be the same on
            every rank (checked, see ``check_shards``); N may differ.
        feature_map: as in :func:`linattn.functional.linear_attention`; the same on every rank
            (not checked).
        group: the ``torch.distributed`` process group (None: the default group). With no
            initialised process group, or a group of one rank, this is exactly the functional call.
        key_padding_mask: not supported here; must be None (ValueError otherwise).
        initial_state: the state before rank 0's shard. Only rank 0's value is read (and gets a
            gradient); the other ranks' values are ignored.
        return_state: also return the state after the LAST rank's shard, on every rank.
        chunk_size, tile_positions: tuning knobs of the functional form, passed on.
        check_shards: first exchange a few numbers per rank (dtype, sizes, success of the local
            work, whether a graph is built), so that a bad shard raises on every rank (its own
            error on that rank, a ValueError naming it on the others) instead of leaving the
            others waiting in a collective. False skips that exchange (one small all-gather and a
            device-to-host copy) once the set-up is known to be right.

    Returns:
        ``(B, H, N, Dv)`` this rank's outputs in the input dtype, and with ``return_state`` the
        :class:`LinearAttentionState` after the whole sequence (float32 for half inputs).
        Differentiable in q, k, v and rank 0's ``initial_state``: when any rank runs backward, every
        rank must (the state gradients travel back through a collective).
    """
    fn = _PREFIX + "linear_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(feature_map=feature_map, causal=True, chunk_size=chunk_size, tile_positions=tile_positions)
    where = group_place(fn, group)
    if where is None:
        return linear.linear_attention(q, k, v, initial_state=initial_state, return_state=return_state, **opts)
    rank, P = where[1], where[2]
    first = []  # rank 0's output, from the local work

    def local():
        check_positive_int(fn, "chunk_size", chunk_size)
        check_positive_int(fn, "tile_positions", tile_positions)
        if rank == 0:
            out, st = linear.linear_attention(q, k, v, initial_state=initial_state, return_state=True, **opts)
            first.append(out)
            S, z = st.S, st.z
        else:
            check_qkv(fn, q, k, v, causal=True)
            dt = compute_dtype(q.dtype)
            kf = resolve_feature_map(fn, feature_map)(k.to(dt))  # (B, H, N, F)
            if not isinstance(kf, Tensor) or kf.dim() != 4 or kf.shape[:3] != k.shape[:3]:
                got = shape_str(kf) if isinstance(kf, Tensor) else type(kf).__name__
                raise ValueError(f"{fn}: feature_map must map k {shape_str(k)} to (B, H, N, F), got {got}")
            kf = kf.to(dt)
            S, z = kf.transpose(-1, -2) @ v.to(dt), kf.sum(2)  # (B, H, F, Dv), (B, H, F)
        B, H, Fd, Dv = S.shape
        return [S, z], [_dtype_code(q), B, H, q.shape[-1], Dv, Fd]

    with no_autocast(_device_type(q)):
        rows, summaries = _run(fn, where, [q, k, v, *_state_tensors(initial_state, rank)],
                               ("dtype", "B", "H", "D", "Dv", "F"), check_shards, local)

        def upto(n: int) -> LinearAttentionState:
            """The state after the shards of ranks 0 .. n-1: sums, the transitions are identities."""
            S, z = summaries[0]
            for S_j, z_j in summaries[1:n]:
                S, z = S + S_j, z + z_j
            return LinearAttentionState(S=S, z=z)

        if rank == 0:
            out = depend_on(first[0], rows)
        else:
            out = linear.linear_attention(q, k, v, initial_state=upto(rank), return_state=False, **opts)
        return (out, upto(P)) if return_state else out


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    kernel: str = "softmax",
    features: str = "positive",
    group=None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = 64,
    tile_entries: int = 1 << 20,
    check_shards: bool = True,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Causal FAVOR+ (:func:`linattn.functional.favor_attention` with ``causal=True``) over one
    sequence sharded along N across the ranks of ``group``: this rank's shard in, its outputs out.

    Collective, with the contract of :func:`linear_attention` (shards in rank order, any lengths;
    only rank 0's ``initial_state`` is read; ``return_state`` gives the state after the last
    rank's shard on every rank; every rank runs backward when one does). Exchanges
    ``B H (F (Dv + 1) + 1)`` numbers per rank: the sums and their log_scale. Summaries combine at
    the larger log_scale (the other rescaled by exp of a difference <= 0), as the functional form's
    running maximum does; the stabiliser gets no gradient, as there. Ranks after the first call
    the functional form twice (summary, then outputs). Tested with gloo on CPU; nccl untested.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys.
        v: ``(B, H, N, Dv)`` this rank's values (B, H, D, Dv, dtype alike on every rank; N may
            differ).
        projection: ``(m, D)``, the same on every rank (not checked).
        kernel, features, scale, chunk_size, tile_entries: as in the functional form, the same on
            every rank (``scale`` is checked).
        group: the process group (None: the default group); no initialised group or a group of
            one rank: exactly the functional call.
        key_padding_mask: not supported here; must be None.
        initial_state: the state before rank 0's shard; only rank 0's value is read.
        return_state: also return the state after the last rank's shard, on every rank.
        check_shards: as in :func:`linear_attention`.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the
        :class:`LinearAttentionState` (with ``log_scale``) after the whole sequence.
    """
    fn = _PREFIX + "favor_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(kernel=kernel, features=features, causal=True, scale=scale, chunk_size=chunk_size,
                tile_entries=tile_entries)
    where = group_place(fn, group)
    if where is None:
        return favor.favor_attention(q, k, v, projection, initial_state=initial_state, return_state=return_state,
                                     **opts)
    rank, P = where[1], where[2]
    first = []

    def local():
        out, st = favor.favor_attention(q, k, v, projection, initial_state=initial_state if rank == 0 else None,
                                        return_state=True, **opts)
        log_scale = st.log_scale
        if q.shape[2] == 0 and (rank > 0 or initial_state is None):
            # an empty shard's sums are 0 at any scale: the lowest finite one never raises the
            # scale of a combination (the functional form reports 0)
            log_scale = torch.full_like(log_scale, torch.finfo(log_scale.dtype).min)
        if rank == 0:
            first.append(out)
        B, H, Fd, Dv = st.S.shape
        return [st.S, st.z, log_scale], [_dtype_code(q), B, H, q.shape[-1], Dv, Fd,
                                         check_scale(fn, scale, q.shape[-1])]

    with no_autocast(_device_type(q)):
        rows, summaries = _run(fn, where, [q, k, v, *_state_tensors(initial_state, rank)],
                               ("dtype", "B", "H", "D", "Dv", "F", "scale"), check_shards, local)

        def upto(n: int) -> LinearAttentionState:
            """The state after the shards of ranks 0 .. n-1: sums at the larger of two log_scales."""
            S, z, c = summaries[0]
            c = c.detach()  # the stabiliser, as in the functional form: no gradient
            for S_j, z_j, c_j in summaries[1:n]:
                c_j = c_j.detach()
                top = torch.maximum(c, c_j)  # (B, H)
                a, b = torch.exp(c - top), torch.exp(c_j - top)  # both <= 1
                S = S * a[..., None, None] + S_j * b[..., None, None]
                z = z * a[..., None] + z_j * b[..., None]
                c = top
            return LinearAttentionState(S=S, z=z, log_scale=c)

        if rank == 0:
            out = depend_on(first[0], rows)
        else:
            out = favor.favor_attention(q, k, v, projection, initial_state=upto(rank), return_state=False, **opts)
        return (out, upto(P)) if return_state else out


def gated_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    *,
    scale: float | None = None,
    group=None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    check_shards: bool = True,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Gated linear attention (:func:`linattn.functional.gated_linear_attention`) over one sequence
    sharded along N across the ranks of ``group``: this rank's shard in, its outputs out.

    Collective, with the contract of :func:`linear_attention`. Exchanges ``B H (D Dv + G)``
    numbers per rank: the shard's state from zero and its total decay exp(sum of log_decay)
    (G = 1 per head, D per key channel). Every rank calls the
    functional form once; ranks after the first add ``scale (q_t * exp(b_t))^T S_in`` to its
    output (``b_t`` the shard's cumulative log decay, summed in float64). Tested with gloo on CPU;
    nccl untested.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys.
        v: ``(B, H, N, Dv)`` this rank's values (B, H, D, Dv, dtype alike on every rank).
        log_decay: ``(B, H, N)`` (per head) or ``(B, H, N, D)`` (per key channel), this rank's
            positions; the same form on every rank (checked).
        scale: the read-out factor, None: ``1/sqrt(D)``; the same on every rank (checked).
        group: the process group (None: the default group); no initialised group or a group of
            one rank: exactly the functional call.
        key_padding_mask: not supported here; must be None.
        initial_state: the :class:`DecayedState` before rank 0's shard; only rank 0's is read.
        return_state: also return the state after the last rank's shard, on every rank.
        chunk_size: the functional form's tuning knob, passed on.
        check_shards: as in :func:`linear_attention`.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the :class:`DecayedState`
        after the whole sequence. Differentiable in q, k, v, log_decay and rank 0's initial state.
    """
    fn = _PREFIX + "gated_linear_attention"
    _no_mask(fn, key_padding_mask)
    where = group_place(fn, group)
    if where is None:
        return gated.gated_linear_attention(q, k, v, log_decay, scale=scale, initial_state=initial_state,
                                            return_state=return_state, chunk_size=chunk_size)
    rank, P = where[1], where[2]
    kept = {}

    def local():
        if rank == 0:
            out, st = gated.gated_linear_attention(q, k, v, log_decay, scale=scale, initial_state=initial_state,
                                                   return_state=True, chunk_size=chunk_size)
        else:
            check_qkv(fn, q, k, v, causal=True)
            dt = compute_dtype(q.dtype)  # the correction is added before the cast to the input dtype
            out, st = gated.gated_linear_attention(q.to(dt), k.to(dt), v.to(dt), log_decay, scale=scale,
                                                   return_state=True, chunk_size=chunk_size)
        s = st.s  # (B, H, D, Dv)
        G = 1 if log_decay.dim() == 3 else q.shape[-1]
        gate = log_decay.unsqueeze(-1) if G == 1 else log_decay  # (B, H, N, G)
        if rank == 0:
            decay = s.new_zeros(*s.shape[:2], G)  # rank 0's transition is never read
        else:
            # cumulative log decay in float64, as the functional form's chunks do: a huge decay
            # early in the shard must not drown the digits of small ones after it
            b = gate.to(torch.float64).cumsum(2)  # (B, H, N, G)
            kept["decay_to_t"] = torch.exp(b).to(s.dtype)  # the decay from the shard's start to t, <= 1
            decay = torch.exp(gate.to(torch.float64).sum(2)).to(s.dtype)  # (B, H, G)
        kept["out"] = out
        return [decay, s], [_dtype_code(q), s.shape[0], s.shape[1], q.shape[-1], s.shape[-1], G,
                            check_scale(fn, scale, q.shape[-1])]

    with no_autocast(_device_type(q)):
        rows, summaries = _run(fn, where, [q, k, v, log_decay, *_state_tensors(initial_state, rank)],
                               ("dtype", "B", "H", "D", "Dv", "G", "scale"), check_shards, local)

        def upto(n: int) -> Tensor:
            """The state after the shards of ranks 0 .. n-1, ``(B, H, D, Dv)``."""
            s = summaries[0][1]
            for decay, s_j in summaries[1:n]:
                s = decay[..., None] * s + s_j  # (B, H, G, 1): every row (G = 1) or row d (G = D)
            return s

        out = kept["out"]
        if rank == 0:
            out = depend_on(out, rows)
        else:
            s_in = upto(rank)
            qd = q.to(s_in.dtype) * kept["decay_to_t"]  # (B, H, N, D): q_t * exp(b_t)
            out = (out + check_scale(fn, scale, q.shape[-1]) * (qd @ s_in)).to(q.dtype)
        return (out, DecayedState(upto(P))) if return_state else out


def delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    log_decay: Tensor | None = None,
    scale: float | None = None,
    group=None,
    key_padding_mask: Tensor | None = None,
    initial_state: DecayedState | None = None,
    return_state: bool = False,
    chunk_size: int = 32,
    check_shards: bool = True,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Delta-rule attention (:func:`linattn.functional.delta_rule_attention`, DeltaNet / Gated
    DeltaNet) over one sequence sharded along N across the ranks of ``group``: this rank's shard in,
    its outputs out.

    Collective, with the contract of :func:`linear_attention`. Exchanges ``B H D (D + Dv)``
    numbers per rank: the product ``M_r (D, D)`` of the shard's transitions and its state from zero.
    Ranks after the first get both, and the outputs, from ONE functional call with values
    ``[v, 0]`` and initial state ``[0 | I]`` (width Dv + D): its final state is ``[S_r | M_r]`` and
    its last D output columns are ``scale M_t^T q_t``, so the output from ``S_in`` is its first Dv
    columns plus ``(scale M_t^T q_t)^T S_in``. Tested with gloo on CPU; nccl untested.

    Args:
        q: ``(B, H, N, D)`` this rank's queries.
        k: ``(B, H, N, D)`` this rank's keys, expected L2-normalised (as in the functional form).
        v: ``(B, H, N, Dv)`` this rank's values (B, H, D, Dv, dtype alike on every rank).
        beta: ``(B, H, N)`` write strengths in [0, 2].
        log_decay: None (DeltaNet) or ``(B, H, N)`` (Gated DeltaNet); None on every rank or on
            none (checked).
        scale: the read-out factor, None: ``1/sqrt(D)``; the same on every rank (checked).
        group: the process group (None: the default group); no initialised group or a group of
            one rank: exactly the functional call.
        key_padding_mask: not supported here; must be None.
        initial_state: the :class:`DecayedState` before rank 0's shard; only rank 0's is read.
        return_state: also return the state after the last rank's shard, on every rank.
        chunk_size: the functional form's tuning knob, passed on.
        check_shards: as in :func:`linear_attention`.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the :class:`DecayedState`
        after the whole sequence. Differentiable in q, k, v, beta, log_decay and rank 0's initial
        state.
    """
    fn = _PREFIX + "delta_rule_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(log_decay=log_decay, scale=scale, chunk_size=chunk_size)
    where = group_place(fn, group)
    if where is None:
        return delta.delta_rule_attention(q, k, v, beta, initial_state=initial_state, return_state=return_state,
                                          **opts)
    rank, P = where[1], where[2]
    kept = {}

    def local():
        if rank == 0:
            out, st = delta.delta_rule_attention(q, k, v, beta, initial_state=initial_state, return_state=True,
                                                 **opts)
            B, H, D, Dv = st.s.shape
            s, M = st.s, st.s.new_zeros(B, H, D, D)  # rank 0's transition is never read
        else:
            check_qkv(fn, q, k, v, causal=True)
            dt = compute_dtype(q.dtype)  # the correction is added before the cast to the input dtype
            B, H, N, D = q.shape
            Dv = v.shape[-1]
            v_ext = torch.cat([v.to(dt), v.new_zeros(B, H, N, D, dtype=dt)], dim=-1)  # (B, H, N, Dv + D)
            eye = torch.eye(D, dtype=dt, device=q.device).expand(B, H, D, D)
            s0 = torch.cat([v.new_zeros(B, H, D, Dv, dtype=dt), eye], dim=-1)  # [0 | I], (B, H, D, Dv + D)
            o_ext, st = delta.delta_rule_attention(q.to(dt), k.to(dt), v_ext, beta, initial_state=DecayedState(s0),
                                                   return_state=True, **opts)
            out, kept["reads"] = o_ext[..., :Dv], o_ext[..., Dv:]  # local output, scale M_t^T q_t (B, H, N, D)
            s, M = st.s[..., :Dv], st.s[..., Dv:]
        kept["out"] = out
        return [M, s], [_dtype_code(q), B, H, D, Dv, float(log_decay is not None),
                        check_scale(fn, scale, q.shape[-1])]

    with no_autocast(_device_type(q)):
        rows, summaries = _run(fn, where, [q, k, v, beta, log_decay, *_state_tensors(initial_state, rank)],
                               ("dtype", "B", "H", "D", "Dv", "log_decay given", "scale"), check_shards, local)

        def upto(n: int) -> Tensor:
            """The state after the shards of ranks 0 .. n-1, ``(B, H, D, Dv)``."""
            s = summaries[0][1]
            for M, s_j in summaries[1:n]:
                s = M @ s + s_j
            return s

        out = kept["out"]
        if rank == 0:
            out = depend_on(out, rows)
        else:
            out = (out + kept["reads"] @ upto(rank)).to(q.dtype)
        return (out, DecayedState(upto(P))) if return_state else out
