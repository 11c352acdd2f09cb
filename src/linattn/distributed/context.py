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
form and sends the state after its shard (``A_0`` is never used). What a later rank computes, and
how it finishes its output from the state before its shard, is the mechanism's
:class:`~linattn.functional.sharding.ShardForm`, defined beside its fast forms
(``linattn.functional.linear.SHARDING``, ``favor.SHARDING``, ``gated.SHARDING``,
``delta.SHARDING``); :func:`sharded` is the one driver that exchanges and folds the summaries for
all of them.

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
from ..functional.checks import no_autocast
from ..functional.decayed_state import DecayedState
from ..functional.feature_maps import FeatureMap
from ..functional.linear import LinearAttentionState
from ..functional.sharding import ShardForm

__all__ = [
    "all_gather_differentiable",
    "delta_rule_attention",
    "depend_on",
    "favor_attention",
    "gated_linear_attention",
    "group_place",
    "linear_attention",
    "sharded",
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
# The driver
# ---------------------------------------------------------------------------------------------


def sharded(fn: str, form: ShardForm, where, tensors: tuple, options: dict, *, initial_state=None,
            return_state: bool = False, check_shards: bool = True):
    """The causal form of the mechanism ``form`` describes, over one sequence sharded along N
    across the ranks of a group: this rank's shard in, this rank's outputs out (and with
    ``return_state`` the state after the whole sequence, on every rank).

    Rank 0 runs the functional form from ``initial_state``; every rank computes its summary
    (:class:`~linattn.functional.sharding.ShardForm`), the shard check and ONE differentiable
    all-gather exchange them, and a later rank folds the summaries of the ranks before it into its
    incoming state and finishes its output from it. ``where``: ``(group, rank, P)`` from
    :func:`group_place`; ``tensors`` and ``options``: the functional form's inputs for this rank's
    shard. Collective (see the module docstring)."""
    rank, P = where[1], where[2]
    first = rank == 0
    parts = []

    def local():
        part = form.summarize(fn, first, initial_state if first else None, tensors, options)
        parts.append(part)
        return part.summary, [_dtype_code(tensors[0]), *part.values]

    with no_autocast(_device_type(tensors[0])):
        rows, summaries = _run(fn, where, [*tensors, *_state_tensors(initial_state, rank)], ("dtype", *form.check),
                               check_shards, local)

        def upto(n: int) -> list[Tensor]:
            """The state after the shards of ranks 0 .. n-1."""
            state = form.fold(None, summaries[0])
            for summary in summaries[1:n]:
                state = form.fold(state, summary)
            return state

        out = depend_on(parts[0].out, rows) if first else form.finish(parts[0].kept, upto(rank))
        return (out, form.state(upto(P))) if return_state else out


# ---------------------------------------------------------------------------------------------
# The mechanisms: the functional forms' names and options plus ``group`` and ``check_shards``
# ---------------------------------------------------------------------------------------------

_COLLECTIVE = """Collective: every rank of the group calls it with its shard, shards in rank order (rank 0 holds
    the first positions), of any lengths (1 and 0 included); one summary per rank is exchanged
    ({summary}; docs/context_parallel.md). Only rank 0's ``initial_state`` is read (and gets a
    gradient); ``return_state`` gives the state after the LAST rank's shard on every rank; when any
    rank runs backward, every rank must (the state gradients travel back through a collective).
    With no initialised process group, or a group of one rank, this is exactly the functional
    call. ``key_padding_mask`` is not supported (each shard would need its own part of it): it
    must be None. ``check_shards``: first exchange a few numbers per rank (dtype, sizes, success
    of the local work, whether a graph is built), so that a bad shard raises on every rank (its
    own error on that rank, a ValueError naming it on the others) instead of leaving the others
    waiting in a collective; False skips that exchange once the set-up is known to be right.
    Tested with gloo on CPU; written for nccl on CUDA but untested there."""


def _collective(summary: str):
    def document(f):
        f.__doc__ = f.__doc__.replace("{collective}", _COLLECTIVE.format(summary=summary))
        return f
    return document


@_collective("B H F (Dv + 1) numbers")
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
    over one sequence sharded along N across the ranks of ``group`` (None: the default group), with
    the summary of :data:`linattn.functional.linear.SHARDING`.

    {collective}

    Shapes: q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``, this rank's positions (B, H, D, Dv and the
    dtype alike on every rank, checked) -> ``(B, H, N, Dv)`` in the input dtype, and with
    ``return_state`` a :class:`LinearAttentionState` (float32 for half inputs).
    """
    fn = _PREFIX + "linear_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(feature_map=feature_map, chunk_size=chunk_size, tile_positions=tile_positions)
    where = group_place(fn, group)
    if where is None:
        return linear.linear_attention(q, k, v, causal=True, initial_state=initial_state, return_state=return_state,
                                       **opts)
    return sharded(fn, linear.SHARDING, where, (q, k, v), opts, initial_state=initial_state,
                   return_state=return_state, check_shards=check_shards)


@_collective("B H (F (Dv + 1) + 1) numbers: the sums and their log_scale")
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
    sequence sharded along N across the ranks of ``group``, with the summary of
    :data:`linattn.functional.favor.SHARDING` (summaries combine at the larger log_scale; the
    stabiliser gets no gradient, as in the functional form). ``projection (m, D)``, ``kernel``,
    ``features``, ``scale`` (checked), ``chunk_size`` and ``tile_entries``: as in the functional
    form, the same on every rank.

    {collective}

    Returns ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the
    :class:`LinearAttentionState` (with ``log_scale``) after the whole sequence.
    """
    fn = _PREFIX + "favor_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(kernel=kernel, features=features, scale=scale, chunk_size=chunk_size, tile_entries=tile_entries)
    where = group_place(fn, group)
    if where is None:
        return favor.favor_attention(q, k, v, projection, causal=True, initial_state=initial_state,
                                     return_state=return_state, **opts)
    return sharded(fn, favor.SHARDING, where, (q, k, v, projection), opts, initial_state=initial_state,
                   return_state=return_state, check_shards=check_shards)


@_collective("B H (D Dv + G) numbers: the shard's state from zero and its total decay")
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
    sharded along N across the ranks of ``group``, with the summary of
    :data:`linattn.functional.gated.SHARDING`: one functional call per rank, a later rank adding
    ``scale (q_t * exp(b_t))^T S_in`` to its output. ``log_decay`` ``(B, H, N)`` or ``(B, H, N, D)``
    of this rank's positions, the same form on every rank (checked); ``scale`` checked alike.

    {collective}

    Returns ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the
    :class:`DecayedState` after the whole sequence. Differentiable in q, k, v, log_decay and rank
    0's initial state.
    """
    fn = _PREFIX + "gated_linear_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(scale=scale, chunk_size=chunk_size)
    where = group_place(fn, group)
    if where is None:
        return gated.gated_linear_attention(q, k, v, log_decay, initial_state=initial_state,
                                            return_state=return_state, **opts)
    return sharded(fn, gated.SHARDING, where, (q, k, v, log_decay), opts, initial_state=initial_state,
                   return_state=return_state, check_shards=check_shards)


@_collective("B H D (D + Dv) numbers: the product of the shard's transitions and its state from zero")
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
    chunk_size: int | None = None,
    check_shards: bool = True,
) -> Union[Tensor, tuple[Tensor, DecayedState]]:
    """Delta-rule attention (:func:`linattn.functional.delta_rule_attention`, DeltaNet / Gated
    DeltaNet) over one sequence sharded along N across the ranks of ``group``, with the summary of
    :data:`linattn.functional.delta.SHARDING`: one functional call of width Dv + D per rank.
    ``beta (B, H, N)``; ``log_decay`` None or ``(B, H, N)``, None on every rank or on none
    (checked); ``scale`` checked alike.

    {collective}

    Returns ``(B, H, N, Dv)`` in the input dtype, and with ``return_state`` the
    :class:`DecayedState` after the whole sequence. Differentiable in q, k, v, beta, log_decay and
    rank 0's initial state.
    """
    fn = _PREFIX + "delta_rule_attention"
    _no_mask(fn, key_padding_mask)
    opts = dict(log_decay=log_decay, scale=scale, chunk_size=chunk_size)
    where = group_place(fn, group)
    if where is None:
        return delta.delta_rule_attention(q, k, v, beta, initial_state=initial_state, return_state=return_state,
                                          **opts)
    return sharded(fn, delta.SHARDING, where, (q, k, v, beta), opts, initial_state=initial_state,
                   return_state=return_state, check_shards=check_shards)
