"""The Mamba-2 family: Mamba-2, Bamba, Falcon-H1, Granite-4.0 hybrids (``granitemoehybrid``),
Nemotron-H and Zamba2, whose mixers run Mamba-2's state-space duality (SSD, arXiv 2405.21060), on
:func:`linattn.functional.gated_linear_attention`.

SSD is gated linear attention with one scalar decay per head and grouped keys. Per head h of group
g (a group's heads share B and C), with ``dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)``
and ``A = -exp(A_log)``:

    S_t = exp(A_h dt_t) S_{t-1} + B_t (dt_t x_t)^T          (S: (state_size, head_dim))
    y_t = S_t^T C_t + D_h x_t

so the queries are C, the keys B (one per group: the engine's grouped heads, Hk = n_groups), the
values ``x dt``, the log decay ``A dt``, the scale 1. The output goes through the layer's own gated
norm (``norm(y, z)``; Falcon-H1 without ``mamba_rms_norm``: ``y * silu(z)``) and ``out_proj``.

What linattn computes differently, on purpose: dt, the decays, x, B, C and the state in float32
(float64 for a float64 model; transformers takes dt through softplus in the model's dtype and the
scan in float32), the recurrence chunked by linattn's engine, and ``time_step_limit`` applied in
decoding too (transformers' own one-token step, like mamba_ssm's ``selective_state_update``, skips
it, so its cached generation can drift from its own prefill when a limit binds; linattn's equals
its prefill). Projections, convolution weights, norms and the cache are transformers' own code or
the same formulas.

Dimension legend: B batch, N positions, G groups (``n_groups``), Ds state width (``state_size``),
H heads, P head width (``head_dim``), I = H P (``intermediate_size``), C convolution channels
(I + 2 G Ds).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional import DecayedState, gated_linear_attention, gated_linear_attention_reference
from ...functional.varlen import check_cu_seqlens
from .layers import Family, Form, convolve, mask_padding, packed_cache, packed_offsets


class SsdProjected(NamedTuple):
    """What an SSD family's input projection gives the shared forward (B, N from the hidden states)."""

    gate: Tensor  # (B, N, I): z, the output norm's gate
    xbc: Tensor  # (B, N, C): the convolution's input, channels [x; B; C]
    dt: Tensor  # (B, N, H): the time steps before dt_bias and softplus


def _split(layer: nn.Module, projected: Tensor) -> SsdProjected:
    return SsdProjected(*projected.split([layer.intermediate_size, layer.conv_dim, layer.num_heads], dim=-1))


def _project(layer: nn.Module, hidden: Tensor) -> SsdProjected:
    return _split(layer, layer.in_proj(hidden))


def _project_falcon_h1(layer: nn.Module, hidden: Tensor) -> SsdProjected:
    # Falcon-H1's muP multipliers: one on the input, one per part of the projection (z, x, B, C, dt);
    # mup_vector is a buffer the model registers on the mixer after building it
    mup = getattr(layer, "mup_vector", None)
    if mup is None:
        raise TypeError(f"linattn.integrations.transformers: {type(layer).__mro__[1].__name__} has no mup_vector "
                        "(FalconH1Model registers it on each mixer): a mixer built outside its model, or the installed "
                        "transformers changed this layer")
    return _split(layer, layer.in_proj(hidden * layer.ssm_in_multiplier) * mup)


def _time_steps(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float],
                dtype: torch.dtype) -> Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in ``dtype`` (the clamp only where a limit can bind:
    softplus is positive, so (0, inf) is the identity)."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _reference_packed(q, k, v, log_decay, cu_seqlens):
    """The float64 reference on packed documents, one document at a time (reads the offsets)."""
    cu = cu_seqlens.tolist()
    outs = [gated_linear_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], log_decay[:, :, a:b], scale=1.0)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=2)


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor | None = None,
        dt_bias: Tensor | None = None, dt_softplus: bool = False,
        dt_limit: tuple[float, float] = (0.0, math.inf), initial_state: Tensor | None = None,
        output_final_state: bool = False, cu_seqlens: Tensor | None = None,
        form: Form = "chunked") -> tuple[Tensor, Tensor | None]:
    """Mamba-2's SSD scan in transformers' layout and semantics, on linattn: what the replacement
    mixers run, and a drop-in for transformers' ``mamba2_chunk_scan`` (mamba_ssm's
    ``mamba_chunk_scan_combined``) without ``chunk_size``, which only tunes linattn's engine.
    Computes in float32 (float64 for float64 inputs) and returns the output and the state in that
    dtype, as transformers' scan returns float32.

    Args:
        x: ``(B, N, H, P)`` the heads' inputs.
        dt: ``(B, N, H)`` time steps (before ``dt_bias`` and softplus when those are asked for).
        A: ``(H,)`` negative rates (``-exp(A_log)``).
        B, C: ``(B, N, G, Ds)`` keys and queries of G groups, H a multiple of G (head h is in group
            ``h // (H / G)``).
        D: None or ``(H,)``, the skip ``D_h x``.
        dt_bias: None or ``(H,)``; dt_softplus: softplus after the bias; dt_limit: the clamp after.
        initial_state: None or ``(B, H, P, Ds)`` (``(n, H, P, Ds)`` with ``cu_seqlens``).
        output_final_state: also return the state after the last position.
        cu_seqlens: None or integer ``(n + 1,)`` offsets of n documents packed along N (B = 1).
        form: ``"chunked"`` or ``"reference"`` (linattn's recurrence, a loop over positions).

    Returns ``(y (B, N, H, P), state (B, H, P, Ds) or None)``.
    """
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    dt = _time_steps(dt, dt_bias, dt_softplus, dt_limit, ct)  # (B, N, H)
    log_decay = (A.to(ct) * dt).transpose(1, 2)  # (B, H, N), <= 0
    xc = x.to(ct)
    q, k = C.transpose(1, 2).to(ct), B.transpose(1, 2).to(ct)  # (B, G, N, Ds): grouped in the engine
    # linattn's states are (Ds, P) per head: keys' rows, values' columns
    initial = None if initial_state is None else DecayedState(initial_state.to(ct).transpose(-1, -2))
    if form == "reference":
        v = (xc * dt[..., None]).transpose(1, 2)  # (B, H, N, P)
        if cu_seqlens is not None:
            cu_seqlens = check_cu_seqlens("ssd", cu_seqlens, v, q_name="x (as (B, H, N, P))")
            G = q.shape[1]
            rep = v.shape[1] // max(G, 1)
            out, new = _reference_packed(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, log_decay,
                                         cu_seqlens), None
        else:
            out, new = gated_linear_attention_reference(q, k, v, log_decay, scale=1.0, initial_state=initial,
                                                        return_state=True)
        y = out.transpose(1, 2)  # (B, N, H, P)
        if D is not None:
            y = torch.addcmul(y, D.to(ct)[:, None], xc)
    else:
        # x and dt as the engine's values and value_scale, D as its skip: on the grouped route they
        # are applied chunk by chunk in cache, and x in transformers' (B, N, H, P) memory is read as
        # it is, the output given back in that memory
        result = gated_linear_attention(q, k, xc.transpose(1, 2), log_decay, scale=1.0, initial_state=initial,
                                        return_state=output_final_state, cu_seqlens=cu_seqlens,
                                        value_scale=dt.transpose(1, 2), skip=None if D is None else D.to(ct))
        out, new = result if output_final_state else (result, None)
        y = out.transpose(1, 2)  # (B, N, H, P)
    state = new.s.transpose(-1, -2) if (output_final_state and new is not None) else None
    return y, state


def _readout(layer: nn.Module, y: Tensor, gate: Tensor) -> Tensor:
    return layer.norm(y, gate)


def _readout_falcon_h1(layer: nn.Module, y: Tensor, gate: Tensor) -> Tensor:
    # mamba_rms_norm off: no norm, the gate alone (as the layer's chunked path and its decode kernel)
    return layer.norm(y, gate) if layer.mamba_rms_norm else y * F.silu(gate)


def forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The replacement mixers' forward, with the originals' arguments: ``hidden_states (B, N, hidden)``,
    transformers' cache or None, a 2-D padding mask (1 = real token) or None, and the model's keyword
    arguments, of which ``cu_seq_lens_q`` or ``seq_idx`` (packed documents, B = 1) are read.

    Padding is as transformers does it: padded positions are zeroed before the projection and after
    the convolution (exact for left padding, which ``generate`` uses)."""
    family: Family = self._linattn_family
    cu_seqlens = packed_offsets(self, hidden_states, kwargs)  # checked before any work
    if cache_params is not None:
        cache_params = packed_cache(self, cache_params, cu_seqlens)
    dtype = hidden_states.dtype
    hidden_states = mask_padding(hidden_states, attention_mask)
    Bsz, N = hidden_states.shape[:2]
    G, Ds, H, P = family.dims(self)
    p = family.project(self, hidden_states)
    xbc = mask_padding(convolve(self, p.xbc, cache_params, cu_seqlens), attention_mask)  # (B, N, C)
    x, b, c = torch.split(xbc, [H * P, G * Ds, G * Ds], dim=-1)
    state = None if cache_params is None else cache_params.get_recurrent_state(self.layer_idx, state_idx=0)
    A = -torch.exp(self.A_log.to(torch.float64 if dtype == torch.float64 else torch.float32))
    y, new = ssd(x.reshape(Bsz, N, H, P), p.dt, A, b.reshape(Bsz, N, G, Ds), c.reshape(Bsz, N, G, Ds), D=self.D,
                 dt_bias=self.dt_bias, dt_softplus=True, dt_limit=tuple(self.time_step_limit), initial_state=state,
                 output_final_state=cache_params is not None, cu_seqlens=cu_seqlens,
                 form=self._linattn_form)  # (B, N, H, P), compute dtype
    if cache_params is not None:
        cache_params.update_recurrent_state(new, self.layer_idx)
    y = family.readout(self, y.reshape(Bsz, N, H * P), p.gate)
    return getattr(self, family.out_proj)(y.to(dtype))


_NEEDS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
          "ssm_state_size", "intermediate_size", "conv_dim", "time_step_limit", "layer_idx", "activation",
          "conv_kernel_size")


def _ssd(model_type: str, layer: str, project=_project, readout=_readout, needs: tuple = (), holder=None) -> Family:
    return Family(model_type, f"transformers.models.{model_type}.modeling_{model_type}", layer, "ssd", "norm",
                  "out_proj", _NEEDS + needs, project, forward, readout, holder)


#: The Mamba-2 families, by ``model_type``.
FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _ssd("mamba2", "Mamba2Mixer"),
    _ssd("bamba", "BambaMixer"),
    _ssd("falcon_h1", "FalconH1Mixer", _project_falcon_h1, _readout_falcon_h1, ("ssm_in_multiplier", "mamba_rms_norm")),
    _ssd("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    # NemotronHBlock builds its mixer from the table MIXER_TYPES, made at import
    _ssd("nemotron_h", "NemotronHMamba2Mixer", holder=("NemotronHBlock", "mixer")),
    _ssd("zamba2", "Zamba2MambaMixer"),
)}
