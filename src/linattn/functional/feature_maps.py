"""Feature maps phi for kernel ("linear") attention: sim(q, k) = phi(q) . phi(k).

Each map takes ``x (..., D)`` and returns ``phi(x) (..., F)`` with non-negative entries, which is what
makes the normaliser phi(q) . sum_j phi(k_j) a sum of non-negative terms (see ``linear.py``).

- ``"elu"``: elu(x) + 1, Katharopoulos et al. 2020 (arXiv 2006.16236), F = D.
- ``"relu"``: max(x, 0), F = D. A query and key with disjoint supports have similarity 0.
- ``"cos"``: [1, x / ||x||], F = D + 1, so sim(q, k) = 1 + cos(q, k) in [0, 2].
- ``"softmax"``: softmax over the feature dimension, F = D.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ELEMENTWISE_MAPS", "FEATURE_MAPS", "ElementwiseMap", "FeatureMap", "resolve_feature_map"]

FeatureMap = Callable[[Tensor], Tensor]


def _elu_plus_one(x: Tensor, out: Tensor | None = None) -> Tensor:
    """exp(min(x, 0)) + max(x, 0), which is elu(x) + 1 without the cancellation of
    (exp(x) - 1) + 1: that returns exactly 0 in float32 for x < -17, and a key whose features are
    all 0 would then count as no key at all."""
    y = torch.clamp(x, max=0.0, out=out).exp_()
    return y.add_(torch.clamp(x, min=0.0))


def _elu_plus_one_grad(y: Tensor, g: Tensor) -> Tensor:
    # y = elu(x) + 1 is x + 1 for x > 0 and exp(x) <= 1 otherwise, so dy/dx = min(y, 1): the
    # backward needs only y.
    return y.clamp(max=1.0).mul_(g)


class _EluPlusOne(torch.autograd.Function):
    # Saves y only, so forward and backward each make one tensor instead of two.
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = _elu_plus_one(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return _elu_plus_one_grad(y, g)


def elu_feature_map(x: Tensor) -> Tensor:
    """elu(x) + 1 > 0 (Katharopoulos et al., arXiv 2006.16236, eq. 7)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _elu_plus_one(x)  # no graph to build: skip the Function's per-call cost (decoding)
    return _EluPlusOne.apply(x)


def relu_feature_map(x: Tensor) -> Tensor:
    """max(x, 0)."""
    return F.relu(x)


def cos_feature_map(x: Tensor) -> Tensor:
    """[1, x/||x||]: phi(q).phi(k) = 1 + cos(q, k). A zero vector maps to [1, 0, ..., 0]."""
    unit = F.normalize(x, dim=-1)  # x / max(||x||, eps): no 0/0 for x = 0
    return torch.cat([torch.ones_like(x[..., :1]), unit], dim=-1)


def softmax_feature_map(x: Tensor) -> Tensor:
    """softmax over the feature dimension."""
    return torch.softmax(x, dim=-1)


class ElementwiseMap(NamedTuple):
    """A named map applied elementwise (F = D) whose derivative is a function of its output.

    Fused kernels (causal ``linear_attention``) apply it one tile at a time, writing into and
    overwriting buffers they own (no autograd here).
    """

    forward: Callable[[Tensor, Tensor], Tensor]  # (x, out) -> out = phi(x)
    backward_: Callable[[Tensor, Tensor], Tensor]  # (y = phi(x), g) -> y = g * phi'(x), in place


# relu's derivative is taken as 0 at 0, as autograd does for F.relu.
ELEMENTWISE_MAPS: dict[str, ElementwiseMap] = {
    "elu": ElementwiseMap(_elu_plus_one,
                          lambda y, g: y.clamp_(max=1.0).mul_(g)),
    "relu": ElementwiseMap(lambda x, out: torch.clamp(x, min=0.0, out=out),
                           lambda y, g: y.gt_(0.0).mul_(g)),
}


FEATURE_MAPS: dict[str, FeatureMap] = {
    "elu": elu_feature_map,
    "relu": relu_feature_map,
    "cos": cos_feature_map,
    "softmax": softmax_feature_map,
}


def resolve_feature_map(fn: str, feature_map: Union[str, FeatureMap]) -> FeatureMap:
    """Turn a feature-map name or callable into a callable, or raise listing the known names."""
    if isinstance(feature_map, str):
        try:
            return FEATURE_MAPS[feature_map]
        except KeyError:
            raise ValueError(
                f"{fn}: unknown feature_map {feature_map!r}; known: {sorted(FEATURE_MAPS)} "
                "or any callable mapping (..., D) to (..., F)"
            ) from None
    if callable(feature_map):
        return feature_map
    raise TypeError(
        f"{fn}: feature_map must be a name {sorted(FEATURE_MAPS)} or a callable, "
        f"got {type(feature_map).__name__}"
    )
