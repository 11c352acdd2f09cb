"""The normaliser guard of kernel attention (``normaliser.normaliser_floor``) at every input scale.

Issue 18, defect 1: at inputs scaled by 100 a query row's normaliser of 1.2e-38, just above
``finfo(float32).tiny``, passed the old guard; ``1 / den`` ~ 8e37 then overflowed in the backward
and NaN spread over the whole head's key gradients (FAVOR+, and linear attention with softmax
features, causal too; float64 causal FAVOR+ as well). The guard is now relative to each row's
scale. These tests check finiteness across magnitudes, dtypes and forms, that the forms agree
with each other and with the float64 references where the floor is active, and that the floor
does not touch ordinary rows.
"""

from __future__ import annotations

import pytest
import torch

import linattn
from conftest import assert_close, grads, make_qkv
from linattn.functional import favor_attention_reference, linear_attention_reference
from linattn.functional.normaliser import normaliser_floor

SCALES = [1.0, 10.0, 100.0, 1000.0]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def issue_inputs(scale: float, dtype: torch.dtype, n: int = 256):
    """The issue's example: B = 1, H = 8, D = 64, m = 256, seed 0, q and k scaled."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
    W = linattn.favor_projection(256, 64, generator=g)
    q, k = (q * scale).to(dtype).requires_grad_(), (k * scale).to(dtype).requires_grad_()
    return q, k, v.to(dtype).requires_grad_(), W


def attend(name: str, q, k, v, W, **kw):
    if name == "favor":
        return linattn.favor_attention(q, k, v, W, **kw)
    if name == "favor_relu":
        return linattn.favor_attention(q, k, v, W, kernel="relu", **kw)
    return linattn.linear_attention(q, k, v, feature_map=name.removeprefix("linear_"), **kw)


MECHANISMS = ["favor", "favor_relu", "linear_softmax", "linear_elu", "linear_cos"]


def test_issue_example_has_finite_gradients():
    """The issue's exact call: float32, inputs x100, bidirectional. NaN/inf before the fix."""
    q, k, v, W = issue_inputs(100.0, torch.float32)
    linattn.favor_attention(q, k, v, W).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("form", ["bidirectional", "causal", "recurrent"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_and_gradients_are_finite(mechanism, form, scale, dtype):
    n = 12 if form == "recurrent" else 130  # causal: > one chunk, the tiled engine
    q, k, v, W = issue_inputs(scale, dtype, n)
    if form == "recurrent":
        state, outs = None, []
        for i in range(n):
            sl = slice(i, i + 1)
            o, state = attend(mechanism, q[:, :, sl], k[:, :, sl], v[:, :, sl], W, causal=True,
                              initial_state=state, return_state=True)
            outs.append(o)
        out = torch.cat(outs, dim=2)
        assert state.S.dtype == state.z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    else:
        out = attend(mechanism, q, k, v, W, causal=form == "causal")
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    # outputs are convex combinations of values (cos: 1 + cos >= 0 too), so never above max |v|
    assert out.abs().max() <= v.abs().max() * 1.01 + 1e-3
    for name, gr in zip("qkv", grads(out.float(), (q, k, v))):
        assert torch.isfinite(gr).all(), f"grad {name}"


def steps(mechanism, q, k, v, W):
    state, outs = None, []
    for i in range(q.shape[2]):
        sl = slice(i, i + 1)
        o, state = attend(mechanism, q[:, :, sl], k[:, :, sl], v[:, :, sl], W, causal=True,
                          initial_state=state, return_state=True)
        outs.append(o)
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("mechanism", ["favor", "linear_softmax"])
def test_forms_agree_where_the_floor_is_active(mechanism):
    """At x100, where the floor decides many rows, step-by-step decoding, the chunked causal form
    and a split-and-resume give the same outputs and gradients, in float64. (Not in float32: at
    x100 FAVOR's exponents subtract ||k'||^2 / 2 ~ 4e4, whose float32 ulp is 0.004, and each form
    rounds in its own order, so features differ by ~1% between forms.)"""
    n, dtype = 70, torch.float64
    q, k, v, W = issue_inputs(100.0, dtype, n)
    whole = attend(mechanism, q, k, v, W, causal=True)
    stepped, _ = steps(mechanism, q, k, v, W)
    first, st = attend(mechanism, q[:, :, :33], k[:, :, :33], v[:, :, :33], W, causal=True, return_state=True)
    rest = attend(mechanism, q[:, :, 33:], k[:, :, 33:], v[:, :, 33:], W, causal=True, initial_state=st)
    split = torch.cat([first, rest], dim=2)
    want = grads(whole, (q, k, v))
    for other in (stepped, split):
        assert_close(other, whole)
        for a, b in zip(grads(other, (q, k, v)), want):
            assert_close(a, b)


def test_floor_is_active_and_fast_forms_match_the_reference():
    """Softmax features at x100 in float32: many normalisers lie between finfo.tiny and the floor
    (the old guard let them through; the floor now decides them); the fast forms equal the plain
    reference, which applies the same floor, in outputs and gradients, bidirectional and causal."""
    q, k, v, _ = issue_inputs(100.0, torch.float32, 70)
    qf, kf = (torch.softmax(x.detach(), dim=-1) for x in (q, k))
    z_seen = kf.cumsum(2)
    den = (qf * z_seen).sum(-1, keepdim=True)
    below = den < normaliser_floor(qf, z_seen)
    assert (den[below] > torch.finfo(torch.float32).tiny).sum() > 10
    for causal in (False, True):
        out = linattn.linear_attention(q, k, v, feature_map="softmax", causal=causal)
        want = linear_attention_reference(q, k, v, feature_map="softmax", causal=causal)
        assert_close(out, want, atol=1e-5, rtol=1e-4)
        for a, b in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
            assert torch.isfinite(b).all()
            assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=1e-3)


def test_favor_fast_forms_match_reference_at_large_scale():
    """FAVOR+ (positive features) at x14, near the largest scale where the unstabilised float64
    reference still represents every row, equals it in outputs and gradients: the guard changes
    nothing there. (The float64 floor, 7.5e-155 of a row's scale, is out of the reference's reach:
    its features underflow first. Where it acts, the forms are checked against each other above.)"""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    W = linattn.favor_projection(16, 8, generator=g, dtype=torch.float64)
    q, k = (q * 14).requires_grad_(), (k * 14).requires_grad_()
    v.requires_grad_()
    for causal in (False, True):
        out = linattn.favor_attention(q, k, v, W, causal=causal)
        want = favor_attention_reference(q, k, v, W, causal=causal)
        assert torch.isfinite(want).all()
        assert_close(out, want, atol=1e-9, rtol=1e-7)
        for a, b in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
            assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_floor_leaves_ordinary_rows_alone_and_scales_with_the_data():
    """At x1 no row is near the floor (outputs equal the unguarded ratio); scaling the features
    by c scales the floor by c^2, the normaliser's own scaling."""
    q, k, v = make_qkv(1, 2, 50, 50, 8, 4, requires_grad=False)
    out = linattn.linear_attention(q, k, v, feature_map="elu")
    qf, kf = (torch.nn.functional.elu(x) + 1 for x in (q, k))
    want = (qf @ (kf.transpose(-1, -2) @ v)) / (qf @ kf.sum(-2)[..., None])
    assert_close(out, want)
    z = kf.sum(-2, keepdim=True)
    assert_close(normaliser_floor(qf * 1e-10, z * 1e-10), normaliser_floor(qf, z) * 1e-20, rtol=1e-12, atol=0)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("scale", SCALES)
def test_hedgehog_guard_matches_reference_and_keeps_gradients_finite(window, scale):
    """Hedgehog normalises with the same floor (its windowed normaliser adds the window's softmax
    mass to the floor's scale): finite gradients at every scale, and the fast form equals the
    reference, which applies the same floor, in float32 outputs and gradients."""
    from linattn.functional import HedgehogMaps, hedgehog_attention, hedgehog_attention_reference

    g = torch.Generator().manual_seed(5)
    H, D, F = 2, 16, 16
    maps = HedgehogMaps(*(torch.randn(*s, generator=g) for s in [(H, D, F), (H, F), (H, D, F), (H, F), (H,)]))
    q, k, v = (torch.randn(1, H, 70, D, generator=g) for _ in range(3))
    q, k = (q * scale).requires_grad_(), (k * scale).requires_grad_()
    v.requires_grad_()
    out = hedgehog_attention(q, k, v, maps, window=window)
    want = hedgehog_attention_reference(q, k, v, maps, window=window)
    assert torch.isfinite(out).all()
    assert_close(out, want, atol=1e-4, rtol=1e-3)
    for a, b in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
        assert torch.isfinite(a).all()
        assert_close(a, b, atol=1e-4 * max(b.abs().max().item(), 1e-30), rtol=1e-3)


def _nearly_disjoint(feature_map: str, n: int = 150):
    """Float32 queries and keys whose features meet on one channel where the keys' are ~1e-26, while
    the keys' other channel is large: the normaliser of every row lies far below its floor."""
    low, off, q_on, k_on = (-60.0, -200.0, 0.0, 50.0) if feature_map == "elu" else (1e-26, -1.0, 1.0, 50.0)
    q = torch.full((1, 2, n, 8), off)
    k = torch.full((1, 2, n, 8), off)
    q[..., 0], k[..., 0], k[..., 1] = q_on, low, k_on
    v = torch.randn(1, 2, n, 5, generator=torch.Generator().manual_seed(1))
    return q, k, v


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_elementwise_maps_floor_decides_as_in_the_reference(feature_map, strategy):
    """The chunked engine takes an elementwise map's features, and their sums from no given state,
    as non-negative: the largest value for the floor's largest magnitude, no pass for magnitudes.
    Where the floor decides every row, it decides them as the reference does (outputs and
    gradients); and so from a given state whose normaliser sum is negative on a channel no feature
    reaches (any value is accepted): the magnitudes taken there, a floor 20-7000 times higher."""
    from linattn.functional.feature_maps import FEATURE_MAPS

    q, k, v = _nearly_disjoint(feature_map)
    qf, kf = (FEATURE_MAPS[feature_map](x) for x in (q, k))
    z_seen = kf.cumsum(2)
    den = (qf * z_seen).sum(-1, keepdim=True)
    assert (den < normaliser_floor(qf, z_seen)).all()
    z0 = torch.zeros(1, 2, 8)
    z0[..., 2] = -1e3
    for state in (None, linattn.LinearAttentionState(torch.zeros(1, 2, 8, 5), z0)):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        out = linattn.linear_attention(*ins, feature_map=feature_map, causal=True, initial_state=state,
                                       strategy=strategy, chunk_size=32)
        want = linear_attention_reference(*ins, feature_map=feature_map, causal=True, initial_state=state)
        assert_close(out, want, atol=1e-6, rtol=1e-5)
        for a, b in zip(grads(out, ins), grads(want, ins)):
            assert torch.isfinite(a).all()
            assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-4)
