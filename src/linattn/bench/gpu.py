"""`linattn bench gpu`: every chunked form and the transformers backend on a GPU, side by side with
flash-linear-attention's Triton kernels, transformers' own PyTorch path and SDPA (issue 44).

Forms (B = 1, bfloat16 by default, checkpoint widths: 16 heads of 128 unless stated; ``quick``: 2
heads of 16 everywhere, for a CPU check of the script), each a :class:`Form`:

- ``gated_delta``: Gated DeltaNet, ``delta_rule_attention`` with a log decay per head and position;
- ``delta``: DeltaNet, ``delta_rule_attention`` without a decay;
- ``kda``: Kimi Delta Attention, ``delta_rule_attention`` with a log decay per key channel, 32 heads;
- ``gla_channel``: GLA, ``gated_linear_attention`` with a log decay per key channel;
- ``gla_head``: GLA with one gate per head (RetNet, Mamba-2, simple GLA);
- ``ssd``: Mamba-2's scan at Mamba-2 1.3B's width (64 heads of 64, state 128, one group of B and C),
  ``linattn.integrations.transformers.ssd``: the grouped route of ``gated_linear_attention`` with
  Mamba-2's dt (softplus, dt_bias) and D in the engine, what the Mamba-2 family's layers run;
- ``linear``: causal ``linear_attention`` with its elu+1 feature map;
- ``favor``: causal ``favor_attention``, FAVOR+ with 256 positive random features (the registry's);
- ``qwen3_5_model``: the transformers backend: a Qwen3.5-0.8B-width model (hidden 1024, 16 query/key
  and 16 value heads of 128, vocabulary 1024) of 2 Gated DeltaNet layers, on linattn (``attach``)
  against transformers' own path, the same module and weights, its class switched call by call.

Contenders, where they exist for a form: ``linattn``; ``fla``, flash-linear-attention's chunked
kernel when ``fla`` imports (left out with ``fla=False``: it autotunes for minutes on its first
call of each shape); ``transformers``, its pure-PyTorch function (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``, unwrapped from the decorator that would hand
the call to FLA or mamba_ssm); and ``sdpa``, exact causal softmax attention (``scaled_dot_product_attention(is_causal=True)``) at the
form's heads and width, the quadratic reference. A contender that does not import is reported as not
installed, one that raises as its error's first line (FLA's backward raises on Hopper with some
Triton versions): a row of the table either way, never the end of the run.

Inputs: q, v N(0, 1); k N(0, 1), rows L2-normalised for the delta rule (its contract); beta
sigmoid(N(0, 1)) in (0, 1); log decays log-sigmoid(N(0, 1) + 3) in float32, as transformers'
layers compute them. Every contender reads the same values: FLA's and transformers' (B, N, H, D)
copies are made before timing, so no transpose is timed. SSD's inputs are a Mamba-2 mixer's, in
transformers' layout: x ``(B, N, H, P)``, raw time steps dt ``(B, N, H)`` N(0, 0.5), B and C
``(B, N, 1, Ds)`` N(0, 1), A = -1 .. -H, D ones, dt_bias as Mamba-2 initialises it; FLA has no SSD
kernel: its simple GLA takes C and B repeated per head, x dt and A dt formed before timing, and D x
is added to its output.

Passes: ``prefill`` (forward without gradients) and ``train`` (forward+backward, the gradient of
every input; the model's: of every parameter, from its loss). For each (form, N, pass): two warm-up
calls per contender (FLA autotunes in the first, whose seconds are recorded), one call whose peak
memory is measured (``torch.cuda.max_memory_allocated`` above what was allocated before it; None on
a CPU, where no allocator statistics exist), then ``runs`` runs, each ``repeats`` calls per
contender interleaved (A B C A B C ..., the order reversed every call), every call between two
``torch.cuda.synchronize``. A contender's time is the median over the runs of each run's median,
with min and max; its ratio to linattn is taken run by run. A prefill row also gives the largest
difference of the contender's output from linattn's, relative to linattn's largest entry (SDPA
computes another function: none there), which catches a wrong calling convention, and its error
against float64 (:func:`float64_reference`: linattn's function in float64 on the CPU from the
same values), which issue 44 asks to be no worse than FLA's; a training row, its gradients'
errors against float64's, the largest in the table. :func:`targets` judges issue 44's
H200 targets (:data:`TARGETS`) from the rows.

``cuda_graphs``: also ``linattn+cudagraph``, linattn's call captured in CUDA graphs and replayed
(every kernel form, on CUDA): its kernels without the host's launch overhead, what an eager call
costs above them.

``profile``: also one Gated DeltaNet forward and forward+backward of linattn at the first N under
torch.profiler: on a GPU the number of kernels and the time the GPU was busy with them, and on
either device the number of leaf aten ops (ops that call no other aten op), of which the
"computing" ones (no view, no allocation) track kernel launches between GPU runs.

Writes gpu.json and gpu.md (with the device, the versions, the command) into ``out`` after every
(form, N), so that a run stopped by a device's time limit leaves what it measured (``complete`` is
False until the end). Every number there comes from this code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import linattn

from .. import progress
from ..functional import (
    delta_rule_attention,
    favor_attention,
    favor_projection,
    gated_linear_attention,
    linear_attention,
)
from ..nn import FavorConfig
from .harness import RUNS, machine_info, output_folder, spread, write_atomically

__all__ = ["CONTENDERS", "DTYPES", "FORMS", "GRAPHED", "KERNEL_FORMS", "MODEL_FORM", "PASSES", "TARGETS", "Form", "Target",
           "aggregate", "check_device", "check_tunings", "float64_reference", "form_function", "form_projection",
           "format_gpu", "relative_error", "run_gpu", "targets", "tunings"]

# Dimension legend: B batch (1), H heads, N positions, D head width (Dk = Dv).

PASSES = ("prefill", "train")
CONTENDERS = ("linattn", "fla", "transformers", "sdpa")
DTYPES = ("bfloat16", "float16", "float32")
DEFAULT_NS = (4096, 16384)
QUICK_NS = (64, 128)
QUICK_HEADS, QUICK_HEAD_DIM = 2, 16  # the quick sizes' heads and widths (SSD's state too)
HEAD_DIM = 128
REPEATS = 5
# FLA autotunes its Triton kernels in the first call of each shape; the second call is warm
WARMUP = 2
FAVOR_FEATURES = FavorConfig().num_features  # the registry's default m
REFERENCE = "float64 reference"  # the row of a setting whose float64 reference failed


@dataclass(frozen=True)
class Form:
    """One chunked form: how linattn computes it and who else does.

    ``decay``: None, ``"head"`` (a log decay ``(B, H, N)``) or ``"channel"`` (``(B, H, N, D)``);
    ``delta``: the delta rule (unit keys and a beta ``(B, H, N)``); ``fla`` / ``transformers``: the
    dotted path of FLA's kernel / transformers' PyTorch function for it (None: none exists);
    ``head_dim``: the value width (and the key width but for SSD); ``state``: SSD's state size (its
    key width), None for the other forms."""

    name: str
    title: str
    heads: int
    decay: str | None
    delta: bool
    fla: str | None = None
    transformers: str | None = None
    head_dim: int = HEAD_DIM
    state: int | None = None


_QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
_KIMI = "transformers.models.kimi_linear.modeling_kimi_linear"
KERNEL_FORMS: dict[str, Form] = {f.name: f for f in (
    Form("gated_delta", "Gated DeltaNet (delta_rule_attention, a log decay per head)", 16, "head", True,
         fla="fla.ops.gated_delta_rule.chunk_gated_delta_rule",
         transformers=f"{_QWEN3_NEXT}.torch_chunk_gated_delta_rule"),
    Form("delta", "DeltaNet (delta_rule_attention, no decay)", 16, None, True,
         fla="fla.ops.delta_rule.chunk_delta_rule"),
    Form("kda", "Kimi Delta Attention (delta_rule_attention, a log decay per key channel)", 32, "channel", True,
         fla="fla.ops.kda.chunk_kda", transformers=f"{_KIMI}.chunk_kimi_delta_attention"),
    Form("gla_channel", "GLA (gated_linear_attention, a log decay per key channel)", 16, "channel", False,
         fla="fla.ops.gla.chunk_gla"),
    Form("gla_head", "GLA per head / RetNet (gated_linear_attention, a log decay per head)", 16, "head", False,
         fla="fla.ops.simple_gla.chunk_simple_gla"),
    Form("ssd", "Mamba-2 SSD (integrations.transformers.ssd: the grouped route of gated_linear_attention, dt and D "
         "in the engine), one group of B and C", 64, "head", False, fla="fla.ops.simple_gla.chunk_simple_gla",
         transformers="transformers.models.mamba2.modeling_mamba2.mamba2_chunk_scan", head_dim=64, state=128),
    Form("linear", "causal linear attention (linear_attention, elu+1)", 16, None, False),
    Form("favor", f"FAVOR+ causal (favor_attention, {FAVOR_FEATURES} positive features)", 16, None, False),
)}
MODEL_FORM = "qwen3_5_model"
MODEL_TITLE = "transformers backend: a Qwen3.5-width model of 2 Gated DeltaNet layers"
FORMS = (*KERNEL_FORMS, MODEL_FORM)
# the model at Qwen3.5-0.8B's linear-attention width, and at the quick sizes
MODEL_DIMS = {False: dict(hidden_size=1024, heads=16, key_heads=16, head_dim=128, vocab_size=1024),
              True: dict(hidden_size=32, heads=QUICK_HEADS, key_heads=QUICK_HEADS, head_dim=QUICK_HEAD_DIM,
                         vocab_size=128)}


# ---------------------------------------------------------------------------------------------
# The device
# ---------------------------------------------------------------------------------------------


def check_device(device: str) -> torch.device:
    """``device`` as a torch.device: ``cpu`` or ``cuda[:i]`` with that GPU present. ValueError (one
    line naming the device) otherwise: on a machine without CUDA the run would fail at its first
    tensor, after the imports, with a traceback."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r}: not a device; use cuda, cuda:<index> or cpu") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {device}: only cuda (the benchmark) and cpu (a check of the script) are timed")
    if not torch.cuda.is_available():
        why = "a build without CUDA" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, {why}); "
                         "use --device cpu --quick to check the script")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} GPUs here")
    return dev


def _synchronizer(dev: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work: a GPU call returns before its kernels have run."""
    if dev.type == "cuda":
        return functools.partial(torch.cuda.synchronize, dev)
    return lambda: None


def _version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` found (None: none is), read from the
    package metadata without importing it (importing FLA would defeat ``fla=False``)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def describe_device(dev: torch.device) -> dict:
    """The device's name and, on a GPU, its capability and memory."""
    if dev.type != "cuda":
        return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(dev)
    return {"type": "cuda", "name": props.name, "capability": list(torch.cuda.get_device_capability(dev)),
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}


def versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton", "pytorch-triton"), "fla": _version("fla-core", "flash-linear-attention"),
            "transformers": _version("transformers"), "linattn": linattn.__version__}


@contextlib.contextmanager
def _fla_blocked(blocked: bool) -> Iterator[None]:
    """While ``blocked``, ``import fla`` fails as for a package that is not installed (a None entry in
    sys.modules), so that transformers' modeling modules imported meanwhile resolve their kernels to
    their PyTorch path: transformers picks FLA for its layers whenever it imports, and ``fla=False``
    means no FLA anywhere (its autotuning is what that flag avoids). No effect once FLA was
    imported in this process: :func:`transformers_kernels` then records what was resolved."""
    if not blocked or "fla" in sys.modules:
        yield
        return
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "fla" in sys.modules and sys.modules["fla"] is None:
            del sys.modules["fla"]


def _resolved(fn: Callable) -> str:
    """The function transformers' kernel decorator (``use_kernel_func_from_hub_with_fallback``)
    hands ``fn``'s calls to: FLA's or causal-conv1d's kernel when it found one at import, else its
    own PyTorch code. Read from the closure of the wrapper (its free variable ``implementation``)."""
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and "implementation" in code.co_freevars and fn.__closure__:
            impl = fn.__closure__[code.co_freevars.index("implementation")].cell_contents
            return f"{impl.__module__}.{impl.__qualname__}"
        fn = getattr(fn, "__wrapped__", None)
    return "unknown"


def transformers_kernels() -> dict[str, str] | str:
    """What transformers' own path of the Qwen3.5 model runs for its recurrence and its convolution
    (its modeling module is imported here, under :func:`_fla_blocked` when FLA is left out)."""
    try:
        module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    except Exception as e:  # noqa: BLE001 - not installed, or an incompatible version: said in the table
        return f"not installed ({_first_line(e)})"
    return {name: _resolved(getattr(module, name)) for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")}


# ---------------------------------------------------------------------------------------------
# Contenders
# ---------------------------------------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    """``Type: the message's first line``, at most 300 characters: what a table row can hold."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")


class Unavailable(Exception):
    """A contender that cannot run here: ``status`` is "not installed" or "left out"."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _import(path: str) -> Callable:
    """The object at dotted ``path`` (``package.module.name``); :class:`Unavailable` "not installed"
    when it does not import, whatever the reason (missing package, a version without it, a missing
    dependency such as Triton)."""
    module, name = path.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - any failure to import is "not installed" here
        raise Unavailable("not installed", _first_line(e)) from None


@dataclass
class Subject:
    """One contender at one setting: ``call()`` is one timed call (it returns the output of a
    prefill, None for a training step); ``canonical`` puts a prefill's output, or a gradient of one
    of ``inputs``, into linattn's layout for the checks (None: not comparable); ``inputs``: the
    tensors a training step leaves gradients in, in the order of linattn's (None: not comparable)."""

    call: Callable[[], Tensor | None]
    canonical: Callable[[Tensor], Tensor] | None = None
    inputs: list[Tensor] | None = None


def _subject(fn: Callable[..., Tensor], tensors: list[Tensor], train: bool,
             canonical: Callable[[Tensor], Tensor] | None) -> Subject:
    """``fn`` on its own ``tensors`` (:func:`_runner`), their gradients checked when ``canonical``."""
    return Subject(_runner(fn, tensors, train), canonical, tensors if canonical is not None else None)


def _same(x: Tensor) -> Tensor:
    return x


def _bnhd(x: Tensor) -> Tensor:
    # (B, H, N, ...) <-> (B, N, H, ...) contiguous: FLA's and transformers' layout, and back (its own
    # inverse) for their outputs and gradients
    return x.transpose(1, 2).contiguous()


def widths(form: Form, quick: bool) -> tuple[int, int, int | None]:
    """``(heads, head_dim, state)`` of ``form``: its checkpoint width, or the quick sizes (2 heads of
    16, SSD's state 16); state None but for SSD."""
    if quick:
        return QUICK_HEADS, QUICK_HEAD_DIM, None if form.state is None else QUICK_HEAD_DIM
    return form.heads, form.head_dim, form.state


def width_record(form: Form, quick: bool) -> dict:
    """``{"heads", "head_dim"[, "state"]}`` of ``form`` (:func:`widths`), as the result files record it."""
    heads, head_dim, state = widths(form, quick)
    return {"heads": heads, "head_dim": head_dim, **({} if state is None else {"state": state})}


def make_inputs(form: Form, n: int, heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                seed: int = 0, state: int | None = None) -> list[Tensor]:
    """``[q, k, v, beta?, log_decay?]`` for ``form`` in the SDPA layout: q, k, v ``(B, H, N, D)`` in
    ``dtype``, k L2-normalised for the delta rule; beta ``(B, H, N)`` in ``dtype``; the log decay
    ``(B, H, N)`` or ``(B, H, N, D)`` in float32. Drawn on ``device`` from a seeded generator (a
    host-side draw and copy takes seconds at N = 16384, 32 heads), the same values for every seed.

    SSD (``form.state``; ``state`` its width): :func:`ssd_inputs`' Mamba-2 mixer inputs as
    ``gated_linear_attention`` takes Mamba-2's scan, ``[q, k, v, log_decay, value_scale, skip]``:
    one group of queries (C) and keys (B) ``(B, 1, N, state)``, values x ``(B, H, N, D)``, the time
    steps ``dt = softplus(dt_raw + dt_bias)`` ``(B, H, N)`` as the value scale, the log decay
    ``A dt``, and the skip D ``(H,)``; dt, the log decay and D in float32 (float64 for float64), as
    the mixer computes them."""
    if form.state is not None:
        m = ssd_inputs(n, heads, head_dim, state or form.state, dtype=dtype, device=device, seed=seed)
        ct = torch.float64 if dtype == torch.float64 else torch.float32  # the mixer's compute dtype
        dt = F.softplus(m["dt"].to(ct) + m["dt_bias"].to(ct)).transpose(1, 2).contiguous()  # (B, H, N)
        return [m["C"].transpose(1, 2).contiguous(), m["B"].transpose(1, 2).contiguous(),
                m["x"].transpose(1, 2).contiguous(), m["A"].to(ct)[:, None] * dt, dt, m["D"].to(ct)]
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (1, heads, n, head_dim)  # (B, H, N, D)

    def normal(*size: int) -> Tensor:
        return torch.randn(size, generator=g, device=device, dtype=torch.float32)

    q, k, v = normal(*shape), normal(*shape), normal(*shape)
    if form.delta:
        k = F.normalize(k, dim=-1)
    out = [q.to(dtype), k.to(dtype), v.to(dtype)]
    if form.delta:
        out.append(torch.sigmoid(normal(1, heads, n)).to(dtype))  # (B, H, N)
    if form.decay is not None:
        out.append(F.logsigmoid(normal(*shape[:3], *((head_dim,) if form.decay == "channel" else ())) + 3))
    return out


def form_function(form: Form, *, strategy: str = "auto", projection: Tensor | None = None,
                  **tuning: int) -> Callable[..., Tensor]:
    """linattn's function of ``form`` on :func:`make_inputs`' tensors, ``fn(q, k, v[, beta][, log_decay]
    [, value_scale, skip])``, with the engines' ``strategy`` (``"auto"``: the device's); FAVOR+ takes
    ``projection (m, D)``, converted to q's dtype; ``tuning``: ``chunk_size`` and, for a gate per key
    channel, ``sub_chunk_size`` (:func:`tunings`), passed to the function (absent: its defaults). The
    one definition behind ``bench gpu``, ``bench launches`` and ``bench tensor-cores``."""
    kw = {"strategy": strategy, **tuning}
    if form.name == "favor":
        if projection is None:
            raise ValueError("form_function: FAVOR+ needs its projection (m, D)")
        return lambda q, k, v: favor_attention(q, k, v, projection.to(q.dtype), causal=True, **kw)
    if form.name == "linear":
        return lambda q, k, v: linear_attention(q, k, v, causal=True, feature_map="elu", **kw)
    if form.delta:
        if form.decay is None:
            return lambda q, k, v, beta: delta_rule_attention(q, k, v, beta, **kw)
        return lambda q, k, v, beta, g: delta_rule_attention(q, k, v, beta, log_decay=g, **kw)
    if form.state is not None:  # SSD: Mamba-2's dt and D in the engine
        return lambda q, k, v, g, dt, D: gated_linear_attention(q, k, v, g, scale=1.0, value_scale=dt, skip=D, **kw)
    return lambda q, k, v, g: gated_linear_attention(q, k, v, g, **kw)


def tunings(form: str, chunk_sizes: Sequence[int] = (), sub_chunk_sizes: Sequence[int] = (),
            solve_blocks: Sequence[int] = ()) -> dict[str, dict]:
    """The extra linattn contenders of ``form`` that try other tuning knobs, by their names in the
    table: ``{"linattn chunk_size=128": {"chunk_size": 128}, ...}``: every chunk size; for a gate per
    key channel (``kda``, ``gla_channel``) every pair of a chunk size or the default with a
    sub-chunk size; for the delta rule (``gated_delta``, ``delta``, ``kda``) every pair of a chunk
    size or the default with a solve block (the largest block of a chunk's triangular inverse
    solved directly: one solve of the whole chunk, or blocks of it joined by products). None for
    SSD (``integrations.transformers.ssd``, transformers' signature, takes no chunk size) and the
    model (the backend runs the defaults). Timed beside the default ``linattn``, so that the
    accelerator's defaults (``CHUNK_SIZES`` of ``decayed.py`` and ``delta.py``, ``solve_block``)
    are chosen by measurement on the device."""
    spec = KERNEL_FORMS.get(form)
    if spec is None or spec.state is not None:
        return {}
    subs = (None, *sub_chunk_sizes) if spec.decay == "channel" else (None,)
    solves = (None, *solve_blocks) if spec.delta else (None,)
    out = {}
    for C in (None, *chunk_sizes):
        for c, b in [(c, None) for c in subs] + [(None, b) for b in solves[1:]]:
            kw = {k: v for k, v in (("chunk_size", C), ("sub_chunk_size", c), ("solve_block", b)) if v is not None}
            if kw:
                out["linattn " + " ".join(f"{k}={v}" for k, v in kw.items())] = kw
    return out


def form_projection(form: Form, head_dim: int, *, dtype: torch.dtype | None = None,
                    device: torch.device | None = None) -> Tensor | None:
    """FAVOR+'s projection ``(m, D)`` for ``form`` (None for every other form), from one seed: the
    same draw in ``bench gpu``, ``bench launches`` and ``bench tensor-cores`` (``dtype``, ``device``:
    :func:`~linattn.functional.favor_projection`'s)."""
    if form.name != "favor":
        return None
    return favor_projection(FAVOR_FEATURES, head_dim, generator=torch.Generator().manual_seed(0), dtype=dtype,
                            device=device)


def _linattn_fn(form: Form, head_dim: int, dtype: torch.dtype, device: torch.device, **tuning: int) -> Callable[..., Tensor]:
    """:func:`form_function` on ``device``, FAVOR+'s projection drawn there once, outside the timing."""
    return form_function(form, projection=form_projection(form, head_dim, dtype=dtype, device=device), **tuning)


def _fla_fn(form: Form, head_dim: int) -> Callable[..., Tensor]:
    """FLA's kernel for ``form`` on (B, N, H, D) inputs, by keyword (its positional order differs
    from kernel to kernel), with linattn's scale 1/sqrt(D); the output only."""
    kernel = _import(form.fla)
    scale = head_dim ** -0.5
    if form.delta and form.decay is None:
        return lambda q, k, v, beta: kernel(q, k, v, beta=beta, scale=scale)[0]
    if form.delta:
        return lambda q, k, v, beta, g: kernel(q, k, v, g=g, beta=beta, scale=scale)[0]
    return lambda q, k, v, g: kernel(q, k, v, g=g, scale=scale)[0]


def _transformers_fn(form: Form) -> Callable[..., Tensor]:
    """transformers' PyTorch function for ``form`` (q, k not normalised again: they are as linattn's
    reads them), unwrapped from the decorator that hands its calls to FLA where FLA imports."""
    import inspect

    fn = inspect.unwrap(_import(form.transformers))
    return lambda q, k, v, beta, g: fn(q, k, v, g=g, beta=beta)[0]


def _sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _runner(fn: Callable[..., Tensor], tensors: list[Tensor], train: bool) -> Callable[[], Tensor | None]:
    """One call of ``fn(*tensors)``: without gradients, or forward+backward into every tensor's
    gradient (reset to None first, so no accumulation is timed) with a cotangent of ones made once."""
    if not train:
        def prefill() -> Tensor:
            with torch.no_grad():
                return fn(*tensors)
        return prefill
    for t in tensors:
        t.requires_grad_(True)
    cotangent: list[Tensor] = []

    def step() -> None:
        for t in tensors:
            t.grad = None
        out = fn(*tensors)
        if not cotangent:
            cotangent.append(torch.ones_like(out))
        out.backward(cotangent[0])
    return step


GRAPHED = "linattn+cudagraph"  # linattn's call replayed from CUDA graphs (cuda_graphs=True)


def _graphed_runner(fn: Callable[..., Tensor], tensors: list[Tensor], train: bool) -> Callable[[], Tensor | None]:
    """:func:`_runner`'s call of ``fn(*tensors)`` captured in CUDA graphs and replayed: the time of
    linattn's kernels without the host's launch overhead (the engines read nothing back to the host
    and keep their shapes, which capture needs). Captured on the first call, inside the measurement's
    warm-up, so that a capture that fails is that contender's error row. Prefill: one graph of the
    call on its own copies of the inputs, after two warm-up calls on a side stream (lazy
    initialisation and the scan's cached index happen outside the capture); its output tensor is
    rewritten by every replay. Train: ``torch.cuda.make_graphed_callables``, a graph of the forward
    and one of the backward. ``tensors``: its own, which the capture keeps (the graph reads them)."""
    leaves = tensors
    captured: list[Callable[[], Tensor | None]] = []

    def capture() -> Callable[[], Tensor | None]:
        if train:
            for t in leaves:
                t.requires_grad_(True)
            return _runner(torch.cuda.make_graphed_callables(fn, tuple(leaves)), leaves, train)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                fn(*leaves)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = fn(*leaves)

        def replay() -> Tensor:
            graph.replay()
            return out
        return replay

    def call() -> Tensor | None:
        if not captured:
            captured.append(capture())
        return captured[0]()
    return call


def _graphed_subject(fn: Callable[..., Tensor], tensors: list[Tensor], train: bool,
                     device: torch.device) -> Subject | Unavailable:
    """linattn replayed from CUDA graphs (:func:`_graphed_runner`) on its own copies of ``tensors``,
    its prefill's output copied before the next replay rewrites it; "left out" off CUDA."""
    if device.type != "cuda":
        return Unavailable("left out", "CUDA graphs need a CUDA device")
    leaves = [t.detach().clone() for t in tensors]
    return Subject(_graphed_runner(fn, leaves, train), lambda o: o.clone(), leaves)


def check_tunings(forms: Sequence[str], chunk_sizes: Sequence[int], sub_chunk_sizes: Sequence[int],
                  solve_blocks: Sequence[int] = ()) -> None:
    """ValueError, naming the argument, for sizes that are not distinct integers >= 1, or sizes given
    where none of ``forms`` takes them (:func:`tunings`)."""
    for name, sizes, probe, who in (
            ("chunk_sizes", chunk_sizes, ((1,),), "every kernel form but ssd does"),
            ("sub_chunk_sizes", sub_chunk_sizes, ((), (1,)), "kda and gla_channel do"),
            ("solve_blocks", solve_blocks, ((), (), (1,)), "gated_delta, delta and kda do")):
        if any(not isinstance(x, int) or x < 1 for x in sizes) or len(set(sizes)) < len(sizes):
            raise ValueError(f"run_gpu: {name} must be distinct integers >= 1, got {list(sizes)}")
        if sizes and not [f for f in forms if tunings(f, *probe)]:
            raise ValueError(f"run_gpu: {name} {list(sizes)} given, but none of the forms {list(forms)} takes them "
                             f"({who})")


def kernel_subjects(form: Form, n: int, *, quick: bool, dtype: torch.dtype, device: torch.device, train: bool,
                    fla: bool, tuned: dict[str, dict] | None = None,
                    cuda_graphs: bool = False) -> dict[str, Subject | Unavailable]:
    """Every contender of ``form`` at ``n`` (the ones that do not exist for it absent), each with
    inputs of its own holding the same values; ``tuned``: linattn with other knobs (:func:`tunings`),
    right after the default; ``cuda_graphs``: linattn replayed from CUDA graphs (:data:`GRAPHED`)
    after them."""
    heads, head_dim, state = widths(form, quick)
    if state is not None:
        return ssd_subjects(form, n, heads, head_dim, state, dtype=dtype, device=device, train=train, fla=fla,
                            cuda_graphs=cuda_graphs)
    base = make_inputs(form, n, heads, head_dim, dtype=dtype, device=device)
    out: dict[str, Subject | Unavailable] = {}

    def mine(layout: str) -> list[Tensor]:
        return [(_bnhd(t) if layout == "bnhd" else t.clone()).detach() for t in base]

    fn = _linattn_fn(form, head_dim, dtype, device)
    out["linattn"] = _subject(fn, mine("bhnd"), train, _same)
    for name, kw in (tuned or {}).items():
        out[name] = _subject(_linattn_fn(form, head_dim, dtype, device, **kw), mine("bhnd"), train, _same)
    if cuda_graphs:
        out[GRAPHED] = _graphed_subject(fn, mine("bhnd"), train, device)
    if form.fla is not None:
        try:
            if not fla:
                raise Unavailable("left out", "--no-fla")
            out["fla"] = _subject(_fla_fn(form, head_dim), mine("bnhd"), train, _bnhd)
        except Unavailable as u:
            out["fla"] = u
    if form.transformers is not None:
        try:
            out["transformers"] = _subject(_transformers_fn(form), mine("bnhd"), train, _bnhd)
        except Unavailable as u:
            out["transformers"] = u
    out["sdpa"] = Subject(_runner(_sdpa, mine("bhnd")[:3], train))
    return out


SSD_KEYS = ("x", "dt", "A", "B", "C", "D", "dt_bias")  # ssd_inputs' tensors in linattn's (and transformers') order


def ssd_inputs(n: int, heads: int, head_dim: int, state: int, *, dtype: torch.dtype, device: torch.device,
               seed: int = 0, groups: int = 1) -> dict[str, Tensor]:
    """A Mamba-2 mixer's scan inputs in transformers' layout (see the module docstring), x, dt, B, C
    in ``dtype``, A, D and dt_bias in float32 as the mixer keeps them in its compute; B and C
    ``(1, n, groups, state)``. ``bench transformers``' ssd_core and :func:`make_inputs`' SSD (the
    engine's layout, for ``bench launches`` and ``bench tensor-cores``) draw their inputs here too."""
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> Tensor:
        return torch.randn(size, generator=g, device=device, dtype=torch.float32)

    # dt at Mamba-2's initialisation: softplus(dt_bias) log-uniform in [1e-3, 1e-1]
    dt0 = torch.exp(torch.rand(heads, generator=g, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {"x": normal(1, n, heads, head_dim).to(dtype), "dt": (normal(1, n, heads) * 0.5).to(dtype),
            "A": -torch.arange(1, heads + 1, dtype=torch.float32, device=device),
            "B": normal(1, n, groups, state).to(dtype), "C": normal(1, n, groups, state).to(dtype),
            "D": torch.ones(heads, device=device), "dt_bias": dt0 + torch.log(-torch.expm1(-dt0))}


def _ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor) -> Tensor:
    """linattn's SSD on :func:`ssd_inputs`' tensors (in its key order): the output ``(B, N, H, P)``."""
    from ..integrations import transformers as lt

    return lt.ssd(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)[0]


def ssd_subjects(form: Form, n: int, heads: int, head_dim: int, state: int, *, dtype: torch.dtype,
                 device: torch.device, train: bool, fla: bool,
                 cuda_graphs: bool = False) -> dict[str, Subject | Unavailable]:
    """Every contender of the SSD form at ``n``: linattn's ``ssd``, transformers' ``mamba2_chunk_scan``
    (its torch path), FLA's simple GLA on the same recurrence (inputs formed before timing) and SDPA
    at the form's heads and width; outputs ``(B, N, H, P)`` each."""
    import inspect

    from ..integrations import transformers as lt

    base = ssd_inputs(n, heads, head_dim, state, dtype=dtype, device=device)
    def mine() -> list[Tensor]:
        return [base[k].clone() for k in SSD_KEYS]

    out: dict[str, Subject | Unavailable] = {"linattn": _subject(_ssd, mine(), train, _same)}
    if cuda_graphs:
        out[GRAPHED] = _graphed_subject(_ssd, mine(), train, device)
    try:
        if not fla:
            raise Unavailable("left out", "--no-fla")
        kernel = _import(form.fla)
        with torch.no_grad():  # Mamba-2's recurrence as simple GLA, every head its own copy of C and B
            dt = F.softplus(base["dt"].float() + base["dt_bias"])  # (B, N, H)
            inputs = [base["C"].expand(-1, -1, heads, -1).contiguous(), base["B"].expand(-1, -1, heads, -1).contiguous(),
                      (base["x"].float() * dt[..., None]).to(dtype), base["A"] * dt, base["x"].clone(), base["D"]]

        def theirs(q, k, v, g, x, D):
            return kernel(q, k, v, g=g, scale=1.0)[0] + x * D[:, None]

        # other inputs than linattn's (C and B per head, x dt, A dt): its output compares, its gradients do not
        out["fla"] = Subject(_runner(theirs, [t.detach() for t in inputs], train), _same)
    except Unavailable as u:
        out["fla"] = u
    try:
        scan = inspect.unwrap(_import(form.transformers))

        def torch_path(x, dt, A, B, C, D, dt_bias):
            y = scan(x, dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True)
            return y[0] if isinstance(y, tuple) else y

        out["transformers"] = _subject(torch_path, mine(), train, _same)
    except Unavailable as u:
        out["transformers"] = u
    qkv = [base["x"].transpose(1, 2).clone() for _ in range(3)]  # (B, H, N, P)
    out["sdpa"] = Subject(_runner(_sdpa, qkv, train))
    return out


def build_model(*, quick: bool, dtype: torch.dtype, device: torch.device):
    """The transformers-backend subject's model (:data:`MODEL_DIMS`, 2 Gated DeltaNet layers), built
    by transformers' ``from_config`` with its own initialisation, in ``dtype`` on ``device``."""
    from ..integrations import transformers as lt

    dims = dict(MODEL_DIMS[quick])
    vocab = dims.pop("vocab_size")
    config = lt.small_config("qwen3_5", layer_types=("linear_attention", "linear_attention"), vocab_size=vocab,
                             **dims)
    torch.manual_seed(0)
    return lt.causal_lm(config, dtype=dtype).to(device).train(False)


def model_subjects(model, n: int, *, device: torch.device, train: bool) -> dict[str, Subject | Unavailable]:
    """linattn's and transformers' path through the same ``model``: each call first puts its layers
    on its path (``attach`` / ``detach``: a class assignment, nothing copied)."""
    from ..integrations import transformers as lt

    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1)).to(device)

    def on(path: str) -> Callable[[], Tensor | None]:
        def call() -> Tensor | None:
            if path == "linattn":
                lt.attach(model)
            else:
                lt.detach(model)
            if not train:
                with torch.no_grad():
                    return model(ids, use_cache=False).logits
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()
            return None
        return call

    return {path: Subject(on(path), lambda o: o) for path in ("linattn", "transformers")}


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def aggregate(per_run: Sequence[Sequence[float]]) -> dict:
    """A contender's time from its calls, one list per run: the :func:`~linattn.bench.harness.spread`
    (median, min, max, every run's) of each run's median call. A claim uses the median over runs,
    never the best run, so one slow spell of the machine moves it less."""
    if not per_run or any(not calls for calls in per_run):
        raise ValueError("aggregate: every run needs at least one call")
    return spread([statistics.median(calls) for calls in per_run])


def relative_error(out: Tensor, reference: Tensor) -> float:
    """``max |out - reference| / max |reference|`` in float64, ``out`` brought to the reference's
    device (check.py's ``relerr``); ValueError naming both shapes when they differ (no broadcast)."""
    if out.shape != reference.shape:
        raise ValueError(f"relative_error: out {tuple(out.shape)} and reference {tuple(reference.shape)} differ in shape")
    out = out.detach().to(device=reference.device, dtype=torch.float64)
    reference = reference.detach().double()
    return float((out - reference).abs().max() / reference.abs().max().clamp_min(1e-300))


def float64_reference(form: Form, n: int, *, quick: bool, dtype: torch.dtype,
                      device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """What every contender of ``form`` at ``n`` is measured against: linattn's function in float64
    on the CPU, strategy ``"cpu"`` (the engines' tests hold it to the per-position reference in
    float64), on the very values the contenders read: their inputs drawn again on ``device`` from
    the same seeds in ``dtype`` (FAVOR+'s projection too), then widened. One forward and backward
    for both passes: the output, ``(B, H, N, D)``, SSD's ``(B, N, H, P)``, in linattn's layout (a
    prefill's reference), and the gradients of every input (in linattn's order and layout) from a
    cotangent of ones, as the training steps take (a training step's)."""
    heads, head_dim, state = widths(form, quick)
    cpu = torch.device("cpu")

    def widened(t: Tensor) -> Tensor:
        return t.to(device=cpu, dtype=torch.float64).requires_grad_(True)

    if state is not None:
        m = ssd_inputs(n, heads, head_dim, state, dtype=dtype, device=device)
        fn, inputs = _ssd, [widened(m[k]) for k in SSD_KEYS]
    else:
        projection = form_projection(form, head_dim, dtype=dtype, device=device)
        fn = form_function(form, strategy="cpu",
                           projection=None if projection is None else projection.to(cpu, torch.float64))
        inputs = [widened(t) for t in make_inputs(form, n, heads, head_dim, dtype=dtype, device=device)]
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in inputs]


def _gradient_errors(row: dict, subject: Subject, reference: list[Tensor]) -> None:
    """Into ``row``: the errors of the gradients a training step of ``subject`` left in its inputs
    against the float64 ``reference`` (one per input), the largest as ``error_to_float64``; a
    missing gradient or another shape is said as its ``comparison``."""
    try:
        if len(subject.inputs) != len(reference) or any(t.grad is None for t in subject.inputs):
            raise ValueError(f"gradients of {sum(t.grad is not None for t in subject.inputs)} of "
                             f"{len(subject.inputs)} inputs, against {len(reference)} in the reference")
        errors = [relative_error(subject.canonical(t.grad), r) for t, r in zip(subject.inputs, reference)]
    except ValueError as e:
        row["comparison"] = str(e)
        return
    row["gradient_errors"] = errors
    row["error_to_float64"] = max(errors)


def _release(dev: torch.device) -> None:
    """Hand the cached blocks of a failed contender back (an out-of-memory error leaves them)."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _peak_bytes(call: Callable[[], object], dev: torch.device, sync: Callable[[], None]) -> int | None:
    """Peak memory one call allocates above what is allocated before it (None on a CPU)."""
    if dev.type != "cuda":
        return None
    sync()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    call()
    sync()
    return torch.cuda.max_memory_allocated(dev) - base


def measure(subjects: dict[str, Subject | Unavailable], *, runs: int, repeats: int, dev: torch.device,
            compare: bool, reference: Tensor | list[Tensor] | None = None) -> dict[str, dict]:
    """Warm up, measure peak memory, then time ``subjects`` interleaved (see the module docstring);
    ``{contender: row}`` with ``status`` "ok", "error", "not installed" or "left out". ``compare``:
    each prefill output's ``difference_to_linattn``. With a ``reference`` (:func:`float64_reference`),
    ``error_to_float64``: a prefill's output against it, or for a training step (a list: one
    gradient per input) the largest of its gradients' errors, each in ``gradient_errors``."""
    sync = _synchronizer(dev)
    rows: dict[str, dict] = {}
    live: dict[str, Subject] = {}
    outputs: dict[str, Tensor] = {}
    for name, subject in subjects.items():
        if isinstance(subject, Unavailable):
            rows[name] = {"status": subject.status, "detail": subject.detail}
            continue
        try:
            sync()
            t0 = time.perf_counter()
            out = subject.call()
            sync()
            first = time.perf_counter() - t0
            for _ in range(WARMUP - 1):
                out = subject.call()
            sync()
        except Exception as e:  # noqa: BLE001 - a contender's failure is a row of the table
            rows[name] = {"status": "error", "detail": _first_line(e)}
            _release(dev)
            continue
        rows[name] = {"status": "ok", "first_call_s": first}
        if compare and out is not None and subject.canonical is not None:
            outputs[name] = subject.canonical(out)
        if isinstance(reference, list) and subject.inputs is not None:
            _gradient_errors(rows[name], subject, reference)
        del out
        live[name] = subject
    for name, out in outputs.items():
        try:
            if name != "linattn" and "linattn" in outputs:
                rows[name]["difference_to_linattn"] = relative_error(out, outputs["linattn"])
            if isinstance(reference, Tensor):
                rows[name]["error_to_float64"] = relative_error(out, reference)
        except ValueError as e:  # a contender's output in another shape: said in its row, the timing goes on
            rows[name]["comparison"] = str(e)
    outputs.clear()
    for name in list(live):
        try:
            rows[name]["peak_memory_bytes"] = _peak_bytes(live[name].call, dev, sync)
        except Exception as e:  # noqa: BLE001
            rows[name] = {"status": "error", "detail": _first_line(e)}
            del live[name]
            _release(dev)
    calls: dict[str, list[list[float]]] = {name: [[] for _ in range(runs)] for name in live}
    for run in range(runs):
        for i in range(repeats):
            order = list(live) if (run * repeats + i) % 2 == 0 else list(live)[::-1]
            for name in order:
                if name not in live:  # failed earlier in this round
                    continue
                try:
                    sync()
                    t0 = time.perf_counter()
                    live[name].call()
                    sync()
                    calls[name][run].append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001
                    rows[name] = {"status": "error", "detail": _first_line(e)}
                    del live[name]
                    _release(dev)
    for name in live:
        rows[name].update(time_s=aggregate(calls[name]), calls_per_run=repeats)
    if "linattn" in live:
        ours = [statistics.median(c) for c in calls["linattn"]]
        for name in live:
            if name != "linattn":
                rows[name]["ratio_to_linattn"] = spread(
                    [statistics.median(c) / o for c, o in zip(calls[name], ours)])
    return rows


# Aten ops that launch no kernel: views, metadata, allocation. The other leaf ops are "computing".
_NO_KERNEL = frozenset(f"aten::{op}" for op in (
    "empty", "empty_strided", "as_strided", "view", "_unsafe_view", "alias", "_reshape_alias", "reshape", "expand",
    "permute", "transpose", "t", "select", "slice", "narrow", "unsqueeze", "squeeze", "unflatten", "flatten",
    "split", "split_with_sizes", "chunk", "unbind", "diagonal", "detach", "detach_", "lift_fresh", "resize_",
    "set_", "result_type", "size", "stride", "is_nonzero", "expand_as", "view_as", "movedim", "swapaxes"))


def profile_gated_delta(n: int, *, quick: bool, dtype: torch.dtype, device: torch.device) -> dict:
    """One linattn Gated DeltaNet forward and forward+backward at ``n`` under torch.profiler, after
    two warm-up calls: per pass the wall time (profiler overhead included), on a GPU the kernels
    launched and the GPU-busy time (their durations summed), and the leaf aten ops (all, and the
    computing ones), with the 8 ops that took longest."""
    from torch.profiler import ProfilerActivity, profile

    sync = _synchronizer(device)
    form = KERNEL_FORMS["gated_delta"]
    heads, head_dim = (QUICK_HEADS, QUICK_HEAD_DIM) if quick else (form.heads, HEAD_DIM)
    out = {"n": n, "heads": heads, "head_dim": head_dim}
    for pass_ in PASSES:
        call = _runner(_linattn_fn(form, head_dim, dtype, device),
                       make_inputs(form, n, heads, head_dim, dtype=dtype, device=device), pass_ == "train")
        for _ in range(WARMUP):
            call()
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            call()
            sync()
        wall = time.perf_counter() - t0
        events = prof.events()
        leaves = [e for e in events if e.name.startswith("aten::")
                  and not any(c.name.startswith("aten::") for c in e.cpu_children)]
        kernels = [e for e in events if getattr(e.device_type, "name", "") == "CUDA"]
        gpu = device.type == "cuda"
        by_time = sorted(prof.key_averages(), key=lambda e: -(e.device_time_total if gpu else e.self_cpu_time_total))
        out[pass_] = {
            "wall_s": wall,
            "kernels": len(kernels) if gpu else None,
            "gpu_busy_s": sum(e.device_time for e in kernels) / 1e6 if gpu else None,
            "leaf_aten_ops": len(leaves),
            "computing_leaf_aten_ops": sum(e.name not in _NO_KERNEL for e in leaves),
            "top": [{"op": e.key, "count": e.count,
                     "ms": (e.device_time_total if gpu else e.self_cpu_time_total) / 1e3} for e in by_time[:8]],
        }
    return out


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def _command(out, device, n, forms, dtype, runs, repeats, fla, quick, profile, chunk_sizes, sub_chunk_sizes,
             cuda_graphs, solve_blocks=()) -> str:
    """The command line that reproduces a call of :func:`run_gpu` made without one."""
    parts = ["linattn bench gpu", f"--device {device}"]
    if n is not None:
        parts.append("--n " + ",".join(map(str, n)))
    if tuple(forms) != FORMS:
        parts.append("--forms " + ",".join(forms))
    for flag, sizes in (("--chunk-sizes", chunk_sizes), ("--sub-chunk-sizes", sub_chunk_sizes),
                        ("--solve-blocks", solve_blocks)):
        if sizes:
            parts.append(f"{flag} " + ",".join(map(str, sizes)))
    parts += [f"--dtype {dtype}", f"--runs {runs}", f"--repeats {repeats}"]
    parts += [flag for flag, on in (("--no-fla", not fla), ("--quick", quick), ("--profile", profile),
                                    ("--cuda-graphs", cuda_graphs)) if on]
    return " ".join([*parts, f"--out {out}"])


def run_gpu(*, out: str | Path = "docs/benchmarks/gpu", device: str = "cuda", n: Sequence[int] | None = None,
            forms: Sequence[str] = FORMS, dtype: str = "bfloat16", runs: int = RUNS, repeats: int = REPEATS,
            fla: bool = True, quick: bool = False, profile: bool = False, chunk_sizes: Sequence[int] = (),
            sub_chunk_sizes: Sequence[int] = (), solve_blocks: Sequence[int] = (), cuda_graphs: bool = False,
            command: str | None = None,
            quiet: bool = False) -> dict:
    """Measure every form of ``forms`` at every N of ``n`` (default 4096 and 16384; 64 and 128 with
    ``quick``, which also takes 2 heads of 16 everywhere), write gpu.json and gpu.md into ``out``
    (after every form and N: a run stopped midway leaves what it measured), print the Markdown, and
    return the result. ``chunk_sizes``, ``sub_chunk_sizes``, ``solve_blocks``: linattn contenders
    with those knobs beside the default one (:func:`tunings`). ``cuda_graphs``: linattn replayed from
    CUDA graphs beside it (every kernel form, on CUDA; a "left out" row elsewhere). ``command``: the
    command line recorded (None: one rebuilt from the arguments). ValueError before any work for a
    bad argument or a device that is not here."""
    for name, value in (("runs", runs), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"run_gpu: {name} must be >= 1, got {value}")
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise ValueError(f"run_gpu: forms must be some of {', '.join(FORMS)}, got {list(forms)}")
    if dtype not in DTYPES:
        raise ValueError(f"run_gpu: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ns = tuple(n) if n is not None else (QUICK_NS if quick else DEFAULT_NS)
    if not ns or any(x < 1 for x in ns):
        raise ValueError(f"run_gpu: n must be sequence lengths >= 1, got {n}")
    chunk_sizes, sub_chunk_sizes, solve_blocks = tuple(chunk_sizes), tuple(sub_chunk_sizes), tuple(solve_blocks)
    check_tunings(forms, chunk_sizes, sub_chunk_sizes, solve_blocks)
    dev = check_device(device)
    output_folder(out)
    torch_dtype = getattr(torch, dtype)
    say = functools.partial(progress.say, quiet=quiet)
    t_start = time.perf_counter()
    with _fla_blocked(not fla):
        kernels = transformers_kernels() if MODEL_FORM in forms else None
    result: dict = {
        "command": command or _command(out, device, n, forms, dtype, runs, repeats, fla, quick, profile, chunk_sizes,
                                       sub_chunk_sizes, cuda_graphs, solve_blocks),
        "complete": False,
        "device": describe_device(dev),
        "versions": versions(),
        "transformers_kernels": kernels,
        "config": {"forms": list(forms), "n": list(ns), "dtype": dtype, "batch_size": 1, "runs": runs,
                   "repeats": repeats, "warmup": WARMUP, "fla": fla, "quick": quick, "profile": profile,
                   "chunk_sizes": list(chunk_sizes), "sub_chunk_sizes": list(sub_chunk_sizes),
                   "solve_blocks": list(solve_blocks), "cuda_graphs": cuda_graphs,
                   "widths": {name: width_record(f, quick) for name, f in KERNEL_FORMS.items() if name in forms},
                   "model": MODEL_DIMS[quick] if MODEL_FORM in forms else None},
        "machine": machine_info(),
        "rows": [],
        "references": [],  # the float64 references' CPU time, form and N by form and N
    }
    say(f"linattn bench gpu on {result['device']['name']} ({dev}): {', '.join(forms)} at N = "
        f"{', '.join(map(str, ns))}, {dtype}, {runs} runs of {repeats} interleaved calls")

    def save() -> None:
        result["elapsed_seconds"] = time.perf_counter() - t_start
        result["targets"] = targets(result)
        write_atomically(out, {"gpu.json": json.dumps(result, indent=2), "gpu.md": format_gpu(result)})

    if profile:
        say(f"  profile: one Gated DeltaNet forward and forward+backward at N = {ns[0]} ...")
        try:
            result["profile"] = profile_gated_delta(ns[0], quick=quick, dtype=torch_dtype, device=dev)
        except Exception as e:  # noqa: BLE001 - the timings still matter
            result["profile"] = {"error": _first_line(e)}
        save()
    for form in forms:
        model = None
        if form == MODEL_FORM:
            try:
                with _fla_blocked(not fla):
                    model = build_model(quick=quick, dtype=torch_dtype, device=dev)
            except Exception as e:  # noqa: BLE001 - transformers missing or refusing: rows that say so
                status = "not installed" if isinstance(e, ImportError) else "error"
                for x in ns:
                    for pass_ in PASSES:
                        for path in ("linattn", "transformers"):
                            result["rows"].append({"form": form, "n": x, "pass": pass_, "contender": path,
                                                   "status": status, "detail": _first_line(e)})
                save()
                continue
        for x in ns:
            references: dict[str, Tensor | list[Tensor]] = {}  # by pass: the output, the gradients
            failed = None
            if model is None:
                try:
                    t0 = time.perf_counter()
                    references["prefill"], references["train"] = float64_reference(
                        KERNEL_FORMS[form], x, quick=quick, dtype=torch_dtype, device=dev)
                    result["references"].append({"form": form, "n": x, "seconds": time.perf_counter() - t0})
                except Exception as e:  # noqa: BLE001 - rows that say so; the timings still matter
                    failed = _first_line(e)
            for pass_ in PASSES:
                say(f"  {form}, N = {x}, {pass_} ...")
                train = pass_ == "train"
                if model is not None:
                    subjects = model_subjects(model, x, device=dev, train=train)
                else:
                    subjects = kernel_subjects(KERNEL_FORMS[form], x, quick=quick, dtype=torch_dtype, device=dev,
                                               train=train, fla=fla,
                                               tuned=tunings(form, chunk_sizes, sub_chunk_sizes, solve_blocks),
                                               cuda_graphs=cuda_graphs)
                if failed is not None:
                    result["rows"].append({"form": form, "n": x, "pass": pass_, "contender": REFERENCE,
                                           "status": "error", "detail": failed})
                rows = measure(subjects, runs=runs, repeats=repeats, dev=dev, compare=not train,
                               reference=references.pop(pass_, None))
                del subjects
                _release(dev)
                for name, row in rows.items():
                    result["rows"].append({"form": form, "n": x, "pass": pass_, "contender": name, **row})
            save()
        del model
        _release(dev)
    result["complete"] = True
    save()
    say(format_gpu(result))
    return result


# ---------------------------------------------------------------------------------------------
# Issue 44's targets
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One of issue 44's targets for linattn (an H200, bf16, B = 1), judged from a run's rows.

    ``kind``: ``"time"``, linattn's median time at most ``limit`` seconds; ``"ratio"``, linattn's
    time at most ``limit`` times ``other``'s (the median over the runs of the ratio, both timed in
    the same rounds); ``"error"``, linattn's error against float64 (a prefill's output, a training
    step's largest gradient error) at most ``other``'s on the same inputs. ``n`` None: at every N
    of the run."""

    form: str
    n: int | None
    pass_: str
    kind: str
    limit: float = 1.0
    other: str | None = None
    label: str | None = None  # the other contender as the issue names it (None: its name)

    def text(self) -> str:
        if self.kind == "time":
            return f"linattn <= {self.limit * 1e3:g} ms"
        other = self.label or self.other
        if self.kind == "ratio":
            return f"linattn's time <= {self.limit:g}x that of {other}"
        what = "error" if self.pass_ == "prefill" else "largest gradient error"
        return f"linattn's {what} against float64 <= that of {other}"


TARGETS = (
    Target("gated_delta", 4096, "prefill", "time", 3e-3),
    Target("gated_delta", 16384, "prefill", "time", 4e-3),
    Target("gated_delta", 4096, "train", "time", 8e-3),
    Target("gated_delta", 16384, "train", "time", 15e-3),
    Target("gla_channel", None, "prefill", "ratio", 3.0, "fla"),
    Target("gla_channel", None, "train", "ratio", 3.0, "fla"),
    Target("kda", 4096, "prefill", "time", 6e-3),
    Target("kda", 4096, "train", "time", 20e-3),
    Target("linear", 16384, "prefill", "ratio", 1.0, "sdpa"),
    Target("linear", 65536, "prefill", "ratio", 0.25, "sdpa"),  # at least 4x faster than SDPA
    Target(MODEL_FORM, 4096, "prefill", "ratio", 2.0, "transformers", "transformers + FLA"),
    Target(MODEL_FORM, 16384, "prefill", "ratio", 2.0, "transformers", "transformers + FLA"),
    Target(MODEL_FORM, 4096, "train", "time", 60e-3),
    *(Target(name, None, "prefill", "error", other="fla") for name, f in KERNEL_FORMS.items() if f.fla is not None),
    # gradients where FLA's inputs are linattn's (SSD's stand-in takes others)
    *(Target(name, None, "train", "error", other="fla") for name, f in KERNEL_FORMS.items()
      if f.fla is not None and f.state is None),
)


def _judge(target: Target, rows: dict[str, dict], kernels) -> tuple[str, bool | None, str]:
    """``(value, holds, why)`` of ``target`` from one setting's ``rows`` (by contender); holds None
    when the run cannot tell (why says what is missing)."""
    ours = rows.get("linattn")
    if ours is None:
        return "-", None, "not measured (the run stopped before it)"
    if ours["status"] != "ok":
        return "-", False, f"linattn: {ours['status']}: {ours['detail']}"
    if target.kind == "time":
        t = ours["time_s"]["median"]
        return _time(t), t <= target.limit, ""
    other = rows.get(target.other)
    if other is None or other["status"] != "ok":
        return "-", None, f"{target.other}: " + ("absent" if other is None else f"{other['status']}: {other['detail']}")
    if target.form == MODEL_FORM and not (isinstance(kernels, dict) and
                                          kernels.get("torch_chunk_gated_delta_rule", "").startswith("fla.")):
        return "-", None, "transformers' path ran without FLA's kernel; the target is against transformers + FLA"
    if target.kind == "ratio":
        r = statistics.median([1 / x for x in other["ratio_to_linattn"]["runs"]])
        return f"{r:.2f}x", r <= target.limit, ""
    mine, theirs = ours.get("error_to_float64"), other.get("error_to_float64")
    if mine is None or theirs is None:
        missing = [name for name, row in (("linattn", ours), (target.other, other)) if "error_to_float64" not in row]
        return "-", None, f"no error against float64 for {' and '.join(missing)} (the reference or the comparison failed)"
    return f"{mine:.1e} vs {theirs:.1e}", mine <= theirs, ""


def _graphed(target: Target, rows: dict[str, dict]) -> str:
    """The value a time or ratio ``target`` takes for linattn replayed from CUDA graphs
    (:data:`GRAPHED`, ``--cuda-graphs``) in one setting's ``rows``; "-" where that row or the
    other contender is missing or failed, and for the errors (the same products)."""
    mine = rows.get(GRAPHED)
    if target.kind == "error" or mine is None or mine["status"] != "ok":
        return "-"
    if target.kind == "time":
        return _time(mine["time_s"]["median"])
    other = rows.get(target.other)
    if other is None or other["status"] != "ok" or "ratio_to_linattn" not in mine:
        return "-"
    ratios = [g / o for g, o in zip(mine["ratio_to_linattn"]["runs"], other["ratio_to_linattn"]["runs"])]
    return f"{statistics.median(ratios):.2f}x"


def targets(result: dict) -> list[dict]:
    """Issue 44's :data:`TARGETS` judged from ``result``'s rows, one entry per target and N:
    ``{"form", "n", "pass", "target", "value", "holds", "why", "graphed"}`` (holds None: the run does
    not say; a setting outside the run's forms and Ns is "not in this run"; ``graphed``: the value
    for linattn replayed from CUDA graphs, :func:`_graphed`, beside the verdict on linattn as
    called)."""
    cfg = result["config"]
    by: dict[tuple, dict[str, dict]] = {}
    for r in result["rows"]:
        by.setdefault((r["form"], r["n"], r["pass"]), {})[r["contender"]] = r
    out = []
    for t in TARGETS:
        for n in ([t.n] if t.n is not None else cfg["n"]):
            rows = by.get((t.form, n, t.pass_), {})
            if t.form not in cfg["forms"] or n not in cfg["n"]:
                value, holds, why = "-", None, "not in this run"
            else:
                value, holds, why = _judge(t, rows, result.get("transformers_kernels"))
            out.append({"form": t.form, "n": n, "pass": t.pass_, "target": t.text(), "value": value, "holds": holds,
                        "why": why, "graphed": _graphed(t, rows)})
    return out


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def _time(t: float) -> str:
    """Three significant digits: GPU times run from tenths of a millisecond to seconds."""
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def _cells(row: dict) -> list[str]:
    """time | spread | vs linattn | peak memory | agreement | error vs float64 | note, for one row."""
    if row["status"] != "ok":
        return ["-"] * 6 + [f"{row['status']}: {row['detail']}".replace("|", "/")]
    t = row["time_s"]
    ratio = row.get("ratio_to_linattn")
    peak = row.get("peak_memory_bytes")
    diff = row.get("difference_to_linattn")
    error = row.get("error_to_float64")
    notes = [f"first call {_time(row['first_call_s'])}"] if row["first_call_s"] > 1 else []
    notes += [row["comparison"].replace("|", "/")] if "comparison" in row else []
    return [_time(t["median"]), f"{_time(t['min'])} – {_time(t['max'])}",
            "-" if ratio is None else f"{ratio['median']:.2f}x ({ratio['min']:.2f}–{ratio['max']:.2f}x)",
            "-" if peak is None else f"{peak / 2**20:.0f} MiB",
            "-" if diff is None else f"{diff:.1e}", "-" if error is None else f"{error:.1e}", "; ".join(notes)]


def _format_targets(result: dict, on_gpu: bool) -> list[str]:
    """The targets section of gpu.md (:func:`targets`): every target's value and verdict."""
    entries = result.get("targets") or targets(result)
    verdict = {True: "holds", False: "misses", None: "-"}
    lines = ["", "## Issue 44's targets", "",
             "The limits are issue 44's for an H200 (bf16, B = 1)" + ("" if on_gpu else
             "; this run is on a CPU, so its verdicts check the script, not the targets") + ". A ratio is the "
             "median over the runs of linattn's time / the other's, both timed in the same rounds. The verdict "
             "is on linattn as called; with CUDA graphs: the same value for linattn replayed from CUDA graphs "
             "(`--cuda-graphs`), its kernels without the launches' host overhead.", "",
             "| form | N | pass | target | value | verdict | with CUDA graphs | why not measured |",
             "| --- | ---: | --- | --- | ---: | --- | ---: | --- |"]
    for e in entries:
        lines.append(f"| {e['form']} | {e['n']} | {e['pass']} | {e['target']} | {e['value']} | {verdict[e['holds']]} | "
                     f"{e.get('graphed', '-')} | {e['why'].replace('|', '/')} |")
    return lines


def format_gpu(result: dict) -> str:
    cfg, dev, ver = result["config"], result["device"], result["versions"]
    on_gpu = dev["type"] == "cuda"
    where = (f"{dev['name']} (compute capability {'.'.join(map(str, dev['capability']))}, {dev['memory_gib']} GiB)"
             if on_gpu else f"the CPU ({dev['name']}, {dev['threads']} threads): a check of the script, not a GPU "
                            "measurement")
    lines = ["# linattn on a GPU: the chunked forms and the transformers backend beside FLA, transformers and SDPA",
             "", f"Written by `{result['command']}`; do not edit by hand.", "",
             f"Device: {where}. Versions: " + ", ".join(f"{k} {v if v is not None else 'not installed'}"
                                                     for k, v in ver.items()) + "."]
    kernels = result.get("transformers_kernels")
    if kernels is not None:
        text = kernels if isinstance(kernels, str) else "; ".join(f"{k} runs {v}" for k, v in kernels.items())
        lines += ["", f"transformers' own path in the model: {text}."]
    lines += ["", f"B = 1, {cfg['dtype']}, log decays in float32; {cfg['runs']} runs, each {cfg['repeats']} calls per "
              f"contender interleaved after {cfg['warmup']} warm-up calls, every call between two device "
              "synchronisations. Time: the median over the runs of each run's median, with min – max over the "
              "runs; vs linattn: the contender's time / linattn's, run by run, median (min–max); peak memory: "
              "allocated above what was allocated before one call"
              + ("" if on_gpu else " (none on a CPU, which has no allocator statistics)")
              + "; agreement: the largest difference of the prefill's output from linattn's, relative to "
              "linattn's largest entry; error vs float64: the same against linattn's function in float64 on "
              "the CPU (strategy cpu) from the same input values, for a training step the largest over the "
              "inputs' gradients (from a cotangent of ones). A first call over a second (FLA's "
              "autotuning) is noted."]
    if cfg.get("chunk_sizes") or cfg.get("sub_chunk_sizes") or cfg.get("solve_blocks"):
        lines += ["", "`linattn chunk_size=...`, `sub_chunk_size=...`, `solve_block=...`: linattn with those knobs "
                  "instead of its "
                  "defaults (the row `linattn`), timed in the same rounds: a vs linattn below 1.00x is faster than "
                  "the defaults."]
    if not result.get("complete"):
        lines += ["", "**Incomplete**: the run stopped before its end; these are the settings it finished."]
    for form in cfg["forms"]:
        rows = [r for r in result["rows"] if r["form"] == form]
        if not rows:
            continue
        if form == MODEL_FORM:
            m = cfg["model"]
            title = (f"{MODEL_TITLE} (hidden {m['hidden_size']}, {m['heads']} heads of {m['head_dim']}, vocabulary "
                     f"{m['vocab_size']})")
        else:
            w = cfg["widths"][form]
            title = f"{KERNEL_FORMS[form].title}, {w['heads']} heads of {w['head_dim']}" + (
                f" (state {w['state']})" if "state" in w else "")
        lines += ["", f"## `{form}`: {title}", "",
                  "| N | pass | contender | time | spread (min – max) | vs linattn | peak memory | agreement | "
                  "error vs float64 | note |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            lines.append(f"| {r['n']} | {r['pass']} | {r['contender']} | " + " | ".join(_cells(r)) + " |")
    lines += _format_targets(result, on_gpu)
    prof = result.get("profile")
    if prof:
        lines += ["", "## Profile: one linattn Gated DeltaNet call", ""]
        if "error" in prof:
            lines.append(f"error: {prof['error']}")
        else:
            lines += [f"N = {prof['n']}, {prof['heads']} heads of {prof['head_dim']}, after {cfg['warmup']} warm-up "
                      "calls; leaf aten ops call no other aten op, computing ones are neither views nor "
                      "allocations" + ("" if on_gpu else " (kernels and GPU-busy time exist on a GPU only)") + ".", "",
                      "| pass | wall (profiled) | kernels | GPU busy | leaf aten ops | computing |",
                      "| --- | ---: | ---: | ---: | ---: | ---: |"]
            for pass_ in PASSES:
                p = prof[pass_]
                lines.append(f"| {pass_} | {_time(p['wall_s'])} | {'-' if p['kernels'] is None else p['kernels']} | "
                             f"{'-' if p['gpu_busy_s'] is None else _time(p['gpu_busy_s'])} | {p['leaf_aten_ops']} | "
                             f"{p['computing_leaf_aten_ops']} |")
    lines += ["", f"Elapsed: {result.get('elapsed_seconds', 0):.0f} s.", ""]
    return "\n".join(lines)
