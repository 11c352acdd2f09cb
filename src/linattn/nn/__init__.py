"""Tier 2: modules that own parameters and buffers of a mechanism and call ``linattn.functional``.

Imports the functional tier only; nothing below imports this package. Modules here never own the
query/key/value/output projections (those belong to one attention layer that calls any mechanism).
"""

from .linformer import LinformerAttention

__all__ = ["LinformerAttention"]
