"""What a computation does below Python, counted under a ``TorchDispatchMode``: the dtypes of every
op's tensors (float64 has no place in a fast form: MPS has none, consumer GPUs run it at 1/32 to
1/64 of float32) and the host reads of tensor values (each one stalls a GPU until its queue drains).

Used by the portability tests (issue 29) and to measure where the code stands before a change.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from linattn.functional.checks import ENGINE_OPS

__all__ = ["HOST_METHODS", "HOST_READS", "OpProbe", "VALUE_SHAPED", "reads_host"]

# The ATen ops that copy a tensor's value to the host: `.item()`, `bool(t)`, `int(t)`, `.tolist()`
# and Python control flow on a tensor all end in one of them. `item` itself is seen where a mode is
# entered again inside a dispatch (the probe inside an engine's operator), before it decomposes.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
                        "aten.equal.default"})
# Ops whose output shape depends on the values (the host must read how many): they synchronise too.
VALUE_SHAPED = frozenset({"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                          "aten.unique_consecutive.default", "aten.unique_dim.default"})


def reads_host(name: str, args, kwargs) -> bool:
    """Whether the op ``name`` called with ``args, kwargs`` reads tensor values on the host."""
    if name in HOST_READS or name in VALUE_SHAPED:
        return True
    if name == "aten.index.Tensor":  # a bool index is a nonzero inside
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    if name == "aten.repeat_interleave.Tensor":  # without output_size the total is read
        return (kwargs or {}).get("output_size") is None
    return False


# Tensor methods that copy values to the host without an ATen op on a CPU tensor (on an
# accelerator they are a copy to the CPU): seen at the Python level instead.
HOST_METHODS = frozenset({"tolist", "numpy", "cpu"})


class _MethodProbe(TorchFunctionMode):
    def __init__(self, probe: "OpProbe") -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_METHODS:
            self.probe.host_reads[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


class OpProbe(TorchDispatchMode):
    """Within the block, record every ATen op that runs (autograd's backward included):
    ``ops`` counts them by name, ``float64_ops`` those with a float64 tensor among their inputs or
    outputs, ``host_reads`` those that read a tensor's value on the host (:func:`reads_host`, and
    the methods :data:`HOST_METHODS`). An engine's operator (``EngineOp``) is one opaque call to a
    dispatch mode; ``engines=True`` runs its kernel under the probe instead, so that the ops inside
    the engines are counted too."""

    def __init__(self, *, engines: bool = False) -> None:
        super().__init__()
        self.engines = engines
        self.ops: Counter[str] = Counter()
        self.float64_ops: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self._methods = _MethodProbe(self)

    def __enter__(self):
        self._methods.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._methods.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        engine = ENGINE_OPS.get(func.name()) if self.engines else None
        if engine is not None:  # into the engine: its kernel's ops under this probe too
            with self:
                out = engine._run(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        name = str(func)
        self.ops[name] += 1
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in tensors):
            self.float64_ops[name] += 1
        if reads_host(name, args, kwargs):
            self.host_reads[name] += 1
        return out

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())
