"""What a computation does below Python, counted under a ``TorchDispatchMode``: the dtypes of every
op's tensors (float64 has no place in a fast form: MPS has none, consumer GPUs run it at 1/32 to
1/64 of float32) and the host reads of tensor values (each one stalls a GPU until its queue drains).

Used by the portability tests (issue 29) and to measure where the code stands before a change.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HOST_READS", "OpProbe"]

# The ATen ops that copy a tensor's value to the host: `.item()`, `bool(t)`, `int(t)`, `.tolist()`
# and Python control flow on a tensor all end in one of them.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"})


class OpProbe(TorchDispatchMode):
    """Within the block, record every ATen op that runs (autograd's backward included):
    ``ops`` counts them by name, ``float64_ops`` those with a float64 tensor among their inputs or
    outputs, ``host_reads`` those that read a tensor's value on the host (:data:`HOST_READS`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.float64_ops: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        self.ops[name] += 1
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in tensors):
            self.float64_ops[name] += 1
        if name in HOST_READS:
            self.host_reads[name] += 1
        return out

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())
