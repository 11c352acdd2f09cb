"""lsh_attention with packed documents (cu_seqlens): the fast form against the library reference
and against a one-query-at-a-time reference run on each document alone with the packed call's
buckets; no information crossing a document boundary (bit-identical outputs of the other
documents when one document changes); one document is the plain call; padding; errors."""

import pytest
import torch

import linattn
from linattn.functional import lsh_attention_reference

import reference as ref
from conftest import assert_close, grads, make_mask


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def _qk_v(H, N, D, Dv, seed=0):
    g = _gen(seed)
    qk = torch.randn(1, H, N, D, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, H, N, Dv, generator=g, dtype=torch.float64).requires_grad_()
    return qk, v


def _many_short(n_docs, total, seed):
    """n_docs lengths summing to total, with empty documents and documents of length 1."""
    g = _gen(seed)
    cuts = torch.sort(torch.randint(0, total + 1, (n_docs - 1,), generator=g)).values.tolist()
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    lengths[:4] = [0, 1, lengths[0] + lengths[1] + lengths[2] + lengths[3] - 1, 0]  # same total
    return lengths


# (lengths, bucket_size, n_hashes): documents of length 1, empty ones (first, middle, last),
# lengths that are not multiples of bucket_size, and 30 short documents
CASES = [
    ([7, 1, 0, 13, 3], 4, 2),
    ([0, 1, 1, 10, 0, 12, 0], 3, 3),
    ([23, 1], 6, 1),
    (_many_short(30, 120, seed=3), 4, 2),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths,c,R", CASES, ids=["mixed", "empty-ones", "two", "30-short"])
def test_fast_matches_reference_with_documents(causal, lengths, c, R):
    """Outputs and gradients of qk and v: fast == library reference (an explicit (N, N) mask)."""
    N = sum(lengths)
    cu = _cu(lengths)
    qk, v = _qk_v(2, N, 3, 5, seed=N)  # D = 3: uneven buckets, several chunks in some groups
    kw = dict(n_hashes=R, bucket_size=c, causal=causal, cu_seqlens=cu)
    out = linattn.lsh_attention(qk, v, **kw, generator=_gen(R))
    expected = lsh_attention_reference(qk, v, **kw, generator=_gen(R))
    assert out.shape == (1, 2, N, 5) and out.dtype == torch.float64
    assert_close(out, expected, msg="output")
    for name, g, ge in zip(["qk", "v"], grads(out, (qk, v)), grads(expected, (qk, v))):
        assert torch.isfinite(g).all()
        assert_close(g, ge, msg=f"grad {name}")
    # a document of length 1 has nothing else to attend: its output is its own value
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b - a == 1:
            assert torch.equal(out[:, :, a], v[:, :, a])


@pytest.mark.parametrize("causal", [False, True])
def test_each_document_is_its_own_sequence_with_the_packed_buckets(causal):
    """Independent of the library's document ids: a one-query-at-a-time reference run on each
    document alone, with the buckets the packed call drew for that document's positions (same
    rotations), gives the packed output. Rank and chunk are then per (document, bucket)."""
    lengths, c, R, D = [9, 0, 1, 14, 8], 4, 2, 3
    N = sum(lengths)
    cu = _cu(lengths)
    qk, v = _qk_v(1, N, D, 4, seed=11)
    out = linattn.lsh_attention(qk, v, n_hashes=R, bucket_size=c, causal=causal, cu_seqlens=cu, generator=_gen(5))
    rot = torch.randn(D, R, (N // c + 1) // 2, generator=_gen(5)).double()  # the documented draw
    buckets = ref.lsh_buckets(qk.detach(), rot, N // c)  # (1, 1, R, N)
    parts = [ref.lsh_attention_loops(qk[:, :, a:b], v[:, :, a:b], buckets[..., a:b], c, causal=causal)
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]  # the loops need N >= 1
    expected = torch.cat(parts, dim=2)
    assert_close(out, expected, msg="output")
    for name, g, ge in zip(["qk", "v"], grads(out, (qk, v)), grads(expected, (qk, v))):
        assert_close(g, ge, msg=f"grad {name}")


@pytest.mark.parametrize("fn", [linattn.lsh_attention, lsh_attention_reference], ids=["fast", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("changed", [0, 2, 4])
def test_other_documents_are_bit_identical_when_one_changes(fn, causal, changed):
    """Every token of one document is replaced; every other document's output (and the gradients
    of its inputs) must not move by a single bit. With documents sharing a bucket's rank (a sort by (bucket, position) alone),
    the chunk of a position would depend on how many positions of earlier documents share its
    bucket, and this fails, causal too: D = 2 makes the 20 buckets uneven, so some buckets span
    three or more chunks and a causal query's chunk neighbours move."""
    lengths, c = [19, 1, 22, 0, 21, 17], 4
    N = sum(lengths)
    cu = _cu(lengths)
    qk, v = _qk_v(2, N, 2, 3, seed=1)
    kw = dict(n_hashes=3, bucket_size=c, causal=causal, cu_seqlens=cu)
    a, b = int(cu[changed]), int(cu[changed + 1])
    other = torch.ones(N, dtype=torch.bool)
    other[a:b] = False
    qk2, v2 = qk.detach().clone(), v.detach().clone()
    g = _gen(99)
    qk2[:, :, a:b] = torch.randn(qk2[:, :, a:b].shape, generator=g, dtype=torch.float64)
    v2[:, :, a:b] = torch.randn(v2[:, :, a:b].shape, generator=g, dtype=torch.float64)
    qk2.requires_grad_(), v2.requires_grad_()
    out = fn(qk, v, **kw, generator=_gen(4))
    out2 = fn(qk2, v2, **kw, generator=_gen(4))
    assert not torch.equal(out[:, :, a:b], out2[:, :, a:b])  # the change did reach its own document
    assert torch.equal(out[:, :, other], out2[:, :, other])
    # the gradients of the other documents' inputs, for one cotangent, are bit-identical too
    for g, g2 in zip(grads(out, (qk, v)), grads(out2, (qk2, v2))):
        assert torch.equal(g[:, :, other], g2[:, :, other])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_one_document_is_the_plain_call(causal, masked):
    N = 48
    qk, v = _qk_v(3, N, 6, 5, seed=2)
    mask = make_mask(1, N, seed=2) if masked else None
    kw = dict(n_hashes=2, bucket_size=6, causal=causal, key_padding_mask=mask)
    plain = linattn.lsh_attention(qk, v, **kw, generator=_gen(3))
    packed = linattn.lsh_attention(qk, v, **kw, generator=_gen(3), cu_seqlens=_cu([N]))
    assert torch.equal(plain, packed)
    for g, gp in zip(grads(plain, (qk, v)), grads(packed, (qk, v))):
        assert torch.equal(g, gp)
    ref_plain = lsh_attention_reference(qk, v, **kw, generator=_gen(3))
    assert torch.equal(ref_plain, lsh_attention_reference(qk, v, **kw, generator=_gen(3), cu_seqlens=_cu([N])))


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_with_documents(causal):
    """Padding inside documents (and a document that is all padding): fast == reference, padded
    outputs are zeros, and padding content (NaN) reaches no real output or gradient."""
    lengths, c = [11, 3, 0, 17, 5], 4
    N = sum(lengths)
    cu = _cu(lengths)
    qk, v = _qk_v(2, N, 4, 3, seed=5)
    mask = make_mask(1, N, seed=5)
    mask[0, 11:14] = False  # the second document is all padding
    kw = dict(n_hashes=2, bucket_size=c, causal=causal, key_padding_mask=mask, cu_seqlens=cu)
    out = linattn.lsh_attention(qk, v, **kw, generator=_gen(6))
    expected = lsh_attention_reference(qk, v, **kw, generator=_gen(6))
    assert_close(out, expected, msg="output")
    g_out = grads(out, (qk, v))
    for g, ge in zip(g_out, grads(expected, (qk, v))):
        assert_close(g, ge)
    pad = ~mask[:, None, :, None]
    assert torch.equal(out * pad, torch.zeros_like(out))
    qk2 = torch.where(pad, torch.full_like(qk, float("nan")), qk).detach().requires_grad_()
    v2 = torch.where(pad, torch.full_like(v, float("nan")), v).detach().requires_grad_()
    out2 = linattn.lsh_attention(qk2, v2, **kw, generator=_gen(6))
    assert_close(out2, out)
    for g2, g in zip(grads(out2, (qk2, v2)), g_out):
        assert torch.isfinite(g2).all()
        assert_close(g2, g)


@pytest.mark.parametrize("fn", [linattn.lsh_attention, lsh_attention_reference], ids=["fast", "reference"])
def test_cu_seqlens_errors(fn):
    qk, v = _qk_v(2, 12, 8, 6)
    kw = dict(n_hashes=1, bucket_size=4)
    name = fn.__name__
    with pytest.raises(TypeError, match=f"{name}: cu_seqlens must have an integer dtype.*torch.float32"):
        fn(qk, v, **kw, cu_seqlens=torch.tensor([0.0, 5.0, 12.0]))
    with pytest.raises(TypeError, match=f"{name}: cu_seqlens must be an integer tensor.*or None, got list"):
        fn(qk, v, **kw, cu_seqlens=[0, 5, 12])
    with pytest.raises(ValueError, match=f"{name}: cu_seqlens must start at 0, got 1"):
        fn(qk, v, **kw, cu_seqlens=torch.tensor([1, 5, 12]))
    with pytest.raises(ValueError, match=rf"{name}: cu_seqlens must end at T = 12 .*\(1, 2, 12, 8\).*got 11"):
        fn(qk, v, **kw, cu_seqlens=_cu([5, 6]))
    with pytest.raises(ValueError, match=rf"{name}: cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 7 > cu_seqlens\[2\] = 3"):
        fn(qk, v, **kw, cu_seqlens=torch.tensor([0, 7, 3, 12]))
    with pytest.raises(ValueError, match=rf"{name}: cu_seqlens must be 1-D.*\(2, 2\)"):
        fn(qk, v, **kw, cu_seqlens=torch.tensor([[0, 6], [6, 12]]))
    qk2, v2 = qk.detach().expand(2, -1, -1, -1), v.detach().expand(2, -1, -1, -1)
    with pytest.raises(ValueError, match=rf"{name}: with cu_seqlens.*batch size must be 1, got qk \(2, 2, 12, 8\)"):
        fn(qk2, v2, **kw, cu_seqlens=_cu([5, 7]))
    with pytest.raises(ValueError, match=rf"{name}: bucket_size must divide.*N = 12.*packed length"):
        fn(qk, v, n_hashes=1, bucket_size=5, cu_seqlens=_cu([5, 7]))
