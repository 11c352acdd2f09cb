"""FAVOR+ (Performer): projection, every form against the explicit reference, the stabiliser,
approximation quality, and the module's redraw policy."""

import math

import pytest
import torch

import linattn
import linattn.nn
import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv
from linattn.functional.favor import TRIG_NORMALISER_FLOOR, favor_attention_reference

KINDS = [("softmax", "positive"), ("softmax", "trig"), ("relu", "positive")]


def kind_name(kernel, features):
    return "relu" if kernel == "relu" else features


def projection(m, d, *, seed=0, orthogonal=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return linattn.favor_projection(m, d, orthogonal=orthogonal, generator=g, dtype=dtype)


def fast(q, k, v, W, kernel, features, **kw):
    return linattn.favor_attention(q, k, v, W, kernel=kernel, features=features, **kw)


# ------------------------------------------------------------------------------------------
# projection
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,d", [(1, 1), (7, 16), (64, 16), (100, 60)])
def test_projection_shape_determinism_and_orthogonal_blocks(m, d):
    W = projection(m, d)
    assert W.shape == (m, d) and W.dtype == torch.float64
    assert torch.equal(W, projection(m, d))
    assert not torch.equal(W, projection(m, d, seed=1))
    # rows inside a block of d are exactly orthogonal; across blocks they are not constrained
    for start in range(0, m, d):
        block = W[start : start + d]
        unit = block / block.norm(dim=1, keepdim=True)
        gram = unit @ unit.T
        assert_close(gram, torch.eye(block.shape[0], dtype=torch.float64), atol=1e-12, rtol=0)
    # dtype and device are applied after drawing: float32 is the float64 draw rounded
    assert_close(projection(m, d, dtype=torch.float32).double(), W, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_projection_rows_are_marginally_gaussian(orthogonal):
    d, m = 16, 8192
    W = projection(m, d, orthogonal=orthogonal)
    sq = W.square().sum(1)  # chi^2(d): mean d, variance 2d
    assert abs(sq.mean().item() - d) < 4 * math.sqrt(2 * d / m)
    assert abs(sq.var().item() - 2 * d) < 0.15 * 2 * d
    # each coordinate N(0, 1)
    assert W.mean().abs().item() < 4 / math.sqrt(m * d)
    assert abs(W.var().item() - 1) < 0.05


def test_iid_projection_rows_are_not_orthogonal():
    W = projection(16, 16, orthogonal=False)
    unit = W / W.norm(dim=1, keepdim=True)
    off = (unit @ unit.T - torch.eye(16, dtype=torch.float64)).abs().max()
    assert off > 0.1


# ------------------------------------------------------------------------------------------
# every form against the explicit float64 reference
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 2, 63, 65, 200])
@pytest.mark.parametrize("masked", [False, True])
def test_forms_match_reference(kernel, features, causal, n, masked):
    B, H, D, Dv, m = 2, 2, 16, 7, 24
    q, k, v = make_qkv(B, H, n, n, D, Dv, seed=n)
    with torch.no_grad():
        q.mul_(0.5), k.mul_(0.5)
    W = projection(m, D, seed=n)
    mask = make_mask(B, n, seed=n) if masked else None
    out = fast(q, k, v, W, kernel, features, causal=causal, key_padding_mask=mask)
    want, _, _ = ref.favor_attention(
        q, k, v, W, kind_name(kernel, features), causal=causal, mask=mask, trig_floor=TRIG_NORMALISER_FLOOR
    )
    assert_close(out, want, msg="out")
    lib_ref = favor_attention_reference(q, k, v, W, kernel=kernel, features=features, causal=causal, key_padding_mask=mask)
    assert_close(lib_ref, want, msg="library reference")
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(want, (q, k, v))):
        assert_close(a, b, msg=f"d{name}")


@pytest.mark.parametrize("kernel,features", KINDS)
def test_cross_attention_and_custom_scale(kernel, features):
    q, k, v = make_qkv(2, 3, 17, 40, 12, 5, seed=3)
    W = projection(30, 12)
    out = fast(q, k, v, W, kernel, features, scale=0.7)
    want, _, _ = ref.favor_attention(q, k, v, W, kind_name(kernel, features), scale=0.7, trig_floor=TRIG_NORMALISER_FLOOR)
    assert_close(out, want)
    for a, b in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
        assert_close(a, b)


def test_trig_floor_is_exercised_and_matches_reference():
    """Few trig features on spread-out inputs give negative normaliser estimates: the fast forms
    must clamp exactly as documented (and stay finite)."""
    q, k, v = make_qkv(1, 4, 50, 50, 8, 3, seed=11)
    with torch.no_grad():
        q.mul_(3), k.mul_(3)
    W = projection(2, 8, seed=4)
    fq = ref.favor_phi("trig", q, W, 1 / math.sqrt(8))
    fk = ref.favor_phi("trig", k, W, 1 / math.sqrt(8))
    assert ((fq @ fk.transpose(-1, -2)).sum(-1) < 0).any(), "test setup: want negative normalisers"
    for causal in (False, True):
        out = fast(q, k, v, W, "softmax", "trig", causal=causal)
        want, _, _ = ref.favor_attention(q, k, v, W, "trig", causal=causal, trig_floor=TRIG_NORMALISER_FLOOR)
        assert torch.isfinite(out).all()
        assert_close(out, want, atol=1e-9, rtol=1e-8)


# ------------------------------------------------------------------------------------------
# recurrent form: states, step-by-step, split-and-resume
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,features", KINDS)
def test_state_is_the_sum_of_key_features(kernel, features):
    q, k, v = make_qkv(2, 2, 70, 70, 8, 3, seed=5)
    W = projection(10, 8)
    mask = make_mask(2, 70, seed=5)
    _, state = fast(q, k, v, W, kernel, features, causal=True, key_padding_mask=mask, return_state=True)
    _, S, z = ref.favor_attention(q, k, v, W, kind_name(kernel, features), causal=True, mask=mask, trig_floor=TRIG_NORMALISER_FLOOR)
    assert isinstance(state, linattn.LinearAttentionState) and state.log_scale.shape == (2, 2)
    scale = torch.exp(state.log_scale)[..., None]
    assert_close(state.S * scale[..., None], S, msg="S")
    assert_close(state.z * scale, z, msg="z")


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("split", [1, 37, 64, 99])
def test_split_and_resume_equals_whole(kernel, features, split):
    n = 100
    q, k, v = make_qkv(2, 2, n, n, 8, 3, seed=split)
    W = projection(12, 8)
    mask = make_mask(2, n, seed=split)
    kw = dict(kernel=kernel, features=features, causal=True, return_state=True)
    whole, ws = linattn.favor_attention(q, k, v, W, key_padding_mask=mask, **kw)
    a, s1 = linattn.favor_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], W, key_padding_mask=mask[:, :split], **kw)
    b, s2 = linattn.favor_attention(
        q[:, :, split:], k[:, :, split:], v[:, :, split:], W, key_padding_mask=mask[:, split:], initial_state=s1, **kw
    )
    resumed = torch.cat([a, b], dim=2)
    assert_close(resumed, whole)
    for name in ("S", "z", "log_scale"):
        assert_close(getattr(s2, name), getattr(ws, name), msg=name)
    loss_w = (whole * torch.cos(whole)).sum() + ws.S.sum() + ws.z.square().sum()
    loss_r = (resumed * torch.cos(resumed)).sum() + s2.S.sum() + s2.z.square().sum()
    for x, y in zip(torch.autograd.grad(loss_w, (q, k, v)), torch.autograd.grad(loss_r, (q, k, v))):
        assert_close(x, y)


@pytest.mark.parametrize("kernel,features", KINDS)
def test_step_by_step_equals_parallel(kernel, features):
    n = 40
    q, k, v = make_qkv(1, 3, n, n, 8, 4, seed=9)
    W = projection(9, 8)
    mask = make_mask(1, n, seed=9)
    mask[0, :3] = False  # the sequence starts with padding: no real key yet
    parallel = fast(q, k, v, W, kernel, features, causal=True, key_padding_mask=mask)
    state, outs = None, []
    for i in range(n):
        o, state = fast(
            q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], W, kernel, features,
            causal=True, key_padding_mask=mask[:, i : i + 1], initial_state=state, return_state=True,
        )
        outs.append(o)
    steps = torch.cat(outs, dim=2)
    assert_close(steps, parallel)
    assert (parallel[:, :, :3] == 0).all()
    for x, y in zip(grads(steps, (q, k, v)), grads(parallel, (q, k, v))):
        assert_close(x, y)


@pytest.mark.parametrize("growing", [False, True])
def test_unpadded_steps_equal_parallel_outputs_states_and_gradients(growing):
    # one unpadded position at a time takes the decoding fast path (positive softmax features);
    # growing key norms raise the running maximum at many steps, so the carried sums are rescaled
    n = 33
    q, k, v = make_qkv(2, 3, n, n, 8, 5, seed=21)
    if growing:
        with torch.no_grad():
            k.mul_(torch.linspace(0.5, 6.0, n, dtype=k.dtype)[:, None])
    W = projection(10, 8)
    kw = dict(causal=True, return_state=True)
    parallel, ps = linattn.favor_attention(q, k, v, W, **kw)
    state, outs = None, []
    for i in range(n):
        o, state = linattn.favor_attention(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], W,
                                           initial_state=state, **kw)
        outs.append(o)
    steps = torch.cat(outs, dim=2)
    assert_close(steps, parallel)
    for name in ("S", "z", "log_scale"):
        assert_close(getattr(state, name), getattr(ps, name), msg=name)
    loss_p = (parallel * torch.cos(parallel)).sum() + ps.S.sum() + ps.z.square().sum()
    loss_s = (steps * torch.cos(steps)).sum() + state.S.sum() + state.z.square().sum()
    for x, y in zip(torch.autograd.grad(loss_p, (q, k, v)), torch.autograd.grad(loss_s, (q, k, v))):
        assert_close(x, y)


# ------------------------------------------------------------------------------------------
# stabiliser: causal, finite at any input scale
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("features", ["positive", "trig"])
@pytest.mark.parametrize("change", ["x10", "x100", "aligned"])
def test_future_keys_never_change_earlier_outputs(features, change):
    """A key at position s, scaled by 10 or 100, or made the largest-magnitude key there can be
    (aligned with the longest projection row), must leave outputs before s bit-for-bit unchanged.
    A sequence-wide maximum as stabiliser fails this: the trig magnitude exp(||k'||^2/2) of a
    key scaled by 100 pushes every earlier key's features below float32's range."""
    B, H, n, D, m, s = 1, 2, 200, 16, 64, 150
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, n, D, generator=g) * 0.5
    k = torch.randn(B, H, n, D, generator=g) * 0.5
    v = torch.randn(B, H, n, 8, generator=g)
    W = projection(m, D, dtype=torch.float32)
    k2 = k.clone()
    if change == "aligned":
        top = W[W.norm(dim=1).argmax()]
        k2[:, :, s] = top * math.sqrt(D)  # k' = top: the largest exponent W k' - ||k'||^2/2
    else:
        k2[:, :, s] *= 10.0 if change == "x10" else 100.0
    for causal_out in (
        lambda kk: fast(q, kk, v, W, "softmax", features, causal=True),
    ):
        before, after = causal_out(k), causal_out(k2)
        assert torch.equal(before[:, :, :s], after[:, :, :s])
        assert not torch.equal(before[:, :, s:], after[:, :, s:])  # the change is visible later


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("factor", [10.0, 100.0])
def test_large_inputs_give_finite_outputs_and_gradients(kernel, features, causal, factor):
    q, k, v = make_qkv(2, 2, 130, 130, 64, 16, dtype=torch.float32, seed=int(factor), requires_grad=False)
    q, k = (q * factor).requires_grad_(), (k * factor).requires_grad_()
    v.requires_grad_()
    W = projection(128, 64, dtype=torch.float32)
    out = fast(q, k, v, W, kernel, features, causal=causal, key_padding_mask=make_mask(2, 130))
    assert torch.isfinite(out).all()
    for gr in grads(out, (q, k, v)):
        assert torch.isfinite(gr).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_keep_float32_state(dtype):
    q, k, v = make_qkv(1, 2, 300, 300, 32, 8, dtype=dtype, requires_grad=False)
    W = projection(64, 32, dtype=torch.float32)
    out, state = linattn.favor_attention(q, k, v, W, causal=True, return_state=True)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert state.S.dtype == state.z.dtype == state.log_scale.dtype == torch.float32
    want = linattn.favor_attention(q.double(), k.double(), v.double(), W.double(), causal=True)
    assert (out.double() - want).abs().max() < 0.02


def test_padded_keys_never_reach_outputs_or_gradients():
    n, pad = 60, 9
    q, k, v = make_qkv(2, 2, n, n + pad, 8, 4, seed=2)
    W = projection(16, 8)
    mask = torch.ones(2, n + pad, dtype=torch.bool)
    mask[:, n:] = False
    for kernel, features in KINDS:
        base = fast(q, k[:, :, :n], v[:, :, :n], W, kernel, features)
        gb = grads(base, (q,))
        for junk in (1e30, float("nan")):
            kk, vv = k.detach().clone(), v.detach().clone()
            kk[:, :, n:], vv[:, :, n:] = junk, junk
            kk.requires_grad_(), vv.requires_grad_()
            out = fast(q, kk, vv, W, kernel, features, key_padding_mask=mask)
            assert_close(out, base)
            gq, gk, gv = grads(out, (q, kk, vv))
            assert_close(gq, gb[0])
            assert (gk[:, :, n:] == 0).all() and (gv[:, :, n:] == 0).all()


# ------------------------------------------------------------------------------------------
# approximation of softmax attention (Performer's claims)
# ------------------------------------------------------------------------------------------


def relative_error(m, *, orthogonal, features, seed, n=256, d=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.25
    k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.25
    v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    W = linattn.favor_projection(m, d, orthogonal=orthogonal, generator=g, dtype=torch.float64)
    want = linattn.softmax_attention(q, k, v)
    out = linattn.favor_attention(q, k, v, W, features=features)
    return ((out - want).norm() / want.norm()).item()


def test_positive_orthogonal_features_approximate_softmax_and_improve_with_m():
    assert relative_error(4096, orthogonal=True, features="positive", seed=0) < 0.03
    mean = [sum(relative_error(m, orthogonal=True, features="positive", seed=s) for s in range(4)) / 4 for m in (16, 64, 256, 1024, 4096)]
    assert all(a > b for a, b in zip(mean, mean[1:])), mean


@pytest.mark.parametrize("features", ["positive", "trig"])
def test_orthogonal_features_beat_iid_on_average(features):
    for m in (64, 256):
        orth = sum(relative_error(m, orthogonal=True, features=features, seed=s) for s in range(20)) / 20
        iid = sum(relative_error(m, orthogonal=False, features=features, seed=s) for s in range(20)) / 20
        assert orth < iid, (m, orth, iid)


def test_positive_features_beat_trig_where_the_kernel_is_small():
    """Performer Lemma 2: the positive estimator's error vanishes as exp(x.y) -> 0, the trig one's
    does not. Pairs y = -x with ||x|| = 1.5 (kernel exp(-2.25)), relative MSE over 50 projections."""
    d, m = 16, 64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, d, generator=g, dtype=torch.float64)
    x = 1.5 * x / x.norm(dim=1, keepdim=True)
    y = -x
    true = torch.exp((x * y).sum(1))
    mse = {}
    for kind in ("positive", "trig"):
        errs = []
        for seed in range(50):
            W = projection(m, d, seed=seed)
            est = (ref.favor_phi(kind, x, W, 1.0) * ref.favor_phi(kind, y, W, 1.0)).sum(1)
            errs.append(((est - true) / true).square().mean())
        mse[kind] = torch.stack(errs).mean().item()
    assert mse["positive"] < mse["trig"] / 10, mse


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------


def test_errors():
    q, k, v = make_qkv(2, 3, 5, 5, 8, 4)
    W = projection(6, 8)
    with pytest.raises(ValueError, match=r"projection must have shape \(m, D\) with D = 8.*got \(6, 7\)"):
        linattn.favor_attention(q, k, v, W[:, :7])
    with pytest.raises(TypeError, match="projection must be a floating-point tensor"):
        linattn.favor_attention(q, k, v, W.long())
    with pytest.raises(ValueError, match="unknown kernel 'exp'"):
        linattn.favor_attention(q, k, v, W, kernel="exp")
    with pytest.raises(ValueError, match="unknown features 'cos'"):
        linattn.favor_attention(q, k, v, W, features="cos")
    with pytest.raises(ValueError, match="kernel='relu' has one feature map"):
        linattn.favor_attention(q, k, v, W, kernel="relu", features="trig")
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.favor_attention(q, k, v, W, return_state=True)
    with pytest.raises(ValueError, match="num_features must be an int >= 1"):
        linattn.favor_projection(0, 8)
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        linattn.favor_projection(8, 2.0)
    _, state = linattn.favor_attention(q, k, v, W, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"initial_state.S must have shape \(2, 3, 12, 4\)"):
        linattn.favor_attention(q, k, v, W, features="trig", causal=True, initial_state=state)
    with pytest.raises(ValueError, match="log_scale is set"):
        linattn.linear_attention(q, k, v, causal=True, initial_state=state._replace(S=state.S[..., :6, :], z=state.z[..., :6]))


# ------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------


def module(**kw):
    return linattn.nn.FavorAttention(linattn.nn.FavorConfig(head_dim=8, num_features=16, **kw))


def test_module_state_dict_roundtrip_and_repeatable_eval():
    a = module(seed=3)
    q, k, v = make_qkv(1, 2, 20, 20, 8, 4, dtype=torch.float32, requires_grad=False)
    a.eval()
    first = a(q, k, v, causal=True)
    assert torch.equal(first, a(q, k, v, causal=True))
    assert "projection" in a.state_dict()
    b = module(seed=99)
    b.load_state_dict(a.state_dict())
    b.eval()
    assert torch.equal(b(q, k, v, causal=True), first)
    with pytest.raises(ValueError, match="state_dict was saved with"):
        module(seed=3, kernel="relu").load_state_dict(a.state_dict())


def test_module_redraw_is_explicit_and_deterministic():
    a, b = module(), module()
    assert torch.equal(a.projection, b.projection)
    a.redraw_(torch.Generator().manual_seed(5))
    b.redraw_(torch.Generator().manual_seed(5))
    assert torch.equal(a.projection, b.projection)
    c = module()
    c.redraw_(torch.Generator().manual_seed(6))
    assert not torch.equal(a.projection, c.projection)


def test_module_redraw_policy_counts_training_forwards_and_resumes_exactly():
    a = module(redraw_every=3)
    q, k, v = make_qkv(1, 2, 10, 10, 8, 4, dtype=torch.float32, requires_grad=False)
    seen = []
    for _ in range(7):
        a(q, k, v)
        seen.append(a.projection.clone())
    # forwards 1-3 use the first draw, 4-6 the second, 7 the third
    assert torch.equal(seen[0], seen[2]) and not torch.equal(seen[2], seen[3])
    assert torch.equal(seen[3], seen[5]) and not torch.equal(seen[5], seen[6])
    a.eval()
    for _ in range(5):
        a(q, k, v)
    assert torch.equal(a.projection, seen[6])  # evaluation never redraws
    a.train()
    # resume: a fresh module loading the state continues the same sequence of draws
    b = module(redraw_every=3)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        a(q, k, v), b(q, k, v)
        assert torch.equal(a.projection, b.projection)


def test_a_redraw_between_forward_and_backward_does_not_change_the_gradient():
    q, k, v = make_qkv(1, 2, 30, 30, 8, 4, dtype=torch.float64)
    a = module().double()
    out = a(q, k, v, causal=True)
    want = grads(a.projection.new_tensor(0) + out, (q, k, v))
    out2 = a(q, k, v, causal=True)
    a.redraw_(torch.Generator().manual_seed(1))
    for x, y in zip(grads(out2, (q, k, v)), want):
        assert torch.equal(x, y)


def test_config_validation_and_dict_roundtrip():
    c = linattn.nn.FavorConfig(head_dim=8, features="trig", redraw_every=100)
    assert linattn.nn.FavorConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="redraw_every must be None or an int >= 1"):
        linattn.nn.FavorConfig(head_dim=8, redraw_every=0)
    with pytest.raises(ValueError, match=r"unknown field\(s\)"):
        linattn.nn.FavorConfig.from_dict({"head_dim": 8, "m": 3})


# ------------------------------------------------------------------------------------------
# tiling (large calls run in tiles of heads and position blocks; tests shrink the tiles)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [768, 4613, 12000])
def test_tiled_equals_one_piece(kernel, features, causal, tile):
    """Tiles of one head and 64-position blocks, of two heads, and of two whole batch rows
    give the same outputs, gradients and states as one piece, with masks and a resumed state."""
    B, H, n, D, m = 3, 3, 150, 8, 12
    q, k, v = make_qkv(B, H, n, n, D, 4, seed=tile)
    W = projection(m, D)
    mask = make_mask(B, n, seed=1)
    kw = dict(kernel=kernel, features=features, causal=causal, key_padding_mask=mask)

    def run(tile_entries):
        if causal:  # resume from a state that carries gradients back into a prefix
            _, st = fast(q[:, :, :10], k[:, :, :10], v[:, :, :10], W, kernel, features, causal=True, return_state=True,
                         tile_entries=tile_entries)
            return fast(q, k, v, W, initial_state=st, return_state=True, tile_entries=tile_entries, **kw)
        return fast(q, k, v, W, tile_entries=tile_entries, **kw)

    whole = run(10**9)  # one piece
    tiled = run(tile * (2 if features == "trig" else 1))
    if causal:
        (whole, ws), (tiled, ts) = whole, tiled
        for name in ("S", "z", "log_scale"):
            assert_close(getattr(ts, name), getattr(ws, name), msg=name)
    assert_close(tiled, whole)
    for x, y in zip(grads(tiled, (q, k, v)), grads(whole, (q, k, v))):
        assert_close(x, y)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 500])
def test_chunk_size_changes_nothing_but_rounding(chunk_size):
    """The causal product's chunk length is a tuning knob: outputs, gradients and the state agree
    with the reference for chunks of one position, that do not divide N, and longer than N."""
    B, H, n, D, m = 2, 2, 133, 8, 12
    q, k, v = make_qkv(B, H, n, n, D, 4, seed=chunk_size)
    W = projection(m, D)
    mask = make_mask(B, n, seed=2)
    kw = dict(causal=True, key_padding_mask=mask, return_state=True)
    out, st = fast(q, k, v, W, "softmax", "positive", chunk_size=chunk_size, **kw)
    _, default_st = fast(q, k, v, W, "softmax", "positive", **kw)
    ref = favor_attention_reference(q, k, v, W, causal=True, key_padding_mask=mask)
    assert_close(out, ref)
    for name in ("S", "z", "log_scale"):
        assert_close(getattr(st, name), getattr(default_st, name), msg=name)
    for x, y in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        assert_close(x, y)
    with pytest.raises(ValueError, match="chunk_size"):
        fast(q, k, v, W, "softmax", "positive", causal=True, chunk_size=0)


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("nq,nk", [(0, 0), (3, 0), (0, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_empty_inputs_give_zeros_in_every_form_and_the_reference(kernel, features, nq, nk, masked):
    """No keys (or no queries): zeros of the right shape with zero gradients, in the fast forms
    and the reference (issue 18, defect 4: the reference raised IndexError on Nk = 0)."""
    W = projection(16, 8)
    for causal in ([False, True] if nq == nk else [False]):
        q, k, v = make_qkv(2, 2, nq, nk, 8, 4, seed=1)
        mask = torch.ones(2, nk, dtype=torch.bool) if masked else None
        for f in (fast, lambda *a, **kw: favor_attention_reference(*a[:4], kernel=a[4], features=a[5], **kw)):
            out = f(q, k, v, W, kernel, features, causal=causal, key_padding_mask=mask)
            assert out.shape == (2, 2, nq, 4) and bool((out == 0).all())
            for gr in grads(out, (q, k, v)):
                assert bool((gr == 0).all())
