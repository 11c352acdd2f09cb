"""The state of the gated and delta-rule mechanisms (``gated_linear_attention``,
``delta_rule_attention``): one matrix per head, with no normaliser.

Both are recurrences ``S_t = A_t S_{t-1} + k_t (something)_t^T`` read out as ``o_t = scale S_t^T q_t``:
their state after position t is the matrix ``S (B, H, D, Dv)`` and nothing else, so one type serves
both, and a state returned by one form (chunked, recurrent step) resumes the other.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .checks import shape_str

__all__ = ["DecayedState", "check_decayed_state", "result_without_positions"]


class DecayedState(NamedTuple):
    """The recurrent state after some prefix of positions.

    Attributes:
        s: ``(B, H, D, Dv)``, the sum of the decayed (and, for the delta rule, corrected) outer
            products ``k v^T`` of every position so far. Kept in float32 for half inputs.
    """

    s: Tensor


def check_decayed_state(fn: str, state, B: int, H: int, D: int, Dv: int, device: torch.device) -> None:
    """Raise unless ``state`` is a :class:`DecayedState` whose ``s`` is ``(B, H, D, Dv)`` on
    ``device``, floating point; the message names the field and both shapes."""
    if not isinstance(state, DecayedState):
        raise TypeError(f"{fn}: initial_state must be a DecayedState, got {type(state).__name__}")
    s = state.s
    if not isinstance(s, Tensor) or not s.is_floating_point():
        raise TypeError(f"{fn}: initial_state.s must be a floating-point tensor, got {type(s).__name__}")
    if tuple(s.shape) != (B, H, D, Dv):
        raise ValueError(f"{fn}: initial_state.s must have shape (B, H, D, Dv) = ({B}, {H}, {D}, {Dv}), "
                         f"got {shape_str(s)}")
    if s.device != device:
        raise ValueError(f"{fn}: initial_state.s is on {s.device}, the inputs on {device}")


def result_without_positions(
    per_position: Sequence[Tensor], s0: Tensor | None, out_shape: tuple[int, ...], state_shape: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """The result of a decayed recurrence over inputs without a single position (B*H*N == 0: no
    batch row, no head, or N = 0), checked and in the compute dtype.

    Args:
        per_position: the inputs with a position dimension (q, k, v, the gates), every one empty.
        s0: ``(n, H, D, Dv)`` the initial state (n = B, or the number of packed documents), or None
            for zeros.
        out_shape: ``(B, H, N, Dv)``.
        state_shape: ``(n, H, D, Dv)``.

    Returns:
        ``out (B, H, N, Dv)``, empty, and the state after no step, ``(n, H, D, Dv)``: a new tensor
        equal to s0 (zeros without one), never s0 itself, so that the caller can change one without
        the other.

    Both are built from every input, as any non-empty call's results are, so that a loss on them
    backpropagates like any other: zero gradients of the inputs' shapes, and the identity from the
    state to s0. A sum over an empty tensor is exactly 0 and its gradient is empty, so ``nothing``
    links the per-position inputs at no cost to the values; s0's sum reaches ``out`` only by being
    broadcast into an empty tensor, so even an inf in s0 cannot make a NaN.
    """
    nothing = sum(x.sum() for x in per_position)  # exactly 0
    ref = per_position[0]
    s = (ref.new_zeros(state_shape) if s0 is None else s0) + nothing
    out = ref.new_zeros(out_shape) + (nothing + s.sum())
    return out, s
