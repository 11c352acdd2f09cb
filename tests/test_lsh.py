"""lsh_attention (Reformer) against a one-query-at-a-time reference, full attention, and its own
promises: causal means causal, more rounds come closer to full attention, padding never leaks."""

import pytest
import torch

import linattn
from linattn.functional import lsh_attention_reference

import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rotations(D, n_hashes, n_buckets, seed):
    """The documented draw: standard normal float32 (D, n_hashes, ceil(n_buckets / 2))."""
    return torch.randn(D, n_hashes, (n_buckets + 1) // 2, generator=_gen(seed)).double()


def _qk_v(B, H, N, D, Dv, seed=0):
    q, _, v = make_qkv(B, H, N, N, D, Dv, seed=seed)
    return q, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N,c,R", [(1, 1, 1), (12, 3, 1), (30, 5, 3), (33, 11, 2), (64, 4, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_one_query_at_a_time_reference(causal, N, c, R, masked):
    B, H, D = 2, 2, 6  # small D: buckets of uneven sizes, several chunks per bucket
    qk, v = _qk_v(B, H, N, D, 5, seed=N + c)
    mask = make_mask(B, N, seed=N) if masked else None
    out = linattn.lsh_attention(qk, v, n_hashes=R, bucket_size=c, causal=causal, key_padding_mask=mask,
                                generator=_gen(R))
    buckets = ref.lsh_buckets(qk.detach(), _rotations(D, R, N // c, R), N // c)
    expected = ref.lsh_attention_loops(qk, v, buckets, c, causal=causal, mask=mask)
    assert out.shape == (B, H, N, 5) and out.dtype == torch.float64
    assert_close(out, expected, msg="output")
    inputs = (qk, v) if N > 1 else (v,)  # alone, a position returns its value: qk is unused
    for name, g, ge in zip(["qk", "v"][-len(inputs):], grads(out, inputs), grads(expected, inputs)):
        assert torch.isfinite(g).all()
        assert_close(g, ge, msg=f"grad {name}")
    lib = lsh_attention_reference(qk, v, n_hashes=R, bucket_size=c, causal=causal, key_padding_mask=mask,
                                  generator=_gen(R))
    assert_close(lib, expected, msg="library reference")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [256, 1000])
def test_fast_form_matches_library_reference_at_larger_n(causal, N):
    qk, v = _qk_v(1, 2, N, 16, 8, seed=N)
    mask = make_mask(1, N, seed=N)
    kw = dict(n_hashes=3, bucket_size=N // 8 if N == 256 else 25, causal=causal, key_padding_mask=mask)
    out = linattn.lsh_attention(qk, v, **kw, generator=_gen(1))
    expected = lsh_attention_reference(qk, v, **kw, generator=_gen(1))
    assert_close(out, expected)
    for g, ge in zip(grads(out, (qk, v)), grads(expected, (qk, v))):
        assert_close(g, ge)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 63, 65])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_bucket_is_full_shared_qk_attention(causal, N, n_hashes):
    qk, v = _qk_v(2, 2, N, 16, 7, seed=N)
    mask = make_mask(2, N, seed=N)
    out = linattn.lsh_attention(qk, v, n_hashes=n_hashes, bucket_size=N, causal=causal, key_padding_mask=mask,
                                scale=0.5)
    expected = ref.shared_qk_attention(qk, v, causal=causal, mask=mask, scale=0.5)
    assert_close(out, expected)
    for g, ge in zip(grads(out, (qk, v)), grads(expected, (qk, v))):
        assert_close(g, ge)
    # the self rule is visible: the first causal position has nothing else and returns its value
    if causal and N > 1:
        first = out[0, :, 0] if mask[0, 0] else None
        if first is not None:
            assert_close(first, v[0, :, 0])


@pytest.mark.parametrize("t", [0, 17, 40])
def test_causal_never_looks_at_the_future(t):
    """Changing positions after t (their vectors, so their buckets too) leaves outputs <= t alone."""
    N = 48
    qk, v = _qk_v(2, 2, N, 8, 4, seed=t)
    mask = make_mask(2, N, seed=t, all_padded_row=False)
    kw = dict(n_hashes=4, bucket_size=4, causal=True, key_padding_mask=mask)
    out = linattn.lsh_attention(qk, v, **kw, generator=_gen(5))
    g = torch.Generator().manual_seed(99)
    qk2 = qk.detach().clone()
    v2 = v.detach().clone()
    qk2[:, :, t + 1:] = 3 * torch.randn(qk2[:, :, t + 1:].shape, generator=g, dtype=qk.dtype)
    v2[:, :, t + 1:] = torch.randn(v2[:, :, t + 1:].shape, generator=g, dtype=qk.dtype)
    out2 = linattn.lsh_attention(qk2, v2, **kw, generator=_gen(5))
    assert torch.equal(out2[:, :, : t + 1], out[:, :, : t + 1])
    assert not torch.equal(out2[:, :, t + 1:], out[:, :, t + 1:])  # the perturbation is real
    # and no gradient flows from an output to a later position
    gq, gv = torch.autograd.grad(out[:, :, : t + 1].sum(), (qk, v))
    assert torch.equal(gq[:, :, t + 1:], torch.zeros_like(gq[:, :, t + 1:]))
    assert torch.equal(gv[:, :, t + 1:], torch.zeros_like(gv[:, :, t + 1:]))


def test_more_hash_rounds_come_closer_to_full_attention():
    N, c = 128, 8
    errors = {R: [] for R in (1, 2, 8)}
    for seed in range(6):
        qk, v = _qk_v(1, 2, N, 16, 8, seed=seed)
        qk = 2 * qk  # peaked enough that the few nearest keys matter
        full = ref.shared_qk_attention(qk, v)
        for R in errors:
            out = linattn.lsh_attention(qk, v, n_hashes=R, bucket_size=c, generator=_gen(seed))
            errors[R].append((out - full).norm().item() / full.norm().item())
    mean = {R: sum(e) / len(e) for R, e in errors.items()}
    assert mean[1] > mean[2] > mean[8], mean


def test_deterministic_given_the_generator():
    qk, v = _qk_v(1, 2, 64, 16, 8, seed=0)
    a = linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=8, generator=_gen(1))
    b = linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=8, generator=_gen(1))
    c = linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=8, generator=_gen(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(7)
    d = linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=8)
    torch.manual_seed(7)
    assert torch.equal(d, linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=8))


@pytest.mark.parametrize("content", ["huge", "nan"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_content_never_leaks(content, causal):
    B, H, N = 2, 2, 60
    qk, v = _qk_v(B, H, N, 8, 5)
    mask = make_mask(B, N)
    kw = dict(n_hashes=3, bucket_size=6, causal=causal, key_padding_mask=mask)
    out = linattn.lsh_attention(qk, v, **kw, generator=_gen())
    pad = ~mask[:, None, :, None]
    val = 1e30 if content == "huge" else float("nan")
    qk2 = torch.where(pad, torch.full_like(qk, val), qk).detach().requires_grad_()
    v2 = torch.where(pad, torch.full_like(v, val), v).detach().requires_grad_()
    out2 = linattn.lsh_attention(qk2, v2, **kw, generator=_gen())
    assert_close(out2, out)
    assert torch.equal(out2 * pad, torch.zeros_like(out2))  # padded positions output zeros
    g2 = grads(out2, (qk2, v2))
    for a, b in zip(g2, grads(out, (qk, v))):
        assert torch.isfinite(a).all()
        assert_close(a, b)
    assert torch.equal(g2[0] * pad, torch.zeros_like(g2[0]))


@pytest.mark.parametrize("fn", [linattn.lsh_attention, lsh_attention_reference], ids=["fast", "reference"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_empty_sequence_gives_empty_output_and_gradients(fn, causal, masked, dtype):
    """N = 0 (so zero buckets): an empty (B, H, 0, Dv) output still attached to qk and v."""
    qk, v = _qk_v(2, 3, 0, 8, 5)
    qk, v = qk.detach().to(dtype).requires_grad_(), v.detach().to(dtype).requires_grad_()
    mask = torch.ones(2, 0, dtype=torch.bool) if masked else None
    out = fn(qk, v, n_hashes=3, bucket_size=4, causal=causal, key_padding_mask=mask, generator=_gen())
    assert out.shape == (2, 3, 0, 5) and out.dtype == dtype
    gq, gv = torch.autograd.grad(out, (qk, v), torch.ones_like(out))
    assert gq.shape == qk.shape and gv.shape == v.shape and gq.dtype == gv.dtype == dtype


@pytest.mark.parametrize("fn", [linattn.lsh_attention, lsh_attention_reference], ids=["fast", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_batch(fn, causal):
    qk, v = _qk_v(0, 2, 12, 8, 5)
    out = fn(qk, v, n_hashes=2, bucket_size=4, causal=causal, key_padding_mask=torch.ones(0, 12, dtype=torch.bool))
    assert out.shape == (0, 2, 12, 5)
    gq, gv = torch.autograd.grad(out, (qk, v), torch.ones_like(out))
    assert gq.shape == qk.shape and gv.shape == v.shape


def test_half_inputs():
    qk, v = _qk_v(1, 2, 64, 16, 8)
    qk, v = qk.detach().float(), v.detach().float()
    out = linattn.lsh_attention(qk.bfloat16(), v.bfloat16(), n_hashes=2, bucket_size=64, causal=True)
    assert out.dtype == torch.bfloat16
    full = linattn.lsh_attention(qk, v, n_hashes=2, bucket_size=64, causal=True)
    torch.testing.assert_close(out.float(), full, atol=3e-2, rtol=3e-2)


def test_errors():
    qk, v = _qk_v(2, 3, 12, 8, 6)
    with pytest.raises(ValueError, match=r"bucket_size must divide the sequence length N.*bucket_size 5 and N = 12.*\(2, 3, 12, 8\)"):
        linattn.lsh_attention(qk, v, n_hashes=1, bucket_size=5)
    with pytest.raises(ValueError, match="n_hashes must be >= 1.*got 0"):
        linattn.lsh_attention(qk, v, n_hashes=0, bucket_size=4)
    with pytest.raises(ValueError, match="bucket_size must be >= 1.*got 0"):
        linattn.lsh_attention(qk, v, n_hashes=1, bucket_size=0)
    with pytest.raises(TypeError, match="n_hashes must be an int.*float"):
        linattn.lsh_attention(qk, v, n_hashes=1.0, bucket_size=4)
    with pytest.raises(ValueError, match=r"must share B, H and N.*\(2, 3, 12, 8\).*\(2, 3, 11, 6\)"):
        linattn.lsh_attention(qk, v[:, :, :11], n_hashes=1, bucket_size=4)
    with pytest.raises(ValueError, match=r"qk must have 4 dimensions.*\(3, 12, 8\)"):
        linattn.lsh_attention(qk[0], v, n_hashes=1, bucket_size=4)
    with pytest.raises(TypeError, match="qk and v must share one dtype"):
        linattn.lsh_attention(qk, v.float(), n_hashes=1, bucket_size=4)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Nk\) = \(2, 12\)"):
        linattn.lsh_attention(qk, v, n_hashes=1, bucket_size=4, key_padding_mask=torch.ones(2, 11, dtype=torch.bool))
