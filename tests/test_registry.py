"""The mechanism registry and MultiHeadAttention against plain references."""

import pytest
import torch

import linattn
from conftest import assert_close
from linattn.functional import (
    efficient_attention_reference,
    linear_attention_reference,
    linformer_attention_reference,
    local_attention_reference,
    lsh_attention,
    softmax_attention_reference,
)
from linattn.nn import (
    MECHANISMS,
    DeltaNetConfig,
    EfficientConfig,
    FavorConfig,
    GatedDeltaNetConfig,
    KDAConfig,
    GLAConfig,
    HedgehogConfig,
    KVCache,
    LinearConfig,
    LinformerConfig,
    LocalConfig,
    LSHConfig,
    MultiHeadAttention,
    RetNetConfig,
    SoftmaxConfig,
    attention_config,
    attention_config_from_dict,
    attention_config_to_dict,
    get_mechanism,
)

ALL_CONFIGS = [
    SoftmaxConfig(),
    LinearConfig(feature_map="relu"),
    EfficientConfig(),
    FavorConfig(num_features=16, scale=0.5),
    LocalConfig(window=3),
    LinformerConfig(proj_len=4, max_len=16),
    LSHConfig(n_hashes=2, bucket_size=4),
    HedgehogConfig(window=2),
    RetNetConfig(output_gate=False),
    GLAConfig(gate_rank=4, gate_temperature=8.0),
    DeltaNetConfig(output_gate=True),
    GatedDeltaNetConfig(a_max=8.0, seed=3),
    KDAConfig(gate_rank=3, seed=2),
]


def test_registry_names_and_specs():
    gated = {"retnet", "gla", "deltanet", "gated_deltanet", "kda"}
    assert sorted(MECHANISMS) == sorted(["efficient", "favor", "hedgehog", "linear", "linformer", "local", "lsh",
                                         "softmax", *gated])
    assert {n for n, s in MECHANISMS.items() if s.causal} == {"softmax", "linear", "favor", "local", "lsh", *gated}
    assert {n for n, s in MECHANISMS.items() if s.recurrent} == {"softmax", "linear", "favor", "local", *gated}
    assert {n for n, s in MECHANISMS.items() if not s.bidirectional} == gated
    assert {n for n, s in MECHANISMS.items() if s.needs_input} == gated
    assert {n for n, s in MECHANISMS.items() if not s.rotary} == {"efficient", "hedgehog", "linformer", "deltanet",
                                                                  "gated_deltanet", "kda"}
    assert get_mechanism("lsh").shared_qk and get_mechanism("softmax").state_type is KVCache
    assert {type(c) for c in ALL_CONFIGS} == {s.config_type for s in MECHANISMS.values()}


def test_unknown_names_and_options_list_what_exists():
    with pytest.raises(ValueError, match=r"unknown attention mechanism 'performer'.*favor.*softmax"):
        attention_config("performer")
    with pytest.raises(ValueError, match=r"no option\(s\) 'widow' \(did you mean 'window'\?\).*\['window'\]"):
        attention_config("local", widow=3)
    with pytest.raises(ValueError, match="unknown feature_map 'tanh'"):
        LinearConfig(feature_map="tanh")
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        LocalConfig(window=0)
    with pytest.raises(TypeError, match="attention must be a mechanism config"):
        MultiHeadAttention(8, 2, attention="softmax")
    with pytest.raises(ValueError, match="needs a 'name'"):
        attention_config_from_dict({"window": 3})


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: type(c).__name__)
def test_attention_config_dict_round_trip(config):
    d = attention_config_to_dict(config)
    assert attention_config_from_dict(d) == config
    assert d["name"] == linattn.nn.spec_for(config).name


def _heads(x, H):
    B, N, C = x.shape
    return x.view(B, N, H, C // H).transpose(1, 2)


def _merge(o):
    B, H, N, D = o.shape
    return o.transpose(1, 2).reshape(B, N, H * D)


def _manual(mha, x, attend):
    """Projections written out by hand around ``attend(q, k, v)``."""
    H = mha.n_heads
    lin = torch.nn.functional.linear
    # in_proj's weight rows are [W_q; W_k; W_v] ([W_qk; W_v] for LSH)
    ws, bs = mha.in_proj.weight.split(mha.d_model), mha.in_proj.bias.split(mha.d_model)
    if mha.spec.shared_qk:
        q = k = _heads(lin(x, ws[0], bs[0]), H)
    else:
        q = _heads(lin(x, ws[0], bs[0]), H)
        k = _heads(lin(x, ws[1], bs[1]), H)
    v = _heads(lin(x, ws[-1], bs[-1]), H)
    return lin(_merge(attend(q, k, v)), mha.out_proj.weight, mha.out_proj.bias)


@pytest.mark.parametrize(
    "name,causal",
    [(n, c) for n in ["softmax", "linear", "local", "efficient", "linformer", "lsh"] for c in (False, True)
     if not c or n not in ("efficient", "linformer")],  # those two have no causal form (tested below)
)
def test_multihead_attention_matches_manual_reference(name, causal):
    assert get_mechanism(name).causal or not causal
    torch.manual_seed(0)
    config = {
        "softmax": SoftmaxConfig(), "linear": LinearConfig(feature_map="elu"), "local": LocalConfig(window=2),
        "efficient": EfficientConfig(), "linformer": LinformerConfig(proj_len=3), "lsh": LSHConfig(n_hashes=2, bucket_size=4),
    }[name]
    mha = MultiHeadAttention(12, 3, attention=config, max_len=8).double()
    x = torch.randn(2, 8, 12, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False
    refs = {
        "softmax": lambda q, k, v: softmax_attention_reference(q, k, v, causal=causal, key_padding_mask=mask),
        "linear": lambda q, k, v: linear_attention_reference(q, k, v, causal=causal, key_padding_mask=mask),
        "local": lambda q, k, v: local_attention_reference(q, k, v, window=2, causal=causal, key_padding_mask=mask),
        "efficient": lambda q, k, v: efficient_attention_reference(q, k, v, key_padding_mask=mask),
        "linformer": lambda q, k, v: linformer_attention_reference(
            q, k, v, mha.mechanism.linformer.e_proj, mha.mechanism.linformer.f_proj, key_padding_mask=mask),
        "lsh": lambda q, k, v: lsh_attention(q, v, n_hashes=2, bucket_size=4, causal=causal, key_padding_mask=mask,
                                             generator=torch.Generator().manual_seed(0)),
    }
    got = mha(x, causal=causal, key_padding_mask=mask)
    want = _manual(mha, x, refs[name])
    assert_close(got, want, atol=1e-12, rtol=1e-10, msg=name)


@pytest.mark.parametrize("config", [SoftmaxConfig(), LinearConfig(), FavorConfig(num_features=8), LocalConfig(window=2)],
                         ids=lambda c: type(c).__name__)
def test_multihead_step_equals_causal_forward(config):
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 2, attention=config, rotary=True).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    full = mha(x, causal=True)
    state = mha.initial_state(2)
    outs = []
    for i in range(6):
        o, state = mha.step(x[:, i : i + 1], state)
        outs.append(o)
    assert state.position == 6
    assert_close(torch.cat(outs, 1), full, msg="step")
    # prefill 4, then step
    head, state = mha(x[:, :4], causal=True, return_state=True)
    tail = [mha.step(x[:, i : i + 1], state)[0] for i in (4,)]
    assert_close(torch.cat([head, *tail], 1), full[:, :5], msg="prefill + step")


def test_kv_cache_grows_and_old_cache_stays_readable():
    torch.manual_seed(2)
    mha = MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 40, 8, dtype=torch.float64)
    with torch.no_grad():
        full = mha(x, causal=True)
        state = mha.initial_state(1)
        outs, caches = [], []
        for i in range(40):
            o, state = mha.step(x[:, i : i + 1], state)
            outs.append(o)
            caches.append(state.mechanism)
    assert caches[-1].k.shape[2] >= 40 and caches[-1].length == 40
    assert caches[3].keys().shape[2] == 4
    assert_close(torch.cat(outs, 1), full, msg="kv cache")


def test_favor_head_dim_must_match_the_layer():
    with pytest.raises(ValueError, match="head_dim = 5 but the layer's head width is 4"):
        MultiHeadAttention(8, 2, attention=FavorConfig(head_dim=5))
    with pytest.raises(ValueError, match="head_dim must be set"):
        linattn.FavorAttention(FavorConfig())


def test_mha_errors_name_the_problem():
    with pytest.raises(ValueError, match="n_heads = 3 must divide d_model = 8"):
        MultiHeadAttention(8, 3)
    with pytest.raises(ValueError, match="rotary positions are not supported with 'efficient'"):
        MultiHeadAttention(8, 2, attention=EfficientConfig(), rotary=True)
    with pytest.raises(ValueError, match="'linformer' attention has no causal form"):
        MultiHeadAttention(8, 2, attention=LinformerConfig(), max_len=4)(torch.randn(1, 4, 8), causal=True)
    with pytest.raises(ValueError, match="'efficient' attention has no causal form"):
        MultiHeadAttention(8, 2, attention=EfficientConfig())(torch.randn(1, 4, 8), causal=True)
    lsh = MultiHeadAttention(8, 2, attention=LSHConfig(bucket_size=2))
    with pytest.raises(ValueError, match="'lsh' attention has no recurrent form"):
        lsh.step(torch.randn(1, 1, 8), None)
    with pytest.raises(ValueError, match="'lsh' attention has no recurrent form"):
        lsh.initial_state(1)
    mha = MultiHeadAttention(8, 2, attention=LinearConfig())
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, d_model = 8\), got \(1, 4, 6\)"):
        mha(torch.randn(1, 4, 6))
    with pytest.raises(ValueError, match="one position"):
        mha.step(torch.randn(1, 2, 8), mha.initial_state(1))
    with pytest.raises(TypeError, match="must be a LinearAttentionState"):
        mha.step(torch.randn(1, 1, 8), linattn.nn.AttentionState(KVCache(torch.zeros(1), torch.zeros(1), 0), 0))
    with pytest.raises(ValueError, match="return_state needs causal=True"):
        mha(torch.randn(1, 4, 8), return_state=True)
