"""linattn: attention in time and memory linear in sequence length.

Tensors follow ``torch.nn.functional.scaled_dot_product_attention``: ``q (B, H, Nq, D)``,
``k (B, H, Nk, D)``, ``v (B, H, Nk, Dv)`` -> ``(B, H, Nq, Dv)``; ``key_padding_mask`` is bool
``(B, Nk)`` with True = a real key that may be attended.
"""

from . import models, nn
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
from .models import (
    LMState,
    TransformerConfig,
    TransformerEncoder,
    TransformerLM,
    count_parameters,
    parameter_table,
)
from .nn import (
    MECHANISMS,
    AttentionState,
    EfficientConfig,
    FavorAttention,
    FavorConfig,
    KVCache,
    LinearConfig,
    LinformerAttention,
    LinformerConfig,
    LocalConfig,
    LSHConfig,
    MechanismSpec,
    MultiHeadAttention,
    SoftmaxConfig,
    attention_config,
    get_mechanism,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionState",
    "EfficientConfig",
    "FEATURE_MAPS",
    "FavorAttention",
    "FavorConfig",
    "KVCache",
    "LMState",
    "LSHConfig",
    "LinearAttentionState",
    "LinearConfig",
    "LinformerAttention",
    "LinformerConfig",
    "LocalAttentionState",
    "LocalConfig",
    "MECHANISMS",
    "MechanismSpec",
    "MultiHeadAttention",
    "SoftmaxConfig",
    "TransformerConfig",
    "TransformerEncoder",
    "TransformerLM",
    "attention_config",
    "causal_linear_product",
    "count_parameters",
    "efficient_attention",
    "favor_attention",
    "favor_features",
    "favor_projection",
    "get_mechanism",
    "linear_attention",
    "linformer_attention",
    "local_attention",
    "lsh_attention",
    "models",
    "nn",
    "parameter_table",
    "softmax_attention",
]
