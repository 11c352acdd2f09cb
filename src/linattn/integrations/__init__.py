"""Top tier: linattn as the engine of other libraries' models.

Each submodule imports its library only when one of its functions is called, so ``import linattn``
never imports it: ``linattn.integrations.transformers`` (Hugging Face transformers' Gated DeltaNet
and Kimi Delta Attention layers).
"""
