"""linattn as the engine of Hugging Face transformers' Gated DeltaNet, KDA and Mamba-2 (SSD) layers
(linattn.integrations.transformers), family by family, on small random models built with each
family's own config class: against transformers' own PyTorch path (float32: its recurrences compute
in float32 whatever the model's dtype), against linattn's float64 reference recurrence plugged in the
same way, greedy generation through transformers' cache, packed documents, bf16, training, and the
sentinels that fail when a transformers upgrade moves what the route relies on."""

import glob
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")  # installed by `make setup`

from linattn.integrations import transformers as lt  # noqa: E402
from linattn.integrations.transformers.route import check_layer  # noqa: E402

FAMILIES = list(lt.FAMILIES)
KDA = [name for name, f in lt.FAMILIES.items() if f.rule == "kda"]
SSD = [name for name, f in lt.FAMILIES.items() if f.rule == "ssd"]
# transformers' fused MoE (grouped_mm) has no float64 kernel: float64 models run its eager experts
F64 = dict(dtype=torch.float64, experts_implementation="eager")
# GLM5-Next's full-attention layers (its sparse "indexed" attention, top-k keys) neither keep packed
# documents apart nor give the same tokens with and without a cache, in transformers itself: its
# packed check runs on linear layers only, and its generation is held to transformers' cached one
LINEAR_ONLY = {"glm5_next": ("linear_attention", "linear_attention", "linear_attention"),
               # GraniteMoeHybrid's attention layers mix packed documents in transformers itself (an
               # attention-only model of it: 0.67 of the logits' scale in float64)
               "granitemoehybrid": ("linear_attention", "linear_attention", "linear_attention")}
# Mamba2ForCausalLM neither passes the model's keyword arguments (cu_seq_lens_q) to its backbone nor
# names its cache past_key_values: packed documents go through the backbone, the cache is cache_params
THROUGH_BACKBONE = {"mamba2"}


def _logits(model, ids, **kwargs):
    """``model``'s logits for ``ids``; a Mamba-2 model's through its backbone, which passes ``kwargs``
    (packed documents' offsets) down to the mixers as its causal LM does not."""
    if model.config.model_type in THROUGH_BACKBONE:
        return model.lm_head(model.backbone(ids, **kwargs).last_hidden_state)
    return model(ids, **kwargs).logits


def _cache(out):
    return out.cache_params if hasattr(out, "cache_params") else out.past_key_values


def _cache_kw(model, cache) -> dict:
    return {"cache_params" if model.config.model_type == "mamba2" else "past_key_values": cache}
CACHE_CHANGES_TOKENS = {"glm5_next"}


@pytest.fixture(autouse=True)
def _no_leftover_patch():
    yield
    lt.disable()


def _pair(name: str, *, form: str = "chunked", seed: int = 0, config=None, **kwargs):
    """transformers' own model and the same weights on linattn (``form``), from ``from_config``."""
    config = config or lt.small_config(name)
    torch.manual_seed(seed)
    theirs = lt.causal_lm(config, **kwargs)
    with lt.enabled(form=form):
        ours = lt.causal_lm(config, **kwargs)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _rel(a, b, scale=None):
    scale = a.abs().max() if scale is None else scale
    return float((a - b).abs().max() / scale)


def _assert_same(a_logits, a_grads, b_logits, b_grads, tol):
    """Logits within ``tol`` of their scale; every parameter's gradient within ``tol`` of the
    model's largest gradient. Not of its own scale: the decay parameters' gradients (A_log,
    dt_bias) of a random model are sums that cancel to 1e-7 of the largest, where float32 rounding
    alone moves them by 5-40% in transformers' path and ours (measured against float64); the float64
    test below holds them to 1e-10 of their own scale."""
    assert a_grads.keys() == b_grads.keys()
    assert _rel(a_logits, b_logits) <= tol, ("logits", _rel(a_logits, b_logits))
    top = max(g.abs().max() for g in a_grads.values())
    worst = max((_rel(a_grads[n], b_grads[n], top), n) for n in a_grads)
    assert worst[0] <= tol, worst


def _assert_exact(a_logits, a_grads, b_logits, b_grads, tol):
    """As :func:`_assert_same`, but every gradient within ``tol`` of its own scale, or of 1e-4 of
    the largest gradient for those below that: the decay parameters' gradients of the last layers
    are sums that cancel to 1e-8 of the largest, where float64's own rounding of the terms is
    already ~1e-8 of the sum."""
    assert a_grads.keys() == b_grads.keys()
    assert _rel(a_logits, b_logits) <= tol, ("logits", _rel(a_logits, b_logits))
    top = max(g.abs().max() for g in a_grads.values())
    worst = max((_rel(a_grads[n], b_grads[n], max(a_grads[n].abs().max(), 1e-4 * top)), n) for n in a_grads)
    assert worst[0] <= tol, worst


@pytest.mark.parametrize("name", FAMILIES)
def test_patch_takes_effect_and_matches_transformers_float32(name):
    theirs, ours = _pair(name)
    n_linear = sum(isinstance(m, lt.replacement_class(name).__mro__[1]) for m in theirs.modules())
    assert n_linear >= 3  # (Falcon-H1's and Zamba2's hybrid layers hold a mixer too)
    assert sum(isinstance(m, lt.replacement_class(name)) for m in ours.modules()) == n_linear
    assert not any(type(m).__name__.startswith("Linattn") for m in theirs.modules())
    ids = torch.randint(3, 99, (2, 37), generator=torch.Generator().manual_seed(1))
    _assert_same(*_loss_and_grads(theirs, ids), *_loss_and_grads(ours, ids), tol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_float64_equals_the_reference_recurrence(name):
    _, chunked = _pair(name, **F64)
    _, reference = _pair(name, form="reference", **F64)
    assert any(type(m).__name__.startswith("LinattnReference") for m in reference.modules())
    ids = torch.randint(3, 99, (2, 21), generator=torch.Generator().manual_seed(2))
    # The issue asks for 1e-10; 2e-11 also catches the engine's log-decay gradient losing digits
    # to cancellation (Qwen4-exp's was 7.8e-11 when the backward summed dE o E's two parts apart,
    # docs/benchmarks/README.md, History; every family is at most 4.8e-12 since)
    _assert_exact(*_loss_and_grads(reference, ids), *_loss_and_grads(chunked, ids), tol=2e-11)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_generate_with_the_cache(name):
    theirs, ours = _pair(name)
    prompt = torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        want = theirs.generate(prompt, **kw)
        got = ours.generate(prompt, **kw)
        uncached = ours.generate(prompt, use_cache=False, **kw)
    assert torch.equal(got, want)
    if name not in CACHE_CHANGES_TOKENS:
        assert torch.equal(got, uncached)
    # the decoding steps ran linattn's recurrence through transformers' cache: the cache holds the
    # states linattn wrote, equal to a cache-less prefill of the whole sequence's final states
    with torch.no_grad():
        cache = _cache(ours(got, use_cache=True))
        step = _cache(ours(got[:, :-1], use_cache=True))
        ours(got[:, -1:], **_cache_kw(ours, step), use_cache=True)
    layer = next(m for m in ours.modules() if isinstance(m, lt.replacement_class(name))).layer_idx
    assert _rel(cache.get_recurrent_state(layer), step.get_recurrent_state(layer)) < 1e-5


PACKED_LENGTHS = [5, 1, 9, 4, 7]  # a one-token document and documents shorter than the convolution


def _packed_batch(lengths, generator):
    """Random documents of ``lengths`` and the keyword arguments of their packed batch (one row),
    as transformers' flattening collator gives them (``position_ids`` and ``cu_seq_lens_*``)."""
    docs = [torch.randint(3, 99, (1, n), generator=generator) for n in lengths]
    cu = torch.tensor([0] + list(lengths)).cumsum(0)
    return docs, dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None], cu_seq_lens_q=cu,
                      cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths), use_cache=False)


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_documents_equal_one_by_one_and_transformers_does_not(name):
    layers = LINEAR_ONLY.get(name, lt.SMALL_LAYER_TYPES)
    theirs, ours = _pair(name, config=lt.small_config(name, layer_types=layers), **F64)
    g = torch.Generator().manual_seed(4)
    docs, packed = _packed_batch(PACKED_LENGTHS, g)
    cu = packed["cu_seq_lens_q"]
    with torch.no_grad():
        alone = torch.cat([_logits(ours, d, use_cache=False)[0] for d in docs])
        got = _logits(ours, torch.cat(docs, 1), **packed)[0]
        # gates compute in float32 whatever the model's dtype: equal up to float32 rounding
        assert _rel(alone, got) <= 1e-6
        try:
            wrong = _rel(alone, _logits(theirs, torch.cat(docs, 1), **packed)[0])
        except ValueError as err:  # Qwen's and OLMo's layers refuse packed inputs without fla
            assert "flash-linear-attention" in str(err)
        else:  # Kimi's, GLM5's, Bailing's and every Mamba-2 family's carry the state (and the
            # convolution) from one document into the next: far above float32's rounding (Falcon-H1's
            # small model mixes least, 5e-4)
            assert wrong > 1e-4
    # a packed forward given a fresh cache (a model makes one whenever config.use_cache is on,
    # training included) runs as without one and leaves the layer's states unset
    layer = next(m for m in ours.modules() if isinstance(m, lt.replacement_class(name)))
    h = torch.randn(1, int(cu[-1]), layer.hidden_size, dtype=torch.float64, generator=g)
    cache = transformers.DynamicCache(config=ours.config.get_text_config())
    with torch.no_grad(), pytest.warns(UserWarning, match="Pass use_cache=False with packed batches"):
        assert torch.equal(layer(h, cu_seq_lens_q=cu), layer(h, cache_params=cache, cu_seq_lens_q=cu))
    assert cache.get_recurrent_state(layer.layer_idx) is None


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])  # a Gated DeltaNet and a KDA family
def test_a_training_step_on_the_flattening_collators_batch_is_each_documents_alone(name):
    """transformers' own packing tool, as a user trains with it: DataCollatorWithFlattening's int32
    cu_seq_lens_* and position_ids, its labels (-100 at each document's first token), the model's
    own loss, one SGD step. The packed step equals the step on each document alone with its
    tokens' losses summed in the packed loss's weights: the loss, every gradient, every updated
    weight. Full-attention layers included (no cache: see the packed-cache test)."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(3, 99, (n,), generator=g).tolist() for n in PACKED_LENGTHS]
    batch = collator([{"input_ids": d} for d in docs])
    assert batch["cu_seq_lens_q"].dtype == torch.int32  # what the collator gives, not converted here
    _, packed = _pair(name, **F64)
    _, alone = _pair(name, **F64)

    def step(model, loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        return loss.item(), grads

    got_loss, got = step(packed, packed(**batch, use_cache=False).loss)
    weights = [len(d) - 1 for d in docs]  # the predicted tokens of each document
    total = sum(alone(torch.tensor([d]), labels=torch.tensor([d]), use_cache=False).loss * w
                for d, w in zip(docs, weights) if w) / sum(weights)
    want_loss, want = step(alone, total)
    assert abs(got_loss - want_loss) <= 1e-6 * abs(want_loss)
    assert got.keys() == want.keys()
    scale = max(float(t.abs().max()) for t in want.values())
    for n in want:
        assert _rel(want[n], got[n], scale) <= 1e-6, n
    for (n, a), b in zip(packed.named_parameters(), alone.parameters()):
        a, b = a.detach(), b.detach()
        assert _rel(b, a, max(float(b.abs().max()), 1e-12)) <= 1e-6, n


def test_a_packed_forward_with_a_cache_warns_and_its_cache_cannot_be_continued():
    """With use_cache=True (transformers' default) transformers' full-attention layers ignore the
    packing; linattn says so, and refuses to decode from the cache such a forward filled."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    batch = collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11]}])
    theirs, ours = _pair("qwen3_5", **F64)
    with pytest.warns(UserWarning, match="Pass use_cache=False with packed batches"):
        out = ours(**batch, use_cache=True)
    with pytest.raises(ValueError, match="went through a packed forward"):
        ours(torch.tensor([[12]]), past_key_values=out.past_key_values, use_cache=True)
    # what the warning says: with a cache transformers' full-attention layers attend across the
    # documents (a model of full-attention layers only, linattn not involved)
    full = lt.small_config("qwen3_5", layer_types=("full_attention",))
    torch.manual_seed(0)
    attention_only = lt.causal_lm(full, **F64)
    with torch.no_grad():
        without = attention_only(**batch, use_cache=False).logits
        alone = torch.cat([attention_only(torch.tensor([d])).logits for d in ([5, 6, 7], [8, 9, 10, 11])], 1)
        cached = attention_only(**batch, use_cache=True).logits
    assert _rel(alone, without) <= 1e-12 and _rel(alone, cached) > 1e-3


@pytest.mark.parametrize("bad,match", [
    (torch.tensor([1, 3, 8]), r"cu_seq_lens_q must start at 0, got 1"),
    (torch.tensor([0, 3, 7]), r"cu_seq_lens_q must end at T = 8 .*hidden_states \(1, 1, 8, 64\).*got 7"),
    (torch.tensor([0, 5, 3, 8]), r"cu_seq_lens_q must be non-decreasing, got cu_seq_lens_q\[1\] = 5 > "),
    (torch.tensor([0, 3, 8], dtype=torch.int16), None),  # any integer dtype is taken
    (torch.tensor([0.0, 3.0, 8.0]), r"cu_seq_lens_q must have an integer dtype .*got torch.float32"),
    (torch.tensor([[0, 3, 8]]), r"cu_seq_lens_q must be 1-D"),
])
def test_bad_packed_offsets_are_named_before_any_work(bad, match):
    """Every linear layer checks cu_seq_lens_q before its projections and convolution (they used to
    fail inside the convolution's repeat_interleave with torch's own messages)."""
    _, ours = _pair("qwen3_5", config=lt.small_config("qwen3_5", layer_types=("linear_attention",)))
    layer = next(m for m in ours.modules() if isinstance(m, lt.replacement_class("qwen3_5")))
    h = torch.randn(1, 8, layer.hidden_size)
    if match is None:
        assert torch.equal(layer(h, cu_seq_lens_q=bad), layer(h, cu_seq_lens_q=bad.long()))
        return
    calls = []
    hook = layer.in_proj_qkv.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises((ValueError, TypeError), match=match):
        layer(h, cu_seq_lens_q=bad)
    hook.remove()
    assert not calls  # refused before the first projection


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_inference_is_finite_and_close_to_float32(name):
    # GLM5-Next's full-attention layers select top-k keys: a rounding anywhere flips some choices,
    # so its whole model in bfloat16 lands 0.006-0.09 from float32 on transformers' own path too
    # (seeds 0-2): its linear layers are what is measured here
    _, ours = _pair(name, config=lt.small_config(name, layer_types=LINEAR_ONLY[name]) if name == "glm5_next" else None)
    ids = torch.randint(3, 99, (2, 29), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ours(ids, use_cache=False).logits
        got = ours.to(torch.bfloat16)(ids, use_cache=False).logits.float()
    assert torch.isfinite(got).all()
    assert _rel(want, got) < 0.05  # bf16's 8 bits of mantissa, through 4 layers


@pytest.mark.parametrize("name", FAMILIES)
def test_a_few_optimizer_steps_lower_the_loss(name):
    _, ours = _pair(name)
    ids = torch.randint(3, 99, (4, 33), generator=torch.Generator().manual_seed(6))
    opt = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = ours(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_under_full_determinism_calls_nothing_cuda_refuses(name):
    """transformers' full_determinism (torch.use_deterministic_algorithms(True)) on a GPU: a training
    step of every family on linattn calls no op that CUDA refuses then (a floating cumsum raised
    there, from linattn's engines); with every uninitialised float NaN, its loss and gradients are
    those of the same step without it. The experts run eagerly: transformers' grouped MoE kernels
    (histc, cumsum) are refused there too, by transformers' own code."""
    from probes import OpProbe, deterministic_algorithms

    _, ours = _pair(name, experts_implementation="eager")
    ids = torch.randint(3, 99, (2, 37), generator=torch.Generator().manual_seed(8))
    logits, grads = _loss_and_grads(ours, ids)
    with deterministic_algorithms(), OpProbe(engines=True) as p:
        det_logits, det_grads = _loss_and_grads(ours, ids)
    assert not p.cuda_refusals, dict(p.cuda_refusals)
    assert all(torch.isfinite(g).all() for g in det_grads.values())
    _assert_same(logits, grads, det_logits, det_grads, 1e-5)


def test_saved_model_loads_without_linattn(tmp_path):
    _, ours = _pair("qwen3_5")
    ours.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(type(m).__name__.startswith("Linattn") for m in loaded.modules())
    assert ours.state_dict().keys() == loaded.state_dict().keys()
    ids = torch.randint(3, 99, (1, 17), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert _rel(ours(ids).logits, loaded(ids).logits) < 1e-5
    with lt.enabled():  # and from_pretrained after enable() builds linattn's layers
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert sum(isinstance(m, lt.replacement_class("qwen3_5")) for m in again.modules()) == 3
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, again(ids).logits)


def test_enable_disable_and_the_context_manager():
    config = lt.small_config("kimi_linear")
    assert not lt.is_enabled()
    lt.enable()
    assert lt.is_enabled() and lt.is_enabled("kimi_linear")
    assert any(isinstance(m, lt.replacement_class("kimi_linear")) for m in lt.causal_lm(config).modules())
    lt.disable()
    assert not lt.is_enabled()
    assert not any(type(m).__name__.startswith("Linattn") for m in lt.causal_lm(config).modules())
    with lt.enabled(model_types=("kimi_linear",)):
        assert lt.is_enabled("kimi_linear") and not lt.is_enabled("qwen3_5")
    assert not lt.is_enabled()
    model = lt.causal_lm(config)
    assert lt.attach(model) == 3 and lt.detach(model) == 3


def test_attach_switches_a_built_model_and_detach_restores_it():
    theirs, _ = _pair("olmo_hybrid")
    ids = torch.randint(3, 99, (1, 19), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = theirs(ids).logits
        lt.attach(theirs)
        assert any(type(m).__name__.startswith("Linattn") for m in theirs.modules())
        got = theirs(ids).logits
        lt.detach(theirs)
    assert not any(type(m).__name__.startswith("Linattn") for m in theirs.modules())
    assert 0 < _rel(want, got) < 1e-5  # ran a different engine, to the same result


def test_unsupported_models_and_options_are_named():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="LlamaForCausalLM has no linear-attention layer"):
        lt.attach(llama)
    with pytest.raises(ValueError, match="unsupported model type 'mamba'"):
        lt.enable(model_types=("mamba",))
    with pytest.raises(TypeError, match=r"model_types must be a tuple of model type names, e.g. \('qwen3_5',\).*"
                                        r"got the str 'qwen3_5'"):
        lt.enable(model_types="qwen3_5")
    with pytest.raises(TypeError, match="model_types must hold model type names"):
        lt.enable(model_types=(3,))
    with pytest.raises(ValueError, match="form must be one of"):
        lt.enable(form="fast")
    with pytest.raises(ValueError, match="kimi_linear .KDA. has no grouped value heads"):
        lt.small_config("kimi_linear", key_heads=2)
    _, ours = _pair("qwen3_next")
    cache = ours(torch.randint(3, 99, (1, 6)), use_cache=True).past_key_values
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="cu_seq_lens_q .3,.. cannot continue a cache"):
        ours(torch.randint(3, 99, (1, 5)), past_key_values=cache, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
             max_length_q=3, max_length_k=3, position_ids=torch.tensor([[0, 1, 0, 1, 2]]))


def test_someone_elses_patch_is_not_overwritten():
    from transformers.monkey_patching import register_patch_mapping, unregister_patch_mapping

    class Other(torch.nn.Module):
        pass

    register_patch_mapping({"KimiLinearDeltaAttention": Other})
    try:
        with pytest.raises(ValueError, match="already has a patch registered by someone else"):
            lt.enable()
    finally:
        unregister_patch_mapping(["KimiLinearDeltaAttention"])


# ---------------------------------------------------------------------------------------------
# Sentinels: fail the day a transformers upgrade moves what the route relies on
# ---------------------------------------------------------------------------------------------


def test_every_installed_model_with_a_delta_rule_or_ssd_layer_is_supported():
    """Any modeling file of the installed transformers that defines a gated delta rule, KDA or
    Mamba-2 SSD scan function belongs to a supported family, and each family's layer class is where
    we look."""
    root = os.path.dirname(transformers.__file__)
    found = set()
    for path in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(path, encoding="utf-8") as f:
            if re.search(r"^def (torch_chunk_gated_delta_rule|chunk_kimi_delta_attention|mamba2_chunk_scan)\(",
                         f.read(), re.M):
                found.add(os.path.basename(os.path.dirname(path)))
    assert found == set(lt.FAMILIES), found ^ set(lt.FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_layer_still_has_what_the_forward_reads(name):
    """The replacement checks the layer's attributes when it is built; here the check itself is
    held to the original class (a removed attribute would otherwise only fail at build time), and
    the patch mapping entry is transformers' own, applied at from_config."""
    from transformers.monkey_patching import get_patch_mapping

    family = lt.FAMILIES[name]
    with lt.enabled(model_types=(name,)):
        assert get_patch_mapping()[family.layer] is lt.replacement_class(name)
        model = lt.causal_lm(lt.small_config(name))
    layer = next(m for m in model.modules() if isinstance(m, lt.replacement_class(name)))
    assert type(layer).__mro__[1].__name__ == family.layer
    for attribute in family.needs:
        assert hasattr(layer, attribute), attribute
    delattr(layer, family.needs[0])
    with pytest.raises(TypeError, match=f"{family.layer} has no {family.needs[0]}"):
        check_layer(layer)


def test_import_linattn_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, linattn, linattn.integrations, linattn.functional; "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
def test_delta_rule_is_a_drop_in_for_transformers_function(name):
    """``lt.delta_rule`` against the function the family's layer calls, with q/k normalisation in
    the kernel (rows of small norm among them, where eps inside the root matters), an initial state
    and the final state, grouped value heads for the gated delta rule: outputs, state and every
    input's gradient."""
    import importlib

    module = importlib.import_module(lt.FAMILIES[name].module)
    kda = lt.FAMILIES[name].rule == "kda"
    theirs = module.chunk_kimi_delta_attention if kda else module.torch_chunk_gated_delta_rule
    g = torch.Generator().manual_seed(9)
    B, N, Hk, H, D = 2, 45, (3 if kda else 1), 3, 16
    q, k = (torch.randn(B, N, Hk, D, generator=g) for _ in range(2))
    q[:, :3] *= 1e-4
    k[:, 5:8] *= 1e-4
    v = torch.randn(B, N, H, D, generator=g)
    decay = -torch.rand(B, N, H, *((D,) if kda else ()), generator=g)
    beta = torch.rand(B, N, H, generator=g)
    s0 = torch.randn(B, H, D, D, generator=g)
    inputs = [t.requires_grad_() for t in (q, k, v, decay, beta)]
    want, want_s = theirs(q, k, v, g=decay, beta=beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    got, got_s = lt.delta_rule(q, k, v, decay, beta, initial_state=s0, output_final_state=True)
    assert _rel(want, got) < 1e-5 and _rel(want_s, got_s) < 1e-5
    w, ws = torch.randn(want.shape, generator=g), torch.randn(want_s.shape, generator=g)
    theirs_grads = torch.autograd.grad((want * w).sum() + (want_s * ws).sum(), inputs)
    ours_grads = torch.autograd.grad((got * w).sum() + (got_s * ws).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), theirs_grads, ours_grads):
        assert _rel(a, b) < 1e-5, name
