"""How much of a call's matrix-product arithmetic takes half-precision operands: the share a GPU
runs on tensor cores, measured on any device.

torch.profiler records every ``aten::bmm``, ``baddbmm``, ``mm``, ``addmm`` and ``matmul``-made
product with its FLOPs. A product counts as *half* when its operands are float16 or bfloat16
(on CUDA, ``strategy.mixed_bmm`` multiplies them so, accumulating in float32), or when it runs
under the ``linattn::half_operands`` label (elsewhere ``mixed_bmm`` multiplies the rounded
operands in float32: the same numbers, labelled); every other product counts as *full*.

Dimension legend: none (FLOP counts only).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..functional.strategy import HALF_OPERANDS

__all__ = ["ProductFlops", "product_flops"]

_PRODUCTS = frozenset({"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::addbmm"})
_HALF = frozenset({"c10::BFloat16", "c10::Half", "BFloat16", "Half"})


class ProductFlops(NamedTuple):
    """FLOPs of a call's matrix products with half operands (``half``) and with others (``full``)."""

    half: int
    full: int

    @property
    def half_share(self) -> float:
        """``half / (half + full)`` (0 for a call without products)."""
        total = self.half + self.full
        return self.half / total if total else 0.0


def product_flops(fn: Callable[[], object]) -> ProductFlops:
    """Run ``fn()`` once under torch.profiler and sum its matrix products' FLOPs by operand kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        fn()
    half = full = 0

    def walk(ev, labelled: bool) -> None:
        nonlocal half, full
        labelled = labelled or ev.name == HALF_OPERANDS
        if ev.name in _PRODUCTS and ev.flops:
            dtypes = set(ev.input_dtypes or ())
            if labelled or dtypes & _HALF:
                half += ev.flops
            else:
                full += ev.flops
            return  # a product's own children (a copy, a bmm under addmm) are not counted again
        for child in ev.cpu_children:
            walk(child, labelled)

    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev, False)
    return ProductFlops(half, full)
