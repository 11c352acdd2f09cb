"""The normaliser of kernel attention, ``out_i = num_i / den_i``, and its guard.

Kernel attention (``linear.py``, ``favor.py``) and Hedgehog (``hedgehog.py``) divide a numerator
by a normaliser that is a sum of feature products. With non-negative features the normaliser is
accurate to rounding however small it is, but it can be 0 (no key with positive similarity) or so
small that the backward's ``1 / den`` overflows. Every form divides through the helpers here, so
the fast forms and the references apply one guard: the normaliser's magnitude is raised to
:func:`normaliser_floor`, and to 1 where even that is below ``finfo.tiny``.

Shapes: ``num (..., Dv)``, ``den (..., 1)``, ``floor (..., 1)``; ``o (..., Dv+1)`` holds the
numerator and the normaliser side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["divide_by_normaliser", "divide_by_normaliser_", "guarded_normaliser", "normalise", "normaliser_floor"]


def normaliser_floor(qf: Tensor, z_seen: Tensor, *, nonnegative: bool = False) -> Tensor:
    """The smallest normaliser used as it is: ``max_r |qf_r| * max_r |z_r| / sqrt(finfo.max)``.

    ``qf (..., F)``: a query's features; ``z_seen (..., F)``: the normaliser state it sees (the sum
    of the features of every key it may attend, prefix state included), broadcast against ``qf``;
    ``nonnegative``: the caller knows both are (an elementwise map's features and their sums), so
    that their largest magnitude is their largest value: no pass for the magnitudes, which at
    ``(N, F)`` per row cost a fused engine as much traffic as a product.
    Returns ``(..., 1)``, detached: a guard, held constant under differentiation. A normaliser
    below it is raised to it (:func:`normalise`).

    Why relative to ``max|qf| max|z|``: that is the row's scale (``|qf . z| <= F max|qf| max|z|``),
    so scaling the features scales the floor with them and rows are judged alike at every
    magnitude. Why ``1 / sqrt(finfo.max)`` (5.4e-20 in float32, 7.5e-155 in float64): with
    non-negative features the normaliser is a sum without cancellation, accurate to rounding
    however small it is, so the forward needs no floor at all; the backward does. It multiplies by
    ``1 / den`` before anything small can cancel it: at den = 1.2e-38 (just above ``finfo.tiny``,
    the old guard) ``1 / den`` is 8e37 and the key gradients overflow, then NaN spreads to the whole
    head. Above this floor ``qf_r / den <= sqrt(finfo.max) / max|z|``, and ``max|z|`` is at least
    the heaviest visible key's largest feature, which leaves ``sqrt(finfo.max)`` of headroom for
    the sums over positions and values in the backward. Rows below it have a normaliser
    ``1e-20`` times their own scale: their features are nearly one-hot in different directions.
    """
    rel = torch.finfo(qf.dtype).max ** -0.5
    qf, z_seen = (t.detach() if t.requires_grad else t for t in (qf, z_seen))
    if not nonnegative:
        qf, z_seen = qf.abs(), z_seen.abs()
    return qf.amax(-1, keepdim=True).mul_(z_seen.amax(-1, keepdim=True)).mul_(rel)


def guarded_normaliser(den: Tensor, floor: Tensor) -> tuple[Tensor, Tensor]:
    """``den`` with its magnitude raised to at least ``floor`` (sign kept: signed features, as
    ``"cos"`` has, can give a negative estimate), and 1 where even that is below ``finfo.tiny``
    (no key, or features that underflowed): the divisor, and where ``den`` itself was used (the
    gradient reaches it only there). With non-negative features ``|num| <= den max|v|``: a
    raised row comes out smaller, never larger, than the unguarded one, and a row with no key
    gets zeros."""
    active = den.abs() >= floor
    d = torch.where(active, den, floor.copysign(den))
    ok = d.abs() >= torch.finfo(d.dtype).tiny
    return torch.where(ok, d, 1.0), active & ok


def divide_by_normaliser(num: Tensor, den: Tensor, floor: Tensor) -> Tensor:
    """``num (..., Dv) / den (..., 1)`` with the guard of :func:`guarded_normaliser` and
    ``floor`` from :func:`normaliser_floor`, through autograd (the gradient reaches ``den`` only
    where it was used): for callers that hold the weights or the sums themselves (Hedgehog)."""
    return num / guarded_normaliser(den, floor)[0]


def divide_by_normaliser_(num: Tensor, den: Tensor, floor: Tensor) -> Tensor:
    """``num / den`` in place in ``num``, guarded as in :func:`guarded_normaliser` (no graph:
    for decoding steps)."""
    d = torch.where(den.abs() >= floor, den, floor.copysign(den))  # guarded_normaliser's divisor
    return num.div_(torch.where(d.abs() >= torch.finfo(d.dtype).tiny, d, 1.0))


class _Normalise(torch.autograd.Function):
    """``o (..., Dv+1) -> o[..., :Dv] / max(o[..., Dv], floor)`` (see :func:`normaliser_floor`).

    Its own backward writes the gradient of numerator and normaliser into one buffer instead of
    autograd's two zero-filled slice gradients (a measurable cost at long N on CPU).
    """

    @staticmethod
    def forward(ctx, o: Tensor, dv: int, floor: Tensor):
        d, active = guarded_normaliser(o[..., dv:], floor)  # (..., 1)
        inv = d.reciprocal_()
        out = o[..., :dv] * inv
        ctx.save_for_backward(out, inv, active)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        out, inv, active = ctx.saved_tensors
        do = torch.empty(*out.shape[:-1], out.shape[-1] + 1, dtype=out.dtype, device=out.device)
        if torch.compiler.is_compiling():  # it refuses out= a strided view
            do[..., :-1] = g * inv
        else:
            torch.mul(g, inv, out=do[..., :-1])
        # d out_e / d den = -out_e / den where den was used; 0 where the floor stood in for it
        do[..., -1:] = torch.linalg.vecdot(g, out, dim=-1).unsqueeze(-1).mul_(inv).neg_().mul_(active)
        return do, None, None


def normalise(o: Tensor, dv: int, out_dtype: torch.dtype, floor: Tensor) -> Tensor:
    """Split ``o (..., Dv+1)`` into numerator and normaliser and divide, the normaliser raised to
    ``floor (..., 1)`` (:func:`normaliser_floor`).

    A zero normaliser means no key with positive similarity (all padding, or disjoint relu
    supports); with non-negative features the numerator is then zero too, and the row returns
    zeros with finite gradients instead of 0/0. A normaliser below the floor (features that are
    nearly one-hot in different directions, at large input scales) is raised to it: the output
    shrinks towards zero and every gradient stays finite.
    """
    if not (o.requires_grad and torch.is_grad_enabled()):
        # the same arithmetic as _Normalise.forward, without the Function's per-call cost (decoding)
        return (o[..., :dv] * guarded_normaliser(o[..., dv:], floor)[0].reciprocal_()).to(out_dtype)
    return _Normalise.apply(o, dv, floor).to(out_dtype)
