"""Tier 2: modules that own a mechanism's parameters and buffers and call ``linattn.functional``.

Imports the functional tier only; nothing below imports this package. Modules here never own the
query/key/value/output projections (those belong to one attention layer that calls any mechanism).
"""

from .favor import FavorAttention, FavorConfig
from .linformer import LinformerAttention

__all__ = ["FavorAttention", "FavorConfig", "LinformerAttention"]
