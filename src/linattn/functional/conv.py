"""The short causal depthwise convolution over positions, as a function: the one engine behind
:class:`linattn.nn.conv.ShortConv` and the Hugging Face integration's convolutions
(``linattn.integrations.transformers``), with document boundaries for packed inputs, and its
recurrent form for decoding (:func:`causal_conv1d_step`, one output from the last K inputs).

``y[:, t, c] = bias[c] + sum_j weight[c, K-1-j] * x[:, t-j, c]`` over ``0 <= j < K``: tap ``K - 1``
multiplies the current position, tap 0 the one ``K - 1`` back (the layout of a depthwise
``nn.Conv1d``'s weight ``(C, 1, K)`` squeezed to ``(C, K)``). Positions before the start read zero.

Dimension legend: B batch, N positions, C channels, K kernel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import shape_str

__all__ = ["causal_conv1d", "causal_conv1d_reference", "causal_conv1d_step"]


def _check(fn: str, x: Tensor, weight: Tensor, bias: Tensor | None, positions: Tensor | None) -> None:
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise ValueError(f"{fn}: x must be (B, N, C) and weight (C, K) with K >= 1, got x {shape_str(x)} and "
                         f"weight {shape_str(weight)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"{fn}: bias must be (C,) = ({x.shape[-1]},) for x {shape_str(x)}, got {shape_str(bias)}")
    if positions is not None and tuple(positions.shape) != (x.shape[1],):
        raise ValueError(f"{fn}: positions must be (N,) = ({x.shape[1]},) for x {shape_str(x)}, got "
                         f"{shape_str(positions)}")


def causal_conv1d(x: Tensor, weight: Tensor, *, bias: Tensor | None = None,
                  positions: Tensor | None = None) -> Tensor:
    """Causal depthwise convolution ``x (B, N, C) -> (B, N, C)``.

    Args:
        x: ``(B, N, C)`` inputs; the result has x's dtype (the weight is cast to it).
        weight: ``(C, K)``, tap ``K - 1`` for the current position.
        bias: None or ``(C,)``.
        positions: None, or for documents packed along N (``linattn.functional.varlen``) every
            token's position within its own document, ``(N,)`` int64
            (:func:`linattn.nn.positional.document_positions`): a tap that would reach back past
            the document's first token reads zero, as at the start of a sequence. Read on the
            device only.
    """
    _check("causal_conv1d", x, weight, bias, positions)
    K = weight.shape[1]
    w = weight.to(x.dtype)
    if positions is not None:
        # tap j (input t - j) only where t - j is in t's document: j <= its position there. K small
        # shifted products rather than one convolution whose window a mask would have to cut.
        y = x * w[:, K - 1]
        for j in range(1, K):
            shifted = F.pad(x, (0, 0, j, 0))[:, : x.shape[1]]  # (B, N, C): input t - j at t
            y = y + shifted * (positions >= j)[:, None].to(x.dtype) * w[:, K - 1 - j]
    else:
        # conv1d is a cross-correlation: with K - 1 zeros on the left, output t reads inputs t-K+1..t
        h = F.pad(x.transpose(1, 2), (K - 1, 0))  # (B, C, N + K - 1)
        y = F.conv1d(h, w[:, None, :], groups=x.shape[-1]).transpose(1, 2)  # (B, N, C)
    return y if bias is None else y + bias.to(x.dtype)


def causal_conv1d_step(window: Tensor, weight: Tensor, *, bias: Tensor | None = None) -> Tensor:
    """The recurrent form: the output at the newest of the last K inputs ``window (B, K, C)`` (oldest
    first; any strides, a cache's channels-first window transposed too) -> ``(B, 1, C)``, in the
    window's dtype: ``bias + sum_j weight[:, j] * window[:, j]``, what :func:`causal_conv1d` gives at
    the window's last position, as one weighted sum (a decoding step is a few microseconds of work:
    padding the window and calling a convolution for one output cost more than the sum)."""
    if window.dim() != 3 or weight.dim() != 2 or tuple(weight.shape) != (window.shape[2], window.shape[1]):
        raise ValueError(f"causal_conv1d_step: window must be (B, K, C) and weight (C, K), got window "
                         f"{shape_str(window)} and weight {shape_str(weight)}")
    if bias is not None and tuple(bias.shape) != (window.shape[-1],):
        raise ValueError(f"causal_conv1d_step: bias must be (C,) = ({window.shape[-1]},) for window "
                         f"{shape_str(window)}, got {shape_str(bias)}")
    y = torch.linalg.vecdot(window.transpose(1, 2), weight.to(window.dtype))[:, None]  # (B, 1, C)
    return y if bias is None else y + bias.to(window.dtype)


def causal_conv1d_reference(x: Tensor, weight: Tensor, *, bias: Tensor | None = None,
                            positions: Tensor | None = None) -> Tensor:
    """The loop form of :func:`causal_conv1d` (same arguments): what the tests trust."""
    _check("causal_conv1d_reference", x, weight, bias, positions)
    B, N, C = x.shape
    K = weight.shape[1]
    w = weight.to(x.dtype)
    y = torch.zeros_like(x)
    for t in range(N):
        reach = t + 1 if positions is None else int(positions[t]) + 1  # inputs t - j with j < reach exist
        for j in range(min(K, reach)):
            y[:, t] += w[:, K - 1 - j] * x[:, t - j]
    return y if bias is None else y + bias.to(x.dtype)
