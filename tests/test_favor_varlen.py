"""Packed documents (cu_seqlens) of causal favor_attention against one call per document: outputs,
gradients of q, k, v and of the initial-state tensors, and the per-document states (their scale
included), for every kernel and feature kind."""

import pytest
import torch

from conftest import assert_close
import linattn
from linattn.functional.linear import LinearAttentionState

F64 = torch.float64
H, D, DV, M = 2, 6, 3, 8
KINDS = [("softmax", "positive"), ("softmax", "trig"), ("relu", "positive")]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _inputs(lengths, kernel, features, *, with_state, seed, dtype=F64, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    T, n = sum(lengths), len(lengths)
    # documents of very different key magnitudes: one document's scale must not reach another's
    mags = torch.tensor([spread ** (i % 3) for i in range(n)], dtype=dtype)
    per_pos = mags.repeat_interleave(torch.tensor(lengths), output_size=T) if T else mags[:0]
    q = torch.randn(1, H, T, D, generator=g, dtype=dtype) * 0.5
    k = torch.randn(1, H, T, D, generator=g, dtype=dtype) * per_pos[:, None]
    v = torch.randn(1, H, T, DV, generator=g, dtype=dtype)
    W = linattn.favor_projection(M, D, generator=g, dtype=dtype)
    states = None
    if with_state:  # a real state: from a prefix of every document
        Fd = 2 * M if features == "trig" else M
        pre = [torch.randn(1, H, 4, D, generator=g, dtype=dtype) for _ in range(3)]
        S, z, ls = [], [], []
        for i in range(n):
            _, st = linattn.favor_attention(pre[0] * 0.5, pre[1] * (i + 1), pre[2][..., :DV], W, kernel=kernel,
                                            features=features, causal=True, return_state=True)
            S.append(st.S), z.append(st.z), ls.append(st.log_scale)
        states = [torch.cat(S), torch.cat(z), torch.cat(ls)]
        assert states[0].shape == (n, H, Fd, DV)
    leaves = [q, k, v] + ([states[0], states[1]] if states else [])
    for t in leaves:
        t.requires_grad_()
    return q, k, v, W, states, leaves


def _state(states, i=None):
    if states is None:
        return None
    S, z, ls = states
    if i is None:
        return LinearAttentionState(S, z, ls)
    return LinearAttentionState(S[i : i + 1], z[i : i + 1], ls[i : i + 1])


@pytest.mark.parametrize("kernel,features", KINDS)
@pytest.mark.parametrize("lengths", [[1], [9, 1, 17, 0, 5], [3] * 12, [40], [0, 0, 7]])
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_equals_one_call_per_document(kernel, features, lengths, with_state):
    q, k, v, W, states, leaves = _inputs(lengths, kernel, features, with_state=with_state, seed=len(lengths),
                                         spread=6.0)
    cu = _cu(lengths)
    kw = dict(kernel=kernel, features=features, causal=True, return_state=True, chunk_size=4)
    out, st = linattn.favor_attention(q, k, v, W, initial_state=_state(states), cu_seqlens=cu, **kw)
    outs, sts = [], []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, s = linattn.favor_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], W, initial_state=_state(states, i),
                                       **kw)
        outs.append(o), sts.append(s)
    want = torch.cat(outs, dim=2)
    assert_close(out, want, msg="out")
    for name in ("S", "z", "log_scale"):
        assert_close(getattr(st, name), torch.cat([getattr(s, name) for s in sts]), msg=name)
    g = torch.Generator().manual_seed(7)
    cot = [torch.randn(out.shape, generator=g, dtype=F64), torch.randn(st.S.shape, generator=g, dtype=F64),
           torch.randn(st.z.shape, generator=g, dtype=F64)]

    def loss(o, s):
        return (o * cot[0]).sum() + (s.S * cot[1]).sum() + (s.z * cot[2]).sum()

    got = torch.autograd.grad(loss(out, st), leaves, allow_unused=True)
    ref_state = LinearAttentionState(*(torch.cat([getattr(s, f) for s in sts]) for f in ("S", "z", "log_scale")))
    wanted = torch.autograd.grad(loss(want, ref_state), leaves, allow_unused=True)
    for name, x, y in zip(["q", "k", "v", "S0", "z0"], got, wanted):
        if y is None:
            assert x is None or bool((x == 0).all()), name
        else:
            assert_close(x, y, msg=f"d{name}")


def test_padding_inside_documents():
    lengths = [6, 11, 4]
    q, k, v, W, _, _ = _inputs(lengths, "softmax", "positive", with_state=False, seed=3)
    cu = _cu(lengths)
    mask = torch.ones(1, sum(lengths), dtype=torch.bool)
    mask[0, [0, 8, 9, 20]] = False  # a document's first position, and its middle
    out = linattn.favor_attention(q, k, v, W, causal=True, key_padding_mask=mask, cu_seqlens=cu)
    want = torch.cat([linattn.favor_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], W, causal=True,
                                              key_padding_mask=mask[:, a:b])
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=2)
    assert_close(out, want)


def test_a_loud_document_does_not_silence_the_next_in_float32():
    """A document of huge keys before one of tiny keys: with one running maximum over the packed
    sequence the second's features would underflow to zero; each document keeps its own."""
    lengths = [20, 20]
    q, k, v, W, _, _ = _inputs(lengths, "softmax", "positive", with_state=False, seed=5, dtype=torch.float32)
    k = k.detach().clone()
    k[:, :, :20] *= 30.0
    cu = _cu(lengths)
    out = linattn.favor_attention(q, k, v, W, causal=True, cu_seqlens=cu)
    second = linattn.favor_attention(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], W, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, 20:], second, rtol=1e-5, atol=1e-6)


def test_errors():
    q, k, v, W, _, _ = _inputs([3, 4], "softmax", "positive", with_state=False, seed=1)
    cu = _cu([3, 4])
    with pytest.raises(ValueError, match="causal=True"):
        linattn.favor_attention(q, k, v, W, cu_seqlens=cu)
    with pytest.raises(ValueError, match="end at T"):
        linattn.favor_attention(q, k, v, W, causal=True, cu_seqlens=_cu([3, 3]))
    with pytest.raises(ValueError, match="batch size must be 1"):
        linattn.favor_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), W,
                                causal=True, cu_seqlens=cu)
    _, st = linattn.favor_attention(q, k, v, W, causal=True, return_state=True)  # one state, two documents
    with pytest.raises(ValueError):
        linattn.favor_attention(q, k, v, W, causal=True, cu_seqlens=cu, initial_state=st)
