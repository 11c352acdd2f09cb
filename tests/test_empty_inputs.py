"""Empty inputs to the decayed recurrences (gated_linear_attention, delta_rule_attention and their
references): no batch row (B = 0), no head (H = 0) or no position (N = 0), in every form.

The contract is softmax_attention's and linear_attention's: the output keeps its (B, H, N, Dv)
shape and stays in the autograd graph of every input (a loss on it backpropagates, giving zero
gradients of the inputs' shapes); the returned state is a new tensor, never the caller's
initial_state.s, equal to it (zeros without one), and its gradient flows back to initial_state.s
unchanged (the state after no step is the initial state).

Legend: B batch, H heads, N positions, T packed positions, n documents, D key width, Dv value width.
"""

from __future__ import annotations

import pytest
import torch

import linattn
from linattn.functional import LinearAttentionState, favor_projection
from linattn.functional.decayed_state import DecayedState
from linattn.functional.delta import delta_rule_attention, delta_rule_attention_reference
from linattn.functional.gated import gated_linear_attention, gated_linear_attention_reference

D, DV = 4, 3

# (mechanism, gate): gated with one gate per head or per key channel; the delta rule without a
# decay (DeltaNet) or with one (Gated DeltaNet)
MECHANISMS = [("gated", "head"), ("gated", "channel"), ("delta", None), ("delta", "decay")]
MECH_IDS = ["gated-head", "gated-channel", "delta", "delta-decay"]

FUNCTIONS = {
    "gated": (gated_linear_attention, gated_linear_attention_reference),
    "delta": (delta_rule_attention, delta_rule_attention_reference),
}


def _inputs(mech, gate, B, H, N, *, n_states=None, state=False, masked=False, dtype=torch.float64, seed=0):
    """Named inputs, each requiring grad: ``q, k (B, H, N, D)``, ``v (B, H, N, Dv)``, the gates
    (``log_decay (B, H, N)`` or ``(B, H, N, D)``; ``beta (B, H, N)``), ``s0 (n_states, H, D, Dv)``
    (n_states defaults to B) or None, and ``mask`` bool ``(B, N)`` or None (no grad)."""
    g = torch.Generator().manual_seed(seed)
    x = {
        "q": torch.randn(B, H, N, D, generator=g, dtype=torch.float64),
        "k": torch.nn.functional.normalize(torch.randn(B, H, N, D, generator=g, dtype=torch.float64), dim=-1),
        "v": torch.randn(B, H, N, DV, generator=g, dtype=torch.float64),
    }
    if mech == "delta":
        x["beta"] = 2 * torch.rand(B, H, N, generator=g, dtype=torch.float64)
    if gate is not None:
        shape = (B, H, N, D) if gate == "channel" else (B, H, N)
        x["log_decay"] = -torch.rand(shape, generator=g, dtype=torch.float64)
    x = {name: t.to(dtype).requires_grad_() for name, t in x.items()}
    n = B if n_states is None else n_states
    # the state of half inputs is float32 (what the functions return for them)
    s_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x["s0"] = torch.randn(n, H, D, DV, generator=g, dtype=s_dtype).requires_grad_() if state else None
    x["mask"] = (torch.rand(B, N, generator=g) > 0.3) if masked else None
    return x


def _call(fn, mech, x, *, return_state=True, **kw):
    init = None if x["s0"] is None else DecayedState(x["s0"])
    common = dict(key_padding_mask=x["mask"], initial_state=init, return_state=return_state, **kw)
    if mech == "gated":
        return fn(x["q"], x["k"], x["v"], x["log_decay"], **common)
    return fn(x["q"], x["k"], x["v"], x["beta"], log_decay=x.get("log_decay"), **common)


def _differentiable(x):
    return {name: t for name, t in x.items() if name != "mask" and t is not None}


def _check(out, st, x, out_shape, state_shape, dtype=torch.float64):
    """Shapes, values and gradients of an empty call's output ``out`` and state ``st`` (or None)."""
    inputs = _differentiable(x)
    assert out.shape == out_shape and out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(out))
    # the output alone reaches every input (allow_unused=False), with zero gradients
    grads = torch.autograd.grad(out, list(inputs.values()), torch.ones_like(out), retain_graph=True)
    for (name, t), g in zip(inputs.items(), grads):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert torch.equal(g, torch.zeros_like(g)), name
    s0 = x["s0"]
    if st is not None:
        assert isinstance(st, DecayedState)
        assert st.s.shape == state_shape
        assert st.s.requires_grad
        if s0 is None:
            assert torch.equal(st.s, torch.zeros_like(st.s))
        else:
            assert st.s is not s0  # a new tensor, not the caller's own
            assert st.s.dtype == s0.dtype and torch.equal(st.s, s0)
            cot = torch.randn(state_shape, generator=torch.Generator().manual_seed(3), dtype=st.s.dtype)
            (g,) = torch.autograd.grad(st.s, s0, cot, retain_graph=True)
            assert torch.equal(g, cot)  # the state after no step is s0 itself: identity
    # and the plain way: one loss, one backward
    loss = out.float().sum() + (0 if st is None else st.s.float().sum())
    loss.backward()
    for name, t in inputs.items():
        assert t.grad is not None and t.grad.shape == t.shape, name
        want = torch.ones_like(t) if (name == "s0" and st is not None) else torch.zeros_like(t)
        assert torch.equal(t.grad, want), name


FORMS = {  # name: (reference?, keyword arguments)
    "chunked": (False, {}),
    "chunked-small-chunks": (False, {"chunk_size": 2}),
    "reference": (True, {}),
}


@pytest.mark.parametrize("mech,gate", MECHANISMS, ids=MECH_IDS)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("B,H,N", [(0, 2, 5), (2, 0, 5), (2, 2, 0), (0, 2, 0), (0, 0, 0)])
@pytest.mark.parametrize("state", [False, True], ids=["zeros", "initial_state"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
@pytest.mark.parametrize("return_state", [False, True], ids=["out", "out+state"])
def test_no_row_or_no_position(mech, gate, form, B, H, N, state, masked, return_state):
    reference, kw = FORMS[form]
    fn = FUNCTIONS[mech][reference]
    x = _inputs(mech, gate, B, H, N, state=state, masked=masked)
    res = _call(fn, mech, x, return_state=return_state, **kw)
    out, st = res if return_state else (res, None)
    _check(out, st, x, (B, H, N, DV), (B, H, D, DV))


@pytest.mark.parametrize("mech,gate", MECHANISMS, ids=MECH_IDS)
@pytest.mark.parametrize("B,H", [(0, 2), (2, 0)])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_recurrent_step_without_rows(mech, gate, B, H, masked):
    """N = 1 with an initial state is the recurrent form (a generation step)."""
    x = _inputs(mech, gate, B, H, 1, state=True, masked=masked)
    out, st = _call(FUNCTIONS[mech][0], mech, x)
    _check(out, st, x, (B, H, 1, DV), (B, H, D, DV))


@pytest.mark.parametrize("mech,gate", MECHANISMS, ids=MECH_IDS)
@pytest.mark.parametrize("H,cu", [(2, [0, 0]), (2, [0, 0, 0]), (0, [0, 1, 3]), (0, [0, 0])],
                         ids=["one-empty-doc", "two-empty-docs", "no-head", "no-head-empty-doc"])
@pytest.mark.parametrize("state", [False, True], ids=["zeros", "initial_state"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
def test_packed_without_positions(mech, gate, H, cu, state, masked):
    """cu_seqlens: T = 0 (every document empty), or no head at all."""
    cu = torch.tensor(cu, dtype=torch.int64)
    n, T = cu.shape[0] - 1, int(cu[-1])
    x = _inputs(mech, gate, 1, H, T, n_states=n, state=state, masked=masked)
    out, st = _call(FUNCTIONS[mech][0], mech, x, cu_seqlens=cu)
    _check(out, st, x, (1, H, T, DV), (n, H, D, DV))


@pytest.mark.parametrize("mech,gate", MECHANISMS, ids=MECH_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,N", [(0, 2, 5), (2, 2, 0)])
def test_half_inputs(mech, gate, dtype, B, H, N):
    """Half inputs: the output in the input dtype, the state float32, as for non-empty inputs."""
    x = _inputs(mech, gate, B, H, N, state=True, dtype=dtype)
    out, st = _call(FUNCTIONS[mech][0], mech, x)
    assert st.s.dtype == torch.float32
    _check(out, st, x, (B, H, N, DV), (B, H, D, DV), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The causal kernel attentions whose tiled engines had the same defect (no row, N > chunk_size)
# ---------------------------------------------------------------------------------------------


def _kernel_call(name, q, k, v, state):
    if name == "linear":
        return linattn.linear_attention(q, k, v, causal=True, chunk_size=2, initial_state=state, return_state=True)
    proj = favor_projection(8, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return linattn.favor_attention(q, k, v, proj, causal=True, chunk_size=2, initial_state=state,
                                   return_state=True)


@pytest.mark.parametrize("name", ["linear", "favor"])
@pytest.mark.parametrize("B,H", [(0, 2), (2, 0)])
@pytest.mark.parametrize("state", [False, True], ids=["zeros", "initial_state"])
def test_causal_kernel_attention_without_rows(name, B, H, state):
    N = 5
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g, dtype=torch.float64).requires_grad_() for d in (D, D, DV))
    Fd = D if name == "linear" else 8
    init = None
    if state:
        init = LinearAttentionState(S=torch.randn(B, H, Fd, DV, dtype=torch.float64),
                                    z=torch.rand(B, H, Fd, dtype=torch.float64),
                                    log_scale=None if name == "linear" else torch.zeros(B, H, dtype=torch.float64))
    out, st = _kernel_call(name, q, k, v, init)
    assert out.shape == linattn.softmax_attention(q, k, v, causal=True).shape == (B, H, N, DV)
    assert st.S.shape == (B, H, Fd, DV) and st.z.shape == (B, H, Fd)
    (out.sum() + st.S.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape
