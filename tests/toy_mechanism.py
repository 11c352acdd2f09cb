"""A toy mechanism written the way a new one is added: a functional fast form and its reference, a
state summary for sharding (``SHARDING``), one ``nn`` module and one registry entry. The tests
register it (:func:`register`) and check that it appears everywhere mechanisms are listed or run,
with no other edit.

Unnormalised causal linear attention with the identity feature map, its keys halved:
``o_i = q_i . S_i``, ``S_i = S_{i-1} + (k_i / 2) v_i^T``, state ``S (B, H, D, Dv)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from linattn.config import Config
from linattn.functional.sharding import ShardForm, ShardPart
from linattn.nn.mechanisms import Mechanism
from linattn.nn.registry import MECHANISMS, MechanismSpec


def toy_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, key_padding_mask: Tensor | None = None,
                  initial_state: Tensor | None = None, return_state: bool = False):
    """The fast form: prefix sums of ``(k / 2) v^T`` per position, read by q."""
    if not causal:
        raise ValueError("toy_attention: causal only")
    if key_padding_mask is not None:
        k = k * key_padding_mask[:, None, :, None]
    kv = (k / 2).unsqueeze(-1) * v.unsqueeze(-2)  # (B, H, N, D, Dv)
    S = kv.cumsum(2)
    if initial_state is not None:
        S = S + initial_state.unsqueeze(2)
    out = (q.unsqueeze(-2) @ S).squeeze(-2)  # (B, H, N, Dv)
    if not return_state:
        return out
    last = (k / 2).transpose(-1, -2) @ v  # (B, H, D, Dv)
    return out, (last if initial_state is None else last + initial_state)


def toy_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                            key_padding_mask: Tensor | None = None, initial_state: Tensor | None = None,
                            return_state: bool = False):
    """Position by position."""
    if not causal:
        raise ValueError("toy_attention_reference: causal only")
    B, H, N, D = q.shape
    S = q.new_zeros(B, H, D, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for i in range(N):
        ki = k[:, :, i] if key_padding_mask is None else k[:, :, i] * key_padding_mask[:, None, i, None]
        S = S + (ki / 2)[..., None] * v[:, :, i, None, :]
        outs.append((q[:, :, i, None, :] @ S)[:, :, 0])
    out = torch.stack(outs, 2) if outs else q.new_zeros(B, H, 0, v.shape[-1])
    return (out, S) if return_state else out


def _summarize(fn, first, initial_state, tensors, options):
    q, k, v = tensors
    if first:
        out, S = toy_attention(q, k, v, initial_state=initial_state, return_state=True)
    else:
        out, S = None, (k / 2).transpose(-1, -2) @ v
    return ShardPart([S], [q.shape[0], q.shape[1], q.shape[-1], v.shape[-1]], out, tensors)


SHARDING = ShardForm("toy_attention", ("B", "H", "D", "Dv"), _summarize,
                     lambda state, s: s if state is None else [state[0] + s[0]],
                     lambda kept, state: toy_attention(*kept, initial_state=state[0]),
                     lambda state: state[0], ("q", "k", "v"))


@dataclass(frozen=True)
class ToyConfig(Config):
    """The toy mechanism; no options."""


class ToyMechanism(Mechanism):
    name = "toy"
    sharding = SHARDING

    def __init__(self, config: ToyConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config

    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        return toy_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, return_state=return_state)

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v), {"causal": causal}

    def initial_state(self, batch_size, *, device=None, dtype=None):
        return torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)

    def step(self, q, k, v, state, *, x=None):
        return toy_attention(q, k, v, initial_state=state, return_state=True)


SPEC = MechanismSpec("toy", ToyConfig, ToyMechanism, toy_attention, toy_attention_reference,
                     frozenset({"causal", "recurrent", "sharded"}), rotary=True, shared_qk=False, state_type=Tensor,
                     summary="toy: unnormalised causal linear attention with halved keys")


def register() -> None:
    """Add the toy to the registry (in this process)."""
    MECHANISMS["toy"] = SPEC
