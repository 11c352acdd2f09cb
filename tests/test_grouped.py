"""The decayed engine's grouped route (linattn.functional.grouped): keys and queries shared by a group
of heads with a decay per head, Mamba-2's SSD. Against the float64 reference recurrence with q and k
repeated per head: outputs, final states and every gradient, at awkward sizes, both strategies, with
resets (-inf), packed documents, float32, torch.compile."""

import contextlib
import math

import pytest
import torch

from linattn.functional import DecayedState, gated_linear_attention, gated_linear_attention_reference
from linattn.functional.grouped import grouped_decayed_product
from probes import deterministic_algorithms


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _graph(node, seen=None) -> set:
    """The names of every autograd node reachable from ``node``."""
    seen = set() if seen is None else seen
    if node is not None and type(node).__name__ not in seen:
        seen.add(type(node).__name__)
        for child, _ in node.next_functions:
            _graph(child, seen)
    return seen


def _inputs(B, Hk, m, N, D, Dv, *, dtype=torch.float64, seed=0, strong=False, resets=()):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk, N, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hk, N, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hk * m, N, Dv, generator=g, dtype=dtype)
    a = -torch.rand(B, Hk * m, N, generator=g, dtype=dtype) * (8.0 if strong else 0.5)
    for t in resets:
        a[:, :, t] = -math.inf
    s0 = torch.randn(B, Hk * m, D, Dv, generator=g, dtype=dtype)
    return q, k, v, a, s0


def _reference(q, k, v, a, s0, scale=1.0):
    m = v.shape[1] // q.shape[1]
    out, s = gated_linear_attention_reference(q.repeat_interleave(m, 1), k.repeat_interleave(m, 1), v, a,
                                              scale=scale, initial_state=None if s0 is None else DecayedState(s0),
                                              return_state=True)
    return out, s.s


def _grads(fn, inputs, seed=1):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out, s = fn(*inputs)
    g = torch.Generator().manual_seed(seed)
    # drawn in float64 whatever the dtype: the same weights for a float32 call and its reference
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    ws = torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.dtype)
    grads = torch.autograd.grad((out * w).sum() + (s * ws).sum(), inputs)
    return out.detach(), s.detach(), grads


SIZES = [  # B, Hk, m, N, D, Dv, C
    (2, 2, 3, 37, 5, 4, 8),  # N not a multiple of C
    (1, 1, 4, 64, 6, 3, 16),  # N a multiple of C
    (1, 3, 2, 13, 4, 5, 64),  # N below C: one short chunk
    (2, 1, 5, 1, 3, 2, 4),  # a single position
]


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("size", SIZES, ids=[f"B{s[0]}Hk{s[1]}m{s[2]}N{s[3]}C{s[6]}" for s in SIZES])
@pytest.mark.parametrize("strong", [False, True])
def test_equals_the_reference_float64(size, strategy, strong):
    B, Hk, m, N, D, Dv, C = size
    inputs = _inputs(B, Hk, m, N, D, Dv, strong=strong)
    got = _grads(lambda *x: grouped_decayed_product(*x, chunk_size=C, strategy=strategy), inputs)
    want = _grads(_reference, inputs)
    assert _rel(got[0], want[0]) < 1e-12 and _rel(got[1], want[1]) < 1e-12
    for name, a, b in zip("q k v log_decay s0".split(), got[2], want[2]):
        assert _rel(a, b) < 1e-11, name


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_resets_and_no_initial_state(strategy, deterministic):
    """-inf log decays (a reset, what packed documents put at their starts), in the first position,
    at a chunk's first and last positions and twice in a row; no initial state. Also under
    torch.use_deterministic_algorithms(True), where the chunks' log-decay sums are
    recurrence.prefix_sums' scan with its rounding errors carried: an infinite sum has none (its
    error term, inf - inf, was NaN)."""
    q, k, v, a, _ = _inputs(2, 2, 3, 37, 5, 4, resets=(0, 7, 8, 15, 30))
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        got = _grads(lambda *x: grouped_decayed_product(*x, None, chunk_size=8, strategy=strategy), (q, k, v, a))
    want = _grads(lambda *x: _reference(*x, None), (q, k, v, a))
    assert _rel(got[0], want[0]) < 1e-12 and _rel(got[1], want[1]) < 1e-12
    for name, x, y in zip("q k v log_decay".split(), got[2], want[2]):
        assert torch.isfinite(x).all(), name
        assert _rel(x, y) < 1e-11, name


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("per_tile", [1, 2, 3])
def test_tiles_equal_the_reference(strategy, per_tile):
    """Tiles of 1, 2 and 3 chunks (5 chunks, the last short; resets inside and at tile edges): the
    state and its gradient carried from tile to tile, with gradients and without (one tile's states)."""
    inputs = _inputs(2, 2, 3, 37, 5, 4, resets=(8, 20))
    fn = lambda *x: grouped_decayed_product(*x, chunk_size=8, strategy=strategy, chunks_per_tile=per_tile)  # noqa: E731
    got, want = _grads(fn, inputs), _grads(_reference, inputs)
    assert _rel(got[0], want[0]) < 1e-12 and _rel(got[1], want[1]) < 1e-12
    for name, a, b in zip("q k v log_decay s0".split(), got[2], want[2]):
        assert _rel(a, b) < 1e-11, name
    with torch.no_grad():
        out, s = fn(*inputs)
    assert _rel(out, want[0]) < 1e-12 and _rel(s, want[1]) < 1e-12


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
@pytest.mark.parametrize("per_tile", [None, 2])
@pytest.mark.parametrize("parts", ["scale", "skip", "both"])
def test_value_scale_and_skip_equal_the_reference(strategy, per_tile, parts):
    """Values times a scale per head and position and a skip per head (Mamba-2's dt and D), formed
    chunk by chunk: the reference on ``v * scale`` plus ``skip * v``; every gradient, the scale's and
    the skip's included, with resets and an initial state."""
    q, k, v, a, s0 = _inputs(2, 2, 3, 37, 5, 4, resets=(8,))
    g = torch.Generator().manual_seed(7)
    c = torch.rand(2, 6, 37, generator=g, dtype=torch.float64) + 0.1 if parts != "skip" else None
    d = torch.randn(6, generator=g, dtype=torch.float64) if parts != "scale" else None
    extra = [t for t in (c, d) if t is not None]

    def fused(q, k, v, a, s0, *cd):
        it = iter(cd)
        cc, dd = (next(it) if c is not None else None), (next(it) if d is not None else None)
        return grouped_decayed_product(q, k, v, a, s0, chunk_size=8, strategy=strategy, chunks_per_tile=per_tile,
                                       value_scale=cc, skip=dd)

    def reference(q, k, v, a, s0, *cd):
        it = iter(cd)
        cc, dd = (next(it) if c is not None else None), (next(it) if d is not None else None)
        out, s = _reference(q, k, v if cc is None else v * cc[..., None], a, s0)
        return (out if dd is None else out + dd[:, None, None] * v), s

    got, want = _grads(fused, [q, k, v, a, s0, *extra]), _grads(reference, [q, k, v, a, s0, *extra])
    assert _rel(got[0], want[0]) < 1e-12 and _rel(got[1], want[1]) < 1e-12
    names = "q k v log_decay s0".split() + [n for n, t in (("value_scale", c), ("skip", d)) if t is not None]
    for name, x, y in zip(names, got[2], want[2]):
        assert _rel(x, y) < 1e-11, name


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_chunks_per_tile_is_named(bad):
    q, k, v, a, s0 = _inputs(1, 1, 2, 9, 3, 2)
    with pytest.raises(ValueError, match="chunks_per_tile"):
        grouped_decayed_product(q, k, v, a, s0, chunk_size=4, strategy="cpu", chunks_per_tile=bad)


def test_float32_within_1e5_of_the_float64_reference():
    inputs = _inputs(1, 2, 4, 150, 16, 8, dtype=torch.float64, strong=True)
    want = _grads(_reference, inputs)
    got = _grads(lambda *x: grouped_decayed_product(*x, chunk_size=64, strategy="cpu"), [t.float() for t in inputs])
    assert _rel(got[0].double(), want[0]) < 1e-5 and _rel(got[1].double(), want[1]) < 1e-5
    for name, a, b in zip("q k v log_decay s0".split(), got[2], want[2]):
        assert _rel(a.double(), b) < 1e-5, name


def test_gated_linear_attention_takes_the_grouped_route_and_keeps_its_contract():
    """Grouped value heads with a decay per head run the grouped route (its autograd node), and the
    result is the general route's: scale, initial and final state, half inputs' float32 state."""
    q, k, v, a, s0 = _inputs(2, 2, 3, 45, 8, 4, dtype=torch.float32)
    q.requires_grad_()
    out, s = gated_linear_attention(q, k, v, a, scale=0.3, initial_state=DecayedState(s0), return_state=True)
    assert "_GroupedDecayedBackward" in _graph(out.grad_fn)
    # with a padding mask the general route runs (q and k repeated per head)
    masked = gated_linear_attention(q, k, v, a, key_padding_mask=torch.ones(2, 45, dtype=torch.bool))
    assert "_GroupedDecayedBackward" not in _graph(masked.grad_fn)
    m = 3
    want, ws = gated_linear_attention(q.repeat_interleave(m, 1), k.repeat_interleave(m, 1), v, a, scale=0.3,
                                      initial_state=DecayedState(s0), return_state=True)
    assert _rel(out, want) < 1e-5 and _rel(s.s, ws.s) < 1e-5
    half, hs = gated_linear_attention(q.detach().bfloat16(), k.bfloat16(), v.bfloat16(), a, return_state=True)
    assert half.dtype == torch.bfloat16 and hs.s.dtype == torch.float32


def test_packed_documents_equal_one_by_one():
    """cu_seqlens without states: the documents restart at their starts (resets), empty documents
    included; equal to one call per document, outputs and gradients."""
    q, k, v, a, _ = _inputs(1, 2, 3, 40, 5, 4, seed=3)
    cu = torch.tensor([0, 7, 7, 8, 25, 40], dtype=torch.int32)

    def packed(q, k, v, a):
        return gated_linear_attention(q, k, v, a, scale=1.0, cu_seqlens=cu)

    def alone(q, k, v, a):
        c = cu.tolist()
        return torch.cat([gated_linear_attention(q[:, :, i:j], k[:, :, i:j], v[:, :, i:j], a[:, :, i:j], scale=1.0)
                          for i, j in zip(c[:-1], c[1:]) if j > i], dim=2)

    inputs = [t.requires_grad_() for t in (q, k, v, a)]
    got, want = packed(*inputs), alone(*inputs)
    assert _rel(got, want) < 1e-12
    w = torch.randn(got.shape, dtype=got.dtype)
    for name, x, y in zip("q k v log_decay".split(), torch.autograd.grad((got * w).sum(), inputs),
                          torch.autograd.grad((want * w).sum(), inputs)):
        assert _rel(x, y) < 1e-11, name


def test_compiles_fullgraph():
    q, k, v, a, s0 = _inputs(1, 2, 2, 33, 4, 4, dtype=torch.float32)

    def fn(q, k, v, a, s0):
        out, s = gated_linear_attention(q, k, v, a, initial_state=DecayedState(s0), return_state=True)
        return out, s.s

    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    got, want = compiled(q, k, v, a, s0), fn(q, k, v, a, s0)
    assert _rel(got[0], want[0]) < 1e-6 and _rel(got[1], want[1]) < 1e-6


def test_bad_grouping_is_named():
    q, k, v, a, _ = _inputs(1, 2, 3, 10, 4, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"v's number of heads H must be a multiple of q's and k's Hk"):
        gated_linear_attention(q, k, v[:, :5], a[:, :5])
    with pytest.raises(ValueError, match=r"q and k must have the same number of heads"):
        gated_linear_attention(q, k[:, :1], v, a)
    with pytest.raises(ValueError, match=r"log_decay must be <= 0"):
        gated_linear_attention(q, k, v, a.abs() + 0.1)
    with pytest.raises(ValueError, match=r"log_decay must have shape \(B, H, N\)"):
        gated_linear_attention(q, k, v, a[:, :, :5])


# --- gated_linear_attention's value_scale and skip (Mamba-2's dt and D), on every route ---------


def _ssd_inputs(Hk, m, N, *, seed=5, dtype=torch.float64):
    q, k, v, a, s0 = _inputs(1, Hk, m, N, 4, 3, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    c = (torch.rand(1, Hk * m, N, generator=g, dtype=torch.float64) + 0.1).to(dtype)
    d = torch.randn(Hk * m, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, a, s0, c, d


ROUTES = {  # name: (Hk, m, N, options)
    "grouped": (1, 3, 37, {}),
    "grouped, packed": (1, 3, 37, {"cu_seqlens": torch.tensor([0, 9, 9, 30, 37])}),
    "per head": (3, 1, 37, {}),
    "padded": (1, 3, 37, {"key_padding_mask": torch.arange(37) >= 5}),  # the general route
    "packed, states": (1, 2, 20, {"cu_seqlens": torch.tensor([0, 7, 20]), "return_state": True}),
    "one step": (1, 2, 1, {"initial_state": True, "return_state": True}),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_value_scale_and_skip_on_every_route_equal_the_reference(route):
    """Each route of gated_linear_attention (the grouped one, the general one with a padding mask,
    per-head keys, packed documents with states, the one-step recurrent form) against the reference
    recurrence, outputs and every gradient, value_scale's and skip's included, in float64."""
    Hk, m, N, opts = ROUTES[route]
    q, k, v, a, s0, c, d = _ssd_inputs(Hk, m, N)
    opts = dict(opts)
    if opts.get("key_padding_mask") is not None:
        opts["key_padding_mask"] = opts["key_padding_mask"][None]
    cu = opts.pop("cu_seqlens", None)
    want_state = opts.pop("return_state", False)
    use_s0 = opts.pop("initial_state", False)
    n_states = 1 if cu is None else cu.numel() - 1
    s0 = s0[:1].expand(n_states, -1, -1, -1).clone() if use_s0 else None

    def call(fn, q, k, v, a, c, d, *maybe_s0):
        kw = dict(opts, scale=1.0, value_scale=c, skip=d, return_state=want_state,
                  initial_state=DecayedState(maybe_s0[0]) if maybe_s0 else None)
        if fn is gated_linear_attention_reference and cu is not None:  # one document at a time
            outs, states = [], []
            for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
                kw_i = dict(kw, initial_state=DecayedState(maybe_s0[0][i:i + 1]) if maybe_s0 else None, return_state=True)
                o, s = fn(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], a[:, :, lo:hi], **dict(kw_i, value_scale=c[:, :, lo:hi]))
                outs.append(o)
                states.append(s.s)
            out = torch.cat(outs, dim=2)
            return (out, torch.cat(states)) if want_state else (out, out.new_zeros(()))
        result = fn(q, k, v, a, **(kw if cu is None else dict(kw, cu_seqlens=cu)))
        return (result[0], result[1].s) if want_state else (result, result.new_zeros(()))

    inputs = [q, k, v, a, c, d] + ([s0] if use_s0 else [])
    got = _grads(lambda *x: call(gated_linear_attention, *x), inputs)
    want = _grads(lambda *x: call(gated_linear_attention_reference, *x), inputs)
    assert _rel(got[0], want[0]) < 1e-12 and (not want_state or _rel(got[1], want[1]) < 1e-12)
    for name, x, y in zip("q k v log_decay value_scale skip s0".split(), got[2], want[2]):
        assert _rel(x, y) < 1e-11, (route, name)
    if "key_padding_mask" in opts:  # padded positions' outputs stay zeros, skip included
        assert torch.equal(got[0][:, :, :5], torch.zeros_like(got[0][:, :, :5]))
        # and what they hold is never read, NaN included
        v_nan, c_nan = v.clone(), c.clone()
        v_nan[:, :, :5], c_nan[:, :, :5] = float("nan"), float("nan")
        assert torch.equal(call(gated_linear_attention, q, k, v_nan, a, c_nan, d)[0], got[0])


def test_value_scale_and_skip_are_checked_by_name():
    q, k, v, a, _, c, d = _ssd_inputs(1, 2, 10, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"value_scale must be a floating tensor of shape \(1, 2, 10\)"):
        gated_linear_attention(q, k, v, a, value_scale=c[:, :, :9])
    with pytest.raises(ValueError, match=r"skip must be a floating tensor of shape \(2,\)"):
        gated_linear_attention(q, k, v, a, skip=d[None])
    with pytest.raises(TypeError, match="value_scale must be a Tensor or None"):
        gated_linear_attention(q, k, v, a, value_scale=0.5)

