"""Argument validation and small helpers shared by the mechanisms of the functional tier.

Dimension legend (used across ``linattn.functional``):
    B  batch            H  heads
    Nq query positions  Nk key positions      N  positions when Nq == Nk
    D  query/key width  Dv value width        F  feature-map width

Every check raises with a message that names the argument and the shapes involved. Nothing here
pads, crops or broadcasts: a caller who passes the wrong shape hears about it.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
from torch import Tensor

__all__ = [
    "at_most",
    "check_key_padding_mask",
    "check_positive_int",
    "check_qkv",
    "check_recurrent_args",
    "check_scale",
    "check_values",
    "compute_dtype",
    "finite_max",
    "no_autocast",
    "sanitize_padded",
    "shape_str",
]


def check_values(ok: Tensor, message) -> None:
    """Raise ``ValueError(message())`` unless every entry of the bool tensor ``ok`` is True, with
    no host read when they are (a read of a tensor's value stalls a GPU until its queue drains;
    a fast form checks its gates' values on every call).

    The check is ``torch._assert_async`` (documented in torch, underscore and all): on a CPU it
    raises at once, turned here into the ValueError, whose ``message`` may read the offending
    value (only a failure pays for that read); on an accelerator it is a device-side assertion
    that fails the stream when it runs instead of stalling it now, and the error then surfaces
    later as the device's own (written for CUDA, tested on the CPU only). Traceable by
    ``torch.compile``. Devices without a kernel for it (MPS, in torch 2.13: CPU and CUDA only) read
    the host instead: correct, at the cost of the stall."""
    if ok.device.type not in ("cpu", "cuda"):
        if not bool(ok.all()):
            raise ValueError(message())
        return
    try:
        torch._assert_async(ok.all(), "linattn: a value check failed (see the function's argument contract)")
    except NotImplementedError:  # a RuntimeError too, but not a failed check
        raise
    except RuntimeError:
        raise ValueError(message()) from None


def at_most(x: Tensor, bound: float) -> Tensor:
    """Whether every entry of ``x`` is at most ``bound``, a 0-d bool tensor for :func:`check_values`
    (False where an entry is NaN: the maximum carries a NaN through). From the maximum, one pass
    over ``x``: the comparison's bool tensor and its ``all`` took ten times as long on a CPU (1.3
    against 0.13 ms for 2**20 float32 log decays, 2 threads)."""
    if x.numel() == 0:  # a maximum of nothing is undefined; nothing is above the bound
        return torch.ones((), dtype=torch.bool, device=x.device)
    return x.amax() <= bound


def shape_str(t: Tensor) -> str:
    """``t``'s shape as ``"(2, 8, 64)"``, for error messages."""
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_qkv(fn: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> None:
    """Validate SDPA-layout inputs ``q (B,H,Nq,D)``, ``k (B,H,Nk,D)``, ``v (B,H,Nk,Dv)``.

    Raises:
        TypeError: an input is not a tensor, is not floating point, or the dtypes differ.
        ValueError: wrong rank, mismatched B, H, D or Nk, different devices, or ``causal`` with
            Nq != Nk.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"{fn}: {name} must have 4 dimensions (B, H, N, D) like scaled_dot_product_attention, "
                f"got shape {shape_str(t)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{fn}: q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"{fn}: q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"{fn}: batch size B differs: q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(
            f"{fn}: number of heads H differs: q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{fn}: q and k must have the same last dimension D, got q {shape_str(q)} and k {shape_str(k)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{fn}: k and v must have the same number of keys Nk (dim 2), got k {shape_str(k)} and v {shape_str(v)}"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{fn}: causal=True needs as many queries as keys (query i sees keys j <= i), got "
            f"q {shape_str(q)} and k {shape_str(k)}"
        )


def check_key_padding_mask(fn: str, mask: Tensor | None, k: Tensor) -> None:
    """Validate ``key_padding_mask``: bool ``(B, Nk)``, True = a real key, False = padding."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{fn}: key_padding_mask must be a bool tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{fn}: key_padding_mask must have dtype torch.bool (True = real key, False = padding), "
            f"got {mask.dtype}"
        )
    expected = (k.shape[0], k.shape[2])
    if tuple(mask.shape) != expected:
        raise ValueError(
            f"{fn}: key_padding_mask must have shape (B, Nk) = {expected} for k {shape_str(k)}, "
            f"got {shape_str(mask)}"
        )
    if mask.device != k.device:
        raise ValueError(f"{fn}: key_padding_mask is on {mask.device} but k is on {k.device}")


def check_scale(fn: str, scale: float | None, d: int) -> float:
    """The logit scale to use: ``scale`` as a float, or ``1/sqrt(d)`` when None (1 when d = 0).

    Raises:
        TypeError: ``scale`` is not a real number or None.
        ValueError: ``scale`` is not finite.
    """
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be finite, got {scale}")
    return float(scale)


def check_recurrent_args(fn: str, causal: bool, initial_state, return_state: bool) -> None:
    """``initial_state`` and ``return_state`` belong to the recurrent form: ValueError without ``causal``."""
    if not causal and (initial_state is not None or return_state):
        raise ValueError(
            f"{fn}: initial_state and return_state belong to the recurrent form and need causal=True"
        )


def check_positive_int(fn: str, name: str, value) -> int:
    """A tuning knob or size that must be an int >= 1 (``chunk_size``, ...); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: {name} must be an int >= 1, got {value!r}")
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and normalisers are accumulated in: float32 for half inputs, else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """A context that turns autocast off on a device type (``"cpu"``, ``"cuda"``, ...).

    Under autocast the sums over the sequence (states, normalisers) would run in half precision;
    linattn picks its compute dtype itself (:func:`compute_dtype`) and returns the input dtype.
    """
    if not torch.is_autocast_enabled(device_type):  # nothing to turn off: skip the context's own cost
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def expand_key_heads(fn: str, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped value heads: ``q, k (B, Hk, N, D)`` and ``v (B, H, N, Dv)`` with H a multiple of Hk
    -> q and k repeated to H heads, value head h reading query/key head ``h // (H / Hk)`` (the
    convention of flash-linear-attention and transformers: Qwen3-Next, Qwen3.5). Their gradients
    sum over each group (``repeat_interleave``'s backward). Equal head counts, and inputs that
    :func:`check_qkv` will refuse anyway, come back as they are.

    Raises:
        ValueError: q and k differ in their number of heads, or H is not a multiple of Hk.
    """
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k, v)) or q.shape[1] == v.shape[1]:
        return q, k
    G = check_key_groups(fn, q, k, v)
    return q.repeat_interleave(G, dim=1), k.repeat_interleave(G, dim=1)  # (B, H, N, D)


def check_key_groups(fn: str, q: Tensor, k: Tensor, v: Tensor) -> int:
    """The heads per group ``H / Hk`` of grouped value heads ``q, k (B, Hk, N, D)``, ``v (B, H, N, Dv)``.

    Raises:
        ValueError: q and k differ in their number of heads, or H is not a multiple of Hk.
    """
    Hk, H = q.shape[1], v.shape[1]
    if k.shape[1] != Hk:
        raise ValueError(f"{fn}: q and k must have the same number of heads (grouped value heads: q, k "
                         f"(B, Hk, N, D), v (B, H, N, Dv)), got q {shape_str(q)} and k {shape_str(k)}")
    if Hk == 0 or H % Hk:
        raise ValueError(f"{fn}: v's number of heads H must be a multiple of q's and k's Hk (value head h reads "
                         f"query/key head h // (H / Hk)), got q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}")
    return H // Hk


# Every EngineOp by its operator's name: where a dispatch probe that must see inside the engines
# (an operator is one opaque call to a TorchDispatchMode) finds their kernels (tests/probes.py).
ENGINE_OPS: dict[str, "EngineOp"] = {}


class EngineOp:
    """A chunked engine's entry as a ``torch.library`` operator ``name`` (``"linattn::..."``):
    ``schema`` its arguments in order and its outputs, ``impl`` its kernel, run with autocast off on
    the first tensor argument's device (the engines get inputs in the compute dtype their caller
    chose, float32 for half inputs; autocast would run their products in half precision and
    accumulate the states there). Called like a function; :meth:`register_fake` and
    :meth:`register_autograd` as on ``torch.library.custom_op``'s operators.

    Defined through ``torch.library``'s ``define``/``impl``/``register_fake``/``register_autograd``
    rather than ``custom_op``, whose kernel wrapper imports torch._dynamo on an operator's first
    call: 0.7 s of a fresh process's first call, and an import that made torch keep a process group
    alive (:func:`linattn.train.dist.join_group`). What that wrapper does, kept here: once
    torch._dynamo is loaded (a compile may run), the kernel runs under ``torch.compiler.disable``,
    so dynamo never traces into an engine called eagerly beside compiled code; and an operator
    given no autograd formula refuses to be differentiated instead of leaving the gradient out:
    ``backward=True`` (an engine's backward operator: no double backward), unless its schema marks
    an input mutated (torch.library then takes no formula: :func:`once_differentiable` refuses in
    its forward operator's formula instead).
    """

    def __init__(self, name: str, schema: str, impl, *, backward: bool = False):
        namespace, opname = name.split("::")
        self.name, self._impl, self._no_dynamo = name, impl, None
        ENGINE_OPS[name] = self
        self._lib = torch.library.Library(namespace, "FRAGMENT")
        self._lib.define(opname + schema)
        self._lib.impl(opname, self._kernel, "CompositeExplicitAutograd")
        self._op = getattr(getattr(torch.ops, namespace), opname).default
        # torch.library takes no autograd formula for an operator that mutates (Tensor(a!) in its schema)
        if backward and "!)" not in schema:
            torch.library.register_autograd(name, self._refuse, lib=self._lib)

    def __call__(self, *args):
        return self._op(*args)

    def register_fake(self, fn):
        """``fn`` as the operator's shape function (fake tensors in, fake tensors out)."""
        torch.library.register_fake(self.name, fn, lib=self._lib)
        return fn

    def register_autograd(self, backward, *, setup_context) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)``, as
        ``torch.library.register_autograd`` takes them."""
        torch.library.register_autograd(self.name, backward, setup_context=setup_context, lib=self._lib)

    def _kernel(self, *args):
        if self._no_dynamo is None and "torch._dynamo" in sys.modules:
            self._no_dynamo = torch.compiler.disable(self._run)
        return (self._run if self._no_dynamo is None else self._no_dynamo)(*args)

    def _run(self, *args):
        device = next(a.device for a in args if isinstance(a, Tensor))
        # no_grad: nothing inside an engine is recorded (its operator's formula is its gradient), also
        # where no autograd kernel put it below autograd (a backward operator that mutates, under
        # create_graph=True), as custom_op's kernels are
        with torch.no_grad(), no_autocast(device.type):
            return self._impl(*args)

    def _refuse(self, ctx, *grads):
        raise RuntimeError(_second_backward(self.name))


def _second_backward(name: str) -> str:
    return (f"{name}: differentiable once; a second backward (create_graph=True, then backward through the "
            "gradients) is not supported")


class _Refused(torch.autograd.Function):
    """``grads`` unchanged (views), with a backward that refuses (see :func:`once_differentiable`)."""

    @staticmethod
    def forward(ctx, name: str, n: int, *tensors: Tensor):
        ctx.name = name
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_second_backward(ctx.name))


def once_differentiable(name: str, grads: tuple, inputs: tuple) -> tuple:
    """An engine formula's ``grads`` as they are, but refusing a second backward where one could run
    (create_graph=True): they then depend on ``inputs`` (the op's inputs and incoming gradients) through
    a node that raises, instead of coming back detached from them, which would leave the second-order
    terms out without a word. For a backward operator torch.library gives no formula (one that
    mutates); :class:`EngineOp`'s ``backward=True`` refuses the same way."""
    if not torch.is_grad_enabled():
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    linked = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    if not linked:
        return grads
    out = iter(_Refused.apply(name, len(tensors), *tensors, *linked))
    return tuple(next(out) if isinstance(g, Tensor) else g for g in grads)


def sanitize_padded(x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Replace padded key rows of ``x (B,H,Nk,*)`` by zeros.

    ``torch.where`` (not multiplication) so that NaN or inf in padding cannot survive as 0*NaN, and
    the gradient reaching the padded rows is exactly zero.
    """
    if key_padding_mask is None:
        return x
    return torch.where(key_padding_mask[:, None, :, None], x, x.new_zeros(()))


def finite_max(x: Tensor, dim: int) -> Tensor:
    """The largest entry of ``x`` along ``dim`` (kept as a dimension of size 1), and 0 where there
    is no finite one: every entry -inf (all keys masked) or ``dim`` empty (no keys at all, where
    ``amax`` raises). The shift of a stabilised softmax: ``exp(x - shift) <= 1``, and no ``-inf -
    (-inf)`` = NaN. Not detached: callers that hold it constant detach it."""
    if x.shape[dim] == 0:
        return x.new_zeros(*x.shape[:dim % x.dim()], 1, *x.shape[dim % x.dim() + 1:])
    m = x.amax(dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))
