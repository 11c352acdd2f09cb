"""Tier 1: pure tensor math. One module per mechanism, each with its fast forms and its reference.

Imports nothing from the higher tiers (nn, models, bench, cli).
"""

from .decayed_state import DecayedState
from .delta import delta_rule_attention, delta_rule_attention_reference
from .efficient import efficient_attention, efficient_attention_reference
from .favor import (
    FAVOR_FEATURES,
    FAVOR_KERNELS,
    favor_attention,
    favor_attention_reference,
    favor_features,
    favor_projection,
)
from .feature_maps import FEATURE_MAPS
from .gated import gated_linear_attention, gated_linear_attention_reference
from .hedgehog import HedgehogMaps, hedgehog_attention, hedgehog_attention_reference
from .linear import (
    LinearAttentionState,
    causal_linear_product,
    linear_attention,
    linear_attention_reference,
)
from .linformer import linformer_attention, linformer_attention_reference
from .local import LocalAttentionState, local_attention, local_attention_reference
from .lsh import lsh_attention, lsh_attention_reference
from .softmax import softmax_attention, softmax_attention_reference

__all__ = [
    "DecayedState",
    "FAVOR_FEATURES",
    "FAVOR_KERNELS",
    "FEATURE_MAPS",
    "HedgehogMaps",
    "LinearAttentionState",
    "LocalAttentionState",
    "causal_linear_product",
    "delta_rule_attention",
    "delta_rule_attention_reference",
    "efficient_attention",
    "efficient_attention_reference",
    "favor_attention",
    "favor_attention_reference",
    "favor_features",
    "favor_projection",
    "gated_linear_attention",
    "gated_linear_attention_reference",
    "hedgehog_attention",
    "hedgehog_attention_reference",
    "linear_attention",
    "linear_attention_reference",
    "linformer_attention",
    "linformer_attention_reference",
    "local_attention",
    "local_attention_reference",
    "lsh_attention",
    "lsh_attention_reference",
    "softmax_attention",
    "softmax_attention_reference",
]
