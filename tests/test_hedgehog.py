"""Hedgehog attention (learnable feature maps, optional softmax window) against its reference."""

import pytest
import torch

from conftest import assert_close, grads, make_mask, make_qkv
from linattn.functional import softmax_attention_reference
from linattn.functional.hedgehog import HedgehogMaps, hedgehog_attention, hedgehog_attention_reference
from linattn.nn import HedgehogConfig, build_mechanism


def _maps(H, D, F, *, seed=0):
    g = torch.Generator().manual_seed(seed + 5)
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_(True)  # noqa: E731
    return HedgehogMaps(t(H, D, F), t(H, F), t(H, D, F), t(H, F), t(H))


@pytest.mark.parametrize("n, window", [(1, 0), (63, 0), (65, 3), (100, 40), (200, 7), (37, 50)])
def test_fast_form_matches_reference_with_gradients(n, window):
    q, k, v = make_qkv(3, 2, n, n, 6, 5)
    maps = _maps(2, 6, 4)
    mask = make_mask(3, n)
    mask[0, 0] = True  # a sequence of length 1 needs a real key somewhere
    out = hedgehog_attention(q, k, v, maps, window=window, key_padding_mask=mask)
    ref = hedgehog_attention_reference(q, k, v, maps, window=window, key_padding_mask=mask)
    real = mask[:, None, :, None]  # padded queries' outputs are not compared
    assert_close(out * real, ref * real, msg="output")
    ins = (q, k, v, *maps)
    cot = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)) * real
    for name, a, b in zip(["q", "k", "v", "q_weight", "q_bias", "k_weight", "k_bias", "log_gain"],
                          torch.autograd.grad(out, ins, cot, allow_unused=True),
                          torch.autograd.grad(ref, ins, cot, allow_unused=True)):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        assert_close(a, b, atol=1e-9, rtol=1e-8, msg=name)


def test_window_covering_the_input_is_exact_softmax():
    # every key inside the window: the linear part has nothing left, whatever the maps
    q, k, v = make_qkv(2, 3, 20, 20, 8, 8)
    mask = make_mask(2, 20, all_padded_row=False)
    out = hedgehog_attention(q, k, v, _maps(3, 8, 5), window=19, key_padding_mask=mask)
    assert_close(out, softmax_attention_reference(q, k, v, key_padding_mask=mask), msg="window >= N - 1")


def test_padding_changes_nothing_for_real_tokens():
    q, k, v = make_qkv(1, 2, 30, 30, 4, 4, requires_grad=False)
    maps = _maps(2, 4, 4)
    short = hedgehog_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], maps, window=4)
    mask = torch.arange(30)[None] < 20
    kn, vn = k.clone(), v.clone()
    kn[:, :, 20:] = float("nan")  # padding content never reaches a real output
    vn[:, :, 20:] = float("nan")
    padded = hedgehog_attention(q, kn, vn, maps, window=4, key_padding_mask=mask)
    assert_close(padded[:, :, :20], short, msg="padded vs unpadded")


def test_mechanism_starts_from_identity_maps_and_rejects_causal():
    mech = build_mechanism(HedgehogConfig(window=2), n_heads=2, head_dim=4)
    assert torch.equal(mech.q_weight[0], torch.eye(4)) and mech.log_gain.shape == (2,)
    q, k, v = make_qkv(1, 2, 9, 9, 4, 4, dtype=torch.float32, requires_grad=False)
    w = mech.attention_weights(q, k)
    assert_close(w @ v, mech(q, k, v), atol=1e-6, rtol=1e-5, msg="weights @ v")
    with pytest.raises(ValueError, match="bidirectional only"):
        mech(q, k, v, causal=True)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        HedgehogConfig(window=-1)


@pytest.mark.parametrize("fn", [hedgehog_attention, hedgehog_attention_reference], ids=["fast", "reference"])
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_empty_sequence(fn, window, masked):
    q, k, v = make_qkv(2, 2, 0, 0, 4, 5)
    maps = _maps(2, 4, 3)
    mask = torch.ones(2, 0, dtype=torch.bool) if masked else None
    out = fn(q, k, v, maps, window=window, key_padding_mask=mask)
    assert out.shape == (2, 2, 0, 5)
    ins = (q, k, v, *maps)
    for t, g in zip(ins, torch.autograd.grad(out, ins, torch.ones_like(out), allow_unused=True)):
        assert g is None or (g.shape == t.shape and not g.any())
