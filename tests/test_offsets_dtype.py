"""Packed documents' offsets in any integer dtype: flash-attention's convention (and so
transformers' DataCollatorWithFlattening) gives int32 ``cu_seqlens``. Every form, module and model
that takes them gives bitwise the outputs, gradients and states of the same offsets in int64; the
int64 copy is made once per offsets tensor, not once per layer."""

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.functional.decayed_state import DecayedState
from linattn.functional.lsh import lsh_attention_reference
from linattn.functional.local import local_attention_reference
from linattn.functional.softmax import softmax_attention_reference
from linattn.functional.varlen import document_lengths, int64_offsets
from linattn.models import TransformerConfig, TransformerLM
from linattn.nn import MultiHeadAttention
from linattn.nn.registry import MECHANISMS

H, D, DV = 2, 4, 3
LENGTHS = [5, 0, 7, 1, 11]  # an empty document and one of a single token
T = sum(LENGTHS)  # 24: the LSH forms below need bucket_size = 4 | T
DTYPES = [torch.int32, torch.int16, torch.uint8]


def _cu(dtype):
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=dtype)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    k = F.normalize(k, dim=-1)
    v = torch.randn(1, H, T, DV, generator=g, dtype=torch.float64)
    beta = torch.rand(1, H, T, generator=g, dtype=torch.float64)
    head = -torch.rand(1, H, T, generator=g, dtype=torch.float64)
    channel = -torch.rand(1, H, T, D, generator=g, dtype=torch.float64)
    s0 = torch.randn(len(LENGTHS), H, D, DV, generator=g, dtype=torch.float64)
    proj = torch.randn(6, D, generator=g, dtype=torch.float64)
    return dict(q=q, k=k, v=v, beta=beta, head=head, channel=channel, s0=s0, proj=proj)


def _states(res):
    """(output, [state tensors]) of a form's result."""
    if not isinstance(res, tuple):
        return res, []
    out, st = res
    return out, [t for t in (st if isinstance(st, tuple) else (st.s,)) if isinstance(t, torch.Tensor)]


FORMS = {
    "gated_head": lambda x, cu: gated_linear_attention_call(x, "head", cu),
    "gated_channel": lambda x, cu: gated_linear_attention_call(x, "channel", cu),
    "delta": lambda x, cu: linattn.delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=cu,
                                                        initial_state=DecayedState(x["s0"]), return_state=True),
    "gated_delta": lambda x, cu: linattn.delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], log_decay=x["head"],
                                                              cu_seqlens=cu, return_state=True),
    "kda": lambda x, cu: linattn.delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], log_decay=x["channel"],
                                                      cu_seqlens=cu, return_state=True, qk_l2norm_eps=1e-6),
    "linear": lambda x, cu: linattn.linear_attention(x["q"], x["k"], x["v"], causal=True, cu_seqlens=cu,
                                                     return_state=True),
    "favor": lambda x, cu: linattn.favor_attention(x["q"], x["k"], x["v"], x["proj"], causal=True, cu_seqlens=cu,
                                                   return_state=True),
    "local": lambda x, cu: linattn.local_attention(x["q"], x["k"], x["v"], window=3, causal=True, cu_seqlens=cu,
                                                   return_state=True),
    "local_reference": lambda x, cu: local_attention_reference(x["q"], x["k"], x["v"], window=3, causal=True,
                                                               cu_seqlens=cu, return_state=True),
    "lsh": lambda x, cu: linattn.lsh_attention(x["q"], x["v"], n_hashes=2, bucket_size=4, causal=True,
                                               cu_seqlens=cu, generator=torch.Generator().manual_seed(3)),
    "lsh_reference": lambda x, cu: lsh_attention_reference(x["q"], x["v"], n_hashes=2, bucket_size=4, causal=True,
                                                           cu_seqlens=cu, generator=torch.Generator().manual_seed(3)),
    "softmax": lambda x, cu: linattn.softmax_attention(x["q"], x["k"], x["v"], causal=True, cu_seqlens=cu),
    "softmax_reference": lambda x, cu: softmax_attention_reference(x["q"], x["k"], x["v"], causal=True,
                                                                   cu_seqlens=cu),
}


def gated_linear_attention_call(x, decay, cu):
    return linattn.gated_linear_attention(x["q"], x["k"], x["v"], x[decay], cu_seqlens=cu,
                                          initial_state=DecayedState(x["s0"]), return_state=True)


def _run(form, cu):
    x = {name: t.clone().requires_grad_(t.is_floating_point()) for name, t in _inputs().items()}
    out, states = _states(FORMS[form](x, cu))
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    loss = (out * cot).sum() + sum(s.sum() for s in states if s.is_floating_point())
    leaves = [t for t in x.values() if t.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return out, states, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_gives_int64s_results(form, dtype):
    out, states, grads = _run(form, _cu(torch.int64))
    out2, states2, grads2 = _run(form, _cu(dtype))
    assert torch.equal(out, out2)
    assert len(states) == len(states2)
    for a, b in zip(states, states2):
        assert torch.equal(a, b)
    assert any(g is not None for g in grads)
    for a, b in zip(grads, grads2):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_bad_int32_offsets_are_named_like_int64_ones():
    x = _inputs()
    bad = torch.tensor([0, 9, 4, T], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 9 > "
                                         r"cu_seqlens\[2\] = 4"):
        linattn.delta_rule_attention(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=bad)


def test_the_int64_copy_is_made_once_per_offsets_tensor():
    cu = _cu(torch.int32)
    first = int64_offsets(cu)
    assert first.dtype == torch.int64 and torch.equal(first, _cu(torch.int64))
    assert int64_offsets(cu) is first  # every layer of a model forward shares it
    assert int64_offsets(first) is first
    lengths = document_lengths(first)
    assert document_lengths(int64_offsets(cu)) is lengths  # and the lengths read from it
    cu[1] += 1  # an in-place change makes a new copy
    assert int64_offsets(cu) is not first and int(int64_offsets(cu)[1]) == LENGTHS[0] + 1


CAUSAL = [name for name, spec in MECHANISMS.items() if spec.causal]


@pytest.mark.parametrize("name", CAUSAL)
def test_model_and_layer_take_int32_offsets(name):
    spec = MECHANISMS[name]
    attention = spec.default_config()
    if name == "lsh":  # bucket_size | T
        attention = type(attention)(bucket_size=4, n_hashes=2)
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, max_len=16, attention=attention,
                            positional="rotary" if spec.rotary else "learned", short_conv=3)
    model = TransformerLM(cfg).double()
    ids = torch.randint(0, 11, (1, T), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for dtype in (torch.int64, torch.int32):
        torch.manual_seed(5)  # LSH and FAVOR+ draw in the forward
        logits = model(ids, cu_seqlens=_cu(dtype))
        results.append((logits, torch.autograd.grad(logits.square().sum(), params, allow_unused=True)))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    for x, y in zip(ga, gb):
        assert (x is None and y is None) or torch.equal(x, y)
    layer = model.blocks[0].attn if hasattr(model.blocks[0], "attn") else None
    if isinstance(layer, MultiHeadAttention):
        h = torch.randn(1, T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        torch.manual_seed(5)
        y64 = layer(h, causal=True, cu_seqlens=_cu(torch.int64))
        torch.manual_seed(5)
        assert torch.equal(layer(h, causal=True, cu_seqlens=_cu(torch.int32)), y64)
