"""A short causal depthwise convolution over positions, for the input of an attention layer.

Why: kernel (linear) attention cannot form the sharp "look one or two characters back" pattern
that softmax learns at once, because phi(q)·phi(k) of low-dimensional positive features is smooth
in the positions. Modern linear-attention models give every layer that local view separately: a
token shift (RWKV, arXiv 2305.13048) or a short convolution before the q/k/v projections (H3,
arXiv 2212.14052; Mamba; gated linear attention, arXiv 2312.06635). It adds ``C x K`` weights per
layer and O(K) work per token, and keeps decoding O(1): the state is the last ``K - 1`` inputs.

Context parallelism (a sequence sharded along N over the ranks of a group): the shard's first
K - 1 positions read the previous rank's last inputs, fetched by one differentiable all-gather
(:func:`linattn.distributed.halo`; zeros before position 0, as unsharded).

Dimension legend: B batch, N positions, C channels (d_model), K kernel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_step


__all__ = ["ShortConv", "short_conv_reference"]


def short_conv_reference(x: Tensor, weight: Tensor) -> Tensor:
    """Plain loop form: ``y[:, t] = sum_j weight[:, K-1-j] * x[:, t-j]`` over ``0 <= j < K``,
    ``j <= t``. ``x (B, N, C)``, ``weight (C, K)`` -> ``(B, N, C)``."""
    return causal_conv1d_reference(x, weight)


class ShortConv(nn.Module):
    """Causal depthwise convolution ``x (B, N, C) -> (B, N, C)`` with kernel size K.

    Position t sees positions ``t - K + 1 .. t`` (earlier than 0 counts as zero). Initialised to
    the identity (the newest tap is 1, the others 0), so a model starts as it would without it.

    Args:
        d_model: C.
        kernel_size: K >= 1 (K = 1 is a per-channel scale).
    """

    def __init__(self, d_model: int, kernel_size: int) -> None:
        super().__init__()
        for name, val in (("d_model", d_model), ("kernel_size", kernel_size)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"ShortConv: {name} must be an int >= 1, got {val!r}")
        self.d_model, self.kernel_size = d_model, kernel_size
        weight = torch.zeros(d_model, kernel_size)
        weight[:, -1] = 1.0  # tap K - 1 multiplies the current position
        self.weight = nn.Parameter(weight)  # (C, K)

    def _check(self, x: Tensor, what: str) -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"ShortConv.{what}: x must be (B, N, {self.d_model}), got {tuple(x.shape)}")

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, *,
                positions: Tensor | None = None, context_parallel=None) -> Tensor:
        """``x (B, N, C) -> (B, N, C)``. ``key_padding_mask`` (bool ``(B, N)``, True = real token):
        padded positions are zeroed first, so no padding reaches a real token's output.

        ``positions (N,)``: for documents packed along N, every token's position within its own
        document (:func:`linattn.nn.positional.document_positions`); a tap that would reach back
        past the document's first token reads zero instead, as at the start of a sequence.

        ``context_parallel`` (:class:`linattn.distributed.ContextParallel`): ``x`` is this rank's
        shard of one sequence sharded along N; its first K - 1 positions read the K - 1 inputs
        before the shard from the previous rank(s) (a halo, one all-gather; collective). Not with
        ``key_padding_mask`` or ``positions``.
        """
        self._check(x, "forward")
        if context_parallel is not None and (key_padding_mask is not None or positions is not None):
            raise ValueError("ShortConv.forward: context_parallel is not supported together with key_padding_mask "
                             "or positions (packed documents); pass None")
        if key_padding_mask is not None:
            x = x.masked_fill(~key_padding_mask[..., None], 0.0)
        if positions is not None and tuple(positions.shape) != (x.shape[1],):
            raise ValueError(f"ShortConv.forward: positions must be (N,) = ({x.shape[1]},) for x "
                             f"{tuple(x.shape)}, got {tuple(positions.shape)}")
        K = self.kernel_size
        if K == 1:
            return x * self.weight[:, 0].to(x.dtype)  # reads no other position: nothing to exchange
        if context_parallel is not None:
            before = context_parallel.halo(x, K - 1, dim=1).values  # (B, K - 1, C)
            if x.shape[1] == 0:  # an empty shard: no output, but tied to the halo for the backward
                return x + before[:, :0].to(x.dtype)
            # the halo before the shard (zeros on rank 0), the same convolution, the halo's own
            # outputs dropped: every kept output reads K real inputs, in the unsharded order
            h = torch.cat([before.to(x.dtype), x], dim=1)  # (B, K - 1 + N, C)
            return causal_conv1d(h, self.weight)[:, K - 1:]
        return causal_conv1d(x, self.weight, positions=positions)

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> Tensor:
        """The last ``K - 1`` inputs before the first token: zeros ``(B, K - 1, C)``."""
        w = self.weight
        return torch.zeros(batch_size, self.kernel_size - 1, self.d_model,
                           device=device or w.device, dtype=dtype or w.dtype)

    def tail(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """The decoding state after ``x (B, N, C)``: its last ``K - 1`` positions ``(B, K - 1, C)``,
        zeros in front when ``N < K - 1``."""
        self._check(x, "tail")
        if key_padding_mask is not None:
            x = x.masked_fill(~key_padding_mask[..., None], 0.0)
        keep = self.kernel_size - 1
        x = x[:, max(x.shape[1] - keep, 0):]
        return F.pad(x, (0, 0, keep - x.shape[1], 0))

    def step(self, x_t: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
        """One position: ``x_t (B, 1, C)`` and the last ``K - 1`` inputs ``(B, K - 1, C)`` ->
        ``(B, 1, C)`` and the next state."""
        self._check(x_t, "step")
        if x_t.shape[1] != 1 or state.shape != (x_t.shape[0], self.kernel_size - 1, self.d_model):
            raise ValueError(
                f"ShortConv.step: x_t must be (B, 1, {self.d_model}) and state (B, {self.kernel_size - 1}, "
                f"{self.d_model}), got {tuple(x_t.shape)} and {tuple(state.shape)}"
            )
        window = torch.cat([state.to(x_t.dtype), x_t], dim=1)  # (B, K, C)
        return causal_conv1d_step(window, self.weight), window[:, 1:]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, kernel_size={self.kernel_size}"
