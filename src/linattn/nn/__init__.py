"""Tier 2: modules that own parameters and buffers and call the functional tier.

Imports ``linattn.functional`` only, never the higher tiers (models, bench, cli).
"""

from .favor import FavorAttention, FavorConfig

__all__ = ["FavorAttention", "FavorConfig"]
