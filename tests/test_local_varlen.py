"""local_attention with packed documents (cu_seqlens): one packed call against one call per
document (outputs, gradients of q, k, v and of the state tensors, returned states), in float64, and
the reference's packed form against its per-document calls."""

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional import local_attention_reference
from linattn.functional.local import MAX_BLOCK, MIN_BLOCK

from conftest import assert_close, make_mask, make_qkv

H, D, DV = 2, 12, 7


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def _state(n, window, *, seed, pos=5):
    """A random state of n rings (float64, leaves with grad), some slots empty."""
    g = torch.Generator().manual_seed(seed + 99)
    k0 = torch.randn(n, H, window, D, generator=g, dtype=torch.float64).requires_grad_()
    v0 = torch.randn(n, H, window, DV, generator=g, dtype=torch.float64).requires_grad_()
    valid = torch.rand(n, window, generator=g) > 0.25
    return linattn.LocalAttentionState(k0, v0, valid, pos)


def _oldest_first(state):
    """k, v, valid of a state with slot i holding position pos - W + i (independent of pos)."""
    shift = -(state.pos % state.k.shape[2])
    return state.k.roll(shift, 2), state.v.roll(shift, 2), state.valid.roll(shift, 1)


def _per_document(fn, q, k, v, cu, *, window, causal, mask, state):
    """fn called once per document; outputs concatenated, states stacked in oldest-first order."""
    outs, rings = [], []
    bounds = cu.tolist()
    for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        st = None if state is None else linattn.LocalAttentionState(
            state.k[d:d + 1], state.v[d:d + 1], state.valid[d:d + 1], state.pos)
        res = fn(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], window=window, causal=causal,
                 key_padding_mask=None if mask is None else mask[:, a:b], initial_state=st, return_state=causal)
        if causal:
            res, s = res
            assert s.pos == (0 if state is None else state.pos) + b - a
            rings.append(_oldest_first(s))
        outs.append(res)
    out = torch.cat(outs, 2)
    if not causal:
        return out, None
    return out, tuple(torch.cat(parts, 0) for parts in zip(*rings))


def _loss(out, rings, seed):
    """<out, R> plus <ring k, R'> and <ring v, R''>: reaches every gradient path, states included."""
    g = torch.Generator().manual_seed(seed)
    total = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if rings is not None:
        for t in rings[:2]:
            total = total + (t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum()
    return total


def _check_packed_equals_per_document(lengths, window, *, causal, with_state, masked, seed=0, fn=None):
    fn = fn or linattn.local_attention
    cu = _offsets(lengths)
    T, n = int(cu[-1]), len(lengths)
    q, k, v = make_qkv(1, H, T, T, D, DV, seed=seed)
    mask = make_mask(1, T, seed=seed) if masked else None
    state = _state(n, window, seed=seed) if with_state else None
    res = fn(q, k, v, window=window, causal=causal, key_padding_mask=mask, initial_state=state,
             return_state=causal, cu_seqlens=cu)
    out, packed_state = res if causal else (res, None)
    expected, rings = _per_document(fn, q, k, v, cu, window=window, causal=causal, mask=mask, state=state)
    assert out.shape == (1, H, T, DV) and out.dtype == torch.float64
    assert_close(out, expected, msg="output")
    packed_rings = None
    if causal:
        assert packed_state.pos == (state.pos if with_state else 0) + max(lengths)
        assert packed_state.k.shape == (n, H, window, D) and packed_state.valid.shape == (n, window)
        packed_rings = _oldest_first(packed_state)
        for name, a, b in zip(("k", "v"), packed_rings, rings):
            assert_close(a, b, msg=f"state {name}")
        assert torch.equal(packed_rings[2], rings[2]), "state valid"
    inputs = (q, k, v) + ((state.k, state.v) if with_state else ())
    got = torch.autograd.grad(_loss(out, packed_rings, seed), inputs, allow_unused=True)
    want = torch.autograd.grad(_loss(expected, rings, seed), inputs, allow_unused=True)
    for name, x, a, b in zip(("q", "k", "v", "state.k", "state.v"), inputs, got, want):
        # an unused input (no document, every key padded) has no gradient: zeros on both sides
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        assert torch.isfinite(a).all(), f"grad {name}"
        assert_close(a, b, msg=f"grad {name}")


# (lengths, window): documents of length 1; lengths around the window and around the block bounds;
# empty documents; windows below, at and above the documents' lengths and MAX_BLOCK; one document
CASES = [
    ([1] * 7, 3),
    ([4, 5, 6, 7, 1, 11], 5),
    ([0, 5, 0, 0, 3, 0], 2),
    ([3, 7, 2], 20),
    ([MIN_BLOCK - 1, MIN_BLOCK, MIN_BLOCK + 1, 1, 2 * MIN_BLOCK + 1], 33),
    ([MAX_BLOCK - 1, 1, MAX_BLOCK + 2, 40], MAX_BLOCK + 1),
    ([300], 33),
    ([2, 250, 1, 9], 64),
]


@pytest.mark.parametrize("lengths,window", CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_packed_equals_per_document(lengths, window, with_state):
    _check_packed_equals_per_document(lengths, window, causal=True, with_state=with_state, masked=False,
                                      seed=len(lengths) + window)


@pytest.mark.parametrize("window", [4, 50])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_forty_short_documents(window, with_state, masked):
    g = torch.Generator().manual_seed(window)
    lengths = torch.randint(0, 10, (40,), generator=g).tolist()
    lengths[7] = 0
    lengths[8] = 1
    _check_packed_equals_per_document(lengths, window, causal=True, with_state=with_state, masked=masked, seed=3)


@pytest.mark.parametrize("lengths,window", [([7, 1, 40, 0, 13], 6), ([MIN_BLOCK + 3, 90], 70)])
@pytest.mark.parametrize("with_state", [False, True])
def test_padding_mask_inside_documents(lengths, window, with_state):
    _check_packed_equals_per_document(lengths, window, causal=True, with_state=with_state, masked=True, seed=11)


@pytest.mark.parametrize("lengths,window", [([1] * 5, 2), ([4, 0, 9, 1, 30], 5), ([MAX_BLOCK + 2, 3, 70], 40), ([3, 7, 2], 20)])
@pytest.mark.parametrize("masked", [False, True])
def test_bidirectional_packed_equals_per_document(lengths, window, masked):
    _check_packed_equals_per_document(lengths, window, causal=False, with_state=False, masked=masked, seed=5)


@pytest.mark.parametrize("lengths,window,causal,with_state", [
    ([1] * 6, 3, True, True), ([4, 0, 9, 1, 30], 5, True, True), ([3, 7, 2], 20, True, False),
    ([4, 0, 9, 1, 30], 5, False, False),
])
def test_reference_packed_equals_per_document_references(lengths, window, causal, with_state):
    _check_packed_equals_per_document(lengths, window, causal=causal, with_state=with_state, masked=True, seed=2,
                                      fn=local_attention_reference)


def test_fast_and_reference_agree_on_a_mixed_pack():
    lengths, W = [0, 1, 17, 2, 60, 5, 33], 9
    cu = _offsets(lengths)
    q, k, v = make_qkv(1, H, int(cu[-1]), int(cu[-1]), D, DV, seed=8, requires_grad=False)
    state = _state(len(lengths), W, seed=8)
    mask = make_mask(1, int(cu[-1]), seed=8)
    args = dict(window=W, causal=True, key_padding_mask=mask, initial_state=state, return_state=True, cu_seqlens=cu)
    out, st = linattn.local_attention(q, k, v, **args)
    out_r, st_r = local_attention_reference(q, k, v, **args)
    assert_close(out, out_r)
    assert st.pos == st_r.pos == state.pos + 60
    assert_close(st.k, st_r.k)
    assert_close(st.v, st_r.v)
    assert torch.equal(st.valid, st_r.valid)


def test_packed_state_resumes_each_document():
    """Two packed calls, the second continuing the first's states, equal one packed call: the shared
    pos of a packed state is a consistent layout for every document."""
    firsts, seconds, W = [3, 0, 12, 1, 7], [5, 4, 0, 9, 1], 4
    whole_cu = _offsets([a + b for a, b in zip(firsts, seconds)])
    T = int(whole_cu[-1])
    q, k, v = make_qkv(1, H, T, T, D, DV, seed=21)
    first_idx = torch.cat([torch.arange(s, s + a) for s, a in zip(whole_cu[:-1].tolist(), firsts)])
    second_idx = torch.cat([torch.arange(s + a, s + a + b) for s, a, b in zip(whole_cu[:-1].tolist(), firsts, seconds)])
    call = lambda idx, lengths, st: linattn.local_attention(  # noqa: E731
        q[:, :, idx], k[:, :, idx], v[:, :, idx], window=W, causal=True, initial_state=st, return_state=True,
        cu_seqlens=_offsets(lengths))
    o1, s1 = call(first_idx, firsts, None)
    o2, s2 = call(second_idx, seconds, s1)
    whole, whole_state = linattn.local_attention(q, k, v, window=W, causal=True, return_state=True, cu_seqlens=whole_cu)
    assert_close(o1, whole[:, :, first_idx])
    assert_close(o2, whole[:, :, second_idx])
    for a, b in zip(_oldest_first(s2), _oldest_first(whole_state)):
        assert torch.equal(a, b)
    resumed = torch.zeros_like(whole).index_copy(2, first_idx, o1).index_copy(2, second_idx, o2)
    got = torch.autograd.grad(_loss(resumed, _oldest_first(s2), 1), (q, k, v))
    want = torch.autograd.grad(_loss(whole, _oldest_first(whole_state), 1), (q, k, v))
    for a, b in zip(got, want):
        assert_close(a, b)


def test_one_document_is_the_plain_call():
    q, k, v = make_qkv(1, H, 70, 70, D, DV, seed=4, requires_grad=False)
    state = _state(1, 9, seed=4)
    plain, plain_state = linattn.local_attention(q, k, v, window=9, causal=True, initial_state=state, return_state=True)
    packed, packed_state = linattn.local_attention(q, k, v, window=9, causal=True, initial_state=state,
                                                   return_state=True, cu_seqlens=torch.tensor([0, 70]))
    assert_close(packed, plain)
    assert packed_state.pos == plain_state.pos
    for a, b in zip(packed_state[:3], plain_state[:3]):
        assert torch.equal(a, b)


def test_cost_grows_with_total_length(monkeypatch):
    """One long document and 300 one-token ones, with states: the attention calls score O(T window)
    query-key pairs in all, not (documents x longest) nor (documents x window x window)."""
    lengths, W = [2000] + [1] * 300, 64
    cu = _offsets(lengths)
    T = int(cu[-1])
    q, k, v = make_qkv(1, 1, T, T, 8, 4, dtype=torch.float32, requires_grad=False)
    state = linattn.LocalAttentionState(torch.randn(301, 1, W, 8), torch.randn(301, 1, W, 4),
                                        torch.ones(301, W, dtype=torch.bool), 0)
    pairs = []
    sdpa = F.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        pairs.append(q.shape[:-1].numel() * k.shape[-2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    linattn.local_attention(q, k, v, window=W, causal=True, initial_state=state, cu_seqlens=cu)
    assert 2 <= len(pairs) <= 10  # the blocked pass and one call per head-length group
    assert sum(pairs) <= 4 * T * (W + 1), (pairs, T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    cu = _offsets([30, 0, 1, 69])
    q, k, v = make_qkv(1, H, 100, 100, D, DV, dtype=torch.float32, requires_grad=False)
    state = linattn.LocalAttentionState(*(t.detach().float() for t in _state(4, 10, seed=1)[:2]), *_state(4, 10, seed=1)[2:])
    args = dict(window=10, causal=True, initial_state=state, return_state=True, cu_seqlens=cu)
    out, st = linattn.local_attention(q.to(dtype), k.to(dtype), v.to(dtype), **args)
    expected, st32 = linattn.local_attention(q, k, v, **args)
    assert out.dtype == dtype and st.k.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(st.valid, st32.valid)


def test_errors():
    q, k, v = make_qkv(1, H, 10, 10, D, DV, dtype=torch.float32, requires_grad=False)
    cu = torch.tensor([0, 4, 10])
    run = lambda c, **kw: linattn.local_attention(q, k, v, window=3, causal=True, cu_seqlens=c, **kw)  # noqa: E731
    with pytest.raises(TypeError, match="local_attention: cu_seqlens must be an integer tensor.*list"):
        run([0, 4, 10])
    with pytest.raises(TypeError, match="cu_seqlens must have an integer dtype.*got torch.float64"):
        run(cu.double())
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D with n \+ 1 >= 2 entries.*got shape \(1, 3\)"):
        run(cu[None])
    with pytest.raises(ValueError, match=r">= 2 entries.*got shape \(1,?\)"):
        run(torch.tensor([0]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, got 1"):
        run(torch.tensor([1, 4, 10]))
    with pytest.raises(ValueError, match=r"cu_seqlens must end at T = 10 .*got 9"):
        run(torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match=r"non-decreasing, got cu_seqlens\[1\] = 6 > cu_seqlens\[2\] = 2"):
        run(torch.tensor([0, 6, 2, 10]))
    with pytest.raises(ValueError, match="cu_seqlens is on meta, q on cpu"):
        run(cu.to("meta"))
    q2, k2, v2 = make_qkv(2, H, 10, 10, D, DV, requires_grad=False)
    with pytest.raises(ValueError, match=r"batch size must be 1, got q \(2, 2, 10, 12\)"):
        linattn.local_attention(q2, k2, v2, window=3, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"initial_state.k must have shape \(2, 2, 3, 12\).*one ring per document: 2 "
                                         r"documents in cu_seqlens.*got \(1, 2, 3, 12\)"):
        run(cu, initial_state=_state(1, 3, seed=0))  # one ring for two documents
    st = _state(2, 3, seed=0)
    with pytest.raises(ValueError, match=r"initial_state.valid must be a bool tensor of shape \(2, 3\)"):
        run(cu, initial_state=st._replace(valid=st.valid[:1]))
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.local_attention(q, k, v, window=3, cu_seqlens=cu, return_state=True)
    with pytest.raises(ValueError, match=r"local_attention_reference: cu_seqlens must be non-decreasing"):
        local_attention_reference(q, k, v, window=3, cu_seqlens=torch.tensor([0, 6, 2, 10]))
