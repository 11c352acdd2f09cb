"""What a computation does below Python, counted under a ``TorchDispatchMode``: the dtypes of every
op's tensors (float64 has no place in a fast form: MPS has none, consumer GPUs run it at 1/32 to
1/64 of float32), the host reads of tensor values (each one stalls a GPU until its queue drains)
the ops that CUDA refuses while deterministic algorithms are on (a CPU runs them regardless) and
the scans that CUDA runs on a contiguous copy (a CPU scans strided memory as it is).

Used by the portability tests (issue 29) and to measure where the code stands before a change.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from linattn.functional.checks import ENGINE_OPS

__all__ = ["HOST_METHODS", "HOST_READS", "OpProbe", "VALUE_SHAPED", "deterministic_algorithms", "reads_host",
           "cuda_cumsum", "cuda_scan_order", "refused_by_cuda", "scans_a_copy_on_cuda"]

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


# The ops that torch.use_deterministic_algorithms(True) makes raise on a CUDA tensor (its docstring's
# list, the array ops among it) and that run on a CPU without a word: a CPU test sees them only here.
_CUDA_REFUSES = ("aten.histc.", "aten.median.dim", "aten.put_.", "aten.put.")


def refused_by_cuda(name: str, args, kwargs) -> bool:
    """Whether CUDA would refuse the op ``name`` with ``args, kwargs`` while deterministic algorithms
    are on: a floating or complex cumsum (no deterministic kernel), a weighted bincount, a scatter
    reduce by product, and the ops of ``_CUDA_REFUSES``."""
    if not torch.are_deterministic_algorithms_enabled():
        return False
    if name.startswith("aten.cumsum"):
        return args[0].is_floating_point() or args[0].is_complex()
    if name.startswith("aten.bincount"):
        return (args[1] if len(args) > 1 else (kwargs or {}).get("weights")) is not None
    if name.startswith("aten.scatter_reduce"):
        return "prod" in [a for a in args if isinstance(a, str)] + [(kwargs or {}).get("reduce")]
    return name.startswith(_CUDA_REFUSES)


def scans_a_copy_on_cuda(name: str, args, kwargs, out) -> bool:
    """Whether the op ``name`` is a cumulative sum that CUDA (and XPU) would run on contiguous copies:
    its kernels take contiguous tensors only, so a strided input is copied first and a strided
    result computed into a new tensor and copied back (aten's ScanKernels: ``contiguous_out_arg``,
    ``expect_contiguous``): two passes and a temporary the size of the result that a CPU never
    shows, since its scan walks strided memory as it is."""
    if not name.startswith("aten.cumsum"):
        return False
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return not args[0].is_contiguous() or not all(t.is_contiguous() for t in outs)


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` within the block (as transformers'
    ``full_determinism`` sets it), the previous setting restored after. CUDA then refuses the ops of
    :func:`refused_by_cuda`, and on every device ``torch.empty`` fills floats with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``): a read of memory that nothing wrote
    shows as NaN, where on a CPU fresh pages are zeros and would hide it."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


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
    the methods :data:`HOST_METHODS`), ``cuda_refusals`` those that CUDA would refuse under
    deterministic algorithms (:func:`refused_by_cuda`), ``cuda_scan_copies`` the scans that CUDA
    runs on contiguous copies (:func:`scans_a_copy_on_cuda`). An engine's operator (``EngineOp``) is
    one opaque call to a dispatch mode; ``engines=True`` runs its kernel under the probe instead, so
    that the ops inside the engines are counted too."""

    def __init__(self, *, engines: bool = False) -> None:
        super().__init__()
        self.engines = engines
        self.ops: Counter[str] = Counter()
        self.float64_ops: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.cuda_refusals: Counter[str] = Counter()
        self.cuda_scan_copies: Counter[str] = Counter()
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
        if refused_by_cuda(name, args, kwargs):
            self.cuda_refusals[name] += 1
        if scans_a_copy_on_cuda(name, args, kwargs, out):
            self.cuda_scan_copies[name] += 1
        return out

    @property
    def n_host_reads(self) -> int:
        return sum(self.host_reads.values())


def _cuda_inner_block(num_rows: int, row_size: int) -> int:
    """The elements CUDA's inner scan sums as one tree, ``2 * num_threads_x`` (aten's
    ScanUtils.cuh, ``get_log_num_threads_x_inner_scan``: the ratio of threads kept near that of the
    row length to the rows, 512 threads a block, 16 to 512 of them along the row)."""
    log_x = max(row_size - 1, 0).bit_length()
    log_y = max(num_rows - 1, 0).bit_length()
    return 2 << min(max(4, (9 + log_x - log_y) // 2), 9)


def _sklansky_rows(x: Tensor) -> Tensor:
    """Inclusive sums of ``x (rows, L)`` in the order of CUDA's inner scan: blocks of
    :func:`_cuda_inner_block` elements, each summed by a Sklansky tree (level m: the upper half of
    every 2^(m+1) elements adds the last of the lower half), the total of the earlier blocks added
    to each block's first element first; a new tensor."""
    rows, L = x.shape
    B = _cuda_inner_block(rows, L)
    out = torch.empty_like(x)
    total = torch.zeros_like(x[:, :1])
    for start in range(0, L, B):
        block = x.new_zeros(rows, B)
        width = min(B, L - start)
        block[:, :width] = x[:, start:start + width]
        block[:, :1] += total
        s = 1
        while s < B:
            pairs = block.view(rows, B // (2 * s), 2 * s)
            pairs[:, :, s:] += pairs[:, :, s - 1:s]
            s *= 2
        out[:, start:start + width] = block[:, :width]
        total = block[:, B - 1:]
    return out


def cuda_cumsum(x: Tensor, dim: int) -> Tensor:
    """``torch.cumsum(x, dim)`` in the order of additions and the precision CUDA sums it with (aten's
    ``scan_dim``): along the last dimension a Sklansky tree in blocks (:func:`_sklansky_rows`),
    along any other one each column in turn in x's own dtype (a CPU's cumsum carries a float's
    running sum in double); a sum over every element (CUB's scan) taken as the last dimension."""
    dim = dim % x.dim()
    if dim == x.dim() - 1 or x.numel() == x.shape[dim]:
        flat = x.movedim(dim, -1)
        return _sklansky_rows(flat.reshape(-1, flat.shape[-1])).view(flat.shape).movedim(-1, dim)
    out = x.clone()
    acc = out.select(dim, 0).clone()
    for i in range(1, x.shape[dim]):
        acc += x.select(dim, i)
        out.select(dim, i).copy_(acc)
    return out


class _CudaScanOrder(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        name = str(func)
        engine = ENGINE_OPS.get(func.name())
        if engine is not None:  # into the engine: its scans too
            with self:
                return engine._run(*args, **(kwargs or {}))
        if name in ("aten.cumsum.default", "aten.cumsum_.default") and args[0].is_floating_point() \
                and args[0].numel() and (kwargs or {}).get("dtype") is None and len(args) == 2:
            summed = cuda_cumsum(args[0], args[1])
            return args[0].copy_(summed) if name == "aten.cumsum_.default" else summed
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_scan_order():
    """Within the block, every floating cumsum (the engines' own included) is summed as CUDA sums
    it (:func:`cuda_cumsum`): a CPU test then sees the rounding a GPU run gets from its scans, which
    a CPU's sequential double-carried cumsum hides."""
    with _CudaScanOrder():
        yield
