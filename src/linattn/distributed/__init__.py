"""Context parallelism: causal linear attention, FAVOR+, gated linear attention and the delta rule
over one sequence sharded along N across the ranks of a ``torch.distributed`` process group
(LASP / LASP-2, arXiv 2404.02882, 2502.07563). Each function has the name and options of its
functional form plus ``group``, takes this rank's shard and returns this rank's outputs; see
``context.py`` and docs/context_parallel.md.

Sits at the functional tier: imports ``linattn.functional`` and ``torch.distributed`` only.
Tested with gloo on CPU; written device-agnostic for nccl on CUDA, which is untested.
"""

from .context import (
    all_gather_differentiable,
    delta_rule_attention,
    favor_attention,
    gated_linear_attention,
    linear_attention,
)

__all__ = [
    "all_gather_differentiable",
    "delta_rule_attention",
    "favor_attention",
    "gated_linear_attention",
    "linear_attention",
]
