"""Tier 1: pure tensor math. One module per mechanism, each with its fast forms and its reference.

Imports nothing from the higher tiers (nn, models, bench, cli).
"""

from .efficient import efficient_attention, efficient_attention_reference
from .feature_maps import FEATURE_MAPS
from .linear import (
    LinearAttentionState,
    causal_linear_product,
    linear_attention,
    linear_attention_reference,
)
from .softmax import softmax_attention, softmax_attention_reference

__all__ = [
    "FEATURE_MAPS",
    "LinearAttentionState",
    "causal_linear_product",
    "efficient_attention",
    "efficient_attention_reference",
    "linear_attention",
    "linear_attention_reference",
    "softmax_attention",
    "softmax_attention_reference",
]
