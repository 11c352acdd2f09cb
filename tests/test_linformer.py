"""linformer_attention against its formula written out in float64, and the LinformerAttention module."""

import pytest
import torch

import linattn
from linattn.functional import linformer_attention_reference

import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv


def _proj(P, nk, *, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(P, nk, generator=g, dtype=dtype) / P**0.5).requires_grad_()
    f = (torch.randn(P, nk, generator=g, dtype=dtype) / P**0.5).requires_grad_()
    return e, f


@pytest.mark.parametrize("nq,nk,P", [(1, 1, 1), (63, 63, 8), (65, 65, 64), (7, 130, 33), (1000, 1000, 17)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_formula(nq, nk, P, masked):
    q, k, v = make_qkv(2, 2, nq, nk, 60, 9, seed=nk)
    e, f = _proj(P, nk, seed=P)
    mask = make_mask(2, nk, seed=nk) if masked else None
    out = linattn.linformer_attention(q, k, v, e, f, key_padding_mask=mask, scale=0.2)
    expected = ref.linformer_attention(q, k, v, e, f, mask=mask, scale=0.2)
    assert out.shape == (2, 2, nq, 9)
    assert_close(out, expected)
    for name, g, ge in zip(["q", "k", "v", "e", "f"], grads(out, (q, k, v, e, f)), grads(expected, (q, k, v, e, f))):
        assert_close(g, ge, msg=name)
    lib = linformer_attention_reference(q, k, v, e, f, key_padding_mask=mask, scale=0.2)
    assert_close(lib, expected, msg="library reference")


@pytest.mark.parametrize("N", [1, 63, 65])
def test_identity_projections_are_softmax_attention(N):
    q, k, v = make_qkv(2, 3, N, N, 16, 8, seed=N)
    eye = torch.eye(N, dtype=q.dtype)
    out = linattn.linformer_attention(q, k, v, eye, eye)
    assert_close(out, linattn.softmax_attention(q, k, v))
    assert_close(out, ref.softmax_attention(q, k, v))


@pytest.mark.parametrize("content", ["huge", "nan"])
def test_padding_content_never_leaks(content):
    B, H, N = 2, 2, 40
    q, k, v = make_qkv(B, H, N, N, 16, 8)
    e, f = _proj(12, N)
    mask = make_mask(B, N)
    out = linattn.linformer_attention(q, k, v, e, f, key_padding_mask=mask)
    pad = ~mask[:, None, :, None]
    val = 1e30 if content == "huge" else float("nan")
    k2 = torch.where(pad, torch.full_like(k, val), k).detach().requires_grad_()
    v2 = torch.where(pad, torch.full_like(v, val), v).detach().requires_grad_()
    out2 = linattn.linformer_attention(q, k2, v2, e, f, key_padding_mask=mask)
    assert_close(out2, out)
    g1, g2 = grads(out, (q, k, v, e, f)), grads(out2, (q, k2, v2, e, f))
    for a, b in zip(g2, g1):
        assert torch.isfinite(a).all()
        assert_close(a, b)
    # the all-padding batch row: zero projected keys and values, zero output
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_no_causal_form():
    q, k, v = make_qkv(1, 2, 5, 5, 8, 8)
    e, f = _proj(3, 5)
    with pytest.raises(ValueError, match="no causal form.*mix all Nk keys.*later positions"):
        linattn.linformer_attention(q, k, v, e, f, causal=True)


def test_errors():
    q, k, v = make_qkv(2, 3, 5, 5, 8, 6, requires_grad=False)
    e, f = _proj(4, 5)
    cases = [
        ((q, k, v, e[:, :4], f), ValueError, r"e_proj must have shape \(P, Nk\) with P >= 1 and Nk = 5 for k \(2, 3, 5, 8\), got \(4, 4\)"),
        ((q, k, v, e, f[None]), ValueError, r"f_proj must have shape \(P, Nk\).*got \(1, 4, 5\)"),
        ((q, k, v, e, f[:3]), ValueError, r"e_proj and f_proj must have the same shape.*\(4, 5\) and \(3, 5\)"),
        ((q, k, v, e[:0], f[:0]), ValueError, r"P >= 1.*got \(0, 5\)"),
        ((q, k, v, e.float(), f), TypeError, r"e_proj must have the dtype of q, k and v \(torch.float64\), got torch.float32"),
        ((q, k, v, "E", f), TypeError, r"e_proj must be a torch.Tensor"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            linattn.linformer_attention(*args)


def test_half_inputs():
    q, k, v = make_qkv(1, 2, 50, 50, 16, 8, dtype=torch.float32, requires_grad=False)
    e, f = (p.detach().float() for p in _proj(10, 50))
    out = linattn.linformer_attention(*(t.bfloat16() for t in (q, k, v, e, f)))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), linattn.linformer_attention(q, k, v, e, f), atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------------------------
# LinformerAttention (the module owning E and F)
# ---------------------------------------------------------------------------------------------


def test_module_shorter_input_equals_right_padding_to_max_len():
    m = linattn.LinformerAttention(max_len=50, proj_len=8, generator=torch.Generator().manual_seed(0)).double()
    q, k, v = make_qkv(2, 2, 31, 31, 16, 8)
    mask = make_mask(2, 31, all_padded_row=False)
    short = m(q, k, v, key_padding_mask=mask)
    pad = (0, 0, 0, 50 - 31)
    mask50 = torch.cat([mask, torch.zeros(2, 50 - 31, dtype=torch.bool)], 1)
    padded = m(q, torch.nn.functional.pad(k, pad, value=float("nan")), torch.nn.functional.pad(v, pad),
               key_padding_mask=mask50)
    assert_close(short, padded)
    # and it is the functional form with the first Nk columns
    assert_close(short, linattn.linformer_attention(q, k, v, m.e_proj[:, :31], m.f_proj[:, :31], key_padding_mask=mask))


def test_module_longer_input_raises():
    m = linattn.LinformerAttention(max_len=10, proj_len=4)
    q, k, v = make_qkv(1, 1, 11, 11, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Nk = 11 keys \(shape \(1, 1, 11, 8\)\).*max_len = 10"):
        m(q, k, v)


def test_module_parameters_generator_and_sharing():
    a = linattn.LinformerAttention(max_len=20, proj_len=5, generator=torch.Generator().manual_seed(3))
    b = linattn.LinformerAttention(max_len=20, proj_len=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.e_proj, b.e_proj) and not torch.equal(a.e_proj, a.f_proj)
    b.reset_parameters(generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a.e_proj, b.e_proj)
    s = linattn.LinformerAttention(max_len=20, proj_len=5, share_kv=True)
    assert s.f_proj is None and sorted(n for n, _ in s.named_parameters()) == ["e_proj"]
    q, k, v = make_qkv(1, 2, 20, 20, 8, 8, dtype=torch.float32)
    out = a(q, k, v)
    out.square().sum().backward()
    assert a.e_proj.grad is not None and a.f_proj.grad.abs().sum() > 0
    assert_close(s(q, k, v), linattn.linformer_attention(q, k, v, s.e_proj, s.e_proj))
    with pytest.raises(ValueError, match="proj_len must be an int >= 1, got 0"):
        linattn.LinformerAttention(max_len=20, proj_len=0)
