"""linattn: attention in time and memory linear in sequence length.

Tensors follow ``torch.nn.functional.scaled_dot_product_attention``: ``q (B, H, Nq, D)``,
``k (B, H, Nk, D)``, ``v (B, H, Nk, Dv)`` -> ``(B, H, Nq, Dv)``; ``key_padding_mask`` is bool
``(B, Nk)`` with True = a real key that may be attended.
"""

from . import nn
from .functional import (
    FEATURE_MAPS,
    LinearAttentionState,
    LocalAttentionState,
    causal_linear_product,
    efficient_attention,
    favor_attention,
    favor_features,
    favor_projection,
    linear_attention,
    linformer_attention,
    local_attention,
    lsh_attention,
    softmax_attention,
)
from .nn import FavorAttention, FavorConfig, LinformerAttention

__version__ = "0.1.0"

__all__ = [
    "FEATURE_MAPS",
    "FavorAttention",
    "FavorConfig",
    "LinearAttentionState",
    "LinformerAttention",
    "LocalAttentionState",
    "causal_linear_product",
    "efficient_attention",
    "favor_attention",
    "favor_features",
    "favor_projection",
    "linear_attention",
    "linformer_attention",
    "local_attention",
    "lsh_attention",
    "nn",
    "softmax_attention",
]
