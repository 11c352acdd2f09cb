"""Context parallelism: one sequence sharded along N across the ranks of a ``torch.distributed``
process group. Causal linear attention, FAVOR+, gated linear attention and the delta rule exchange
one fixed-size summary per rank (LASP / LASP-2, arXiv 2404.02882, 2502.07563; ``context.py``);
sliding-window attention and short convolutions exchange a halo of the positions before each
shard, and softmax attention gathers every rank's keys and values (``layers.py``). Each function
has the name and options of its functional form plus ``group``, takes this rank's shard and
returns this rank's outputs; :class:`ContextParallel` is what a model's forward takes, and its
``attend`` runs any mechanism's sharded form (``SHARDING`` of its functional file) through the
driver its kind needs: :func:`sharded` for every recurrent mechanism. See docs/context_parallel.md.

Sits at the functional tier: imports ``linattn.functional`` and ``torch.distributed`` only.
Tested with gloo on CPU; written device-agnostic for nccl on CUDA, which is untested.
"""

from .context import (
    all_gather_differentiable,
    delta_rule_attention,
    depend_on,
    favor_attention,
    gated_linear_attention,
    linear_attention,
    sharded,
)
from .layers import ContextParallel, Halo, check_context_parallel, halo, local_attention, softmax_attention

__all__ = [
    "ContextParallel",
    "Halo",
    "all_gather_differentiable",
    "check_context_parallel",
    "delta_rule_attention",
    "depend_on",
    "favor_attention",
    "gated_linear_attention",
    "halo",
    "linear_attention",
    "local_attention",
    "sharded",
    "softmax_attention",
]
