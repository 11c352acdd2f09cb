"""The state of the gated and delta-rule mechanisms (``gated_linear_attention``,
``delta_rule_attention``): one matrix per head, with no normaliser.

Both are recurrences ``S_t = A_t S_{t-1} + k_t (something)_t^T`` read out as ``o_t = scale S_t^T q_t``:
their state after position t is the matrix ``S (B, H, D, Dv)`` and nothing else, so one type serves
both, and a state returned by one form (chunked, recurrent step) resumes the other.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .checks import shape_str

__all__ = ["DecayedState", "check_decayed_state"]


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
