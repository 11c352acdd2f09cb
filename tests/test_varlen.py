"""Packed variable-length inputs (cu_seqlens) of gated_linear_attention, delta_rule_attention and
causal linear_attention against the same function called once per document: outputs, the
gradient of every input and initial-state tensor, and the returned per-document states."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close
from linattn.functional.decayed_state import DecayedState
from linattn.functional.delta import delta_rule_attention
from linattn.functional.gated import gated_linear_attention
from linattn.functional.linear import LinearAttentionState, linear_attention
from linattn.functional.varlen import segment_cumsum, segment_cumsum_reference, segment_sum, varlen_layout

F64 = torch.float64
H, D, DV = 2, 5, 3


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


class Spec:
    """One mechanism: ``tensors`` makes its packed inputs ``(1, H, T, *)`` and its per-document
    initial-state tensors ``(n, H, ...)``; ``call`` runs it and returns the output and the list of
    returned state tensors (empty without return_state)."""

    def __init__(self, name, tensors, call):
        self.name, self.tensors, self.call = name, tensors, call


def _gated_tensors(channel):
    def tensors(T, n, g, dtype):
        q, k = (torch.randn(1, H, T, D, generator=g, dtype=dtype) for _ in range(2))
        v = torch.randn(1, H, T, DV, generator=g, dtype=dtype)
        ld = -torch.rand(1, H, T, *([D] if channel else []), generator=g, dtype=dtype)
        return [q, k, v, ld], [torch.randn(n, H, D, DV, generator=g, dtype=dtype)]
    return tensors


def _gated_call(ins, states, return_state, **kw):
    init = None if states is None else DecayedState(*states)
    res = gated_linear_attention(*ins, initial_state=init, return_state=return_state, **kw)
    return (res[0], [res[1].s]) if return_state else (res, [])


def _delta_tensors(decay):
    def tensors(T, n, g, dtype):
        q = torch.randn(1, H, T, D, generator=g, dtype=dtype)
        k = F.normalize(torch.randn(1, H, T, D, generator=g, dtype=dtype), dim=-1)
        v = torch.randn(1, H, T, DV, generator=g, dtype=dtype)
        beta = torch.rand(1, H, T, generator=g, dtype=dtype) * 1.5
        ins = [q, k, v, beta] + ([-torch.rand(1, H, T, generator=g, dtype=dtype)] if decay else [])
        return ins, [torch.randn(n, H, D, DV, generator=g, dtype=dtype)]
    return tensors


def _delta_call(ins, states, return_state, **kw):
    q, k, v, beta, *ld = ins
    init = None if states is None else DecayedState(*states)
    res = delta_rule_attention(q, k, v, beta, log_decay=ld[0] if ld else None, initial_state=init,
                               return_state=return_state, **kw)
    return (res[0], [res[1].s]) if return_state else (res, [])


def _linear_tensors(fm):
    Fd = D + 1 if fm == "cos" else D

    def tensors(T, n, g, dtype):
        q, k = (torch.randn(1, H, T, D, generator=g, dtype=dtype) for _ in range(2))
        v = torch.randn(1, H, T, DV, generator=g, dtype=dtype)
        return [q, k, v], [torch.randn(n, H, Fd, DV, generator=g, dtype=dtype),
                           1 + torch.rand(n, H, Fd, generator=g, dtype=dtype)]
    return tensors


def _linear_call(fm):
    def call(ins, states, return_state, **kw):
        init = None if states is None else LinearAttentionState(*states)
        res = linear_attention(*ins, feature_map=fm, causal=True, initial_state=init, return_state=return_state,
                               **kw)
        return (res[0], [res[1].S, res[1].z]) if return_state else (res, [])
    return call


SPECS = [
    Spec("gated_head", _gated_tensors(False), _gated_call),
    Spec("gated_channel", _gated_tensors(True), _gated_call),
    Spec("deltanet", _delta_tensors(False), _delta_call),
    Spec("gated_deltanet", _delta_tensors(True), _delta_call),
    Spec("linear_elu", _linear_tensors("elu"), _linear_call("elu")),
    Spec("linear_cos", _linear_tensors("cos"), _linear_call("cos")),
]

_MANY = torch.randint(1, 7, (40,), generator=torch.Generator().manual_seed(3)).tolist()
LENGTHS = {  # name: (document lengths, chunk size)
    "awkward": ([1, 5, 7, 1, 13, 2], 4),  # lengths that do not divide the chunk; documents of one position
    "many": (_MANY, 8),  # 40 short documents: chunks span several of them
    "long": ([70], 16),  # one document of several chunks
    "empty": ([3, 0, 4, 0, 1], 3),  # empty documents (their state passes through)
}
STATES = {"none": (False, False), "read": (False, True), "write": (True, False), "both": (True, True)}


def _run(spec, ins, states, cu, *, with_init, return_state, packed, mask=None, seed=1, **kw):
    """Output, returned states and the gradients of a random linear function of both with respect
    to every input and initial-state tensor; packed (one call) or one call per document."""
    ins = [t.detach().clone().requires_grad_() for t in ins]
    states = [s.detach().clone().requires_grad_() for s in states] if with_init else None
    if packed:
        out, st = spec.call(ins, states, return_state, cu_seqlens=cu,
                            **({} if mask is None else {"key_padding_mask": mask}), **kw)
    else:
        outs, sts = [], []
        for j in range(cu.shape[0] - 1):
            a, b = int(cu[j]), int(cu[j + 1])
            extra = {} if mask is None else {"key_padding_mask": mask[:, a:b]}
            o, s = spec.call([t[:, :, a:b] for t in ins], None if states is None else [t[j:j + 1] for t in states],
                             return_state, **extra, **kw)
            outs.append(o)
            sts.append(s)
        out = torch.cat(outs, dim=2)
        st = [torch.cat(parts, dim=0) for parts in zip(*sts)] if return_state else []
    g = torch.Generator().manual_seed(seed)
    loss = (out.double() * torch.randn(out.shape, generator=g, dtype=F64)).sum()
    for s in st:
        loss = loss + (s.double() * torch.randn(s.shape, generator=g, dtype=F64)).sum()
    wrt = ins + (states or [])
    return [out, *st], torch.autograd.grad(loss, wrt)


def _compare(spec, got, want, *, atol=1e-10, rtol=1e-9):
    (vals, grads), (vals_r, grads_r) = got, want
    assert len(vals) == len(vals_r) and len(grads) == len(grads_r)
    for i, (a, b) in enumerate(zip(vals, vals_r)):
        assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=f"{spec.name} {'out' if i == 0 else f'state {i}'}")
    for i, (a, b) in enumerate(zip(grads, grads_r)):
        assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=f"{spec.name} gradient of input {i}")


@pytest.mark.parametrize("states", list(STATES))
@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_packed_equals_per_document(spec, case, states):
    lengths, C = LENGTHS[case]
    with_init, return_state = STATES[states]
    cu = _cu(lengths)
    ins, st = spec.tensors(int(cu[-1]), len(lengths), torch.Generator().manual_seed(0), F64)
    kw = dict(with_init=with_init, return_state=return_state, chunk_size=C)
    got = _run(spec, ins, st, cu, packed=True, **kw)
    _compare(spec, got, _run(spec, ins, st, cu, packed=False, **kw))


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_packed_with_padding_mask(spec):
    """key_padding_mask (1, T) with cu_seqlens: a padded position is an identity step, as in each
    document's own call with its slice of the mask (a document's first position padded too)."""
    lengths = [4, 1, 6, 0, 9]
    cu = _cu(lengths)
    T = int(cu[-1])
    mask = torch.rand(1, T, generator=torch.Generator().manual_seed(5)) > 0.3
    mask[0, 0] = mask[0, 5] = False  # the first position of documents 0 and 2
    ins, st = spec.tensors(T, len(lengths), torch.Generator().manual_seed(0), F64)
    if not spec.name.startswith("linear"):  # linear attention masks keys only; the others skip padded
        ins[0] = torch.where(mask[:, None, :, None], ins[0], torch.nan)  # queries too (zeros out), even NaN
    for with_init in (False, True):
        kw = dict(with_init=with_init, return_state=True, chunk_size=4, mask=mask)
        got = _run(spec, ins, st, cu, packed=True, **kw)
        _compare(spec, got, _run(spec, ins, st, cu, packed=False, **kw))
        if not spec.name.startswith("linear"):
            assert not got[0][0].masked_select(~mask[:, None, :, None]).any()


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[1], SPECS[3], SPECS[4]], ids=lambda s: s.name)
def test_packed_float32(spec):
    lengths, C = [3, 17, 1, 30, 9], 8
    cu = _cu(lengths)
    ins, st = spec.tensors(int(cu[-1]), len(lengths), torch.Generator().manual_seed(0), torch.float32)
    kw = dict(with_init=True, return_state=True, chunk_size=C)
    got = _run(spec, ins, st, cu, packed=True, **kw)
    assert got[0][0].dtype == torch.float32
    _compare(spec, got, _run(spec, ins, st, cu, packed=False, **kw), atol=2e-5, rtol=2e-4)


def test_default_chunk_size_many_documents():
    """The default chunk sizes (64 per head, 32 per channel): every chunk spans many documents."""
    lengths = _MANY + [1, 2, 50]
    cu = _cu(lengths)
    for spec in SPECS:
        ins, st = spec.tensors(int(cu[-1]), len(lengths), torch.Generator().manual_seed(2), F64)
        kw = dict(with_init=True, return_state=True)
        _compare(spec, _run(spec, ins, st, cu, packed=True, **kw), _run(spec, ins, st, cu, packed=False, **kw))


# ---------------------------------------------------------------------------------------------
# The layout: the engine runs on T positions, plus n*D per kind of state asked for.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("states", list(STATES))
def test_layout_length_and_partition(states):
    write, read = STATES[states]
    lengths = [3, 0, 5, 1, 0]
    cu = _cu(lengths)
    T, n = int(cu[-1]), len(lengths)
    lay = varlen_layout(cu, T, D, write_states=write, read_states=read)
    assert lay.total == T + n * D * (int(write) + int(read))
    assert (lay.gather is None) == (not write and not read)  # no state: the inputs are used as they are
    parts = [lay.real] + [p for p in (lay.write, lay.read) if p is not None]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(lay.total))
    assert torch.equal(lay.doc, torch.tensor([0, 0, 0, 2, 2, 2, 2, 2, 3]))
    # the reset of each document sits at its first expanded position; empty documents without
    # inserted positions have none
    per_doc = [L + D * (int(write) + int(read)) for L in lengths]
    firsts = [sum(per_doc[:j]) for j in range(n) if per_doc[j] > 0]
    assert torch.nonzero(lay.resets[:, 0]).flatten().tolist() == firsts


def test_segment_sums():
    cu = _cu([2, 0, 3])
    lay = varlen_layout(cu, 5, 1, write_states=False, read_states=False)
    x = torch.arange(1.0, 6.0, dtype=F64).view(1, 1, 5, 1)
    init = torch.tensor([10.0, 20.0, 30.0], dtype=F64).view(3, 1, 1)
    assert segment_cumsum(x, lay, initial=init).flatten().tolist() == [11, 13, 33, 37, 42]
    assert segment_sum(x, lay, initial=init).flatten().tolist() == [13, 20, 42]


@pytest.mark.parametrize("lengths", [[5, 0, 3], [64], [63, 1, 64, 0, 64], [4133], [1, 4000, 0, 100, 32],
                                     [64 * 64 * 2 + 5, 3, 64 * 70], [0, 0, 9000, 1]])
def test_segment_cumsum_equals_its_reference_through_every_level(lengths):
    """Documents within one block, across blocks, and across blocks of blocks (T past 64 * 64: a
    third level), empty ones, boundaries on a block's edge: values and the gradients of x and of
    the initial sums, float64."""
    g = torch.Generator().manual_seed(len(lengths))
    cu = _cu(lengths)
    T, n = int(cu[-1]), len(lengths)
    lay = varlen_layout(cu, T, 1, write_states=False, read_states=False)
    x = torch.randn(1, 2, T, 3, dtype=F64, generator=g, requires_grad=True)
    init = torch.randn(n, 2, 3, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(1, 2, T, 3, dtype=F64, generator=g)
    got, want = segment_cumsum(x, lay, initial=init), segment_cumsum_reference(x, cu, initial=init)
    assert (got - want).abs().max() <= 1e-12 * max(1.0, float(want.abs().max()))
    for a, b in zip(torch.autograd.grad((got * w).sum(), (x, init)), torch.autograd.grad((want * w).sum(), (x, init))):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max()))


def test_packed_forms_on_the_accelerator_launch_alike_at_any_length():
    """Every chunked form of bench gpu on packed documents, the accelerator strategy: prefill and
    training from ``.sum()`` (a cotangent of strides 0) launch within 1.2x from T = 1024 to 4096.
    Two grew with T before: causal linear attention's normaliser sums looped over blocks of 64
    positions (prefill 282 launches at T = 4096, 673 at 16384), and Mamba-2's SSD route read the
    broadcast cotangent as it was, which a CPU's bmm copied matrix by matrix (train 426, 1207)."""
    from linattn.bench.gpu import KERNEL_FORMS, form_function, form_projection, make_inputs, widths
    from linattn.bench.launches import count_launches

    for name, form in KERNEL_FORMS.items():
        heads, head_dim, state = widths(form, True)
        counts = {"prefill": [], "train": []}
        for T in (1024, 4096):
            tensors = make_inputs(form, T, heads, head_dim, dtype=torch.float32, device=torch.device("cpu"),
                                  state=state)
            fn = form_function(form, strategy="accelerator", projection=form_projection(form, head_dim),
                               cu_seqlens=torch.tensor([0, 300, T // 2, T - 5, T]))

            def prefill():
                with torch.no_grad():
                    fn(*tensors)

            def train():
                for t in tensors:
                    t.grad = None
                fn(*tensors).sum().backward()
            prefill()
            counts["prefill"].append(count_launches(prefill).total)
            for t in tensors:
                t.requires_grad_(t.is_floating_point())
            train()
            counts["train"].append(count_launches(train).total)
        for pass_, (small, large) in counts.items():
            assert large <= 1.2 * small, (name, pass_, small, large)


def test_empty_inputs():
    """Every document empty: outputs (1, H, 0, Dv); returned states are the initial ones (or zeros)."""
    cu = torch.zeros(3, dtype=torch.int64)
    q, k, v = torch.randn(1, H, 0, D), torch.randn(1, H, 0, D), torch.randn(1, H, 0, DV)
    s0 = torch.randn(2, H, D, DV)
    out, st = gated_linear_attention(q, k, v, torch.zeros(1, H, 0), cu_seqlens=cu, initial_state=DecayedState(s0),
                                     return_state=True)
    assert out.shape == (1, H, 0, DV)
    assert_close(st.s, s0, msg="state")
    out, st = delta_rule_attention(q, k, v, torch.zeros(1, H, 0), cu_seqlens=cu, return_state=True)
    assert out.shape == (1, H, 0, DV) and st.s.shape == (2, H, D, DV) and not st.s.any()
    out = gated_linear_attention(q, k, v, torch.zeros(1, H, 0), cu_seqlens=cu)
    assert out.shape == (1, H, 0, DV)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _all_calls(T=6):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, T, D, generator=g) for _ in range(2))
    v = torch.randn(1, H, T, DV, generator=g)
    z = torch.zeros(1, H, T)
    return [
        lambda cu, **kw: gated_linear_attention(q, k, v, z, cu_seqlens=cu, **kw),
        lambda cu, **kw: delta_rule_attention(q, k, v, z, cu_seqlens=cu, **kw),
        lambda cu, **kw: linear_attention(q, k, v, causal=True, cu_seqlens=cu, **kw),
    ]


@pytest.mark.parametrize("cu,err,match", [
    (torch.tensor([0, 4, 2, 6]), ValueError, r"non-decreasing.*cu_seqlens\[1\] = 4 > cu_seqlens\[2\] = 2"),
    (torch.tensor([1, 3, 6]), ValueError, "start at 0"),
    (torch.tensor([0, 3, 5]), ValueError, r"end at T = 6"),
    (torch.tensor([0.0, 3.0, 6.0]), TypeError, r"integer dtype.*torch.float32"),
    (torch.tensor([True, True]), TypeError, r"integer dtype.*torch.bool"),
    (torch.tensor([1, 3, 6], dtype=torch.int32), ValueError, "start at 0"),
    (torch.tensor([0, 4, 2, 6], dtype=torch.int16), ValueError, r"non-decreasing"),
    (torch.tensor([[0, 3, 6]]), ValueError, "1-D"),
    (torch.tensor([0]), ValueError, "1-D"),
    ([0, 3, 6], TypeError, "tensor"),
])
def test_bad_cu_seqlens(cu, err, match):
    for call in _all_calls():
        with pytest.raises(err, match=match):
            call(cu)


def test_batch_size_must_be_one():
    q, k, v = torch.randn(2, H, 6, D), torch.randn(2, H, 6, D), torch.randn(2, H, 6, DV)
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match=r"batch size must be 1.*\(2, 2, 6, 5\)"):
        gated_linear_attention(q, k, v, torch.zeros(2, H, 6), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"batch size must be 1.*\(2, 2, 6, 5\)"):
        delta_rule_attention(q, k, v, torch.zeros(2, H, 6), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"batch size must be 1.*\(2, 2, 6, 5\)"):
        linear_attention(q, k, v, causal=True, cu_seqlens=cu)


def test_initial_state_needs_one_per_document():
    cu = _cu([2, 4])  # two documents
    gated, delta, linear = _all_calls()
    wrong = DecayedState(torch.zeros(1, H, D, DV))
    with pytest.raises(ValueError, match=r"initial_state.s must have shape \(B, H, D, Dv\) = \(2, 2, 5, 3\)"):
        gated(cu, initial_state=wrong)
    with pytest.raises(ValueError, match=r"initial_state.s must have shape \(B, H, D, Dv\) = \(2, 2, 5, 3\)"):
        delta(cu, initial_state=wrong)
    with pytest.raises(ValueError, match=r"initial_state.S must have shape \(2, 2, 5, 3\)"):
        linear(cu, initial_state=LinearAttentionState(torch.zeros(3, H, D, DV), torch.zeros(3, H, D)))


def test_linear_bidirectional_has_no_packed_form():
    q = torch.randn(1, H, 6, D)
    with pytest.raises(ValueError, match="cu_seqlens.*causal=True"):
        linear_attention(q, q, q, causal=False, cu_seqlens=_cu([2, 4]))
