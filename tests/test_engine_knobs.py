"""The engines' tuning knobs are keyword arguments (issue 29): any value gives the same result as the
default (outputs, gradients and final states, float64), and a bad value is refused by name."""

import pytest
import torch
import torch.nn.functional as F

import linattn

F64 = torch.float64
N = 75  # chunks of 8 and 16 leave a partial one


def _inputs(width_gate):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, N, 6, generator=g, dtype=F64) for _ in range(3))
    k = F.normalize(k, dim=-1)
    shape = (2, 3, N) if width_gate == 1 else (2, 3, N, 6)
    gate = F.logsigmoid(torch.randn(*shape, generator=g, dtype=F64) + 1)
    beta = torch.rand(2, 3, N, generator=g, dtype=F64)
    return q, k, v, gate, beta


def _run(fn, tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out, state = fn(*leaves)
    (out.square().sum() + state.s.sin().sum()).backward()
    return [out.detach(), state.s.detach(), *[t.grad for t in leaves]]


@pytest.mark.parametrize("width", [1, 6])
@pytest.mark.parametrize("knobs", [dict(sub_chunk_size=1), dict(sub_chunk_size=3), dict(sub_chunk_size=16),
                                   dict(tile_positions=1), dict(tile_positions=100),
                                   dict(chunk_size=16, sub_chunk_size=8, tile_positions=50)])
def test_gated_knobs_do_not_change_the_result(width, knobs):
    q, k, v, gate, _ = _inputs(width)
    base = dict(chunk_size=8)

    def fn(**kw):
        return lambda q, k, v, g: linattn.gated_linear_attention(q, k, v, g, return_state=True, **kw)

    want = _run(fn(**base), (q, k, v, gate))
    got = _run(fn(**{**base, **knobs}), (q, k, v, gate))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("knobs", [dict(chunks_per_block=1), dict(chunks_per_block=2), dict(solve_block=1),
                                   dict(solve_block=3), dict(chunk_size=16, solve_block=64, chunks_per_block=3)])
def test_delta_rule_knobs_do_not_change_the_result(decay, knobs):
    q, k, v, gate, beta = _inputs(1)
    base = dict(chunk_size=8)

    def fn(**kw):
        if decay:
            return lambda q, k, v, b, g: linattn.delta_rule_attention(q, k, v, b, log_decay=g, return_state=True,
                                                                      **kw)
        return lambda q, k, v, b, g: linattn.delta_rule_attention(q, k, v, b, return_state=True, **kw)

    want = _run(fn(**base), (q, k, v, beta, gate))
    got = _run(fn(**{**base, **knobs}), (q, k, v, beta, gate))
    for a, b in zip(got, want):
        if a is None or b is None:  # the unused gate without a decay
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


KNOB_CHECKS = [("gated", name) for name in ("sub_chunk_size", "tile_positions", "chunk_size")] + [
    ("delta", name) for name in ("chunks_per_block", "solve_block", "chunk_size")]


@pytest.mark.parametrize("form,name", KNOB_CHECKS)
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_knobs_are_checked(form, name, value):
    q, k, v, gate, beta = _inputs(1)
    with pytest.raises((ValueError, TypeError), match=name):
        if form == "gated":
            linattn.gated_linear_attention(q, k, v, gate, **{name: value})
        else:
            linattn.delta_rule_attention(q, k, v, beta, **{name: value})
