"""linattn as the engine of Hugging Face transformers' linear-attention layers, on any device.

transformers (5.23) ships hybrids whose linear-attention layers run the gated delta rule (Qwen3-Next,
Qwen3.5, Qwen3.5-MoE, Qwen4-exp, OLMo-Hybrid), Kimi Delta Attention (Kimi Linear, GLM5-Next, the
Bailing hybrid) or Mamba-2's state-space duality, SSD (Mamba-2, Bamba, Falcon-H1, the Granite-4.0
hybrids, Nemotron-H, Zamba2). With flash-linear-attention's Triton kernels or mamba_ssm's CUDA
kernels they are fast; everywhere else they run reference PyTorch code that is slow, needs
O(N C^2 D) memory for KDA, and mishandles packed documents (Qwen's layers refuse ``cu_seq_lens_q``;
Kimi's and every Mamba-2 family's carry the state from one document into the next; the causal
convolution ignores the boundaries in all).

:func:`enable` makes every supported model built afterwards by ``from_pretrained`` /
``from_config`` run its linear-attention layers on linattn:

- chunked prefill and training: :func:`linattn.functional.delta_rule_attention` (per-head decays for
  the gated delta rule, per-channel for KDA; grouped value heads as they come), and for SSD
  :func:`linattn.functional.gated_linear_attention` (a decay per head; B and C shared by a group's
  heads, which its grouped route computes once per group);
- recurrent decoding, one token at a time, through transformers' own cache (its conv and recurrent
  states, its ``update_*`` calls, so speculative decoding's past recording still works);
- packed documents (``cu_seq_lens_q``, what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
  produces, or for SSD ``seq_idx``, ``return_seq_idx=True``'s): the recurrence and the causal
  convolution both restart at every document. A cache holds one state per batch row, not per
  document, so a packed forward leaves the linear layers' cache states unset (a model makes a cache
  whenever ``config.use_cache`` is on, training included), and a packed forward that would continue
  a cache with states is refused. transformers does not give these layers ``position_ids``: packing
  seen only there is invisible to them.

Weights, parameter names and checkpoints are unchanged: the replacement layer classes subclass the
originals and only override ``forward``. A model saved with linattn loads without it.

How it plugs in (the route, and every place it touches transformers):

- The class replacement goes through transformers' public ``transformers.monkey_patching``
  (``register_patch_mapping`` / ``unregister_patch_mapping``), applied by transformers itself at
  ``from_pretrained`` / ``from_config`` (and inside ``monkey_patching.apply_patches()``).
- Nemotron-H builds its mixers from ``MIXER_TYPES``, a dict of classes made at import, which the
  patch mapping (it replaces module attributes) cannot reach: the mapping also replaces
  ``NemotronHBlock`` by a subclass whose ``__init__`` runs the original and then switches its
  ``mixer`` to the replacement class (:attr:`Family.holder`).
- The ``kernels`` function mapping is not used: transformers 5.23 accepts only kernels >= 0.18.2,
  which this project's package index lacks, so it cannot be tested here.
- :func:`attach` switches the layers of an already built model by assigning ``__class__`` (to the
  subclass, which adds no state); :func:`detach` switches them back.
- The replacement forward reads the layers' own submodules, parameters and attributes by their names
  (``in_proj_qkvz``, ``conv1d``, ``A_log``, ``norm``, ``in_proj``, ``dt_bias``, ``D``,
  ``time_step_limit``, ``n_groups``, ``ssm_state_size``, ``conv_dim``, Falcon-H1's
  ``ssm_in_multiplier``, ``mamba_rms_norm`` and the ``mup_vector`` buffer its model registers, ...),
  calls Qwen3-Next's ``fix_query_key_value_ordering`` and the layers' own gated norms and forget
  gates, and uses the cache's public methods. These are transformers internals in the sense that no
  API promises them; every replacement checks them when a layer is built (a clear error naming the
  missing ones), and tests/test_transformers_integration.py and tests/test_transformers_ssd.py fail
  the day they move.

What linattn computes differently, on purpose, is in each rule's module (``delta``, ``mamba2``): the
recurrence and its inputs in float32 (float64 for a float64 model), chunked by linattn's engine, and
nothing else.

Written for CUDA and MPS as much as for CPUs (no float64 outside float64 models, no host reads in
the fast path besides the packed documents' offsets, read once per model call); tested on CPUs only.

Modules, each importing only those before it: ``layers`` (what every replacement shares), ``delta``
and ``mamba2`` (the rules' families and forwards), ``route`` (the switches), ``small`` (small
configs for tests, the README, the demo and the benchmarks).
"""

from .delta import delta_rule
from .layers import FORMS, PACKED_CACHE_WARNING, Family, Form
from .route import FAMILIES, attach, detach, disable, enable, enabled, is_enabled, replacement_class
from .small import SMALL_LAYER_TYPES, causal_lm, small_config
from .mamba2 import ssd

__all__ = [
    "FAMILIES",
    "FORMS",
    "Family",
    "Form",
    "PACKED_CACHE_WARNING",
    "SMALL_LAYER_TYPES",
    "attach",
    "causal_lm",
    "delta_rule",
    "detach",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "replacement_class",
    "small_config",
    "ssd",
]
