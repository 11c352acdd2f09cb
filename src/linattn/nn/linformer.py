"""The module that owns Linformer's sequence projections E and F (Wang et al., arXiv 2006.04768).

Dimension legend: B batch, H heads, Nq queries, Nk keys, P projected length, D query/key width,
Dv value width, Nmax the largest Nk the module accepts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..functional.linformer import linformer_attention

__all__ = ["LinformerAttention"]


class LinformerAttention(nn.Module):
    """Owns E and F ``(P, Nmax)`` and applies :func:`linattn.functional.linformer_attention`.

    Shorter inputs: a call with Nk < Nmax keys uses the first Nk columns of E and F. This is exactly
    what the same call right-padded to Nmax with ``key_padding_mask`` False on the padding gives
    (padded keys are zeroed before projecting, so the other columns multiply zeros); a model
    trained on padded batches therefore sees the same function on unpadded short inputs.
    A call with Nk > Nmax raises ValueError: there are no columns for the extra positions.

    Args:
        max_len: Nmax, the largest number of keys.
        proj_len: P, the projected length.
        share_kv: use one matrix for E and F (the paper's "key-value sharing").
        generator: drawn from for the initial E and F (see :meth:`reset_parameters`).
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        max_len: int,
        proj_len: int,
        *,
        share_kv: bool = False,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("max_len", max_len), ("proj_len", proj_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinformerAttention: {name} must be an int >= 1, got {value!r}")
        self.max_len = max_len
        self.proj_len = proj_len
        self.share_kv = share_kv
        self.e_proj = nn.Parameter(torch.empty(proj_len, max_len, device=device, dtype=dtype))
        self.f_proj = None if share_kv else nn.Parameter(torch.empty(proj_len, max_len, device=device, dtype=dtype))
        self.reset_parameters(generator=generator)

    def reset_parameters(self, *, generator: torch.Generator | None = None) -> None:
        """Redraw E and F with entries N(0, 1/P): a Johnson-Lindenstrauss projection, which keeps
        the norm of each key feature column in expectation (the paper's argument for a small P)."""
        std = 1.0 / math.sqrt(self.proj_len)
        with torch.no_grad():
            for p in (self.e_proj, self.f_proj):
                if p is not None:
                    # drawn where the generator lives (a CPU generator for CPU draws), then moved
                    where = p.device if generator is None else generator.device
                    p.copy_(torch.randn(p.shape, generator=generator, device=where, dtype=p.dtype) * std)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """``q (B,H,Nq,D)``, ``k (B,H,Nk,D)``, ``v (B,H,Nk,Dv)`` with Nk <= Nmax -> ``(B,H,Nq,Dv)``.

        ``key_padding_mask`` is bool ``(B, Nk)``, True = a real key. E and F are cast to the
        inputs' dtype. There is no causal form (see :func:`linformer_attention`).
        """
        nk = k.shape[2] if isinstance(k, Tensor) and k.dim() == 4 else None
        if nk is not None and nk > self.max_len:
            raise ValueError(
                f"LinformerAttention: k has Nk = {nk} keys (shape {tuple(k.shape)}) but the module "
                f"was built for max_len = {self.max_len}; build it with a larger max_len"
            )
        if nk is None:  # let the functional form name what is wrong with k
            nk = self.max_len
        e, f = self.projections(q, nk)
        return linformer_attention(q, k, v, e, f, key_padding_mask=key_padding_mask, scale=scale)

    def projections(self, q: Tensor, nk: int) -> tuple[Tensor, Tensor]:
        """E and F for ``nk`` keys, ``(P, nk)`` each, in q's dtype (F is E when shared)."""
        e = self.e_proj[:, :nk].to(q.dtype) if isinstance(q, Tensor) else self.e_proj[:, :nk]
        f = e if self.f_proj is None else self.f_proj[:, :nk].to(e.dtype)
        return e, f

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, proj_len={self.proj_len}, share_kv={self.share_kv}"
