"""Cumulative log decays in float32 (functional/log_decays.py): the gated and delta-rule chunked
forms compute without float64, forward and backward, and stay within 1e-5 (relative to the
output's largest entry) of float64 at decays near 0, at -1e4, with -inf resets, just above the
reset threshold (-39: the hardest case for the digits of the small decays after it), packed, and
at N = 65536 (there against the float64 chunked form, which the reference checks at smaller N)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional.delta import delta_rule_attention_reference
from linattn.functional.gated import gated_linear_attention_reference
from probes import OpProbe, deterministic_algorithms

KINDS = ("near 0", "-1e4", "-inf", "-39")


def _gates(kind, shape, g):
    base = F.logsigmoid(torch.randn(shape, generator=g, dtype=torch.float64) + 6)  # about -0.0025
    if kind == "near 0":
        return base
    value = {"-1e4": -1e4, "-inf": float("-inf"), "-39": -39.0}[kind]
    return base.masked_fill(torch.rand(shape, generator=g, dtype=torch.float64) < 0.05, value)


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


def _inputs(N, seed=1, B=1, H=2, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    beta = torch.sigmoid(torch.randn(B, H, N, generator=g, dtype=torch.float64))
    return g, q, F.normalize(k, dim=-1), v, beta


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N, exact", [(2000, True), (65536, False)])
def test_float32_within_1e5_of_float64(kind, N, exact):
    g, q, k, v, beta = _inputs(N)
    gated64 = gated_linear_attention_reference if exact else linattn.gated_linear_attention
    delta64 = delta_rule_attention_reference if exact else linattn.delta_rule_attention
    for log_decay in (_gates(kind, q.shape[:3], g), _gates(kind, q.shape, g)):  # per head, per channel
        o64, s64 = gated64(q, k, v, log_decay, return_state=True)
        o32, s32 = linattn.gated_linear_attention(q.float(), k.float(), v.float(), log_decay.float(),
                                                  return_state=True)
        assert _rel(o32, o64) < 1e-5 and _rel(s32.s, s64.s) < 1e-5, (kind, log_decay.dim())
    log_decay = _gates(kind, q.shape[:3], g)
    o64, s64 = delta64(q, k, v, beta, log_decay=log_decay, return_state=True)
    o32, s32 = linattn.delta_rule_attention(q.float(), k.float(), v.float(), beta.float(),
                                            log_decay=log_decay.float(), return_state=True)
    assert _rel(o32, o64) < 1e-5 and _rel(s32.s, s64.s) < 1e-5, kind


@pytest.mark.parametrize("kind", KINDS + ("layer",))
def test_delta_rule_float32_gradients_within_2e5_of_float64(kind):
    """The gated delta rule's gradients (every input, the log decays' included, with the L2
    normalisation of q and k) in float32 against the float64 chunked form (itself checked against
    the reference elsewhere), relative to each gradient's largest entry; "layer": the decays of a
    Qwen3.5 layer at initialisation (-A softplus(a + 1), A up to 16)."""
    g, q, k, v, beta = _inputs(2000, D=32)
    if kind == "layer":
        A = torch.empty(q.shape[1], 1, dtype=torch.float64).uniform_(0.01, 16, generator=g)
        log_decay = -A * F.softplus(torch.randn(q.shape[:3], generator=g, dtype=torch.float64) + 1)
    else:
        log_decay = _gates(kind, q.shape[:3], g)
    w = torch.randn(v.shape, generator=g, dtype=torch.float64)

    def grads(dtype):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v, beta, log_decay)]
        o = linattn.delta_rule_attention(*xs[:4], log_decay=xs[4], qk_l2norm_eps=1e-6)
        return torch.autograd.grad((o * w.to(dtype)).sum(), xs)

    for name, got, want in zip(("q", "k", "v", "beta", "log_decay"), grads(torch.float32), grads(torch.float64)):
        assert _rel(got, want) < 2e-5, (kind, name, _rel(got, want))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_packed_documents_within_1e5(kind, deterministic):
    """Also under torch.use_deterministic_algorithms(True), where the chunks' cumulative log decays
    are recurrence.prefix_sums' scan instead of cumsum: a scan that formed each sum by its own tree
    (Hillis-Steele) measured 1.08e-5 here for GLA after decays of -39."""
    g, q, k, v, beta = _inputs(700)
    cu = torch.tensor([0, 3, 3, 100, 101, 460, 700])
    log_decay = _gates(kind, q.shape[:3], g)
    o64 = gated_linear_attention_reference(q, k, v, log_decay)  # documents alone, below
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    alone = torch.cat([gated_linear_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], log_decay[:, :, a:b])
                       for a, b in bounds], dim=2)
    d64 = torch.cat([delta_rule_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b],
                                                    log_decay=log_decay[:, :, a:b]) for a, b in bounds], dim=2)
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        o32 = linattn.gated_linear_attention(q.float(), k.float(), v.float(), log_decay.float(), cu_seqlens=cu)
        d32 = linattn.delta_rule_attention(q.float(), k.float(), v.float(), beta.float(),
                                           log_decay=log_decay.float(), cu_seqlens=cu)
    assert _rel(o32, alone) < 1e-5
    assert _rel(d32, d64) < 1e-5
    assert o64.shape == o32.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_and_delta_forms_run_no_float64(dtype):
    _, q, k, v, beta = _inputs(300)
    q, k, v, beta = (t.to(dtype).requires_grad_() for t in (q, k, v, beta))
    head = F.logsigmoid(torch.randn(1, 2, 300) + 3).masked_fill(torch.rand(1, 2, 300) < 0.05, float("-inf"))
    channel = F.logsigmoid(torch.randn(1, 2, 300, 16) + 3)
    head, channel = head.to(dtype).requires_grad_(), channel.to(dtype).requires_grad_()
    for name, fn in (("gated per head", lambda: linattn.gated_linear_attention(q, k, v, head)),
                     ("gated per channel", lambda: linattn.gated_linear_attention(q, k, v, channel)),
                     ("delta rule", lambda: linattn.delta_rule_attention(q, k, v, beta)),
                     ("gated delta rule", lambda: linattn.delta_rule_attention(q, k, v, beta, log_decay=head))):
        with OpProbe() as p:
            fn().float().sum().backward()
        assert not p.float64_ops, (name, dict(p.float64_ops))


def test_favor_document_major_key_orders_by_document_then_value():
    from linattn.functional.favor import _document_major_key

    g = torch.Generator().manual_seed(3)
    c = torch.randn(1, 2, 200, generator=g) * torch.logspace(-30, 30, 200)  # every magnitude
    c[0, :, ::7] = float("-inf")
    c[0, 0, 5], c[0, 0, 6], c[0, 1, 9] = -0.0, 0.0, torch.finfo(torch.float32).max
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([50, 1, 100, 49]))
    key = _document_major_key(doc, c)
    assert key.dtype == torch.int64
    for h in range(2):
        want = sorted(range(200), key=lambda t: (int(doc[t]), float(c[0, h, t])))
        got = sorted(range(200), key=lambda t: int(key[0, h, t]))
        assert [(int(doc[t]), float(c[0, h, t])) for t in got] == [(int(doc[t]), float(c[0, h, t])) for t in want]


def test_packed_kernel_forms_run_no_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 120, 16, generator=g).requires_grad_() for _ in range(3))
    W = linattn.favor_projection(32, 16, generator=g)
    cu = torch.tensor([0, 7, 7, 60, 120])
    for name, fn in (("linear", lambda: linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu)),
                     ("favor", lambda: linattn.favor_attention(q, k, v, W, causal=True, cu_seqlens=cu))):
        with OpProbe() as p:
            fn().sum().backward()
        assert not p.float64_ops, (name, dict(p.float64_ops))


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_float32_within_1e5_with_cuda_scan_order(strategy):
    """The hardest case (decays of -39, N = 65536) with every running sum summed in the order and
    precision CUDA sums it (probes.cuda_scan_order: a Sklansky tree in blocks along the last
    dimension, a float running sum along any other). There a difference of two cumulative log decays
    carries a rounding for every step between them, or a tree's: GLA per head (its decays summed
    along the chunk in float) measured 2.63e-5 on both strategies before each sum was rounded once
    (recurrence.prefix_sums' exact split), 9.18e-6 after, as in a CPU's order."""
    from probes import cuda_scan_order

    g, q, k, v, beta = _inputs(65536)
    head = _gates("-39", q.shape[:3], g)
    chan = _gates("-39", q.shape, g)
    cases = {"gated delta": lambda *x: linattn.delta_rule_attention(*x[:4], log_decay=x[4], return_state=True,
                                                                    strategy=strategy),
             "gla per head": lambda *x: linattn.gated_linear_attention(*x[:3], x[5], return_state=True,
                                                                       strategy=strategy),
             "gla per channel": lambda *x: linattn.gated_linear_attention(*x[:3], x[6], return_state=True,
                                                                          strategy=strategy)}
    inputs = (q, k, v, beta, head, head, chan)
    for name, fn in cases.items():
        o64, s64 = fn(*inputs)
        with cuda_scan_order():
            o32, s32 = fn(*(t.float() for t in inputs))
        assert _rel(o32, o64) < 1e-5 and _rel(s32.s, s64.s) < 1e-5, (name, _rel(o32, o64), _rel(s32.s, s64.s))
