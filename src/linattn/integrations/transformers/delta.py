"""The delta-rule families: Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Qwen4-exp, OLMo-Hybrid)
and Kimi Delta Attention (Kimi Linear, GLM5-Next, the Bailing hybrid), on
:func:`linattn.functional.delta_rule_attention`.

What linattn computes differently, on purpose: q, k, v, beta and the decays in float32 (float64 for a
float64 model, where transformers stays in float32), the recurrence chunked by linattn's engine, and
nothing else: projections, gates, norms and the cache are transformers' own code or the same formulas.
q and k are L2-normalised as every family does it, x / sqrt(sum x^2 + 1e-6) (Qwen and OLMo write
it x * rsqrt(...), the same up to rounding), by the engine itself (``qk_l2norm_eps``).

Dimension legend: B batch, N positions, Hk query/key heads, H value heads, Dk key width, Dv value
width, C convolution channels (2 Hk Dk + H Dv), K convolution kernel.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional import DecayedState, delta_rule_attention, delta_rule_attention_reference
from ...functional.varlen import check_cu_seqlens
from .layers import Family, Form, convolve, mask_padding, packed_cache, packed_offsets

# The eps of every family's q/k L2 normalisation, inside the root (transformers' l2norm functions)
L2NORM_EPS = 1e-6


class Projected(NamedTuple):
    """What a family's projections give the shared forward (B, N from the hidden states)."""

    mixed: Tensor  # (B, N, C): the convolution's input, channels [q; k; v]
    beta: Tensor  # (B, N, H): write strengths, in the model's dtype
    log_decay: Tensor  # (B, N, H) per head, or (B, N, H, Dk) per key channel (KDA): float32 or wider
    gate: Tensor  # (B, N, H, Dv): the output norm's gate


# ---------------------------------------------------------------------------------------------
# The families' projections: each writes its layer's formulas (read from transformers 5.23's
# modeling files), in the layer's own parameters, returning the shared forward's inputs
# ---------------------------------------------------------------------------------------------


def _per_head_decay(layer: nn.Module, a: Tensor) -> Tensor:
    """Mamba-2's log decay ``-exp(A_log) softplus(a + dt_bias)`` ``(B, N, H)``, with A_log and a taken
    to float32 first as the Qwen and OLMo layers do (a half A_log would overflow exp)."""
    return -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)


def _heads(x: Tensor, width: int) -> Tensor:
    return x.reshape(*x.shape[:2], -1, width)  # (B, N, heads, width)


def _project_qwen3_next(layer: nn.Module, hidden: Tensor) -> Projected:
    # in_proj_qkvz holds, per key head, [q, k, the group's v, the group's z] (in_proj_ba likewise
    # [b, a] per group): the layer's own method takes them apart
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(hidden), layer.in_proj_ba(hidden))
    B, N = hidden.shape[:2]
    mixed = torch.cat([q.reshape(B, N, -1), k.reshape(B, N, -1), v.reshape(B, N, -1)], dim=-1)
    return Projected(mixed, b.sigmoid(), _per_head_decay(layer, a), z)


def _project_qwen3_5(layer: nn.Module, hidden: Tensor) -> Projected:
    return Projected(layer.in_proj_qkv(hidden), layer.in_proj_b(hidden).sigmoid(),
                     _per_head_decay(layer, layer.in_proj_a(hidden)), _heads(layer.in_proj_z(hidden), layer.head_v_dim))


def _project_olmo_hybrid(layer: nn.Module, hidden: Tensor) -> Projected:
    mixed = torch.cat([layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)], dim=-1)
    beta = layer.b_proj(hidden).sigmoid()
    if layer.allow_neg_eigval:  # beta in [0, 2]: the transition may reflect (negative eigenvalue)
        beta = beta * 2.0
    return Projected(mixed, beta, _per_head_decay(layer, layer.a_proj(hidden)),
                     _heads(layer.g_proj(hidden), layer.head_v_dim))


def _project_kda(gate: Callable[[nn.Module, Tensor], Tensor]):
    def project(layer: nn.Module, hidden: Tensor) -> Projected:
        mixed = torch.cat([layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)], dim=-1)
        # the layer's forget gate module: its formula differs by family (a lower bound in GLM5 and
        # Bailing), (B, N, H, Dk)
        return Projected(mixed, layer.b_proj(hidden).sigmoid(), layer.forget_gate(hidden),
                         _heads(gate(layer, hidden), layer.head_dim))
    return project


def _reference_packed(q, k, v, beta, log_decay, cu_seqlens):
    """The float64 reference on packed documents, one document at a time (reads the offsets)."""
    cu = cu_seqlens.tolist()
    outs = [delta_rule_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b],
                                           log_decay=log_decay[:, :, a:b], qk_l2norm_eps=L2NORM_EPS)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=2)


def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, *,
               initial_state: Tensor | None = None, output_final_state: bool = False,
               cu_seqlens: Tensor | None = None,
               form: Form = "chunked") -> tuple[Tensor, Tensor | None]:
    """The gated delta rule (per-head ``g``) or KDA (per-channel ``g``) in transformers' layout and
    semantics, on linattn: what the replacement layers run, and a drop-in for transformers'
    ``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention`` with
    ``use_qk_l2norm_in_kernel=True``. Computes in float32 (float64 for float64 inputs); the output
    has the query's dtype, the state the compute dtype.

    Args:
        query, key: ``(B, N, Hk, Dk)``; value ``(B, N, H, Dv)`` with H a multiple of Hk.
        g: log decays ``(B, N, H)`` (per head) or ``(B, N, H, Dk)`` (per key channel), <= 0.
        beta: ``(B, N, H)`` in [0, 2].
        initial_state: None or ``(B, H, Dk, Dv)`` (``(n, H, Dk, Dv)`` with ``cu_seqlens``).
        output_final_state: also return the state after the last position.
        cu_seqlens: None or integer (int32 or int64) ``(n + 1,)`` offsets of n documents packed along N (B = 1).
        form: ``"chunked"`` or ``"reference"`` (linattn's recurrence, a loop over positions).

    Returns ``(out (B, N, H, Dv), state (B, H, Dk, Dv) or None)``.
    """
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    # q and k L2-normalised by the engine as it takes them (qk_l2norm_eps): no normalised copies
    q, k = query.transpose(1, 2).to(ct), key.transpose(1, 2).to(ct)  # (B, Hk, N, Dk)
    v = value.transpose(1, 2).to(ct)  # (B, H, N, Dv)
    beta = beta.transpose(1, 2).to(ct)  # (B, H, N)
    log_decay = g.transpose(1, 2).to(ct)  # (B, H, N[, Dk])
    initial = None if initial_state is None else DecayedState(initial_state.to(ct))
    if form == "reference":
        if cu_seqlens is not None:  # the chunked form's engine checks them itself; this loop reads them
            cu_seqlens = check_cu_seqlens("delta_rule", cu_seqlens, q, q_name="query (as (B, Hk, N, Dk))")
            out, new = _reference_packed(q, k, v, beta, log_decay, cu_seqlens), None
        else:
            out, new = delta_rule_attention_reference(q, k, v, beta, log_decay=log_decay, initial_state=initial,
                                                      return_state=True, qk_l2norm_eps=L2NORM_EPS)
    else:
        result = delta_rule_attention(q, k, v, beta, log_decay=log_decay, initial_state=initial,
                                      return_state=output_final_state, cu_seqlens=cu_seqlens, qk_l2norm_eps=L2NORM_EPS)
        out, new = result if output_final_state else (result, None)
    state = new.s if (output_final_state and new is not None) else None
    return out.transpose(1, 2).to(query.dtype), state  # (B, N, H, Dv)


def forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The replacement layers' forward, with the originals' arguments: ``hidden_states (B, N, hidden)``,
    transformers' cache or None, a 2-D padding mask (1 = real token) or None, and the model's keyword
    arguments, of which ``cu_seq_lens_q`` (packed documents, B = 1) is read.

    Padding is as transformers does it: padded positions' inputs are zeroed (exact for left
    padding, which ``generate`` uses)."""
    family: Family = self._linattn_family
    cu_seqlens = packed_offsets(self, hidden_states, kwargs)  # checked before any work
    if cache_params is not None:
        cache_params = packed_cache(self, cache_params, cu_seqlens)
    hidden_states = mask_padding(hidden_states, attention_mask)
    B, N = hidden_states.shape[:2]
    Hk, Dk, H, Dv = family.dims(self)
    p = family.project(self, hidden_states)
    mixed = convolve(self, p.mixed, cache_params, cu_seqlens)  # (B, N, C)
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, H * Dv], dim=-1)
    state = None if cache_params is None else cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
    out, new = delta_rule(q.reshape(B, N, Hk, Dk), k.reshape(B, N, Hk, Dk), v.reshape(B, N, H, Dv), p.log_decay,
                          p.beta, initial_state=state, output_final_state=cache_params is not None,
                          cu_seqlens=cu_seqlens, form=self._linattn_form)  # (B, N, H, Dv)
    if cache_params is not None:
        cache_params.update_recurrent_state(new, self.layer_idx)
    out = getattr(self, family.norm)(out, p.gate).reshape(B, N, H * Dv)
    return getattr(self, family.out_proj)(out)


# ---------------------------------------------------------------------------------------------
# The replacement classes and the switch
# ---------------------------------------------------------------------------------------------



_GDN_NEEDS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
              "layer_idx", "activation", "conv_kernel_size")
_KDA_NEEDS = ("conv1d", "q_proj", "k_proj", "v_proj", "b_proj", "forget_gate", "o_norm", "o_proj", "num_heads",
              "head_dim", "layer_idx", "activation", "conv_kernel_size")


def _gdn(model_type: str, module: str, layer: str, project, norm: str, out_proj: str, needs: tuple) -> Family:
    return Family(model_type, f"transformers.models.{model_type}.{module}", layer, "gated_delta_rule", norm,
                  out_proj, _GDN_NEEDS + (norm, out_proj) + needs, project, forward)


def _kda(model_type: str, module: str, layer: str, gate, needs: tuple) -> Family:
    return Family(model_type, f"transformers.models.{model_type}.{module}", layer, "kda", "o_norm", "o_proj",
                  _KDA_NEEDS + needs, _project_kda(gate), forward)


_QWEN3_5_NEEDS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

#: The delta-rule families, by ``model_type``.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _gdn("qwen3_next", "modeling_qwen3_next", "Qwen3NextGatedDeltaNet", _project_qwen3_next, "norm", "out_proj",
         ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")),
    _gdn("qwen3_5", "modeling_qwen3_5", "Qwen3_5GatedDeltaNet", _project_qwen3_5, "norm", "out_proj", _QWEN3_5_NEEDS),
    _gdn("qwen3_5_moe", "modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", _project_qwen3_5, "norm", "out_proj",
         _QWEN3_5_NEEDS),
    _gdn("qwen4_exp", "modeling_qwen4_exp", "Qwen4ExpTextGatedDeltaNet", _project_qwen3_5, "norm", "out_proj",
         _QWEN3_5_NEEDS),
    _gdn("olmo_hybrid", "modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet", _project_olmo_hybrid, "o_norm", "o_proj",
         ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "allow_neg_eigval")),
    _kda("kimi_linear", "modeling_kimi_linear", "KimiLinearDeltaAttention",
         lambda layer, h: layer.g_b_proj(layer.g_a_proj(h)), ("g_a_proj", "g_b_proj")),
    _kda("glm5_next", "modeling_glm5_next", "Glm5NextTextLinearAttention",
         lambda layer, h: layer.g_b_proj(layer.g_a_proj(h)), ("g_a_proj", "g_b_proj")),
    _kda("bailing_hybrid", "modeling_bailing_hybrid", "BailingHybridDeltaAttention",
         lambda layer, h: layer.g_proj(h), ("g_proj",)),
)}


# ---------------------------------------------------------------------------------------------
# The shared forward
# ---------------------------------------------------------------------------------------------


