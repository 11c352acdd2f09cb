"""delta_rule_attention (DeltaNet, Gated DeltaNet) against its plain float64 recurrence, and its
forms against each other: chunked = step by step = split and resumed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional.decayed_state import DecayedState
from linattn.functional.delta import delta_rule_attention, delta_rule_attention_reference
from linattn.functional.strategy import EngineOptions

f64 = torch.float64


def make(B=1, H=2, N=65, D=60, Dv=48, *, decay=True, dtype=f64, seed=0, g_low=-1.0, g_high=0.0,
         state=False):
    """Random inputs: unit keys, beta in [0, 2], log decays in [g_low, g_high]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=gen, dtype=f64)
    k = F.normalize(torch.randn(B, H, N, D, generator=gen, dtype=f64), dim=-1)
    v = torch.randn(B, H, N, Dv, generator=gen, dtype=f64)
    beta = 2 * torch.rand(B, H, N, generator=gen, dtype=f64)
    g = (g_low + (g_high - g_low) * torch.rand(B, H, N, generator=gen, dtype=f64)) if decay else None
    s0 = torch.randn(B, H, D, Dv, generator=gen, dtype=f64) if state else None
    cast = (lambda t: None if t is None else t.to(dtype))
    return dict(q=cast(q), k=cast(k), v=cast(v), beta=cast(beta), log_decay=cast(g),
                initial_state=None if s0 is None else DecayedState(s0))


def call(fn, x, **kw):
    return fn(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"], initial_state=x["initial_state"],
              return_state=True, **kw)


def close(a, b, tol=1e-10):
    assert a.shape == b.shape
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol * (1 + b.abs().max().item() if b.numel() else 1), err


# ---------------------------------------------------------------------------------------------
# Against the reference: outputs, final states and every gradient
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 63, 65, 1000])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_outputs_and_state_match_reference(N, decay, chunk_size):
    x = make(N=N, decay=decay, state=True, seed=N)
    out, st = call(delta_rule_attention, x, chunk_size=chunk_size)
    ref, st_ref = call(delta_rule_attention_reference, x)
    assert out.dtype == f64 and out.shape == (1, 2, N, 48) and st.s.shape == (1, 2, 60, 48)
    close(out, ref)
    close(st.s, st_ref.s)


def _grads(fn, x, names, seed=1, **kw):
    """Gradients of a random linear function of (out, final state) w.r.t. ``names``."""
    leaves = {n: (x[n].s if n == "initial_state" else x[n]).clone().requires_grad_() for n in names}
    y = dict(x)
    for n, t in leaves.items():
        y[n] = DecayedState(t) if n == "initial_state" else t
    out, st = call(fn, y, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum() \
        + (st.s * torch.randn(st.s.shape, generator=gen, dtype=st.s.dtype)).sum()
    return torch.autograd.grad(loss, list(leaves.values()))


ALL = ["q", "k", "v", "beta", "log_decay", "initial_state"]


@pytest.mark.parametrize("N,chunk_size", [(1, 64), (63, 16), (65, 64), (300, 32)])
@pytest.mark.parametrize("decay", [False, True])
def test_gradients_match_reference(N, chunk_size, decay):
    x = make(N=N, decay=decay, state=True, seed=N + 7)
    names = [n for n in ALL if decay or n != "log_decay"]
    got = _grads(delta_rule_attention, x, names, chunk_size=chunk_size)
    want = _grads(delta_rule_attention_reference, x, names)
    for n, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), n
        close(a, b, 1e-9)


def test_gradcheck_tiny():
    """The hand-written backward against finite differences, several chunks and a partial one."""
    x = make(B=1, H=1, N=9, D=3, Dv=2, state=True, seed=3)
    leaves = [x[n].clone().requires_grad_() for n in ["q", "k", "v", "beta", "log_decay"]]
    s0 = x["initial_state"].s.clone().requires_grad_()

    def fn(q, k, v, beta, g, s):
        out, st = delta_rule_attention(q, k, v, beta, log_decay=g, initial_state=DecayedState(s),
                                       return_state=True, chunk_size=4)
        return out, st.s

    assert torch.autograd.gradcheck(fn, (*leaves, s0))


def test_many_blocks_of_chunks():
    """Chunk size 2 at N = 1000: hundreds of chunks, the chunked form's blocks carry the state."""
    x = make(N=1000, D=8, Dv=8, state=True, seed=11)
    out, st = call(delta_rule_attention, x, chunk_size=2)
    ref, st_ref = call(delta_rule_attention_reference, x)
    close(out, ref)
    close(st.s, st_ref.s)
    names = ["k", "beta", "log_decay", "initial_state"]
    for a, b in zip(_grads(delta_rule_attention, x, names, chunk_size=3),
                    _grads(delta_rule_attention_reference, x, names)):
        close(a, b, 1e-9)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 5000])
def test_chunk_size_changes_nothing(chunk_size):
    x = make(N=40 if chunk_size == 1 else 100, seed=5, state=True)
    out, st = call(delta_rule_attention, x, chunk_size=chunk_size)
    ref, st_ref = call(delta_rule_attention_reference, x)
    close(out, ref)
    close(st.s, st_ref.s)


# ---------------------------------------------------------------------------------------------
# Edge values of beta and the decay
# ---------------------------------------------------------------------------------------------


def test_beta_at_zero_and_two():
    x = make(N=70, seed=2, state=True)
    x["beta"] = torch.where(torch.rand(x["beta"].shape, generator=torch.Generator().manual_seed(0)) < 0.5,
                            torch.zeros_like(x["beta"]), torch.full_like(x["beta"], 2.0))
    names = ["q", "k", "v", "beta", "log_decay", "initial_state"]
    close(call(delta_rule_attention, x, chunk_size=16)[0], call(delta_rule_attention_reference, x)[0])
    for a, b in zip(_grads(delta_rule_attention, x, names, chunk_size=16),
                    _grads(delta_rule_attention_reference, x, names)):
        close(a, b, 1e-9)


def test_beta_zero_without_decay_keeps_the_initial_state():
    x = make(N=40, decay=False, seed=4, state=True)
    x["beta"] = torch.zeros_like(x["beta"])
    out, st = call(delta_rule_attention, x, chunk_size=16)
    s0 = x["initial_state"].s
    close(st.s, s0)
    close(out, (x["q"] @ s0) / 60 ** 0.5)


@pytest.mark.parametrize("low,high", [(-1e-6, 0.0), (-1e4, -1e4 + 1), (-1e4, 0.0)])
def test_extreme_decays(low, high):
    """Decays near 1 (log near 0), near 0 (log near -1e4), and both mixed within a chunk."""
    x = make(N=130, seed=6, state=True, g_low=low, g_high=high)
    if low == -1e4 and high == 0.0:  # mostly mild decays, some huge ones, one -inf
        mild = -0.1 * torch.rand(x["beta"].shape, generator=torch.Generator().manual_seed(1), dtype=f64)
        x["log_decay"] = torch.where(x["log_decay"] < -9000, x["log_decay"], mild)
        x["log_decay"][0, 0, 50] = float("-inf")
    out, st = call(delta_rule_attention, x, chunk_size=32)
    ref, st_ref = call(delta_rule_attention_reference, x)
    close(out, ref)
    close(st.s, st_ref.s)
    for n, a, b in zip(ALL, _grads(delta_rule_attention, x, ALL, chunk_size=32),
                       _grads(delta_rule_attention_reference, x, ALL)):
        assert torch.isfinite(a).all(), n
        close(a, b, 1e-9)


def test_float32_with_huge_decays_mixed_in():
    """In float32 a decay of exp(-1e4) early in a chunk must not drown the mild ones after it."""
    x = make(N=256, seed=8, g_low=-0.05, g_high=0.0)
    x["log_decay"][..., ::17] = -1e4
    ref = call(delta_rule_attention_reference, x)[0]
    y = {n: (t.float() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    out = call(delta_rule_attention, y)[0]
    assert out.dtype == torch.float32
    close(out.double(), ref, 1e-5)


# ---------------------------------------------------------------------------------------------
# Padding, causality, resuming, stepping
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["start", "middle", "end", "mixed"])
def test_padding_is_an_identity_step(where):
    B, N = 2, 50
    x = make(B=B, N=N, seed=9, state=True)
    mask = torch.ones(B, N, dtype=torch.bool)
    if where == "start":
        mask[:, :7] = False
    elif where == "middle":
        mask[0, 20:37] = False
        mask[1, 30] = False
    elif where == "end":
        mask[:, -9:] = False
    else:
        mask[0, :3] = mask[0, 25:29] = mask[1, -1] = False
    # NaN in every padded position must not leak into outputs, states or gradients
    for n in ["q", "k", "v", "beta", "log_decay"]:
        x[n] = x[n].clone()
        x[n].transpose(1, 2)[~mask] = float("nan")  # (B, N, H, ...) indexed by (B, N)
    out, st = call(delta_rule_attention, x, chunk_size=16, key_padding_mask=mask)
    ref, st_ref = call(delta_rule_attention_reference, x, key_padding_mask=mask)
    assert (out.transpose(1, 2)[~mask] == 0).all()
    close(out, ref)
    close(st.s, st_ref.s)
    # ... and equals the sequence with the padded positions taken out
    for b in range(B):
        sub = {n: (t[b:b + 1][:, :, mask[b]] if n != "initial_state" else DecayedState(t.s[b:b + 1]))
               for n, t in x.items()}
        o_b, st_b = call(delta_rule_attention, sub, chunk_size=16)
        close(out[b:b + 1][:, :, mask[b]], o_b)
        close(st.s[b:b + 1], st_b.s)
    got = _grads(delta_rule_attention, x, ALL, chunk_size=16, key_padding_mask=mask)
    want = _grads(delta_rule_attention_reference, x, ALL, key_padding_mask=mask)
    for n, a, b in zip(ALL, got, want):
        assert torch.isfinite(a).all(), n
        close(a, b, 1e-9)


@pytest.mark.parametrize("decay", [False, True])
def test_causal_under_perturbation_of_a_later_position(decay):
    x = make(N=150, seed=10, decay=decay, dtype=torch.float32)
    out = call(delta_rule_attention, x)[0]
    for t0 in (0, 40, 63, 64, 149):
        y = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        for n in ["q", "k", "v"]:
            y[n][:, :, t0] += 1.0
        y["beta"][:, :, t0] = 2.0 - y["beta"][:, :, t0]
        if decay:
            y["log_decay"][:, :, t0] = -5.0
        out2 = call(delta_rule_attention, y)[0]
        assert torch.equal(out2[:, :, :t0], out[:, :, :t0]), t0
        assert not torch.equal(out2[:, :, t0:], out[:, :, t0:])


@pytest.mark.parametrize("split", [1, 30, 64, 99])
def test_split_and_resume(split):
    x = make(N=100, seed=12, state=True)
    whole, st = call(delta_rule_attention, x, chunk_size=16)
    first = {n: (t[:, :, :split] if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    o1, st1 = call(delta_rule_attention, first, chunk_size=16)
    second = {n: (t[:, :, split:] if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    second["initial_state"] = st1
    o2, st2 = call(delta_rule_attention, second, chunk_size=16)
    close(torch.cat([o1, o2], dim=2), whole)
    close(st2.s, st.s)


@pytest.mark.parametrize("decay", [False, True])
def test_step_by_step_equals_chunked(decay):
    x = make(N=70, seed=13, decay=decay, state=True)
    whole, st = call(delta_rule_attention, x)
    state, outs = x["initial_state"], []
    for t in range(70):
        o, state = delta_rule_attention(x["q"][:, :, t:t + 1], x["k"][:, :, t:t + 1], x["v"][:, :, t:t + 1],
                                        x["beta"][:, :, t:t + 1],
                                        log_decay=None if not decay else x["log_decay"][:, :, t:t + 1],
                                        initial_state=state, return_state=True)
        outs.append(o)
    close(torch.cat(outs, dim=2), whole)
    close(state.s, st.s)


def test_non_contiguous_inputs():
    """Inputs in (B, N, H, D) memory seen as (B, H, N, D), as a projection followed by a transpose
    gives them."""
    x = make(B=2, H=3, N=90, D=8, Dv=5, seed=20, state=True)
    y = {n: (t.transpose(1, 2).contiguous().transpose(1, 2) if isinstance(t, torch.Tensor) else t)
         for n, t in x.items()}
    assert not y["q"].is_contiguous()
    out, st = call(delta_rule_attention, y, chunk_size=16)
    ref, st_ref = call(delta_rule_attention_reference, x)
    close(out, ref)
    close(st.s, st_ref.s)


def test_step_gradients_match_reference():
    x = make(N=1, seed=14, state=True)
    for a, b in zip(_grads(delta_rule_attention, x, ALL), _grads(delta_rule_attention_reference, x, ALL)):
        close(a, b)


def test_empty_sequence():
    x = make(N=0, seed=15, state=True)
    out, st = call(delta_rule_attention, x)
    assert out.shape == (1, 2, 0, 48)
    close(st.s, x["initial_state"].s)


# ---------------------------------------------------------------------------------------------
# Half precision
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_a_float32_state(dtype):
    x = make(N=200, seed=16, dtype=dtype)
    out, st = call(delta_rule_attention, x)
    assert out.dtype == dtype and st.s.dtype == torch.float32
    ref, st_ref = call(delta_rule_attention_reference, {n: (t.double() if isinstance(t, torch.Tensor) else t)
                                                         for n, t in x.items()})
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    close(out.double(), ref, tol)
    close(st.s.double(), st_ref.s, 1e-4)  # from the same (rounded) inputs, all float32 after them
    leaves = [x[n].clone().requires_grad_() for n in ["q", "k", "v", "beta", "log_decay"]]
    o = delta_rule_attention(*leaves[:4], log_decay=leaves[4])
    o.float().square().sum().backward()
    for t in leaves:
        assert t.grad.dtype == dtype and torch.isfinite(t.grad).all()
    # a half state resumes too (it is taken to float32)
    o2 = delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], initial_state=DecayedState(st.s.to(dtype)))
    assert o2.dtype == dtype


# ---------------------------------------------------------------------------------------------
# Against Hugging Face's pure-PyTorch gated delta rule (a comparison of results)
# ---------------------------------------------------------------------------------------------


def test_equals_transformers_torch_chunk_gated_delta_rule():
    qwen = pytest.importorskip(
        "transformers.models.qwen3_next.modeling_qwen3_next",
        reason="transformers (with Qwen3-Next) is not installed: nothing to compare with",
    )
    x = make(B=2, H=3, N=150, D=32, Dv=16, seed=17, dtype=torch.float32, g_low=-0.3)
    s0 = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(3))
    x["initial_state"] = DecayedState(s0)
    out, st = call(delta_rule_attention, x)
    t = (lambda a: a.transpose(1, 2).contiguous())  # (B, H, N, ...) -> (B, N, H, ...)
    hf_out, hf_state = qwen.torch_chunk_gated_delta_rule(
        t(x["q"]), t(x["k"]), t(x["v"]), t(x["log_decay"]), t(x["beta"]), chunk_size=64,
        initial_state=s0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=False)
    close(out, hf_out.transpose(1, 2), 1e-4)
    close(st.s, hf_state, 1e-4)


# ---------------------------------------------------------------------------------------------
# Bad inputs raise, naming the argument
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [delta_rule_attention, delta_rule_attention_reference])
def test_bad_inputs_raise_naming_the_argument(fn):
    x = make(N=10, seed=18, D=4, Dv=3)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["log_decay"]
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, beta + 2.5)
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, beta - 2.5)
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, torch.full_like(beta, float("nan")))
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, beta[..., :5])
    with pytest.raises(TypeError, match="beta"):
        fn(q, k, v, beta > 1)
    with pytest.raises(ValueError, match="log_decay"):
        fn(q, k, v, beta, log_decay=g + 1.5)
    # one bad entry among good ones, per head and per key channel (KDA): positive, NaN, +inf
    for gate in (g, g[..., None].expand(*g.shape, q.shape[-1])):
        for bad in (0.25, float("nan"), float("inf")):
            one = gate.clone()
            one[0, 1, 7] = bad
            with pytest.raises(ValueError, match=f"log_decay must be <= 0.* got {bad}"):
                fn(q, k, v, beta, log_decay=one)
    with pytest.raises(ValueError, match="log_decay"):
        fn(q, k, v, beta, log_decay=g[..., None])
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, beta, initial_state=DecayedState(torch.zeros(1, 2, 3, 4, dtype=f64)))
    with pytest.raises(TypeError, match="initial_state"):
        fn(q, k, v, beta, initial_state=torch.zeros(1, 2, 4, 3, dtype=f64))
    with pytest.raises(TypeError, match="key_padding_mask"):
        fn(q, k, v, beta, key_padding_mask=torch.ones(1, 10))
    with pytest.raises(ValueError, match="key_padding_mask"):
        fn(q, k, v, beta, key_padding_mask=torch.ones(1, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\bk\b"):
        fn(q, k[..., :3], v, beta)
    with pytest.raises(ValueError, match="k and v"):
        fn(q, k, v[:, :, :9], beta)
    with pytest.raises(TypeError, match="scale"):
        fn(q, k, v, beta, scale="1")
    with pytest.raises(TypeError):
        fn(q, k, v, beta, causal=False)  # no bidirectional form
    if fn is delta_rule_attention:
        with pytest.raises(ValueError, match="chunk_size"):
            fn(q, k, v, beta, chunk_size=0)


def test_out_of_range_gates_at_padded_positions_are_ignored():
    x = make(N=10, seed=19, D=4, Dv=3)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 4] = False
    beta, g = x["beta"].clone(), x["log_decay"].clone()
    beta[:, :, 4], g[:, :, 4] = 7.0, 3.0
    out = delta_rule_attention(x["q"], x["k"], x["v"], beta, log_decay=g, key_padding_mask=mask)
    ref = delta_rule_attention_reference(x["q"], x["k"], x["v"], beta, log_decay=g, key_padding_mask=mask)
    close(out, ref)


@pytest.mark.parametrize("decay", [None, "head", "channel"])
def test_a_call_no_gradient_flows_through_keeps_no_states(decay):
    """Under no_grad (prefill, evaluation) the chunked op keeps nothing for a backward (neither the
    state before every block nor the chunks' T, U, W, E, KK, P), and gives bit for bit the same output and
    state as a call that keeps them."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 3, 300, 16
    q, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, H, N, D, generator=g), dim=-1)
    beta = torch.rand(B, H, N, generator=g)
    ld = {None: None, "head": -torch.rand(B, H, N, generator=g), "channel": -torch.rand(B, H, N, D, generator=g)}[decay]
    with torch.no_grad():
        out, state = linattn.delta_rule_attention(q, k, v, beta, log_decay=ld, return_state=True, chunks_per_block=3)
    qg = q.clone().requires_grad_()
    out_g, state_g = linattn.delta_rule_attention(qg, k, v, beta, log_decay=ld, return_state=True, chunks_per_block=3)
    assert torch.equal(out, out_g.detach()) and torch.equal(state.s, state_g.s.detach())
    rows = [t.reshape(B * H, N, *t.shape[3:]) for t in (q * D ** -0.5, k, v, beta)]
    g_rows = None if ld is None else ld.reshape(B * H, N, *ld.shape[3:])
    op = torch.ops.linattn.delta_rule_chunked.default
    s0 = q.new_zeros(B * H, D, D)
    options = EngineOptions(32, per_tile=3, solve_block=16).encode()
    kept = op(*rows, g_rows, s0, 1.0, True, None, options)
    light = op(*rows, g_rows, s0, 1.0, False, None, options)
    Nc, R = -(-N // 32), B * H
    assert kept[2].shape == (-(-Nc // 3) + 1, R, D, D)  # the state before every block of 3 chunks, and after
    assert [t.shape for t in kept[3:6]] == [(Nc, R, 32, 32), (Nc, R, 32, D), (Nc, R, 32, D)]  # T, U, W
    # E, KK, P: the scores, kept where the backward takes them as they are (E only with a decay;
    # a gate per key channel forms its scores again)
    want = {None: [0, 1, 1], "head": [1, 1, 1], "channel": [0, 0, 0]}[decay]
    assert [t.shape if w else t.numel() for t, w in zip(kept[6:9], want)] == \
        [(Nc, R, 32, 32) if w else 0 for w in want]
    assert kept[9].numel() == 0  # no L2 normalisation: no factors kept
    assert all(t.numel() == 0 for t in light[2:])
    assert torch.equal(kept[2][-1], kept[1])  # the last kept state is the final one
    assert torch.equal(kept[0], light[0]) and torch.equal(kept[1], light[1])


# ---------------------------------------------------------------------------------------------
# qk_l2norm_eps: the L2 normalisation of q and k inside the engine
# ---------------------------------------------------------------------------------------------


def _unnormalised(x, seed):
    """x with q and k of varied norms (some near sqrt(eps), where eps inside the root matters)."""
    gen = torch.Generator().manual_seed(seed)
    y = dict(x)
    for name in ("q", "k"):
        t = x[name]
        norms = torch.exp(3 * torch.randn(t.shape[:-1], generator=gen, dtype=f64)).to(t.dtype)[..., None]
        y[name] = t * norms
        y[name][..., :2, :] *= 1e-4  # two positions with norms around 1e-4
    return y


@pytest.mark.parametrize("decay", [None, "head", "channel"])
@pytest.mark.parametrize("N,chunk_size,grouped", [(1, 16, False), (70, 16, False), (70, 32, True), (300, 32, False)])
def test_l2norm_inside_matches_reference(decay, N, chunk_size, grouped):
    """Outputs, final state and every gradient (of the unnormalised q and k) against the reference
    with the same option, in float64: chunk fill (N = 70), one position, grouped value heads, the
    three kinds of decay."""
    x = _unnormalised(make(N=N, D=12, Dv=10, decay=decay is not None, state=True, seed=N + 3), N)
    if decay == "channel":
        gen = torch.Generator().manual_seed(N)
        x["log_decay"] = -torch.rand(1, 2, N, 12, generator=gen, dtype=f64)
    if grouped:  # one key head for two value heads
        x["q"], x["k"] = x["q"][:, :1], x["k"][:, :1]
    names = [n for n in ALL if decay is not None or n != "log_decay"]
    for eps in (1e-6, 0.5):
        out, st = call(delta_rule_attention, x, chunk_size=chunk_size, qk_l2norm_eps=eps)
        ref, st_ref = call(delta_rule_attention_reference, x, qk_l2norm_eps=eps)
        close(out, ref)
        close(st.s, st_ref.s)
        got = _grads(delta_rule_attention, x, names, chunk_size=chunk_size, qk_l2norm_eps=eps)
        want = _grads(delta_rule_attention_reference, x, names, qk_l2norm_eps=eps)
        for n, a, b in zip(names, got, want):
            close(a, b, 1e-9)


def test_l2norm_inside_equals_normalised_inputs():
    """The option gives what normalised inputs give: outputs and the gradients chained by hand
    through x / sqrt(sum x^2 + eps); and the recurrent step (N = 1 with a state) and packed
    documents, with and without states inserted, agree with the chunked form."""
    x = _unnormalised(make(N=50, D=8, Dv=6, state=True, seed=4), 4)
    eps = 1e-6

    def normalised(t):
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + eps)

    y = dict(x, q=normalised(x["q"]), k=normalised(x["k"]))
    close(call(delta_rule_attention, x, qk_l2norm_eps=eps)[0], call(delta_rule_attention, y)[0])
    q, k = x["q"].clone().requires_grad_(), x["k"].clone().requires_grad_()
    out = delta_rule_attention(q, k, x["v"], x["beta"], log_decay=x["log_decay"], qk_l2norm_eps=eps)
    q2, k2 = x["q"].clone().requires_grad_(), x["k"].clone().requires_grad_()
    out2 = delta_rule_attention(normalised(q2), normalised(k2), x["v"], x["beta"], log_decay=x["log_decay"])
    w = torch.randn(out.shape, dtype=f64)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k)), torch.autograd.grad((out2 * w).sum(), (q2, k2))):
        close(a, b)
    # the step: position 50 after the first 49
    _, st = delta_rule_attention(x["q"][:, :, :49], x["k"][:, :, :49], x["v"][:, :, :49], x["beta"][:, :, :49],
                                 log_decay=x["log_decay"][:, :, :49], return_state=True, qk_l2norm_eps=eps)
    step = delta_rule_attention(x["q"][:, :, 49:], x["k"][:, :, 49:], x["v"][:, :, 49:], x["beta"][:, :, 49:],
                                log_decay=x["log_decay"][:, :, 49:], initial_state=st, qk_l2norm_eps=eps)
    whole = delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], log_decay=x["log_decay"], qk_l2norm_eps=eps)
    close(step, whole[:, :, 49:])
    # packed: two documents of 20 and 30, with initial states and final states, and without
    cu = torch.tensor([0, 20, 50])
    packed = {n: x[n][:1] for n in ("q", "k", "v", "beta", "log_decay")}
    s0 = torch.randn(2, 2, 8, 6, dtype=f64)
    for states in (False, True):
        got = delta_rule_attention(packed["q"], packed["k"], packed["v"], packed["beta"], log_decay=packed["log_decay"],
                                   cu_seqlens=cu, qk_l2norm_eps=eps, return_state=states,
                                   initial_state=DecayedState(s0) if states else None)
        got = got[0] if states else got
        for i, (a, b) in enumerate([(0, 20), (20, 50)]):
            one = delta_rule_attention(*(packed[n][:, :, a:b] for n in ("q", "k", "v", "beta")),
                                       log_decay=packed["log_decay"][:, :, a:b], qk_l2norm_eps=eps,
                                       initial_state=DecayedState(s0[i:i + 1]) if states else None)
            close(got[:, :, a:b], one)


@pytest.mark.parametrize("eps,error", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                       ("1e-6", TypeError), (True, TypeError)])
def test_l2norm_eps_is_checked(eps, error):
    x = make(N=5, D=4, Dv=3)
    for fn in (delta_rule_attention, delta_rule_attention_reference):
        with pytest.raises(error, match="qk_l2norm_eps"):
            call(fn, x, qk_l2norm_eps=eps)


def test_gradient_of_any_layout_arrives_whole():
    """The backward reads the output's gradient as it comes: expanded (of out.sum()), transposed
    (of an output transposed afterwards) and contiguous give the same gradients."""
    x = make(N=70, D=8, Dv=6, seed=5)
    q = x["q"].clone().requires_grad_()

    def grad(loss_of):
        out = delta_rule_attention(q, x["k"], x["v"], x["beta"], log_decay=x["log_decay"], chunk_size=16)
        return torch.autograd.grad(loss_of(out), q)[0]

    want = grad(lambda out: (out * torch.ones_like(out)).sum())
    close(grad(lambda out: out.sum()), want)  # stride-0 gradient
    close(grad(lambda out: out.transpose(1, 2).contiguous().sum()), want)
    w = torch.randn(1, 70, 2, 6, dtype=f64)
    close(grad(lambda out: (out.transpose(1, 2) * w).sum()), grad(lambda out: (out * w.transpose(1, 2)).sum()))


def test_threads_running_the_engine_at_once_keep_their_own_buffers():
    """The chunked form's kept tile buffers are per thread: two threads running forward and
    backward at once (different sizes, so a shared buffer would be resized under the other) give
    what each gives alone; release_kept_buffers frees the calling thread's."""
    import threading

    from linattn.functional import chunks

    xs = [make(N=n, D=d, Dv=d, seed=n) for n, d in ((300, 16), (200, 24))]

    def run(x):
        q = x["q"].clone().requires_grad_()
        out = delta_rule_attention(q, x["k"], x["v"], x["beta"], log_decay=x["log_decay"], chunk_size=8,
                                   chunks_per_block=2)
        return out.detach(), torch.autograd.grad(out.square().sum(), q)[0]

    alone = [run(x) for x in xs]
    got = [[], []]

    def worker(i):
        for _ in range(5):
            got[i].append(run(xs[i]))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(got[i]) == 5
        for out, grad in got[i]:
            assert torch.equal(out, alone[i][0]) and torch.equal(grad, alone[i][1])
    assert chunks._KEPT.__dict__.get("buffers")
    chunks.release_kept_buffers()
    assert not chunks._KEPT.__dict__.get("buffers")


def test_outputs_and_gradients_come_back_in_the_inputs_layout():
    """Inputs viewed from transformers' (B, N, H, D) layout, B = 1, get the output laid out as v and
    gradients laid out as their inputs (autograd then hands them over as they are, not copied into
    the inputs' strides), equal to those of contiguous inputs."""
    x = make(N=64, D=8, Dv=6, seed=3)
    names = ("q", "k", "v", "beta", "log_decay")
    leaves = {n: x[n].transpose(1, 2).contiguous().requires_grad_() for n in names}  # (B, N, H, ...)
    seen = {n: t.transpose(1, 2) for n, t in leaves.items()}  # (B, H, N, ...) views
    out = delta_rule_attention(seen["q"], seen["k"], seen["v"], seen["beta"], log_decay=seen["log_decay"],
                               chunk_size=16, qk_l2norm_eps=1e-6)
    assert out.transpose(1, 2).is_contiguous()  # (B, N, H, Dv), as v's leaf
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), [seen[n] for n in names])
    plain = {n: x[n].clone().requires_grad_() for n in names}
    out2 = delta_rule_attention(plain["q"], plain["k"], plain["v"], plain["beta"], log_decay=plain["log_decay"],
                                chunk_size=16, qk_l2norm_eps=1e-6)
    want = torch.autograd.grad((out2 * w).sum(), [plain[n] for n in names])
    close(out, out2)
    for n, got, ref in zip(names, grads, want):
        laid = [s for s, size in zip(got.stride(), got.shape) if size > 1]  # B = 1: its stride is moot
        assert laid == [s for s, size in zip(seen[n].stride(), got.shape) if size > 1], n
        close(got, ref)


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_strong_decays_leave_no_subnormal_numbers_in_the_kept_inverse(strategy):
    """A Qwen3.5 layer's decays at initialisation (-A softplus(a + 1), A up to 16) make the chunks'
    triangular inverses products of many small entries; in float32 those reached the subnormal
    range, where every product with them runs several times slower on a CPU. There, entries
    negligible beside the unit diagonal are flushed (log_decays.negligible_decay): none is left
    subnormal. The accelerator strategy leaves them (an accelerator computes them at full speed).
    Either way the result matches float64."""
    from linattn.functional.log_decays import NEGLIGIBLE_DECAY_FLOAT32, flush_negligible

    g = torch.Generator().manual_seed(0)
    R, N, D = 8, 256, 32
    q, v = torch.randn(R, N, D, generator=g), torch.randn(R, N, D, generator=g)
    k = F.normalize(torch.randn(R, N, D, generator=g), dim=-1)
    b = torch.sigmoid(torch.randn(R, N, generator=g))
    ld = -torch.empty(R, 1).uniform_(0.01, 16, generator=g) * F.softplus(torch.randn(R, N, generator=g) + 1)
    op = torch.ops.linattn.delta_rule_chunked.default
    options = EngineOptions(32, strategy, per_tile=4, solve_block=32).encode()
    out = op(q, k, v, b, ld, q.new_zeros(R, D, D), D ** -0.5, True, None, options)
    T = out[3]
    tiny = torch.finfo(torch.float32).tiny
    assert ((T != 0) & (T.abs() < tiny)).any() == (strategy == "accelerator")
    assert ((T != 0) & (T.abs() < 1e-6)).any()  # small entries kept, only negligible ones flushed
    want = op(*(t.double() for t in (q, k, v, b, ld)), q.new_zeros(R, D, D, dtype=f64), D ** -0.5,
              True, None, options)
    assert float((out[0].double() - want[0]).abs().max() / want[0].abs().max()) < 1e-5
    flushed = flush_negligible(torch.tensor([NEGLIGIBLE_DECAY_FLOAT32 / 2, NEGLIGIBLE_DECAY_FLOAT32 * 2]))
    assert flushed[0] == 0 and flushed[1] > 0


def _decay_grads(per_channel: bool, N: int, D: int, H: int, scale_g: float, seed: int, fns: dict,
                 resets: bool = False) -> dict:
    """The log decay's gradient of a weighted sum of the delta rule's outputs, weak decays
    ``-U(0, scale_g)`` (per head or per key channel), for each ``name: (fn, dtype, kwargs)``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, N, D, dtype=f64, generator=gen)
    k = F.normalize(torch.randn(1, H, N, D, dtype=f64, generator=gen), dim=-1)
    v = torch.randn(1, H, N, D, dtype=f64, generator=gen)
    beta = torch.rand(1, H, N, dtype=f64, generator=gen)
    g = -torch.rand(*((1, H, N, D) if per_channel else (1, H, N)), dtype=f64, generator=gen) * scale_g
    if resets:  # a document boundary: the state forgotten there
        g[:, :, N // 3] = -1e4
    weights = torch.randn(1, H, N, D, dtype=f64, generator=gen)
    out = {}
    for name, (fn, dtype, kw) in fns.items():
        xs = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v, beta, g)]
        (fn(*xs[:4], log_decay=xs[4], **kw) * weights.to(dtype)).sum().backward()
        out[name] = xs[4].grad.double()
    return out


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_the_telescoped_decay_gradient_stays_close_over_a_long_sequence(strategy, per_channel):
    """gamma_C's gradient at each chunk's end is telescoped between exact energies
    (delta._energies, every ANCHOR_SPAN chunks): 128 chunks here, in one block on the accelerator.
    Under weak decays, where the states and their energies are largest against the gradient, the
    float32 log-decay gradient stays within 1e-5 of float64's (1-2e-6 here when written). A 0.1%
    error in one term of a chunk's change fails it."""
    grads = _decay_grads(per_channel, 2048, 16, 2, 1e-3, 3, {
        "ref": (delta_rule_attention_reference, f64, {}),
        "got": (delta_rule_attention, torch.float32, dict(chunk_size=16, strategy=strategy))})
    ref, got = grads["ref"], grads["got"]
    assert float((got - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_the_energies_are_exact_at_every_span_of_a_block(strategy, per_channel):
    """Blocks of more than ANCHOR_SPAN chunks, of lengths that are no multiple of it (the first
    span short), with a reset: telescoping between exact energies is exact algebra, so float64
    gives the reference's log-decay gradient. An energy anchored at the wrong chunk is off by
    whole terms of the sum."""
    from linattn.functional.delta import ANCHOR_SPAN

    N, C = 700, 7  # 100 chunks: the accelerator's one block is 3 spans and a short one
    kw = dict(chunks_per_block=70) if strategy == "cpu" else {}  # CPU blocks of 70 and 30 chunks
    assert N // C > 3 * ANCHOR_SPAN and (N // C) % ANCHOR_SPAN and 70 % ANCHOR_SPAN
    grads = _decay_grads(per_channel, N, 8, 2, 0.05, 5, {
        "ref": (delta_rule_attention_reference, f64, {}),
        "got": (delta_rule_attention, f64, dict(chunk_size=C, strategy=strategy, **kw))}, resets=True)
    ref, got = grads["ref"], grads["got"]
    assert float((got - ref).norm() / ref.norm()) < 1e-10


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_accelerators_states_formed_again_do_not_drift(per_channel):
    """The accelerator's backward forms the states again from the kept pseudo-values by a recurrence
    that does not repeat its forward's rounding (the forward scans the full transitions) and does
    not damp the difference: over a whole sequence the states, and q's gradient with them, drifted
    from the forward's with N (float32, weak decays, one head 16 wide: 2.1e-6 at N = 8192, 4.6e-6 at
    32768). Started again from the forward's states every ANCHOR_SPAN chunks, the error is that of
    one span at any length: at N = 32768 (512 chunks) within 1.5x of N = 2048's (one span)."""
    def q_grad_error(N):
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(1, 1, N, 16, generator=g), F.normalize(torch.randn(1, 1, N, 16, generator=g), dim=-1)
        v, beta = torch.randn(1, 1, N, 16, generator=g), torch.rand(1, 1, N, generator=g)
        decay = -torch.rand(1, 1, N, *((16,) if per_channel else ()), generator=g) * 1e-5
        weight = torch.randn(1, 1, N, 16, generator=g, dtype=f64)

        def dq(dtype, strategy):
            x = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v, beta)]
            out = delta_rule_attention(*x, log_decay=decay.to(dtype), strategy=strategy)
            (out.double() * weight).sum().backward()
            return x[0].grad.double()

        ref = dq(f64, "cpu")
        return float((dq(torch.float32, "accelerator") - ref).norm() / ref.norm())

    short, long = q_grad_error(2048), q_grad_error(32768)
    assert long <= 1.5 * short and long < 5e-6, (short, long)


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_decay_gradient_does_not_drift_along_a_sequence(per_channel):
    """N = 16384 of one narrow head (16 wide): a CPU block is then 1024 chunks and the
    accelerator's 256 chunks of 64. Telescoped over a whole block, the float32 log-decay gradient
    drifted to 1.1e-5 of float64's (per head, accelerator) and to 1.5e-5 at N = 65536 (CPU); between
    exact energies every ANCHOR_SPAN chunks it measured 0.8-3.3e-6 when written
    (docs/benchmarks/kda_energies/anchors.md). Both strategies stay within the 1e-5 asked of every
    fast form."""
    grads = _decay_grads(per_channel, 16384, 16, 1, 1e-3, 3, {
        "ref": (delta_rule_attention_reference, f64, {}),
        "cpu": (delta_rule_attention, torch.float32, dict(strategy="cpu")),
        "accelerator": (delta_rule_attention, torch.float32, dict(strategy="accelerator"))})
    ref = grads.pop("ref")
    errors = {name: float((got - ref).norm() / ref.norm()) for name, got in grads.items()}
    assert max(errors.values()) < 1e-5, errors
