"""The Mamba-2 families on linattn (linattn.integrations.transformers, rule "ssd"): what the family-wide
tests of tests/test_transformers_integration.py do not reach. The SSD scan against the function the
mixers call, every config option that changes the mixer's formula (dt limits that bind, Falcon-H1's
norm switched off or before the gate, its muP multipliers), packed documents given as ``seq_idx``,
and bad packing arguments."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")  # installed by `make setup`

from linattn.integrations import transformers as lt  # noqa: E402
from test_transformers_integration import _loss_and_grads  # noqa: E402  (the family tests' own helpers)
from test_transformers_integration import _pair as _family_pair  # noqa: E402

F64 = dict(dtype=torch.float64, experts_implementation="eager")


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    yield
    lt.disable()


def _rel(a, b, scale=None):
    scale = a.abs().max() if scale is None else scale
    return float((a - b).detach().abs().max() / scale)


def _pair(name, config, *, form="chunked", **kwargs):
    return _family_pair(name, config=config, form=form, **kwargs)


@pytest.mark.parametrize("limit", [(0.0, math.inf), (0.05, 0.3)])
def test_ssd_is_a_drop_in_for_transformers_scan(limit):
    """``lt.ssd`` against transformers' ``mamba2_chunk_scan`` (what every mixer calls without
    mamba_ssm): grouped B and C, D, dt_bias and softplus, a dt limit that binds or not, an initial
    state and the final state, N not a multiple of its chunk; outputs, state and every input's
    gradient."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    g = torch.Generator().manual_seed(1)
    Bsz, N, H, G, P, Ds = 2, 45, 6, 2, 8, 12
    x = torch.randn(Bsz, N, H, P, generator=g)
    dt = torch.randn(Bsz, N, H, generator=g)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    b, c = (torch.randn(Bsz, N, G, Ds, generator=g) for _ in range(2))
    D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5
    s0 = torch.randn(Bsz, H, P, Ds, generator=g)
    inputs = [t.requires_grad_() for t in (x, dt, A, b, c, D, dt_bias, s0)]
    want, want_s = mamba2_chunk_scan(x, dt, A, b, c, chunk_size=8, D=D, dt_bias=dt_bias, initial_states=s0,
                                     dt_softplus=True, dt_limit=limit, return_final_states=True)
    got, got_s = lt.ssd(x, dt, A, b, c, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit, initial_state=s0,
                        output_final_state=True)
    assert got.shape == want.shape and got_s.shape == want_s.shape
    assert _rel(want, got) < 1e-5 and _rel(want_s, got_s) < 1e-5
    w, ws = torch.randn(want.shape, generator=g), torch.randn(want_s.shape, generator=g)
    theirs = torch.autograd.grad((want * w).sum() + (want_s * ws).sum(), inputs)
    ours = torch.autograd.grad((got * w).sum() + (got_s * ws).sum(), inputs)
    for name, a, o in zip("x dt A B C D dt_bias initial_state".split(), theirs, ours):
        if name != "A":
            assert _rel(a, o) < 1e-5, name
    # A's gradient sums every position's log-decay gradient times dt; at these strong decays (steps
    # of exp(-6)) the engine's log-decay gradient loses more digits than transformers' autograd
    # through its segment sums: against float64, 1.5e-5 of its scale without a limit (transformers
    # 4.7e-7), 1.6e-6 with one. Held to 3e-5 of float64's here, the gap written down, not hidden
    f64 = [t.detach().double().requires_grad_() for t in inputs]
    exact, exact_s = lt.ssd(*f64[:5], D=f64[5], dt_bias=f64[6], dt_softplus=True, dt_limit=limit,
                            initial_state=f64[7], output_final_state=True, form="reference")
    exact_a = torch.autograd.grad((exact * w.double()).sum() + (exact_s * ws.double()).sum(), f64[2])[0]
    assert _rel(exact_a, ours[2].double()) < 3e-5


def test_ssd_reference_form_and_float64():
    """The reference form (a loop over positions) and the chunked form agree in float64, packed
    documents too (the reference one document at a time)."""
    g = torch.Generator().manual_seed(2)
    Bsz, N, H, G, P, Ds = 1, 30, 4, 1, 5, 7
    x = torch.randn(Bsz, N, H, P, generator=g, dtype=torch.float64)
    dt = torch.randn(Bsz, N, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64) - 0.1
    b, c = (torch.randn(Bsz, N, G, Ds, generator=g, dtype=torch.float64) for _ in range(2))
    kw = dict(D=torch.randn(H, generator=g, dtype=torch.float64), dt_softplus=True)
    chunked, s1 = lt.ssd(x, dt, A, b, c, output_final_state=True, **kw)
    reference, s2 = lt.ssd(x, dt, A, b, c, output_final_state=True, form="reference", **kw)
    assert chunked.dtype == torch.float64
    assert _rel(reference, chunked) < 1e-12 and _rel(s2, s1) < 1e-12
    cu = torch.tensor([0, 7, 8, 19, 30])
    packed = lt.ssd(x, dt, A, b, c, cu_seqlens=cu, **kw)[0]
    packed_ref = lt.ssd(x, dt, A, b, c, cu_seqlens=cu, form="reference", **kw)[0]
    alone = torch.cat([lt.ssd(x[:, i:j], dt[:, i:j], A, b[:, i:j], c[:, i:j], **kw)[0]
                       for i, j in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    assert _rel(alone, packed) < 1e-12 and _rel(alone, packed_ref) < 1e-12


OPTIONS = [
    ("mamba2", dict(time_step_limit=(0.05, 0.3))),  # both limits bind for some positions
    ("nemotron_h", dict(time_step_min=0.02, time_step_limit=(0.02, math.inf))),
    ("falcon_h1", dict(mamba_rms_norm=False)),  # no norm: y * silu(z)
    ("falcon_h1", dict(mamba_norm_before_gate=True)),
    ("bamba", dict(mamba_proj_bias=True, mamba_conv_bias=False)),
    ("zamba2", dict(add_bias_linear=True)),
]


@pytest.mark.parametrize("name,options", OPTIONS, ids=[f"{n}-{'-'.join(o)}" for n, o in OPTIONS])
def test_config_options_match_transformers_and_the_reference(name, options):
    config = lt.small_config(name, **options)
    for key, value in options.items():
        assert getattr(config, key) == value, key
    theirs, ours = _pair(name, config)
    ids = torch.randint(3, 99, (2, 37), generator=torch.Generator().manual_seed(3))
    a_logits, a_grads = _loss_and_grads(theirs, ids)
    b_logits, b_grads = _loss_and_grads(ours, ids)
    assert _rel(a_logits, b_logits) <= 1e-5
    top = max(t.abs().max() for t in a_grads.values())
    assert max(_rel(a_grads[n], b_grads[n], top) for n in a_grads) <= 1e-5
    _, chunked = _pair(name, config, **F64)
    _, reference = _pair(name, config, form="reference", **F64)
    ids = ids[:, :21]
    with torch.no_grad():
        assert _rel(reference(ids).logits, chunked(ids).logits) <= 1e-11
    # decoding applies the dt limit as the prefill does: cached and uncached generation agree
    prompt = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kw), ours.generate(prompt, use_cache=False, **kw))


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid"])
def test_seq_idx_packs_as_cu_seq_lens_q(name):
    """Packed documents given as ``seq_idx`` (the document index of each position, what
    DataCollatorWithFlattening(return_seq_idx=True) adds and mamba_ssm's kernels take) equal the
    documents one by one, and the offsets are read from it once per tensor."""
    config = lt.small_config(name, layer_types=("linear_attention",) * 3)
    _, ours = _pair(name, config, **F64)
    lengths = [5, 1, 9, 4]
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 99, (1, n), generator=g) for n in lengths]
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        alone = torch.cat([ours(d, use_cache=False).logits[0] for d in docs])
        got = ours(torch.cat(docs, 1), seq_idx=seq_idx, use_cache=False).logits[0]
    assert _rel(alone, got) <= 1e-6
    cu = seq_idx._linattn_offsets[1]
    assert cu.tolist() == [0, 5, 6, 15, 19]


def test_flattening_collators_seq_idx_batch_trains_as_documents_alone():
    """transformers' own collator with ``return_seq_idx=True`` (and its flash-attention offsets): the
    packed loss and gradients of a Bamba model (attention layers included) equal the documents' one
    by one."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True,
                                                       return_seq_idx=True)
    g = torch.Generator().manual_seed(6)
    lengths = [5, 1, 9, 4, 7]
    docs = [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
    batch = collator([{"input_ids": d} for d in docs])
    assert "seq_idx" in batch
    config = lt.small_config("bamba")
    _, packed = _pair("bamba", config, **F64)
    _, alone = _pair("bamba", config, **F64)
    loss = packed(**batch, use_cache=False).loss
    weights = [n - 1 for n in lengths]
    want = sum(alone(torch.tensor([d]), labels=torch.tensor([d]), use_cache=False).loss * w
               for d, w in zip(docs, weights) if w) / sum(weights)
    assert abs(loss.item() - want.item()) <= 1e-9 * abs(want.item())
    loss.backward()
    want.backward()
    for (n, a), b in zip(packed.named_parameters(), alone.parameters()):
        assert _rel(b.grad, a.grad, max(float(b.grad.abs().max()), 1e-12)) <= 1e-8, n


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]], dtype=torch.float32), r"seq_idx must be an integer tensor"),
    (torch.tensor([[0, 0, 1, 1, 1, 2, 2]]), r"seq_idx must have shape \(1, N\) = \(1, 8\).*got \(1, 7\)"),
    (torch.tensor([0, 0, 1, 1, 1, 2, 2, 2]), r"seq_idx must have shape \(1, N\)"),
])
def test_bad_seq_idx_is_named_before_any_work(bad, match):
    config = lt.small_config("bamba", layer_types=("linear_attention",))
    _, ours = _pair("bamba", config)
    layer = next(m for m in ours.modules() if isinstance(m, lt.replacement_class("bamba")))
    calls = []
    hook = layer.in_proj.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(1, 8, layer.hidden_size), seq_idx=bad)
    hook.remove()
    assert not calls


def test_nemotron_h_mixer_is_reached_through_its_block():
    """Nemotron-H builds its mixers from a table made at import (``MIXER_TYPES``), which
    transformers' patch mapping cannot change: linattn patches the block instead. The day the table
    goes, the block patch is not needed; the day the block is renamed, this fails."""
    import importlib

    module = importlib.import_module(lt.FAMILIES["nemotron_h"].module)
    assert lt.FAMILIES["nemotron_h"].holder == ("NemotronHBlock", "mixer")
    assert module.MIXER_TYPES["linear_attention"] is module.NemotronHMamba2Mixer
    with lt.enabled(model_types=("nemotron_h",)):
        model = lt.causal_lm(lt.small_config("nemotron_h"))
    mixers = [m for m in model.modules() if isinstance(m, module.NemotronHMamba2Mixer)]
    assert mixers and all(isinstance(m, lt.replacement_class("nemotron_h")) for m in mixers)
    assert lt.detach(model) == len(mixers)
    assert not any(isinstance(m, lt.replacement_class("nemotron_h")) for m in model.modules())
