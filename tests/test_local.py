"""local_attention: the blocked form against an explicit banded-mask softmax in float64, and the
recurrent form (ring-buffer state) against the parallel one."""

import pytest
import torch

import linattn
from linattn.functional import local_attention_reference
from linattn.functional.local import MAX_BLOCK

import reference as ref
from conftest import assert_close, grads, make_mask, make_qkv

# (N, window): N = 1, not multiples of any block size, windows below, at and above N and MAX_BLOCK
SIZES = [(1, 1), (2, 1), (63, 5), (65, 64), (65, 100), (200, 33), (300, MAX_BLOCK + 1), (600, 2 * MAX_BLOCK + 5), (1000, 40)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N,window", SIZES)
@pytest.mark.parametrize("masked", [False, True])
def test_matches_banded_reference(causal, N, window, masked):
    D = [16, 60, 64][N % 3]
    B, H = (2, 2) if N < 1000 else (2, 1)
    q, k, v = make_qkv(B, H, N, N, D, 11, seed=N + window)
    mask = make_mask(B, N, seed=N) if masked else None
    out = linattn.local_attention(q, k, v, window=window, causal=causal, key_padding_mask=mask, scale=0.3)
    expected = ref.local_attention(q, k, v, window, causal=causal, mask=mask, scale=0.3)
    assert out.dtype == torch.float64 and out.shape == (B, H, N, 11)
    assert_close(out, expected, msg="output")
    for name, g, ge in zip("qkv", grads(out, (q, k, v)), grads(expected, (q, k, v))):
        assert torch.isfinite(g).all()
        assert_close(g, ge, msg=f"grad {name}")
    lib = local_attention_reference(q, k, v, window=window, causal=causal, key_padding_mask=mask, scale=0.3)
    assert_close(lib, expected, msg="library reference")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 65, 130])
def test_window_at_least_n_is_full_softmax(causal, N):
    q, k, v = make_qkv(2, 2, N, N, 16, 8, seed=1)
    mask = make_mask(2, N, seed=2)
    for window in (max(N - 1, 1), N, 10 * N + 7):
        out = linattn.local_attention(q, k, v, window=window, causal=causal, key_padding_mask=mask)
        full = linattn.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
        assert_close(out, full, msg=f"window {window}")


def test_the_band_is_what_it_says():
    """Perturbing a key just outside the window leaves the output alone; just inside does not."""
    N, W, i = 50, 6, 25
    q, k, v = make_qkv(1, 1, N, N, 8, 4, requires_grad=False)
    for causal in (False, True):
        base = linattn.local_attention(q, k, v, window=W, causal=causal)[0, 0, i]
        for j, inside in [(i - W, True), (i - W - 1, False), (i + 1, not causal), (i + W, not causal), (i + W + 1, False)]:
            v2 = v.clone()
            v2[0, 0, j] += 1.0
            moved = not torch.equal(linattn.local_attention(q, k, v2, window=W, causal=causal)[0, 0, i], base)
            assert moved == inside, (causal, j)


@pytest.mark.parametrize("content", ["huge", "nan"])
@pytest.mark.parametrize("causal", [False, True])
def test_padding_content_never_leaks(content, causal):
    B, H, N, W = 2, 2, 77, 9
    q, k, v = make_qkv(B, H, N, N, 16, 8)
    mask = make_mask(B, N, all_padded_row=False)
    out = linattn.local_attention(q, k, v, window=W, causal=causal, key_padding_mask=mask)
    val = 1e30 if content == "huge" else float("nan")
    pad = ~mask[:, None, :, None]
    k2 = torch.where(pad, torch.full_like(k, val), k).detach().requires_grad_()
    v2 = torch.where(pad, torch.full_like(v, val), v).detach().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    out2 = linattn.local_attention(q2, k2, v2, window=W, causal=causal, key_padding_mask=mask)
    assert_close(out2, out)
    g2 = grads(out2, (q2, k2, v2))
    for a, b in zip(g2, grads(out, (q, k, v))):
        assert torch.isfinite(a).all()
        assert_close(a, b)
    gk, gv = g2[1:]
    assert torch.equal(gk * pad, torch.zeros_like(gk)) and torch.equal(gv * pad, torch.zeros_like(gv))


@pytest.mark.parametrize("causal", [False, True])
def test_query_without_keys_gets_zeros(causal):
    q, k, v = make_qkv(2, 2, 40, 40, 8, 8)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1] = False
    mask[0, :10] = False  # window 3: queries 0..6 (bidirectional) or 0..9 (causal) of batch 0 see no key
    out = linattn.local_attention(q, k, v, window=3, causal=causal, key_padding_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    lonely = 10 if causal else 7
    assert torch.equal(out[0, :, :lonely], torch.zeros_like(out[0, :, :lonely]))
    assert out[0, :, lonely].abs().sum() > 0
    assert_close(out, ref.local_attention(q, k, v, 3, causal=causal, mask=mask))
    for g in grads(out, (q, k, v)):
        assert torch.isfinite(g).all()


def _run_in_pieces(q, k, v, mask, window, cuts):
    """Causal local attention over consecutive pieces [cuts[i], cuts[i+1]), each resuming the last state."""
    outs, state = [], None
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, state = linattn.local_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], window=window, causal=True,
            key_padding_mask=None if mask is None else mask[:, a:b], initial_state=state, return_state=True,
        )
        outs.append(o)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("N,window,cuts", [
    (65, 7, [0, 1, 65]), (65, 64, [0, 64, 65]), (130, 9, [0, 63, 64, 130]), (1000, 40, [0, 513, 1000]),
    (64, 5, [0, 0, 64]), (64, 5, [0, 64, 64]), (50, 300, [0, 20, 50]), (33, 3, [0, 2, 3, 4, 33]),
])
def test_split_and_resume_equals_whole(N, window, cuts):
    q, k, v = make_qkv(2, 2, N, N, 16, 7, seed=N + window)
    mask = make_mask(2, N, seed=len(cuts), all_padded_row=False)
    whole, whole_state = linattn.local_attention(q, k, v, window=window, causal=True, key_padding_mask=mask,
                                                 return_state=True)
    resumed, state = _run_in_pieces(q, k, v, mask, window, cuts)
    assert_close(resumed, whole)
    assert state.pos == whole_state.pos == N
    for name in ("k", "v", "valid"):
        assert torch.equal(getattr(state, name), getattr(whole_state, name)), name
    # gradients flow through the carried state into the earlier pieces
    loss_w = (whole * torch.cos(whole)).sum() + whole_state.k.square().sum()
    loss_r = (resumed * torch.cos(resumed)).sum() + state.k.square().sum()
    for gw, gr in zip(torch.autograd.grad(loss_w, (q, k, v)), torch.autograd.grad(loss_r, (q, k, v))):
        assert_close(gr, gw)


def test_step_by_step_equals_parallel():
    N, W = 70, 9
    q, k, v = make_qkv(2, 2, N, N, 16, 12, seed=5)
    mask = make_mask(2, N, seed=5, all_padded_row=False)
    mask[0, :3] = False  # left padding: the first queries of batch 0 have no key at all
    par = linattn.local_attention(q, k, v, window=W, causal=True, key_padding_mask=mask)
    rec, _ = _run_in_pieces(q, k, v, mask, W, list(range(N + 1)))
    assert_close(rec, par)
    assert torch.equal(par[0, :, :3], torch.zeros_like(par[0, :, :3]))
    for gp, gr in zip(grads(par, (q, k, v)), grads(rec, (q, k, v))):
        assert torch.isfinite(gp).all()
        assert_close(gr, gp)


@pytest.mark.parametrize("N,W", [(29, 6), (5, 9), (40, 1)])
def test_unpadded_steps_equal_parallel_outputs_states_and_gradients(N, W):
    # one unpadded position at a time takes the decoding fast path (SDPA over the unrolled ring);
    # N > W wraps the ring several times, N < W leaves empty slots
    q, k, v = make_qkv(2, 3, N, N, 8, 5, seed=N + W)
    par, par_state = linattn.local_attention(q, k, v, window=W, causal=True, return_state=True)
    rec, state = _run_in_pieces(q, k, v, None, W, list(range(N + 1)))
    assert_close(rec, par)
    assert state.pos == N
    for name in ("k", "v", "valid"):
        assert torch.equal(getattr(state, name), getattr(par_state, name)), name
    # gradients through outputs and through the carried ring
    loss_p = (par * torch.cos(par)).sum() + par_state.v.square().sum()
    loss_r = (rec * torch.cos(rec)).sum() + state.v.square().sum()
    for gp, gr in zip(torch.autograd.grad(loss_p, (q, k, v)), torch.autograd.grad(loss_r, (q, k, v))):
        assert_close(gr, gp)


def test_state_is_a_ring_buffer_of_the_last_window_keys():
    N, W = 23, 5
    q, k, v = make_qkv(1, 2, N, N, 4, 3, requires_grad=False)
    mask = torch.ones(1, N, dtype=torch.bool)
    mask[0, 20] = False
    _, st = linattn.local_attention(q, k, v, window=W, causal=True, key_padding_mask=mask, return_state=True)
    assert isinstance(st, linattn.LocalAttentionState) and st.pos == N
    assert st.k.shape == (1, 2, W, 4) and st.v.shape == (1, 2, W, 3) and st.valid.shape == (1, W)
    for p in range(N - W, N):  # slot p % W holds position p
        assert torch.equal(st.v[:, :, p % W], v[:, :, p] if p != 20 else torch.zeros_like(v[:, :, p]))
        assert bool(st.valid[0, p % W]) == (p != 20)
    # a state after fewer than W positions marks the slots before position 0 empty
    _, st = linattn.local_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], window=W, causal=True, return_state=True)
    assert st.valid.tolist() == [[True, True, False, False, False]] and st.pos == 2


def test_one_step_costs_the_window_not_the_position():
    """A step at position 10**6 touches only the W slots of the state (same work as at position 1)."""
    q, k, v = make_qkv(1, 2, 1, 1, 8, 8, requires_grad=False)
    W = 4
    st = linattn.LocalAttentionState(torch.randn(1, 2, W, 8, dtype=q.dtype), torch.randn(1, 2, W, 8, dtype=q.dtype),
                                     torch.ones(1, W, dtype=torch.bool), 10**6)
    out, st2 = linattn.local_attention(q, k, v, window=W, causal=True, initial_state=st, return_state=True)
    keys = torch.cat([st.k, k], 2)
    vals = torch.cat([st.v, v], 2)
    expected = torch.softmax((q @ keys.transpose(-1, -2)) / 8**0.5, -1) @ vals
    assert_close(out, expected)
    assert st2.pos == 10**6 + 1 and torch.equal(st2.k[:, :, 10**6 % W], k[:, :, 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    q, k, v = make_qkv(1, 2, 100, 100, 16, 8, dtype=torch.float32, requires_grad=False)
    out = linattn.local_attention(q.to(dtype), k.to(dtype), v.to(dtype), window=10, causal=True)
    assert out.dtype == dtype
    expected = linattn.local_attention(q, k, v, window=10, causal=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linattn.local_attention(q, k, v, window=10)
    assert out.dtype == torch.float32


def test_empty_sequence():
    q, k, v = make_qkv(1, 2, 0, 0, 8, 5)
    out, st = linattn.local_attention(q, k, v, window=3, causal=True, return_state=True)
    assert out.shape == (1, 2, 0, 5) and st.pos == 0 and not st.valid.any()


def test_errors():
    q, k, v = make_qkv(2, 3, 5, 5, 8, 6, dtype=torch.float32, requires_grad=False)
    with pytest.raises(ValueError, match="local_attention: window must be >= 1.*got 0"):
        linattn.local_attention(q, k, v, window=0)
    with pytest.raises(TypeError, match="window must be an int.*float"):
        linattn.local_attention(q, k, v, window=2.0)
    with pytest.raises(TypeError, match="window must be an int.*bool"):
        linattn.local_attention(q, k, v, window=True)
    with pytest.raises(ValueError, match=r"as many queries as keys.*\(2, 3, 4, 8\).*\(2, 3, 5, 8\)"):
        linattn.local_attention(q[:, :, :4], k, v, window=2)
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.local_attention(q, k, v, window=2, return_state=True)
    _, st = linattn.local_attention(q, k, v, window=2, causal=True, return_state=True)
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.local_attention(q, k, v, window=2, initial_state=st)
    with pytest.raises(ValueError, match=r"initial_state.k must have shape \(2, 3, 3, 8\).*window=3.*\(2, 3, 2, 8\)"):
        linattn.local_attention(q, k, v, window=3, causal=True, initial_state=st)
    with pytest.raises(ValueError, match=r"initial_state.v must have shape \(2, 3, 2, 5\)"):
        linattn.local_attention(q, k, v[..., :5], window=2, causal=True, initial_state=st)
    with pytest.raises(ValueError, match=r"initial_state.valid must be a bool tensor of shape \(2, 2\)"):
        linattn.local_attention(q, k, v, window=2, causal=True, initial_state=st._replace(valid=st.valid.long()))
    with pytest.raises(ValueError, match="initial_state.pos must be an int >= 0, got -1"):
        linattn.local_attention(q, k, v, window=2, causal=True, initial_state=st._replace(pos=-1))
    with pytest.raises(TypeError, match="initial_state must be a LocalAttentionState.*tuple"):
        linattn.local_attention(q, k, v, window=2, causal=True, initial_state=tuple(st))
    with pytest.raises(ValueError, match="scale must be finite"):
        linattn.local_attention(q, k, v, window=2, scale=float("nan"))
