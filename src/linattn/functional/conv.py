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
        x: ``(B, N, C)`` inputs; the result has x's dtype (computed in float32 for half inputs).
        weight: ``(C, K)``, tap ``K - 1`` for the current position.
        bias: None or ``(C,)``.
        positions: None, or for documents packed along N (``linattn.functional.varlen``) every
            token's position within its own document, ``(N,)`` int64
            (:func:`linattn.nn.positional.document_positions`): a tap that would reach back past
            the document's first token reads zero, as at the start of a sequence. Read on the
            device only.
    """
    _check("causal_conv1d", x, weight, bias, positions)
    K, N = weight.shape[1], x.shape[1]
    # half inputs accumulate their K products in float32 and are rounded once, as a convolution
    # kernel accumulates: K roundings to bfloat16 would cost digits
    ct = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    w = weight.to(ct)
    # K shifted multiply-adds in x's own (B, N, C) layout, each into the rows its tap reaches: tap j
    # (input t - j) adds to outputs t >= j. A depthwise F.conv1d needs channels first, and its
    # transposes in and out cost more than the products (K is 4 in every model here); packed
    # documents only add a mask per tap, where a convolution's window would have to be cut.
    y = x * w[:, K - 1]  # (B, N, C) in ct
    for j in range(1, min(K, N)):
        tap = w[:, K - 1 - j]  # (C,)
        if positions is not None:  # only where t - j is in t's document: j <= its position there
            tap = (positions[j:] >= j)[:, None].to(ct) * tap  # (N - j, C)
        y[:, j:].addcmul_(x[:, : N - j], tap)
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype)


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
