"""What every replacement layer shares: the family record, the causal convolution through
transformers' cache, packed documents' offsets (``cu_seq_lens_q`` or ``seq_idx``) and the rule for
a cache a packed forward goes through.

Dimension legend: B batch, N positions, C convolution channels, K convolution kernel, n documents.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...functional.conv import causal_conv1d, causal_conv1d_step
from ...functional.varlen import check_cu_seqlens
from ...nn.positional import document_positions

Form = Literal["chunked", "reference"]
FORMS: tuple[str, ...] = ("chunked", "reference")


@dataclass(frozen=True)
class Family:
    """One model family's linear-attention layer class and how to read it.

    Attributes:
        model_type: the config's ``model_type`` (``"qwen3_next"``).
        module: the transformers module defining the layer.
        layer: the layer class's name there.
        rule: ``"gated_delta_rule"`` (the delta rule, a decay per head), ``"kda"`` (the delta rule,
            a decay per key channel) or ``"ssd"`` (Mamba-2's state-space duality: gated linear
            attention with a decay per head and grouped keys).
        norm, out_proj: the names of the layer's gated output norm and output projection.
        needs: every attribute of a layer the forward reads (checked when a layer is built).
        project: ``(layer, hidden (B, N, hidden)) ->`` the rule's projected inputs.
        forward: the replacement layer's ``forward``, with the original's arguments.
        readout: SSD only: ``(layer, y (B, N, I), gate (B, N, I)) ->`` the gated output before
            ``out_proj`` (the delta rule's families call their norm with per-head shapes instead).
        holder: None, or ``(class name, attribute)`` where the model builds the layer through a
            table of classes made at import (Nemotron-H's ``MIXER_TYPES``), which transformers'
            patch mapping cannot reach: the holder class (the block) is patched instead, and
            switches its ``attribute`` to the replacement after building it.
    """

    model_type: str
    module: str
    layer: str
    rule: Literal["gated_delta_rule", "kda", "ssd"]
    norm: str
    out_proj: str
    needs: tuple[str, ...]
    project: Callable
    forward: Callable
    readout: Callable | None = None
    holder: tuple[str, str] | None = None

    def dims(self, layer: nn.Module) -> tuple[int, int, int, int]:
        """``(Hk, Dk, H, Dv)`` of a layer of this family: query/key heads and width, value heads
        and width (for SSD: B/C groups, state size, heads, head width)."""
        if self.rule == "kda":
            return layer.num_heads, layer.head_dim, layer.num_heads, layer.head_dim
        if self.rule == "ssd":
            return layer.n_groups, layer.ssm_state_size, layer.num_heads, layer.head_dim
        return layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The layer's activation, applied to the convolution's fresh output: SiLU (every family's) in
    place, sparing a (B, N, C) buffer and its first-touch page faults; others as transformers has them."""
    if name in ("silu", "swish"):
        return functools.partial(F.silu, inplace=True)
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def convolve(layer: nn.Module, mixed: Tensor, cache, cu_seqlens: Tensor | None) -> Tensor:
    """The causal depthwise convolution of ``mixed (B, N, C)`` and its activation -> ``(B, N, C)``,
    through the cache when there is one (its conv state holds the last K inputs, oldest first)."""
    B, N, C = mixed.shape
    weight = layer.conv1d.weight.squeeze(1)  # (C, K)
    bias = layer.conv1d.bias
    act = activation(layer.activation)
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


_PACKED_CACHE = "_linattn_packed_forward"

PACKED_CACHE_WARNING = (
    "packed documents (cu_seq_lens_q) with a cache (past_key_values; use_cache=True, transformers' default, makes "
    "one, in training too): transformers' own full-attention layers then see one sequence and attend across the "
    "documents (their mask detects packing only without a cache), and the cache cannot continue any document. "
    "Pass use_cache=False with packed batches.")


def packed_cache(layer: nn.Module, cache, cu_seqlens: Tensor | None):
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




def mask_padding(x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """``x (B, N, *)`` with padded positions zeroed, as every family's layer does it with a 2-D
    padding mask ``(B, N)`` (1 = real token; exact for left padding, which ``generate`` uses)."""
    if attention_mask is None:
        return x
    return (x * attention_mask[:, :, None]).to(x.dtype)


def packed_offsets(layer: nn.Module, hidden: Tensor, kwargs: dict) -> Tensor | None:
    """The packed documents' int64 offsets ``(n + 1,)`` of a layer call, checked before any work,
    or None: from ``cu_seq_lens_q`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
    any integer dtype), else from ``seq_idx`` ``(1, N)`` (``return_seq_idx=True``, the document
    index of every position, as mamba_ssm's kernels take it), where each run of equal indices is
    one document. With both, ``cu_seq_lens_q`` is used (the collator gives them together).

    ``seq_idx`` is turned into offsets once per tensor (a host read, kept on the tensor with its
    version counter as :func:`linattn.functional.varlen.int64_offsets` keeps its copy), so the
    layers of one model call share one read.

    Raises:
        ValueError: offsets that do not fit ``hidden (B, N, hidden)`` (B must be 1), or a
            ``seq_idx`` that is not an integer ``(1, N)`` tensor on ``hidden``'s device."""
    name = type(layer).__name__
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None and kwargs.get("seq_idx") is not None:
        cu = _seq_idx_offsets(name, kwargs["seq_idx"], hidden)
    if cu is None:
        return None
    # int64 from here on (the collator's are int32)
    return check_cu_seqlens(name, cu, hidden[:, None], name="cu_seq_lens_q", q_name="hidden_states")  # (1, 1, N, hidden)


def _seq_idx_offsets(name: str, seq_idx, hidden: Tensor) -> Tensor:
    B, N = hidden.shape[:2]
    if not isinstance(seq_idx, Tensor) or seq_idx.is_floating_point() or seq_idx.is_complex() \
            or seq_idx.dtype == torch.bool:
        got = seq_idx.dtype if isinstance(seq_idx, Tensor) else type(seq_idx).__name__
        raise ValueError(f"{name}: seq_idx must be an integer tensor (the document index of every position), got {got}")
    if tuple(seq_idx.shape) != (1, N) or B != 1:
        raise ValueError(f"{name}: seq_idx must have shape (1, N) = (1, {N}) for hidden_states {tuple(hidden.shape)} "
                         f"(packed documents, batch size 1), got {tuple(seq_idx.shape)}")
    if seq_idx.device != hidden.device:
        raise ValueError(f"{name}: seq_idx is on {seq_idx.device}, hidden_states on {hidden.device}")
    kept = getattr(seq_idx, "_linattn_offsets", None)
    if kept is not None and kept[0] == seq_idx._version and not torch.compiler.is_compiling():
        return kept[1]
    ids = seq_idx[0]
    starts = torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1  # the host read: where a new document starts
    ends = torch.tensor([0, N], dtype=torch.int64, device=ids.device)
    cu = torch.cat([ends[:1], starts.to(torch.int64), ends[1:]]) if N else ends[:1].repeat(2)
    if not torch.compiler.is_compiling():
        seq_idx._linattn_offsets = (seq_idx._version, cu)
    return cu
