"""softmax_attention and efficient_attention against the independent float64 references."""

import pytest
import torch

import linattn
from linattn.functional import efficient_attention_reference, softmax_attention_reference

import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 2, 63, 64, 65, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_reference(causal, N, masked):
    D = {1: 16, 2: 60, 63: 64, 64: 16, 65: 60, 1000: 64}[N]
    B, H = (2, 2) if N < 1000 else (2, 1)
    q, k, v = make_qkv(B, H, N, N, D, 24, seed=N)
    mask = make_mask(B, N, seed=N) if masked else None
    out = linattn.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask, scale=0.3)
    expected = ref.softmax_attention(q, k, v, causal=causal, mask=mask, scale=0.3)
    assert_close(out, expected)
    for name, g, ge in zip("qkv", grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert torch.isfinite(g).all()
        assert_close(g, ge, msg=name)
    lib = softmax_attention_reference(q, k, v, causal=causal, key_padding_mask=mask, scale=0.3)
    assert_close(lib, expected)


def test_softmax_cross_and_default_scale():
    q, k, v = make_qkv(2, 2, 7, 130, 60, 9)
    mask = make_mask(2, 130)
    out = linattn.softmax_attention(q, k, v, key_padding_mask=mask)
    assert_close(out, ref.softmax_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("content", ["huge", "nan"])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_padding_content_never_leaks(content, causal):
    B, H, N, extra = 2, 2, 40, 9
    q, k, v = make_qkv(B, H, N, N, 16, 8)
    mask = make_mask(B, N, all_padded_row=False)
    mask[:, 0] = True
    out = linattn.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    val = 1e30 if content == "huge" else float("nan")
    k2 = torch.cat([k.detach(), torch.full((B, H, extra, 16), val, dtype=k.dtype)], 2).requires_grad_()
    v2 = torch.cat([v.detach(), torch.full((B, H, extra, 8), val, dtype=k.dtype)], 2).requires_grad_()
    q2 = torch.cat([q.detach(), torch.randn(B, H, extra, 16, dtype=k.dtype)], 2) if causal else q.detach()
    q2.requires_grad_()
    mask2 = torch.cat([mask, torch.zeros(B, extra, dtype=torch.bool)], 1)
    out2 = linattn.softmax_attention(q2, k2, v2, causal=causal, key_padding_mask=mask2)
    assert_close(out2[:, :, :N], out)
    g1, g2 = grads(out, (q, k, v)), grads(out2[:, :, :N], (q2, k2, v2))
    for a, b in zip(g2, g1):
        assert torch.isfinite(a).all()
        assert_close(a[:, :, :N], b)


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_query_without_keys_gets_zeros(causal):
    q, k, v = make_qkv(2, 2, 10, 10, 8, 8)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    mask[0, :4] = False  # left padding: causal queries 0..3 of batch 0 see no key
    out = linattn.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    if causal:
        assert torch.equal(out[0, :, :4], torch.zeros_like(out[0, :, :4]))
    assert_close(out, ref.softmax_attention(q, k, v, causal=causal, mask=mask))
    for g in grads(out, (q, k, v)):
        assert torch.isfinite(g).all()


def test_softmax_empty():
    q, k, v = make_qkv(1, 2, 3, 0, 8, 5)
    out = linattn.softmax_attention(q, k, v)
    assert out.shape == (1, 2, 3, 5) and torch.equal(out, torch.zeros_like(out))
    q, k, v = make_qkv(1, 2, 0, 0, 8, 5)
    assert linattn.softmax_attention(q, k, v, causal=True).shape == (1, 2, 0, 5)


def test_softmax_causality():
    q, k, v = make_qkv(1, 2, 50, 50, 16, 8, requires_grad=False)
    out = linattn.softmax_attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] *= 50
    v2[:, :, 20:] += 1e6
    out2 = linattn.softmax_attention(q, k2, v2, causal=True)
    assert_close(out2[:, :, :20], out[:, :, :20], atol=1e-12, rtol=0)


@pytest.mark.parametrize("nq,nk", [(1, 1), (2, 2), (63, 63), (64, 65), (65, 1000), (1000, 63)])
@pytest.mark.parametrize("masked", [False, True])
def test_efficient_matches_reference(nq, nk, masked):
    D = {1: 16, 2: 60, 63: 64, 64: 16, 65: 60, 1000: 64}[nq]
    q, k, v = make_qkv(2, 2, nq, nk, D, 11, seed=nk)
    mask = make_mask(2, nk, seed=nk) if masked else None
    out = linattn.efficient_attention(q, k, v, key_padding_mask=mask)
    expected = ref.efficient_attention(q, k, v, mask=mask)
    assert_close(out, expected)
    for name, g, ge in zip("qkv", grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert torch.isfinite(g).all()
        assert_close(g, ge, msg=name)
    assert_close(efficient_attention_reference(q, k, v, key_padding_mask=mask), expected)
    if masked:
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # batch 1 is all padding


@pytest.mark.parametrize("content", ["random", "huge", "nan"])
def test_efficient_padding_content_never_leaks(content):
    q, k, v = make_qkv(2, 2, 30, 30, 16, 8)
    mask = make_mask(2, 30, all_padded_row=False)
    out = linattn.efficient_attention(q, k, v, key_padding_mask=mask)
    fill = {"random": torch.randn, "huge": lambda *s, **kw: torch.full(s, 1e30, **kw),
            "nan": lambda *s, **kw: torch.full(s, float("nan"), **kw)}[content]
    k2 = torch.cat([k.detach(), fill(2, 2, 5, 16, dtype=k.dtype)], 2).requires_grad_()
    v2 = torch.cat([v.detach(), fill(2, 2, 5, 8, dtype=k.dtype)], 2).requires_grad_()
    mask2 = torch.cat([mask, torch.zeros(2, 5, dtype=torch.bool)], 1)
    out2 = linattn.efficient_attention(q, k2, v2, key_padding_mask=mask2)
    assert_close(out2, out)
    for a, b in zip(grads(out2, (q, k2, v2)), grads(out, (q, k, v))):
        assert torch.isfinite(a).all()
        assert_close(a[:, :, : b.shape[2]], b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_efficient_and_softmax_half(dtype):
    q, k, v = make_qkv(1, 2, 100, 100, 32, 32, dtype=torch.float32, requires_grad=False)
    for f in (linattn.efficient_attention, linattn.softmax_attention):
        out = f(q.to(dtype), k.to(dtype), v.to(dtype))
        assert out.dtype == dtype
        assert (out.float() - f(q, k, v)).abs().max() < 3e-2


def test_efficient_autocast_keeps_float32_sums():
    q, k, v = make_qkv(1, 2, 500, 500, 32, 32, dtype=torch.float32, requires_grad=False)
    plain = linattn.efficient_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = linattn.efficient_attention(q, k, v)
    assert auto.dtype == torch.float32 and (auto - plain).abs().max() < 1e-6
