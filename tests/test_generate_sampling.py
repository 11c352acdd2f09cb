"""TransformerLM.generate's sampling arguments: bad values raise naming the argument and the value
before anything runs; tiny positive temperatures are the greedy limit, not NaN probabilities."""

import math
import re

import pytest
import torch

from linattn import LinearConfig, TransformerConfig, TransformerLM
from linattn.models.transformer import _sample

SMALL = dict(vocab_size=23, max_len=24, d_model=16, n_layers=2, n_heads=2, d_ff=24, init_std=0.3)


def _lm(dtype=torch.float64):
    torch.manual_seed(0)
    return TransformerLM(TransformerConfig(**SMALL, attention=LinearConfig())).to(dtype).eval()


def _prompt():
    return torch.randint(0, SMALL["vocab_size"], (3, 4), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -math.inf), ("temperature", -1.0),
    ("temperature", -1e-300), ("temperature", 10 ** 400),
    ("top_k", 0), ("top_k", -3),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
])
def test_bad_sampling_values_raise_naming_argument_and_value(name, value):
    with pytest.raises(ValueError, match=rf"generate: {name} must be .*got {re.escape(repr(value))}"):
        _lm().generate(_prompt(), 3, **{name: value})


@pytest.mark.parametrize("name, value", [
    ("temperature", True), ("temperature", "1.0"), ("temperature", None), ("top_k", 2.0), ("top_k", True),
    ("top_p", "0.9"), ("top_p", False),
])
def test_wrong_types_raise_naming_argument(name, value):
    with pytest.raises(TypeError, match=rf"generate: {name} must be .*got {type(value).__name__}"):
        _lm().generate(_prompt(), 3, **{name: value})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, 1e-38, 1e-30])
def test_tiny_temperature_is_the_greedy_limit(dtype, temperature):
    lm = _lm(dtype)
    greedy = lm.generate(_prompt(), 8, temperature=0)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(lm.generate(_prompt(), 8, temperature=temperature, generator=g), greedy)
    assert torch.equal(lm.generate(_prompt(), 8, temperature=temperature, top_k=3, top_p=0.5, generator=g), greedy)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_tiny_temperature_shares_tied_maxima_and_never_picks_masked_tokens(temperature):
    logits = torch.tensor([[2.0, -math.inf, 2.0, 1.0, -1e30]]).expand(400, 5)  # (B, V): tokens 0 and 2 tie
    picks = _sample(logits, temperature, None, None, torch.Generator().manual_seed(0))
    assert set(picks.flatten().tolist()) == {0, 2}


def test_extreme_logits_sample_without_nan():
    logits = torch.tensor([[3e38, -3e38, 3e38 - 1e32, 0.0]], dtype=torch.float32)
    for t in (1.0, 1e-45, 1e30):
        picks = _sample(logits.expand(200, 4), t, None, None, torch.Generator().manual_seed(0))
        assert picks.min() >= 0 and picks.max() < 4


def test_sampling_under_deterministic_algorithms_calls_nothing_cuda_refuses():
    """Nucleus sampling's running sum of probabilities under torch.use_deterministic_algorithms(True):
    no floating cumsum (CUDA refuses one then), and the same tokens from the same generator."""
    from probes import OpProbe, deterministic_algorithms

    lm = _lm(torch.float32)
    want = lm.generate(_prompt(), 6, top_p=0.7, generator=torch.Generator().manual_seed(3))
    with deterministic_algorithms(), OpProbe(engines=True) as p:
        got = lm.generate(_prompt(), 6, top_p=0.7, generator=torch.Generator().manual_seed(3))
    assert not p.cuda_refusals, dict(p.cuda_refusals)
    assert torch.equal(got, want)
