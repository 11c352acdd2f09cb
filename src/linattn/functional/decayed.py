"""The decayed engine: every chunked causal product of the form

    S_t = diag(exp g_t) S_{t-1} + k_t v_t^T        (S_{-1} = s0, or zeros)
    o_t = scale * S_t^T q_t

with a gate ``g`` of width none (linear attention, Hedgehog, FAVOR's relu kernel: ``g = 0``), one
per head (RetNet, Mamba-2 / simple GLA; FAVOR+'s running rescale ``g_t = m_{t-1} - m_t``) or one
per key channel (GLA). :func:`decayed_product` is its one entry; ``gated_linear_attention``,
``linear_attention``, ``causal_linear_product`` and ``favor_attention`` call it, and packed
documents reach it as resets (``varlen.py``: a gate of -inf at each document's start). Everything
runs on one chunk layout (``chunks.py``) with one representation of cumulative log decays
(``log_decays.py``), as a ``torch.library`` custom op per specialisation, each with its backward.

The gate's width picks a specialisation inside the engine, not a route through the general path
(routed through the log-decay path, the no-gate and running-scale products measured slower:
docs/design/one_engine.md, and every run of ``linattn bench gated``):

- **no gate**: chunk states are prefix sums of per-chunk products (one cumsum, no recurrence and
  no decay tensors), tiles are rows or blocks of one row so that every batched product reads its
  inputs and writes its outputs in place, and linear attention's normaliser is an implicit ones
  column (a width of Dv + 1 makes the products markedly slower) with an elementwise feature map
  fused into the same pass;
- **per head, as a running log scale** ``m`` (non-decreasing): the weights ``e^{m_j - m_i}`` are
  differences of given values, never of cumulative sums, so a jump of thousands in ``m`` costs no
  digit, and the chunk states are one rescaled scan;
- **per head or per key channel, as log decays**: chunk-local cumulative log decays, the
  recurrence across chunks for all rows at once (``recurrence.py``), and for a per-channel gate
  the GLA paper's sub-chunks.

Each specialisation runs either strategy of ``strategy.py`` (the ``strategy`` keyword of the
functional forms): on a CPU, tiles in cache and a sequential recurrence; on an accelerator, one
tile of the whole input, the recurrence as a log-depth scan and, for half inputs, the forward's
products on half operands. The ops take their knobs as one
:class:`~linattn.functional.strategy.EngineOptions` value.

Dimension legend: B batch, H heads, N positions, D (or F) query/key (feature) width, Dv value
width, E a value width (Dv, or Dv + 1 with a ones column), R rows (the B*H independent sequences),
C chunk length, Nc chunks, m chunks of one tile, c sub-chunk length, n = C / c sub-chunks per
chunk, G gate width (1 for a per-head gate, D for a per-channel one).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import EngineOp, once_differentiable
from .chunks import ChunkLayout, cumsum_in_chunks
from .feature_maps import ELEMENTWISE_MAPS
from .log_decays import RESET_LOG_DECAY, CumulativeLogDecay, flush_low
from .normaliser import guarded_normaliser, normaliser_floor
from .recurrence import chunk_recurrence, prefix_sums, prefix_sums_
from .strategy import EngineOptions, mixed_bmm, operand_dtype, resolve_strategy, split_bmm

__all__ = ["CHUNK_SIZES", "ChannelDecays", "channel_decays", "channel_scores", "channel_scores_backward", "decayed_product",
           "sub_chunk_length"]

# Default chunk length per kind of gate, each the fastest measured (docs/benchmarks/README.md,
# History): no gate and per head 64, per key channel 32 (sub-chunks, below).
CHUNK_SIZES = {"none": 64, "scale": 64, "head": 64, "channel": 32}


# =============================================================================================
# No gate: o_i = q_i . (s0 + sum_{j<=i} k_j v_j^T), optionally normalised.
# =============================================================================================

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



def _new_like(x: Tensor) -> Tensor:
    """An uninitialised contiguous tensor like ``x``. (empty_like would copy the strides of a
    permuted input, and the views this file writes through would then be copies.)"""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rows_view(x: Tensor | None) -> Tensor | None:
    """``(B, H, ..., X, Y)`` -> ``(B*H, ..., X, Y)``, a view whenever the strides allow."""
    return None if x is None else x.reshape(-1, *x.shape[2:])


def _exclusive_chunk_sums(contributions, shape: tuple[int, ...], start: Tensor | None, strategy: str,
                          like: Tensor) -> tuple[Tensor, Tensor]:
    """The sums before each chunk, ``start + sum_{c' < c} contrib[:, c']`` ``(R, Nc, ...)``, and the
    total ``start + sum_c contrib[:, c]`` ``(R, ...)``, of the contributions ``contrib (R, Nc, ...)``
    (``shape``) that ``contributions(out)`` writes as ``(R*Nc, ...)`` into ``out``, or with ``out``
    None returns; ``start (R, ...)`` or None for zeros; dtype and device of ``like``.

    One buffer of ``R*Nc + 1`` slots holds them, a spare slot first: the contributions go into
    slots 1.. and are summed along each row's chunks in place, so that slot ``r*Nc + c`` holds the
    sum before chunk c of row r, but for c = 0, where the previous row's total sits: the totals are
    taken out, then ``start`` written there. No shifted copy of the contributions. ``start`` is
    added to each row's first contribution before the sums.

    The CPU strategy's slots are 16 elements longer than their contents: at F = E = 64 a slot is
    4096 floats, and with slots exactly 16 KiB apart the sums down a row hit the same cache sets at
    every step and run many times slower. The contributions are then made contiguous and copied in
    (a product into slots that far apart takes a CPU's slower per-matrix path). The accelerator's
    slots are end to end, the product is written straight into them, and the sums run over a
    contiguous tensor: CUDA's and XPU's cumsum take contiguous tensors only, and would copy a
    strided one in and its result back out.
    """
    R, nc, *rest = shape
    m = math.prod(rest)
    pad = 16 if strategy == "cpu" else 0
    buf = like.new_empty(R * nc + 1, m + pad)[:, :m]
    slots = buf[1:]
    if pad:
        slots.copy_(contributions(None).reshape(R * nc, m))
    else:
        contributions(slots.view(R * nc, *rest))
    rows = slots.view(R, nc, m)
    if start is not None:
        rows[:, 0] += start.reshape(R, m)
    prefix_sums_(rows, 1)
    total = rows[:, -1].clone()  # before the slots of each next row's c = 0 are written
    before = buf[:R * nc].view(R, nc, m)
    if start is None:
        before[:, 0].zero_()
    else:
        before[:, 0].copy_(start.reshape(R, m))
    return before.view(R, nc, *rest), total.view(R, *rest)


def _reverse_chunk_sums(contrib: Tensor, end: Tensor | None, strategy: str) -> tuple[Tensor, Tensor]:
    """``contrib (R, Nc, ...)`` -> ``end + sum_{c' > c} contrib[:, c']`` ``(R, Nc, ...)`` and the
    total ``end + sum_c contrib[:, c]`` ``(R, ...)``: :func:`_exclusive_chunk_sums` of the chunks in
    reverse order (gathered straight into its slots on the accelerator), reversed back."""
    nc = contrib.shape[1]
    backwards = torch.arange(nc - 1, -1, -1, device=contrib.device)
    rev, total = _exclusive_chunk_sums(
        lambda out: torch.index_select(contrib, 1, backwards, out=None if out is None else out.view(contrib.shape)),
        contrib.shape, end, strategy, contrib)
    return rev.flip(1), total


class _ChunkInputs(NamedTuple):
    """One tile of ``R`` rows, chunked: ``a, k (R*Nc, C, F)``, ``w (R*Nc, C, E)``, the states
    before it ``s0 (R, F, E)`` and, for the normaliser, ``z0 (R, F)`` (None for zeros); the
    engine's ``strategy`` (the layout of the sums across chunks: :func:`_exclusive_chunk_sums`)."""

    a: Tensor
    k: Tensor
    w: Tensor
    s0: Tensor | None
    z0: Tensor | None
    R: int
    strategy: str

    @property
    def nc(self) -> int:
        """Nc, the chunks of each row."""
        return self.a.shape[0] // self.R

    def states(self, operand: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """States before each chunk, ``s0 + sum_{c' < c} k[c']^T w[c']`` ``(R*Nc, F, E)``, and the
        final state ``(R, F, E)`` (``operand``: the products' operand dtype, None: as they are)."""
        Fd, E = self.a.shape[-1], self.w.shape[-1]
        s_excl, s_final = _exclusive_chunk_sums(
            lambda out: mixed_bmm(self.k.transpose(1, 2), self.w, operand, out=out),
            (self.R, self.nc, Fd, E), self.s0, self.strategy, self.a)
        return s_excl.view(-1, Fd, E), s_final

    def z_states(self) -> tuple[Tensor, Tensor]:
        """The same for the normaliser, ``w = 1``: ``(R*Nc, F)`` and ``(R, F)``."""
        Fd = self.a.shape[-1]
        z_excl, z_final = _exclusive_chunk_sums(lambda out: torch.sum(self.k, 1, out=out),
                                                (self.R, self.nc, Fd), self.z0, self.strategy, self.a)
        return z_excl.view(-1, Fd), z_final

    def scores(self, operand: torch.dtype | None = None) -> Tensor:
        """``(R*Nc, C, C)`` intra-chunk scores a_i . k_j for j <= i, zero above the diagonal."""
        return mixed_bmm(self.a, self.k.transpose(1, 2), operand).tril_()


def _rows_forward(x: _ChunkInputs, with_den: bool, out: Tensor | None = None, operand: torch.dtype | None = None,
                  nonnegative: bool = False):
    """Forward of one tile: ``o (R*Nc, C, E)``, final state ``(R, F, E)``, and with ``with_den``
    the normaliser ``d = a_i . (z0 + sum_{j <= i} k_j)`` ``(R*Nc, C)``, its final state ``(R, F)``
    and its floor ``(R*Nc, C)`` (:func:`normaliser_floor`, from the normaliser state each position
    sees; ``nonnegative``: the features and states are, as an elementwise map's from no given state
    are). The normaliser is the product with an implicit ones column, kept out of the bmm: a width
    of 65 instead of 64 makes them markedly slower. ``out``: where to write o, or None; ``operand``:
    the four products' operand dtype (None: as they are; the normaliser's stay in the compute
    dtype)."""
    s_excl, s_final = x.states(operand)
    scores = x.scores(operand)
    if operand is None:
        o = torch.bmm(x.a, s_excl, out=out).baddbmm_(scores, x.w)  # inter-chunk + intra-chunk
    else:  # the state in two half parts (strategy.split_bmm): its rounding cost the bf16 output the most
        o = split_bmm(x.a, s_excl, operand, out=out).add_(mixed_bmm(scores, x.w, operand))
    if not with_den:
        return o, s_final, None, None, None
    z_excl, z_final = x.z_states()
    d = torch.bmm(x.a, z_excl.unsqueeze(-1)).squeeze(-1).add_(scores.sum(-1))
    z_seen = prefix_sums(x.k, 1).add_(z_excl.unsqueeze(1))  # (R*Nc, C, F): z_i at every position
    return o, s_final, d, z_final, normaliser_floor(x.a, z_seen, nonnegative=nonnegative).squeeze(-1)


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
        g, ds0 = _reverse_chunk_sums(torch.bmm(x.a.transpose(1, 2), do).view(R, -1, Fd, E), ds_final, x.strategy)
        g = g.view(-1, Fd, E)
        if dd is not None:  # the same for the ones column: a^T dd
            gz = torch.bmm(x.a.transpose(1, 2), dd.unsqueeze(-1)).view(R, -1, Fd)
            gz, dz0 = _reverse_chunk_sums(gz, dz_final, x.strategy)
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

def _block_inputs(lay: ChunkLayout, chunks: slice, q: Tensor, k: Tensor, v: Tensor, s: Tensor | None,
                  z: Tensor | None, phi, strategy: str, feats: list[Tensor] | None = None) -> _ChunkInputs:
    """One row tile's chunked features and values from a row group's ``q, k (r, N, D)``,
    ``v (r, N, Dv)`` (phi applied before the fill: phi(0) need not be 0), with the states before it.
    ``feats``: the group's ``(r, N, F)`` tensors to write phi(q), phi(k) into, or None."""
    if phi is not None:
        pos = lay.positions(chunks)
        q, k = (phi.forward(t[:, pos], _new_like(t[:, pos]) if f is None else f[:, pos])
                for t, f in zip((q, k), feats or (None, None)))
        qc, kc = lay.as_block(q, chunks), lay.as_block(k, chunks)
    else:
        qc, kc = lay.block(q, chunks), lay.block(k, chunks)
    return _ChunkInputs(qc, kc, lay.block(v, chunks), s, z, q.shape[0], strategy)


def _split_state(s: Tensor | None, normalise: bool, dv: int) -> tuple[Tensor | None, Tensor | None]:
    """A row group's state ``(r, F, Dv + normalise)`` -> the numerator's and the normaliser's."""
    if s is None or not normalise:
        return s, None
    return s[..., :dv], s[..., dv]


def _ungated_forward(q: Tensor, k: Tensor, v: Tensor, s0: Tensor | None, normalise: bool, phi_name: str, keep: bool,
                     options: str):
    """The product without a gate, row tile by row tile: ``o_i = q_i . (s0 + sum_{j<=i} k_j v_j^T)``,
    or with ``normalise`` ``out_i = n_i / d_i`` where ``[n_i, d_i] = phi(q_i) . (s0 + sum_{j<=i}
    phi(k_j) [v_j, 1]^T)`` (``phi``: an elementwise feature map's name, or "" when q and k are
    features already). Returns ``out (B, H, N, Dv)``, ``s_final (B, H, F, Dv + normalise)``, the
    guarded normaliser's inverse ``inv (B, H, N, 1)`` and where it was used ``active`` (bool), the
    kept features (two ``(B, H, N, F)`` when ``keep`` and ``phi``), and the states before every
    block of a row but its first, stacked, numerator ``(n, 1, F, Dv)`` and normaliser ``(n, 1, F)``.
    What does not apply is ``(0,)`` (each a new tensor: a custom op's outputs may not alias).
    ``options``: an encoded :class:`~linattn.functional.strategy.EngineOptions`."""
    phi = ELEMENTWISE_MAPS[phi_name] if phi_name else None
    opts = EngineOptions.decode(options)
    lay = _ungated_layout(q, opts)
    dv = v.shape[-1]
    q3, k3, v3, s03 = (_rows_view(t) for t in (q, k, v, s0))
    out = v.new_empty(v.shape)
    out3 = _rows_view(out)
    if normalise:
        inv = v.new_empty(*v.shape[:-1], 1)  # 1 / guarded normaliser, (B, H, N, 1)
        # where the normaliser itself was used (not its floor): the gradient reaches it there
        active = torch.empty(inv.shape, dtype=torch.bool, device=inv.device)
        inv3, active3 = _rows_view(inv), _rows_view(active)
    keep = keep and phi is not None
    feats = (_new_like(q), _new_like(k)) if keep else None
    feats3 = None if feats is None else [_rows_view(f) for f in feats]
    s_finals, starts_s, starts_z = [], [], []
    # an elementwise map's features are non-negative, and so are their sums unless a given state is not
    nonnegative = phi is not None and s0 is None
    for rows in lay.row_groups():
        s, z = _split_state(None if s03 is None else s03[rows], normalise, dv)
        for i, chunks in enumerate(lay.blocks()):
            if i:
                starts_s.append(s)
                if normalise:
                    starts_z.append(z)
            x = _block_inputs(lay, chunks, q3[rows], k3[rows], v3[rows], s, z, phi, opts.strategy,
                              None if feats3 is None else [f[rows] for f in feats3])
            into = lay.target(out3[rows], chunks)
            og, s, d, z, floor = _rows_forward(x, with_den=normalise, out=None if normalise else into,
                                               operand=opts.operand, nonnegative=nonnegative)
            if normalise:
                d, act = guarded_normaliser(d, floor)
                inv_g = d.reciprocal_().unsqueeze(-1)
                lay.put_block(inv3[rows], chunks, inv_g)
                lay.put_block(active3[rows], chunks, act.unsqueeze(-1))
                og = og.mul_(inv_g) if into is None else torch.mul(og, inv_g, out=into)
            if into is None:
                lay.put_block(out3[rows], chunks, og)
        s_finals.append(torch.cat([s, z.unsqueeze(-1)], dim=-1) if normalise else s)
    s_final = torch.cat(s_finals).view(*q.shape[:2], q.shape[-1], -1)

    def none() -> Tensor:
        return q.new_empty(0)

    if not normalise:
        inv, active = none(), none()
    fq, fk = feats if feats is not None else (none(), none())
    ss = torch.stack(starts_s) if starts_s else none()
    sz = torch.stack(starts_z) if starts_z else none()
    return out, s_final, inv, active, fq, fk, ss, sz


def _ungated_layout(q: Tensor, opts: EngineOptions) -> ChunkLayout:
    """The row tiles of ``q (B, H, N, F)``: of about ``opts.per_tile`` positions on the CPU strategy,
    one tile of every row and chunk on the accelerator's (the chunk states are then one cumsum)."""
    R, N, C = q.shape[0] * q.shape[1], q.shape[2], opts.chunk_size
    per_tile = opts.per_tile
    if opts.strategy == "accelerator":
        per_tile = max(per_tile, R * -(-N // min(C, N)) * min(C, N))
    return ChunkLayout.by_rows(R, N, C, per_tile)


def _ungated_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, need, normalise, phi_name,
                      options):
    """Gradients of :func:`_ungated_forward` (``need``: for q, k, v, s0; ``(0,)`` where not needed);
    the kept features ``fq, fk`` (unless ``(0,)``) are overwritten with the gradients of q and k,
    which then come back as ``(0,)``."""
    phi = ELEMENTWISE_MAPS[phi_name] if phi_name else None
    feats = (fq, fk) if fq.numel() else None
    opts = EngineOptions.decode(options)
    lay = _ungated_layout(q, opts)
    dv = v.shape[-1]
    q3, k3, v3, s03, out3, inv3, active3, dout3, dsf3 = (
        _rows_view(t) for t in (q, k, v, s0, out, inv, active, dout, ds_final)
    )
    grads = [_new_like(t) if n else None for t, n in zip((q, k, v, s0), need)]
    feats3 = None if feats is None else [_rows_view(f) for f in feats]
    if feats is not None:  # the features' tensors become the gradients of q and k
        grads[:2] = [f if n else None for f, n in zip(feats, need)]
    grads3 = [_rows_view(g) for g in grads]
    n_starts = ss.shape[0] if ss.numel() else 0
    starts = iter(reversed([(ss[i], sz[i] if normalise else None) for i in range(n_starts)]))
    blocks = lay.blocks()
    for rows in reversed(lay.row_groups()):
        # gradients of the states after the block, carried back from block to block
        ds, dz = _split_state(dsf3[rows], normalise, dv)
        for i in reversed(range(len(blocks))):
            chunks = blocks[i]
            if i:
                s, z = next(starts)
            else:
                s, z = _split_state(None if s03 is None else s03[rows], normalise, dv)
            if feats is None:
                x = _block_inputs(lay, chunks, q3[rows], k3[rows], v3[rows], s, z, phi, opts.strategy)
            else:
                x = _ChunkInputs(*(lay.block(t[rows], chunks) for t in (*feats3, v3)), s, z,
                                 rows.stop - rows.start, opts.strategy)
            g = lay.block(dout3[rows], chunks)
            dd = None
            if normalise:
                # out = n / d: d out / d n = 1 / d and d out_e / d d = -out_e / d ...
                o_g, inv_g, act = (lay.block(t[rows], chunks) for t in (out3, inv3, active3))
                # ... and 0 where the floor stood in for d
                dd = torch.linalg.vecdot(g, o_g, dim=-1).mul_(inv_g.squeeze(-1)).neg_().mul_(act.squeeze(-1))
                g = g * inv_g
            # gradients straight into their final tensors where no fill is in the way: dw always;
            # da, dk when q, k are features (else phi' comes first)
            outs = [None if g3 is None else lay.target(g3[rows], chunks) for g3 in grads3[:3]]
            if phi is not None:
                outs[:2] = None, None
            da, dk, dw, ds, dz = _rows_backward(x, g, dd, ds, dz, need, tuple(outs))
            if phi is not None:  # through the feature map: d phi(x) / dx from phi(x) itself,
                # in place of phi(x), which is the saved feature itself unless there is fill
                da = None if da is None else phi.backward_(x.a, da)
                dk = None if dk is None else phi.backward_(x.k, dk)
                if feats is not None and not lay.fills(chunks):
                    outs[:2] = da, dk
            for g3, part, into in zip(grads3[:3], (da, dk, dw), outs):
                if g3 is not None and into is None:
                    lay.put_block(g3[rows], chunks, part)
        if grads3[3] is not None:
            grads3[3][rows] = torch.cat([ds, dz.unsqueeze(-1)], dim=-1) if normalise else ds
    if feats is not None:
        grads[:2] = [None, None]  # they are the features' tensors, returned by the autograd function
    return tuple(q.new_empty(0) if g is None else g for g in grads)


# The specialisation as a torch.library custom op with its own autograd. Features under a fused
# phi, when a gradient will be needed (``keep``): the forward writes phi(q) and phi(k) into two
# tensors that the backward then overwrites, tile by tile, with the gradients of q and k (a tile's
# features are read only by that tile). Storing them costs no more memory than the gradients
# themselves, and no page faults beyond theirs (a fresh 32 MiB tensor faults in every page at
# first touch), while recomputing phi (an exp) would cost a visible share of the call. A second
# backward through the same graph (retain_graph) finds them consumed and recomputes. The backward
# op mutates the kept features (declared) and the autograd function returns them as the gradients
# of q and k. Under torch.compile no features are kept (they live on the autograd context, which
# a compiled backward does not take as an input): the backward recomputes phi.
_ungated_chunked = EngineOp(
    "linattn::ungated_chunked",
    "(Tensor q, Tensor k, Tensor v, Tensor? s0, bool normalise, str phi, bool keep, str options) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _ungated_forward)


@_ungated_chunked.register_fake
def _(q, k, v, s0, normalise, phi, keep, options):
    B, H, N, Fd = q.shape
    dv = v.shape[-1]
    n_starts = _ungated_layout(q, EngineOptions.decode(options)).block_starts()
    kept = keep and bool(phi)

    def maybe(cond: bool, *shape: int) -> Tensor:
        return q.new_empty(*shape) if cond else q.new_empty(0)

    return (v.new_empty(v.shape), q.new_empty(B, H, Fd, dv + normalise), maybe(normalise, B, H, N, 1),
            torch.empty((B, H, N, 1) if normalise else (0,), dtype=torch.bool, device=q.device),
            maybe(kept, *q.shape), maybe(kept, *k.shape), maybe(n_starts > 0, n_starts, 1, Fd, dv),
            maybe(n_starts > 0 and normalise, n_starts, 1, Fd))


_ungated_chunked_backward = EngineOp(
    "linattn::ungated_chunked_backward",
    "(Tensor q, Tensor k, Tensor v, Tensor? s0, Tensor out, Tensor inv, Tensor active, "
    "Tensor(a!) fq, Tensor(b!) fk, Tensor ss, Tensor sz, Tensor dout, Tensor ds_final, "
    "bool[] need, bool normalise, str phi, str options) -> (Tensor, Tensor, Tensor, Tensor)",
    _ungated_backward, backward=True)


@_ungated_chunked_backward.register_fake
def _(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final, need, normalise, phi, options):
    kept = fq.numel() > 0
    dq = q.new_empty(q.shape) if need[0] and not kept else q.new_empty(0)
    dk = k.new_empty(k.shape) if need[1] and not kept else q.new_empty(0)
    dv = v.new_empty(v.shape) if need[2] else q.new_empty(0)
    ds0 = s0.new_empty(s0.shape) if s0 is not None and need[3] else q.new_empty(0)
    return dq, dk, dv, ds0


def _ungated_setup(ctx, inputs, output):
    q, k, v, s0, normalise, phi, keep, options = inputs
    out, s_final, inv, active, fq, fk, ss, sz = output
    ctx.save_for_backward(q, k, v, s0, out, inv, active, ss, sz)
    ctx.knobs = (normalise, phi, options)
    # on ctx, not saved: the backward overwrites them in place (saved tensors would refuse a second
    # backward for that), and forgets them after the first
    ctx.feats = (fq, fk) if fq.numel() else None
    ctx.mark_non_differentiable(inv, active, fq, fk, ss, sz)
    # unused outputs' gradients stay None: materialised, they would be zero-filled every backward
    ctx.set_materialize_grads(False)


def _ungated_autograd(ctx, dout, ds_final, *_):
    q, k, v, s0, out, inv, active, ss, sz = ctx.saved_tensors
    fq, fk = ctx.feats if ctx.feats is not None else (q.new_empty(0), q.new_empty(0))
    ctx.feats = None  # overwritten below: a second backward (retain_graph) recomputes them
    need = list(ctx.needs_input_grad[:3]) + [bool(ctx.needs_input_grad[3] and s0 is not None)]
    if dout is None:
        dout = torch.zeros_like(out)
    if ds_final is None:
        ds_final = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1] + ctx.knobs[0])  # (B, H, F, Dv [+ 1])
    grads = list(_ungated_chunked_backward(q, k, v, s0, out, inv, active, fq, fk, ss, sz, dout, ds_final,
                                           need, *ctx.knobs))
    if fq.numel():  # the kept features now hold the gradients of q and k
        grads[:2] = fq, fk
    grads = once_differentiable("linattn::ungated_chunked", tuple(g if n else None for g, n in zip(grads, need)),
                                (q, k, v, s0, dout, ds_final))
    return (*grads, None, None, None, None)


_ungated_chunked.register_autograd(_ungated_autograd, setup_context=_ungated_setup)


# =============================================================================================
# Per head or per key channel, as log decays.
# =============================================================================================

# ---------------------------------------------------------------------------------------------
# The chunked causal form.
#
# Within a chunk, with b_t = log_decay_1 + ... + log_decay_t (cumulative from the chunk's start,
# <= 0 and non-increasing) and S_0 the state before the chunk:
#
#     o_t   = (q_t * exp(b_t))^T S_0 + sum_{s <= t} A_ts v_s,   A_ts = sum_d q_td k_sd exp(b_td - b_sd)
#     S_end = exp(b_C) * S_0 + sum_s (k_s * exp(b_C - b_s)) v_s^T
#
# Every exponent above is <= 0 once the entries with s > t are clamped to 0 before the exp (and
# zeroed after it): no exp(+large) anywhere, so huge decays give exact zeros rather than inf * 0 =
# NaN. b is held in the compute dtype as small decays plus a count of resets (log decays below
# -40, -inf included: log_decays.py), so its differences keep their digits without float64. Across
# chunks, S_end = exp(b_C) * S_0 + U is a loop over chunks (never over positions) of one addcmul.
#
# A per-head gate (G = 1) makes exp(b_t - b_s) one number per (t, s): A is (q k^T) * exp(masked
# differences), a C x C matrix. A per-channel gate (G = D) cannot be factored as exp(b_t) exp(-b_s)
# (exp(-b_s) overflows once the chunk has decayed by more than ~88 in float32), and the explicit
# (C, C, D) tensor of differences costs C*D exps per position. So the chunk is cut into sub-chunks
# of c positions (the GLA paper's secondary chunking, arXiv 2312.06635 sec. 4): a block of queries
# in sub-chunk i against keys in earlier sub-chunks factors safely through the cumulative decay r_i
# at the end of sub-chunk i-1, exp(b_t - b_s) = exp(b_t - r_i) * exp(r_i - b_s), both exponents
# <= 0 since s <= (end of i-1) < t, which makes it one bmm; only the c x c diagonal blocks are
# formed explicitly, and of them only the c (c - 1) / 2 pairs s < t (s = t has a decay of 1), D
# values each. The factor exp(r_{i-1} - b_s) is itself split at the end of the key's sub-chunk (see
# channel_scores). Every factor within one sub-chunk (the diagonal pairs, and the factors to and from
# its ends) is a product of at most c decays exp(g) rather than an exp of a difference: one exp per
# position and channel, and no digit lost however large the decays before.
#
# Backward: the per-chunk states S_0 are saved (N/C of them, (D, Dv) each: O(N) memory), the chunk-
# local products are recomputed. The log decays need no product of their own. A term of an output
# (or of the final state) at t' that reads the key at s carries exp(B_t' - B_s) (B: cumulative log
# decay), so it reaches log_decay_t for s < t <= t' with the factor (term * dterm). For t in a
# chunk, sort those terms by where s and t' lie:
#   s, t' in the chunk:        reverse cumsum within the chunk of q*dq_intra - k*dk_intra
#                              (each pair adds at t' and takes away at s; intra: from A alone)
#   s before, t' in the chunk: reverse cumsum of q*dq_inter (dq_inter: through S_0)
#   s in, t' after the chunk:  exclusive cumsum of k*dk_inter (dk_inter: through S_end)
#   s before, t' after:        exp(b_C) * S_0 * dS_end summed over Dv, alike for the whole chunk.
# Every sum stays inside one chunk. The shorter identity dL/dB_t = q_t*dq_t - k_t*dk_t with one
# reverse cumsum over the whole sequence is the same sum regrouped, but it cancels terms across
# the whole sequence: where decays are near -1e4 (true gradient 0) its rounding error is that of
# a sum of N terms instead of C.
# ---------------------------------------------------------------------------------------------

def sub_chunk_length(C: int, sub_chunk_size: int) -> int:
    """The sub-chunk length c: the largest divisor of C up to ``sub_chunk_size``."""
    return max(d for d in range(1, min(C, sub_chunk_size) + 1) if C % d == 0)


def _strict_upper(n: int, device) -> Tensor:
    """``(n, n)`` bool, True above the diagonal (s > t: a key after the query)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def _exp_masked(x: Tensor, upper: Tensor) -> Tensor:
    """``exp(x)``, in place in the temporary ``x``, with the entries where ``upper`` is True set to
    0. Those (a key after the query) are positive and are clamped to 0 before the exp, not masked
    to -inf: exp of -inf (and of any result below the normal range) takes a slow path on CPUs,
    several times the cost of an ordinary one."""
    return x.clamp_(max=0).exp_().masked_fill_(upper, 0)


def _intra_head(q: Tensor, k: Tensor, b: CumulativeLogDecay,
                operand: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Per-head gate: ``q, k (M, C, D)``, ``b (M, C, 1)`` -> ``A (M, C, C)`` and the masked
    decays ``E = exp(b_t - b_s)`` ``(M, C, C)`` (0 above the diagonal); ``q k^T`` with operands in
    ``operand`` (None: as they are)."""
    E = _exp_masked(b - b.transpose(1, 2), _strict_upper(b.shape[1], b.device))  # exp(b_t - b_s)
    return mixed_bmm(q, k.transpose(1, 2), operand).mul_(E), E


def _sub_chunk_runs(a: Tensor, flush: bool = True) -> list:
    """``a (M, n, c, D)`` per-position decays -> ``runs``: ``runs[d] (M, n, c - d, D)`` holds, at
    s, the product ``a_{s+1} ... a_{s+d}`` = ``exp(b_{s+d} - b_s)`` for the pairs s < t = s + d of
    a sub-chunk (``runs[0]`` is None: s = t has a decay of 1). Products of at most c - 1 factors in
    [0, 1]: no difference of sums, so no digit is lost and a reset (a = 0) gives an exact 0.
    ``flush``: each product's negligible factors set to 0 (:func:`~linattn.functional.log_decays.flush_low`)."""
    c = a.shape[2]
    runs = [None, a[:, :, 1:]] if c > 1 else [None]
    for d in range(2, c):
        run = runs[d - 1][:, :, :-1] * a[:, :, d:]
        runs.append(flush_low(run, flush))
    return runs


class ChannelDecays(NamedTuple):
    """The decays of ``M`` chunks of C positions with a gate per key channel, cut into ``n``
    sub-chunks of ``c`` positions, as products of the decays ``exp(g)`` (no difference of sums:
    see the comment above :func:`sub_chunk_length`). With b the cumulative log decay from the
    chunk's start and r_i its value at the end of sub-chunk i:

    ``flush``: the CPU strategy's choice, every product of factors formed here and by the methods
    below with its negligible factors set to 0 (``log_decays.flush_low``: subnormal numbers slow a CPU's
    products); the accelerator's keeps them (computed at full speed there), all but the resets.

    ``a (M, n, c, D)``: ``exp(g)``, 0 at a reset (``g < RESET_LOG_DECAY``); ``runs``:
    ``runs[d] (M, n, c - d, D)`` = ``exp(b_{s+d} - b_s)`` within a sub-chunk
    (:func:`_sub_chunk_runs`); ``inner (M, n, c, D)``: ``exp(b_t - r_{i-1})``, the product from the
    start of t's sub-chunk to t; ``rev (M, n, c, D)``: ``exp(r_i - b_t)``, the product after t to
    the end of its sub-chunk; ``total (M, n, D)``: ``exp(r_i - r_{i-1})``, each sub-chunk's.
    """

    a: Tensor
    runs: list
    inner: Tensor
    rev: Tensor
    total: Tensor
    flush: bool = True

    def before(self) -> Tensor:
        """``(M, n, 1, D)``: ``exp(r_{i-1})``, the product over the sub-chunks before i."""
        t = self.total
        return flush_low(torch.cat([t.new_ones(t.shape[0], 1, t.shape[2]), t[:, :-1].cumprod(1)], dim=1),
                         self.flush).unsqueeze(2)

    def from_start(self, before: Tensor) -> Tensor:
        """``(M, C, D)``: ``exp(b_t)``, the decay from the chunk's start to t (``before`` from
        :meth:`before`)."""
        M, n, c, D = self.inner.shape
        return flush_low(self.inner * before, self.flush).view(M, n * c, D)

    def to_end(self) -> Tensor:
        """``(M, C, D)``: ``exp(b_C - b_t)``, the decay after t to the chunk's end."""
        M, n, c, D = self.rev.shape
        t = self.total
        # exp(b_C - r_i): the product over the sub-chunks after i (reverse, exclusive)
        after = torch.cat([t[:, 1:].flip(1).cumprod(1).flip(1), t.new_ones(M, 1, D)], dim=1).unsqueeze(2)
        return flush_low(self.rev * after, self.flush).view(M, n * c, D)

    def whole(self, before: Tensor) -> Tensor:
        """``(M, D)``: ``exp(b_C)``, the decay over the whole chunk."""
        return flush_low(before[:, -1, 0] * self.total[:, -1], self.flush)

    def between(self) -> Tensor:
        """``(M, n-1 (i), n-1 (j), D)``: ``exp(r_{i-1} - r_j)`` for a query sub-chunk i >= 1 and a
        key sub-chunk j < i, the product over the sub-chunks strictly between them; 0 for j >= i.
        Row by row, each row the one before times one sub-chunk's total (n - 2 products of
        (M, <= n-2, D)): the CPU strategy's pairs of sub-chunks (the accelerator pairs halves of
        ever larger groups instead: :func:`_levels_forward`)."""
        M, n, _, D = self.inner.shape
        mid = self.total.new_zeros(M, n - 1, n - 1, D)
        mid.diagonal(dim1=1, dim2=2).fill_(1)  # j = i - 1: no sub-chunk between
        for i in range(2, n):  # row i - 1 = row i - 2 times total_{i-1}, for j < i - 1
            # flushed row by row, so that no product of factors each above the threshold goes subnormal
            flush_low(torch.mul(mid[:, i - 2, : i - 1], self.total[:, i - 1 : i], out=mid[:, i - 1, : i - 1]),
                      self.flush)
        return mid


def channel_decays(g: Tensor, c: int, batched: bool = False) -> ChannelDecays:
    """:class:`ChannelDecays` of the log decays ``g (M, C, D)`` (<= 0, -inf allowed) in sub-chunks
    of ``c`` positions; ``batched`` (the accelerator): the cumulative products within sub-chunks
    as one ``cumprod``, else from the sub-chunks' runs (c - 1 products of (M, n, D), which on a
    CPU took about 0.6 of the time of a ``cumprod`` along a short inner dimension), and no
    product's negligible factors flushed (``ChannelDecays.flush`` False)."""
    M, C, D = g.shape
    n = C // c
    # a reset an exact 0 (log_decays.py); clamped first, as exp of far below its range takes a
    # slow path on CPUs. In float32 every factor below log_decays.negligible_decay (2**-40) is
    # flushed to 0 (log_decays.flush_low), which makes a reset's exp(-40) an exact 0 on both strategies;
    # float64's factors are not flushed, so there it is masked. On a CPU every product of factors
    # is flushed as it is formed too: such products fell into the subnormal range, where every
    # product with them runs several times slower (KDA with strong per-channel decays:
    # docs/benchmarks/README.md, History); an accelerator computes subnormal numbers at full speed
    a = g.clamp(min=RESET_LOG_DECAY).exp_()
    if a.dtype == torch.float64:
        a.masked_fill_(g < RESET_LOG_DECAY, 0)
    a = flush_low(a).view(M, n, c, D)
    runs = _sub_chunk_runs(a, flush=not batched)
    if batched:
        inner = a.cumprod(2)
    else:  # a_0 ... a_t = a_0 runs[t] at s = 0, within a sub-chunk (two flushed factors: none subnormal)
        inner = a.new_empty(M, n, c, D)
        inner[:, :, 0] = a[:, :, 0]
        for t in range(1, c):
            torch.mul(a[:, :, 0], runs[t][:, :, 0], out=inner[:, :, t])
        inner = flush_low(inner)
    # the products to the end of the sub-chunk are runs already formed: a_{t+1} .. a_c = runs[c-1-t][t]
    rev = a.new_empty(M, n, c, D)
    rev[:, :, -1] = 1
    for t in range(c - 1):
        rev[:, :, t] = runs[c - 1 - t][:, :, t]
    return ChannelDecays(a, runs, inner, rev, inner[:, :, -1], flush=not batched)


def channel_scores(x: Tensor, k: Tensor, decays: ChannelDecays, operand: torch.dtype | None = None,
                   batched: bool = False, saves: bool = True):
    """Per-channel gate: ``S`` sets of queries ``x (M, S, C, D)`` against one set of keys
    ``k (M, C, D)``, with the :class:`ChannelDecays` of their log decays ->
    ``A (M, S, C, C)``, ``A_jts = sum_d x_jtd k_sd exp(b_td - b_sd)`` for s <= t (0 above the
    diagonal; b the cumulative log decay), and what the backward needs (sub-chunks, as described
    at the top of this section). Everything on the keys' side (the decays between positions, the
    decayed keys) is formed once for all S sets: KDA's two score matrices (q against k, and k
    against k) cost little more than one. (Set-major: measured about 10% faster than the sets of
    one position side by side, ``(M, C, S, D)``.) ``operand``: the operand dtype of the products
    between sub-chunks (:func:`~linattn.functional.strategy.mixed_bmm`), None for as they are.
    ``batched`` (the accelerator strategy): the blocks between sub-chunks level by level, one
    product per level for every chunk (:func:`_levels_forward`), instead of one per sub-chunk.
    ``saves`` False (a forward: the backward forms the scores again): what the backward needs is
    let go as soon as it is used, and None comes back in its place."""
    M, S, C, D = x.shape
    a = decays.a
    n, c = a.shape[1], a.shape[2]
    xs, ks = x.view(M, S, n, c, D), k.view(M, n, c, D)
    A = x.new_zeros(M, S, C, C)
    # Diagonal blocks, the pairs s < t of one sub-chunk only, by their distance d = t - s (s = t
    # has a decay of 1): runs[d] = exp(b_{s+d} - b_s) as products of the decays between, and the
    # decayed keys keys[d] = runs[d] * k_s, shared by the S sets.
    runs = decays.runs
    keys = [None] + [r * ks[:, :, : c - d] for d, r in enumerate(runs) if d]  # keys[d] (M, n, c - d, D)
    Ad = x.new_zeros(M, S, n, c, c)
    # the strided diagonals are copied into rather than written with out=, which torch.compile refuses
    Ad.diagonal(dim1=3, dim2=4).copy_(torch.linalg.vecdot(xs, ks.unsqueeze(1)))  # (M, S, n, c)
    for d in range(1, c):
        Ad.diagonal(-d, dim1=3, dim2=4).copy_(torch.linalg.vecdot(xs[:, :, :, d:], keys[d].unsqueeze(1)))
    off = None
    if n > 1 and batched:
        off = _levels_forward(xs, ks, decays, A, operand, saves)
    elif n > 1:
        # Queries of sub-chunk i >= 1 against keys s of sub-chunk j < i, with r_j = b at the end of
        # sub-chunk j: exp(b_t - b_s) = exp(b_t - r_{i-1}) exp(r_{i-1} - r_j) exp(r_j - b_s), every
        # exponent <= 0: the first and last factors per position (products within a sub-chunk),
        # the middle one per pair of sub-chunks.
        eq = decays.inner[:, 1:]  # (M, n-1, c, D)
        ek = decays.rev[:, :-1]  # (M, n-1, c, D)
        mid = decays.between()  # (M, n-1 (i), n-1 (j), D)
        # the S sets' queries of sub-chunk i side by side, (M, n-1, S, c, D): one product per
        # sub-chunk for all sets
        qt = torch.mul(xs[:, :, 1:].transpose(1, 2), eq.unsqueeze(2),
                       out=x.new_empty(M, n - 1, S, c, D)).view(M, n - 1, S * c, D)
        kj = ks[:, :-1] * ek  # (M, n-1, c, D)
        A5 = A.view(M, S, n, c, C)
        kts = []  # kts[i - 1] (M, i c, D): the keys before sub-chunk i, decayed to its start
        for i in range(1, n):  # only the sub-chunks before i: no product of the zero blocks j >= i
            kt = (mid[:, i - 1, :i].unsqueeze(2) * kj[:, :i]).view(M, i * c, D)
            A5[:, :, i, :, : i * c] = mixed_bmm(qt[:, i - 1], kt.transpose(1, 2), operand).view(M, S, c, i * c)
            if saves:
                kts.append(kt)
        off = (eq, ek, mid, qt, kts)
    A.view(M, S, n, c, n, c).diagonal(dim1=2, dim2=4).copy_(Ad.permute(0, 1, 3, 4, 2))
    return A, ((runs, keys, off) if saves else None)


# The accelerator's blocks between sub-chunks, by levels (channel_scores with batched=True). The
# sub-chunks, padded to a power of two n2, are paired as halves of ever larger groups: at level l
# (L = 2^l c positions per half) every group of 2L positions is a lower half and an upper half, and
# every pair of a query t and an earlier key s in different sub-chunks is in exactly one such
# (upper, lower) pair of halves, at the level of the highest bit where their sub-chunk indices
# differ. With m the last position of the lower half, exp(b_t - b_s) = exp(b_t - b_m) exp(b_m - b_s),
# both exponents <= 0, so each block is one product of
#     QF_l[t] = x_t exp(b_t - b_m)   (the decay from the upper half's start to t, inclusive)
#     KF_l[s] = k_s exp(b_m - b_s)   (the decay after s to the lower half's end)
# over all blocks of the level at once. Level 0 starts from the sub-chunk factors (inner, rev), and a
# level's factors are the one before times the other half's total decay: QF_{l+1} = QF_l times the
# first half's total on the second half (its start moves back by L), KF_{l+1} = KF_l times the second
# half's total on the first. Every factor is a product of decays exp(g), no difference of sums.
# Against the pairs of sub-chunks (the CPU's form): log2(n) products of the useful pairs only, and
# no (n-1)^2 c D tensor of decayed keys per chunk (KDA's n = 16: 900 D against a few C D = 64 D), for
# a few more launches, constant in N (docs/benchmarks/levels: launches, traffic, memory). The
# factors are not flushed: subnormal products cost nothing on a GPU (the flushes are the CPU's).

class _Levels(NamedTuple):
    """What the levels' backward needs: per level the queries' and keys' sides ``Q (M P, S L, D)``
    and ``K (M P, L, D)`` and the group totals ``T`` ``(M, n2 / 2^l, D)``; the padded sub-chunk
    count ``n2``; the level-0 factors ``inner``, ``rev`` (:class:`ChannelDecays`')."""

    Q: list
    K: list
    T: list
    n2: int
    inner: Tensor
    rev: Tensor


def _pad_sub_chunks(x: Tensor, n2: int, dim: int) -> Tensor:
    """``x`` with zeros appended along ``dim`` (its sub-chunks) up to ``n2`` (``x`` itself when it has
    ``n2`` already)."""
    extra = n2 - x.shape[dim]
    return x if extra == 0 else F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, extra))


def _level_view(A: Tensor, P: int, L: int) -> Tensor:
    """The blocks of one level inside ``A (M, S, C2, C2)`` (C2 = 2 P L): ``(M, S, L (t), L (s), P)``,
    the upper half's rows against the lower half's columns of each of the P groups."""
    M, S = A.shape[:2]
    return A.view(M, S, P, 2, L, P, 2, L).diagonal(dim1=2, dim2=5)[:, :, 1, :, 0]


def _levels_forward(xs: Tensor, ks: Tensor, decays: ChannelDecays, A: Tensor,
                    operand: torch.dtype | None, saves: bool = True) -> _Levels:
    """The blocks between sub-chunks, written into ``A (M, S, C, C)`` level by level (see above):
    ``xs (M, S, n, c, D)``, ``ks (M, n, c, D)``; products with operands in ``operand``; without
    ``saves``, no level's sides are kept (the lists come back empty: only one level's are alive)."""
    M, S, n, c, D = xs.shape
    levels = (n - 1).bit_length()
    n2 = 1 << levels
    QF = _pad_sub_chunks(xs * decays.inner.unsqueeze(1), n2, 2)  # (M, S, n2, c, D)
    KF = _pad_sub_chunks(ks * decays.rev, n2, 1)  # (M, n2, c, D)
    T = _pad_sub_chunks(decays.total, n2, 1)  # (M, n2, D): each sub-chunk's total decay
    out = A if n2 == n else A.new_zeros(M, S, n2 * c, n2 * c)
    Qs, Ks, Ts = [], [], []
    for lvl in range(levels):
        P, L = n2 >> (lvl + 1), c << lvl
        # copies, always (a reshape may give a view): QF and KF are scaled in place below
        Q = QF.view(M, S, P, 2, L, D)[:, :, :, 1].transpose(1, 2).clone(memory_format=torch.contiguous_format)
        Q = Q.view(M * P, S * L, D)
        K = KF.view(M, P, 2, L, D)[:, :, 0].clone(memory_format=torch.contiguous_format).view(M * P, L, D)
        blocks = mixed_bmm(Q, K.transpose(1, 2), operand)  # (M P, S L, L)
        _level_view(out, P, L).copy_(blocks.view(M, P, S, L, L).permute(0, 2, 3, 4, 1))
        if saves:
            Qs.append(Q)
            Ks.append(K)
            Ts.append(T)
        if lvl + 1 < levels:
            halves = T.view(M, P, 2, D)
            QF.view(M, S, P, 2, L, D)[:, :, :, 1].mul_(halves[:, None, :, 0, None])
            KF.view(M, P, 2, L, D)[:, :, 0].mul_(halves[:, :, 1, None])
            T = halves[:, :, 0] * halves[:, :, 1]  # (M, P, D): the next level's group totals
    if out is not A:
        C = n * c
        A.copy_(out[:, :, :C, :C])
    return _Levels(Qs, Ks, Ts, n2, decays.inner, decays.rev)


def _levels_backward(dA: Tensor, lv: _Levels, dx: Tensor, dk: Tensor) -> None:
    """Adds the gradients of the blocks :func:`_levels_forward` wrote, from ``dA (M, S, C, C)``, into
    ``dx (M, S, n, c, D)`` and ``dk (M, n, c, D)``: each level's two products, then back through the
    factors, top level first (QF_{l+1} = QF_l times a total: its gradient flows back times that total)."""
    M, S, n, c, D = dx.shape
    n2, levels = lv.n2, len(lv.Q)
    if n2 != n:
        dA = F.pad(dA, (0, (n2 - n) * c) * 2)  # (M, S, C2, C2): zero rows and columns appended
    G = dx.new_zeros(M, S, n2, c, D)  # d loss / d QF_l, level by level downwards
    H = dk.new_zeros(M, n2, c, D)  # d loss / d KF_l
    for lvl in reversed(range(levels)):
        P, L = n2 >> (lvl + 1), c << lvl
        if lvl + 1 < levels:  # through QF_{l+1} = QF_l * (the first half's total, on the second half)
            halves = lv.T[lvl].view(M, P, 2, D)
            G.view(M, S, P, 2, L, D)[:, :, :, 1].mul_(halves[:, None, :, 0, None])
            H.view(M, P, 2, L, D)[:, :, 0].mul_(halves[:, :, 1, None])
        dB = _level_view(dA, P, L).permute(0, 4, 1, 2, 3).reshape(M * P, S * L, L)  # (M P, S L (t), L (s))
        G.view(M, S, P, 2, L, D)[:, :, :, 1].add_(torch.bmm(dB, lv.K[lvl]).view(M, P, S, L, D).transpose(1, 2))
        H.view(M, P, 2, L, D)[:, :, 0].add_(torch.bmm(dB.transpose(1, 2), lv.Q[lvl]).view(M, P, L, D))
    dx.addcmul_(G[:, :, :n], lv.inner.unsqueeze(1))
    dk.addcmul_(H[:, :n], lv.rev)


def channel_scores_backward(x: Tensor, k: Tensor, c: int, saved, dA: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`channel_scores` from ``dA (M, S, C, C)`` (entries above the
    diagonal are ignored): ``dx (M, S, C, D)``, each set's queries', and ``dk (M, C, D)``, the
    keys' summed over the S sets."""
    M, S, C, D = x.shape
    n = C // c
    runs, keys, off = saved
    xs, ks = x.view(M, S, n, c, D), k.view(M, n, c, D)
    dAd = dA.view(M, S, n, c, n, c).diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # (M, S, n, c_t, c_s)
    dd = dAd.diagonal(dim1=3, dim2=4).unsqueeze(-1)  # (M, S, n, c, 1): the pairs s = t
    dx = ks.unsqueeze(1) * dd  # (M, S, n, c, D)
    dk = xs[:, 0] * dd[:, 0]  # (M, n, c, D): the keys' side, summed over the sets
    for j in range(1, S):
        dk.addcmul_(xs[:, j], dd[:, j])
    for d in range(1, c):  # the pairs t = s + d
        dp = dAd.diagonal(-d, dim1=3, dim2=4).unsqueeze(-1)  # (M, S, n, c - d, 1)
        dx[:, :, :, d:].addcmul_(dp, keys[d].unsqueeze(1))
        # summed over the sets before the decays (shared) multiply in
        w = xs[:, 0, :, d:] * dp[:, 0]
        for j in range(1, S):
            w.addcmul_(xs[:, j, :, d:], dp[:, j])
        dk[:, :, : c - d].addcmul_(w, runs[d])
    if isinstance(off, _Levels):  # the accelerator's (channel_scores' batched): the pairs j < i only
        _levels_backward(dA, off, dx, dk)
    elif off is not None:
        eq, ek, mid, qt, kts = off
        dA5 = dA.view(M, S, n, c, C)
        dkj = x.new_zeros(M, n - 1, c, D)
        for i in range(1, n):
            dAo = dA5[:, :, i, :, : i * c].reshape(M, S * c, i * c)
            dx[:, :, i].addcmul_((dAo @ kts[i - 1]).view(M, S, c, D), eq[:, i - 1].unsqueeze(1))
            dkt = (dAo.transpose(1, 2) @ qt[:, i - 1]).view(M, i, c, D)
            dkj[:, :i].addcmul_(dkt, mid[:, i - 1, :i].unsqueeze(2))
        dk[:, :-1].addcmul_(dkj, ek)
    return dx.view(M, S, C, D), dk.view(M, C, D)


def _tile_decays(g: Tensor, c: int, batched: bool) -> tuple[CumulativeLogDecay | ChannelDecays, Tensor, Tensor]:
    """``g (m, R, C, G)`` -> the tile's decays as its scores take them (:func:`_tile_intra`),
    ``exp(b) (m, R, C, G)`` and ``exp(b_C - b) (m, R, C, G)``, b the cumulative log decay from
    the chunk's start; every exponent <= 0, all in g's dtype. A gate per head: b itself, whose
    differences keep the digits of small decays after a large one (a reset) without float64
    (log_decays.py). A gate per key channel: the :class:`ChannelDecays` of its sub-chunks of ``c``
    (``batched``: the accelerator's form), both factors products of them, as the scores' are: one
    representation formed once (as the delta rule's KDA takes them), not a second one of cumulative
    sums beside it."""
    if g.shape[-1] == 1:
        b = CumulativeLogDecay.of(g, 2)
        return b, b.exp(), (b[:, :, -1:] - b).exp_()
    m, R, C, D = g.shape
    decays = channel_decays(g.reshape(m * R, C, D), c, batched)
    before = decays.before()
    return decays, decays.from_start(before).view(m, R, C, D), decays.to_end().view(m, R, C, D)


def _g_sum(x: Tensor, G: int) -> Tensor:
    """Sum ``x (..., D)`` over its last dimension for a per-head gate (G = 1), keep it for G = D."""
    return x.sum(-1, keepdim=True) if G == 1 else x


def _tile_intra(q: Tensor, k: Tensor, decays: CumulativeLogDecay | ChannelDecays, opts: EngineOptions | None = None,
                saves: bool = True):
    """``A (m, R, C, C)`` of a tile and what its backward needs, from its decays (:func:`_tile_decays`:
    per head the cumulative log decays ``(m, R, C, 1)``, per key channel the :class:`ChannelDecays`
    of its ``m R`` chunks) (``opts``: the products' operand dtype and, for a gate per key channel,
    the accelerator's batched scores; None in the backward). ``saves`` False: a gate per key
    channel's scores keep nothing for a backward (:func:`channel_scores`)."""
    m, R, C, D = q.shape
    q2, k2 = (t.reshape(m * R, C, D) for t in (q, k))
    operand = None if opts is None else opts.operand
    if isinstance(decays, CumulativeLogDecay):
        A, saved = _intra_head(q2, k2, decays.reshape(m * R, C, 1), operand)
    else:  # one set of queries
        batched = opts is not None and opts.strategy == "accelerator"
        A, saved = channel_scores(q2.unsqueeze(1), k2, decays, operand, batched=batched, saves=saves)
    return A.view(m, R, C, C), saved


def _mm(a: Tensor, b: Tensor, operand: torch.dtype | None, split: bool = False) -> Tensor:
    """``a @ b`` of ``a (m, R, X, Y)``, ``b (m, R, Y, Z)`` with operands in ``operand`` (None: as they
    are; :func:`~linattn.functional.strategy.mixed_bmm`, or with ``split`` b in two half parts,
    :func:`~linattn.functional.strategy.split_bmm`) -> ``(m, R, X, Z)``."""
    if operand is None:
        return a @ b
    product = split_bmm if split else mixed_bmm
    return product(a.flatten(0, 1), b.flatten(0, 1), operand).view(*a.shape[:-1], b.shape[-1])


def _gated_layout(R: int, N: int, chunk_size: int, tile_positions: int, strategy: str) -> ChunkLayout:
    """The gated product's chunks: tiles of about ``tile_positions`` positions on a CPU (temporaries
    in cache), one tile of every chunk for the accelerator (every product over the whole sequence,
    the recurrence a scan: launches that do not grow with N)."""
    if strategy == "accelerator":
        return ChunkLayout.whole(R, N, chunk_size)
    return ChunkLayout.of(R, N, chunk_size, tile_positions=tile_positions)


def _gated_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, s0: Tensor | None, scale: float,
                   options: str) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked form: ``q, k (B, H, N, D)``, ``v (B, H, N, Dv)``, ``g (B, H, N, G)``,
    ``s0 (B, H, D, Dv)`` or None, all in one (compute) dtype -> ``o (B, H, N, Dv)``, the final
    state ``(B, H, D, Dv)`` and the states before every chunk and after the last,
    ``(Nc + 1, B*H, D, Dv)`` (what the backward needs besides the inputs). ``q`` is scaled tile
    by tile (a scaled copy of the whole q would be one more full-size tensor). ``options``: an
    encoded :class:`~linattn.functional.strategy.EngineOptions`."""
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    opts = EngineOptions.decode(options)
    strategy, operand = opts.strategy, opts.operand
    lay = _gated_layout(B * H, N, opts.chunk_size, opts.per_tile, strategy)
    R, C, Nc = lay.R, lay.C, lay.Nc
    q3, k3, v3, g3 = (lay.chunked(t.reshape(R, N, t.shape[-1])) for t in (q, k, v, g))  # (R, Nc, C, *)
    states = q.new_empty(Nc + 1, R, D, Dv)  # states[j]: the state before chunk j
    if s0 is None:
        states[0].zero_()
    else:
        states[0] = s0.reshape(R, D, Dv)
    o = lay.new_chunked(q, Dv)
    c = sub_chunk_length(C, opts.sub_chunk_size)
    for sl in lay.tiles():
        q_ = lay.take_scaled(q3, sl, scale)  # (m, R, C, D)
        k_, v_, g_ = (lay.take(t, sl) for t in (k3, v3, g3))
        decays, eb, ek = _tile_decays(g_, c, strategy == "accelerator")
        u = _mm((k_ * ek).transpose(-1, -2), v_, operand)  # (m, R, D, Dv): what the chunk writes
        a = eb[:, :, -1].unsqueeze(-1)  # (m, R, G, 1): its decay of the state before
        chunk_recurrence(a, u, states[sl.start], strategy=strategy, out=states[sl.start: sl.stop + 1],
                         consume=True)
        A, _ = _tile_intra(q_, k_, decays, opts, saves=False)
        # the state in two half parts (strategy.split_bmm): its rounding cost the bf16 output the most
        lay.put(o, sl, _mm(q_ * eb, states[sl], operand, split=True).add_(_mm(A, v_, operand)))
    return lay.unchunked(o).reshape(B, H, N, Dv).contiguous(), states[Nc].reshape(B, H, D, Dv).clone(), states


def _gated_backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, states: Tensor, do: Tensor, ds_final: Tensor,
                    has_s0: bool, scale: float, options: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`_gated_forward` given ``do (B, H, N, Dv)`` and ``ds_final (B, H, D, Dv)``:
    ``dq, dk, dv, dg`` shaped as their inputs and ``ds0 (B, H, D, Dv)`` (``(0,)`` without
    ``has_s0``). The chunk-local products are recomputed from the inputs and the saved states, in
    the compute dtype (the backward's products take no half operands)."""
    B, H, N, D = q.shape
    Dv, G = v.shape[-1], g.shape[-1]
    opts = EngineOptions.decode(options)
    strategy = opts.strategy
    lay = _gated_layout(B * H, N, opts.chunk_size, opts.per_tile, strategy)
    R, C, Nc = lay.R, lay.C, lay.Nc
    q3, k3, v3, g3, do3 = (lay.chunked(t.reshape(R, N, t.shape[-1])) for t in (q, k, v, g, do))  # (R, Nc, C, *)
    T = q3.new_empty(Nc + 1, R, D, Dv)  # T[j]: gradient of states[j]
    T[Nc] = ds_final.reshape(R, D, Dv)
    dq3, dk3, dv3, dg3 = (lay.new_chunked(q, X) for X in (D, D, Dv, G))
    c = sub_chunk_length(C, opts.sub_chunk_size)
    for sl in reversed(lay.tiles()):
        q_ = lay.take_scaled(q3, sl, scale)  # (m, R, C, D)
        k_, v_, g_, do_ = (lay.take(t, sl) for t in (k3, v3, g3, do3))
        decays, eb, ek = _tile_decays(g_, c, strategy == "accelerator")
        qd = q_ * eb
        gs = qd.transpose(-1, -2) @ do_  # (m, R, D, Dv): the outputs' gradient of the state before
        a = eb[:, :, -1].unsqueeze(-1)  # (m, R, G, 1)
        chunk_recurrence(a, gs, T[sl.stop], strategy=strategy, reverse=True, out=T[sl.start: sl.stop + 1],
                         consume=True)
        s_, t_ = states[sl], T[sl.start + 1: sl.stop + 1]  # before, gradient after each chunk
        A, saved = _tile_intra(q_, k_, decays, replace(opts, operands=""))
        dA = do_ @ v_.transpose(-1, -2)  # (m, R, C, C)
        lay.put(dv3, sl, (k_ * ek) @ t_ + A.transpose(-1, -2) @ do_)
        dq = (do_ @ s_.transpose(-1, -2)).mul_(eb)  # through the state before the chunk
        dk = (v_ @ t_.transpose(-1, -2)).mul_(ek)  # through the state after it
        y, z = _g_sum(q_ * dq, G), _g_sum(k_ * dk, G)  # (m, R, C, G)
        M = R * (sl.stop - sl.start)
        if G == 1:
            dP = dA.view(M, C, C).mul_(saved)  # saved: the masked decays E
            dqi = torch.bmm(dP, k_.reshape(M, C, D))
            dki = torch.bmm(dP.transpose(1, 2), q_.reshape(M, C, D))
        else:
            dqi, dki = channel_scores_backward(q_.reshape(M, 1, C, D), k_.reshape(M, C, D), c, saved,
                                               dA.view(M, 1, C, C))
        dqi, dki = dqi.view_as(q_), dki.view_as(k_)
        x = _g_sum(q_ * dqi - k_ * dki, G)
        # Decay of the state through the whole chunk: (m, R, 1, G), the same for every position.
        whole = _g_sum((a * s_ * t_).sum(-1), G).unsqueeze(2)
        dg = cumsum_in_chunks(x.add_(y), -2, reverse=True).add_(cumsum_in_chunks(z, -2, exclusive=True))
        dg.add_(whole)
        # 0 at a reset (a log decay below -40, -inf included): each term carries a decay of
        # exactly 0 there, but the cumulative sums above leave rounding noise
        lay.put(dg3, sl, dg.masked_fill_(g_ < RESET_LOG_DECAY, 0))
        lay.put(dq3, sl, dq.add_(dqi).mul_(scale))  # the tile saw scale * q
        lay.put(dk3, sl, dk + dki)
    ds0 = T[0].reshape(B, H, D, Dv) if has_s0 else T.new_empty(0)
    dq, dk, dv, dg = (lay.unchunked(t).reshape(B, H, N, t.shape[-1]).contiguous() for t in (dq3, dk3, dv3, dg3))
    return dq, dk, dv, dg, ds0


# The chunked form as a torch.library custom op with its own autograd: torch.compile then sees one
# op with a shape function (no chunk loop to unroll and no engine internals to trace, so a model
# compiles in seconds and whole), and eager autograd runs the same two functions.
_gated_chunked = EngineOp(
    "linattn::gated_chunked",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? s0, float scale, str options) -> (Tensor, Tensor, Tensor)",
    _gated_forward)


@_gated_chunked.register_fake
def _(q, k, v, g, s0, scale, options):
    B, H, N, D = q.shape
    Dv = v.shape[-1]
    Nc = -(-N // min(EngineOptions.decode(options).chunk_size, N))
    return q.new_empty(B, H, N, Dv), q.new_empty(B, H, D, Dv), q.new_empty(Nc + 1, B * H, D, Dv)


_gated_chunked_backward = EngineOp(
    "linattn::gated_chunked_backward",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor states, Tensor do, Tensor ds_final, "
    "bool has_s0, float scale, str options) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _gated_backward, backward=True)


@_gated_chunked_backward.register_fake
def _(q, k, v, g, states, do, ds_final, has_s0, scale, options):
    B, H, _, D = q.shape
    ds0 = q.new_empty(B, H, D, v.shape[-1]) if has_s0 else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), ds0


def _gated_setup(ctx, inputs, output):
    q, k, v, g, s0, scale, options = inputs
    ctx.save_for_backward(q, k, v, g, output[2])
    ctx.knobs = (s0 is not None, scale, options)
    ctx.mark_non_differentiable(output[2])
    # unused outputs' gradients stay None: materialised, the saved states' would be a zero-filled tensor
    # as large as the states themselves on every backward
    ctx.set_materialize_grads(False)


def _gated_autograd(ctx, do, ds_final, _dstates):
    q, k, v, g, states = ctx.saved_tensors
    has_s0 = ctx.knobs[0]
    do = torch.zeros_like(v) if do is None else do.to(v.dtype)
    if ds_final is None:
        ds_final = q.new_zeros(*q.shape[:2], *states.shape[2:])  # (B, H, D, Dv)
    dq, dk, dv, dg, ds0 = _gated_chunked_backward(q, k, v, g, states, do, ds_final, *ctx.knobs)
    return dq, dk, dv, dg, ds0 if has_s0 else None, None, None


_gated_chunked.register_autograd(_gated_autograd, setup_context=_gated_setup)


# =============================================================================================
# Per head, as a running log scale: o_i = q_i . (e^{m_0 - m_i} s0 + sum_{j <= i} e^{m_j - m_i} k_j v_j^T).
# =============================================================================================

def _scale_chunks(lay: ChunkLayout, x: Tensor) -> Tensor:
    """``(B, H, N, X)`` -> ``(B*H*Nc, C, X)`` on the layout ``lay`` (zero rows fill the last chunk)."""
    return lay.chunked(x.reshape(lay.R, lay.N, x.shape[-1])).flatten(0, 1)


def _scale_weights(mc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
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
                      reverse: bool, strategy: str = "cpu", operand: torch.dtype | None = None) -> Tensor:
    """:func:`_scan_` of the per-chunk products ``bmm(a, b)`` for ``a (BH*Nc, F, C)``,
    ``b (BH*Nc, C, E)``, seeded with ``seed`` (anything of BH*F*E entries; None for zeros): a new
    ``(BH, Nc + 1, F*E)`` laid out as :func:`_scan_` describes. The products go straight into their
    slots when those are one block of memory (BH = 1, the tiled FAVOR path)."""
    if strategy == "accelerator":
        return _scanned_by_recurrence(a, b, seed, lvl, lvl_init, reverse=reverse, operand=operand)
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


def _scanned_by_recurrence(a: Tensor, b: Tensor, seed: Tensor | None, lvl: Tensor, lvl_init: Tensor, *,
                           reverse: bool, operand: torch.dtype | None = None) -> Tensor:
    """:func:`_scanned_products` for the accelerator: the same sums as the recurrence across chunks
    (``recurrence.py``) with a number per row as each chunk's transition, ``e^{lvl[c-1] - lvl[c]}``
    (``e^{lvl[c+1] - lvl[c]}`` reversed; ``lvl_init`` at the seed's end), every factor <= 1."""
    BH, nc = lvl.shape
    Fd, E = a.shape[1], b.shape[2]
    terms = mixed_bmm(a, b, operand).view(BH, nc, Fd, E).transpose(0, 1)  # (Nc, BH, F, E)
    beyond = lvl_init[:, None]
    other = torch.cat([lvl[:, 1:], beyond], dim=1) if reverse else torch.cat([beyond, lvl[:, :-1]], dim=1)
    A = torch.exp(other - lvl).t()[..., None, None]  # (Nc, BH, 1, 1)
    seed = a.new_zeros(BH, Fd, E) if seed is None else seed.reshape(BH, Fd, E)
    states = chunk_recurrence(A, terms, seed, strategy="accelerator", reverse=reverse)  # (Nc + 1, BH, F, E)
    return states.transpose(0, 1).reshape(BH, nc + 1, Fd * E)


def _chunk_states(
    kc: Tensor, wc: Tensor, leave: Tensor, start: Tensor, end: Tensor, s0: Tensor | None, BH: int,
    strategy: str = "cpu", operand: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The state entering each chunk ``(B*H*Nc, F, E)`` and the final state ``(B*H, F, E)``.

    ``S_out[c] = e^{start[c] - end[c]} S_out[c-1] + kc[c]^T (leave * wc[c])`` with ``S_out[-1] = s0``.
    """
    Fd, E = kc.shape[-1], wc.shape[-1]
    nc = kc.shape[0] // BH
    # s0, then each chunk's leaving state (scale the narrower w)
    buf = _scanned_products(kc.transpose(1, 2), wc * leave, s0, end, start[:, 0], reverse=False, strategy=strategy,
                            operand=operand)
    s_final = buf[:, nc].reshape(BH, Fd, E).clone()
    return buf[:, :nc].reshape(-1, Fd, E), s_final  # a view when BH = 1


def _scale_layout(a: Tensor, chunk_size: int) -> ChunkLayout:
    """One tile: the whole row (the per-chunk states are one scan over all chunks at once)."""
    B, H, N = a.shape[:3]
    return ChunkLayout.whole(B * H, N, chunk_size)


def _scale_forward(a: Tensor, kf: Tensor, w: Tensor, m: Tensor, s0: Tensor | None,
                   options: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> ``o (B, H, N, E)``, the final state ``(B, H, F, E)`` and what the backward keeps besides
    the inputs: the chunked scales ``mc (B*H, Nc, C)``, the per-chunk states ``s_in (B*H*Nc, F, E)``
    and the masked chunk scores ``(B*H*Nc, C, C)`` (N F E / C and N C floats: with F in the
    hundreds both cost more to redo than to keep)."""
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    opts = EngineOptions.decode(options)
    operand = opts.operand
    lay = _scale_layout(a, opts.chunk_size)
    C, nc, n_pad = lay.C, lay.Nc, lay.fill
    ac, kc, wc = (_scale_chunks(lay, x) for x in (a, kf, w))  # (B*H*Nc, C, F|F|E)
    # fill positions repeat the last scale: they carry zero rows and must not rescale. A copy (B*H*N
    # floats): kept for the backward, it must not be a view of the input m
    mc = _scale_chunks(lay, m[..., None]).view(B * H, nc, C).clone()
    if n_pad:
        mc[:, -1, C - n_pad:] = mc[:, -1, C - n_pad - 1: C - n_pad]
    intra, enter, leave, start, end = _scale_weights(mc)
    s_in, s_final = _chunk_states(kc, wc, leave, start, end, s0, B * H, opts.strategy, operand)
    scores = mixed_bmm(ac, kc.transpose(1, 2), operand).mul_(intra)  # (B*H*Nc, C, C)
    # the state in two half parts (strategy.split_bmm): its rounding cost the bf16 output the most
    o = split_bmm(ac, s_in, operand).mul_(enter).add_(mixed_bmm(scores, wc, operand))  # (B*H*Nc, C, E)
    out = lay.unchunked(o.view(B * H, nc, C, E)).view(B, H, N, E)
    return out.contiguous(), s_final.view(B, H, Fd, E), mc, s_in.contiguous(), scores


def _scale_backward(a: Tensor, kf: Tensor, w: Tensor, mc: Tensor, s_in: Tensor, scores: Tensor, do: Tensor,
                    ds_final: Tensor, has_s0: bool, options: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`_forward`: ``da, dkf, dw`` shaped as their inputs and ``ds0 (B, H, F, E)``
    (``(0,)`` without ``has_s0``)."""
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    opts = EngineOptions.decode(options)
    strategy = opts.strategy
    lay = _scale_layout(a, opts.chunk_size)
    C = lay.C
    ac, kc, wc, doc = (_scale_chunks(lay, x) for x in (a, kf, w, do))  # (B*H*Nc, C, F|F|E|E)
    intra, enter, leave, start, end = _scale_weights(mc)
    doe = doc * enter  # gradient reaching a_i . S_in, per row
    # g[c] = d loss / d S_in[c] from chunk c's outputs. The total gradient of S_in[c] is
    # T[c] = sum_{c' >= c} e^{start[c] - start[c']} g[c'] + e^{start[c] - end[-1]} ds_final,
    # the same rescaled scan run backwards (levels -start, read in reverse order); chunk c's
    # contribution gets T[c+1] (T[Nc] = ds_final) and s0 gets T[0].
    t = _scanned_products(ac.transpose(1, 2), doe, ds_final, -start, -end[:, -1], reverse=True,
                          strategy=strategy)  # T[c], T[Nc]
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
_scaled_chunked = EngineOp(
    "linattn::scaled_chunked",
    "(Tensor a, Tensor kf, Tensor w, Tensor m, Tensor? s0, str options) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _scale_forward)


@_scaled_chunked.register_fake
def _(a, kf, w, m, s0, options):
    B, H, N, Fd = a.shape
    E = w.shape[-1]
    C = min(EngineOptions.decode(options).chunk_size, N)
    nc = -(-N // C)
    return (a.new_empty(B, H, N, E), a.new_empty(B, H, Fd, E), a.new_empty(B * H, nc, C),
            a.new_empty(B * H * nc, Fd, E), a.new_empty(B * H * nc, C, C))


_scaled_chunked_backward = EngineOp(
    "linattn::scaled_chunked_backward",
    "(Tensor a, Tensor kf, Tensor w, Tensor mc, Tensor s_in, Tensor scores, Tensor do, "
    "Tensor ds_final, bool has_s0, str options) -> (Tensor, Tensor, Tensor, Tensor)",
    _scale_backward, backward=True)


@_scaled_chunked_backward.register_fake
def _(a, kf, w, mc, s_in, scores, do, ds_final, has_s0, options):
    B, H, _, Fd = a.shape
    ds0 = a.new_empty(B, H, Fd, w.shape[-1]) if has_s0 else a.new_empty(0)
    return a.new_empty(a.shape), kf.new_empty(kf.shape), w.new_empty(w.shape), ds0


def _scale_setup(ctx, inputs, output):
    a, kf, w, m, s0, options = inputs
    _, _, mc, s_in, scores = output
    ctx.save_for_backward(a, kf, w, mc, s_in, scores)
    ctx.knobs = (s0 is not None, options)
    ctx.mark_non_differentiable(mc, s_in, scores)
    # unused outputs' gradients stay None (materialised, the saved tensors' would be zero-filled)
    ctx.set_materialize_grads(False)


def _scale_autograd(ctx, do, ds_final, _dmc, _ds_in, _dscores):
    a, kf, w, mc, s_in, scores = ctx.saved_tensors
    has_s0 = ctx.knobs[0]
    B, H, _, Fd = a.shape
    if do is None:
        do = w.new_zeros(w.shape)
    if ds_final is None:
        ds_final = w.new_zeros(B, H, Fd, w.shape[-1])
    da, dk, dw, ds0 = _scaled_chunked_backward(a, kf, w, mc, s_in, scores, do, ds_final, *ctx.knobs)
    return da, dk, dw, None, ds0 if has_s0 else None, None


_scaled_chunked.register_autograd(_scale_autograd, setup_context=_scale_setup)

# =============================================================================================
# The entry
# =============================================================================================


def decayed_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s0: Tensor | None = None,
    *,
    log_decay: Tensor | None = None,
    running_log_scale: Tensor | None = None,
    scale: float = 1.0,
    normalise: bool = False,
    phi: str = "",
    keep: bool = False,
    chunk_size: int | None = None,
    sub_chunk_size: int = 4,
    tile_positions: int = 4096,
    strategy: str = "auto",
    input_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The decayed engine's one entry (internal: callers have checked the inputs and chosen the
    compute dtype; B*H, N >= 1). Differentiable once in q, k, v, log_decay and s0.

    Args:
        q, k: ``(B, H, N, D)``; with ``phi`` the inputs of the feature map, else features.
        v: ``(B, H, N, Dv)``.
        s0: ``(B, H, D, Dv)`` state before position 0 (``(B, H, D, Dv + 1)`` with ``normalise``:
            numerator and normaliser side by side), or None for zeros.
        log_decay: None (no gate), or ``(B, H, N, G)`` log decays <= 0 with G = 1 (per head) or
            D (per key channel); below -40 is a reset.
        running_log_scale: None, or ``m (B, H, N)`` non-decreasing and finite: the per-head gate
            ``g_t = m_{t-1} - m_t`` given by its running sum (FAVOR+'s stabiliser; no gradient);
            then ``s0`` is at scale ``m_0`` and the final state at scale ``m_{N-1}``.
        scale: the factor of the readout.
        normalise: no gate only: ``out_i = n_i / d_i`` with the normaliser
            ``d_i = q_i . (z0 + sum_{j<=i} k_j)`` guarded as in ``normaliser.normalise``.
        phi: no gate only: the name of an elementwise feature map (``ELEMENTWISE_MAPS``) applied to
            q and k inside the pass, or "".
        keep: with ``phi``, keep the features for the backward (it then writes the gradients of
            q and k over them) instead of recomputing them.
        chunk_size: the chunk length C; None for :data:`CHUNK_SIZES` of the gate's kind.
        sub_chunk_size: per-channel gate: the sub-chunk length (the largest divisor of C up to it).
        tile_positions: about how many positions one tile holds (no gate, per-head and per-channel
            gates; the running-scale product scans whole rows), on the CPU strategy.
        strategy: ``"auto"``, ``"cpu"`` or ``"accelerator"`` (``recurrence.py``): tiles in cache
            and a sequential recurrence across chunks, or one tile of the whole sequence and a
            log-depth scan (launches that do not grow with N); ``"auto"`` picks by q's device.
        input_dtype: the caller's dtype before its cast to the compute dtype (None: q's): with
            half inputs on the accelerator, the gated forward's large products take half operands
            (``strategy.py``).

    Every knob leaves the result unchanged. Returns ``out (B, H, N, Dv)`` and the final state
    ``(B, H, D, Dv)`` (``Dv + 1`` with ``normalise``).
    """
    if (normalise or phi) and (log_decay is not None or running_log_scale is not None):
        raise ValueError("decayed_product: normalise and phi are the no-gate specialisation's; got a gate")
    if log_decay is not None and running_log_scale is not None:
        raise ValueError("decayed_product: give at most one of log_decay and running_log_scale")
    strategy = resolve_strategy(strategy, q.device)
    operands = operand_dtype(strategy, input_dtype or q.dtype)
    if log_decay is not None:
        kind = "head" if log_decay.shape[-1] == 1 else "channel"
        C = CHUNK_SIZES[kind] if chunk_size is None else chunk_size
        options = EngineOptions(C, strategy, operands, tile_positions, sub_chunk_size)
        out, s_final, _ = _gated_chunked(q, k, v, log_decay, s0, scale, options.encode())
        return out, s_final
    if scale != 1.0:
        q = q * scale
    if running_log_scale is not None:
        C = CHUNK_SIZES["scale"] if chunk_size is None else chunk_size
        options = EngineOptions(C, strategy, operands)
        out, s_final, _, _, _ = _scaled_chunked(q, k, v, running_log_scale.detach(), s0, options.encode())
        return out, s_final
    C = CHUNK_SIZES["none"] if chunk_size is None else chunk_size
    options = EngineOptions(C, strategy, operands, tile_positions)
    out, s_final, *_ = _ungated_chunked(q, k, v, s0, normalise, phi, keep, options.encode())
    return out, s_final

