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
blocked scan carries the state, rescaled at every chunk boundary. Exponents are differences of given ``m`` values, never of
cumulative sums, so a jump of thousands in ``m`` costs no precision in later weights. ``m`` is
a stabiliser: it receives no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import no_autocast
from .chunks import ChunkLayout

__all__ = ["causal_product_log_scaled"]


def _chunks(lay: ChunkLayout, x: Tensor) -> Tensor:
    """``(B, H, N, X)`` -> ``(B*H*Nc, C, X)`` on the layout ``lay`` (zero rows fill the last chunk)."""
    return lay.chunked(x.reshape(lay.R, lay.N, x.shape[-1])).flatten(0, 1)


def _weights(mc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Scale factors of one chunked ``m (B*H, Nc, C)``, all <= 1:

    - ``intra (B*H*Nc, C, C)``: ``e^{m_j - m_i}`` for j <= i in a chunk, 0 above the diagonal;
    - ``enter (B*H*Nc, C, 1)``: ``e^{m_start - m_i}`` applied to the state entering the chunk,
      ``m_start`` being the scale of that state (the last ``m`` of the previous chunk);
    - ``leave (B*H*Nc, C, 1)``: ``e^{m_j - m_end}``, a key's weight in the state leaving the chunk;
    - ``start``, ``end (B*H, Nc)``: the scale of the state entering and leaving each chunk.
    """
    BH, nc, C = mc.shape
    start = torch.cat([mc[:, :1, 0], mc[:, :-1, -1]], dim=1)  # (B*H, Nc): scale entering each chunk
    end = mc[:, :, -1]  # (B*H, Nc)
    causal = torch.ones(C, C, dtype=mc.dtype, device=mc.device).tril_()
    # m_j - m_i <= 0 for j <= i (m is non-decreasing); above the diagonal it is >= 0, clamped to 0
    # and then zeroed by the mask, so no factor > 1 ever forms. Not exp(-inf) through torch.where:
    # on CPU, exp of arguments far below its range runs a much slower scalar path.
    intra = torch.exp((mc[..., None, :] - mc[..., :, None]).clamp_(max=0)).mul_(causal).view(-1, C, C)
    enter = torch.exp(start[..., None] - mc).view(-1, C, 1)
    leave = torch.exp(mc - end[..., None]).view(-1, C, 1)
    return intra, enter, leave, start, end


def _scan_(buf: Tensor, lvl: Tensor, lvl_init: Tensor, *, reverse: bool, has_init: bool) -> Tensor:
    """Rescaled prefix sums, in place in ``buf (BH, Nc + 1, X)``, which holds the terms and a seed.

    Forward: ``buf[:, 0]`` is the seed ``init`` and ``buf[:, 1 + c]`` the term ``x[c]``; after,
    ``buf[:, 1 + c] = sum_{c' <= c} e^{lvl[c'] - lvl[c]} x[c'] + e^{lvl_init - lvl[c]} init``, so
    ``buf[:, :Nc]`` is the exclusive scan (the state entering each chunk) and ``buf[:, Nc]`` the
    last sum. Reverse: ``buf[:, c]`` is ``x[c]`` and ``buf[:, Nc]`` the seed; after, ``buf[:, c]``
    sums over ``c' >= c`` instead. ``lvl (BH, Nc)`` is non-decreasing in the direction of the scan
    and ``lvl_init (BH,)`` at most its first value, so every factor is <= 1. ``has_init=False``
    promises a zero seed (its carry is skipped). Returns ``buf``.

    In place because the chunk states are the largest tensors of the causal product after the
    features: every extra pass over them (a fresh output, a cat, a flip) cost FAVOR's
    forward+backward a measurable share of its time.

    Two levels so that it costs about 2 sqrt(Nc) operations rather than Nc tiny ones (which on a
    busy CPU or a GPU cost launch and synchronisation more than arithmetic): running sums inside
    groups of G consecutive chunks, one step for all groups at once; then the sum carried from
    the group before (in scan order) brought into each group with one multiply-add.
    """
    BH, n1, _ = buf.shape
    nc = n1 - 1
    xs = buf[:, :nc] if reverse else buf[:, 1:]  # (BH, Nc, X): the terms, then the sums
    G = max(1, min(nc, round(nc**0.5)))
    full = nc // G * G
    for lo, hi, size in ((0, full, G), (full, nc, nc - full)):  # whole groups, then the rest
        if hi - lo == 0 or size == 1:
            continue
        xg = xs[:, lo:hi].unflatten(1, (-1, size))  # (BH, groups, size, X)
        lg = lvl[:, lo:hi].unflatten(1, (-1, size))  # (BH, groups, size)
        # decay from each entry's neighbour in scan order; (size-1, BH, groups, 1) contiguous, as a
        # strided broadcast operand sends addcmul_ down a far slower path
        step = (lg[..., 1:] - lg[..., :-1]) if reverse else (lg[..., :-1] - lg[..., 1:])
        decay = torch.exp(step).permute(2, 0, 1).contiguous()[..., None]
        order = range(size - 2, -1, -1) if reverse else range(1, size)
        for i in order:
            j = i + 1 if reverse else i - 1
            xg[:, :, i].addcmul_(xg[:, :, j], decay[min(i, j)])
    groups = [(lo, min(lo + G, nc)) for lo in range(0, nc, G)]
    for lo, hi in reversed(groups) if reverse else groups:
        if reverse:  # the slot after the group: its first sum, or the seed
            anchor, anchor_lvl, first = hi, (lvl_init if hi == nc else lvl[:, hi]), hi == nc
        else:  # the slot before it: buf[:, lo] is the sum of chunk lo - 1, or the seed
            anchor, anchor_lvl, first = lo, (lvl_init if lo == 0 else lvl[:, lo - 1]), lo == 0
        if first and not has_init:
            continue
        carry = torch.exp(anchor_lvl[:, None] - lvl[:, lo:hi])[..., None]  # (BH, size, 1)
        xs[:, lo:hi].addcmul_(buf[:, anchor : anchor + 1], carry)
    return buf


def _scanned_products(a: Tensor, b: Tensor, seed: Tensor | None, lvl: Tensor, lvl_init: Tensor, *,
                      reverse: bool) -> Tensor:
    """:func:`_scan_` of the per-chunk products ``bmm(a, b)`` for ``a (BH*Nc, F, C)``,
    ``b (BH*Nc, C, E)``, seeded with ``seed`` (anything of BH*F*E entries; None for zeros): a new
    ``(BH, Nc + 1, F*E)`` laid out as :func:`_scan_` describes. The products go straight into their
    slots when those are one block of memory (BH = 1, the tiled FAVOR path)."""
    BH = lvl.shape[0]
    nc, Fd, E = a.shape[0] // BH, a.shape[1], b.shape[2]
    buf = a.new_empty(BH, nc + 1, Fd * E)
    slot, terms = (buf[:, nc], buf[:, :nc]) if reverse else (buf[:, 0], buf[:, 1:])
    if seed is None:
        slot.zero_()
    else:
        slot.copy_(seed.reshape(BH, Fd * E))
    if terms.is_contiguous():
        torch.bmm(a, b, out=terms.view(BH * nc, Fd, E))
    else:
        terms.copy_(torch.bmm(a, b).view(BH, nc, -1))
    return _scan_(buf, lvl, lvl_init, reverse=reverse, has_init=seed is not None)


def _chunk_states(
    kc: Tensor, wc: Tensor, leave: Tensor, start: Tensor, end: Tensor, s0: Tensor | None, BH: int
) -> tuple[Tensor, Tensor]:
    """The state entering each chunk ``(B*H*Nc, F, E)`` and the final state ``(B*H, F, E)``.

    ``S_out[c] = e^{start[c] - end[c]} S_out[c-1] + kc[c]^T (leave * wc[c])`` with ``S_out[-1] = s0``.
    """
    Fd, E = kc.shape[-1], wc.shape[-1]
    nc = kc.shape[0] // BH
    # s0, then each chunk's leaving state (scale the narrower w)
    buf = _scanned_products(kc.transpose(1, 2), wc * leave, s0, end, start[:, 0], reverse=False)
    s_final = buf[:, nc].reshape(BH, Fd, E).clone()
    return buf[:, :nc].reshape(-1, Fd, E), s_final  # a view when BH = 1


def _layout(a: Tensor, chunk_size: int) -> ChunkLayout:
    """One tile: the whole row (the per-chunk states are one scan over all chunks at once)."""
    B, H, N = a.shape[:3]
    return ChunkLayout.of(B * H, N, chunk_size, chunks_per_tile=-(-N // min(chunk_size, N)))


def _forward(a: Tensor, kf: Tensor, w: Tensor, m: Tensor, s0: Tensor | None,
             chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> ``o (B, H, N, E)``, the final state ``(B, H, F, E)`` and what the backward keeps besides
    the inputs: the chunked scales ``mc (B*H, Nc, C)``, the per-chunk states ``s_in (B*H*Nc, F, E)``
    and the masked chunk scores ``(B*H*Nc, C, C)`` (N F E / C and N C floats: with F in the
    hundreds both cost more to redo than to keep)."""
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    lay = _layout(a, chunk_size)
    C, nc, n_pad = lay.C, lay.Nc, lay.fill
    ac, kc, wc = (_chunks(lay, x) for x in (a, kf, w))  # (B*H*Nc, C, F|F|E)
    # fill positions repeat the last scale: they carry zero rows and must not rescale. A copy (B*H*N
    # floats): kept for the backward, it must not be a view of the input m
    mc = _chunks(lay, m[..., None]).view(B * H, nc, C).clone()
    if n_pad:
        mc[:, -1, C - n_pad:] = mc[:, -1, C - n_pad - 1: C - n_pad]
    intra, enter, leave, start, end = _weights(mc)
    s_in, s_final = _chunk_states(kc, wc, leave, start, end, s0, B * H)
    scores = torch.bmm(ac, kc.transpose(1, 2)).mul_(intra)  # (B*H*Nc, C, C)
    o = torch.bmm(ac, s_in).mul_(enter).baddbmm_(scores, wc)  # (B*H*Nc, C, E)
    out = lay.unchunked(o.view(B * H, nc, C, E)).view(B, H, N, E)
    return out.contiguous(), s_final.view(B, H, Fd, E), mc, s_in.contiguous(), scores


def _backward(a: Tensor, kf: Tensor, w: Tensor, mc: Tensor, s_in: Tensor, scores: Tensor, do: Tensor,
              ds_final: Tensor, has_s0: bool, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`_forward`: ``da, dkf, dw`` shaped as their inputs and ``ds0 (B, H, F, E)``
    (``(0,)`` without ``has_s0``)."""
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    lay = _layout(a, chunk_size)
    C = lay.C
    ac, kc, wc, doc = (_chunks(lay, x) for x in (a, kf, w, do))  # (B*H*Nc, C, F|F|E|E)
    intra, enter, leave, start, end = _weights(mc)
    doe = doc * enter  # gradient reaching a_i . S_in, per row
    # g[c] = d loss / d S_in[c] from chunk c's outputs. The total gradient of S_in[c] is
    # T[c] = sum_{c' >= c} e^{start[c] - start[c']} g[c'] + e^{start[c] - end[-1]} ds_final,
    # the same rescaled scan run backwards (levels -start, read in reverse order); chunk c's
    # contribution gets T[c+1] (T[Nc] = ds_final) and s0 gets T[0].
    t = _scanned_products(ac.transpose(1, 2), doe, ds_final, -start, -end[:, -1], reverse=True)  # T[c], T[Nc]
    ds0 = t[:, 0].reshape(B, H, Fd, E).clone() if has_s0 else a.new_empty(0)
    g = t[:, 1:].reshape(-1, Fd, E)  # d loss / d (chunk c's contribution) = T[c + 1]
    del t
    dscores = torch.bmm(doc, wc.transpose(1, 2)).mul_(intra)  # d loss / d (a k^T), masked
    dw = torch.bmm(kc, g).mul_(leave).baddbmm_(scores.transpose(1, 2), doc)
    dk = torch.bmm(wc, g.transpose(1, 2)).mul_(leave).baddbmm_(dscores.transpose(1, 2), ac)
    del g
    da = torch.bmm(dscores, kc).baddbmm_(doe, s_in.transpose(1, 2))

    def unchunk(x: Tensor) -> Tensor:
        return lay.unchunked(x.view(lay.R, lay.Nc, C, x.shape[-1])).view(B, H, N, x.shape[-1]).contiguous()

    return unchunk(da), unchunk(dk), unchunk(dw), ds0


# The chunked product as a torch.library custom op with its own autograd (as the gated and
# delta-rule engines): torch.compile sees one op per call instead of unrolling the chunk scan.
@torch.library.custom_op("linattn::log_scaled_product", mutates_args=(),
                         schema="(Tensor a, Tensor kf, Tensor w, Tensor m, Tensor? s0, int chunk_size) "
                                "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _log_scaled_product(a, kf, w, m, s0, chunk_size):
    with no_autocast(a.device.type):
        return _forward(a, kf, w, m, s0, chunk_size)


@_log_scaled_product.register_fake
def _(a, kf, w, m, s0, chunk_size):
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    C = min(chunk_size, N)
    nc = -(-N // C)
    return (a.new_empty(B, H, N, E), a.new_empty(B, H, Fd, E), a.new_empty(B * H, nc, C),
            a.new_empty(B * H * nc, Fd, E), a.new_empty(B * H * nc, C, C))


@torch.library.custom_op("linattn::log_scaled_product_backward", mutates_args=(),
                         schema="(Tensor a, Tensor kf, Tensor w, Tensor mc, Tensor s_in, Tensor scores, Tensor do, "
                                "Tensor ds_final, bool has_s0, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor)")
def _log_scaled_product_backward(a, kf, w, mc, s_in, scores, do, ds_final, has_s0, chunk_size):
    with no_autocast(a.device.type):
        return _backward(a, kf, w, mc, s_in, scores, do, ds_final, has_s0, chunk_size)


@_log_scaled_product_backward.register_fake
def _(a, kf, w, mc, s_in, scores, do, ds_final, has_s0, chunk_size):
    B, H, _, Fd = a.shape
    ds0 = a.new_empty(B, H, Fd, w.shape[-1]) if has_s0 else a.new_empty(0)
    return a.new_empty(a.shape), kf.new_empty(kf.shape), w.new_empty(w.shape), ds0


def _setup(ctx, inputs, output):
    a, kf, w, m, s0, chunk_size = inputs
    _, _, mc, s_in, scores = output
    ctx.save_for_backward(a, kf, w, mc, s_in, scores)
    ctx.knobs = (s0 is not None, chunk_size)
    ctx.mark_non_differentiable(mc, s_in, scores)
    # unused outputs' gradients stay None (materialised, the saved tensors' would be zero-filled)
    ctx.set_materialize_grads(False)


def _autograd(ctx, do, ds_final, _dmc, _ds_in, _dscores):
    a, kf, w, mc, s_in, scores = ctx.saved_tensors
    has_s0, _ = ctx.knobs
    B, H, _, Fd = a.shape
    if do is None:
        do = w.new_zeros(w.shape)
    if ds_final is None:
        ds_final = w.new_zeros(B, H, Fd, w.shape[-1])
    da, dk, dw, ds0 = _log_scaled_product_backward(a, kf, w, mc, s_in, scores, do, ds_final, *ctx.knobs)
    return da, dk, dw, None, ds0 if has_s0 else None, None


_log_scaled_product.register_autograd(_autograd, setup_context=_setup)


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
    if a.shape[:3].numel() == 0:  # no position (N = 0) or no row (B*H = 0): no chunk to scan
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E) zeros, attached to the graph
        s_final = s if s0 is None else s0 + s
        return a @ s_final, s_final
    out, s_final, _, _, _ = _log_scaled_product(a, kf, w, m.detach(), s0, chunk_size)
    return out, s_final
