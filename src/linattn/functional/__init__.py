"""Tier 1: pure tensor math. One module per mechanism, each with its fast forms and its reference.

Imports nothing from the higher tiers (nn, models, bench, cli).
"""

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
from .linear import (
    LinearAttentionState,
    causal_linear_product,
    linear_attention,
    linear_attention_reference,
)
from .softmax import softmax_attention, softmax_attention_reference

__all__ = [
    "FAVOR_FEATURES",
    "FAVOR_KERNELS",
    "FEATURE_MAPS",
    "LinearAttentionState",
    "causal_linear_product",
    "efficient_attention",
    "efficient_attention_reference",
    "favor_attention",
    "favor_attention_reference",
    "favor_features",
    "favor_projection",
    "linear_attention",
    "linear_attention_reference",
    "softmax_attention",
    "softmax_attention_reference",
]
