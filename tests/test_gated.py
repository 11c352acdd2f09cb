"""gated_linear_attention: the chunked form and the recurrent step against the plain float64
recurrence (gated_linear_attention_reference), and against each other."""

import pytest
import torch

from conftest import assert_close
from linattn.functional.decayed_state import DecayedState
from linattn.functional.gated import gated_linear_attention, gated_linear_attention_reference

F64 = torch.float64


def _inputs(B, H, N, D, Dv, *, channel, lo=1.0, hi=0.0, dtype=F64, seed=0, state=True):
    """q, k, v, log_decay in [-lo, -hi] (per head or per channel), and an initial state or None."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, N, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, N, Dv, generator=g, dtype=dtype)
    shape = (B, H, N, D) if channel else (B, H, N)
    ld = -(hi + (lo - hi) * torch.rand(shape, generator=g, dtype=F64)).to(dtype)
    s0 = torch.randn(B, H, D, Dv, generator=g, dtype=dtype) if state else None
    return q, k, v, ld, s0


def _run(fn, q, k, v, ld, s0, *, seed=1, **kw):
    """Output, final state and the gradients of a random linear function of both for every input."""
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v, ld)]
    s = None if s0 is None else s0.detach().clone().requires_grad_()
    out, st = fn(*ins, initial_state=None if s is None else DecayedState(s), return_state=True, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=F64)).sum()
    loss = loss + (st.s.double() * torch.randn(st.s.shape, generator=g, dtype=F64)).sum()
    wrt = ins + ([] if s is None else [s])
    return out, st.s, torch.autograd.grad(loss, wrt)


def _compare(got, want, *, atol=1e-10, rtol=1e-9):
    names = ["out", "state", "dq", "dk", "dv", "dlog_decay", "dinitial_state"]
    (o, s, gs), (o_r, s_r, gs_r) = got, want
    for name, a, b in zip(names, [o, s, *gs], [o_r, s_r, *gs_r]):
        assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=name)


CASES = [  # N, D, Dv, chunk_size: awkward sizes; chunk sizes that do not divide N; one chunk only
    (1, 60, 5, 64),
    (63, 60, 7, 16),
    (65, 8, 5, 64),
    (65, 6, 4, 24),  # sub-chunks of 8, three per chunk
    (100, 5, 3, 7),  # a prime chunk: one sub-chunk
    (1000, 8, 6, 48),
]


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("N,D,Dv,C", CASES)
def test_chunked_matches_reference(N, D, Dv, C, channel):
    q, k, v, ld, s0 = _inputs(1, 2, N, D, Dv, channel=channel)
    got = _run(gated_linear_attention, q, k, v, ld, s0, chunk_size=C)
    _compare(got, _run(gated_linear_attention_reference, q, k, v, ld, s0))


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_without_initial_state_and_batch(channel):
    q, k, v, ld, _ = _inputs(2, 3, 70, 6, 5, channel=channel, state=False)
    got = _run(gated_linear_attention, q, k, v, ld, None, chunk_size=32)
    _compare(got, _run(gated_linear_attention_reference, q, k, v, ld, None))


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("lo,hi", [(1e-6, 0.0), (1e4, 1e4 - 1.0)], ids=["near0", "near-1e4"])
def test_extreme_decays(lo, hi, channel):
    q, k, v, ld, s0 = _inputs(1, 2, 67, 6, 5, channel=channel, lo=lo, hi=hi)
    if hi > 0:  # mix: a few positions that barely decay between full resets
        ld[..., 10:14, ...] = -1e-3
    got = _run(gated_linear_attention, q, k, v, ld, s0, chunk_size=16)
    want = _run(gated_linear_attention_reference, q, k, v, ld, s0)
    _compare(got, want)
    for t in (got[0], got[1], *got[2]):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_minus_inf_decay_is_a_full_reset(channel):
    """-inf is accepted (floored at -1000 inside the chunked form, where exp is 0 already): the
    same result as -1e4 and as the reference, every gradient finite, 0 at the -inf entries."""
    q, k, v, ld, s0 = _inputs(1, 2, 67, 6, 5, channel=channel, lo=0.3)
    reset = torch.zeros(ld.shape, dtype=torch.bool)
    reset[:, :, [0, 5, 20, 21, 66]] = True
    if channel:
        reset[:, :, 40, :3] = True  # some channels only
    got = _run(gated_linear_attention, q, k, v, ld.masked_fill(reset, float("-inf")), s0, chunk_size=16)
    _compare(got, _run(gated_linear_attention_reference, q, k, v, ld.masked_fill(reset, float("-inf")), s0))
    _compare(got, _run(gated_linear_attention, q, k, v, ld.masked_fill(reset, -1e4), s0, chunk_size=16))
    for t in (got[0], got[1], *got[2]):
        assert torch.isfinite(t).all()
    assert (got[2][3][reset] == 0).all()
    # the recurrent step too
    o1, s1 = gated_linear_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], ld[:, :, :1].clone().fill_(float("-inf")),
                                    initial_state=DecayedState(s0), return_state=True)
    assert_close(s1.s, k[:, :, 0, :, None] * v[:, :, 0, None, :], msg="state after a reset")


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_float32_huge_decay_early_in_chunk_keeps_small_ones(channel):
    """float32 inputs: a decay of -1e4 (or -inf) early in a chunk, small ones after it. The
    cumulative log decays are float64 and their differences taken before the cast: in float32 they
    would be near -1000 (the floor) and keep few digits of the small decays (errors ~1e-5)."""
    q, k, v, ld, s0 = _inputs(1, 2, 100, 8, 5, channel=channel, lo=0.01, dtype=torch.float32)
    ld[:, :, [1, 35, 70]] = -1e4
    ld[:, :, 3] = float("-inf")
    got = _run(gated_linear_attention, q, k, v, ld, s0, chunk_size=32)
    want = _run(gated_linear_attention_reference, *(x.double() for x in (q, k, v, ld, s0)))
    names = ["out", "state", "dq", "dk", "dv", "dlog_decay", "dinitial_state"]
    for name, a, b in zip(names, [got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        assert torch.isfinite(a).all(), name
        assert_close(a.double(), b, atol=2e-6 * b.abs().max().item(), rtol=0, msg=name)


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_padding_is_identity_step(channel):
    B, N = 3, 50
    q, k, v, ld, s0 = _inputs(B, 2, N, 6, 5, channel=channel)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, :7] = False  # start
    mask[1, 20:31] = False  # middle, across a chunk boundary
    mask[2, -9:] = False  # end
    pad = ~mask[:, None, :, None]
    q, k, v = (x.masked_fill(pad, float("nan")) for x in (q, k, v))
    ld = ld.masked_fill(pad if channel else pad[..., 0], float("nan"))  # never read
    got = _run(gated_linear_attention, q, k, v, ld, s0, chunk_size=16, key_padding_mask=mask)
    want = _run(gated_linear_attention_reference, q, k, v, ld, s0, key_padding_mask=mask)
    _compare(got, want)
    assert (got[0][pad.expand_as(got[0])] == 0).all()
    for gr in got[2][:4]:
        assert (gr[(pad if gr.dim() == 4 else pad[..., 0]).expand_as(gr)] == 0).all()
    # the same as dropping the padded positions of row 1
    keep = mask[1]
    o1, s1 = gated_linear_attention_reference(q[1:2, :, keep], k[1:2, :, keep], v[1:2, :, keep], ld[1:2, :, keep],
                                              initial_state=DecayedState(s0[1:2]), return_state=True)
    assert_close(got[0][1:2, :, keep], o1, msg="out without padding")
    assert_close(got[1][1:2], s1.s, msg="state without padding")


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
@pytest.mark.parametrize("p", [5, 37, 63])
def test_causal_under_perturbation_of_later_position(p, channel):
    q, k, v, ld, s0 = _inputs(1, 2, 64, 8, 5, channel=channel, dtype=torch.float32)
    out = gated_linear_attention(q, k, v, ld, initial_state=DecayedState(s0), chunk_size=32)
    q2, k2, v2, ld2 = (x.clone() for x in (q, k, v, ld))
    for x in (q2, k2, v2):
        x[:, :, p] += 10.0
    ld2[:, :, p] = -7.0
    out2 = gated_linear_attention(q2, k2, v2, ld2, initial_state=DecayedState(s0), chunk_size=32)
    assert torch.equal(out[:, :, :p], out2[:, :, :p])
    assert not torch.equal(out[:, :, p], out2[:, :, p])


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_split_and_resume_equals_whole(channel):
    q, k, v, ld, s0 = _inputs(2, 2, 90, 6, 4, channel=channel)
    whole, s_whole = gated_linear_attention(q, k, v, ld, initial_state=DecayedState(s0), return_state=True,
                                            chunk_size=16)
    cut = 37
    first, s1 = gated_linear_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], ld[:, :, :cut],
                                       initial_state=DecayedState(s0), return_state=True, chunk_size=16)
    second, s2 = gated_linear_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], ld[:, :, cut:],
                                        initial_state=s1, return_state=True, chunk_size=16)
    assert_close(torch.cat([first, second], dim=2), whole, msg="out")
    assert_close(s2.s, s_whole.s, msg="state")


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_step_by_step_equals_chunked(channel):
    q, k, v, ld, _ = _inputs(1, 2, 40, 6, 5, channel=channel, state=False)
    whole, s_whole = gated_linear_attention(q, k, v, ld, return_state=True, chunk_size=16)
    state = DecayedState(torch.zeros(1, 2, 6, 5, dtype=F64))
    outs = []
    for t in range(40):
        o, state = gated_linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], ld[:, :, t:t + 1],
                                          initial_state=state, return_state=True)
        outs.append(o)
    assert_close(torch.cat(outs, dim=2), whole, msg="out")
    assert_close(state.s, s_whole.s, msg="state")


@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_recurrent_step_gradients(channel):
    q, k, v, ld, s0 = _inputs(2, 2, 1, 6, 5, channel=channel)
    _compare(_run(gated_linear_attention, q, k, v, ld, s0), _run(gated_linear_attention_reference, q, k, v, ld, s0))


def test_channel_gate_with_equal_columns_is_head_gate():
    q, k, v, ld, s0 = _inputs(1, 2, 45, 6, 5, channel=False)
    head = gated_linear_attention(q, k, v, ld, initial_state=DecayedState(s0), chunk_size=16)
    chan = gated_linear_attention(q, k, v, ld[..., None].expand(-1, -1, -1, 6), initial_state=DecayedState(s0),
                                  chunk_size=16)
    assert_close(chan, head)


def test_scale():
    q, k, v, ld, s0 = _inputs(1, 1, 20, 4, 3, channel=False)
    a = gated_linear_attention(q, k, v, ld, scale=0.3, chunk_size=8)
    b = gated_linear_attention_reference(q, k, v, ld, scale=0.3)
    assert_close(a, b)
    assert_close(gated_linear_attention(q, k, v, ld), gated_linear_attention_reference(q * 0.5, k, v, ld, scale=1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channel", [False, True], ids=["head", "channel"])
def test_half_inputs_float32_state(dtype, channel):
    q, k, v, ld, s0 = _inputs(1, 2, 70, 8, 6, channel=channel, lo=0.2, dtype=dtype)
    s0 = s0.float()
    out, st = gated_linear_attention(q, k, v, ld, initial_state=DecayedState(s0), return_state=True, chunk_size=32)
    assert out.dtype == dtype and st.s.dtype == torch.float32
    ref, st_ref = gated_linear_attention_reference(*(x.double() for x in (q, k, v, ld)),
                                                   initial_state=DecayedState(s0.double()), return_state=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert_close(out.double(), ref.to(dtype).double(), atol=tol * ref.abs().max().item(), rtol=tol, msg="out")
    assert_close(st.s.double(), st_ref.s, atol=1e-4 * st_ref.s.abs().max().item(), rtol=1e-4, msg="state")
    xs = [x.detach().requires_grad_() for x in (q, k, v, ld)]
    gated_linear_attention(*xs, chunk_size=32).float().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all() for x in xs)
    # one step from a float32 state keeps it float32
    o1, s1 = gated_linear_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], ld[:, :, :1], initial_state=st,
                                    return_state=True)
    assert o1.dtype == dtype and s1.s.dtype == torch.float32


def test_empty_sequence():
    q, k, v, ld, s0 = _inputs(1, 2, 0, 4, 3, channel=False)
    out, st = gated_linear_attention(q, k, v, ld, initial_state=DecayedState(s0), return_state=True)
    assert out.shape == (1, 2, 0, 3)
    assert torch.equal(st.s, s0)


@pytest.mark.parametrize("fn", [gated_linear_attention, gated_linear_attention_reference])
def test_bad_inputs_raise_naming_the_argument(fn):
    q, k, v, ld, s0 = _inputs(2, 2, 10, 4, 3, channel=False)
    with pytest.raises(ValueError, match="log_decay must be <= 0"):
        fn(q, k, v, ld.abs())
    with pytest.raises(ValueError, match="log_decay must be <= 0.*got nan"):
        fn(q, k, v, ld.masked_fill(ld < -0.5, float("nan")))
    with pytest.raises(ValueError, match="log_decay must be <= 0.*got inf"):
        fn(q, k, v, ld.masked_fill(ld < -0.5, float("inf")))
    with pytest.raises(ValueError, match=r"log_decay must have shape .*\(2, 2, 10\).*got \(2, 2, 9\)"):
        fn(q, k, v, ld[:, :, :9])
    with pytest.raises(ValueError, match=r"log_decay must have shape .*got \(2, 2, 10, 3\)"):
        fn(q, k, v, ld[..., None].expand(-1, -1, -1, 3))
    with pytest.raises(TypeError, match="log_decay"):
        fn(q, k, v, None)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Nk\) = \(2, 10\)"):
        fn(q, k, v, ld, key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"k and v .*\(2, 2, 10, 4\).*\(2, 2, 9, 3\)"):
        fn(q, k, v[:, :, :9], ld)
    with pytest.raises(ValueError, match=r"q and k"):
        fn(q, k[..., :3], v, ld)
    with pytest.raises(ValueError, match=r"initial_state.s must have shape"):
        fn(q, k, v, ld, initial_state=DecayedState(s0[..., :2]))
    with pytest.raises(TypeError, match="initial_state must be a DecayedState"):
        fn(q, k, v, ld, initial_state=s0)


def test_bad_chunk_size():
    q, k, v, ld, _ = _inputs(1, 1, 10, 4, 3, channel=False)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_linear_attention(q, k, v, ld, chunk_size=0)
