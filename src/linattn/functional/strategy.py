"""The chunked engines' device strategies and their options, as one typed value.

Every chunked engine (``decayed.py``, ``delta.py``) runs one of two strategies, chosen in one
place (:func:`resolve_strategy`) from the tensors' device:

- **cpu**: tiles of a few chunks whose temporaries stay in cache and are reused tile after tile,
  and a sequential recurrence across chunks (the least arithmetic). CPU-specific tuning (tile
  sizes against page faults, subnormal flushes) belongs to this strategy.
- **accelerator**: every chunk of every row at once in a few large products, the recurrence
  across chunks as a log-depth scan (``recurrence.py``): kernel launches grow with log N, not N.
  With half inputs the large products of the forward take their operands in that half dtype and
  accumulate in float32 (tensor cores on a GPU: :func:`mixed_bmm`); states, decays and triangular
  solves stay float32. A formed factor (a state) is rounded to float16 only after an exact
  power-of-two scale into its range (:func:`half_operand`).

``"auto"`` picks ``"cpu"`` on a CPU and ``"accelerator"`` on any other device (CUDA, MPS, XPU);
the functional forms take ``strategy=`` to force either on any device (the tests run both on a
CPU).

:class:`EngineOptions` carries an engine call's knobs as one frozen value. A ``torch.library``
schema has no dataclass type, so the custom ops take it as one string (:meth:`EngineOptions.encode`,
decoded once per distinct value) rather than as a dozen positional arguments.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields

import torch
from torch import Tensor

__all__ = ["FLOAT16_TOP", "HALF_OPERANDS", "STRATEGIES", "EngineOptions", "check_strategy", "half_operand", "mixed_bmm",
           "operand_dtype", "parts_bmm", "resolve_strategy", "split_bmm"]

STRATEGIES = ("auto", "cpu", "accelerator")
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The devices whose bmm takes half operands into a float32 result (``out_dtype``): CUDA. torch 2.14's
# documentation names XPU too, but older releases' XPU builds are not known to: XPU multiplies the
# rounded operands in float32 (correct, slower) until a run on one shows otherwise.
OUT_DTYPE_DEVICES = frozenset({"cuda"})
# The profiler label of a product with half operands computed in float32 (devices without out_dtype).
HALF_OPERANDS = "linattn::half_operands"


def check_strategy(fn: str, strategy) -> str:
    """``strategy``: one of :data:`STRATEGIES`; ValueError naming the argument otherwise."""
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"{fn}: strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {strategy!r}")
    return strategy


def resolve_strategy(strategy: str, device: torch.device) -> str:
    """The strategy a call on ``device`` runs: ``"auto"`` is ``"cpu"`` on a CPU and
    ``"accelerator"`` elsewhere; ``"cpu"`` and ``"accelerator"`` are themselves."""
    if strategy == "auto":
        return "cpu" if device.type == "cpu" else "accelerator"
    return strategy


def operand_dtype(strategy: str, input_dtype: torch.dtype) -> str:
    """The large products' operand dtype for a call: the input's half dtype on the accelerator
    strategy (``"bfloat16"``, ``"float16"``), else ``""`` (the compute dtype itself). The CPU
    strategy keeps float32 operands: a CPU's half products are no faster and lose digits."""
    if strategy != "accelerator":
        return ""
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(input_dtype, "")


@dataclass(frozen=True)
class EngineOptions:
    """The knobs of one chunked engine call (none changes the result beyond rounding).

    ``chunk_size``: the chunk length C; ``strategy``: ``"cpu"`` or ``"accelerator"`` (resolved);
    ``operands``: ``""`` or a half dtype's name, the operand dtype of the accelerator's large
    forward products (:func:`operand_dtype`); ``per_tile``: the CPU strategy's tile, in chunks
    (delta rule: ``chunks_per_block``) or positions (decayed engine: ``tile_positions``);
    ``sub_chunk_size``: a per-channel gate's sub-chunks; ``solve_block``: the largest triangular
    block solved directly."""

    chunk_size: int
    strategy: str = "cpu"
    operands: str = ""
    per_tile: int = 4096
    sub_chunk_size: int = 4
    solve_block: int = 32

    def encode(self) -> str:
        """One string for a custom op's schema: ``"chunk_size=64;strategy=cpu;..."``."""
        return ";".join(f"{k}={v}" for k, v in asdict(self).items())

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def decode(text: str) -> "EngineOptions":
        """The value :meth:`encode` wrote."""
        kinds = {f.name: f.type for f in fields(EngineOptions)}
        values = dict(item.split("=", 1) for item in text.split(";"))
        return EngineOptions(**{k: int(v) if kinds[k] == "int" else v for k, v in values.items()})

    @property
    def operand(self) -> torch.dtype | None:
        """The large products' operand dtype, or None for the compute dtype."""
        return HALF_DTYPES.get(self.operands)


def mixed_bmm(a: Tensor, b: Tensor, operand: torch.dtype | None, out: Tensor | None = None, *,
              negate: bool = False) -> Tensor:
    """``bmm(a, b)`` of float32 ``a (M, X, Y)``, ``b (M, Y, Z)`` with the operands rounded to
    ``operand`` (a half dtype; None: as they are) and a float32 result accumulated in float32, into
    ``out`` when given. On CUDA one product on tensor cores (``out_dtype``); on other devices the
    rounded operands multiplied in float32: the same numbers up to the order of the sums, so a CPU
    checks the accuracy a GPU gets. ``negate``: ``-(a b)``, in the product itself (no pass over the
    result): ``baddbmm`` with ``beta=0, alpha=-1`` (its input ignored, NaN and all, as documented)
    in float32, the rounded ``a`` negated (exactly) with half operands."""
    if operand is None:
        if not negate:
            return torch.bmm(a, b, out=out)
        out = a.new_empty(a.shape[0], a.shape[1], b.shape[2]) if out is None else out
        return torch.baddbmm(out, a, b, beta=0, alpha=-1, out=out)
    rounded, b = a.to(operand), b.to(operand)
    # negated in place only when rounding made a copy: the caller's a is never written
    a = rounded if not negate else rounded.neg_() if rounded is not a else rounded.neg()
    if a.device.type in OUT_DTYPE_DEVICES:  # straight into out: no float32 temporary and copy
        return torch.bmm(a, b, out_dtype=torch.float32, out=out)
    # labelled, so that a profile tells these products from float32 ones (bench/tensor_cores.py)
    with torch.profiler.record_function(HALF_OPERANDS):
        return torch.bmm(a.float(), b.float(), out=out)


# float16's range ends at 65504. A state is a sum over positions (linear attention's, a weakly decayed
# GLA's): at unit scale it passes that within N ~ 2e4, where its rounding to float16 gave inf, its
# lower half inf - inf and the output NaN, though every output is representable. So a matrix that
# the engines form (not an input) is rounded to float16 after a power-of-two scale that puts its
# largest entry in [2^14, 2^15), one per matrix: exact, and the product is scaled back exactly.
# bfloat16 has float32's range and needs none.
FLOAT16_TOP = 15  # the scaled largest entry is below 2^FLOAT16_TOP


def _float16_scales(b: Tensor) -> Tensor:
    """``(M, 1, 1)`` float32 powers of two that put the largest ``|entry|`` of each matrix of a float32
    ``b (M, Y, Z)`` in ``[2^14, 2^15)`` (2^127 for a matrix of zeros, at most that for one of
    subnormals). From the exponent bits of that entry, in integer operations every device has: no
    ``frexp``, which not every backend implements, and exact powers of two (an ``exp2`` need not be)."""
    exponent = b.abs().amax((1, 2), keepdim=True).view(torch.int32).bitwise_right_shift(23)  # biased: e + 127
    # 2^(FLOAT16_TOP - 1 - e) for a largest entry in [2^e, 2^(e + 1)), biased by 127 in turn
    biased = (FLOAT16_TOP - 1 + 2 * 127 - exponent).clamp_(1, 254)
    return biased.bitwise_left_shift_(23).view(torch.float32)


def half_operand(b: Tensor, operand: torch.dtype | None, *, split: bool = False
                 ) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """A formed float32 ``b (M, Y, Z)`` as the right factor of :func:`mixed_bmm` products, rounded
    once for all of them: ``((hi,), s)`` with ``hi`` b rounded to ``operand``, or with ``split``
    ``((hi, lo), s)``, ``lo`` the rounding error rounded in turn (``a hi + a lo`` keeps about twice
    the half dtype's digits of b: :func:`split_bmm`). ``s``: None, or for float16 ``(M, 1, 1)``
    powers of two that b was scaled by first (:data:`FLOAT16_TOP`): divide the products by it.
    ``((b,), None)`` without an operand dtype."""
    if operand is None:
        return (b,), None
    scale = _float16_scales(b) if operand == torch.float16 else None
    if scale is not None:
        b = torch.mul(b, scale)
    hi = b.to(operand)
    if not split:
        return (hi,), scale
    return (hi, torch.sub(b, hi.float()).to(operand)), scale


def parts_bmm(a: Tensor, parts: tuple[Tensor, ...], scale: Tensor | None, operand: torch.dtype | None,
              out: Tensor | None = None) -> Tensor:
    """``a b`` for ``b`` as :func:`half_operand` gave it, ``(parts, scale)``: the :func:`mixed_bmm`
    products with each part summed, divided by ``scale`` when there is one; into ``out`` when given.
    Pass ``parts[:1]`` for b rounded once where its lower part is not needed."""
    product = mixed_bmm(a, parts[0], operand, out=out)
    for part in parts[1:]:
        product.add_(mixed_bmm(a, part, operand))
    return product if scale is None else product.div_(scale)


def split_bmm(a: Tensor, b: Tensor, operand: torch.dtype | None, out: Tensor | None = None) -> Tensor:
    """:func:`mixed_bmm` with ``b`` carried in two half parts, ``b_hi`` (b rounded) and ``b_lo`` (the
    rounding error, rounded): ``a b_hi + a b_lo``, two half products whose result keeps about twice
    the half dtype's digits of ``b``. For a factor that is a difference of larger terms (the delta
    rule's pseudo-values ``U = Uv - W S``) or a product of two inputs (its values times beta),
    whose rounding to bfloat16 would cost the output more digits than the other products' (measured:
    docs/benchmarks/tensor_cores). Into ``out`` when given."""
    if operand is None:
        return torch.bmm(a, b, out=out)
    return parts_bmm(a, *half_operand(b, operand, split=True), operand, out=out)  # float16: b scaled into range
