"""linattn as the engine of Hugging Face transformers' linear-attention layers, on any device.

transformers (5.23) ships hybrids whose linear-attention layers run the gated delta rule (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE, Qwen4-exp, OLMo-Hybrid) or Kimi Delta Attention (Kimi Linear, GLM5-Next, the
Bailing hybrid). With flash-linear-attention's Triton kernels (CUDA/XPU, through its kernel hub) they
are fast; everywhere else they run reference PyTorch code that is slow, needs O(N C^2 D) memory for
KDA, and mishandles packed documents (Qwen's layers refuse ``cu_seq_lens_q``; Kimi's carry the state
from one document into the next; the causal convolution ignores the boundaries in all).

:func:`enable` makes every supported model built afterwards by ``from_pretrained`` /
``from_config`` run its linear-attention layers on linattn:

- chunked prefill and training: :func:`linattn.functional.delta_rule_attention` (per-head decays for
  the gated delta rule, per-channel for KDA; grouped value heads as they come);
- recurrent decoding, one token at a time, through transformers' own cache (its conv and recurrent
  states, its ``update_*`` calls, so speculative decoding's past recording still works);
- packed documents (``cu_seq_lens_q``, what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  produces): the recurrence and the causal convolution both restart at every document. A cache
  holds one state per batch row, not per document, so a packed forward leaves the linear layers'
  cache states unset (a model makes a cache whenever ``config.use_cache`` is on, training
  included), and a packed forward that would continue a cache with states is refused. transformers
  does not give these layers ``position_ids``: packing seen only there is invisible to them.

Weights, parameter names and checkpoints are unchanged: the replacement layer classes subclass the
originals and only override ``forward``. A model saved with linattn loads without it.

How it plugs in (the route, and every place it touches transformers):

- The class replacement goes through transformers' public ``transformers.monkey_patching``
  (``register_patch_mapping`` / ``unregister_patch_mapping``), applied by transformers itself at
  ``from_pretrained`` / ``from_config`` (and inside ``monkey_patching.apply_patches()``).
- The ``kernels`` function mapping is not used: transformers 5.23 accepts only kernels >= 0.18.2,
  which this project's package index lacks, so it cannot be tested here.
- :func:`attach` switches the layers of an already built model by assigning ``__class__`` (to the
  subclass, which adds no state); :func:`detach` switches them back.
- The replacement forward reads the layers' own submodules and parameters by their names
  (``in_proj_qkvz``, ``conv1d``, ``A_log``, ``norm``, ...), calls Qwen3-Next's
  ``fix_query_key_value_ordering`` and the layers' own gated norms and forget gates, and uses the
  cache's public methods. These are transformers internals in the sense that no API promises them;
  every replacement checks them when a layer is built (a clear error naming the missing ones), and
  tests/test_transformers_integration.py fails the day they move.

What linattn computes differently, on purpose: q, k, v, beta and the decays in float32 (float64 for a
float64 model, where transformers stays in float32), the recurrence chunked by linattn's engine, and
nothing else: projections, gates, norms and the cache are transformers' own code or the same formulas.
q and k are L2-normalised as every family does it, x / sqrt(sum x^2 + 1e-6) (Qwen and OLMo write
it x * rsqrt(...), the same up to rounding), by the engine itself (``qk_l2norm_eps``).

Written for CUDA and MPS as much as for CPUs (no float64 outside float64 models, no host reads in
the fast path besides the packed documents' offsets, read once per model call); tested on CPUs only.

Dimension legend: B batch, N positions, Hk query/key heads, H value heads, Dk key width, Dv value
width, C convolution channels (2 Hk Dk + H Dv), K convolution kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import DecayedState, delta_rule_attention, delta_rule_attention_reference
from ..functional.conv import causal_conv1d, causal_conv1d_step
from ..functional.varlen import check_cu_seqlens
from ..nn.positional import document_positions

__all__ = [
    "FAMILIES",
    "Family",
    "SMALL_LAYER_TYPES",
    "attach",
    "causal_lm",
    "delta_rule",
    "detach",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "replacement_class",
    "small_config",
]

Form = Literal["chunked", "reference"]
FORMS: tuple[str, ...] = ("chunked", "reference")
# The eps of every family's q/k L2 normalisation, inside the root (transformers' l2norm functions)
L2NORM_EPS = 1e-6


class Projected(NamedTuple):
    """What a family's projections give the shared forward (B, N from the hidden states)."""

    mixed: Tensor  # (B, N, C): the convolution's input, channels [q; k; v]
    beta: Tensor  # (B, N, H): write strengths, in the model's dtype
    log_decay: Tensor  # (B, N, H) per head, or (B, N, H, Dk) per key channel (KDA): float32 or wider
    gate: Tensor  # (B, N, H, Dv): the output norm's gate


@dataclass(frozen=True)
class Family:
    """One model family's linear-attention layer class and how to read it.

    Attributes:
        model_type: the config's ``model_type`` (``"qwen3_next"``).
        module: the transformers module defining the layer.
        layer: the layer class's name there.
        rule: ``"gated_delta_rule"`` (a decay per head) or ``"kda"`` (per key channel).
        norm, out_proj: the names of the layer's gated output norm and output projection.
        needs: every attribute of a layer the forward reads (checked when a layer is built).
        project: ``(layer, hidden (B, N, hidden)) -> Projected``.
    """

    model_type: str
    module: str
    layer: str
    rule: Literal["gated_delta_rule", "kda"]
    norm: str
    out_proj: str
    needs: tuple[str, ...]
    project: Callable[[nn.Module, Tensor], Projected]

    def dims(self, layer: nn.Module) -> tuple[int, int, int, int]:
        """``(Hk, Dk, H, Dv)`` of a layer of this family."""
        if self.rule == "kda":
            return layer.num_heads, layer.head_dim, layer.num_heads, layer.head_dim
        return layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim


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


_GDN_NEEDS = ("conv1d", "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
              "layer_idx", "activation", "conv_kernel_size")
_KDA_NEEDS = ("conv1d", "q_proj", "k_proj", "v_proj", "b_proj", "forget_gate", "o_norm", "o_proj", "num_heads",
              "head_dim", "layer_idx", "activation", "conv_kernel_size")


def _gdn(model_type: str, module: str, layer: str, project, norm: str, out_proj: str, needs: tuple) -> Family:
    return Family(model_type, f"transformers.models.{model_type}.{module}", layer, "gated_delta_rule", norm,
                  out_proj, _GDN_NEEDS + (norm, out_proj) + needs, project)


def _kda(model_type: str, module: str, layer: str, gate, needs: tuple) -> Family:
    return Family(model_type, f"transformers.models.{model_type}.{module}", layer, "kda", "o_norm", "o_proj",
                  _KDA_NEEDS + needs, _project_kda(gate))


_QWEN3_5_NEEDS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

#: Every supported family, by ``model_type``.
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


def _activation(name: str) -> Callable[[Tensor], Tensor]:
    """The layer's activation, applied to the convolution's fresh output: SiLU (every family's) in
    place, sparing a (B, N, C) buffer and its first-touch page faults; others as transformers has them."""
    if name in ("silu", "swish"):
        return functools.partial(F.silu, inplace=True)
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _convolve(layer: nn.Module, mixed: Tensor, cache, cu_seqlens: Tensor | None) -> Tensor:
    """The causal depthwise convolution of ``mixed (B, N, C)`` and its activation -> ``(B, N, C)``,
    through the cache when there is one (its conv state holds the last K inputs, oldest first)."""
    B, N, C = mixed.shape
    weight = layer.conv1d.weight.squeeze(1)  # (C, K)
    bias = layer.conv1d.bias
    act = _activation(layer.activation)
    if cache is not None:
        conv_state = cache.get_conv_state(layer.layer_idx, state_idx=0)  # (B, C, K) or None before the first call
        if conv_state is not None and N == 1 and not cache.is_recording_past(layer.layer_idx):
            # one decoding step: the window is the state's last K - 1 inputs and this one
            window = torch.cat([conv_state, mixed.transpose(1, 2).to(conv_state.dtype)], dim=-1)[..., 1:]  # (B, C, K)
            conv_state.copy_(window)
            return act(causal_conv1d_step(window.transpose(1, 2).to(mixed.dtype), weight, bias=bias))
        # the cache returns its earlier inputs followed by these, (B, C, P + N), and keeps the tail
        full = cache.update_conv_state(mixed.transpose(1, 2), layer.layer_idx, conv_kernel_size=layer.conv_kernel_size)
        return act(causal_conv1d(full.transpose(1, 2), weight, bias=bias)[:, -N:])
    positions = None if cu_seqlens is None else document_positions(cu_seqlens, N)
    return act(causal_conv1d(mixed, weight, bias=bias, positions=positions))


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


# The attribute linattn sets on a transformers cache that a packed forward went through (its own
# attribute on transformers' object: no transformers internal is read or written)
_PACKED_CACHE = "_linattn_packed_forward"

PACKED_CACHE_WARNING = (
    "packed documents (cu_seq_lens_q) with a cache (past_key_values; use_cache=True, transformers' default, makes "
    "one, in training too): transformers' own full-attention layers then see one sequence and attend across the "
    "documents (their mask detects packing only without a cache), and the cache cannot continue any document. "
    "Pass use_cache=False with packed batches.")


def _packed_cache(layer: nn.Module, cache, cu_seqlens: Tensor | None):
    """The cache ``layer`` runs with: ``cache``, or None for a packed forward.

    A cache holds one state per batch row, not one per document; and a model forward makes a cache
    whenever ``config.use_cache`` is on, training included. So a packed forward runs as if without
    a cache, leaves this layer's states unset and marks the cache; transformers' attention layers
    meanwhile ignore the packing (:data:`PACKED_CACHE_WARNING`, a UserWarning that Python's default filter shows once per process) and
    keep every packed token. A packed forward that would continue a cache holding states, and any
    forward that would continue a cache a packed forward went through (decoding would start the
    linear layers from nothing while the attention layers see every packed token), are refused."""
    name = type(layer).__name__
    if cu_seqlens is None:
        if getattr(cache, _PACKED_CACHE, False):
            raise ValueError(f"{name}: this cache (past_key_values) went through a packed forward (cu_seq_lens_q): "
                             "its attention layers hold every packed token and its linear layers no state, so no "
                             "document can continue from it; make the cache with an unpacked forward (one document "
                             "per batch row)")
        return cache
    if cache.get_conv_state(layer.layer_idx, state_idx=0) is not None:
        raise ValueError(f"{name}: packed documents (cu_seq_lens_q {tuple(cu_seqlens.shape)}) cannot continue a cache "
                         "(past_key_values) that holds states: it has one state per batch row, not per document")
    if not getattr(cache, _PACKED_CACHE, False):
        warnings.warn(f"{name}: {PACKED_CACHE_WARNING}", UserWarning, stacklevel=3)
    setattr(cache, _PACKED_CACHE, True)
    return None


def _forward(self, hidden_states: Tensor, cache_params=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """The replacement layers' forward, with the originals' arguments: ``hidden_states (B, N, hidden)``,
    transformers' cache or None, a 2-D padding mask (1 = real token) or None, and the model's keyword
    arguments, of which ``cu_seq_lens_q`` (packed documents, B = 1) is read.

    Padding is as transformers does it: padded positions' inputs are zeroed (exact for left
    padding, which ``generate`` uses)."""
    family: Family = self._linattn_family
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:  # checked before any work; int64 from here on (the collator's are int32)
        cu_seqlens = check_cu_seqlens(type(self).__name__, cu_seqlens, hidden_states[:, None],
                                      name="cu_seq_lens_q", q_name="hidden_states")  # as (1, 1, N, hidden)
    if cache_params is not None:
        cache_params = _packed_cache(self, cache_params, cu_seqlens)
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    B, N = hidden_states.shape[:2]
    Hk, Dk, H, Dv = family.dims(self)
    p = family.project(self, hidden_states)
    mixed = _convolve(self, p.mixed, cache_params, cu_seqlens)  # (B, N, C)
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

_lock = threading.RLock()
_classes: dict[tuple[str, str], type] = {}  # (model_type, form) -> replacement class
_registered: dict[str, type] = {}  # layer class name -> the replacement this module registered


def _require_transformers(what: str):
    if importlib.util.find_spec("transformers") is None:
        raise ModuleNotFoundError(f"linattn.integrations.transformers.{what} needs transformers, which is not "
                                  "installed; install the optional extra: pip install 'linattn[transformers]'",
                                  name="transformers")
    import transformers

    return transformers


def _check_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"linattn.integrations.transformers: unsupported model type {name!r}; supported: "
                         f"{', '.join(FAMILIES)}")
    return FAMILIES[name]


def _check_model_types(model_types) -> tuple[str, ...]:
    if isinstance(model_types, (str, bytes)) or not isinstance(model_types, (tuple, list, set, frozenset)):
        example = f"({model_types!r},)" if isinstance(model_types, str) else '("qwen3_5",)'
        raise TypeError(f"linattn.integrations.transformers: model_types must be a tuple of model type names, e.g. "
                        f"{example}, or None for every family; got the {type(model_types).__name__} {model_types!r}")
    bad = [name for name in model_types if not isinstance(name, str)]
    if bad:
        raise TypeError(f"linattn.integrations.transformers: model_types must hold model type names (str), got "
                        f"{bad[0]!r} in {model_types!r}")
    return tuple(model_types)


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"linattn.integrations.transformers: form must be one of {FORMS}, got {form!r}")


def _original(family: Family) -> type:
    module = importlib.import_module(family.module)
    cls = getattr(module, family.layer, None)
    if cls is None:
        raise ImportError(f"linattn.integrations.transformers: {family.module} has no class {family.layer} (the "
                          "installed transformers moved it); this family cannot be patched")
    while getattr(cls, "_linattn_family", None) is not None:  # inside transformers' apply_patches
        cls = cls.__mro__[1]
    return cls


def _init(self, *args, **kwargs):
    type(self).__mro__[1].__init__(self, *args, **kwargs)  # the original layer's __init__, as it is
    _check_layer(self)


def _check_layer(layer: nn.Module) -> None:
    missing = [name for name in layer._linattn_family.needs if not hasattr(layer, name)]
    if missing:
        raise TypeError(f"linattn.integrations.transformers: {type(layer).__mro__[1].__name__} has no "
                        f"{', '.join(missing)}: the installed transformers changed this layer, which linattn "
                        "cannot run; disable the integration (linattn.integrations.transformers.disable())")


def replacement_class(model_type: str, form: Form = "chunked") -> type:
    """The layer class that replaces ``model_type``'s linear-attention layer: a subclass of it that
    only overrides ``forward`` (no parameters or buffers of its own). ``form``: ``"chunked"`` (the
    fast engine) or ``"reference"`` (linattn's float64 reference recurrence, a loop over positions:
    for checking, never for speed)."""
    family = _check_family(model_type)
    _check_form(form)
    _require_transformers("replacement_class")
    with _lock:
        key = (model_type, form)
        if key not in _classes:
            original = _original(family)
            prefix = "Linattn" if form == "chunked" else "LinattnReference"
            _classes[key] = type(f"{prefix}{original.__name__}", (original,), {
                "__init__": _init, "forward": _forward, "_linattn_family": family, "_linattn_form": form,
                "__module__": __name__,
                "__doc__": f"{original.__name__} running on linattn ({form}); weights and names unchanged."})
        return _classes[key]


def enable(*, form: Form = "chunked", model_types: tuple[str, ...] | None = None) -> None:
    """Make every supported model built afterwards by ``from_pretrained`` / ``from_config`` run its
    linear-attention layers on linattn (through ``transformers.monkey_patching.register_patch_mapping``).

    Args:
        form: ``"chunked"`` or ``"reference"`` (see :func:`replacement_class`).
        model_types: the families to patch (None: all of :data:`FAMILIES`).

    Raises TypeError when ``model_types`` is not a collection of names (a bare string included:
    it would be read one character at a time), ValueError for an unknown family or form, or when
    another library registered a patch for one of these layer classes (this one never overwrites it)."""
    _check_form(form)
    names = tuple(FAMILIES) if model_types is None else _check_model_types(model_types)
    families = [_check_family(name) for name in names]
    _require_transformers("enable")
    from transformers.monkey_patching import get_patch_mapping, register_patch_mapping

    with _lock:
        current = get_patch_mapping()
        mapping = {}
        for family in families:
            theirs = current.get(family.layer)
            if theirs is not None and _registered.get(family.layer) is not theirs:
                raise ValueError(f"linattn.integrations.transformers.enable: {family.layer} already has a patch "
                                 f"registered by someone else ({theirs.__module__}.{theirs.__qualname__}); not "
                                 "overwriting it")
            mapping[family.layer] = replacement_class(family.model_type, form)
        register_patch_mapping(mapping, overwrite=True)
        _registered.update(mapping)


def disable() -> None:
    """Undo :func:`enable`: models built afterwards use transformers' own layers again (models built
    before keep the classes they were built with; :func:`detach` switches those)."""
    if not _registered:
        return
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    with _lock:
        current = get_patch_mapping()
        ours = [name for name, cls in _registered.items() if current.get(name) is cls]
        if ours:
            unregister_patch_mapping(ours)
        _registered.clear()


def is_enabled(model_type: str | None = None) -> bool:
    """Whether :func:`enable` is in effect (for ``model_type``, or for any family)."""
    if not _registered:
        return False
    from transformers.monkey_patching import get_patch_mapping

    current = get_patch_mapping()
    names = [_check_family(model_type).layer] if model_type is not None else list(_registered)
    return any(name in _registered and current.get(name) is _registered[name] for name in names)


@contextlib.contextmanager
def enabled(*, form: Form = "chunked", model_types: tuple[str, ...] | None = None):
    """:func:`enable` inside a ``with`` block; on leaving, the registrations are as they were."""
    with _lock:
        before = dict(_registered)
        enable(form=form, model_types=model_types)
    try:
        yield
    finally:
        with _lock:
            disable()
            if before:
                from transformers.monkey_patching import register_patch_mapping

                register_patch_mapping(before, overwrite=True)
                _registered.update(before)


def _layers(model: nn.Module):
    for module in model.modules():
        cls = type(module)
        for family in FAMILIES.values():
            if cls.__name__ == family.layer or getattr(cls, "_linattn_family", None) is family:
                yield module, family
                break


def attach(model: nn.Module, *, form: Form = "chunked") -> int:
    """Switch the linear-attention layers of an already built ``model`` to linattn (their class
    becomes :func:`replacement_class`; weights untouched). Returns how many layers were switched.
    Raises ValueError, naming the model, when it has none of a supported family."""
    _check_form(form)
    count = 0
    for module, family in _layers(model):
        cls = replacement_class(family.model_type, form)
        if not isinstance(module, cls.__mro__[1]):
            continue
        module.__class__ = cls
        _check_layer(module)
        count += 1
    if count == 0:
        raise ValueError(f"linattn.integrations.transformers.attach: {type(model).__name__} has no linear-attention "
                         f"layer linattn supports (layer classes: {', '.join(f.layer for f in FAMILIES.values())})")
    return count


def detach(model: nn.Module) -> int:
    """Switch ``model``'s linattn layers back to transformers' own classes. Returns how many."""
    count = 0
    for module, _ in _layers(model):
        if getattr(type(module), "_linattn_family", None) is not None:
            module.__class__ = type(module).__mro__[1]
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Small models of every family: for tests, the README, the demo and the benchmarks
# ---------------------------------------------------------------------------------------------

#: Linear-attention and full-attention layers mixed, as the hybrids do (1 in 4 full).
SMALL_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def small_config(model_type: str, *, hidden_size: int = 64, heads: int = 4, key_heads: int | None = None,
                 head_dim: int = 16, layer_types: tuple[str, ...] = SMALL_LAYER_TYPES, vocab_size: int = 99):
    """A small random configuration of ``model_type``'s family, built with its own config class and
    sized as transformers' model testers size them: ``hidden_size``, the linear layers' ``heads``
    value heads of width ``head_dim`` (queries and keys too), ``key_heads`` query/key heads for the
    families with grouped value heads (None: ``heads // 2`` there; the KDA families have none), the
    given layer types, small full-attention layers, experts and vocabulary. GLM5-Next gets its
    composite config (text and a one-block vision tower), since its causal LM is multimodal."""
    family = _check_family(model_type)
    transformers = _require_transformers("small_config")
    layers = list(layer_types)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(layers), pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, layer_types=layers)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)  # 16: bf16 grouped_mm wants 16-byte strides
    if family.rule == "gated_delta_rule":
        if key_heads is None:
            key_heads = max(heads // 2, 1)
        gdn = dict(common, linear_num_key_heads=key_heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                   linear_value_head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2)
        qwen_moe = dict(moe, num_experts=4, shared_expert_intermediate_size=16)
        if model_type == "qwen3_next":
            return transformers.Qwen3NextConfig(**gdn, head_dim=16, intermediate_size=37, **qwen_moe)
        if model_type == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**gdn, head_dim=16, intermediate_size=37)
        if model_type == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**gdn, head_dim=16, **qwen_moe)
        if model_type == "qwen4_exp":
            return transformers.Qwen4ExpTextConfig(
                **gdn, head_dim=16, **qwen_moe, hc_count=2, hc_lowrank=8, ngram_vocab_size_base=1000,
                make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, heads_per_ngram=2, indexer_n_heads=2,
                indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2)
        return transformers.OlmoHybridConfig(**gdn, intermediate_size=37)  # olmo_hybrid
    if key_heads not in (None, heads):
        raise ValueError(f"small_config: {model_type} (KDA) has no grouped value heads; key_heads must be None or "
                         f"heads = {heads}, got {key_heads}")
    kda = dict(common, linear_num_heads=heads, linear_head_dim=head_dim, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=37, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=16, **moe)
    mlp = ["dense" if i % 2 == 0 else "sparse" for i in range(len(layers))]
    if model_type == "kimi_linear":
        return transformers.KimiLinearConfig(**kda, num_local_experts=4, q_lora_rank=None, qk_rope_head_dim=8,
                                             mlp_layer_types=mlp)
    if model_type == "bailing_hybrid":
        return transformers.BailingHybridConfig(**kda, num_local_experts=4, head_dim=16, n_group=1, topk_group=1,
                                                first_k_dense_replace=1, qk_rope_head_dim=8)
    text = transformers.Glm5NextTextConfig(**kda, n_routed_experts=4, q_lora_rank=16, qk_rope_head_dim=0,
                                           mlp_layer_types=mlp, index_topk=8, index_head_dim=8, index_n_heads=2,
                                           hc_mult=2, index_kpool=4)  # glm5_next
    vision = transformers.Glm5NextVisionConfig(depth=1, hidden_size=16, num_heads=2, out_hidden_size=hidden_size,
                                               intermediate_size=16, patch_size=2, image_size=8, temporal_patch_size=1)
    return transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=vision.to_dict())


def causal_lm(config, **kwargs) -> nn.Module:
    """The family's causal language model built from ``config`` with transformers' ``from_config``
    (so :func:`enable` applies): ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for
    GLM5-Next, whose causal LM is multimodal. ``kwargs`` go to ``from_config`` (``dtype``, ...)."""
    transformers = _require_transformers("causal_lm")
    if config.model_type == "glm5_next":
        return transformers.AutoModelForImageTextToText.from_config(config, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
