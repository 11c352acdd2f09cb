"""The gated and delta-rule mechanisms (retnet, gla, deltanet, gated_deltanet) as layers and models:
their papers' recipes against hand-written float64 references, decoding = teacher forcing, hybrids,
checkpoints, training, the command line and the benchmarks' use of them."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import linattn
from conftest import assert_close, assert_decodes_as_teacher_forced
from linattn import TransformerConfig, TransformerEncoder, TransformerLM
from linattn.cli import main
from linattn.functional import DecayedState, delta_rule_attention_reference, gated_linear_attention_reference
from linattn.nn import (
    MECHANISMS,
    DeltaNetConfig,
    GatedDeltaNetConfig,
    GLAConfig,
    KDAConfig,
    LocalConfig,
    MultiHeadAttention,
    RetNetConfig,
    SoftmaxConfig,
    get_mechanism,
)

GATED = {"retnet": RetNetConfig(), "gla": GLAConfig(gate_rank=4), "deltanet": DeltaNetConfig(),
         "gated_deltanet": GatedDeltaNetConfig(), "kda": KDAConfig()}
# the recipe's short convolution of the delta-rule models is the model's (see DeltaNetConfig)
SHORT_CONV = {"retnet": 0, "gla": 0, "deltanet": 4, "gated_deltanet": 4, "kda": 4}


def _heads(t, H):
    B, N, C = t.shape
    return t.view(B, N, H, C // H).transpose(1, 2)  # (B, H, N, D)


def _rms(o, weight):
    eps = 1e-6  # the layer's, whatever the dtype
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight


def _by_hand(mha, x, mask):
    """The layer written out from the papers' formulas around the plain reference recurrences."""
    m, H = mha.mechanism, mha.n_heads
    q, k, v = (_heads(t, H) for t in F.linear(x, mha.in_proj.weight, mha.in_proj.bias).chunk(3, -1))
    name = mha.spec.name
    if name == "retnet":
        gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=x.dtype)
        ld = gamma.log().view(1, H, 1).expand(x.shape[0], H, x.shape[1])
        o = gated_linear_attention_reference(q, k, v, ld, key_padding_mask=mask)
    elif name == "gla":
        alpha = torch.sigmoid(x @ m.decay_down.weight.T @ m.decay_up.weight.T + m.decay_up.bias) ** (1 / 16)
        o = gated_linear_attention_reference(q, k, v, _heads(alpha.log(), H), key_padding_mask=mask)
    else:
        def unit(t):
            t = F.silu(t)
            return t / t.norm(dim=-1, keepdim=True)

        beta = torch.sigmoid(x @ m.beta_proj.weight.T).transpose(1, 2)  # (B, H, N)
        g = None
        if name == "gated_deltanet":
            dt = F.softplus(x @ m.decay_proj.weight.T + m.dt_bias)
            g = (-m.A_log.exp() * dt).transpose(1, 2)
        elif name == "kda":  # one decay per key channel (arXiv 2510.26692, Eq. 10)
            dt = F.softplus(x @ m.decay_down.weight.T @ m.decay_up.weight.T + m.dt_bias)  # (B, N, C)
            g = _heads(dt, H) * -m.A_log.exp().view(1, H, 1, 1)  # (B, H, N, D)
        o = delta_rule_attention_reference(unit(q), unit(k), F.silu(v), beta, log_decay=g, key_padding_mask=mask)
    o = _rms(o, m.out_norm.weight)
    if name == "kda":  # the low-rank sigmoid output gate
        o = o * _heads(torch.sigmoid(x @ m.gate_down.weight.T @ m.gate_up.weight.T), H)
    elif m.gate_proj is not None:
        o = o * _heads(F.silu(F.linear(x, m.gate_proj.weight, m.gate_proj.bias)), H)
    B, _, N, D = o.shape
    return mha.out_proj(o.transpose(1, 2).reshape(B, N, H * D))


@pytest.mark.parametrize("name", list(GATED))
def test_layer_is_its_papers_recipe(name):
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 3, attention=GATED[name]).double()
    for p in mha.parameters():  # away from the initialisation, so that every gate matters
        p.data.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 3:5] = False  # padding in the middle
    got = mha(x, causal=True, key_padding_mask=mask)
    assert_close(got, _by_hand(mha, x, mask), msg=name)


def test_initial_gates_are_the_papers():
    H = 4
    retnet = get_mechanism("retnet").build(n_heads=H, head_dim=8)
    assert torch.allclose(retnet.log_decay.double().exp(), torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256],
                                                                        dtype=torch.float64))
    gdn = get_mechanism("gated_deltanet").build(n_heads=H, head_dim=8)
    a, dt = gdn.A_log.exp(), F.softplus(gdn.dt_bias)
    assert ((1 <= a) & (a <= 16)).all() and ((1e-3 <= dt) & (dt <= 0.1 + 1e-6)).all()
    same = get_mechanism("gated_deltanet").build(n_heads=H, head_dim=8)
    assert torch.equal(same.A_log, gdn.A_log) and torch.equal(same.dt_bias, gdn.dt_bias)  # seeded, not global
    other = get_mechanism("gated_deltanet").build(GatedDeltaNetConfig(seed=1), n_heads=H, head_dim=8)
    assert not torch.equal(other.A_log, gdn.A_log)
    gla = get_mechanism("gla").build(n_heads=H, head_dim=8)
    torch.nn.init.zeros_(gla.decay_up.bias)  # as TransformerLM initialises biases
    x = torch.randn(1, 3, 32)
    assert torch.allclose(gla.log_decay(0 * x).exp(), torch.tensor(0.5 ** (1 / 16)))  # sigmoid(0)^(1/16)
    assert gla.log_decay(x).shape == (1, H, 3, 8)  # one decay per head, position and key channel


def _lm(name, positional="learned", **kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=23, max_len=24, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                            attention=GATED[name], short_conv=SHORT_CONV[name], positional=positional, **kw)
    return TransformerLM(cfg).double().eval()


@pytest.mark.parametrize("name", list(GATED))
def test_step_by_step_equals_teacher_forced_float64(name):
    lm = _lm(name, positional="rotary" if get_mechanism(name).rotary else "sinusoidal")
    ids = torch.randint(0, 23, (2, 17), generator=torch.Generator().manual_seed(1))
    # prefill 10, then decode the rest: the returned state resumes the recurrence
    state, state10 = assert_decodes_as_teacher_forced(lm, ids, 10, msg=name)
    # O(1) state per token: one (B, H, D, D) matrix per layer, the same after 10 and 17 positions
    for s10, s17 in zip(state10.layers, state.layers):
        assert isinstance(s17.mechanism, DecayedState) and s17.mechanism.s.shape == (2, 2, 8, 8)
        assert s10.mechanism.s.shape == s17.mechanism.s.shape


def test_hybrid_with_softmax_and_local_layers_decodes_and_round_trips(tmp_path):
    torch.manual_seed(0)
    layers = {0: SoftmaxConfig(), 1: GATED["gla"], 2: LocalConfig(window=3), 3: GATED["retnet"], 4: GATED["deltanet"]}
    cfg = TransformerConfig(vocab_size=23, max_len=24, d_model=16, n_layers=6, n_heads=2, d_ff=32,
                            attention=GATED["gated_deltanet"], layer_attention=layers, short_conv=3)
    assert cfg.layer_mechanisms() == ["softmax", "gla", "local", "retnet", "deltanet", "gated_deltanet"]
    lm = TransformerLM(cfg).double().eval()
    ids = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = lm(ids)
        assert_close(lm.forward_steps(ids)[0], full, msg="hybrid steps")
    lm.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert "gated_deltanet" in json.dumps(saved) and "retnet" in json.dumps(saved)
    back = TransformerLM.from_pretrained(tmp_path / "ckpt").double().eval()
    assert back.config == cfg
    with torch.no_grad():
        assert torch.equal(back(ids), full)
    # RetNet's decays are a function of H, not saved: rebuilt on load
    assert not any(k.endswith("log_decay") for k in lm.state_dict())


@pytest.mark.parametrize("name", list(GATED))
def test_checkpoint_round_trip(tmp_path, name):
    lm = _lm(name).float()
    for p in lm.parameters():  # not the initialisation, so that a parameter left unsaved shows
        p.data.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 23, (1, 11), generator=torch.Generator().manual_seed(3))
    lm.save_pretrained(tmp_path / name)
    back = TransformerLM.from_pretrained(tmp_path / name).eval()
    with torch.no_grad():
        assert torch.equal(back(ids), lm(ids))


@pytest.mark.parametrize("name", list(GATED))
def test_every_gate_parameter_learns(name):
    lm = _lm(name).float().train()
    ids = torch.randint(0, 23, (2, 16), generator=torch.Generator().manual_seed(4))
    logits = lm(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, 23), ids[:, 1:].reshape(-1)).backward()
    for key, p in lm.named_parameters():
        if ".mechanism." in key:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, key


@pytest.mark.parametrize("name", list(GATED))
def test_training_lowers_the_loss_on_recall_data(tmp_path, name):
    from linattn.train import TrainConfig, train

    cfg = TrainConfig.from_dict(dict(
        model=dict(vocab_size=20, max_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64, attention={"name": name},
                   short_conv=SHORT_CONV[name]),
        data=dict(recall_pairs=4, recall_queries=4, recall_tokens=20000, recall_val_tokens=2000),
        batch_size=16, seq_len=32, max_steps=60, warmup_steps=5, lr=1e-2, eval_every=60, eval_batches=2,
        log_every=1, out=str(tmp_path / "run")))
    r = train(cfg, quiet=True)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first = next(rec["loss"] for rec in map(json.loads, f) if rec["kind"] == "train")
    assert r.last_val_loss < math.log(20) - 0.5 and r.last_loss < first - 0.5, (first, r.last_loss, r.last_val_loss)


TINY_FLAGS = ["--vocab-size", "20", "--max-len", "16", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
              "--d-ff", "32", "--seq-len", "16", "--batch-size", "4", "--eval-every", "0", "--warmup-steps", "1",
              "--data-recall-pairs", "4", "--data-recall-queries", "2", "--data-recall-tokens", "4000",
              "--data-recall-val-tokens", "400", "--quiet"]


@pytest.mark.parametrize("name", list(GATED))
def test_cli_train_with_each(tmp_path, name):
    out = tmp_path / name
    assert main(["train", "--attention", name, "--max-steps", "2", "--out", str(out), *TINY_FLAGS]) == 0
    saved = json.loads((out / "train_config.json").read_text())["model"]["attention"]
    assert saved == {"name": name, **get_mechanism(name).default_config().to_dict()}
    assert (out / "checkpoints" / "step_00000002").is_dir()


def test_cli_train_attention_option(tmp_path):
    out = tmp_path / "gla"
    assert main(["train", "--attention", "gla", "--attention-gate-rank", "4", "--attention-output-gate", "false",
                 "--max-steps", "1", "--out", str(out), *TINY_FLAGS]) == 0
    saved = json.loads((out / "train_config.json").read_text())["model"]["attention"]
    assert saved["gate_rank"] == 4 and saved["output_gate"] is False


def test_no_bidirectional_form_and_other_refusals_name_the_mechanism():
    x = torch.randn(1, 5, 8)
    for name in GATED:
        spec = get_mechanism(name)
        assert spec.forms == frozenset({"causal", "recurrent", "sharded"}) and spec.needs_input
        assert spec.state_type is DecayedState
        with pytest.raises(ValueError, match=f"'{name}' attention has no bidirectional form"):
            MultiHeadAttention(8, 2, attention=GATED[name])(x)
        module = spec.build(n_heads=2, head_dim=4)
        q = torch.randn(1, 2, 5, 4)
        with pytest.raises(ValueError, match=f"'{name}' attention has no bidirectional form"):
            module(q, q, q, x=x)
        with pytest.raises(ValueError, match=r"x must have shape \(B, N, C\) = \(1, 5, 8\)"):
            module(q, q, q, x=x[:, :4], causal=True)
        with pytest.raises(TypeError, match="state must be a DecayedState"):
            module.step(q[:, :, :1], q[:, :, :1], q[:, :, :1], None, x=x[:, :1])
    with pytest.raises(ValueError, match="layer 1 uses 'gla' attention, which has no bidirectional form"):
        TransformerEncoder(TransformerConfig(vocab_size=5, max_len=4, d_model=8, n_heads=2, n_layers=2,
                                             layer_attention={1: GLAConfig()}))
    with pytest.raises(ValueError, match="positional='rotary' is not supported by 'deltanet'"):
        TransformerConfig(vocab_size=5, max_len=4, d_model=8, n_heads=2, attention=DeltaNetConfig(),
                          positional="rotary")
    with pytest.raises(ValueError, match="gate_rank must be an int > 0"):
        GLAConfig(gate_rank=0)
    with pytest.raises(ValueError, match="need a_min <= a_max"):
        GatedDeltaNetConfig(a_min=4.0, a_max=2.0)
    with pytest.raises(TypeError, match="output_gate must be a bool"):
        RetNetConfig(output_gate=1)


def test_half_inputs_keep_a_float32_state():
    torch.manual_seed(0)
    for name, config in GATED.items():
        mha = MultiHeadAttention(16, 2, attention=config).to(torch.bfloat16)
        x = torch.randn(1, 6, 16, dtype=torch.bfloat16)
        out, state = mha(x, causal=True, return_state=True)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all(), name
        assert state.mechanism.s.dtype == torch.float32, name
        assert mha.initial_state(1).mechanism.s.dtype == torch.float32, name


def test_sweep_runs_them_causal_and_marks_bidirectional_absent(tmp_path):
    from linattn.bench.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(mechanisms=tuple(GATED.values()), peers=(), ns=(16,), passes=("forward+backward",),
                      modes=("causal", "bidirectional"), n_heads=2, head_dim=8, repeats=1, measure_memory=False)
    rows = run_sweep(cfg, out=tmp_path, command="test", quiet=True)["rows"]
    status = {(r["impl"].split()[0], r["mode"]): r["status"] for r in rows}
    for name in GATED:
        assert status[(name, "causal")] == "ok" and status[(name, "bidirectional")] == "unsupported", name
    md = (tmp_path / "sweep.md").read_text()
    assert all(name in md for name in GATED)
    # no softmax among the contenders: no crossover section, and every table's rows as wide as its header
    assert "overtakes softmax" not in md
    for block in md.split("\n\n"):
        rows = [r for r in block.splitlines() if r.startswith("|")]
        assert len({r.count("|") for r in rows}) <= 1, block


def test_harness_gives_the_input_to_mechanisms_that_read_it():
    from linattn.bench.harness import Case, attention_fn, call, make_inputs, needs_input

    for name in GATED:
        case = Case(name, True, 10, n_heads=2, head_dim=4)
        q, k, v, x = inputs = make_inputs(case)
        assert needs_input(case) and x.shape == (1, 10, 8) and x.requires_grad
        call(case, inputs, attention_fn(case))
        assert all(t.grad is not None for t in inputs), name
    assert len(make_inputs(Case("linear", True, 10, n_heads=2, head_dim=4))) == 3


def test_generate_benchmark_decodes_them_with_a_constant_state(tmp_path):
    from linattn.bench.generate import run_generate

    mechanisms = (get_mechanism("linear").default_config(), SoftmaxConfig(), *GATED.values())
    result = run_generate(out=tmp_path, positions=(3, 9), steps=2, warmup=1, d_model=16, n_layers=1, n_heads=2,
                          vocab_size=30, mechanisms=mechanisms, recompute=False, runs=1, quiet=True)
    sizes = result["runs"][0]["allocators"]["inherited"]["state_bytes_after_prefill"]
    for label in ("retnet", "gla gate_rank=4", "deltanet", "gated_deltanet"):
        assert sizes[f"{label}@3"] == sizes[f"{label}@9"] == 2 * 8 * 8 * 4, label
        assert result["seconds_per_token"][f"{label}@9"] > 0


def test_exports():
    for name in ("gated_linear_attention", "gated_linear_attention_reference", "delta_rule_attention",
                 "delta_rule_attention_reference", "DecayedState", "RetNetConfig", "GLAConfig", "DeltaNetConfig",
                 "GatedDeltaNetConfig"):
        assert name in linattn.__all__ and hasattr(linattn, name), name
    assert {n for n, s in MECHANISMS.items() if s.needs_input} == set(GATED)
    assert np.all([get_mechanism(n).function in (linattn.gated_linear_attention, linattn.delta_rule_attention)
                   for n in GATED])
