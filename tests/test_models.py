"""Transformer encoder and LM: recurrent decoding equals teacher forcing, configs, parameter counts,
padding, and errors."""

import json

import pytest
import torch

import linattn
from conftest import assert_close
from linattn import (
    EfficientConfig,
    FavorConfig,
    LinearConfig,
    LinformerConfig,
    LocalConfig,
    LSHConfig,
    SoftmaxConfig,
    TransformerConfig,
    TransformerEncoder,
    TransformerLM,
    count_parameters,
    parameter_table,
)

SMALL = dict(vocab_size=23, max_len=24, d_model=16, n_layers=4, n_heads=2, d_ff=24, init_std=0.3)

STACKS = {
    "softmax": dict(attention=SoftmaxConfig()),
    "linear": dict(attention=LinearConfig()),
    "favor": dict(attention=FavorConfig(num_features=12)),
    "local": dict(attention=LocalConfig(window=3)),
    "softmax-every-other+linear": dict(attention=LinearConfig(), layer_attention={0: SoftmaxConfig(), 2: SoftmaxConfig()}),
    "all-four": dict(attention=LinearConfig(feature_map="relu"),
                     layer_attention={0: SoftmaxConfig(), 1: FavorConfig(num_features=8), 3: LocalConfig(window=2)}),
}


def _lm(stack, positional="learned", **kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(**{**SMALL, **kw}, positional=positional, **STACKS[stack])
    return TransformerLM(cfg).double().eval()


def _ids(B=2, N=13, seed=0):
    return torch.randint(0, SMALL["vocab_size"], (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("positional", ["learned", "sinusoidal", "rotary"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_step_by_step_equals_teacher_forced(stack, positional):
    lm = _lm(stack, positional)
    ids = _ids()
    with torch.no_grad():
        full = lm(ids)  # (B, N, V)
        stepped, state = lm.forward_steps(ids)
        assert state.position == ids.shape[1]
        assert_close(stepped, full, atol=1e-10, rtol=1e-9, msg=f"{stack} {positional} steps")
        # prefill the first 5 with one causal forward, then continue step by step
        head, state = lm(ids[:, :5], return_state=True)
        tail, _ = lm.forward_steps(ids[:, 5:], state)
        assert_close(torch.cat([head, tail], 1), full, atol=1e-10, rtol=1e-9, msg=f"{stack} {positional} prefill")


@pytest.mark.parametrize("stack", ["softmax", "linear", "all-four"])
@pytest.mark.parametrize("norm,pre_norm", [("rmsnorm", True), ("layernorm", False)])
def test_step_equals_forward_for_other_norms(stack, norm, pre_norm):
    lm = _lm(stack, "rotary", norm=norm, pre_norm=pre_norm)
    ids = _ids(seed=3)
    with torch.no_grad():
        assert_close(lm.forward_steps(ids)[0], lm(ids), atol=1e-10, rtol=1e-9, msg=f"{norm} {pre_norm}")


@pytest.mark.parametrize("stack", ["softmax", "linear", "favor", "local", "softmax-every-other+linear"])
def test_greedy_generate_is_argmax_of_teacher_forced_logits(stack):
    lm = _lm(stack, "rotary")
    prompt = _ids(B=3, N=4, seed=1)
    out = lm.generate(prompt, 9, temperature=0)
    assert out.shape == (3, 13) and torch.equal(out[:, :4], prompt)
    with torch.no_grad():
        logits = lm(out)
    assert torch.equal(out[:, 4:], logits[:, 3:-1].argmax(-1))
    assert len(set(out[:, 4:].flatten().tolist())) > 2  # not a constant continuation


def test_sampling_is_reproducible_and_respects_top_k():
    lm = _lm("linear")
    prompt = _ids(B=2, N=3)
    a = lm.generate(prompt, 8, temperature=1.5, top_k=2, generator=torch.Generator().manual_seed(5))
    b = lm.generate(prompt, 8, temperature=1.5, top_k=2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    with torch.no_grad():
        logits = lm(a)
    top2 = logits[:, 2:-1].topk(2, dim=-1).indices  # (B, 8, 2)
    assert (top2 == a[:, 3:, None]).any(-1).all()
    # top_p tiny: only the most likely token survives, so sampling is greedy
    c = lm.generate(prompt, 8, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(c, lm.generate(prompt, 8, temperature=0))


def test_decoding_state_does_not_grow_for_linear_favor_local():
    for stack in ("linear", "favor", "local"):
        lm = _lm(stack)
        ids = _ids(B=1, N=20)
        with torch.no_grad():
            _, s5 = lm(ids[:, :5], return_state=True)
            _, s20 = lm.forward_steps(ids[:, 5:], s5)
        size = lambda s: sum(t.numel() for layer in s.layers for t in layer.mechanism if isinstance(t, torch.Tensor))
        assert size(s5) == size(s20), stack


def test_encoder_key_padding_equals_unpadded():
    torch.manual_seed(0)
    for att in (SoftmaxConfig(), LinearConfig(), EfficientConfig(), LocalConfig(window=2),
                FavorConfig(num_features=8), LinformerConfig(proj_len=4)):
        cfg = TransformerConfig(**SMALL, attention=att)
        enc = TransformerEncoder(cfg).double()
        ids = _ids(B=2, N=10)
        mask = torch.ones(2, 10, dtype=torch.bool)
        mask[1, 7:] = False
        with torch.no_grad():
            out = enc(ids, key_padding_mask=mask)
            alone = enc(ids[1:, :7])
            ids2 = ids.clone()
            ids2[1, 7:] = (ids2[1, 7:] + 1) % SMALL["vocab_size"]  # change the padding's content
            out2 = enc(ids2, key_padding_mask=mask)
        name = type(att).__name__
        assert out.shape == (2, 10, 16)
        assert_close(out[1:, :7], alone, msg=f"{name} padded vs unpadded")
        assert_close(out2[:, :7][mask[:, :7]], out[:, :7][mask[:, :7]], msg=f"{name} padding content")
        assert_close(out2[0], out[0], msg=name)


def test_encoder_lsh_padding_content_is_ignored():
    torch.manual_seed(0)
    enc = TransformerEncoder(TransformerConfig(**SMALL, attention=LSHConfig(n_hashes=2, bucket_size=5))).double()
    ids = _ids(B=2, N=10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    ids2 = ids.clone()
    ids2[1, 6:] = 0
    with torch.no_grad():
        a, b = enc(ids, key_padding_mask=mask), enc(ids2, key_padding_mask=mask)
    assert_close(a[mask], b[mask], msg="lsh")
    assert_close(a[0], enc(ids[:1])[0], msg="lsh unpadded row")


def test_lm_lsh_trains_forward_but_cannot_decode():
    lm = TransformerLM(TransformerConfig(**SMALL, attention=LSHConfig(n_hashes=2, bucket_size=4)))
    ids = _ids(N=8)
    logits = lm(ids)
    assert logits.shape == (2, 8, 23)
    with pytest.raises(ValueError, match="layer 0 uses 'lsh' attention, which has no recurrent form"):
        lm.generate(ids[:, :2], 3)
    # causality: changing a later token leaves earlier logits alone
    ids2 = ids.clone()
    ids2[:, 6] = (ids2[:, 6] + 1) % 23
    assert torch.equal(lm(ids2)[:, :6], logits[:, :6])


def test_config_round_trip_with_nested_attention_configs():
    cfg = TransformerConfig(
        vocab_size=100, max_len=64, d_model=32, n_layers=8, n_heads=4, d_ff=64, norm="rmsnorm", pre_norm=False,
        positional="sinusoidal", dropout=0.1, attention=LinearConfig(feature_map="cos"),
        layer_attention={3: SoftmaxConfig(), 0: FavorConfig(num_features=32, kernel="relu", scale=None),
                         5: LocalConfig(window=7), 6: LinformerConfig(proj_len=8, share_kv=True),
                         7: LSHConfig(n_hashes=3), 4: EfficientConfig()},
        tie_embeddings=False,
    )
    d = json.loads(json.dumps(cfg.to_dict()))
    assert TransformerConfig.from_dict(d) == cfg
    assert list(d["layer_attention"]) == ["0", "3", "4", "5", "6", "7"]
    assert cfg.layer_mechanisms() == ["favor", "linear", "linear", "softmax", "efficient", "local", "linformer", "lsh"]
    assert [i for i, _ in cfg.layer_attention] == [0, 3, 4, 5, 6, 7]
    hash(cfg)  # frozen and hashable


def test_hybrid_every_fourth_layer_is_one_config():
    cfg = TransformerConfig(**{**SMALL, "n_layers": 8}, attention=LinearConfig(),
                            layer_attention={i: SoftmaxConfig() for i in range(0, 8, 4)})
    lm = TransformerLM(cfg)
    assert [b.attn.spec.name for b in lm.blocks] == ["softmax", "linear", "linear", "linear"] * 2


def test_bad_configs_raise_naming_the_problem():
    with pytest.raises(ValueError, match="n_heads = 3 must divide d_model = 16"):
        TransformerConfig(**{**SMALL, "n_heads": 3})
    with pytest.raises(ValueError, match="layer 1 uses 'efficient' attention, which has no causal form"):
        TransformerLM(TransformerConfig(**SMALL, layer_attention={1: EfficientConfig()}))
    with pytest.raises(ValueError, match="layer 0 uses 'linformer' attention, which has no causal form"):
        TransformerLM(TransformerConfig(**SMALL, attention=LinformerConfig()))
    with pytest.raises(ValueError, match="positional='rotary' is not supported by 'linformer' attention \\(layer 2\\)"):
        TransformerConfig(**SMALL, positional="rotary", layer_attention={2: LinformerConfig()})
    with pytest.raises(ValueError, match="unknown positional 'alibi'"):
        TransformerConfig(**SMALL, positional="alibi")
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        TransformerConfig(**SMALL, norm="batchnorm")
    with pytest.raises(ValueError, match=r"index 4 is not a layer index in \[0, 4\)"):
        TransformerConfig(**SMALL, layer_attention={4: SoftmaxConfig()})
    with pytest.raises(TypeError, match=r"layer_attention\[1\]: attention must be a mechanism config"):
        TransformerConfig(**SMALL, layer_attention={1: "softmax"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'n_layer' \(did you mean 'n_layers'\?\)"):
        TransformerConfig.from_dict({**SMALL, "n_layer": 2})
    with pytest.raises(ValueError, match="unknown attention mechanism 'flash'"):
        TransformerConfig.from_dict({**SMALL, "attention": {"name": "flash"}})
    with pytest.raises(ValueError, match="'local' attention has no option"):
        TransformerConfig.from_dict({**SMALL, "attention": {"name": "local", "size": 3}})
    with pytest.raises(ValueError, match="d_model must be an int >= 1"):
        TransformerConfig(**{**SMALL, "d_model": 0})
    with pytest.raises(ValueError, match="below the model's max_len"):
        TransformerEncoder(TransformerConfig(**SMALL, attention=LinformerConfig(max_len=8)))
    lm = TransformerLM(TransformerConfig(**SMALL))
    with pytest.raises(ValueError, match="exceed max_len = 24"):
        lm(_ids(N=25))
    with pytest.raises(ValueError, match="exceeds max_len = 24"):
        lm.generate(_ids(N=20), 5)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        lm(torch.randn(2, 3))
    with pytest.raises(ValueError, match="temperature must be a float >= 0"):
        lm.generate(_ids(N=2), 1, temperature=-1.0)


def _softmax_stack_count(V, max_len, C, L, d_ff, *, head):
    """The parameter count of a pre-norm, layernorm, learned-position stack of softmax attention,
    from the architecture by hand (not from the model): per block the fused q/k/v projection
    C x 3C + 3C, the output projection C x C + C, two LayerNorms 2C each and the MLP
    C x d_ff + d_ff + d_ff x C + C; then token and position embeddings, the final LayerNorm and,
    untied, an LM head V x C without bias."""
    block = (3 * C * C + 3 * C) + (C * C + C) + 2 * (2 * C) + (C * d_ff + d_ff + d_ff * C + C)
    return L * block + V * C + max_len * C + 2 * C + (V * C if head else 0)


def test_tied_embeddings():
    lm = TransformerLM(TransformerConfig(**SMALL))
    assert lm.head.weight is lm.tok_emb.weight
    untied = TransformerLM(TransformerConfig(**SMALL, tie_embeddings=False))
    dims = dict(V=SMALL["vocab_size"], max_len=SMALL["max_len"], C=SMALL["d_model"], L=SMALL["n_layers"],
                d_ff=SMALL["d_ff"])
    # SMALL: 4 * (816 + 272 + 64 + 808) + 368 + 384 + 32 = 8624 tied, + 368 for an untied head
    assert count_parameters(lm) == _softmax_stack_count(**dims, head=False) == 8624  # shared weight counted once
    assert count_parameters(untied) == _softmax_stack_count(**dims, head=True) == 8992
    frozen = TransformerLM(TransformerConfig(**SMALL))
    frozen.tok_emb.weight.requires_grad_(False)  # the tied head too: one parameter
    assert count_parameters(frozen, trainable_only=True) == 8624 - 23 * 16
    assert count_parameters(frozen) == 8624


def test_bert_base_parameter_count():
    cfg = TransformerConfig(vocab_size=30000, max_len=512, d_model=768, n_layers=12, n_heads=12, d_ff=3072)
    with torch.device("meta"):  # shapes only: nothing allocated
        enc = TransformerEncoder(cfg)
    n = count_parameters(enc)
    # exactly, by hand: 12 blocks of 4 C^2 + 2 C d_ff + 9 C + d_ff = 7,087,872, embeddings
    # 30000 x 768 + 512 x 768, the final LayerNorm 2 x 768
    assert n == _softmax_stack_count(30000, 512, 768, 12, 3072, head=False) == 108_489_216
    formula = 12 * 12 * 768**2 + 30000 * 768  # the usual estimate L * 12 C^2 + vocab * C = 107,974,656
    assert abs(n - formula) / formula < 0.03, n
    table = parameter_table(enc, depth=1)
    assert "| blocks |" in table and f"**{n:,}**" in table


def test_parameter_table_counts_each_module():
    lm = _lm("linear")
    table = parameter_table(lm, depth=3)
    attn = sum(p.numel() for p in lm.blocks[0].attn.parameters())
    assert f"| blocks.0.attn | {attn:,} |" in table
    assert "head" not in table  # tied to tok_emb, counted once there


def test_compiled_step_equals_eager_step():
    # every recurrent mechanism in one stack; the prompt's KV cache is full after prefill, so the
    # softmax layer's cache grows (new shapes) while decoding; positions change every step
    lm = _lm("all-four", "rotary")
    prompt = _ids(B=2, N=3, seed=4)
    step = lm.compiled_step()
    with torch.no_grad():
        _, eager = lm(prompt, return_state=True)
        compiled = eager
        nxt = prompt[:, -1:]
        for _ in range(8):
            le, eager = lm.step(nxt, eager)
            lc, compiled = step(nxt, compiled)
            assert_close(lc, le, atol=1e-10, rtol=1e-9, msg=f"position {eager.position}")
            nxt = le.argmax(-1, keepdim=True)
    assert torch.equal(lm.generate(prompt, 10, temperature=0, compile=True),
                       lm.generate(prompt, 10, temperature=0))
    with pytest.raises(ValueError, match="layer 0 uses 'lsh' attention, which has no recurrent form"):
        TransformerLM(TransformerConfig(**SMALL, attention=LSHConfig(bucket_size=4))).compiled_step()


def test_positional_none_has_no_table_and_stays_causal():
    """positional="none": no position embedding of max_len rows, and the order still reaches the
    logits through the causal mask and the short convolution (shifting the input changes them)."""
    from linattn.nn.gated import GatedDeltaNetConfig

    cfg = TransformerConfig(vocab_size=11, max_len=4096, d_model=16, n_heads=2, n_layers=1, positional="none",
                            short_conv=3, attention=GatedDeltaNetConfig())
    m = TransformerLM(cfg)
    names = [n for n, _ in m.named_parameters()] + [n for n, _ in m.named_buffers()]
    assert not any("pos" in n for n in names), names
    ids = torch.randint(0, 11, (1, 12), generator=torch.Generator().manual_seed(0))
    a = m(ids)
    b = m(torch.cat([ids[:, :6], (ids[:, 6:] + 1) % 11], dim=1))
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.equal(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("pre_norm", [True, False])
def test_d_ff_0_blocks_are_attention_only(pre_norm):
    """d_ff = 0: no MLP and no second norm in any block (Zoology's MQAR models), so the block is
    exactly x + attn(norm1(x)) (pre-norm) or norm1(x + attn(x)); decoding still equals teacher forcing."""
    lm = _lm("all-four", d_ff=0, pre_norm=pre_norm)
    with_mlp = _lm("all-four", pre_norm=pre_norm)
    names = [n for n, _ in lm.named_parameters()]
    assert not any(".ff." in n or ".norm2." in n for n in names), names
    mlp = sum(p.numel() for n, p in with_mlp.named_parameters() if ".ff." in n or ".norm2." in n)
    assert count_parameters(with_mlp) - count_parameters(lm) == mlp > 0
    ids = _ids(seed=5)
    with torch.no_grad():
        assert_close(lm.forward_steps(ids)[0], lm(ids), atol=1e-10, rtol=1e-9, msg="d_ff 0 steps")
        block, x = lm.blocks[0], torch.randn(2, 7, SMALL["d_model"], dtype=torch.float64)
        attn = block.attn(block.norm1(x) if pre_norm else x, causal=True)
        assert_close(block(x, causal=True), x + attn if pre_norm else block.norm1(x + attn), atol=1e-12, rtol=1e-12,
                     msg="attention-only block")
    with pytest.raises(ValueError, match=r"d_ff must be an int >= 0 \(0: no MLP\), got -1"):
        TransformerConfig(**{**SMALL, "d_ff": -1})
