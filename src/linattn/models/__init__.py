"""Tier 3: transformer encoder and language model, generation, checkpoints, parameter counts.

Imports the nn and functional tiers only; nothing below imports this package.
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import NORMS, POSITIONAL, TransformerConfig
from .summary import count_parameters, parameter_table
from .transformer import Block, LMState, TransformerEncoder, TransformerLM

__all__ = [
    "Block",
    "LMState",
    "NORMS",
    "POSITIONAL",
    "TransformerConfig",
    "TransformerEncoder",
    "TransformerLM",
    "count_parameters",
    "load_checkpoint",
    "parameter_table",
    "save_checkpoint",
]
