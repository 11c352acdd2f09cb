"""Tier 2: modules that own parameters and buffers and call ``linattn.functional``.

Imports the functional tier only; nothing below imports this package. Mechanism modules never own
the query/key/value/output projections: :class:`MultiHeadAttention` does, and calls any mechanism
registered in :mod:`linattn.nn.registry`.
"""

from .attention import AttentionState, MultiHeadAttention
from .conv import ShortConv
from .favor import FavorAttention, FavorConfig
from .gated import DeltaNetConfig, GatedDeltaNetConfig, GatedMechanism, GLAConfig, KDAConfig, RetNetConfig
from .linformer import LinformerAttention
from .mechanisms import (
    EfficientConfig,
    HedgehogConfig,
    KVCache,
    LinearConfig,
    LinformerConfig,
    LocalConfig,
    LSHConfig,
    Mechanism,
    SoftmaxConfig,
)
from .registry import (
    MECHANISMS,
    AttentionConfig,
    MechanismSpec,
    attention_config,
    attention_config_from_dict,
    attention_config_to_dict,
    build_mechanism,
    get_mechanism,
    spec_for,
)

__all__ = [
    "AttentionConfig",
    "AttentionState",
    "DeltaNetConfig",
    "EfficientConfig",
    "FavorAttention",
    "FavorConfig",
    "GLAConfig",
    "GatedDeltaNetConfig",
    "GatedMechanism",
    "HedgehogConfig",
    "KDAConfig",
    "KVCache",
    "LSHConfig",
    "LinearConfig",
    "LinformerAttention",
    "LinformerConfig",
    "LocalConfig",
    "MECHANISMS",
    "Mechanism",
    "MechanismSpec",
    "MultiHeadAttention",
    "RetNetConfig",
    "ShortConv",
    "SoftmaxConfig",
    "attention_config",
    "attention_config_from_dict",
    "attention_config_to_dict",
    "build_mechanism",
    "get_mechanism",
    "spec_for",
]
