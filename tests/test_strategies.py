"""The engines' device strategies (``linattn.functional.recurrence``): the accelerator strategy,
forced on a CPU, equals the plain references (float64: to rounding; float32: 1e-5 relative) in
every chunked form, packed documents and grouped heads included, and the recurrence stage's two
strategies equal its written-out reference."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import linattn.functional as LF
from linattn.functional.decayed_state import DecayedState
from linattn.functional.delta import delta_rule_attention_reference
from linattn.functional.gated import gated_linear_attention_reference
from linattn.functional.linear import LinearAttentionState, linear_attention_reference
from linattn.functional.favor import favor_attention_reference
from linattn.functional.recurrence import chunk_recurrence, chunk_recurrence_reference, prefix_sums, prefix_sums_
from linattn.functional.strategy import EngineOptions, check_strategy, mixed_bmm, operand_dtype, resolve_strategy
from probes import OpProbe, cuda_scan_order, deterministic_algorithms

f64 = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1), b the reference: relative for the usual references, absolute
    for one whose entries are all below 1 (the inputs are of order 1; a gradient that is 0 in exact
    arithmetic, as q's through a normalised output of one position, is a few ulps of the loss)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1.0)


# --- the recurrence stage ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["identity", "scalar", "diagonal", "full"])
@pytest.mark.parametrize("Nc", [0, 1, 2, 3, 5, 16, 17, 33])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_chunk_recurrence_equals_its_reference(kind, Nc, reverse, strategy):
    g = torch.Generator().manual_seed(Nc)
    R, D, Dv = 3, 4, 5
    U = torch.randn(Nc, R, D, Dv, generator=g, dtype=f64)
    seed = torch.randn(R, D, Dv, generator=g, dtype=f64)
    A = {"identity": None, "scalar": torch.rand(Nc, R, 1, 1, generator=g, dtype=f64),
         "diagonal": torch.rand(Nc, R, D, 1, generator=g, dtype=f64),
         "full": torch.randn(Nc, R, D, D, generator=g, dtype=f64) / 3}[kind]
    want = chunk_recurrence_reference(A, U, seed, reverse=reverse)
    inputs = [t.clone() for t in (U, seed) + (() if A is None else (A,))]
    got = chunk_recurrence(A, U, seed, strategy=strategy, reverse=reverse)
    assert got.shape == (Nc + 1, R, D, Dv)
    assert rel(got, want) < 1e-12
    # the scan works in place in buffers of its own: the inputs are left as they were
    assert all(torch.equal(t, was) for t, was in zip((U, seed) + (() if A is None else (A,)), inputs))
    # written into a buffer that holds the seed itself (as the engines call it)
    out = torch.empty(Nc + 1, R, D, Dv, dtype=f64)
    at = Nc if reverse else 0
    out[at] = seed
    chunk_recurrence(A, U, out[at], strategy=strategy, reverse=reverse, out=out)
    assert rel(out, want) < 1e-12
    # with A and U the caller's temporaries, whose memory the scan may work in
    got = chunk_recurrence(None if A is None else A.clone(), U.clone(), seed, strategy=strategy, reverse=reverse,
                           consume=True)
    assert rel(got, want) < 1e-12
    # and laid out chunk-minor, (R, Nc, ...) in memory, as the grouped engine passes them
    minor = U.transpose(0, 1).contiguous().transpose(0, 1)
    got = chunk_recurrence(A, minor, seed, strategy=strategy, reverse=reverse, consume=True)
    assert rel(got, want) < 1e-12


@pytest.mark.parametrize("kind", ["scalar", "diagonal", "full"])
@pytest.mark.parametrize("reverse", [False, True])
def test_the_accelerator_scan_gathers_only_full_transitions(kind, reverse):
    """Elementwise transitions are scanned in the chunks' own order: at 33 chunks (not a power of
    two) and with the caller's temporaries handed over, no gather, scatter, fill, padding or copy
    of U, only the levels' products and sums (log2 steps) and each odd level's fold; full ones are
    gathered into the bit-reversed order and back."""
    g = torch.Generator().manual_seed(0)
    Nc, R, D, Dv = 33, 2, 3, 4
    A = {"scalar": torch.rand(Nc, R, 1, 1, generator=g), "diagonal": torch.rand(Nc, R, D, 1, generator=g),
         "full": torch.randn(Nc, R, D, D, generator=g) / 3}[kind]
    U, seed = torch.randn(Nc, R, D, Dv, generator=g), torch.randn(R, D, Dv, generator=g)
    want = chunk_recurrence_reference(A.double(), U.double(), seed.double(), reverse=reverse)
    out, handed = torch.empty(Nc + 1, R, D, Dv), U.clone()
    with OpProbe() as probe:
        chunk_recurrence(A, handed, seed, strategy="accelerator", reverse=reverse, out=out, consume=True)
    assert rel(out, want) < 1e-5
    names = [name.split(".")[1] for name in probe.ops.elements()]  # "aten.mul.Tensor" -> "mul"
    moved = {"index_select", "index_copy", "index_copy_", "gather", "scatter", "clone", "zeros", "new_zeros",
             "constant_pad_nd", "fill_", "zero_"}
    if kind == "full":
        assert {"index_select", "index_copy_"} <= set(names), names
    else:
        assert not moved & set(names), names
        # 33 -> fold 1 + 16 pairs -> 8 -> 4 -> 2 -> 1: six levels of at most three ops, one fold of two
        computing = [n for n in names if n not in ("slice", "select", "view", "as_strided", "detach")]
        assert len(computing) <= 3 * 6 + 2 + 2, names


def test_the_strategy_argument():
    assert resolve_strategy("auto", torch.device("cpu")) == "cpu"
    assert resolve_strategy("auto", torch.device("meta")) == "accelerator"  # any other device
    assert resolve_strategy("cpu", torch.device("meta")) == "cpu"
    assert resolve_strategy("accelerator", torch.device("cpu")) == "accelerator"
    with pytest.raises(ValueError, match="f: strategy must be one of 'auto', 'cpu', 'accelerator', got 'gpu'"):
        check_strategy("f", "gpu")
    q = torch.randn(1, 1, 8, 4)
    for call in (lambda: LF.gated_linear_attention(q, q, q, -torch.rand(1, 1, 8), strategy="fast"),
                 lambda: LF.delta_rule_attention(q, q, q, torch.rand(1, 1, 8), strategy=None),
                 lambda: LF.linear_attention(q, q, q, causal=True, strategy="GPU"),
                 lambda: LF.causal_linear_product(q, q, q, strategy=""),
                 lambda: LF.favor_attention(q, q, q, torch.randn(8, 4), causal=True, strategy="scan")):
        with pytest.raises(ValueError, match="strategy must be one of"):
            call()


# --- every chunked form, forced accelerator, against its reference ----------------------------


def _inputs(form: str, B: int, H: int, N: int, D: int, dtype, seed: int = 0, Hk: int | None = None):
    """Inputs of one form (requires_grad), and the names of the tensors to differentiate."""
    g = torch.Generator().manual_seed(seed)
    Hq = H if Hk is None else Hk

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=f64)

    t = {"q": rnd(B, Hq, N, D), "v": rnd(B, H, N, D + 2)}
    if form.startswith("delta"):
        t["k"] = F.normalize(rnd(B, Hq, N, D), dim=-1)
        t["beta"] = torch.rand(B, H, N, generator=g, dtype=f64)
        if form == "delta_head":
            t["log_decay"] = F.logsigmoid(rnd(B, H, N) + 2)
        elif form == "delta_channel":
            t["log_decay"] = F.logsigmoid(rnd(B, H, N, D) + 2)
        t["s0"] = rnd(B, H, D, D + 2)
    elif form.startswith("gla"):
        t["k"] = rnd(B, Hq, N, D)
        t["log_decay"] = F.logsigmoid(rnd(B, H, N, *((D,) if form == "gla_channel" else ())) + 2)
        t["s0"] = rnd(B, H, D, D + 2)
    else:
        t["k"] = rnd(B, Hq, N, D)
    return {k: x.to(dtype).requires_grad_() for k, x in t.items()}


def _projection(D: int, dtype):
    return LF.favor_projection(24, D, generator=torch.Generator().manual_seed(7)).to(dtype)


def _call(form: str, t: dict, strategy: str | None, **kw):
    """The fast form (``strategy``) or, for None, the reference: ``(out, final state or None)``."""
    q, k, v = t["q"], t["k"], t["v"]
    chunk = kw.pop("chunk_size", 8)
    if form.startswith("delta"):
        st = DecayedState(t["s0"])
        if strategy is None:
            o, s = delta_rule_attention_reference(q, k, v, t["beta"], log_decay=t.get("log_decay"), initial_state=st,
                                                  return_state=True)
        else:
            o, s = LF.delta_rule_attention(q, k, v, t["beta"], log_decay=t.get("log_decay"), initial_state=st,
                                           return_state=True, strategy=strategy, chunk_size=chunk, **kw)
        return o, s.s
    if form.startswith("gla"):
        st = DecayedState(t["s0"])
        if strategy is None:
            o, s = gated_linear_attention_reference(q, k, v, t["log_decay"], initial_state=st, return_state=True)
        else:
            o, s = LF.gated_linear_attention(q, k, v, t["log_decay"], initial_state=st, return_state=True,
                                             strategy=strategy, chunk_size=chunk, **kw)
        return o, s.s
    if form.startswith("linear"):
        fm = "relu" if form == "linear_relu" else "elu"
        if strategy is None:
            o, s = linear_attention_reference(q, k, v, feature_map=fm, causal=True, return_state=True)
        else:
            o, s = LF.linear_attention(q, k, v, feature_map=fm, causal=True, return_state=True, strategy=strategy,
                                       chunk_size=chunk, tile_positions=64, **kw)
        return o, s.S
    if form == "product":
        if strategy is None:  # o_i = q_i . sum_{j <= i} k_j v_j^T, written out
            s = torch.einsum("bhnd,bhne->bhnde", k, v).cumsum(2)
            return torch.einsum("bhnd,bhnde->bhne", q, s), s[:, :, -1]
        return LF.causal_linear_product(q, k, v, strategy=strategy, chunk_size=chunk, tile_positions=64)
    kernel = "relu" if form == "favor_relu" else "softmax"
    P = _projection(q.shape[-1], q.dtype)
    if strategy is None:
        return favor_attention_reference(q, k, v, P, kernel=kernel, causal=True), None
    return LF.favor_attention(q, k, v, P, kernel=kernel, causal=True, strategy=strategy, chunk_size=chunk,
                              tile_entries=512, **kw), None


FORMS = ["delta_none", "delta_head", "delta_channel", "gla_head", "gla_channel", "linear_elu", "linear_relu",
         "product", "favor_softmax", "favor_relu"]


def _loss_and_grads(form, t, strategy, **kw):
    o, s = _call(form, t, strategy, **kw)
    loss = (o * torch.linspace(-1, 1, o.shape[-1], dtype=o.dtype)).sum() + (0 if s is None else s.square().sum())
    names = sorted(t)
    return o, s, dict(zip(names, torch.autograd.grad(loss, [t[n] for n in names])))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("N", [1, 37, 64])
def test_forced_accelerator_equals_the_reference_in_float64(form, N):
    t = _inputs(form, 2, 2, N, 6, f64)
    o, s, grads = _loss_and_grads(form, t, "accelerator")
    ro, rs, rgrads = _loss_and_grads(form, t, None)
    assert rel(o, ro) < 1e-10, form
    if rs is not None:
        assert rel(s, rs) < 1e-10, form
    for name in grads:
        assert rel(grads[name], rgrads[name]) < 1e-9, (form, name)


@pytest.mark.parametrize("form", ["delta_channel", "gla_channel"])
@pytest.mark.parametrize("chunk_size, sub_chunk_size", [(16, 4), (12, 4), (64, 4), (14, 2), (7, 4), (32, 8)])
def test_forced_accelerator_pairs_sub_chunks_by_levels_at_any_count(form, chunk_size, sub_chunk_size):
    """A gate per key channel: the accelerator pairs the sub-chunks by levels of ever larger halves
    (decayed._levels_forward), 2, 2, 4, 3, 3 and 2 levels over 4, 3 (padded to 4), 16, 7, 7 and 4
    sub-chunks: outputs, states and every gradient against the float64 reference."""
    t = _inputs(form, 1, 2, 75, 6, f64)
    o, s, grads = _loss_and_grads(form, t, "accelerator", chunk_size=chunk_size, sub_chunk_size=sub_chunk_size)
    ro, rs, rgrads = _loss_and_grads(form, t, None)
    assert rel(o, ro) < 1e-10 and rel(s, rs) < 1e-10
    for name in grads:
        assert rel(grads[name], rgrads[name]) < 1e-9, name


@pytest.mark.parametrize("form", FORMS)
def test_forced_accelerator_in_float32_is_within_1e_5_of_the_float64_reference(form):
    t64 = _inputs(form, 1, 2, 200, 12, f64, seed=3)
    t32 = {k: x.detach().float().requires_grad_() for k, x in t64.items()}
    o, s, grads = _loss_and_grads(form, t32, "accelerator")
    ro, rs, rgrads = _loss_and_grads(form, t64, None)
    assert o.dtype == torch.float32
    assert rel(o, ro) < 1e-5, form
    if rs is not None:
        assert rel(s, rs) < 1e-5, form
    for name in grads:
        assert rel(grads[name], rgrads[name]) < 1e-5, (form, name)


@pytest.mark.parametrize("form", ["delta_none", "delta_head", "delta_channel", "gla_head", "gla_channel"])
def test_forced_accelerator_with_grouped_heads_equals_the_reference(form):
    t = _inputs(form, 1, 4, 41, 6, f64, Hk=2)  # value heads 4, query/key heads 2
    o, s, grads = _loss_and_grads(form, t, "accelerator")
    # the reference on the query/key heads repeated: each value head h reads head h // 2
    rep = {k: (x.detach().repeat_interleave(2, dim=1) if k in ("q", "k") else x.detach()).requires_grad_()
           for k, x in t.items()}
    ro, rs, rg = _loss_and_grads(form, rep, None)
    assert rel(o, ro) < 1e-10 and rel(s, rs) < 1e-10
    for name in grads:
        want = rg[name].unflatten(1, (2, 2)).sum(2) if name in ("q", "k") else rg[name]
        assert rel(grads[name], want) < 1e-9, (form, name)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_under_deterministic_algorithms_every_form_runs_as_cuda_would_and_reads_only_what_it_wrote(form, strategy):
    """With torch.use_deterministic_algorithms(True) (transformers' full_determinism): no op that
    CUDA refuses then (a floating cumsum raised there), inside the engines too, and, with every
    uninitialised float NaN on a CPU too, outputs, states and gradients still equal the float64
    reference: nothing reads memory that nothing wrote. 45 positions in chunks of 8: a chunk
    count that is no power of two, the last chunk cut short."""
    t = _inputs(form, 1, 2, 45, 6, f64, seed=11)
    ro, rs, rgrads = _loss_and_grads(form, t, None)
    with deterministic_algorithms(), OpProbe(engines=True) as p:
        o, s, grads = _loss_and_grads(form, t, strategy)
    assert not p.cuda_refusals, (form, dict(p.cuda_refusals))
    assert rel(o, ro) < 1e-10, form
    if rs is not None:
        assert rel(s, rs) < 1e-10, form
    for name in grads:
        assert rel(grads[name], rgrads[name]) < 1e-9, (form, name)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 64, 100])
def test_prefix_sums_under_deterministic_algorithms_equal_cumsum_without_one(n):
    """prefix_sums and prefix_sums_ are cumsum, one op, outside deterministic algorithms; inside,
    a floating one is a scan of adds (no cumsum, which CUDA would refuse) equal to cumsum to
    rounding, along any dimension, and an integer one still the exact cumsum."""
    x = torch.randn(3, n, 4, dtype=f64)
    ints = torch.arange(2 * n).view(2, n)
    with OpProbe() as p:
        plain = prefix_sums(x, 1)
    assert torch.equal(plain, x.cumsum(1)) and dict(p.ops) == {"aten.cumsum.default": 1}
    with deterministic_algorithms(), OpProbe() as p:
        got = prefix_sums(x, 1)
        last = prefix_sums(x.transpose(1, 2), -1)
        inplace = x.clone()
        same = prefix_sums_(inplace, 1)
        counted = prefix_sums(ints, -1)
    assert not p.cuda_refusals and p.ops["aten.cumsum.default"] == 1  # the integer sums only
    assert same is inplace and torch.equal(inplace, got)
    assert torch.equal(counted, ints.cumsum(-1))
    assert got.shape == x.shape and last.shape == (3, 4, n)
    if n:
        assert rel(got, x.cumsum(1)) < 1e-14 and rel(last, x.transpose(1, 2).cumsum(-1)) < 1e-14


def test_prefix_sums_under_deterministic_algorithms_are_rounded_once():
    """With rounded_once (log decays) the scan's sums carry their rounding errors: each float32 sum
    within one ulp of the exact one, and so each difference of neighbours (a chunk's decay between
    two positions) within one ulp, as a sequential cumsum's, after a first term of -39 (log decays
    just above the reset threshold) and small ones. Without the carried errors: 3.4 and 2.3 ulps."""
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(512, 64, generator=g) * 0.005
    x[:, 0] = -39.0 - torch.rand(512, generator=g)
    exact = x.double().cumsum(1)
    with deterministic_algorithms():
        got = prefix_sums(x, 1, rounded_once=True).double()
        plain = prefix_sums(x, 1).double()
    ulp = 2.0 ** -18  # float32's spacing in [32, 64), where every sum lies
    assert float((got - exact).abs().max()) <= ulp
    assert float((got.diff(dim=1) - exact.diff(dim=1)).abs().max()) <= ulp
    assert float((plain - exact).abs().max()) < 8 * ulp  # the plain scan: a few roundings a sum


@pytest.mark.parametrize("L", [1, 32, 64, 256])
def test_rounded_once_prefix_sums_do_not_depend_on_the_order_a_device_adds_in(L):
    """Float32 log decays (5% of -39, the rest about -0.0025, -inf resets) summed with rounded_once
    outside deterministic algorithms, along the last dimension and along the first: every difference
    of two sums of a row within one float32 eps of the larger sum's magnitude of the exact
    difference, in a CPU's order (a running sum in double) and in CUDA's (probes.cuda_scan_order: a
    Sklansky tree in blocks along the last dimension, a float running sum along others), where a
    plain cumsum's were 1.8-7.6 eps off; infinite sums where the exact ones are."""
    g = torch.Generator().manual_seed(L)
    x = F.logsigmoid(torch.randn(512, L, generator=g) + 6)
    x = x.masked_fill(torch.rand(512, L, generator=g) < 0.05, -39.0)
    x[::9, L // 2] = float("-inf")
    exact = x.double().cumsum(-1)

    def worst(G):
        d = (G.double().unsqueeze(-1) - G.double().unsqueeze(-2)) - (exact.unsqueeze(-1) - exact.unsqueeze(-2))
        scale = torch.maximum(exact.abs().unsqueeze(-1), exact.abs().unsqueeze(-2))
        finite = torch.isfinite(scale)
        return float((d[finite].abs() / scale[finite].clamp_min(1e-30)).max()) / torch.finfo(torch.float32).eps

    for order in (contextlib.nullcontext, cuda_scan_order):
        with order():
            last = prefix_sums(x, -1, rounded_once=True)
            first = prefix_sums_(x.t().contiguous(), 0, rounded_once=True).t()
        for got in (last, first):
            assert torch.equal(torch.isinf(got), torch.isinf(exact))
            assert worst(got) <= 1.0, (order.__name__, worst(got))


PACKED = ["delta_none", "delta_head", "delta_channel", "gla_head", "gla_channel", "linear_elu", "favor_softmax"]


@pytest.mark.parametrize("form", PACKED)
def test_forced_accelerator_on_packed_documents_equals_each_document_alone(form):
    lengths = [5, 0, 20, 1, 17]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    t = _inputs(form, 1, 2, T, 6, f64, seed=5)
    t.pop("s0", None)
    names = sorted(t)

    def packed(strategy):
        q, k, v = t["q"], t["k"], t["v"]
        if form.startswith("delta"):
            return LF.delta_rule_attention(q, k, v, t["beta"], log_decay=t.get("log_decay"), cu_seqlens=cu,
                                           strategy=strategy, chunk_size=8)
        if form.startswith("gla"):
            return LF.gated_linear_attention(q, k, v, t["log_decay"], cu_seqlens=cu, strategy=strategy, chunk_size=8)
        if form.startswith("linear"):
            return LF.linear_attention(q, k, v, causal=True, cu_seqlens=cu, strategy=strategy, chunk_size=8)
        return LF.favor_attention(q, k, v, _projection(6, f64), causal=True, cu_seqlens=cu, strategy=strategy,
                                  chunk_size=8)

    out = packed("accelerator")
    grads = torch.autograd.grad((out * out).sum(), [t[n] for n in names])
    pieces, ref_grads = [], [torch.zeros_like(t[n]) for n in names]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if a == b:
            continue
        doc = {n: t[n].detach()[:, :, a:b].clone().requires_grad_() for n in names}
        doc["s0"] = torch.zeros(1, 2, 6, 8, dtype=f64)
        o, _ = _call(form, doc, None)
        pieces.append(o)
        dg = torch.autograd.grad((o * o).sum(), [doc[n] for n in names])
        for r, d in zip(ref_grads, dg):
            r[:, :, a:b] = d
    ref = torch.cat(pieces, dim=2)
    assert rel(out, ref) < 1e-10, form
    for n, a, b in zip(names, grads, ref_grads):
        assert rel(a, b) < 1e-9, (form, n)


@pytest.mark.parametrize("form", ["delta_head", "gla_channel"])
def test_forced_accelerator_compiles_whole(form):
    """torch.compile(fullgraph=True) of the accelerator strategy: its ops keep their fakes."""
    t = _inputs(form, 1, 2, 40, 6, torch.float32)
    eager = _call(form, t, "accelerator")[0]

    def fn(**x):
        return _call(form, x, "accelerator")[0]

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    assert rel(compiled(**t), eager) < 1e-6


# --- half inputs on the accelerator: half operands, float32 accumulation -------------------------


def _half_case(form: str, N: int = 256, H: int = 2, D: int = 64, inputs: tuple | None = None):
    """``call(strategy, dtype=None)``: the form without gradients on bf16 inputs of order 1 (or on
    ``inputs``, ``(q, k, v, beta, head, channel, P)``), cast to ``dtype`` when given."""
    if inputs is None:
        g = torch.Generator().manual_seed(11)
        bf = torch.bfloat16
        q, v = (torch.randn(1, H, N, D, generator=g).to(bf) for _ in range(2))
        k = F.normalize(torch.randn(1, H, N, D, generator=g), dim=-1).to(bf)
        beta = torch.rand(1, H, N, generator=g).to(bf)
        head = F.logsigmoid(torch.randn(1, H, N, generator=g) + 3).to(bf)
        channel = F.logsigmoid(torch.randn(1, H, N, D, generator=g) + 3).to(bf)
        P = LF.favor_projection(64, D, generator=torch.Generator().manual_seed(3))
    else:
        q, k, v, beta, head, channel, P = inputs

    def call(strategy: str, dtype=None):
        cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
        qq, kk, vv, bb, hh, cc = (cast(t) for t in (q, k, v, beta, head, channel))
        with torch.no_grad():
            if form == "delta_head":
                return LF.delta_rule_attention(qq, kk, vv, bb, log_decay=hh, strategy=strategy)
            if form == "delta_channel":
                return LF.delta_rule_attention(qq, kk, vv, bb, log_decay=cc, strategy=strategy)
            if form == "gla_head":
                return LF.gated_linear_attention(qq, kk, vv, hh, strategy=strategy)
            if form == "gla_channel":
                return LF.gated_linear_attention(qq, kk, vv, cc, strategy=strategy)
            if form == "gla_grouped":  # one query/key head for both value heads: the grouped route (SSD)
                return LF.gated_linear_attention(qq[:, :1], kk[:, :1], vv, hh, strategy=strategy)
            if form == "linear_elu":
                return LF.linear_attention(qq, kk, vv, causal=True, strategy=strategy)
            return LF.favor_attention(qq, kk, vv, P.to(qq.dtype), causal=True, strategy=strategy)

    return call


HALF_FORMS = ["delta_head", "delta_channel", "gla_head", "gla_channel", "gla_grouped", "linear_elu", "favor_softmax"]


@pytest.mark.parametrize("form", HALF_FORMS)
def test_half_inputs_on_the_accelerator_take_half_operands_for_most_product_flops(form):
    from linattn.bench.tensor_cores import product_flops

    call = _half_case(form)
    acc, cpu = product_flops(lambda: call("accelerator")), product_flops(lambda: call("cpu"))
    assert acc.half_share >= 0.5, (form, acc)
    assert cpu.half == 0 and cpu.full > 0  # the CPU strategy keeps float32 operands
    # float32 inputs take no half operands on either strategy
    assert product_flops(lambda: call("accelerator", torch.float32)).half == 0


@pytest.mark.parametrize("form", HALF_FORMS)
def test_half_operands_cost_at_most_a_few_bf16_roundings(form):
    """The bf16 output with half operands against float64: within 3x the error of the CPU
    strategy's float32 products (whose error is the output's own rounding to bf16), and within
    1e-2 of the output's scale."""
    call = _half_case(form)
    ref = call("cpu", torch.float64)
    err_acc, err_cpu = rel(call("accelerator"), ref), rel(call("cpu"), ref)
    assert err_cpu < 5e-3
    assert err_acc <= max(3 * err_cpu, 1e-3) and err_acc < 1e-2, (form, err_acc, err_cpu)


def _float16_case(form: str, N: int = 256, H: int = 2, D: int = 64):
    """:func:`_half_case`'s forms with float16 inputs whose states pass float16's range (65504)
    while every output stays inside it: values of 1e4, positive keys (for the forms without a
    feature map; the delta rule's stay normalised), queries of 1e-3 where the output is not
    normalised (GLA: q S)."""
    g = torch.Generator().manual_seed(12)
    h = torch.float16
    normalised = form in ("linear_elu", "favor_softmax")
    q = (torch.randn(1, H, N, D, generator=g) * (1.0 if normalised or form.startswith("delta") else 1e-3)).to(h)
    k = torch.randn(1, H, N, D, generator=g)
    k = (F.normalize(k, dim=-1) if form.startswith("delta") else k if normalised else k.abs()).to(h)
    v = (1e4 * (1 + 0.3 * torch.randn(1, H, N, D, generator=g))).to(h)
    beta = torch.rand(1, H, N, generator=g).to(h)
    head = F.logsigmoid(torch.randn(1, H, N, generator=g) + 3).to(h)
    channel = F.logsigmoid(torch.randn(1, H, N, D, generator=g) + 3).to(h)
    P = LF.favor_projection(64, D, generator=torch.Generator().manual_seed(3))
    return _half_case(form, inputs=(q, k, v, beta, head, channel, P))


@pytest.mark.parametrize("form", HALF_FORMS)
def test_float16_states_past_its_range_stay_finite_and_accurate(form):
    """float16 ends at 65504: a state summed over positions passes it (linear attention's at N ~
    2e4 at unit scale; here at N = 256 with values of 1e4), and rounded to float16 as the operand of
    a product it was inf, its lower half NaN (linear attention and GLA returned NaN). Formed
    matrices are scaled by powers of two into float16's range first (strategy.FLOAT16_TOP): the
    output is finite and within 3x the error of the CPU strategy's float32 products (1e-3 at least)."""
    call = _float16_case(form)
    ref = call("cpu", torch.float64)
    assert float(ref.abs().max()) < 65504  # every output is representable
    got = call("accelerator")
    assert got.dtype == torch.float16 and bool(torch.isfinite(got).all()), form
    err_acc, err_cpu = rel(got, ref), rel(call("cpu"), ref)
    assert err_acc <= max(3 * err_cpu, 1e-3), (form, err_acc, err_cpu)


@pytest.mark.parametrize("form", ["linear_elu", "delta_head", "delta_channel"])
def test_half_inputs_gradients_on_the_accelerator_are_the_cpu_strategys(form):
    """bf16 inputs, forward+backward: the accelerator's gradients within 2x the CPU strategy's error
    against float64 (whose error is the bf16 inputs' and gradients' own). Where the backward cancels
    the forward's quantities against states it forms in float32, half operands there cost more:
    normalised linear attention with values of mean 3 (its q gradient, (S - z out^T) / d, was 5x
    the CPU's at N = 2048), the delta rule under weak decays (Kd^T Uv and W S rounded once fed the
    states the backward forms again: 3x at N = 4096)."""
    g = torch.Generator().manual_seed(0)
    N, D = (2048, 32) if form == "linear_elu" else (4096, 32)
    q, k = torch.randn(1, 1, N, D, generator=g), torch.randn(1, 1, N, D, generator=g)
    v = torch.randn(1, 1, N, D, generator=g) + (3.0 if form == "linear_elu" else 0.0)
    inputs = [q, k, v] if form == "linear_elu" else [q, F.normalize(k, dim=-1), v, torch.rand(1, 1, N, generator=g)]
    decay = -torch.rand(1, 1, N, *((D,) if form == "delta_channel" else ()), generator=g) * 1e-5
    weight = torch.randn(1, 1, N, D, generator=g, dtype=f64)

    def grads(dtype, strategy):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        if form == "linear_elu":
            out = LF.linear_attention(*x, causal=True, strategy=strategy)
        else:
            out = LF.delta_rule_attention(*x, log_decay=decay.to(f64) if dtype == f64 else decay, strategy=strategy)
        (out.double() * weight).sum().backward()
        return [t.grad.double() for t in x]

    ref = grads(f64, "cpu")

    def error(got):
        return max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))

    err_cpu, err_acc = error(grads(torch.bfloat16, "cpu")), error(grads(torch.bfloat16, "accelerator"))
    assert err_cpu < 1e-2 and err_acc <= 2 * err_cpu, (form, err_acc, err_cpu)


def test_float16_operands_are_scaled_by_powers_of_two():
    """split_bmm and half_operand with float16: each formed matrix scaled into [2^14, 2^15) by an
    exact power of two (matrices of 1e6 and of 1e-6 alike, and of zeros), and the product scaled
    back: float16's digits (split_bmm: about twice as many), not inf or flushed to zero."""
    from linattn.functional.strategy import FLOAT16_TOP, _float16_scales, half_operand, split_bmm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, 40, generator=g)
    b = torch.randn(4, 40, 6, generator=g) * torch.tensor([1e6, 1e-6, 1.0, 0.0]).view(4, 1, 1)
    scales = _float16_scales(b)
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())  # powers of two
    top = (b * scales).abs().amax((1, 2))
    assert bool(((top >= 2 ** (FLOAT16_TOP - 1)) & (top < 2 ** FLOAT16_TOP))[:3].all()) and top[3] == 0
    want = torch.bmm(a.to(torch.float16).double(), b.double())  # a is rounded as it is
    scale_of = want.abs().amax((1, 2), keepdim=True).clamp_min(1e-300)
    got = split_bmm(a, b, torch.float16)
    assert bool(torch.isfinite(got).all()) and float(((got - want) / scale_of).abs().max()) < 1e-5
    (rounded,), s = half_operand(b, torch.float16)
    assert rounded.dtype == torch.float16 and bool(torch.isfinite(rounded).all())
    got = mixed_bmm(a, rounded, torch.float16) / s
    assert float(((got - want) / scale_of).abs().max()) < 2e-3
    (hi, lo), s = half_operand(b, torch.float16, split=True)  # both parts, one scale
    got = (mixed_bmm(a, hi, torch.float16) + mixed_bmm(a, lo, torch.float16)) / s
    assert float(((got - want) / scale_of).abs().max()) < 1e-5
    # bfloat16 has float32's range: rounded as it is
    assert half_operand(b, torch.bfloat16)[1] is None
    (same,), none = half_operand(b, None)
    assert same is b and none is None


def test_mixed_bmm_rounds_the_operands_and_accumulates_in_float32():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 8, 300, generator=g), torch.randn(3, 300, 5, generator=g)
    got = mixed_bmm(a, b, torch.bfloat16)
    want = torch.bmm(a.to(torch.bfloat16).double(), b.to(torch.bfloat16).double())
    assert got.dtype == torch.float32
    assert rel(got, want) < 1e-6  # float32 accumulation of the rounded operands
    assert rel(got, torch.bmm(a.double(), b.double())) > 1e-4  # the operands were rounded
    assert torch.equal(mixed_bmm(a, b, None), torch.bmm(a, b))
    assert operand_dtype("accelerator", torch.bfloat16) == "bfloat16"
    assert operand_dtype("accelerator", torch.float16) == "float16"
    assert operand_dtype("cpu", torch.bfloat16) == "" and operand_dtype("accelerator", torch.float32) == ""
    opts = EngineOptions(64, "accelerator", "bfloat16", 7, 4, 16)
    assert EngineOptions.decode(opts.encode()) == opts and opts.operand is torch.bfloat16


def test_mixed_bmm_on_an_out_dtype_device_is_one_product_into_out(monkeypatch):
    """Where bmm takes half operands into float32 (CUDA: none here), mixed_bmm is one
    ``bmm(out_dtype=float32)`` straight into ``out``: checked on meta tensors, whose bmm has that
    overload (a CPU's has none), for the call torch accepts and the result it returns."""
    from linattn.functional import strategy

    assert strategy.OUT_DTYPE_DEVICES == {"cuda"}
    monkeypatch.setattr(strategy, "OUT_DTYPE_DEVICES", frozenset({"meta"}))
    a, b = torch.empty(3, 8, 30, device="meta"), torch.empty(3, 30, 5, device="meta")
    out = torch.empty(3, 8, 5, device="meta")
    assert mixed_bmm(a, b, torch.bfloat16, out=out) is out
    got = mixed_bmm(a, b, torch.float16)
    assert got.dtype == torch.float32 and got.shape == (3, 8, 5)


def test_forced_accelerator_kda_at_its_default_chunks_packed_and_grouped():
    """KDA on the accelerator at its default chunk (64, so 16 sub-chunks and 4 levels of blocks
    between them) with packed documents (one of 0 and one of 1 position) and grouped heads (2 query
    heads, 4 value heads): outputs and every gradient equal the float64 reference, document by
    document."""
    g = torch.Generator().manual_seed(1)
    lengths = [70, 0, 130, 1, 55]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(1, 2, T, 8, generator=g, dtype=f64)
    k = F.normalize(torch.randn(1, 2, T, 8, generator=g, dtype=f64), dim=-1)
    v = torch.randn(1, 4, T, 8, generator=g, dtype=f64)
    beta = torch.rand(1, 4, T, generator=g, dtype=f64)
    decay = F.logsigmoid(torch.randn(1, 4, T, 8, generator=g, dtype=f64) + 2)
    leaves = [t.requires_grad_() for t in (q, k, v, beta, decay)]
    out = LF.delta_rule_attention(q, k, v, beta, log_decay=decay, cu_seqlens=cu, strategy="accelerator")
    grads = torch.autograd.grad((out * out).sum(), leaves)
    qq, kk = q.repeat_interleave(2, 1), k.repeat_interleave(2, 1)
    ref = torch.cat([delta_rule_attention_reference(qq[:, :, a:b], kk[:, :, a:b], v[:, :, a:b], beta[:, :, a:b],
                                                    log_decay=decay[:, :, a:b])
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a], 2)
    ref_grads = torch.autograd.grad((ref * ref).sum(), leaves)
    assert rel(out, ref) < 1e-10
    for name, got, want in zip(("q", "k", "v", "beta", "log_decay"), grads, ref_grads):
        assert rel(got, want) < 1e-9, name


def test_subnormal_flushes_stay_in_the_cpu_strategy():
    """Issue 44: the CPU's choices stay in the CPU strategy, the flushes of negligible decay factors
    (subnormal numbers slow a CPU's products, not an accelerator's) among them. Counted in the
    launches of every bench gpu form: the accelerator runs no flush but the one that makes a
    per-channel gate's resets exact zeros (once per formation of the decays: the forward's, and the
    backward's again), the CPU strategy its flushes of the products too."""
    from linattn.bench.launches import FORMS, count_launches, form_call
    from linattn.bench.gpu import KERNEL_FORMS

    for form in FORMS:
        for pass_, resets in (("prefill", 1), ("train", 2)):
            flushes = {}
            for strategy in ("cpu", "accelerator"):
                ops = count_launches(form_call(form, 200, pass_, strategy, quick=True)).by_op
                flushes[strategy] = ops["aten::threshold_"] + ops["aten::hardshrink"]
            channel = KERNEL_FORMS[form].decay == "channel"
            assert flushes["accelerator"] == (resets if channel else 0), (form, pass_, flushes)
            assert flushes["cpu"] >= flushes["accelerator"], (form, pass_, flushes)
            if form in ("gated_delta", "kda", "gla_channel", "ssd"):  # decays strong enough to need them on a CPU
                assert flushes["cpu"] > flushes["accelerator"], (form, pass_, flushes)


def test_bit_reversed_order_is_each_steps_binary_digits_reversed():
    """The scan's order: position l holds step bitrev(l), its binary digits over log2(n) bits read
    backwards (an involution), for lengths up to 2**17 (past 16 dimensions, MPS's limit, had the index
    been a permute of a (2,) * log2(n) view)."""
    from linattn.functional.recurrence import _bit_reversed

    for n in (1, 2, 4, 8, 64, 1 << 17):
        bits = (n - 1).bit_length()
        got = _bit_reversed(n, torch.device("cpu"))
        want = [int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(n)]
        assert got.dtype == torch.int64 and got.tolist() == want, n
        assert torch.equal(got[got], torch.arange(n))
