"""Reformer LSH attention (Kitaev et al., arXiv 2001.04451), bidirectional and causal, plus its
reference.

Queries and keys share one projection: query i is ``qk_i``, key j is ``qk_j / ||qk_j||``. Angular
LSH hashes every position into one of ``n_buckets = N / bucket_size`` buckets with a random
rotation R: ``h(x) = argmax([x R; -x R])``. Positions are sorted by (bucket, position); each bucket
is cut into chunks of ``bucket_size`` and a query attends the keys of its own chunk and of the
chunk before it *in its bucket* (so at most 2 bucket_size - 1 others). ``n_hashes`` independent
rounds are combined by log-sum-exp: round r's output is weighted by its share of the total
softmax mass, ``exp(lse_r - logsumexp_r lse_r)``.

A position never attends to itself unless it has nothing else to attend in every round (then its
output is its own value): with shared q and k, q_i . k_i would dominate every row.

Packed documents (``cu_seqlens``, flash-attention's varlen convention: integer offsets
``[0, c_1, ..., c_n = N]`` of n documents along N, batch size 1): no information crosses a
boundary. A *group* is the positions of one (document, bucket) pair in one round, and everything
above said of a bucket holds per group: positions are sorted by (document, bucket, position), each
group is cut into chunks of c, a query attends its chunk and the chunk before in its group.
Sorting by (bucket, position) alone and masking other documents would not do: a position's rank
in its bucket would count the positions of *other* documents before it, so their content would
decide which keys of its own document share its chunk. The rotations are drawn once per call,
with Nbk = N / c for the packed N (so c divides N; a document's length may be anything).
Without ``cu_seqlens`` the call is one document.

Dimension legend: B batch, H heads, N positions, D qk width, Dv value width, R hash rounds,
Nbk buckets, c = bucket_size (chunk length), P the largest power of two <= c, G = B*H*R,
Np padded slots per round, Nc chunks, n documents, m positions of a group.

Why chunks are cut per bucket (the paper cuts the sorted sequence into chunks across bucket
boundaries): with chunks across boundaries, which past keys share a chunk with query i depends on
how many *future* positions fall into lower buckets, so a causal output would change when a future
token changes. Cutting each bucket separately makes the rank of a position in its bucket, and so
its chunk, depend only on earlier positions.

Slots. Each round lays its positions out in Np slots, Nc = Np / c chunks; a query's keys are the
slots of its chunk and of the chunk before, masked to its group. Documents follow one another,
each starting on a chunk boundary; inside one, a group of m > P positions starts on a chunk
boundary and fills ceil(m / c) whole chunks (its chunks are then slot chunks), and a smaller group
takes a block of the next power of two p >= m slots. Those blocks are placed largest first into
runs of P slots, one run at the start of each chunk: every block then starts at a multiple of its
size and never straddles a chunk, so a small group (a single chunk of its own) sees all of itself
and other groups sharing its chunk are masked. Padding a small group to whole chunks instead would
cost c slots per occupied (document, bucket) group, c times N for short documents. A document's
slots relative to its chunks depend on that document alone, so even the rounding in its chunks'
sums does not depend on other documents. Np < 2N + c n' for a power-of-two c (< 4N + c n'
otherwise), n' the number of non-empty documents (a document shorter than c still takes a chunk).

Cost: O(N log N) for the sorts, O(R Np c D) = O(R (N + c n') c D) for the attention,
O(R Np (c + D)) memory (each chunk's keys copied next to the previous chunk's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .checks import (
    check_key_padding_mask,
    check_scale,
    compute_dtype,
    finite_max,
    no_autocast,
    sanitize_padded,
    shape_str,
)
from .varlen import check_cu_seqlens, int64_offsets

__all__ = ["lsh_attention", "lsh_attention_reference"]


def _check_int(fn: str, name: str, value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int ({what}), got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{fn}: {name} must be >= 1 ({what}), got {value}")
    return value


def _validate(fn, qk, v, n_hashes, bucket_size, key_padding_mask, cu_seqlens) -> int:
    """Checks every argument; returns the number of buckets N / bucket_size."""
    for name, t in (("qk", qk), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: {name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must have 4 dimensions (B, H, N, D), got shape {shape_str(t)}")
    if qk.dtype != v.dtype:
        raise TypeError(f"{fn}: qk and v must share one dtype, got qk {qk.dtype}, v {v.dtype}")
    if qk.device != v.device:
        raise ValueError(f"{fn}: qk and v must be on one device, got qk {qk.device}, v {v.device}")
    if qk.shape[:3] != v.shape[:3]:
        raise ValueError(f"{fn}: qk (B, H, N, D) and v (B, H, N, Dv) must share B, H and N, got qk {shape_str(qk)} and v {shape_str(v)}")
    check_key_padding_mask(fn, key_padding_mask, qk)
    if cu_seqlens is not None:
        if qk.shape[0] != 1:  # checked here too, to name both of this function's tensors
            raise ValueError(f"{fn}: with cu_seqlens the documents are packed along N and the batch size must be 1, "
                             f"got qk {shape_str(qk)} and v {shape_str(v)}")
        check_cu_seqlens(fn, cu_seqlens, qk)
    _check_int(fn, "n_hashes", n_hashes, "the number of hash rounds")
    _check_int(fn, "bucket_size", bucket_size, "the chunk length; N / bucket_size buckets")
    n = qk.shape[2]
    if n % bucket_size:
        raise ValueError(
            f"{fn}: bucket_size must divide the sequence length N (there are N / bucket_size buckets), "
            f"got bucket_size {bucket_size} and N = {n} from qk {shape_str(qk)}"
            + (" (with cu_seqlens N is the packed length; the documents' own lengths may be anything)"
               if cu_seqlens is not None else "")
        )
    return n // bucket_size


def _rotations(d: int, n_hashes: int, n_buckets: int, generator, device, dtype) -> Tensor:
    """Random rotations ``R (D, R, ceil(Nbk / 2))``: standard normal float32 drawn from
    ``generator`` on its device (the global generator when None), then cast and moved."""
    where = generator.device if generator is not None else torch.device("cpu")
    r = torch.randn(d, n_hashes, (n_buckets + 1) // 2, generator=generator, device=where, dtype=torch.float32)
    return r.to(device=device, dtype=dtype)


def _prepare(qk, v, n_hashes, n_buckets, key_padding_mask, generator, dt):
    """Queries, unit keys, values in ``dt`` with padding zeroed, and the buckets ``(B, H, R, N)``:
    padded positions get bucket Nbk, after every real one."""
    qk = sanitize_padded(qk, key_padding_mask).to(dt)
    v = sanitize_padded(v, key_padding_mask).to(dt)
    k = qk / qk.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)  # (B, H, N, D)
    rot = _rotations(qk.shape[-1], n_hashes, n_buckets, generator, qk.device, dt)
    with torch.no_grad():
        proj = torch.einsum("bhnd,dre->bhrne", k, rot)  # (B, H, R, N, ceil(Nbk/2))
        if n_buckets == 0:  # N = 0: nothing to hash, and argmax over zero buckets is undefined
            buckets = proj.new_zeros(proj.shape[:-1], dtype=torch.long)  # (B, H, R, 0)
        else:
            buckets = torch.cat([proj, -proj], dim=-1)[..., :n_buckets].argmax(-1)  # (B, H, R, N)
        if key_padding_mask is not None:
            buckets = buckets.masked_fill(~key_padding_mask[:, None, None, :], n_buckets)
    return qk, k, v, buckets


def _combine_rounds(o: Tensor, lse: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``o (B,H,R,N,Dv)`` and ``lse (B,H,R,N)`` (-inf: nothing attended) -> ``(B,H,N,Dv)``.

    Round r weighs ``exp(lse_r) / sum_r exp(lse_r)``. A position with nothing in any round gets its
    own value (zeros if it is padding). Written so that no -inf reaches a gradient.
    """
    top = finite_max(lse, 2).detach()  # (B, H, 1, N)
    w = torch.exp(lse - top)  # 0 for a round with nothing
    total = w.sum(2, keepdim=True)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    out = (w[..., None] * o).sum(2)  # (B, H, N, Dv)
    alone = (total == 0).squeeze(2)[..., None]  # (B, H, N, 1)
    if key_padding_mask is not None:
        v = torch.where(key_padding_mask[:, None, :, None], v, torch.zeros_like(v))
    return torch.where(alone, v, out)


def _masked_softmax_lse(scores: Tensor, allowed: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim restricted to ``allowed``, times ``values``, and the row's
    log-sum-exp (-inf for a row with nothing allowed, whose output is 0). No NaN, even in gradients."""
    top = finite_max(torch.where(allowed, scores, torch.full_like(scores, float("-inf"))), -1).detach()
    e = torch.where(allowed, torch.exp(scores - top), torch.zeros_like(scores))
    z = e.sum(-1, keepdim=True)
    some = z > 0
    z_safe = torch.where(some, z, torch.ones_like(z))
    out = (e @ values) / z_safe
    lse = torch.where(some, torch.log(z_safe) + top, torch.full_like(z, float("-inf")))
    return out, lse.squeeze(-1)


class _ChunkAttention(torch.autograd.Function):
    """``_masked_softmax_lse(q k^T * scale, allowed, v)`` for chunks ``q (.., c, D)``,
    ``k (.., K, D)``, ``v (.., K, Dv)``, ``allowed (.., c, K)`` with its own backward.

    Saves the inputs, the output and the log-sum-exp, and rebuilds the probabilities in backward
    (as flash attention does), instead of autograd keeping the scores, their exponentials and the
    masked copies: at N = 16384 that is the difference between ~1 GB and ~3 GB.
    The log-sum-exp has a gradient too (it weighs the hash rounds).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float):
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (.., c, K)
        scores.masked_fill_(~allowed, float("-inf"))
        top = finite_max(scores, -1)
        p = scores.sub_(top).exp_()  # exp(-inf) = 0 where not allowed
        z = p.sum(-1, keepdim=True)
        some = z > 0
        z = torch.where(some, z, torch.ones_like(z))
        out = torch.matmul(p, v).div_(z)  # (.., c, Dv)
        lse = torch.where(some, z.log() + top, torch.full_like(z, float("-inf"))).squeeze(-1)
        ctx.save_for_backward(q, k, v, allowed, out, lse)
        ctx.scale = scale
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor, d_lse: Tensor):
        q, k, v, allowed, out, lse = ctx.saved_tensors
        scale = ctx.scale
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).sub_(lse_safe).exp_()
        p.masked_fill_(~allowed, 0.0)  # (.., c, K): the probabilities of the forward pass
        dv = torch.matmul(p.transpose(-1, -2), d_out)
        # d score_ij = p_ij (d_out_i . v_j - d_out_i . out_i + d_lse_i)
        delta = (d_out * out).sum(-1, keepdim=True) - d_lse[..., None]  # (.., c, 1)
        ds = torch.matmul(d_out, v.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
        del p
        dq = torch.matmul(ds, k)
        dk = torch.matmul(ds.transpose(-1, -2), q)
        return dq, dk, dv, None, None


def lsh_attention(
    qk: Tensor,
    v: Tensor,
    *,
    n_hashes: int,
    bucket_size: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Reformer LSH attention with shared queries and keys (Kitaev et al., arXiv 2001.04451).

    Args:
        qk: ``(B, H, N, D)`` shared query/key vectors; keys are ``qk / ||qk||``.
        v: ``(B, H, N, Dv)`` values.
        n_hashes: number of hash rounds R >= 1; more rounds, closer to full attention.
        bucket_size: chunk length c; must divide N. There are N / c buckets.
        causal: position i attends only positions j < i.
        key_padding_mask: bool ``(B, N)``, True = a real position, False = padding. Padding is
            hashed into no bucket, attends nothing and is attended by nothing: its content (even
            NaN) never reaches an output or a real input's gradient; its output is zeros.
        scale: logit scale, ``1/sqrt(D)`` when None.
        generator: draws the rotations R ``(D, n_hashes, ceil(N / c / 2))``, standard normal
            float32 on the generator's device (the global generator when None). The same generator
            state gives the same buckets and output.
        cu_seqlens: integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., c_n = N]`` of n documents packed
            along N (non-decreasing; empty documents allowed), with B = 1; None: one sequence per
            batch row. Rank and chunks are then per (document, bucket) group and nothing crosses
            a boundary: a document's outputs and gradients do not depend on any other document's
            content (bit for bit). The rotations are drawn once for the packed call, with
            N / c buckets of the packed N: c must divide N, not the documents' lengths. A
            document of one position returns its value. See the module docstring for the cost.

    Returns:
        ``(B, H, N, Dv)`` in the input dtype (computed in float32 for half inputs). A position with
        nothing else to attend in every round returns its own value.
    """
    fn = "lsh_attention"
    n_buckets = _validate(fn, qk, v, n_hashes, bucket_size, key_padding_mask, cu_seqlens)
    cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
    scale = check_scale(fn, scale, qk.shape[-1])
    with no_autocast(qk.device.type):
        dt = compute_dtype(qk.dtype)
        q, k, v, buckets = _prepare(qk, v, n_hashes, n_buckets, key_padding_mask, generator, dt)
        o, lse = _bucketed(q, k, v, buckets, n_buckets, bucket_size, causal, scale, cu_seqlens)
        return _combine_rounds(o, lse, v, key_padding_mask).to(qk.dtype)


def _document_of(cu_seqlens: Tensor | None, n: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """For every position: its document, that document's first position and its length, each
    ``(N,)`` int64. Without ``cu_seqlens`` the call is one document ``[0, N)``."""
    pos = torch.arange(n, device=device)
    if cu_seqlens is None:
        zero = torch.zeros_like(pos)
        return zero, zero, torch.full_like(pos, n)
    # right=True: an empty document (c_i == c_{i+1}) owns no position
    doc = torch.searchsorted(cu_seqlens[1:], pos, right=True)  # (N,)
    start = cu_seqlens[doc]
    return doc, start, cu_seqlens[doc + 1] - start


def _bucketed(q, k, v, buckets, n_buckets: int, c: int, causal: bool, scale: float, cu_seqlens: Tensor | None):
    """Attention inside per-group chunks for every round: ``o (B,H,R,N,Dv)``, ``lse (B,H,R,N)``.

    A group is the positions of one (document, bucket) pair of one round; the slot layout is
    described in the module docstring."""
    B, H, N, D = q.shape
    R, Dv = buckets.shape[2], v.shape[-1]
    G = B * H * R
    dev = q.device
    levels = c.bit_length() - 1  # log2(P)
    P = 1 << levels  # the largest power of two <= c
    with torch.no_grad():
        h = buckets.reshape(G, N)  # padding has bucket Nbk
        doc, start, length = _document_of(cu_seqlens, N, dev)  # (N,) each
        pos = torch.arange(N, device=dev)
        # (document, bucket, position) in one int64 key below N (Nbk + 1): document d's keys fill
        # [(Nbk+1) start_d, (Nbk+1) (start_d + length_d)), so the key does not grow with n.
        key = (n_buckets + 1) * start + h * length + (pos - start)  # (G, N); bucket * N + pos for one document
        order = torch.sort(key).indices  # (G, N)
        h_sorted = h.gather(1, order)
        doc_sorted = doc[order]  # (G, N)
        real = h_sorted < n_buckets  # (G, N) padding sorts last in its document and is no group's member
        new = torch.ones_like(real)
        new[:, 1:] = (h_sorted[:, 1:] != h_sorted[:, :-1]) | (doc_sorted[:, 1:] != doc_sorted[:, :-1])
        gid = new.cumsum(1) - 1  # (G, N): dense group ids in (document, bucket) order, < N
        idx = torch.arange(N, device=dev).expand(G, N)
        rank = idx - torch.where(new, idx, 0).cummax(1).values  # rank in its group, (G, N)
        size = torch.zeros(G, N, dtype=torch.long, device=dev).scatter_add_(1, gid, real.long())  # m per group id
        gdoc = torch.full((G, N), -1, dtype=torch.long, device=dev).scatter_(1, gid, doc_sorted)  # -1: unused id (no slots)
        # a group of more than P positions starts on a chunk boundary and fills whole chunks, so its
        # chunks are slot chunks; a smaller one takes a power-of-two block of p >= m slots
        full = size > P
        small = (size > 0) & ~full
        mant, expo = torch.frexp(size.to(torch.float64))  # exact: m = mant 2^expo, mant in [0.5, 1)
        p_exp = (expo - (mant == 0.5).long()).clamp(0, levels)  # ceil(log2 m) for small groups
        p = torch.where(small, torch.ones_like(p_exp) << p_exp, 0)  # (G, N)
        f = torch.where(full, -(-size // c) * c, 0)  # (G, N) slots of a full group
        # gfirst: the first group id of every group's document (groups of a document are consecutive)
        newdoc = torch.ones_like(real)
        newdoc[:, 1:] = gdoc[:, 1:] != gdoc[:, :-1]
        gfirst = torch.where(newdoc, idx, 0).cummax(1).values  # (G, N)
        # small groups of a document, largest first: every block then starts at a multiple of its
        # size inside a run of P slots, so it never straddles a chunk boundary
        lev = torch.where(small, levels - p_exp, levels + 1)
        placed = torch.sort((gfirst * (levels + 2) + lev) * N + idx).indices  # (G, N) group ids
        p_placed = p.gather(1, placed)
        u = p_placed.cumsum(1) - p_placed
        # a document's groups stay consecutive in this order, from index gfirst on
        u = u - u.gather(1, gfirst.gather(1, placed))
        u = torch.empty_like(u).scatter_(1, placed, u)  # (G, N) offset in the document's run of small blocks
        f_excl = f.cumsum(1) - f
        f_doc = torch.zeros_like(f).scatter_add_(1, gfirst, f)  # at each document's gfirst
        u_doc = torch.zeros_like(p).scatter_add_(1, gfirst, p)
        region = f_doc + -(-u_doc // P) * c  # (G, N): whole chunks per document, at its gfirst
        doc_base = (region.cumsum(1) - region).gather(1, gfirst)  # first slot of each group's document
        base = torch.where(
            full,
            doc_base + f_excl - f_excl.gather(1, gfirst),
            doc_base + f_doc.gather(1, gfirst) + (u // P) * c + u % P,  # run u // P of P slots
        )  # (G, N): first slot of every group
        np_ = int(region.sum(1).max()) if G and N else 0  # slots per round; no rounds when B*H = 0
        slot = torch.where(real, base.gather(1, gid) + rank, np_)  # (G, N); padding -> dump slot
        tok = torch.full((G, np_ + 1), -1, dtype=torch.long, device=dev).scatter_(1, slot, order)[:, :np_]
        slot_group = torch.full((G, np_ + 1), -1, dtype=torch.long, device=dev).scatter_(1, slot, gid)[:, :np_]
        slot_of_tok = torch.empty_like(order).scatter_(1, order, slot)  # (G, N), Np for padding
        tok = tok.clamp_min(0)
        # flat row index into (B*H*N, X) of each slot's position
        rows = (torch.arange(B * H, device=dev).repeat_interleave(R)[:, None] * N + tok).reshape(-1)

    nc = np_ // c
    qs = q.reshape(B * H * N, D)[rows].view(G, nc, c, D)
    ks = k.reshape(B * H * N, D)[rows].view(G, nc, c, D)
    vs = v.reshape(B * H * N, Dv)[rows].view(G, nc, c, Dv)

    def look_back(x: Tensor, fill) -> Tensor:
        """``(G, Nc, c, *)`` -> ``(G, Nc, 2c, *)``: the previous chunk (``fill`` before the first), then this one."""
        prev = torch.cat([torch.full_like(x[:, :1], fill), x[:, :-1]], dim=1)
        return torch.cat([prev, x], dim=2)

    kw, vw = look_back(ks, 0), look_back(vs, 0)  # (G, Nc, 2c, D|Dv)
    del ks, vs  # R * Np * (D + Dv) floats each: free them before the scores exist
    pq = tok.view(G, nc, c)
    gq = slot_group.view(G, nc, c)
    pk, gk = look_back(pq, -1), look_back(gq, -1)  # (G, Nc, 2c); -1: no key
    allowed = (gk[:, :, None, :] == gq[..., None]) & (gk[:, :, None, :] >= 0)  # same group, a real key
    allowed &= pk[:, :, None, :] != pq[..., None]  # never itself (the fallback is handled later)
    if causal:
        allowed &= pk[:, :, None, :] <= pq[..., None]
    o, lse = _ChunkAttention.apply(qs, kw, vw, allowed, scale)  # (G, Nc, c, Dv), (G, Nc, c)
    # back to positions; padding reads the appended empty slot
    o = torch.cat([o.reshape(G, np_, Dv), o.new_zeros(G, 1, Dv)], 1)
    lse = torch.cat([lse.reshape(G, np_), lse.new_full((G, 1), float("-inf"))], 1)
    o = o.gather(1, slot_of_tok[..., None].expand(G, N, Dv)).view(B, H, R, N, Dv)
    lse = lse.gather(1, slot_of_tok).view(B, H, R, N)
    return o, lse


def lsh_attention_reference(
    qk: Tensor,
    v: Tensor,
    *,
    n_hashes: int,
    bucket_size: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    generator: torch.Generator | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The same attention from the definition, without sorting: for each round an explicit (N, N)
    mask "j is in i's group (its bucket, and its document when ``cu_seqlens`` is given), its rank
    there is in i's chunk or the one before, j != i (and j < i when causal)", a masked softmax,
    and the same log-sum-exp combination. Same contract, arguments and shapes (and the same
    rotations for the same generator state) as :func:`lsh_attention`; tests trust this one, in
    float64. O(R N^2) time and memory."""
    fn = "lsh_attention_reference"
    n_buckets = _validate(fn, qk, v, n_hashes, bucket_size, key_padding_mask, cu_seqlens)
    cu_seqlens = None if cu_seqlens is None else int64_offsets(cu_seqlens)  # the checked offsets, int64
    scale = check_scale(fn, scale, qk.shape[-1])
    dt = compute_dtype(qk.dtype)
    q, k, v, buckets = _prepare(qk, v, n_hashes, n_buckets, key_padding_mask, generator, dt)
    N = qk.shape[2]
    i = torch.arange(N, device=qk.device)[:, None]
    j = torch.arange(N, device=qk.device)[None, :]
    same = (buckets[..., :, None] == buckets[..., None, :]) & (buckets[..., None, :] < n_buckets)  # (B,H,R,N,N)
    if cu_seqlens is not None:
        doc = _document_of(cu_seqlens, N, qk.device)[0]  # (N,)
        same = same & (doc[:, None] == doc[None, :])  # one group: same bucket AND same document
    chunk = (same & (j < i)).sum(-1) // bucket_size  # (B, H, R, N): rank in its group // c
    dchunk = chunk[..., :, None] - chunk[..., None, :]
    allowed = same & (j != i) & ((dchunk == 0) | (dchunk == 1))
    if causal:
        allowed = allowed & (j <= i)
    scores = (q @ k.transpose(-1, -2))[:, :, None] * scale  # (B, H, 1, N, N)
    o, lse = _masked_softmax_lse(scores.expand_as(allowed), allowed, v[:, :, None])
    return _combine_rounds(o, lse, v, key_padding_mask).to(qk.dtype)
