"""What a causal recurrent mechanism contributes to context parallelism: its state summary.

One causal sequence sharded along N over P ranks (LASP / LASP-2, arXiv 2404.02882 and 2502.07563):
a recurrent mechanism sees the past only through a fixed-size state, and the map of one shard of
positions on that state is affine, ``S_out = A_r(S_in) + S_r``. So a rank needs from the ranks
before it only their summaries ``(A_r, S_r)``, and ONE all-gather of the summaries gives every
rank all of them. The exchange, the fold of the summaries and the collective checks are one
generic driver, ``linattn.distributed.context.sharded``; what differs between mechanisms is a
:class:`ShardForm`, defined in the mechanism's functional file beside its fast forms:

- ``summarize``: this rank's work. Rank 0 runs the functional form from the initial state and
  its output is final; its summary is its final state (its transition is never read). A later
  rank computes its shard's summary (its transition and its state from zero) and keeps what
  ``finish`` needs.
- ``fold``: the state after a shard, from the state before it and the shard's summary.
- ``finish``: a later rank's output, from what it kept and the state before its shard.
- ``state``: the folded state as the mechanism's public state type.

Two mechanisms have a past without a fixed-size summary and exchange something else, named by
:class:`GatherForm` (softmax attention: every earlier key and value) and :class:`HaloForm`
(sliding-window attention: the last ``window`` keys and values). This module holds only the types:
no collective, so the functional tier stays free of ``torch.distributed``.

Dimension legend: B batch, H heads, N this rank's positions.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch.nn.functional as F
from torch import Tensor

from .recurrence import prefix_sums

__all__ = ["GatherForm", "HaloForm", "ShardForm", "ShardPart", "cumulative_decay"]


class ShardPart(NamedTuple):
    """One rank's result of :attr:`ShardForm.summarize`.

    Attributes:
        summary: the tensors every rank receives, all in one dtype and of the same shapes on every
            rank: rank 0's final state (with a placeholder transition), a later rank's transition
            and state from zero.
        values: the numbers the ranks compare before the exchange (named by
            :attr:`ShardForm.check`): dtype code and every size but N, the scale, ...
        out: rank 0's output ``(B, H, N, Dv)``; None on later ranks.
        kept: what :attr:`ShardForm.finish` needs on a later rank.
    """

    summary: list[Tensor]
    values: list[float]
    out: Tensor | None
    kept: Any = None


class ShardForm(NamedTuple):
    """A recurrent mechanism's causal form over a sequence sharded along N (see the module docstring).

    Attributes:
        name: the mechanism's functional form, for messages.
        check: the names of :attr:`ShardPart.values`, in order.
        summarize: ``(first, initial_state, tensors, options) -> ShardPart``. ``tensors`` are the
            functional form's positional inputs for this rank's shard, ``options`` its keyword
            options; ``initial_state`` is read on rank 0 (``first``) only. Raises ValueError or
            TypeError for bad input (the driver makes every rank hear of it).
        fold: ``(state, summary) -> state``: the state after a shard (as ``summary`` pieces).
        finish: ``(kept, state) -> out``: a later rank's output given the state before its shard.
        state: ``pieces -> public state`` (LinearAttentionState, DecayedState, ...).
        uses: the names of the ``tensors`` (for messages and graph checks), in order.
    """

    name: str
    check: tuple[str, ...]
    summarize: Callable[[bool, Any, tuple, dict], ShardPart]
    fold: Callable[[list[Tensor], list[Tensor]], list[Tensor]]
    finish: Callable[[Any, list[Tensor]], Tensor]
    state: Callable[[list[Tensor]], Any]
    uses: tuple[str, ...]


class GatherForm(NamedTuple):
    """A mechanism whose past has no fixed-size summary (softmax attention: every earlier key): a
    rank gathers the keys and values of the ranks before it (O(N) memory per rank).

    Attributes:
        name: the functional form, for messages.
    """

    name: str


class HaloForm(NamedTuple):
    """A mechanism that reads a bounded window of the past (sliding-window attention): a rank
    fetches the ``window`` keys and values before its shard (a halo), turned into the functional
    form's decoding state.

    Attributes:
        name: the functional form, for messages.
    """

    name: str


def cumulative_decay(g: Tensor, dim: int, *, block: int = 64) -> Tensor:
    """``exp(g_0 + ... + g_t)`` along ``dim`` for log decays ``g <= 0`` (-inf allowed), in g's dtype
    (no float64): sums within blocks of ``block`` positions, then across the blocks' totals, so a
    value carries the rounding of about ``block + N / block`` additions rather than N. Every
    exponent is <= 0, and only sums are formed (no -inf - -inf)."""
    n = g.shape[dim]
    if n <= block:
        return prefix_sums(g, dim, rounded_once=True).exp()
    gm = g.movedim(dim, -1)  # (..., N)
    nb = -(-n // block)
    local = F.pad(gm, (0, nb * block - n)).unflatten(-1, (nb, block))
    local = prefix_sums(local, -1, rounded_once=True)  # (..., nb, block)
    totals = prefix_sums(local[..., -1], -1, rounded_once=True)  # (..., nb): through the end of each block
    before = F.pad(totals[..., :-1], (1, 0))  # (..., nb): the sum of the blocks before each
    b = (local + before[..., None]).flatten(-2)[..., :n]
    return b.exp().movedim(-1, dim)
