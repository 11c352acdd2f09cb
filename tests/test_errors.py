"""Every bad input raises a clear ValueError/TypeError naming the argument and the shapes."""

import pytest
import torch

import linattn

from conftest import make_qkv

MECHS = {
    "softmax_attention": lambda q, k, v, **kw: linattn.softmax_attention(q, k, v, **kw),
    "linear_attention": lambda q, k, v, **kw: linattn.linear_attention(q, k, v, **kw),
    "efficient_attention": lambda q, k, v, **kw: linattn.efficient_attention(q, k, v, **kw),
    "local_attention": lambda q, k, v, **kw: linattn.local_attention(q, k, v, window=2, **kw),
    "linformer_attention": lambda q, k, v, **kw: linattn.linformer_attention(
        q, k, v, torch.ones(3, k.shape[2]), torch.ones(3, k.shape[2]), **kw),
}


@pytest.fixture
def qkv():
    return make_qkv(2, 3, 5, 5, 8, 6, dtype=torch.float32, requires_grad=False)


@pytest.mark.parametrize("name", MECHS)
def test_shape_errors(name, qkv):
    f = MECHS[name]
    q, k, v = qkv
    cases = [
        ((q, k[..., :7], v), ValueError, ["last dimension D", "(2, 3, 5, 8)", "(2, 3, 5, 7)"]),
        ((q, k, v[:, :, :4]), ValueError, ["Nk", "(2, 3, 5, 8)", "(2, 3, 4, 6)"]),
        ((q, k[:1], v[:1]), ValueError, ["batch size B", "(2, 3, 5, 8)", "(1, 3, 5, 8)"]),
        ((q, k[:, :2], v), ValueError, ["heads H", "(2, 2, 5, 8)"]),
        ((q[0], k, v), ValueError, ["4 dimensions", "q", "(3, 5, 8)"]),
        ((q.long(), k, v), TypeError, ["floating-point", "q", "torch.int64"]),
        ((q, k.double(), v), TypeError, ["one dtype", "torch.float64"]),
        (("q", k, v), TypeError, ["q must be a torch.Tensor"]),
    ]
    for args, exc, words in cases:
        with pytest.raises(exc) as info:
            f(*args)
        for w in words:
            assert w in str(info.value), (w, str(info.value))
        assert name in str(info.value)


@pytest.mark.parametrize("name", MECHS)
def test_mask_errors(name, qkv):
    f = MECHS[name]
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"key_padding_mask must have dtype torch.bool.*torch.int64"):
        f(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Nk\) = \(2, 5\).*\(2, 3, 5, 8\).*\(5, 2\)"):
        f(q, k, v, key_padding_mask=torch.ones(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(2, 1, 5\)"):
        f(q, k, v, key_padding_mask=torch.ones(2, 1, 5, dtype=torch.bool))


@pytest.mark.parametrize("name", ["softmax_attention", "linear_attention"])
def test_causal_needs_equal_lengths(name):
    q, k, v = make_qkv(1, 2, 3, 5, 8, 8, requires_grad=False)
    with pytest.raises(ValueError, match=r"causal=True needs as many queries as keys.*\(1, 2, 3, 8\).*\(1, 2, 5, 8\)"):
        MECHS[name](q, k, v, causal=True)


def test_efficient_has_no_causal_form(qkv):
    with pytest.raises(ValueError, match="no causal form.*later keys"):
        linattn.efficient_attention(*qkv, causal=True)


def test_linear_specific_errors(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"unknown feature_map 'gelu'; known: \['cos', 'elu', 'relu', 'softmax'\]"):
        linattn.linear_attention(q, k, v, feature_map="gelu")
    with pytest.raises(TypeError, match="feature_map must be a name"):
        linattn.linear_attention(q, k, v, feature_map=3)
    with pytest.raises(ValueError, match="feature_map gave different widths F"):
        calls = iter([8, 9])
        linattn.linear_attention(q, k, v, feature_map=lambda x: torch.ones(*x.shape[:-1], next(calls)))
    with pytest.raises(ValueError, match=r"feature_map must map q \(2, 3, 5, 8\)"):
        linattn.linear_attention(q, k, v, feature_map=lambda x: x[0])
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.linear_attention(q, k, v, return_state=True)
    state = linattn.LinearAttentionState(torch.zeros(2, 3, 8, 6), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="need causal=True"):
        linattn.linear_attention(q, k, v, initial_state=state)
    bad = linattn.LinearAttentionState(torch.zeros(2, 3, 8, 5), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"initial_state.S must have shape \(2, 3, 8, 6\).*got \(2, 3, 8, 5\)"):
        linattn.linear_attention(q, k, v, causal=True, initial_state=bad)
    bad = linattn.LinearAttentionState(torch.zeros(2, 3, 8, 6), torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"initial_state.z must have shape \(2, 3, 8\)"):
        linattn.linear_attention(q, k, v, causal=True, initial_state=bad)
    with pytest.raises(TypeError, match="initial_state must be a LinearAttentionState.*list"):
        linattn.linear_attention(q, k, v, causal=True, initial_state=[state.S, state.z])


def test_softmax_scale_errors(qkv):
    with pytest.raises(TypeError, match="scale must be a float"):
        linattn.softmax_attention(*qkv, scale="0.1")
    with pytest.raises(ValueError, match="scale must be finite"):
        linattn.softmax_attention(*qkv, scale=float("inf"))


def test_tuning_knob_errors():
    a = torch.rand(1, 1, 4, 2)
    with pytest.raises(ValueError, match="causal_linear_product: chunk_size must be an int >= 1, got 0"):
        linattn.causal_linear_product(a, a, a, chunk_size=0)
    with pytest.raises(ValueError, match="causal_linear_product: tile_positions must be an int >= 1, got 2.0"):
        linattn.causal_linear_product(a, a, a, tile_positions=2.0)
    with pytest.raises(ValueError, match="linear_attention: chunk_size must be an int >= 1, got True"):
        linattn.linear_attention(a, a, a, causal=True, chunk_size=True)
    with pytest.raises(ValueError, match="linear_attention: tile_positions must be an int >= 1, got -1"):
        linattn.linear_attention(a, a, a, causal=True, tile_positions=-1)
    with pytest.raises(ValueError, match="favor_attention: tile_entries must be an int >= 1, got 0"):
        linattn.favor_attention(a, a, a, torch.randn(4, 2), tile_entries=0)
