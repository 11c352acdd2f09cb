"""Grouped value heads (issue 31): q, k ``(B, Hk, N, D)`` serve v, beta and the decays with H heads,
value head h reading query/key head h // (H / Hk), in the delta-rule and gated forms: fast against
the float64 reference, against the same call with q and k repeated by the caller (gradients summed
over each group), packed, resumed from a returned state, and refused with a clear message."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional import DecayedState

B, H, D, DV = 2, 4, 6, 5

FORMS = {
    "deltanet": (linattn.delta_rule_attention, linattn.functional.delta_rule_attention_reference, "beta", None),
    "gated deltanet": (linattn.delta_rule_attention, linattn.functional.delta_rule_attention_reference, "beta",
                       "head"),
    "gla per head": (linattn.gated_linear_attention, linattn.functional.gated_linear_attention_reference, None,
                     "head"),
    "gla per channel": (linattn.gated_linear_attention, linattn.functional.gated_linear_attention_reference, None,
                        "channel"),
}


def _inputs(form, n, groups, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hk = H // groups
    q = torch.randn(B, hk, n, D, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, hk, n, D, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, n, DV, generator=g, dtype=dtype)
    _, _, beta, decay = FORMS[form]
    args = [q, k, v]
    kw = {}
    if beta:
        args.append(torch.rand(B, H, n, generator=g, dtype=dtype) * 2)
    if decay is not None:
        shape = (B, H, n) if decay == "head" else (B, H, n, D)
        ld = F.logsigmoid(torch.randn(*shape, generator=g, dtype=dtype) + 3)
        if beta:
            kw["log_decay"] = ld
        else:
            args.append(ld)
    return [a.requires_grad_() for a in args], {k: t.requires_grad_() for k, t in kw.items()}


def _call(fn, args, kw, **extra):
    return fn(*args, **kw, **extra)


def _grads(out, tensors, seed=1):
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, tensors, cot, retain_graph=True)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 63, 65])
def test_grouped_equals_the_reference_and_the_caller_repeating(form, groups, n):
    fast, ref, _, _ = FORMS[form]
    args, kw = _inputs(form, n, groups)
    tensors = args + list(kw.values())
    out = _call(fast, args, kw, chunk_size=16)
    want = _call(ref, args, kw)
    torch.testing.assert_close(out, want)
    for g_fast, g_ref in zip(_grads(out, tensors), _grads(want, tensors)):
        torch.testing.assert_close(g_fast, g_ref)
    # the same call with q and k repeated by the caller: equal outputs, q's and k's gradients summed
    rep = [t.detach().repeat_interleave(groups, dim=1).requires_grad_() for t in args[:2]]
    out_rep = _call(fast, rep + args[2:], kw, chunk_size=16)
    torch.testing.assert_close(out, out_rep)
    gq, gk = _grads(out, args[:2])
    rq, rk = _grads(out_rep, rep)
    torch.testing.assert_close(gq, rq.view(B, H // groups, groups, n, D).sum(2))
    torch.testing.assert_close(gk, rk.view(B, H // groups, groups, n, D).sum(2))


@pytest.mark.parametrize("form", list(FORMS))
def test_grouped_packed_and_resumed(form):
    fast, _, _, _ = FORMS[form]
    args, kw = _inputs(form, 40, 2)
    args = [a.detach()[:1] for a in args]
    kw = {k: t.detach()[:1] for k, t in kw.items()}
    cu = torch.tensor([0, 7, 7, 8, 40])
    packed, states = _call(fast, args, kw, cu_seqlens=cu, return_state=True, chunk_size=8)
    for i in range(4):
        lo, hi = int(cu[i]), int(cu[i + 1])

        def part(t):
            return t[:, :, lo:hi]

        one, st = _call(fast, [part(a) for a in args], {k: part(t) for k, t in kw.items()}, return_state=True,
                        chunk_size=8)
        torch.testing.assert_close(packed[:, :, lo:hi], one)
        torch.testing.assert_close(states.s[i:i + 1], st.s)
    # split at 13 and resumed from the returned state = the whole
    whole = _call(fast, args, kw, chunk_size=8)
    first, st = _call(fast, [a[:, :, :13] for a in args], {k: t[:, :, :13] for k, t in kw.items()},
                      return_state=True, chunk_size=8)
    rest = _call(fast, [a[:, :, 13:] for a in args], {k: t[:, :, 13:] for k, t in kw.items()},
                 initial_state=DecayedState(st.s), chunk_size=8)
    torch.testing.assert_close(torch.cat([first, rest], 2), whole)
    # one step at a time (the recurrent form) = the whole
    state, steps = None, []
    for t in range(6):
        o, state = _call(fast, [a[:, :, t:t + 1] for a in args], {k: x[:, :, t:t + 1] for k, x in kw.items()},
                         initial_state=state, return_state=True)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 2), whole[:, :, :6])


@pytest.mark.parametrize("form", list(FORMS))
def test_grouped_heads_refused_by_name(form):
    fast, _, _, _ = FORMS[form]
    args, kw = _inputs(form, 5, 1)
    q, k = args[0].detach(), args[1].detach()
    with pytest.raises(ValueError, match=r"multiple of q's and k's Hk .* q \(2, 3, 5, 6\)"):
        _call(fast, [q[:, :3], k[:, :3]] + args[2:], kw)
    with pytest.raises(ValueError, match=r"q and k must have the same number of heads"):
        _call(fast, [q[:, :2], k[:, :1]] + args[2:], kw)


def test_grouped_context_parallel_with_a_group_of_one():
    import linattn.distributed as cp

    args, kw = _inputs("gla per head", 9, 2)
    torch.testing.assert_close(cp.gated_linear_attention(*args), linattn.gated_linear_attention(*args))
    args, kw = _inputs("gated deltanet", 9, 2)
    torch.testing.assert_close(cp.delta_rule_attention(*args, **kw), linattn.delta_rule_attention(*args, **kw))


def _sharded(rank: int, P: int) -> dict:
    """On each of 2 gloo ranks: this rank's shard [0, 11) or [11, 30) of the grouped calls."""
    import linattn.distributed as cp

    out = {}
    for form in ("gla per head", "gla per channel", "gated deltanet"):
        args, kw = _inputs(form, 30, 2)
        lo, hi = (0, 11) if rank == 0 else (11, 30)
        part = [a.detach()[:, :, lo:hi].requires_grad_() for a in args]
        kwp = {k: t.detach()[:, :, lo:hi].requires_grad_() for k, t in kw.items()}
        fn = cp.gated_linear_attention if form.startswith("gla") else cp.delta_rule_attention
        o, st = fn(*part, **kwp, return_state=True, chunk_size=4)
        # this rank's slice of the whole sequence's cotangent: the ranks' losses sum to the whole's
        cot = torch.randn(B, H, 30, DV, generator=torch.Generator().manual_seed(1), dtype=o.dtype)[:, :, lo:hi]
        grads = torch.autograd.grad(o, part + list(kwp.values()), cot)
        out[form] = {"out": o.detach(), "state": st.s.detach(), "grads": [g.detach() for g in grads]}
    return out


def test_grouped_context_parallel_over_two_ranks(tmp_path):
    from ranks import gloo_ranks

    results = gloo_ranks(_sharded, 2, tmp_path)
    for form in ("gla per head", "gla per channel", "gated deltanet"):
        fast = FORMS[form][0]
        args, kw = _inputs(form, 30, 2)
        o, st = _call(fast, args, kw, return_state=True)
        want = _grads(o, args + list(kw.values()))
        torch.testing.assert_close(torch.cat([r[form]["out"] for r in results], 2), o.detach(), msg=form)
        for r in results:
            torch.testing.assert_close(r[form]["state"], st.s.detach(), msg=form)
        for i, w in enumerate(want):
            torch.testing.assert_close(torch.cat([r[form]["grads"][i] for r in results], 2), w, msg=f"{form} {i}")
