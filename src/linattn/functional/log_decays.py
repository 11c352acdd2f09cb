"""Cumulative log decays within a chunk, in the compute dtype (float32 for float32 and half inputs):
the one representation, and the one reset threshold, of every chunked form that decays its state
(``gated_linear_attention``, ``delta_rule_attention``).

A chunked form needs ``exp(b_t - b_s)`` for positions s <= t of a chunk, with ``b`` the cumulative
sum of the log decays from the chunk's start. Summed plainly in float32, one large decay early in
a chunk (a document boundary is -inf; gates reach -1e4) would leave ``b_t - b_s`` of the positions
after it as the difference of two large numbers, and the small decays between them would keep few
of their digits. So the sum is held in two parts, ``b = small + RESET_STEP * resets``:

- a log decay below :data:`RESET_LOG_DECAY` (-40: exp(-40) = 4e-18, far below any dtype's
  rounding of the state it multiplies) is a *reset*, a decay of exactly 0; ``resets`` counts the
  resets up to each position (small integers, exact in any float dtype);
- ``small`` sums the other log decays, each >= -40, so it stays moderate and its differences
  keep their digits.

A difference of two positions is then ``(small_t - small_s) + RESET_STEP * (resets_t - resets_s)``:
exactly the small decays between them when no reset lies between, and at most
``RESET_STEP + 40 * C`` (far below exp's range, so exp gives 0) when one does. No float64, so
the forms run as they are on devices without it (MPS) or slow at it (consumer GPUs), and no -inf
ever enters a difference (-inf - -inf would be NaN). The gradient with respect to a reset's log
decay is taken as 0 (its true value carries the factor exp(g) < 4e-18).

Dimension legend: any leading dimensions, C positions of a chunk along ``dim``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .recurrence import prefix_sums_

__all__ = ["NEGLIGIBLE_DECAY", "NEGLIGIBLE_DECAY_FLOAT32", "RESET_LOG_DECAY", "RESET_STEP", "CumulativeLogDecay",
           "flush_low", "flush_negligible", "negligible_decay"]

# A log decay below this is a reset (a decay of exactly 0) inside the chunked forms.
RESET_LOG_DECAY = -40.0
# What each reset adds to a cumulative log decay: any difference across a reset is at most this
# plus 40 per position of a chunk (C <= 256 keeps it below -5000), and exp of it is exactly 0.
RESET_STEP = -1.0e4
# A decay factor (a product of decays, scale 1) below this is taken as exactly 0, as one step's
# decay below exp(RESET_LOG_DECAY) is: what it would multiply is 4e-18 of its scale, far below any
# float's resolution, and left in, the products of such factors fall into the subnormal range,
# where CPUs compute several times slower (matrix products on several threads: flush-to-zero modes are
# per thread). Trained Gated DeltaNet layers have such decays (A up to 16: a chunk's cumulative
# decay reaches exp(-100) and less). The CPU strategy flushes them; the accelerator strategy keeps
# them (GPUs compute subnormal numbers at full speed), all but a reset's, which is exactly 0 on both.
NEGLIGIBLE_DECAY = 4.248354255291589e-18  # exp(RESET_LOG_DECAY)
# The same for a float32 compute dtype (float32 and half inputs): 2**-40 (9.1e-13), still 6e4 times
# below float32's resolution (6e-8) of what it multiplies, and the product of two such factors
# (2**-80) times the data stays far inside float32's normal range (down to 2**-126). Factors near
# exp(-40) left subnormal products in float32 (a Qwen3.5 layer's decays at initialisation:
# docs/benchmarks/README.md, History), which CPUs compute several times slower; flush-to-zero is a
# per-thread mode, so it cannot be set for the threads of torch's matrix products.
NEGLIGIBLE_DECAY_FLOAT32 = 2.0 ** -40


def negligible_decay(dtype: torch.dtype) -> float:
    """The flush threshold of decay factors (and of anything else of scale 1 built from them) in the
    compute dtype ``dtype``: :data:`NEGLIGIBLE_DECAY` for float64, else
    :data:`NEGLIGIBLE_DECAY_FLOAT32`."""
    return NEGLIGIBLE_DECAY if dtype == torch.float64 else NEGLIGIBLE_DECAY_FLOAT32


def flush_negligible(factors: Tensor) -> Tensor:
    """``factors`` (decay factors in [0, 1]) with those at or below :func:`negligible_decay` of their
    dtype set to 0, in place (NaN stays NaN); returns it. One pass (``threshold_``), where a
    comparison and a ``masked_fill_`` took two and a mask."""
    return F.threshold_(factors, negligible_decay(factors.dtype), 0.0)


def flush_low(factors: Tensor, flush: bool = True) -> Tensor:
    """:func:`flush_negligible` of products of decays where a CPU would pay for their subnormal
    numbers: with ``flush`` (the CPU strategy's choice; an accelerator computes subnormal numbers at
    full speed and keeps them) and in a float32 or half compute dtype. float64's are left as they
    are: no subnormal slowdown there above 1e-308, and flushing them at exp(-40) moved KDA's
    float64 result by 6e-11 of its scale under strong decays, against 4e-16 without. Returns
    ``factors``, flushed in place or not."""
    return factors if not flush or factors.dtype == torch.float64 else flush_negligible(factors)


class CumulativeLogDecay:
    """``b = small + RESET_STEP * resets`` of a chunk's log decays (see the module docstring).

    Indexing, ``view``, ``reshape`` and ``transpose`` apply to both parts alike, so code written
    for a tensor of cumulative log decays reads the same; ``a - b`` is the difference as a tensor
    and :meth:`exp` is ``exp(b)`` (``b`` relative to the chunk's start, where it is 0). The parts
    are two tensors: stacked in one, the strided reads measured slower.
    """

    __slots__ = ("small", "resets")

    def __init__(self, small: Tensor, resets: Tensor) -> None:
        self.small, self.resets = small, resets

    @staticmethod
    def of(g: Tensor, dim: int) -> "CumulativeLogDecay":
        """The cumulative sums along ``dim`` of the log decays ``g`` (<= 0, -inf allowed), in g's dtype."""
        reset = g < RESET_LOG_DECAY
        # where, not masked_fill: one pass (an out-of-place masked_fill is a copy, then the fill)
        return CumulativeLogDecay(prefix_sums_(torch.where(reset, 0.0, g), dim, rounded_once=True),
                                  prefix_sums_(reset.to(g.dtype), dim))

    @property
    def shape(self) -> torch.Size:
        return self.small.shape

    @property
    def device(self) -> torch.device:
        return self.small.device

    def __getitem__(self, index) -> "CumulativeLogDecay":
        return CumulativeLogDecay(self.small[index], self.resets[index])

    def view(self, *shape) -> "CumulativeLogDecay":
        return CumulativeLogDecay(self.small.view(*shape), self.resets.view(*shape))

    def reshape(self, *shape) -> "CumulativeLogDecay":
        return CumulativeLogDecay(self.small.reshape(*shape), self.resets.reshape(*shape))

    def transpose(self, a: int, b: int) -> "CumulativeLogDecay":
        return CumulativeLogDecay(self.small.transpose(a, b), self.resets.transpose(a, b))

    def __sub__(self, other: "CumulativeLogDecay") -> Tensor:
        return self.sub(other)

    def sub(self, other: "CumulativeLogDecay", out: Tensor | None = None, scratch: Tensor | None = None) -> Tensor:
        """``self - other`` as a tensor, written into ``out`` (and the resets' difference into
        ``scratch``) when given: buffers of the difference's shape."""
        diff = torch.sub(self.small, other.small, out=out)
        return diff.add_(torch.sub(self.resets, other.resets, out=scratch), alpha=RESET_STEP)

    def exp(self) -> Tensor:
        """``exp(b)``: the decay from the chunk's start to each position."""
        return torch.add(self.small, self.resets, alpha=RESET_STEP).exp_()
