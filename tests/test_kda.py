"""Kimi Delta Attention (issue 31): the delta rule with one decay per key channel,

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t,

``delta_rule_attention(..., log_decay=(B, H, N, D))``: the chunked form and its backward against the
float64 reference recurrence (outputs, every input gradient, final states), at awkward sizes,
extreme decays and beta, padding, packed documents, split-and-resume and one step at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional import DecayedState, delta_rule_attention_reference

B, H = 2, 2


def _inputs(n, d=6, dv=5, *, seed=0, decay="moderate", beta="uniform", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, d, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, H, n, d, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, n, dv, generator=g, dtype=dtype)
    b = torch.rand(B, H, n, generator=g, dtype=dtype) * 2
    if beta == "extremes":
        b = torch.where(torch.rand(B, H, n, generator=g) < 0.5, 0.0, 2.0).to(dtype)
    ld = F.logsigmoid(torch.randn(B, H, n, d, generator=g, dtype=dtype) + 3)  # near 0
    if decay == "extreme":  # some channels reset (-inf), some decay hugely (-1e4), the rest near 0
        u = torch.rand(B, H, n, d, generator=g)
        ld = torch.where(u < 0.05, float("-inf"), torch.where(u < 0.1, -1e4, ld.double())).to(dtype)
    elif decay == "strong":
        ld = -torch.rand(B, H, n, d, generator=g, dtype=dtype) * 3
    return q, k, v, b, ld


def _compare(fast, ref, tensors, rtol=1e-7, atol=1e-9):
    out_f, st_f = fast
    out_r, st_r = ref
    torch.testing.assert_close(out_f, out_r, rtol=rtol, atol=atol)
    torch.testing.assert_close(st_f.s, st_r.s, rtol=rtol, atol=atol)
    gen = torch.Generator().manual_seed(5)
    co, cs = torch.randn(out_r.shape, generator=gen, dtype=out_r.dtype), torch.randn(st_r.s.shape, generator=gen,
                                                                                      dtype=out_r.dtype)
    live = [t for t in tensors if t.requires_grad]
    gf = torch.autograd.grad((out_f * co).sum() + (st_f.s * cs).sum(), live, allow_unused=True)
    gr = torch.autograd.grad((out_r * co).sum() + (st_r.s * cs).sum(), live, allow_unused=True)
    for i, (a, b) in enumerate(zip(gf, gr)):
        torch.testing.assert_close(a, b, rtol=rtol * 100, atol=atol * 100, msg=f"gradient {i}")


# chunk lengths 16 and 32 run sub-chunks of 4 (4 and 8 of them), 8 two, 6 two of 3, 5 five of 1
@pytest.mark.parametrize("n,chunk", [(1, 32), (63, 16), (65, 16), (1000, 16), (200, 32), (40, 8), (63, 6), (40, 5)])
@pytest.mark.parametrize("decay", ["moderate", "strong", "extreme"])
def test_chunked_equals_the_reference(n, chunk, decay):
    q, k, v, b, ld = (t.requires_grad_() for t in _inputs(n, decay=decay))
    s0 = DecayedState(torch.randn(B, H, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
                      .requires_grad_())
    fast = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, initial_state=s0, return_state=True,
                                        chunk_size=chunk, chunks_per_block=2)
    ref = delta_rule_attention_reference(q, k, v, b, log_decay=ld, initial_state=s0, return_state=True)
    _compare(fast, ref, [q, k, v, b, ld, s0.s])


def test_awkward_widths_and_beta_at_its_ends():
    q, k, v, b, ld = (t.requires_grad_() for t in _inputs(70, d=60, dv=7, beta="extremes"))
    fast = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, return_state=True, chunk_size=16)
    ref = delta_rule_attention_reference(q, k, v, b, log_decay=ld, return_state=True)
    _compare(fast, ref, [q, k, v, b, ld])


def test_a_per_head_decay_repeated_over_channels_is_gated_deltanet():
    q, k, v, b, ld = _inputs(50)
    head = ld[..., 0]
    per_channel = head[..., None].expand_as(ld).contiguous()
    torch.testing.assert_close(linattn.delta_rule_attention(q, k, v, b, log_decay=per_channel, chunk_size=16),
                               linattn.delta_rule_attention(q, k, v, b, log_decay=head, chunk_size=16))


def test_padding_packed_resumed_and_step_by_step():
    q, k, v, b, ld = _inputs(45, decay="strong")
    mask = torch.ones(B, 45, dtype=torch.bool)
    mask[0, :3] = mask[0, 20:24] = mask[1, 40:] = False
    got = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, key_padding_mask=mask, chunk_size=8)
    want = delta_rule_attention_reference(q, k, v, b, log_decay=ld, key_padding_mask=mask)
    torch.testing.assert_close(got, want)
    # packed documents, empty and one-token ones among them
    cu = torch.tensor([0, 9, 9, 10, 45])
    one = [t[:1] for t in (q, k, v, b, ld)]
    packed, states = linattn.delta_rule_attention(*one[:4], log_decay=one[4], cu_seqlens=cu, return_state=True,
                                                  chunk_size=8)
    for i in range(4):
        lo, hi = int(cu[i]), int(cu[i + 1])
        part = [t[:, :, lo:hi] for t in one]
        o, st = delta_rule_attention_reference(*part[:4], log_decay=part[4], return_state=True)
        torch.testing.assert_close(packed[:, :, lo:hi], o)
        torch.testing.assert_close(states.s[i:i + 1], st.s)
    # split and resumed, and one step at a time, equal the whole
    whole = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, chunk_size=8)
    o1, st = linattn.delta_rule_attention(*(t[:, :, :17] for t in (q, k, v, b)), log_decay=ld[:, :, :17],
                                          return_state=True, chunk_size=8)
    o2 = linattn.delta_rule_attention(*(t[:, :, 17:] for t in (q, k, v, b)), log_decay=ld[:, :, 17:],
                                      initial_state=st, chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2], 2), whole)
    state, steps = None, []
    for t in range(10):
        o, state = linattn.delta_rule_attention(*(x[:, :, t:t + 1] for x in (q, k, v, b)),
                                                log_decay=ld[:, :, t:t + 1], initial_state=state, return_state=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), whole[:, :, :10])


def test_causal_under_perturbation():
    q, k, v, b, ld = _inputs(40, decay="strong", dtype=torch.float32)
    base = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, chunk_size=8)
    ld2 = ld.clone()
    ld2[:, :, 25:] = -5.0
    k2 = k.clone()
    k2[:, :, 25:] = F.normalize(torch.randn_like(k2[:, :, 25:]), dim=-1)
    moved = linattn.delta_rule_attention(q, k2, v, b, log_decay=ld2, chunk_size=8)
    torch.testing.assert_close(moved[:, :, :25], base[:, :, :25], rtol=0, atol=0)


def test_half_inputs_keep_a_float32_state_and_float32_is_close():
    q, k, v, b, ld = _inputs(100, decay="strong", dtype=torch.float32)
    ref = delta_rule_attention_reference(*(t.double() for t in (q, k, v, b)), log_decay=ld.double())
    got = linattn.delta_rule_attention(q, k, v, b, log_decay=ld, chunk_size=32)
    assert (got.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    out, st = linattn.delta_rule_attention(*(t.bfloat16() for t in (q, k, v, b)), log_decay=ld.bfloat16(),
                                           return_state=True)
    assert out.dtype == torch.bfloat16 and st.s.dtype == torch.float32


def _sharded(rank: int, P: int) -> dict:
    """On each of 2 gloo ranks: this rank's shard [0, 13) or [13, 30) of a KDA call."""
    import linattn.distributed as cp

    q, k, v, b, ld = _inputs(30, decay="strong")
    lo, hi = (0, 13) if rank == 0 else (13, 30)
    part = [t[:, :, lo:hi].clone().requires_grad_() for t in (q, k, v, b, ld)]
    o, st = cp.delta_rule_attention(*part[:4], log_decay=part[4], return_state=True, chunk_size=4)
    cot = torch.randn(o.shape[0], o.shape[1], 30, o.shape[3], generator=torch.Generator().manual_seed(1),
                      dtype=o.dtype)[:, :, lo:hi]
    return {"out": o.detach(), "state": st.s.detach(),
            "grads": [g.detach() for g in torch.autograd.grad(o, part, cot)]}


def test_context_parallel_over_two_ranks(tmp_path):
    """The shard summary carries the per-channel transition (the [v, 0] call from [0 | I])."""
    from ranks import gloo_ranks

    results = gloo_ranks(_sharded, 2, tmp_path)
    whole = [t.requires_grad_() for t in _inputs(30, decay="strong")]
    o, st = linattn.delta_rule_attention(*whole[:4], log_decay=whole[4], return_state=True)
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    want = torch.autograd.grad(o, whole, cot)
    torch.testing.assert_close(torch.cat([r["out"] for r in results], 2), o.detach())
    for r in results:
        torch.testing.assert_close(r["state"], st.s.detach())
    for i, w in enumerate(want):
        torch.testing.assert_close(torch.cat([r["grads"][i] for r in results], 2), w, msg=f"gradient {i}")


@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("batched", [False, True])
def test_strong_per_channel_decays_leave_no_subnormal_decay_factors_in_float32(C, batched):
    """Per-channel decays as strong as a Qwen3.5 layer's at initialisation (A up to 16) made the
    products of decays subnormal in float32, where every product with them runs several times
    slower on a CPU: the CPU's form of the decays (row by row) flushes the factors below
    log_decays.negligible_decay as they are formed (in float32; float64's are kept), over 4 and 16
    sub-chunks. The accelerator's (batched) leaves them, subnormal ones included: an accelerator
    computes them at full speed, and the flush would be passes over the decays for nothing. KDA in
    float32 still matches float64 on both strategies, and float64 the reference."""
    from linattn.functional.decayed import channel_decays

    g = torch.Generator().manual_seed(3)
    B, H, N, D = 1, 2, 192, 16
    log_decay = -torch.empty(H, 1, 1, dtype=torch.float64).uniform_(0.01, 16, generator=g) * \
        F.softplus(torch.randn(B, H, N, D, generator=g, dtype=torch.float64) + 1)
    decays = channel_decays(log_decay.float().reshape(-1, C, D), 4, batched)
    before = decays.before()
    tiny = torch.finfo(torch.float32).tiny
    subnormal = {}
    for name, t in (("runs", torch.cat([r.flatten() for r in decays.runs[1:]])), ("inner", decays.inner),
                    ("from_start", decays.from_start(before)), ("to_end", decays.to_end()),
                    ("whole", decays.whole(before)), ("between", decays.between())):
        subnormal[name] = bool(((t != 0) & (t.abs() < tiny)).any())
    assert any(subnormal.values()) == batched, subnormal
    q, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    k = F.normalize(torch.randn(B, H, N, D, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.sigmoid(torch.randn(B, H, N, generator=g, dtype=torch.float64))
    want = delta_rule_attention_reference(q, k, v, beta, log_decay=log_decay)
    got64 = linattn.delta_rule_attention(q, k, v, beta, log_decay=log_decay)
    got32 = linattn.delta_rule_attention(q.float(), k.float(), v.float(), beta.float(), log_decay=log_decay.float(),
                                         chunk_size=C, strategy="accelerator" if batched else "cpu")
    scale = want.abs().max()
    assert float((got64 - want).abs().max() / scale) < 1e-12
    assert float((got32.double() - want).abs().max() / scale) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batched", [False, True])
def test_channel_decays_against_the_exponentials_of_cumulative_sums(dtype, batched):
    """Both forms of the per-channel decays (the CPU's products row by row, the accelerator's
    cumulative products) against exp of differences of float64 cumulative sums, their definition
    (mild decays, where the flush moves nothing), 16 sub-chunks of 4; and a reset (a log decay
    below -40, -inf included) a decay of exactly 0 in both dtypes."""
    from linattn.functional.decayed import channel_decays

    gen = torch.Generator().manual_seed(5)
    M, C, D, c = 6, 64, 8, 4
    n = C // c
    g = F.logsigmoid(torch.randn(M, C, D, generator=gen, dtype=torch.float64) + 3)
    b = g.cumsum(1)  # b_t, from the chunk's start
    r = b.view(M, n, c, D)[:, :, -1]  # r_i, at the end of sub-chunk i
    start = torch.cat([torch.zeros(M, 1, D, dtype=g.dtype), r[:, :-1]], 1)  # r_{i-1}
    decays = channel_decays(g.to(dtype), c, batched)
    tol = {"rtol": 1e-5 if dtype == torch.float32 else 1e-12, "atol": 0.0}
    torch.testing.assert_close(decays.inner.double(), (b.view(M, n, c, D) - start[:, :, None]).exp(), **tol)
    torch.testing.assert_close(decays.rev.double(), (r[:, :, None] - b.view(M, n, c, D)).exp(), **tol)
    torch.testing.assert_close(decays.total.double(), (r - start).exp(), **tol)
    i, j = torch.arange(1, n)[:, None], torch.arange(n - 1)[None, :]
    want = (r[:, i - 1] - r[:, j]).exp() * (j < i)[..., None]  # exp(r_{i-1} - r_j) for j < i, else 0
    torch.testing.assert_close(decays.between().double(), want, **tol)
    g[0, 5, 1], g[1, 0, 0], g[2, 63, 7] = -float("inf"), -41.0, -1e4
    a = channel_decays(g.to(dtype), c, batched).a.reshape(M, C, D)
    assert a[0, 5, 1] == 0 and a[1, 0, 0] == 0 and a[2, 63, 7] == 0
    assert (a[g > -40] > 0).all()
