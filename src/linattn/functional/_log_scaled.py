"""The causal prefix product with a running log-scale: the engine of stabilised causal kernels.

    o_i = a_i . S_i,   S_i = e^{m_{i-1} - m_i} S_{i-1} + kf_i w_i^T,   S_{-1} = s0 (at scale m_0)

i.e. ``o_i = a_i . (e^{m_0 - m_i} s0 + sum_{j <= i} e^{m_j - m_i} kf_j w_j^T)`` with ``m``
non-decreasing along the sequence. ``S_i`` is the running sum ``sum_j e^{m_j} kf_j w_j^T``
stored divided by ``e^{m_i}``, so a caller who divides each key's features by ``e^{m_j}`` (with
``m_j`` a running maximum of the keys' log-magnitudes) gets states and products whose every factor
is <= 1: nothing overflows, whatever the magnitude of the inputs, and ``m_i`` depends on no
position after ``i``. This is how FAVOR+ stabilises its exponential features in causal and
recurrent use without looking at future keys (``favor.py``). With ``m`` constant it is
``causal_linear_product``; as a decay ``e^{m_{i-1} - m_i}`` it is the scalar-gated form of later
linear-attention work.

Dimension legend as in ``linear.py``: B batch, H heads, N positions, F feature width, E value
width, C chunk length, Nc number of chunks.

Chunked like ``causal_linear_product``: inside a chunk the C x C score matrix is formed with the
factors ``e^{m_j - m_i}`` (j <= i) applied elementwise; across chunks a loop of one fused
multiply-add per chunk carries the state, rescaled at every chunk boundary. Exponents are differences of given ``m`` values, never of
cumulative sums, so a jump of thousands in ``m`` costs no precision in later weights. ``m`` is
a stabiliser: it receives no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import no_autocast

__all__ = ["causal_product_log_scaled"]


def _chunks(x: Tensor, n_pad: int, C: int, value: float = 0.0) -> Tensor:
    """``(B, H, N, X)`` -> ``(B*H*Nc, C, X)``, rows of ``value`` appended to fill the last chunk."""
    if n_pad:
        x = F.pad(x, (0, 0, 0, n_pad), value=value)
    return x.reshape(-1, C, x.shape[-1])


def _weights(mc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Scale factors of one chunked ``m (B*H, Nc, C)``, all <= 1:

    - ``intra (B*H*Nc, C, C)``: ``e^{m_j - m_i}`` for j <= i in a chunk, 0 above the diagonal;
    - ``enter (B*H*Nc, C, 1)``: ``e^{m_start - m_i}`` applied to the state entering the chunk,
      ``m_start`` being the scale of that state (the last ``m`` of the previous chunk);
    - ``leave (B*H*Nc, C, 1)``: ``e^{m_j - m_end}``, a key's weight in the state leaving the chunk;
    - ``carry (B*H, Nc)``: ``e^{m_start - m_end}``, the rescaling of the state across the chunk.
    """
    BH, nc, C = mc.shape
    start = torch.cat([mc[:, :1, 0], mc[:, :-1, -1]], dim=1)  # (B*H, Nc): scale entering each chunk
    end = mc[:, :, -1]  # (B*H, Nc)
    diff = mc[..., :, None] - mc[..., None, :]  # (B*H, Nc, C, C): m_i - m_j
    causal = torch.ones(C, C, dtype=torch.bool, device=mc.device).tril_()
    # exp(-inf) = 0 above the diagonal; masking before exp keeps e^{m_i - m_j} (> 1) from ever forming
    intra = torch.exp(torch.where(causal, -diff, float("-inf"))).view(-1, C, C)
    enter = torch.exp(start[..., None] - mc).view(-1, C, 1)
    leave = torch.exp(mc - end[..., None]).view(-1, C, 1)
    carry = torch.exp(start - end)
    return intra, enter, leave, carry


def _chunk_states(
    kc: Tensor, wc: Tensor, leave: Tensor, carry: Tensor, s0: Tensor | None, BH: int
) -> tuple[Tensor, Tensor]:
    """The state entering each chunk ``(B*H*Nc, F, E)`` and the final state ``(B*H, F, E)``.

    ``S_out[c] = carry[c] S_out[c-1] + (leave * kc[c])^T wc[c]`` with ``S_out[-1] = s0``, one fused
    ``addcmul_`` per chunk in the buffer that the per-chunk contributions were written to. The
    buffer has one spare slot in front, so that shifted by one it holds each chunk's *entering*
    state ``S_out[c-1]``; the slots where a head's first chunk would read the previous head's
    last state are then overwritten with ``s0``.
    """
    Fd, E = kc.shape[-1], wc.shape[-1]
    nc = kc.shape[0] // BH
    buf = kc.new_empty(BH * nc + 1, Fd, E)
    torch.bmm((kc * leave).transpose(1, 2), wc, out=buf[1:])  # contributions
    out = buf[1:].view(BH, nc, Fd, E)
    # (Nc, B*H, 1, 1): a contiguous factor per chunk (a strided broadcast operand sends addcmul_
    # down a path ~100x slower)
    carry4 = carry.T.contiguous()[..., None, None]
    if s0 is not None:
        out[:, 0].addcmul_(s0.reshape(BH, Fd, E), carry4[0])
    for c in range(1, nc):
        out[:, c].addcmul_(out[:, c - 1], carry4[c])
    s_final = out[:, -1].clone()
    # slot b*nc (b >= 1) holds head b-1's last state: make it head b's initial state
    buf[0 : BH * nc : nc] = 0 if s0 is None else s0.reshape(BH, Fd, E)
    return buf[:-1], s_final


class _LogScaledCausalProduct(torch.autograd.Function):
    # Saves its inputs and the per-chunk states (N F E / C floats, about one more feature tensor):
    # the scan over chunks is sequential and costs more to redo than to keep.

    @staticmethod
    def forward(ctx, a: Tensor, kf: Tensor, w: Tensor, m: Tensor, s0: Tensor | None, chunk_size: int):
        with no_autocast(a.device.type):
            ctx.device_type = a.device.type
            B, H, N, Fd = a.shape
            E = w.shape[-1]
            C = min(chunk_size, N)
            nc = -(-N // C)
            n_pad = nc * C - N
            ac, kc, wc = (_chunks(x, n_pad, C) for x in (a, kf, w))  # (B*H*Nc, C, F|F|E)
            # fill positions repeat the last scale: they carry zero rows and must not rescale
            mc = _chunks(m[..., None], n_pad, C, 0.0).view(B * H, nc, C)
            if n_pad:
                mc[:, -1, C - n_pad :] = mc[:, -1, C - n_pad - 1 : C - n_pad]
            intra, enter, leave, carry = _weights(mc)
            s_in, s_final = _chunk_states(kc, wc, leave, carry, s0, B * H)
            scores = torch.bmm(ac, kc.transpose(1, 2)).mul_(intra)  # (B*H*Nc, C, C)
            o = torch.bmm(ac, s_in).mul_(enter).baddbmm_(scores, wc)  # (B*H*Nc, C, E)
            ctx.save_for_backward(ac, kc, wc, mc, s_in)
            ctx.has_s0 = s0 is not None
            ctx.meta = (B, H, N)
            out = o.view(B, H, -1, E)[:, :, :N]
            return out, s_final.view(B, H, Fd, E)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do: Tensor | None, ds_final: Tensor | None):
        with no_autocast(ctx.device_type):
            ac, kc, wc, mc, s_in = ctx.saved_tensors
            B, H, N = ctx.meta
            C, Fd, E = ac.shape[1], ac.shape[2], wc.shape[-1]
            BH, nc = B * H, mc.shape[1]
            intra, enter, leave, carry = _weights(mc)
            if do is None:
                do = ac.new_zeros(B, H, N, E)
            doc = _chunks(do, nc * C - N, C)  # (B*H*Nc, C, E)
            doe = doc * enter  # gradient reaching a_i . S_in, per row
            # g[c] = d loss / d S_in[c] from chunk c's outputs. Running backwards,
            # T[c] = g[c] + carry[c] T[c+1] with T[Nc] = d loss / d s_final is the total gradient of
            # S_in[c], and chunk c's contribution gets T[c+1]: the buffer shifted by one, as in
            # _chunk_states but mirrored.
            buf = ac.new_empty(BH * nc + 1, Fd, E)
            torch.bmm(ac.transpose(1, 2), doe, out=buf[:-1])
            t = buf[:-1].view(BH, nc, Fd, E)
            carry4 = carry.T.contiguous()[..., None, None]  # (Nc, B*H, 1, 1), see _chunk_states
            if ds_final is not None:
                t[:, -1].addcmul_(ds_final.reshape(BH, Fd, E), carry4[-1])
            for c in range(nc - 2, -1, -1):
                t[:, c].addcmul_(t[:, c + 1], carry4[c])
            ds0 = t[:, 0].clone().view(B, H, Fd, E) if ctx.has_s0 else None
            buf[nc :: nc] = 0 if ds_final is None else ds_final.reshape(BH, Fd, E)
            g = buf[1:]  # (B*H*Nc, F, E): d loss / d (chunk c's contribution)
            dscores = torch.bmm(doc, wc.transpose(1, 2)).mul_(intra)  # d loss / d (a k^T), masked
            scores = torch.bmm(ac, kc.transpose(1, 2)).mul_(intra)
            dw = torch.bmm(kc * leave, g).baddbmm_(scores.transpose(1, 2), doc)
            del scores
            dk = torch.bmm(wc, g.transpose(1, 2)).mul_(leave).baddbmm_(dscores.transpose(1, 2), ac)
            del g, buf, t
            da = torch.bmm(dscores, kc).baddbmm_(doe, s_in.transpose(1, 2))

            def unchunk(x: Tensor) -> Tensor:
                return x.view(B, H, -1, x.shape[-1])[:, :, :N]

            return unchunk(da), unchunk(dk), unchunk(dw), None, ds0, None


def causal_product_log_scaled(
    a: Tensor,
    kf: Tensor,
    w: Tensor,
    m: Tensor,
    s0: Tensor | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """``o_i = a_i . (e^{m_0 - m_i} s0 + sum_{j <= i} e^{m_j - m_i} kf_j w_j^T)``, chunked.

    Args:
        a: ``(B, H, N, F)`` query features.
        kf: ``(B, H, N, F)`` key features, already divided by ``e^{m_j}``.
        w: ``(B, H, N, E)`` values.
        m: ``(B, H, N)`` finite, non-decreasing along N: the log-scale of the running state.
            Treated as a constant (no gradient).
        s0: ``(B, H, F, E)`` state before position 0, at scale ``m_0``; None for zeros.
        chunk_size: chunk length (any value gives the same result).

    Returns:
        ``o (B, H, N, E)`` and the final state ``(B, H, F, E)`` at scale ``m_{N-1}``;
        differentiable (once) with respect to a, kf, w and s0.
    """
    fn = "causal_product_log_scaled"
    if a.dim() != 4 or a.shape != kf.shape or w.dim() != 4 or w.shape[:3] != a.shape[:3]:
        raise ValueError(
            f"{fn}: need a, kf (B, H, N, F) and w (B, H, N, E), got {tuple(a.shape)}, "
            f"{tuple(kf.shape)}, {tuple(w.shape)}"
        )
    if tuple(m.shape) != tuple(a.shape[:3]):
        raise ValueError(f"{fn}: m must be (B, H, N) = {tuple(a.shape[:3])}, got {tuple(m.shape)}")
    if a.shape[2] == 0:
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E) zeros, attached to the graph
        s_final = s if s0 is None else s0 + s
        return a @ s_final, s_final
    return _LogScaledCausalProduct.apply(a, kf, w, m.detach(), s0, chunk_size)
