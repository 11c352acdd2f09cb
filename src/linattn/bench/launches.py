"""Kernel launches counted on any device, a CPU included: the aten ops of a call that compute.

On a GPU every aten op that computes something launches (at least) one kernel, and a call made of
many small launches is bound by them rather than by arithmetic. torch.profiler records every aten
op on a CPU as well, so the count can be tracked without a GPU: an op counts when it computes (not
a view, a reshape of metadata or an allocation) and no computing aten op runs below it (a
composite op such as ``linalg.vecdot`` counts as the ops it is made of). On the H200 this count
was within a few percent of the CUDA kernels launched (../shared/gpu/README.md).

Dimension legend: none (counts only).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, NamedTuple

import torch

__all__ = ["NON_COMPUTING", "LaunchCount", "count_launches"]

# aten ops that only make a view, change metadata or allocate: no kernel runs for them.
NON_COMPUTING = frozenset(f"aten::{name}" for name in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "transpose", "t", "permute", "expand",
    "expand_as", "select", "slice", "narrow", "unsqueeze", "squeeze", "flatten", "unflatten", "unbind", "split",
    "split_with_sizes", "chunk", "diagonal", "alias", "detach", "detach_", "lift_fresh", "view_as", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "contiguous", "clone_meta",
    "movedim", "moveaxis", "swapaxes", "real", "_has_compatible_shallow_copy_type", "is_nonzero", "item",
    "_local_scalar_dense", "result_type", "to", "_to_copy_meta", "lift", "flip_meta", "numpy_T", "mT", "mH",
    "matrix_H", "adjoint", "conj", "_conj", "resolve_conj", "resolve_neg", "_neg_view", "view_as_real",
    "unfold", "align_as", "rename", "refine_names", "indices", "values", "squeeze_", "unsqueeze_", "transpose_",
    "as_strided_", "record_stream", "_nested_tensor_size", "size", "stride", "numel", "dim", "is_same_size",
))


class LaunchCount(NamedTuple):
    """``total`` computing leaf aten ops of a call, and ``by_op`` their count per op name."""

    total: int
    by_op: Counter


def _computes(name: str) -> bool:
    return name.startswith("aten::") and name not in NON_COMPUTING


def count_launches(fn: Callable[[], object]) -> LaunchCount:
    """Run ``fn()`` once under torch.profiler (CPU activity) and count its computing leaf aten ops.

    Why leaves: a composite op calls others (``matmul`` calls ``bmm``; ``to`` calls ``copy_``); only
    the innermost that compute become kernels. ``to``/``contiguous`` count through the ``copy_``
    below them, when there is one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    by_op: Counter = Counter()

    def computing_below(ev) -> bool:
        return any(_computes(c.name) or computing_below(c) for c in ev.cpu_children)

    for ev in prof.events():
        if _computes(ev.name) and not computing_below(ev):
            by_op[ev.name] += 1
    return LaunchCount(sum(by_op.values()), by_op)
