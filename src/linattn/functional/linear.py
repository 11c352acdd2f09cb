"""Kernel ("linear") attention in bidirectional, causal and recurrent form, plus its reference.

Katharopoulos et al. 2020, "Transformers are RNNs" (arXiv 2006.16236): with sim(q, k) = phi(q).phi(k),

    out_i = phi(q_i) S / phi(q_i) z,   S = sum_j phi(k_j) v_j^T (F, Dv),   z = sum_j phi(k_j) (F,)

over all keys (bidirectional, O(N F Dv)) or over j <= i (causal). Causal attention is an RNN whose
state is (S, z); a call with Nq = 1 and a state is one generation step of cost O(F Dv).

Dimension legend: B batch, H heads, N/Nq/Nk positions, D query/key width, Dv value width,
F feature width, E = Dv + 1 (values with a column of ones appended, so one product gives the
numerator S and the normaliser z together; the causal attention keeps that column implicit),
C chunk length, Nc number of chunks, R rows (of the B*H sequences) in a tile.

The causal form is chunked (as in the chunkwise forms of later linear-attention work): inside a chunk
the C x C masked score matrix is formed explicitly, across chunks a running state carries the sum.
It never builds the (N, F, E) prefix-sum tensor the plain cumsum form needs (30+ GB at N = 65536),
and it has its own backward that recomputes the intra-chunk scores instead of storing them. It runs
tile by tile (a few thousand positions at a time, the ``tile_positions`` knob), so that no temporary
is larger than a tile; causal ``linear_attention`` fuses normalisation and an elementwise feature
map into the same pass (the custom op ``linattn::causal_linear_attention``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_positive_int,
    check_qkv,
    check_recurrent_args,
    compute_dtype,
    no_autocast,
    sanitize_padded,
)
from .decayed_state import DecayedState
from .feature_maps import ELEMENTWISE_MAPS, FeatureMap, resolve_feature_map
from .gated import gated_linear_attention
from .normaliser import (
    divide_by_normaliser,
    divide_by_normaliser_,
    guarded_normaliser,
    normalise,
    normaliser_floor,
)
from .varlen import check_cu_seqlens, segment_cumsum, segment_sum, varlen_layout

__all__ = [
    "LinearAttentionState",
    "causal_linear_product",
    "check_linear_state",
    "linear_attention",
    "linear_attention_reference",
]

# The causal forms' two tuning knobs, keyword arguments of linear_attention and
# causal_linear_product (neither changes the result, only time and memory; timings in
# docs/benchmarks/README.md, "History"):
# - chunk_size, the chunk length C. Work is N*C*(F+E) inside chunks plus N*F*E across them, and
#   storage N*C + N*F*E/C, so C near F balances the two; the default 64 is among the fastest for
#   the usual head widths and keeps the causal peak memory lowest.
# - tile_positions, about how many positions one tile holds: groups of whole rows (the B*H
#   independent sequences) when rows are short, else blocks of consecutive chunks of one row, the
#   state carried from block to block (and the state gradient back, in the backward).
#   Why tiles: with glibc's default malloc every temporary of 32 MiB or more is a fresh mmap whose
#   pages fault in on first touch, which at long N costs as much as the arithmetic. Per-tile
#   temporaries (1 MiB at width 64) are recycled by malloc without faults and stay in cache, where
#   the C x C bmm run faster than on whole tensors. Tests pass small values to exercise many tiles
#   at small sizes.


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal kernel attention after some prefix of keys.

    Attributes:
        S: ``(B, H, F, Dv)`` sum of phi(k_j) v_j^T.
        z: ``(B, H, F)`` sum of phi(k_j).

        log_scale: ``(B, H)`` or None. When set, the sums are ``S * exp(log_scale)`` and
            ``z * exp(log_scale)``: kernels with exponential features (FAVOR+, ``favor.py``) keep
            their state divided by a running maximum so that it never overflows. None (the
            ``linear_attention`` case) means a scale of 1.

    All are float32 when the inputs are float16/bfloat16 (the sums must not lose precision),
    otherwise the input dtype.
    """

    S: Tensor
    z: Tensor
    log_scale: Tensor | None = None


# ---------------------------------------------------------------------------------------------
# The causal product o_i = a_i . (s0 + sum_{j<=i} kf_j w_j^T), chunked, with its own backward.
# ---------------------------------------------------------------------------------------------


class _Tiles(NamedTuple):
    """How a causal call is cut up: ``BH`` rows of ``N`` positions, chunks of ``C``, ``per`` rows
    to a group, and blocks of ``L`` positions (a multiple of C; the whole row when per > 1).

    Inputs are viewed as ``(BH, N, X)``; a tile (rows, positions) is handed to the chunk algorithm
    as ``(R*Nc, C, X)``, zero rows appended to fill the last chunk (zero rows contribute nothing to
    any sum; outputs for them are dropped).
    """

    BH: int
    N: int
    C: int
    per: int
    L: int

    @staticmethod
    def of(x: Tensor, chunk_size: int, tile_positions: int) -> "_Tiles":
        B, H, N = x.shape[:3]
        C = min(chunk_size, N)
        n_fill = -(-N // C) * C
        if n_fill <= tile_positions:
            return _Tiles(B * H, N, C, tile_positions // n_fill, N)
        return _Tiles(B * H, N, C, 1, max(C, tile_positions // C * C))

    def row_groups(self) -> list[slice]:
        return [slice(r, min(r + self.per, self.BH)) for r in range(0, self.BH, self.per)]

    def blocks(self) -> list[slice]:
        return [slice(n, min(n + self.L, self.N)) for n in range(0, self.N, self.L)]

    def chunks(self, x: Tensor, pos: slice) -> Tensor:
        """Positions ``pos`` of a group's ``x (R, N, X)`` as ``(R*Nc, C, X)``: a view unless fill
        rows are needed (only ever in a row's last block)."""
        xt = x[:, pos]
        fill = -xt.shape[1] % self.C
        if fill:
            xt = F.pad(xt, (0, 0, 0, fill))
        return xt.reshape(-1, self.C, x.shape[-1])

    def fills(self, pos: slice) -> bool:
        """Whether positions ``pos`` end in a partial chunk (which :meth:`chunks` fills up)."""
        return (pos.stop - pos.start) % self.C != 0

    def target(self, dst: Tensor, pos: slice) -> Tensor | None:
        """Positions ``pos`` of a group's ``dst (R, N, X)`` as a ``(R*Nc, C, X)`` view to compute
        into, or None where there are fill rows (compute elsewhere, then :meth:`put`)."""
        return None if self.fills(pos) else dst[:, pos].view(-1, self.C, dst.shape[-1])

    def put(self, dst: Tensor, pos: slice, src: Tensor) -> None:
        """Write ``src (R*Nc, C, X)`` into positions ``pos`` of a group's ``dst (R, N, X)``."""
        dst[:, pos].copy_(src.view(dst.shape[0], -1, src.shape[-1])[:, : pos.stop - pos.start])


def _new_like(x: Tensor) -> Tensor:
    """An uninitialised contiguous tensor like ``x``. (empty_like would copy the strides of a
    permuted input, and the views this file writes through would then be copies.)"""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rows_view(x: Tensor | None) -> Tensor | None:
    """``(B, H, ..., X, Y)`` -> ``(B*H, ..., X, Y)``, a view whenever the strides allow."""
    return None if x is None else x.reshape(-1, *x.shape[2:])


def _exclusive_chunk_sums(contrib: Tensor, start: Tensor | None) -> tuple[Tensor, Tensor]:
    """``contrib (R, Nc, ...)`` -> ``start + sum_{c' < c} contrib[:, c']`` ``(R, Nc, ...)`` and the
    total ``start + sum_c contrib[:, c]`` ``(R, ...)``; ``start (R, ...)`` or None for zeros.

    The result's rows lie 16 elements further apart than their length: at F = E = 64 a row is 4096
    floats, and with rows exactly 16 KiB apart the scan down dim 1 hits the same cache sets at every
    step and runs many times slower. (Views with that batch stride are fine for bmm.)
    """
    R, nc, rest = contrib.shape[0], contrib.shape[1], contrib.shape[2:]
    m = math.prod(rest)
    out = contrib.new_empty(R, nc, m + 16)[..., :m].view(R, nc, *rest)
    if start is None:
        out[:, 0].zero_()
    else:
        out[:, 0].copy_(start)
    out[:, 1:].copy_(contrib[:, :-1])
    out.cumsum_(1)  # in place: [s0, c0, c1, ...] -> [s0, s0 + c0, s0 + c0 + c1, ...]
    return out, out[:, -1] + contrib[:, -1]


def _reverse_chunk_sums(contrib: Tensor, end: Tensor | None) -> tuple[Tensor, Tensor]:
    """``contrib (R, Nc, ...)`` -> ``end + sum_{c' > c} contrib[:, c']`` ``(R, Nc, ...)`` and the
    total ``end + sum_c contrib[:, c]`` ``(R, ...)``: :func:`_exclusive_chunk_sums` run backwards."""
    rev, total = _exclusive_chunk_sums(contrib.flip(1), end)
    return rev.flip(1), total


class _ChunkInputs(NamedTuple):
    """One tile of ``R`` rows, chunked: ``a, k (R*Nc, C, F)``, ``w (R*Nc, C, E)``, the states
    before it ``s0 (R, F, E)`` and, for the normaliser, ``z0 (R, F)`` (None for zeros)."""

    a: Tensor
    k: Tensor
    w: Tensor
    s0: Tensor | None
    z0: Tensor | None
    R: int

    def states(self) -> tuple[Tensor, Tensor]:
        """States before each chunk, ``s0 + sum_{c' < c} k[c']^T w[c']`` ``(R*Nc, F, E)``, and the
        final state ``(R, F, E)``."""
        Fd, E = self.a.shape[-1], self.w.shape[-1]
        s_excl, s_final = _exclusive_chunk_sums(
            torch.bmm(self.k.transpose(1, 2), self.w).view(self.R, -1, Fd, E), self.s0
        )
        return s_excl.view(-1, Fd, E), s_final

    def z_states(self) -> tuple[Tensor, Tensor]:
        """The same for the normaliser, ``w = 1``: ``(R*Nc, F)`` and ``(R, F)``."""
        z_excl, z_final = _exclusive_chunk_sums(self.k.sum(1).view(self.R, -1, self.a.shape[-1]), self.z0)
        return z_excl.view(-1, self.a.shape[-1]), z_final

    def scores(self) -> Tensor:
        """``(R*Nc, C, C)`` intra-chunk scores a_i . k_j for j <= i, zero above the diagonal."""
        return torch.bmm(self.a, self.k.transpose(1, 2)).tril_()


def _rows_forward(x: _ChunkInputs, with_den: bool, out: Tensor | None = None):
    """Forward of one tile: ``o (R*Nc, C, E)``, final state ``(R, F, E)``, and with ``with_den``
    the normaliser ``d = a_i . (z0 + sum_{j <= i} k_j)`` ``(R*Nc, C)``, its final state ``(R, F)``
    and its floor ``(R*Nc, C)`` (:func:`normaliser_floor`, from the normaliser state each position
    sees). The normaliser is the product with an implicit ones column, kept out of the bmm: a
    width of 65 instead of 64 makes them markedly slower. ``out``: where to write o, or None."""
    s_excl, s_final = x.states()
    scores = x.scores()
    o = torch.bmm(x.a, s_excl, out=out).baddbmm_(scores, x.w)  # inter-chunk + intra-chunk
    if not with_den:
        return o, s_final, None, None, None
    z_excl, z_final = x.z_states()
    d = torch.bmm(x.a, z_excl.unsqueeze(-1)).squeeze(-1).add_(scores.sum(-1))
    z_seen = x.k.cumsum(1).add_(z_excl.unsqueeze(1))  # (R*Nc, C, F): z_i at every position
    return o, s_final, d, z_final, normaliser_floor(x.a, z_seen).squeeze(-1)


def _rows_backward(x: _ChunkInputs, do: Tensor, dd: Tensor | None, ds_final: Tensor | None,
                   dz_final: Tensor | None, need: tuple[bool, bool, bool, bool],
                   outs: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None)):
    """Backward of one tile, given ``do (R*Nc, C, E)`` and, for the normaliser, ``dd (R*Nc, C)``:
    ``da, dk (R*Nc, C, F)``, ``dw (R*Nc, C, E)``, ``ds0 (R, F, E)`` and ``dz0 (R, F)``, None where
    ``need`` (for a, k, w, initial state) says not needed. ``outs``: where to write da, dk, dw
    (views of the final gradients), or None for new tensors.

    Only the inputs are kept from the forward: the C x C scores and the per-chunk states are
    rebuilt here (two extra bmm), which keeps the saved memory at the inputs alone.
    """
    need_a, need_k, need_w, need_s0 = need
    R, Fd, E = x.R, x.a.shape[-1], x.w.shape[-1]
    da = dk = dw = ds0 = dz0 = g = gz = dscores = None
    if need_k or need_w or need_s0:
        # g[c] = d loss / d (k[c]^T w[c]): that contribution sits in the state of every later
        # chunk and in the final state. Start from d loss / d s_excl[c] = a^T do.
        g, ds0 = _reverse_chunk_sums(torch.bmm(x.a.transpose(1, 2), do).view(R, -1, Fd, E), ds_final)
        g = g.view(-1, Fd, E)
        if dd is not None:  # the same for the ones column: a^T dd
            gz = torch.bmm(x.a.transpose(1, 2), dd.unsqueeze(-1)).view(R, -1, Fd)
            gz, dz0 = _reverse_chunk_sums(gz, dz_final)
            gz = gz.view(-1, 1, Fd)
    if need_a or need_k:
        dscores = torch.bmm(do, x.w.transpose(1, 2))  # (R*Nc, C, C)
        if dd is not None:  # d_i = sum_j scores_ij + ...
            dscores.add_(dd.unsqueeze(-1))
        dscores.tril_()
    if need_k:
        dk = torch.bmm(x.w, g.transpose(1, 2), out=outs[1]).baddbmm_(dscores.transpose(1, 2), x.a)
        if gz is not None:  # + 1 gz^T
            dk.add_(gz)
    if need_w:
        dw = torch.bmm(x.k, g, out=outs[2]).baddbmm_(x.scores().transpose(1, 2), do)
    if need_a:
        s_excl, _ = x.states()
        da = torch.bmm(dscores, x.k, out=outs[0]).baddbmm_(do, s_excl.transpose(1, 2))
        if dd is not None:  # + dd z_excl^T
            z_excl, _ = x.z_states()
            da.addcmul_(dd.unsqueeze(-1), z_excl.unsqueeze(1))
    return da, dk, dw, ds0, dz0


def _product_forward(a: Tensor, kf: Tensor, w: Tensor, s0: Tensor | None, chunk_size: int,
                     tile_positions: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`causal_linear_product`, tile by tile: ``o (B, H, N, E)``, ``s_final (B, H, F, E)`` and the
    states before every block but a row's first, stacked ``(n, 1, F, E)`` (``(0,)`` when every row is
    one block)."""
    lay = _Tiles.of(a, chunk_size, tile_positions)
    a3, k3, w3, s03 = (_rows_view(t) for t in (a, kf, w, s0))
    o = w.new_empty(w.shape)
    s_final = w.new_empty(*a.shape[:2], a.shape[-1], w.shape[-1])
    o3, sf3 = _rows_view(o), _rows_view(s_final)
    starts = []
    for rows in lay.row_groups():
        s = None if s03 is None else s03[rows]
        for i, pos in enumerate(lay.blocks()):
            if i:
                starts.append(s)
            x = _ChunkInputs(*(lay.chunks(t[rows], pos) for t in (a3, k3, w3)), s, None, rows.stop - rows.start)
            into = lay.target(o3[rows], pos)
            og, s, _, _, _ = _rows_forward(x, with_den=False, out=into)
            if into is None:
                lay.put(o3[rows], pos, og)
        sf3[rows] = s
    return o, s_final, torch.stack(starts) if starts else a.new_empty(0)


def _product_backward(a, kf, w, s0, starts, do, ds_final, need, chunk_size, tile_positions):
    """Gradients of :func:`_product_forward` for ``a, kf, w, s0`` (``(0,)`` where ``need`` says none)."""
    lay = _Tiles.of(a, chunk_size, tile_positions)
    a3, k3, w3, s03, do3, dsf3 = (_rows_view(t) for t in (a, kf, w, s0, do, ds_final))
    grads = [_new_like(t) if n else None for t, n in zip((a, kf, w, s0), need)]
    grads3 = [_rows_view(g) for g in grads]
    starts = iter(reversed([starts[i] for i in range(starts.shape[0])] if starts.numel() else []))
    blocks = lay.blocks()
    for rows in reversed(lay.row_groups()):
        ds = dsf3[rows]  # gradient of the state after the block
        for i in reversed(range(len(blocks))):
            pos = blocks[i]
            s = next(starts) if i else (None if s03 is None else s03[rows])
            x = _ChunkInputs(*(lay.chunks(t[rows], pos) for t in (a3, k3, w3)), s, None, rows.stop - rows.start)
            doc = lay.chunks(do3[rows], pos)
            outs = tuple(None if g3 is None else lay.target(g3[rows], pos) for g3 in grads3[:3])
            *parts, ds, _ = _rows_backward(x, doc, None, ds, None, need, outs)
            for g3, part, into in zip(grads3[:3], parts, outs):
                if g3 is not None and into is None:
                    lay.put(g3[rows], pos, part)
        if grads3[3] is not None:
            grads3[3][rows] = ds
    return tuple(a.new_empty(0) if g is None else g for g in grads)


# A torch.library custom op with its own autograd, as every chunked engine here: torch.compile sees
# one op per call. Saves the inputs and the states between blocks.
@torch.library.custom_op("linattn::causal_linear_product", mutates_args=(),
                         schema="(Tensor a, Tensor kf, Tensor w, Tensor? s0, int chunk_size, int tile_positions) "
                                "-> (Tensor, Tensor, Tensor)")
def _causal_linear_product(a, kf, w, s0, chunk_size, tile_positions):
    # Autocast would run these bmm in half precision and accumulate the state there; the caller
    # already chose the compute dtype (float32 for half inputs).
    with no_autocast(a.device.type):
        return _product_forward(a, kf, w, s0, chunk_size, tile_positions)


@_causal_linear_product.register_fake
def _(a, kf, w, s0, chunk_size, tile_positions):
    B, H, _, Fd = a.shape
    E = w.shape[-1]
    lay = _Tiles.of(a, chunk_size, tile_positions)
    n_starts = (len(lay.blocks()) - 1) * B * H if lay.per == 1 else 0
    starts = a.new_empty(n_starts, 1, Fd, E) if n_starts else a.new_empty(0)
    return w.new_empty(w.shape), a.new_empty(B, H, Fd, E), starts


@torch.library.custom_op("linattn::causal_linear_product_backward", mutates_args=(),
                         schema="(Tensor a, Tensor kf, Tensor w, Tensor? s0, Tensor starts, Tensor do, "
                                "Tensor ds_final, bool[] need, int chunk_size, int tile_positions) "
                                "-> (Tensor, Tensor, Tensor, Tensor)")
def _causal_linear_product_backward(a, kf, w, s0, starts, do, ds_final, need, chunk_size, tile_positions):
    with no_autocast(a.device.type):
        return _product_backward(a, kf, w, s0, starts, do, ds_final, tuple(need), chunk_size, tile_positions)


@_causal_linear_product_backward.register_fake
def _(a, kf, w, s0, starts, do, ds_final, need, chunk_size, tile_positions):
    return tuple(t.new_empty(t.shape) if t is not None and n else a.new_empty(0)
                 for t, n in zip((a, kf, w, s0), need))


def _product_setup(ctx, inputs, output):
    a, kf, w, s0, chunk_size, tile_positions = inputs
    ctx.save_for_backward(a, kf, w, s0, output[2])
    ctx.knobs = (chunk_size, tile_positions)
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)


def _product_autograd(ctx, do, ds_final, _dstarts):
    a, kf, w, s0, starts = ctx.saved_tensors
    need = list(ctx.needs_input_grad[:3]) + [bool(ctx.needs_input_grad[3] and s0 is not None)]
    if do is None:
        do = torch.zeros_like(w)
    if ds_final is None:
        ds_final = w.new_zeros(*a.shape[:2], a.shape[-1], w.shape[-1])
    grads = _causal_linear_product_backward(a, kf, w, s0, starts, do, ds_final, need, *ctx.knobs)
    return (*(g if n else None for g, n in zip(grads, need)), None, None)


_causal_linear_product.register_autograd(_product_autograd, setup_context=_product_setup)


# Normalised causal kernel attention ``(q, k, v, s0) -> (out, s_final)`` with ``out_i = n_i / d_i``,
# ``[n_i, d_i] = phi(q_i) . (s0 + sum_{j<=i} phi(k_j) [v_j, 1]^T)``: the causal product fused with
# the normalisation and, for an elementwise feature map ``phi`` (a
# :class:`~linattn.functional.feature_maps.ElementwiseMap`, named in ``ELEMENTWISE_MAPS``), with the
# map too. ``[v, 1]`` and the normaliser only ever exist one tile at a time, and outputs and
# gradients are written straight into their final tensors. With ``phi`` "" q and k are already
# features. Shapes: q, k ``(B, H, N, D)``, v ``(B, H, N, Dv)``, s0 and s_final ``(B, H, F, Dv+1)``
# (numerator state and normaliser state side by side, as :func:`linear_attention` keeps them). The
# normaliser is guarded as in :func:`~linattn.functional.normaliser.normalise`.
#
# Features under a fused phi, when a gradient will be needed (``keep``): the forward writes phi(q)
# and phi(k) into two tensors that the backward then overwrites, tile by tile, with the gradients
# of q and k (a tile's features are read only by that tile). Storing them costs no more memory than
# the gradients themselves, and no page faults beyond theirs (a fresh 32 MiB tensor faults in every
# page at first touch), while recomputing phi (an exp) would cost a visible share of the call. A
# second backward through the same graph (retain_graph) finds them consumed and recomputes.
#
# A torch.library custom op with its own autograd, as every chunked engine here: torch.compile sees
# one op per call. The backward op mutates the kept features (declared) and the autograd function
# returns them as the gradients of q and k.


def _attention_forward(q: Tensor, k: Tensor, v: Tensor, s0: Tensor | None, chunk_size: int, tile_positions: int,
                       phi_name: str, keep: bool):
    """-> ``out``, ``s_final``, the guarded normaliser's inverse ``inv (B, H, N, 1)``, where it was
    used ``active`` (bool, same shape), the kept features (two ``(B, H, N, D)``, or ``(0,)`` each)
    and the states before every block but a row's first, stacked: ``(n, 1, F, Dv)`` and ``(n, 1, F)``
    (``(0,)`` each when every row is one block)."""
    phi = ELEMENTWISE_MAPS[phi_name] if phi_name else None
    lay = _Tiles.of(q, chunk_size, tile_positions)
    dv = v.shape[-1]
    q3, k3, v3, s03 = (_rows_view(t) for t in (q, k, v, s0))
    out = v.new_empty(v.shape)
    inv = v.new_empty(*v.shape[:-1], 1)  # 1 / guarded normaliser, (B, H, N, 1)
    # where the normaliser itself was used (not its floor): the gradient reaches it there
    active = torch.empty(inv.shape, dtype=torch.bool, device=inv.device)
    out3, inv3, active3 = _rows_view(out), _rows_view(inv), _rows_view(active)
    keep = keep and phi is not None
    feats = (_new_like(q), _new_like(k)) if keep else None
    feats3 = None if feats is None else [_rows_view(f) for f in feats]
    s_finals = []
    starts_s, starts_z = [], []  # the states (S, z) before every block but a row's first
    for rows in lay.row_groups():
        s0g = None if s03 is None else s03[rows]
        s, z = (None, None) if s0g is None else (s0g[..., :dv], s0g[..., dv])
        for i, pos in enumerate(lay.blocks()):
            if i:
                starts_s.append(s)
                starts_z.append(z)
            x = _attention_inputs(lay, pos, q3[rows], k3[rows], v3[rows], s, z, phi,
                                  None if feats3 is None else [f[rows] for f in feats3])
            og, s, d, z, floor = _rows_forward(x, with_den=True)
            d, act = guarded_normaliser(d, floor)
            inv_g = d.reciprocal_().unsqueeze(-1)
            lay.put(inv3[rows], pos, inv_g)
            lay.put(active3[rows], pos, act.unsqueeze(-1))
            into = lay.target(out3[rows], pos)
            if into is None:
                lay.put(out3[rows], pos, og.mul_(inv_g))
            else:
                torch.mul(og, inv_g, out=into)
        s_finals.append(torch.cat([s, z.unsqueeze(-1)], dim=-1))
    s_final = torch.cat(s_finals).view(*q.shape[:2], -1, dv + 1)
    def none() -> Tensor:  # a new one each time: a custom op's outputs may not alias each other
        return q.new_empty(0)

    fq, fk = feats if feats is not None else (none(), none())
    ss = torch.stack(starts_s) if starts_s else none()
    sz = torch.stack(starts_z) if starts_z else none()
    return out, s_final, inv, active, fq, fk, ss, sz


def _attention_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, need, chunk_size,
                        tile_positions, phi_name):
    """Gradients of :func:`_attention_forward` (``need``: for q, k, v, s0); the kept features ``fq, fk``
    (unless ``(0,)``) are overwritten with the gradients of q and k, which then come back as ``(0,)``."""
    phi = ELEMENTWISE_MAPS[phi_name] if phi_name else None
    feats = (fq, fk) if fq.numel() else None
    lay = _Tiles.of(q, chunk_size, tile_positions)
    dv = v.shape[-1]
    q3, k3, v3, s03, out3, inv3, active3, dout3, dsf3 = (
        _rows_view(t) for t in (q, k, v, s0, out, inv, active, dout, ds_final)
    )
    grads = [_new_like(t) if n else None for t, n in zip((q, k, v, s0), need)]
    feats3 = None if feats is None else [_rows_view(f) for f in feats]
    if feats is not None:  # the features' tensors become the gradients of q and k
        grads[:2] = [f if n else None for f, n in zip(feats, need)]
    grads3 = [_rows_view(g) for g in grads]
    starts = iter(reversed([(ss[i], sz[i]) for i in range(ss.shape[0])] if ss.numel() else []))
    blocks = lay.blocks()
    for rows in reversed(lay.row_groups()):
        # gradients of the states after the block, carried back from block to block
        dsf = dsf3[rows]
        ds, dz = dsf[..., :dv], dsf[..., dv]
        for i in reversed(range(len(blocks))):
            pos = blocks[i]
            if i:
                s, z = next(starts)
            else:
                s0g = None if s03 is None else s03[rows]
                s, z = (None, None) if s0g is None else (s0g[..., :dv], s0g[..., dv])
            if feats is None:
                x = _attention_inputs(lay, pos, q3[rows], k3[rows], v3[rows], s, z, phi)
            else:
                x = _ChunkInputs(*(lay.chunks(t[rows], pos) for t in (*feats3, v3)), s, z,
                                 rows.stop - rows.start)
            # out = n / d: d out / d n = 1 / d and d out_e / d d = -out_e / d
            g, o_g, inv_g, act = (lay.chunks(t[rows], pos) for t in (dout3, out3, inv3, active3))
            do = g * inv_g
            # ... and 0 where the floor stood in for d
            dd = torch.linalg.vecdot(g, o_g, dim=-1).mul_(inv_g.squeeze(-1)).neg_().mul_(act.squeeze(-1))
            # gradients straight into their final tensors where no fill rows are in the
            # way: dw always; da, dk when q, k are features (else phi' comes first)
            outs = [None if g3 is None else lay.target(g3[rows], pos) for g3 in grads3[:3]]
            if phi is not None:
                outs[:2] = None, None
            da, dk, dw, ds, dz = _rows_backward(x, do, dd, ds, dz, need, tuple(outs))
            if phi is not None:  # through the feature map: d phi(x) / dx from phi(x) itself,
                # in place of phi(x), which is the saved feature itself unless there is fill
                da = None if da is None else phi.backward_(x.a, da)
                dk = None if dk is None else phi.backward_(x.k, dk)
                if feats is not None and not lay.fills(pos):
                    outs[:2] = da, dk
            for g3, part, into in zip(grads3[:3], (da, dk, dw), outs):
                if g3 is not None and into is None:
                    lay.put(g3[rows], pos, part)
        if grads3[3] is not None:
            grads3[3][rows] = torch.cat([ds, dz.unsqueeze(-1)], dim=-1)
    if feats is not None:
        grads[:2] = [None, None]  # they are the features' tensors, returned by the autograd function
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@torch.library.custom_op("linattn::causal_linear_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? s0, int chunk_size, int tile_positions, "
                                "str phi, bool keep) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
                                "Tensor)")
def _causal_linear_attention(q, k, v, s0, chunk_size, tile_positions, phi, keep):
    with no_autocast(q.device.type):
        return _attention_forward(q, k, v, s0, chunk_size, tile_positions, phi, keep)


@_causal_linear_attention.register_fake
def _(q, k, v, s0, chunk_size, tile_positions, phi, keep):
    B, H, N, _ = q.shape
    dv = v.shape[-1]
    Fd = q.shape[-1]
    lay = _Tiles.of(q, chunk_size, tile_positions)
    n_starts = (len(lay.blocks()) - 1) * B * H if lay.per == 1 else 0
    kept = keep and bool(phi)
    fq = q.new_empty(q.shape) if kept else q.new_empty(0)
    fk = k.new_empty(k.shape) if kept else q.new_empty(0)
    ss = q.new_empty(n_starts, 1, Fd, dv) if n_starts else q.new_empty(0)
    sz = q.new_empty(n_starts, 1, Fd) if n_starts else q.new_empty(0)
    return (v.new_empty(v.shape), q.new_empty(B, H, Fd, dv + 1), v.new_empty(B, H, N, 1),
            torch.empty(B, H, N, 1, dtype=torch.bool, device=q.device), fq, fk, ss, sz)


@torch.library.custom_op("linattn::causal_linear_attention_backward", mutates_args=("fq", "fk"),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? s0, Tensor out, Tensor inv, Tensor active, "
                                "Tensor(a!) fq, Tensor(b!) fk, Tensor ss, Tensor sz, Tensor dout, Tensor ds_final, "
                                "bool[] need, int chunk_size, int tile_positions, str phi) "
                                "-> (Tensor, Tensor, Tensor, Tensor)")
def _causal_linear_attention_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, need,
                                      chunk_size, tile_positions, phi):
    with no_autocast(q.device.type):
        return _attention_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, tuple(need),
                                   chunk_size, tile_positions, phi)


@_causal_linear_attention_backward.register_fake
def _(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, need, chunk_size, tile_positions, phi):
    kept = fq.numel() > 0
    dq = q.new_empty(q.shape) if need[0] and not kept else q.new_empty(0)
    dk = k.new_empty(k.shape) if need[1] and not kept else q.new_empty(0)
    dv = v.new_empty(v.shape) if need[2] else q.new_empty(0)
    ds0 = s0.new_empty(s0.shape) if s0 is not None and need[3] else q.new_empty(0)
    return dq, dk, dv, ds0


def _attention_setup(ctx, inputs, output):
    q, k, v, s0, chunk_size, tile_positions, phi, keep = inputs
    out, s_final, inv, active, fq, fk, ss, sz = output
    ctx.save_for_backward(q, k, v, s0, out, inv, active, ss, sz)
    ctx.knobs = (chunk_size, tile_positions, phi)
    # on ctx, not saved: the backward overwrites them in place (saved tensors would refuse a second
    # backward for that), and forgets them after the first
    ctx.feats = (fq, fk) if fq.numel() else None
    ctx.mark_non_differentiable(inv, active, fq, fk, ss, sz)
    ctx.set_materialize_grads(False)


def _attention_autograd(ctx, dout, ds_final, *_):
    q, k, v, s0, out, inv, active, ss, sz = ctx.saved_tensors
    fq, fk = ctx.feats if ctx.feats is not None else (q.new_empty(0), q.new_empty(0))
    ctx.feats = None  # overwritten below: a second backward (retain_graph) recomputes them
    need = list(ctx.needs_input_grad[:3]) + [bool(ctx.needs_input_grad[3] and s0 is not None)]
    if dout is None:
        dout = torch.zeros_like(out)
    if ds_final is None:
        ds_final = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1] + 1)  # (B, H, F, Dv + 1); F = D here
    grads = list(_causal_linear_attention_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final,
                                                   need, *ctx.knobs))
    if fq.numel():  # the kept features now hold the gradients of q and k
        grads[:2] = fq, fk
    return (*(g if n else None for g, n in zip(grads, need)), None, None, None, None)


_causal_linear_attention.register_autograd(_attention_autograd, setup_context=_attention_setup)


def _attention_inputs(lay: _Tiles, pos: slice, q: Tensor, k: Tensor, v: Tensor,
                      s: Tensor | None, z: Tensor | None, phi,
                      feats: list[Tensor] | None = None) -> _ChunkInputs:
    """One tile's chunked features and values from a group's ``q, k (R, N, D)``, ``v (R, N, Dv)``
    (phi applied before the fill rows are added: phi(0) need not be 0), with the states before it.
    ``feats``: the group's ``(R, N, F)`` tensors to write phi(q), phi(k) into, or None."""
    q, k = q[:, pos], k[:, pos]
    if phi is not None:
        q, k = (phi.forward(t, _new_like(t) if feats is None else f[:, pos])
                for t, f in zip((q, k), feats or (None, None)))
    full = slice(0, pos.stop - pos.start)
    return _ChunkInputs(lay.chunks(q, full), lay.chunks(k, full), lay.chunks(v, pos), s, z, q.shape[0])


def causal_linear_product(
    a: Tensor,
    kf: Tensor,
    w: Tensor,
    s0: Tensor | None = None,
    *,
    chunk_size: int = 64,
    tile_positions: int = 4096,
) -> tuple[Tensor, Tensor]:
    """Causal prefix product ``o_i = a_i . (s0 + sum_{j <= i} kf_j w_j^T)`` in O(N) memory.

    The shared engine of every causal kernel attention (linear, FAVOR, ...). No normalisation:
    callers append a ones column to ``w`` to get the normaliser in the same pass.

    Args:
        a: ``(B, H, N, F)`` query features.
        kf: ``(B, H, N, F)`` key features.
        w: ``(B, H, N, E)`` values.
        s0: ``(B, H, F, E)`` state carried in from earlier positions, or None for zeros.
        chunk_size: chunk length C of the algorithm (any C >= 1 gives the same result; 64 is
            among the fastest for the usual widths, see the comment at the top of this file).
        tile_positions: about how many positions the algorithm works on at a time (>= 1; any
            value gives the same result, smaller tiles keep temporaries small).

    Returns:
        ``o (B, H, N, E)`` and the final state ``(B, H, F, E)``. Both are differentiable with
        respect to a, kf, w and s0 (once; no double backward).
    """
    fn = "causal_linear_product"
    check_positive_int(fn, "chunk_size", chunk_size)
    check_positive_int(fn, "tile_positions", tile_positions)
    if a.dim() != 4 or a.shape != kf.shape:
        raise ValueError(f"{fn}: a and kf must both be (B, H, N, F), got a {tuple(a.shape)} and kf {tuple(kf.shape)}")
    if w.dim() != 4 or w.shape[:3] != a.shape[:3]:
        raise ValueError(f"{fn}: w must be (B, H, N, E) with the B, H, N of a {tuple(a.shape)}, got {tuple(w.shape)}")
    if not (a.dtype == kf.dtype == w.dtype):
        raise TypeError(f"{fn}: a, kf and w must share one dtype, got {a.dtype}, {kf.dtype}, {w.dtype}")
    B, H, _, Fd = a.shape
    if s0 is not None and (tuple(s0.shape) != (B, H, Fd, w.shape[-1]) or s0.dtype != a.dtype):
        raise ValueError(
            f"{fn}: s0 must be (B, H, F, E) = {(B, H, Fd, w.shape[-1])} of dtype {a.dtype}, "
            f"got {tuple(s0.shape)} {s0.dtype}"
        )
    if a.shape[2] == 0:
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E) zeros, attached to the graph
        s_final = s if s0 is None else s0 + s
        return a @ s_final, s_final
    o, s_final, _ = _causal_linear_product(a, kf, w, s0, chunk_size, tile_positions)
    return o, s_final


# ---------------------------------------------------------------------------------------------
# linear_attention
# ---------------------------------------------------------------------------------------------


def _features(
    fn: str,
    feature_map: Union[str, FeatureMap],
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None,
    dt: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """phi(q) ``(B,H,Nq,F)`` and phi(k) ``(B,H,Nk,F)`` in dtype ``dt``, padded keys' features zeroed."""
    phi = resolve_feature_map(fn, feature_map)
    qf = phi(q.to(dt))
    kf = phi(sanitize_padded(k, key_padding_mask).to(dt))
    for name, x, f in (("q", q, qf), ("k", k, kf)):
        if not isinstance(f, Tensor) or f.dim() != 4 or f.shape[:3] != x.shape[:3]:
            got = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
            raise ValueError(
                f"{fn}: feature_map must map {name} {tuple(x.shape)} to (B, H, N, F) with the same "
                f"B, H, N; got {got}"
            )
    if qf.shape[-1] != kf.shape[-1]:
        raise ValueError(
            f"{fn}: feature_map gave different widths F for q {tuple(qf.shape)} and k {tuple(kf.shape)}"
        )
    if qf.dtype != dt or kf.dtype != dt:
        qf, kf = qf.to(dt), kf.to(dt)
    # phi(0) need not be 0 (elu + 1 gives 1): remove padded keys from the sums explicitly.
    kf = sanitize_padded(kf, key_padding_mask)
    return qf, kf


def check_linear_state(
    fn: str, state, B: int, H: int, Fd: int, Dv: int, device, *, scaled: bool = False
) -> None:
    """Validate a resumed :class:`LinearAttentionState` for inputs of batch B, H heads, feature
    width Fd and value width Dv on ``device``; ``scaled``: the mechanism keeps a log_scale (FAVOR+),
    else it must be None. Raises TypeError or ValueError naming the field and the shapes."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"{fn}: initial_state must be a LinearAttentionState (as returned with return_state=True), "
            f"got {type(state).__name__}"
        )
    checks = [("S", state.S, (B, H, Fd, Dv)), ("z", state.z, (B, H, Fd))]
    if state.log_scale is not None:
        if not scaled:
            raise ValueError(
                f"{fn}: initial_state.log_scale is set (a state of favor_attention?); this mechanism's "
                "states have log_scale None"
            )
        checks.append(("log_scale", state.log_scale, (B, H)))
    for name, t, shape in checks:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{fn}: initial_state.{name} must be a floating-point tensor")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{fn}: initial_state.{name} must have shape {shape} for these inputs "
                f"(B, H, F, Dv) = {(B, H, Fd, Dv)}, got {tuple(t.shape)}"
            )
        if t.device != device:
            raise ValueError(f"{fn}: initial_state.{name} is on {t.device}, inputs on {device}")


def _state_from(s: Tensor, dv: int) -> LinearAttentionState:
    return LinearAttentionState(S=s[..., :dv], z=s[..., dv])


def _decoding_step(fn, q, k, v, feature_map, state, return_state, dt):
    """One position from ``state``: S += phi(k)^T v, z += phi(k), o = phi(q) S / phi(q) z.

    At decoding sizes every operation costs more in overhead than in arithmetic, so this counts
    operations: S and z stay apart (joining [S, z] and [v, 1] each step was a third of them), a
    named map computes phi(q) and phi(k) in one call (every named map acts on the last dimension
    alone), and the normaliser guard divides in place
    (:func:`~linattn.functional.normaliser.divide_by_normaliser_`). (Timings of these choices:
    docs/benchmarks/README.md, "History".)
    """
    if isinstance(feature_map, str):
        f = resolve_feature_map(fn, feature_map)(torch.stack([q, k]).to(dt))  # (2, B, H, 1, F)
        qf, kf = f[0], f[1]
    else:
        qf, kf = _features(fn, feature_map, q, k, None, dt)
    B, H, _, Fd = qf.shape
    check_linear_state(fn, state, B, H, Fd, v.shape[-1], q.device)
    S = torch.addcmul(state.S.to(dt), kf.transpose(-1, -2), v.to(dt))  # (B, H, F, Dv)
    z = state.z.to(dt) + kf[:, :, 0]  # (B, H, F)
    floor = normaliser_floor(qf, z[:, :, None])  # (B, H, 1, 1)
    out = divide_by_normaliser_(qf @ S, qf @ z[..., None], floor).to(q.dtype)
    return (out, LinearAttentionState(S=S, z=z)) if return_state else out


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int = 64,
    tile_positions: int | None = None,
    cu_seqlens: Tensor | None = None,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Kernel attention ``out_i = phi(q_i) S / phi(q_i) z`` (Katharopoulos et al., arXiv 2006.16236).

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        feature_map: ``"elu"`` (elu+1), ``"relu"``, ``"cos"`` ([1, x/||x||], sim = 1 + cos),
            ``"softmax"`` (over features) or a callable ``(..., D) -> (..., F)`` with non-negative
            output.
        causal: sums over keys j <= i only (needs Nq == Nk). Chunked, O(N) memory.
        key_padding_mask: bool ``(B, Nk)``, True = a real key that may be attended, False = padding.
            Padded keys leave numerator and normaliser alike; their content (even NaN) never reaches
            an output or a real input's gradient.
        initial_state: causal only: the state after an earlier prefix, to resume from.
        return_state: causal only: also return the state after the last key.
        chunk_size: causal only, a tuning knob: the chunk length C of the chunked algorithm (as
            in :func:`causal_linear_product`). Any C >= 1 gives the same result; a call of at most
            C positions is one chunk, computed directly.
        tile_positions: causal only, a tuning knob: about how many positions the chunked
            algorithm works on at a time (as in :func:`causal_linear_product`); any value >= 1
            gives the same result. None: 4096. Refused with ``cu_seqlens``, whose engine does not
            read it.
        cu_seqlens: causal only (ValueError with ``causal=False``). None, or int64 ``(n + 1,)``
            offsets ``[0, c_1, ..., T]`` of n documents packed along N (non-decreasing; empty
            documents allowed), flash-attention's varlen convention. Then B must be 1 (inputs
            ``(1, H, T, *)``), no key is seen across a document boundary, and ``initial_state``
            and the returned state hold one state per document, ``S (n, H, F, Dv)``,
            ``z (n, H, F)``: the result equals one call per document (outputs, gradients,
            states). The numerator runs on :func:`~linattn.functional.gated.gated_linear_attention`'s
            engine (zero decays, a reset at each document's start; ``chunk_size`` is its chunk
            length; ``tile_positions`` is refused: that engine has no such knob), the normaliser is a per-document running sum
            of the key features (``linattn.functional.varlen``), guarded as in every other form.
            The isolation holds for finite inputs; a NaN or inf can cross into the documents that
            share its chunk (and, through the normaliser's running sums, later ones): see
            ``linattn.functional.varlen``.

    Returns:
        ``(B, H, Nq, Dv)`` in the input dtype, and with ``return_state`` a
        :class:`LinearAttentionState`. Sums are accumulated in float32 for half inputs. A query
        with no key of positive similarity gets zeros.
    """
    fn = "linear_attention"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    check_recurrent_args(fn, causal, initial_state, return_state)
    check_positive_int(fn, "chunk_size", chunk_size)
    if tile_positions is not None:
        check_positive_int(fn, "tile_positions", tile_positions)
    if cu_seqlens is not None:
        if tile_positions is not None:  # an option is refused, never accepted and ignored
            raise ValueError(f"{fn}: tile_positions is not used with cu_seqlens: packed documents run on "
                             "gated_linear_attention's engine, whose only knob is chunk_size")
        if not causal:
            raise ValueError(f"{fn}: cu_seqlens (packed documents) needs causal=True: the bidirectional form has "
                             "no packed variant")
        with no_autocast(q.device.type):
            return _linear_varlen(fn, q, k, v, feature_map, key_padding_mask, initial_state, return_state,
                                  chunk_size, cu_seqlens)
    with no_autocast(q.device.type):
        return _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state,
                                 chunk_size, 4096 if tile_positions is None else tile_positions)


def _linear_attention(fn, q, k, v, feature_map, causal, key_padding_mask, initial_state, return_state,
                      chunk_size, tile_positions):
    dt = compute_dtype(q.dtype)
    dv = v.shape[-1]
    if initial_state is not None and q.shape[2] == 1 and key_padding_mask is None:
        return _decoding_step(fn, q, k, v, feature_map, initial_state, return_state, dt)
    # Causal sequences longer than one chunk go to the tiled Function, which computes an
    # elementwise phi itself. One chunk or less (a generation step, a short prompt) is that
    # algorithm's intra-chunk product alone, written out below: there the tiled machinery's
    # hundred small ops would cost more than the arithmetic. So are inputs without a row
    # (B*H = 0), which have no tile to assemble a result from and cost nothing in any form.
    tiled = causal and q.shape[2] > chunk_size and q.shape[0] * q.shape[1] > 0
    fusable = isinstance(feature_map, str) and feature_map in ELEMENTWISE_MAPS and key_padding_mask is None
    if tiled and fusable:
        phi, qf, kf = ELEMENTWISE_MAPS[feature_map], q.to(dt), k.to(dt)
    else:
        phi, (qf, kf) = None, _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    if not causal:
        w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, Nk, E): [v, 1]
        s = kf.transpose(-1, -2) @ w  # (B, H, F, E)
        return normalise(qf @ s, dv, q.dtype, normaliser_floor(qf, s[..., dv].unsqueeze(-2)))
    s0 = None
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        check_linear_state(fn, initial_state, B, H, Fd, dv, q.device)
        s0 = torch.cat([initial_state.S.to(dt), initial_state.z.to(dt)[..., None]], dim=-1)
    if tiled:
        # the features are kept for the backward only when a gradient will be taken, and not under
        # torch.compile: they live on the autograd context (the backward overwrites them), which a
        # compiled backward graph does not take as an input
        keep = (not torch.compiler.is_compiling() and torch.is_grad_enabled()
                and any(t is not None and t.requires_grad for t in (qf, kf, v, s0)))
        name = "" if phi is None else feature_map
        out, s_final, *_ = _causal_linear_attention(qf, kf, v, s0, chunk_size, tile_positions, name, keep)
        out = out.to(q.dtype)
    else:  # o = tril(phi(q) phi(k)^T) [v, 1] + phi(q) s0, N <= C (N = 0 included)
        w = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        o = (qf @ kf.transpose(-1, -2)).tril_() @ w
        s_final = kf.transpose(-1, -2) @ w
        z_seen = kf.detach().cumsum(2)  # (B, H, N, F): the normaliser state at each position
        if s0 is not None:
            o, s_final = o + qf @ s0, s_final + s0
            z_seen = z_seen + s0[..., dv].detach().unsqueeze(-2)
        out = normalise(o, dv, q.dtype, normaliser_floor(qf, z_seen))
    if return_state:
        return out, _state_from(s_final, dv)
    return out


def _linear_varlen(fn, q, k, v, feature_map, key_padding_mask, initial_state, return_state, chunk_size,
                   cu_seqlens):
    """Causal kernel attention of packed documents (``cu_seqlens``): ``q, k (1, H, T, D)``,
    ``v (1, H, T, Dv)`` -> ``(1, H, T, Dv)`` and, with ``return_state``, per-document states.

    The numerator ``phi(q_i) . S_i`` is gated_linear_attention's packed product with zero decays
    (value width Dv as given: a ones column for the normaliser would make the width Dv + 1, which
    slows the products); the normaliser ``phi(q_i) . z_i`` and the guard's ``z_i`` come from one
    per-document running sum of phi(k) (:func:`~linattn.functional.varlen.segment_cumsum`), a few
    elementwise passes; the division is :func:`~linattn.functional.normaliser.divide_by_normaliser`,
    the guard of every other form.
    """
    cu = check_cu_seqlens(fn, cu_seqlens, q)
    dt = compute_dtype(q.dtype)
    dv = v.shape[-1]
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)  # (1, H, T, F)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    n, H, Fd = cu.shape[0] - 1, qf.shape[1], qf.shape[-1]
    S0 = z0 = None
    if initial_state is not None:
        check_linear_state(fn, initial_state, n, H, Fd, dv, q.device)
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
    res = gated_linear_attention(qf, kf, v, qf.new_zeros(qf.shape[:3]), scale=1.0, cu_seqlens=cu,
                                 initial_state=None if S0 is None else DecayedState(S0),
                                 return_state=return_state, chunk_size=chunk_size)
    num, S = res if return_state else (res, None)
    lay = varlen_layout(cu, q.shape[2], Fd, write_states=False, read_states=False)
    z_seen = segment_cumsum(kf, lay, initial=z0)  # (1, H, T, F): the normaliser state each query sees
    den = torch.linalg.vecdot(qf, z_seen).unsqueeze(-1)  # (1, H, T, 1)
    out = divide_by_normaliser(num, den, normaliser_floor(qf, z_seen)).to(q.dtype)
    if return_state:
        return out, LinearAttentionState(S=S.s, z=segment_sum(kf, lay, initial=z0))
    return out


def linear_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: Union[str, FeatureMap] = "elu",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Plain O(Nq*Nk) kernel attention from the formula: an explicit similarity matrix
    ``phi(q) phi(k)^T``, masked, each row normalised. Same contract as :func:`linear_attention`;
    tests trust this one, in float64."""
    fn = "linear_attention_reference"
    check_qkv(fn, q, k, v, causal=causal)
    check_key_padding_mask(fn, key_padding_mask, k)
    check_recurrent_args(fn, causal, initial_state, return_state)
    dt = compute_dtype(q.dtype)
    qf, kf = _features(fn, feature_map, q, k, key_padding_mask, dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    seen = torch.ones(q.shape[2], k.shape[2], dtype=dt, device=q.device)  # (Nq, Nk): key j visible to query i
    if causal:
        seen = seen.tril()
    sim = (qf @ kf.transpose(-1, -2)) * seen  # (B, H, Nq, Nk)
    num = sim @ v  # (B, H, Nq, Dv)
    den = sim.sum(-1, keepdim=True)  # (B, H, Nq, 1)
    z_seen = seen @ kf  # (B, H, Nq, F): the normaliser state each query sees
    S = kf.transpose(-1, -2) @ v  # (B, H, F, Dv)
    z = kf.sum(-2)  # (B, H, F)
    if initial_state is not None:
        B, H, _, Fd = qf.shape
        check_linear_state(fn, initial_state, B, H, Fd, v.shape[-1], q.device)
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
        num = num + qf @ S0
        den = den + (qf @ z0[..., None])
        z_seen = z_seen + z0[:, :, None]
        S, z = S + S0, z + z0
    # the normaliser's magnitude is raised to its floor as in the fast forms (normaliser_floor)
    floor = normaliser_floor(qf, z_seen)
    den = torch.where(den.abs() >= floor, den, floor.copysign(den))
    out = (num / torch.where(den.abs() >= torch.finfo(dt).tiny, den, torch.ones_like(den))).to(q.dtype)
    if return_state:
        return out, LinearAttentionState(S=S, z=z)
    return out
