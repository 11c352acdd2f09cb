"""FAVOR+ as a module: owns its random projection and redraws it only when told to.

Dimension legend as in ``linattn.functional``: B batch, H heads, N positions, D head width,
Dv value width, m number of random features.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor, nn

from ..config import Config
from ..functional.favor import FAVOR_FEATURES, FAVOR_KERNELS, favor_attention, favor_projection
from ..functional.linear import LinearAttentionState

__all__ = ["FavorAttention", "FavorConfig"]


@dataclass(frozen=True)
class FavorConfig(Config):
    """Options of :class:`FavorAttention` (names and defaults as in ``favor_attention``).

    Attributes:
        head_dim: D, the width of q and k. None (only in a model's attention config) means "the
            head width of the layer": ``linattn.MultiHeadAttention`` fills it in; a
            :class:`FavorAttention` needs it set.
        num_features: m, the number of random features (rows of the projection).
        kernel: ``"softmax"`` or ``"relu"``.
        features: ``"positive"`` or ``"trig"`` (softmax kernel only).
        orthogonal: orthogonal random features (lower variance) or i.i.d. Gaussian rows.
        redraw_every: redraw the projection every this many training forwards (a forward in
            training mode with gradients enabled); None never redraws on its own.
        seed: seed of the module's own generator, which draws the first projection and every
            policy redraw.
        scale: logit scale of the softmax kernel; None means 1/sqrt(head_dim).
    """

    head_dim: int | None = None
    num_features: int = 256
    kernel: str = "softmax"
    features: str = "positive"
    orthogonal: bool = True
    redraw_every: int | None = None
    seed: int = 0
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("head_dim", "num_features"):
            val = getattr(self, name)
            if name == "head_dim" and val is None:
                continue
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"FavorConfig: {name} must be an int >= 1, got {val!r}")
        if self.kernel not in FAVOR_KERNELS:
            raise ValueError(f"FavorConfig: unknown kernel {self.kernel!r}; known: {list(FAVOR_KERNELS)}")
        if self.features not in FAVOR_FEATURES:
            raise ValueError(f"FavorConfig: unknown features {self.features!r}; known: {list(FAVOR_FEATURES)}")
        if self.kernel == "relu" and self.features != "positive":
            raise ValueError("FavorConfig: features='trig' applies to kernel='softmax' only")
        r = self.redraw_every
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ValueError(f"FavorConfig: redraw_every must be None or an int >= 1, got {r!r}")


class FavorAttention(nn.Module):
    """FAVOR+ attention with its projection ``(m, D)`` held as a buffer (saved in state_dict).

    Randomness is explicit: the projection changes only in :meth:`redraw_`, called by you or, with
    ``config.redraw_every = K``, at the start of every K-th training forward. A redraw replaces the
    buffer by a new tensor rather than writing into it, so a graph built before it keeps the
    projection it used: a backward always matches its forward. Evaluation (``eval()`` or no grad)
    never redraws and is bit-for-bit repeatable. The generator state and the policy's counter are
    saved in state_dict too (``get_extra_state``), so a resumed run redraws exactly as the
    uninterrupted one. Activation checkpointing that reruns forward in training mode counts as
    another forward: combine it with ``redraw_every=None`` and explicit redraws.
    """

    projection: Tensor

    def __init__(self, config: FavorConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, FavorConfig):
            raise TypeError(f"FavorAttention: config must be a FavorConfig, got {type(config).__name__}")
        if config.head_dim is None:
            raise ValueError("FavorAttention: config.head_dim must be set (the width D of q and k), got None")
        self.config = config
        self._generator = torch.Generator().manual_seed(config.seed)
        self._forwards_since_redraw = 0
        self.register_buffer("projection", self._draw(self._generator, device=device, dtype=dtype))

    def _draw(self, generator: torch.Generator, *, device=None, dtype=None) -> Tensor:
        c = self.config
        return favor_projection(
            c.num_features, c.head_dim, orthogonal=c.orthogonal, generator=generator, dtype=dtype, device=device
        )

    @torch.no_grad()
    def redraw_(self, generator: torch.Generator | None = None) -> None:
        """Draw a new projection from ``generator`` (default: the module's own seeded generator)."""
        old = self.projection
        self.projection = self._draw(generator or self._generator, device=old.device, dtype=old.dtype)
        self._forwards_since_redraw = 0

    def _advance(self) -> None:
        """The redraw policy: a forward that trains (module in training mode, grad enabled) counts,
        and once ``redraw_every`` have, the projection is redrawn before the next one builds its
        graph (never inside one)."""
        every = self.config.redraw_every
        if every is not None and self.training and torch.is_grad_enabled():
            if self._forwards_since_redraw >= every:
                self.redraw_()
            self._forwards_since_redraw += 1

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool = False,
        key_padding_mask: Tensor | None = None,
        initial_state: LinearAttentionState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
        """``q (B,H,Nq,D)``, ``k (B,H,Nk,D)``, ``v (B,H,Nk,Dv)`` -> ``(B,H,Nq,Dv)``; see
        :func:`linattn.favor_attention` for the options (``key_padding_mask`` True = real key)."""
        self._advance()
        c = self.config
        return favor_attention(
            q, k, v, self.projection, kernel=c.kernel, features=c.features, causal=causal,
            key_padding_mask=key_padding_mask, scale=c.scale, initial_state=initial_state,
            return_state=return_state, cu_seqlens=cu_seqlens,
        )

    def inputs(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple, dict]:
        """``favor_attention``'s positional inputs ``(q, k, v, projection)`` and keyword options for
        a call the module makes elsewhere (a shard of a context-parallel sequence: every rank must
        hold the same projection, which the redraw policy keeps as long as every rank runs the same
        forwards). Counts as a forward for the redraw policy."""
        self._advance()
        c = self.config
        return (q, k, v, self.projection), {"kernel": c.kernel, "features": c.features, "scale": c.scale}

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "generator_state": self._generator.get_state(),
            "forwards_since_redraw": self._forwards_since_redraw,
            "config": self.config.to_dict(),
        }

    def set_extra_state(self, state: dict[str, Any]) -> None:
        saved = FavorConfig.from_dict(state["config"])
        # the seed only drew the first projection; the loaded generator state supersedes it
        if dataclasses.replace(saved, seed=self.config.seed) != self.config:
            raise ValueError(f"FavorAttention: state_dict was saved with {saved}, this module has {self.config}")
        self._generator.set_state(state["generator_state"])
        self._forwards_since_redraw = int(state["forwards_since_redraw"])

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"head_dim={c.head_dim}, num_features={c.num_features}, kernel={c.kernel!r}, "
            f"features={c.features!r}, orthogonal={c.orthogonal}, redraw_every={c.redraw_every}"
        )
