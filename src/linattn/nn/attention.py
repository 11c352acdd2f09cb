"""Multi-head attention: the one module that owns the q/k/v/output projections and calls any
registered mechanism.

Dimension legend: B batch, N positions, C = d_model, H heads, D = C / H head width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..functional.varlen import check_cu_seqlens
from .conv import ShortConv
from .mechanisms import SoftmaxConfig
from .positional import apply_rotary, document_positions, rotary_angles
from .registry import MECHANISMS, build_mechanism, spec_for

__all__ = ["AttentionState", "MultiHeadAttention", "check_context_parallel_call"]


class AttentionState(NamedTuple):
    """Decoding state of one :class:`MultiHeadAttention` layer.

    Attributes:
        mechanism: the mechanism's own state: ``KVCache`` (softmax), ``LinearAttentionState``
            (linear, favor), ``LocalAttentionState`` (local) or ``DecayedState`` (retnet, gla,
            deltanet, gated_deltanet).
        position: the position of the next token (the number of tokens seen so far).
        conv: the last ``K - 1`` attention inputs ``(B, K - 1, C)`` of the layer's short
            convolution (``short_conv = K > 0``), else None.
    """

    mechanism: Any
    position: int
    conv: Tensor | None = None


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"MultiHeadAttention: {name} must be an int >= {minimum}, got {value!r}")


def check_context_parallel_call(owner: str, *, causal: bool, key_padding_mask, return_state: bool,
                                cu_seqlens) -> None:
    """Raise ValueError, naming ``owner``, unless a forward with ``context_parallel`` is causal and
    has no ``key_padding_mask``, ``return_state`` or ``cu_seqlens``: a shard of one sequence per
    rank has no padding of its own, its decoding state would be one rank's, and packed documents
    would cross the shards."""
    if not causal:
        raise ValueError(f"{owner}: context_parallel needs causal=True (a shard of a sequence sees the shards "
                         "before it only through a causal mechanism)")
    for name, value in (("key_padding_mask", key_padding_mask), ("cu_seqlens", cu_seqlens)):
        if value is not None:
            raise ValueError(f"{owner}: context_parallel is not supported together with {name}; pass None")
    if return_state:
        raise ValueError(f"{owner}: context_parallel is not supported together with return_state (a decoding "
                         "state is the whole sequence's, not one rank's)")


class MultiHeadAttention(nn.Module):
    """Projections ``x (B, N, C) -> q, k, v (B, H, N, D)``, a mechanism, merged heads ``-> (B, N, C)``.

    Args:
        d_model: C.
        n_heads: H; must divide d_model.
        attention: a mechanism config (``SoftmaxConfig()``, ``LinearConfig(...)``, ...; see
            ``linattn.nn.registry``). The mechanism module (``self.mechanism``) owns any buffers
            or parameters of its own (FAVOR's projection, Linformer's E and F, the gates of the
            gated and delta-rule mechanisms). A mechanism with ``needs_input`` is also handed the
            input the projections read, ``x (B, N, C)`` (after the short convolution).
        rotary: apply rotary position embeddings to q and k (positions 0..N-1, or the state's
            position in :meth:`step`); only for mechanisms whose spec allows it.
        max_len: the longest sequence; needed by Linformer (columns of E and F).
        bias: biases in the projections.
        short_conv: K > 0 puts a causal depthwise convolution of kernel size K
            (:class:`linattn.nn.ShortConv`, identity at initialisation) in front of the q/k/v
            projections, so every position also sees its K - 1 predecessors' inputs; 0 = none.

    The q, k and v projections are one ``in_proj`` (C -> 3C, weight rows [W_q; W_k; W_v]). A
    mechanism with grouped value heads (``n_key_heads`` Hk < H in the delta-rule configs) has q and k
    of Hk heads: C -> 2 Hk D + C, same row order, and value head h reads query/key head
    h // (H / Hk). LSH
    attention shares queries and keys, so its ``in_proj`` is C -> 2C, rows [W_qk; W_v]. (State dicts
    with the separate ``q_proj``/``k_proj``/``v_proj`` of linattn before 0.2 were merged on load
    until 0.3; load and save them once with linattn 0.2 to convert them.)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        attention=None,
        rotary: bool = False,
        max_len: int | None = None,
        bias: bool = True,
        rotary_base: float = 10000.0,
        short_conv: int = 0,
    ) -> None:
        super().__init__()
        _check_int("d_model", d_model)
        _check_int("n_heads", n_heads)
        _check_int("short_conv", short_conv, minimum=0)
        if d_model % n_heads:
            raise ValueError(
                f"MultiHeadAttention: n_heads = {n_heads} must divide d_model = {d_model} "
                f"(each head gets d_model / n_heads features)"
            )
        attention = SoftmaxConfig() if attention is None else attention
        self.spec = spec_for(attention)
        self.config = attention
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        if rotary and not self.spec.rotary:
            raise ValueError(
                f"MultiHeadAttention: rotary positions are not supported with {self.spec.name!r} "
                "attention (its scores are not dot products of q and k at two positions); use "
                "learned or sinusoidal positions"
            )
        if rotary and self.head_dim % 2:
            raise ValueError(f"MultiHeadAttention: rotary needs an even head width, got d_model / n_heads = {self.head_dim}")
        self.rotary = bool(rotary)
        self.rotary_base = float(rotary_base)
        # q, k and v come from one projection C -> 3C, output rows [q; k; v] (LSH: C -> 2C, rows
        # [qk; v]). One matrix product instead of three: in training one larger GEMM, in decoding
        # (a matrix-vector product per projection, bound by reading the weights) one call's
        # overhead instead of three.
        mechanism = build_mechanism(attention, n_heads=n_heads, head_dim=self.head_dim, max_len=max_len)
        # grouped value heads (the delta-rule mechanisms' n_key_heads): q and k get Hk heads, v H
        self.n_key_heads = mechanism.n_key_heads
        qk_width = self.n_key_heads * self.head_dim
        self.in_proj = nn.Linear(d_model, (1 if self.spec.shared_qk else 2) * qk_width + d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.mechanism = mechanism  # registered after the projections: the state dict's order is unchanged
        self.conv = ShortConv(d_model, short_conv) if short_conv else None

    # -- helpers -------------------------------------------------------------------------------

    def _qkv(self, x: Tensor, start: int, positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k ``(B, Hk, N, D)`` and v ``(B, H, N, D)`` for positions ``start .. start + N - 1``, or
        ``positions (N,)`` when given (rotary applied): views into one projection, ``(B, N, 3 | 2, H,
        D)`` when Hk = H."""
        B, N, _ = x.shape
        H, Hk, D = self.n_heads, self.n_key_heads, self.head_dim
        # the counts spelled out, not -1: an empty shard (N = 0) cannot infer them
        if Hk == H:
            p = self.in_proj(x).view(B, N, 2 if self.spec.shared_qk else 3, H, D)
            p = p.permute(2, 0, 3, 1, 4)  # (3 | 2, B, H, N, D)
            if self.spec.shared_qk:
                q = k = p[0]
                v = p[1]
            else:
                q, k, v = p.unbind(0)
        else:
            p = self.in_proj(x)  # (B, N, 2 Hk D + H D): rows [q; k; v]
            qk = p[..., : 2 * Hk * D].view(B, N, 2, Hk, D).permute(2, 0, 3, 1, 4)  # (2, B, Hk, N, D)
            q, k = qk.unbind(0)
            v = p[..., 2 * Hk * D :].view(B, N, H, D).transpose(1, 2)  # (B, H, N, D)
        if self.rotary:
            pos = torch.arange(start, start + x.shape[1], device=x.device) if positions is None else positions
            cos, sin = rotary_angles(pos, self.head_dim, base=self.rotary_base)
            q = apply_rotary(q, cos, sin)
            k = q if self.spec.shared_qk else apply_rotary(k, cos, sin)
        return q, k, v

    def _merge(self, o: Tensor) -> Tensor:
        B, H, N, D = o.shape
        return self.out_proj(o.transpose(1, 2).reshape(B, N, H * D))  # (B, N, C)

    def _check_x(self, x: Tensor, what: str) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"MultiHeadAttention.{what}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"MultiHeadAttention.{what}: x must have shape (B, N, d_model = {self.d_model}), "
                f"got {tuple(x.shape)}"
            )

    # -- public --------------------------------------------------------------------------------

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
                return_state: bool = False, cu_seqlens: Tensor | None = None, context_parallel=None):
        """Attention over ``x (B, N, C)`` -> ``(B, N, C)``.

        Args:
            causal: position i attends positions j <= i (mechanisms with a causal form only);
                False needs a bidirectional form (retnet, gla, deltanet, gated_deltanet have none).
            key_padding_mask: bool ``(B, N)``, True = a real token that may be attended, False =
                padding.
            return_state: also return the :class:`AttentionState` after the last position, to
                continue with :meth:`step` (needs ``causal`` and a recurrent mechanism).
            cu_seqlens: integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., N]`` of n documents packed
                along N (batch size 1; see :mod:`linattn.functional.varlen`). Causal only: no
                position attends another document, the short convolution does not reach across a
                boundary, and rotary positions restart at 0 in every document, so each document's
                output is what it would be alone. Not with ``return_state``.
            context_parallel: a :class:`linattn.distributed.ContextParallel` ``(group, offset)``
                (this tier reads its ``offset`` and calls its ``attend`` and ``halo``; it does not
                import :mod:`linattn.distributed`):
                ``x`` is this rank's shard of sequences sharded along N over the ranks of ``group``
                (contiguous shards in rank order), starting at global position ``offset``; returns
                this rank's part of the whole sequences' output. Rotary positions are ``offset + i``;
                the short convolution and the mechanism exchange what they need with the other ranks
                (collective: every rank calls it, and every rank runs backward when one does; see
                docs/context_parallel.md). Causal only; not with ``key_padding_mask``,
                ``return_state`` or ``cu_seqlens``; mechanisms without a context-parallel form (lsh)
                raise ValueError.
        """
        self._check_x(x, "forward")
        positions = None
        start = 0
        if context_parallel is not None:
            check_context_parallel_call("MultiHeadAttention", causal=causal, key_padding_mask=key_padding_mask,
                                        return_state=return_state, cu_seqlens=cu_seqlens)
            if not self.spec.sharded:
                raise ValueError(f"MultiHeadAttention: {self.spec.name!r} attention has no context-parallel form "
                                 "(see docs/context_parallel.md); pass context_parallel=None")
            start = context_parallel.offset
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"MultiHeadAttention: context_parallel.offset must be an int >= 0, got {start!r}")
        if cu_seqlens is not None:
            if not causal:
                raise ValueError("MultiHeadAttention: cu_seqlens (packed documents) needs causal=True")
            if return_state:
                raise ValueError("MultiHeadAttention: return_state with cu_seqlens is not supported (a layer's "
                                 "decoding state is one sequence's); the functional forms return one state per "
                                 "document")
            cu_seqlens = check_cu_seqlens("MultiHeadAttention", cu_seqlens, x[:, None])  # x as (1, 1, N, C); int64
            if self.rotary or self.conv is not None:
                positions = document_positions(cu_seqlens, x.shape[1])  # (N,)
        if causal and not self.spec.causal:
            raise ValueError(
                f"MultiHeadAttention: {self.spec.name!r} attention has no causal form; causal "
                "mechanisms: " + ", ".join(sorted(n for n, s in MECHANISMS.items() if s.causal))
            )
        if not causal and not self.spec.bidirectional:
            raise ValueError(
                f"MultiHeadAttention: {self.spec.name!r} attention has no bidirectional form (it is causal "
                "only); bidirectional mechanisms: "
                + ", ".join(sorted(n for n, s in MECHANISMS.items() if s.bidirectional))
            )
        if return_state and not (causal and self.spec.recurrent):
            raise ValueError(
                f"MultiHeadAttention: return_state needs causal=True and a recurrent mechanism, got "
                f"causal={causal} with {self.spec.name!r}"
            )
        conv_state = None
        if self.conv is not None:
            if key_padding_mask is not None:  # once, for both the convolution and its state
                x = x.masked_fill(~key_padding_mask[..., None], 0.0)
            if return_state:
                conv_state = self.conv.tail(x)
            x = self.conv(x, positions=positions, context_parallel=context_parallel)
        q, k, v = self._qkv(x, start, positions)
        mech = self.mechanism
        if context_parallel is not None:
            # the mechanism's functional form over the sharded sequence: the engine's driver does the
            # exchange (linattn.distributed), the mechanism only names its inputs
            tensors, options = mech.functional_inputs(q, k, v, x, causal=True)
            return self._merge(mech.functional_output(context_parallel.attend(mech.sharding, tensors, options), x))
        # x: the layer input the projections read (after the short convolution), which the
        # mechanisms whose gates are functions of it read too
        res = mech(q, k, v, x=x, causal=causal, key_padding_mask=key_padding_mask, return_state=return_state,
                   cu_seqlens=cu_seqlens)
        if return_state:
            o, state = res
            return self._merge(o), AttentionState(state, x.shape[1], conv_state)
        return self._merge(res)

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> AttentionState:
        """The state before the first token (an empty KV cache, zero sums, an empty ring buffer).

        ``device`` and ``dtype`` default to those of the projection weights."""
        w = self.in_proj.weight
        device, dtype = device or w.device, dtype or w.dtype
        conv = None if self.conv is None else self.conv.initial_state(batch_size, device=device, dtype=dtype)
        return AttentionState(self.mechanism.initial_state(batch_size, device=device, dtype=dtype), 0, conv)

    def step(self, x_t: Tensor, state: AttentionState) -> tuple[Tensor, AttentionState]:
        """One causal decoding step: ``x_t (B, 1, C)`` at position ``state.position`` ->
        ``(B, 1, C)`` and the next state. Equals the matching row of ``forward(x, causal=True)``.

        Raises ValueError for mechanisms without a recurrent form (efficient, linformer, lsh,
        hedgehog).
        """
        self._check_x(x_t, "step")
        if x_t.shape[1] != 1:
            raise ValueError(f"MultiHeadAttention.step: x_t must hold one position (B, 1, {self.d_model}), got {tuple(x_t.shape)}")
        if not self.spec.recurrent:
            raise ValueError(f"MultiHeadAttention.step: {self.spec.name!r} attention has no recurrent form; the "
                             "mechanisms with one: " + ", ".join(sorted(n for n, s in MECHANISMS.items() if s.recurrent)))
        if not isinstance(state, AttentionState):
            raise TypeError(
                f"MultiHeadAttention.step: state must be an AttentionState (from initial_state() or "
                f"forward(..., return_state=True)), got {type(state).__name__}"
            )
        conv_state = None
        if self.conv is not None:
            if state.conv is None:
                raise ValueError("MultiHeadAttention.step: this layer has a short convolution but the state "
                                 "carries no conv inputs (a state from a layer without one?)")
            x_t, conv_state = self.conv.step(x_t, state.conv)
        q, k, v = self._qkv(x_t, state.position)
        o, inner = self.mechanism.step(q, k, v, state.mechanism, x=x_t)
        return self._merge(o), AttentionState(inner, state.position + 1, conv_state)

    def extra_repr(self) -> str:
        conv = f", short_conv={self.conv.kernel_size}" if self.conv is not None else ""
        keys = f", n_key_heads={self.n_key_heads}" if self.n_key_heads != self.n_heads else ""
        return (f"d_model={self.d_model}, n_heads={self.n_heads}{keys}, mechanism={self.spec.name!r}, "
                f"rotary={self.rotary}{conv}")

