"""linear_attention: every form against the independent float64 reference, and forms against each other."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from linattn.functional import linear_attention_reference
from linattn.functional.linear import causal_linear_product

import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv

MAPS = ["elu", "relu", "cos", "softmax"]
NS = [1, 2, 63, 64, 65, 1000]
DS = [16, 60, 64]


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(feature_map, causal, N, masked):
    D = DS[NS.index(N) % len(DS)]
    Dv = D // 2 + 3  # Dv != D
    B, H = (2, 2) if N < 1000 else (2, 1)
    q, k, v = make_qkv(B, H, N, N, D, Dv, seed=N)
    mask = make_mask(B, N, seed=N) if masked else None
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal, key_padding_mask=mask)
    expected, _, _ = ref.kernel_attention(q, k, v, feature_map, causal=causal, mask=mask)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, Dv)
    assert_close(out, expected, msg="output")
    for name, g, ge in zip("qkv", grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert_close(g, ge, msg=f"grad {name}")
    # the library's own reference form agrees too (it is what `linattn demo` trusts)
    lib_ref = linear_attention_reference(q, k, v, feature_map=feature_map, causal=causal, key_padding_mask=mask)
    assert_close(lib_ref, expected, msg="library reference")


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("nq,nk", [(1, 70), (65, 3), (100, 257)])
def test_cross_attention_matches_reference(feature_map, nq, nk):
    q, k, v = make_qkv(2, 3, nq, nk, 60, 17, seed=nq)
    mask = make_mask(2, nk, seed=nk)
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, key_padding_mask=mask)
    expected, _, _ = ref.kernel_attention(q, k, v, feature_map, mask=mask)
    assert_close(out, expected)
    for g, ge in zip(grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert_close(g, ge)


def test_callable_feature_map():
    q, k, v = make_qkv(1, 2, 33, 33, 8, 5)

    def phi(x):  # F = 2D, non-negative
        return torch.cat([torch.relu(x), torch.relu(-x)], dim=-1) + 0.1

    for causal in (False, True):
        out = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal)
        sim = phi(q) @ phi(k).transpose(-1, -2)
        if causal:
            sim = sim.tril()
        expected = (sim @ v) / sim.sum(-1, keepdim=True)
        assert_close(out, expected)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("N", [1, 63, 64, 65, 200])
def test_causal_state_matches_reference(feature_map, N):
    q, k, v = make_qkv(2, 2, N, N, 16, 9, seed=3)
    mask = make_mask(2, N, seed=N, all_padded_row=False)
    out, state = linattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=True, key_padding_mask=mask, return_state=True
    )
    assert isinstance(state, linattn.LinearAttentionState)
    expected, S, z = ref.kernel_attention(q, k, v, feature_map, causal=True, mask=mask)
    assert_close(out, expected)
    assert_close(state.S, S, msg="S")
    assert_close(state.z, z, msg="z")


def _cat_grads(*pieces):
    return [torch.cat(p, dim=2) for p in zip(*pieces)]


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("N,split", [(65, 1), (65, 64), (130, 63), (1000, 513), (64, 0), (64, 64)])
def test_split_and_resume_equals_whole(feature_map, N, split):
    q, k, v = make_qkv(2, 3, N, N, 60, 7, seed=split)
    mask = make_mask(2, N, seed=split, all_padded_row=False)
    whole, whole_state = linattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=True, key_padding_mask=mask, return_state=True
    )
    a, s1 = linattn.linear_attention(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], feature_map=feature_map, causal=True,
        key_padding_mask=mask[:, :split], return_state=True,
    )
    b, s2 = linattn.linear_attention(
        q[:, :, split:], k[:, :, split:], v[:, :, split:], feature_map=feature_map, causal=True,
        key_padding_mask=mask[:, split:], initial_state=s1, return_state=True,
    )
    resumed = torch.cat([a, b], dim=2)
    assert_close(resumed, whole)
    assert_close(s2.S, whole_state.S)
    assert_close(s2.z, whole_state.z)
    # gradients flow through the carried state into the first segment
    loss_w = (whole * torch.cos(whole)).sum() + whole_state.S.sum() + whole_state.z.square().sum()
    loss_r = (resumed * torch.cos(resumed)).sum() + s2.S.sum() + s2.z.square().sum()
    for gw, gr in zip(torch.autograd.grad(loss_w, (q, k, v)), torch.autograd.grad(loss_r, (q, k, v))):
        assert_close(gr, gw)


@pytest.mark.parametrize("feature_map", ["elu", "cos"])
def test_step_by_step_equals_parallel(feature_map):
    N = 70
    q, k, v = make_qkv(2, 2, N, N, 16, 12, seed=5)
    mask = make_mask(2, N, seed=5, all_padded_row=False)
    mask[0, :3] = False  # left padding: the first queries of batch 0 have no key at all
    par = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True, key_padding_mask=mask)
    state, outs = None, []
    for i in range(N):
        o, state = linattn.linear_attention(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], feature_map=feature_map,
            causal=True, key_padding_mask=mask[:, i : i + 1], initial_state=state, return_state=True,
        )
        outs.append(o)
    rec = torch.cat(outs, dim=2)
    assert_close(rec, par)
    assert torch.equal(par[0, :, :3], torch.zeros_like(par[0, :, :3]))
    for gp, gr in zip(grads(par, (q, k, v)), grads(rec, (q, k, v))):
        assert torch.isfinite(gp).all()
        assert_close(gr, gp)


def test_initial_state_is_differentiable():
    q, k, v = make_qkv(1, 2, 40, 40, 8, 6)
    g = torch.Generator().manual_seed(1)
    S0 = torch.rand(1, 2, 8, 6, generator=g, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(1, 2, 8, generator=g, dtype=torch.float64) + 1).requires_grad_()
    state = linattn.LinearAttentionState(S0, z0)
    out, st = linattn.linear_attention(q, k, v, causal=True, initial_state=state, return_state=True)
    expected, S, z = ref.kernel_attention(q, k, v, "elu", causal=True, S0=S0, z0=z0)
    assert_close(out, expected)
    loss = (out.sin().sum() + st.S.square().sum() + st.z.sum(), expected.sin().sum() + S.square().sum() + z.sum())
    for a, b in zip(torch.autograd.grad(loss[0], (q, S0, z0)), torch.autograd.grad(loss[1], (q, S0, z0))):
        assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda s, zz: linattn.linear_attention(
            q.detach()[:, :, :5], k.detach()[:, :, :5], v.detach()[:, :, :5], causal=True,
            initial_state=linattn.LinearAttentionState(s, zz),
        ),
        (S0, z0),
    )


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 150),
    split=st.integers(0, 150),
    chunk=st.integers(1, 70),
    d=st.integers(1, 9),
    dv=st.integers(1, 9),
)
def test_causal_product_any_chunk_any_split(n, split, chunk, d, dv):
    """The chunked product equals the explicit sum for any chunk length and split point."""
    split = min(split, n)
    g = torch.Generator().manual_seed(n * 1000 + chunk)
    a = torch.rand(1, 2, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    kf = torch.rand(1, 2, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, n, dv, generator=g, dtype=torch.float64, requires_grad=True)
    o1, s1 = causal_linear_product(a[:, :, :split], kf[:, :, :split], w[:, :, :split], chunk_size=chunk)
    o2, s2 = causal_linear_product(a[:, :, split:], kf[:, :, split:], w[:, :, split:], s1, chunk_size=chunk)
    o = torch.cat([o1, o2], dim=2)
    expected = ((a @ kf.transpose(-1, -2)).tril()) @ w
    assert_close(o, expected)
    assert_close(s2, kf.transpose(-1, -2) @ w)
    loss, loss_e = (o.cos().sum() + s2.sum()), (expected.cos().sum() + (kf.transpose(-1, -2) @ w).sum())
    for x, y in zip(torch.autograd.grad(loss, (a, kf, w)), torch.autograd.grad(loss_e, (a, kf, w))):
        assert_close(x, y)


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("N,tile", [(67, 1), (67, 300), (300, 128), (300, 10**6)])
@pytest.mark.parametrize("masked", [False, True])
def test_causal_tiles(feature_map, N, tile, masked):
    """The causal forms work on tiles of about `tile_positions` positions: groups of whole rows,
    or blocks of chunks of one row with the state carried across (here: groups of 1 row and of
    2, 2 and 1; blocks 64 + 3 and 128 + 128 + 44, the last with a partial chunk). Outputs, states
    and every gradient, the initial state's included, match the reference."""
    B, H, D, Dv = 5, 1, 16, 9
    q, k, v = make_qkv(B, H, N, N, D, Dv, seed=tile % 1000)
    mask = make_mask(B, N, seed=3, all_padded_row=False) if masked else None
    g = torch.Generator().manual_seed(2)
    Fd = D + 1 if feature_map == "cos" else D
    S0 = torch.rand(B, H, Fd, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(B, H, Fd, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    out, st = linattn.linear_attention(
        q, k, v, feature_map=feature_map, causal=True, key_padding_mask=mask,
        initial_state=linattn.LinearAttentionState(S0, z0), return_state=True, tile_positions=tile,
    )
    expected, S, z = ref.kernel_attention(q, k, v, feature_map, causal=True, mask=mask, S0=S0, z0=z0)
    assert_close(out, expected)
    assert_close(st.S, S, msg="S")
    assert_close(st.z, z, msg="z")
    ins = (q, k, v, S0, z0)
    loss = (out.sin().sum() + st.S.square().sum() + st.z.cos().sum(),
            expected.sin().sum() + S.square().sum() + z.cos().sum())
    for name, a, b in zip(("q", "k", "v", "S0", "z0"), torch.autograd.grad(loss[0], ins),
                          torch.autograd.grad(loss[1], ins)):
        assert_close(a, b, msg=f"grad {name}")
    # the unnormalised engine too (4 rows)
    a, kf = (torch.rand(2, 2, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(2, 2, N, 5, generator=g, dtype=torch.float64)
    s0 = torch.randn(2, 2, D, 5, generator=g, dtype=torch.float64)
    ins = [t.requires_grad_() for t in (a, kf, w, s0)]
    o, s_final = causal_linear_product(a, kf, w, s0, tile_positions=tile)
    o_ref = (a @ kf.transpose(-1, -2)).tril() @ w + a @ s0
    s_ref = s0 + kf.transpose(-1, -2) @ w
    assert_close(o, o_ref)
    assert_close(s_final, s_ref)
    loss = (o.sin().sum() + s_final.square().sum(), o_ref.sin().sum() + s_ref.square().sum())
    for x, y in zip(torch.autograd.grad(loss[0], ins), torch.autograd.grad(loss[1], ins)):
        assert_close(x, y)


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_sums_across_chunks(strategy):
    """The no-gate engine's sums across chunks (decayed._exclusive_chunk_sums and
    _reverse_chunk_sums, both strategies' layouts): for every row and chunk, the start plus every
    earlier (later) chunk's contribution, and the totals, written out as sums, in float64: one
    chunk, several rows, with and without a start."""
    from linattn.functional.decayed import _exclusive_chunk_sums, _reverse_chunk_sums

    g = torch.Generator().manual_seed(0)
    for R, nc, rest in [(1, 1, (3,)), (3, 5, (2, 4)), (2, 17, (5,))]:
        contrib = torch.randn(R, nc, *rest, generator=g, dtype=torch.float64)

        def produce(out):
            return contrib.reshape(R * nc, *rest).clone() if out is None else out.copy_(contrib.view(out.shape))

        for start in (None, torch.randn(R, *rest, generator=g, dtype=torch.float64)):
            s0 = torch.zeros_like(contrib[:, 0]) if start is None else start
            before, total = _exclusive_chunk_sums(produce, contrib.shape, start, strategy, contrib)
            assert_close(before, torch.stack([s0 + contrib[:, :c].sum(1) for c in range(nc)], 1))
            assert_close(total, s0 + contrib.sum(1))
            after, total = _reverse_chunk_sums(contrib, start, strategy)
            assert_close(after, torch.stack([s0 + contrib[:, c + 1:].sum(1) for c in range(nc)], 1))
            assert_close(total, s0 + contrib.sum(1))


@pytest.mark.parametrize("feature_map", ["elu", "cos"])
def test_causal_permuted_inputs(feature_map):
    """Inputs in the (B, N, H, D) memory layout, transposed to (B, H, N, D) (what a model's
    projections give): the tiled forms write through views of their outputs and gradients, which
    must not become copies."""
    B, N, H, D, Dv = 2, 150, 3, 8, 5
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(B, N, H, D, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
            for _ in range(2))
    v = torch.randn(B, N, H, Dv, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True)
    expected, _, _ = ref.kernel_attention(q, k, v, feature_map, causal=True)
    assert_close(out, expected)
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert_close(a, b, msg=f"grad {name}")
    o, _ = causal_linear_product(q, k, v.detach().requires_grad_())
    o_ref = (q @ k.transpose(-1, -2)).tril() @ v
    assert_close(o, o_ref)
    for a, b in zip(grads(o, (q, k)), grads(o_ref, (q, k))):
        assert_close(a, b)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_causal_fused_map_second_backward_and_partial_grads(feature_map):
    """With a fused elementwise map the forward keeps phi(q), phi(k) in the tensors that become
    the gradients of q and k: a second backward (retain_graph) must still be right, and so must a
    call where only some inputs need a gradient."""
    q, k, v = make_qkv(2, 2, 70, 70, 8, 5, seed=11)
    expected, _, _ = ref.kernel_attention(q, k, v, feature_map, causal=True)
    ge = grads(expected, (q, k, v))
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)  # as grads()
    first = torch.autograd.grad(out, (q, k, v), cot, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), cot)
    for a, b, e in zip(first, second, ge):
        assert_close(a, e)
        assert_close(b, e)
    inputs = {"q": q, "k": k, "v": v}
    for wanted in ("k", "qv", "v"):
        for name, t in inputs.items():
            t.requires_grad_(name in wanted)
        out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True)
        got = torch.autograd.grad(out, [inputs[n] for n in wanted], cot)
        for name, g in zip(wanted, got):
            assert_close(g, ge["qkv".index(name)], msg=f"grad {name} of {wanted}")


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("s", [0, 1, 31, 64, 65, 99])
def test_causality(feature_map, s):
    N = 100
    q, k, v = make_qkv(1, 2, N, N, 16, 8, requires_grad=False)
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=True)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    g = torch.Generator().manual_seed(s)
    q2[:, :, s:] = torch.randn(q2[:, :, s:].shape, generator=g, dtype=q.dtype) * 100
    k2[:, :, s:] *= 1e3
    v2[:, :, s:] = -v2[:, :, s:] * 1e6
    out2 = linattn.linear_attention(q2, k2, v2, feature_map=feature_map, causal=True)
    assert torch.equal(out[:, :, :s], out2[:, :, :s])
    if s < N:
        assert not torch.allclose(out[:, :, s:], out2[:, :, s:])


@pytest.mark.parametrize("feature_map", MAPS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("content", ["random", "huge", "nan"])
def test_padding_content_never_leaks(feature_map, causal, content):
    B, H, N, extra, D, Dv = 2, 2, 67, 13, 16, 10
    q, k, v = make_qkv(B, H, N, N, D, Dv, seed=11)
    mask = make_mask(B, N, seed=11, all_padded_row=False)
    out = linattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal, key_padding_mask=mask)
    g_ref = grads(out, (q, k, v))

    fill = {"random": lambda t: torch.randn_like(t), "huge": lambda t: torch.full_like(t, 1e30),
            "nan": lambda t: torch.full_like(t, float("nan"))}[content]
    q2, k2, v2 = (t.detach() for t in (q, k, v))
    # appended padded keys; in causal mode the appended positions are also (finite) queries
    q2 = torch.cat([q2, torch.randn(B, H, extra, D, dtype=q.dtype)], 2).requires_grad_()
    k2 = torch.cat([k2, fill(torch.empty(B, H, extra, D, dtype=q.dtype))], 2).requires_grad_()
    v2 = torch.cat([v2, fill(torch.empty(B, H, extra, Dv, dtype=q.dtype))], 2).requires_grad_()
    mask2 = torch.cat([mask, torch.zeros(B, extra, dtype=torch.bool)], 1)
    if not causal:
        q2 = q.detach().clone().requires_grad_()
    out2 = linattn.linear_attention(q2, k2, v2, feature_map=feature_map, causal=causal, key_padding_mask=mask2)
    assert_close(out2[:, :, :N], out)
    g2 = grads(out2[:, :, :N], (q2, k2, v2))
    for name, a, b in zip("qkv", g2, g_ref):
        assert torch.isfinite(a).all(), name
        assert_close(a[:, :, :N], b, msg=name)
    assert torch.equal(g2[1][:, :, N:], torch.zeros_like(g2[1][:, :, N:]))
    assert torch.equal(g2[2][:, :, N:], torch.zeros_like(g2[2][:, :, N:]))


@pytest.mark.parametrize("causal", [False, True])
def test_all_padding_gives_zeros_and_finite_grads(causal):
    q, k, v = make_qkv(2, 2, 20, 20, 8, 8)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1] = False
    k2 = k.detach().clone()
    k2[1] = float("nan")
    k2.requires_grad_()
    out = linattn.linear_attention(q, k2, v, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for g in grads(out, (q, k2, v)):
        assert torch.isfinite(g).all()


def test_relu_disjoint_supports_no_zero_over_zero():
    q = torch.tensor([[[[1.0, -1.0]]]], dtype=torch.float64, requires_grad=True)
    k = torch.tensor([[[[-1.0, 1.0], [-2.0, 0.5]]]], dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 2, 3, dtype=torch.float64, requires_grad=True)
    out = linattn.linear_attention(q, k, v, feature_map="relu")
    assert torch.equal(out, torch.zeros_like(out))
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequence(causal):
    q, k, v = make_qkv(2, 3, 0, 0, 8, 5)
    if causal:
        out, state = linattn.linear_attention(q, k, v, causal=True, return_state=True)
        assert state.S.shape == (2, 3, 8, 5) and torch.equal(state.S, torch.zeros_like(state.S))
    else:
        out = linattn.linear_attention(q, k, v)
    assert out.shape == (2, 3, 0, 5)
    # queries but no keys (cross-attention): zeros
    q, k, v = make_qkv(2, 3, 4, 0, 8, 5)
    out = linattn.linear_attention(q, k, v)
    assert out.shape == (2, 3, 4, 5) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_inputs_keep_float32_state(dtype, causal):
    q, k, v = make_qkv(1, 2, 300, 300, 32, 32, dtype=torch.float32, requires_grad=False)
    qh, kh, vh = (t.to(dtype).requires_grad_() for t in (q, k, v))
    if causal:
        out, state = linattn.linear_attention(qh, kh, vh, causal=True, return_state=True)
        assert state.S.dtype == torch.float32 and state.z.dtype == torch.float32
    else:
        out = linattn.linear_attention(qh, kh, vh)
    assert out.dtype == dtype
    expected = linattn.linear_attention(*(t.to(dtype).double() for t in (q, k, v)), causal=causal)
    assert (out.double() - expected).abs().max() < 2e-2
    out.float().sum().backward()
    assert qh.grad.dtype == dtype and torch.isfinite(qh.grad.float()).all()


def test_long_causal_float32_close_to_float64():
    N = 65536
    q, k, v = make_qkv(1, 2, N, N, 64, 64, dtype=torch.float32, requires_grad=False)
    out = linattn.linear_attention(q, k, v, causal=True)
    ref64 = linattn.linear_attention(q.double(), k.double(), v.double(), causal=True)
    assert torch.isfinite(out).all()
    rel = ((out.double() - ref64).norm() / ref64.norm()).item()
    assert rel < 1e-4, rel
    # the float64 chunked form is itself pinned to the O(N^2) reference on a window of this input
    s = slice(N - 1100, N)
    window_state = linattn.linear_attention(
        q[:, :, : s.start].double(), k[:, :, : s.start].double(), v[:, :, : s.start].double(),
        causal=True, return_state=True,
    )[1]
    tail, _, _ = ref.kernel_attention(
        q[:, :, s].double(), k[:, :, s].double(), v[:, :, s].double(), "elu", causal=True,
        S0=window_state.S, z0=window_state.z,
    )
    assert_close(ref64[:, :, s], tail)
    bf = linattn.linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert bf.dtype == torch.bfloat16 and torch.isfinite(bf).all()


@pytest.mark.parametrize("causal", [False, True])
def test_autocast_keeps_float32_sums(causal):
    q, k, v = make_qkv(1, 2, 500, 500, 32, 32, dtype=torch.float32, requires_grad=False)
    plain = linattn.linear_attention(q, k, v, causal=causal)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = linattn.linear_attention(q, k, v, causal=causal)
    # bfloat16 accumulation over 500 keys would be off by ~1e-2
    assert (auto.float() - plain).abs().max() < 1e-5


def test_causal_product_argument_errors():
    a = torch.rand(1, 2, 5, 3)
    with pytest.raises(ValueError, match=r"a and kf must both be \(B, H, N, F\).*\(1, 2, 5, 4\)"):
        causal_linear_product(a, torch.rand(1, 2, 5, 4), a)
    with pytest.raises(ValueError, match=r"w must be \(B, H, N, E\).*\(1, 2, 6, 3\)"):
        causal_linear_product(a, a, torch.rand(1, 2, 6, 3))
    with pytest.raises(ValueError, match=r"s0 must be \(B, H, F, E\) = \(1, 2, 3, 3\)"):
        causal_linear_product(a, a, a, torch.rand(1, 2, 3, 4))


@pytest.mark.parametrize("causal", [False, True])
def test_elu_features_stay_exact_for_very_negative_inputs(causal):
    """elu(x) + 1 = exp(x) for x <= 0; computed as (exp(x) - 1) + 1 it is exactly 0 in float32 below
    x = -17, and every query would see no key. At x = -30 all keys weigh the same: the mean of v."""
    q = torch.full((1, 2, 7, 4), -30.0)
    k = torch.full((1, 2, 7, 4), -30.0)
    v = torch.randn(1, 2, 7, 3, generator=torch.Generator().manual_seed(0))
    out = linattn.linear_attention(q, k, v, causal=causal)
    n = torch.arange(1, 8, dtype=torch.float32)[:, None]
    want = v.cumsum(2) / n if causal else v.mean(2, keepdim=True).expand_as(v)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_underflowed_normaliser_gives_finite_outputs_and_gradients(causal):
    """At x = -50 every elu+1 feature is exp(-50) and each q.k product a float32 denormal: the
    normaliser's reciprocal would be inf. It counts as no key instead (outputs ~0, all finite)."""
    q = torch.full((1, 2, 9, 4), -50.0, requires_grad=True)
    k = torch.full((1, 2, 9, 4), -50.0, requires_grad=True)
    v = torch.randn(1, 2, 9, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = linattn.linear_attention(q, k, v, causal=causal)
    assert torch.isfinite(out).all() and out.abs().max() < 1e-6
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.isfinite(g).all()



def test_inference_path_equals_autograd_path():
    """Without a graph to build, elu+1 and the normaliser skip their autograd Functions: the
    numbers must be the very same, including rows whose normaliser is zero (all keys padded)."""
    from linattn.functional.linear import LinearAttentionState, linear_attention

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    state = LinearAttentionState(torch.rand(2, 3, 4, 4, generator=g), torch.rand(2, 3, 4, generator=g))
    cases = [((q, k, v), dict(key_padding_mask=torch.tensor([[True] * 5, [False] * 5]))),
             ((q, k, v), dict(causal=True)),
             ((q[:, :, :1], k[:, :, :1], v[:, :, :1]), dict(causal=True, initial_state=state, return_state=True))]
    for inputs, kw in cases:
        with torch.no_grad():
            fast = linear_attention(*inputs, **kw)
        slow = linear_attention(*(x.clone().requires_grad_() for x in inputs), **kw)
        fast, slow = (x[0] if isinstance(x, tuple) else x for x in (fast, slow))
        assert slow.requires_grad and not fast.requires_grad
        assert torch.equal(fast, slow.detach()), kw
        assert torch.isfinite(fast).all()
        if "key_padding_mask" in kw:
            assert torch.equal(fast[1], torch.zeros_like(fast[1]))  # no real key: zeros, not 0/0
