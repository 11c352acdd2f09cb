"""The short causal convolution in front of attention: loop reference, decoding state, padding,
and models that use it decode exactly as they are trained."""

import pytest
import torch

from conftest import assert_close
from linattn import LinearConfig, LocalConfig, SoftmaxConfig, TransformerConfig, TransformerLM
from linattn.nn import FavorConfig, MultiHeadAttention, ShortConv
from linattn.nn.conv import short_conv_reference


def _conv(C, K, seed=0):
    torch.manual_seed(seed)
    conv = ShortConv(C, K).double()
    with torch.no_grad():
        conv.weight.normal_()  # the identity initialisation would hide mistakes in the taps
    return conv


def _x(B, N, C, seed=1):
    return torch.randn(B, N, C, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("N", [1, 2, 7])
def test_forward_equals_loop_reference(K, N):
    conv, x = _conv(5, K), _x(3, N, 5)
    assert_close(conv(x), short_conv_reference(x, conv.weight), atol=1e-12, rtol=1e-12, msg=f"K={K} N={N}")


def test_identity_at_initialisation():
    x = _x(2, 6, 4)
    assert torch.equal(ShortConv(4, 3).double()(x), x)


@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("prefix", [0, 1, 2, 6])
def test_steps_after_a_prefix_equal_forward(K, prefix):
    conv, x = _conv(4, K), _x(2, 9, 4)
    full = conv(x)
    state = conv.tail(x[:, :prefix]) if prefix else conv.initial_state(2)
    assert state.shape == (2, K - 1, 4)
    outs = []
    for t in range(prefix, 9):
        y, state = conv.step(x[:, t : t + 1], state)
        outs.append(y)
    assert_close(torch.cat(outs, 1), full[:, prefix:], atol=1e-12, rtol=1e-12, msg=f"K={K} prefix={prefix}")


def test_gradients_match_reference():
    conv, x = _conv(3, 3), _x(2, 5, 3).requires_grad_()
    g = torch.randn(2, 5, 3, dtype=torch.float64)
    gx, gw = torch.autograd.grad((conv(x) * g).sum(), (x, conv.weight))
    rx, rw = torch.autograd.grad((short_conv_reference(x, conv.weight) * g).sum(), (x, conv.weight))
    assert_close(gx, rx, atol=1e-12, rtol=1e-12, msg="dx")
    assert_close(gw, rw, atol=1e-12, rtol=1e-12, msg="dw")


def test_padding_never_reaches_real_tokens():
    conv, x = _conv(4, 3), _x(2, 8, 4)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, :3] = False  # left padding: it would precede real tokens inside the kernel
    mask[1, 6:] = False
    y = conv(x, mask)
    x2 = x.clone()
    x2[~mask] = 1e6
    assert_close(conv(x2, mask)[mask], y[mask], atol=1e-12, rtol=0, msg="padding leaked")


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConv(4, 0)
    conv = ShortConv(4, 3)
    with pytest.raises(ValueError, match=r"\(B, N, 4\)"):
        conv(torch.zeros(2, 5, 3))
    with pytest.raises(ValueError, match="state"):
        conv.step(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match="short_conv"):
        TransformerConfig(vocab_size=8, max_len=8, d_model=8, n_heads=2, short_conv=-1)
    with pytest.raises(ValueError, match="short_conv"):
        MultiHeadAttention(8, 2, short_conv=-2)


@pytest.mark.parametrize("attention", [SoftmaxConfig(), LinearConfig(), FavorConfig(num_features=6),
                                       LocalConfig(window=2)], ids=lambda c: type(c).__name__)
def test_attention_layer_steps_equal_causal_forward(attention):
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2, attention=attention, short_conv=3).double()
    with torch.no_grad():
        layer.conv.weight.normal_()
    x = _x(2, 7, 8)
    full = layer(x, causal=True)
    y, state = layer(x[:, :3], causal=True, return_state=True)
    outs = [y]
    for t in range(3, 7):
        y, state = layer.step(x[:, t : t + 1], state)
        outs.append(y)
    assert state.position == 7 and state.conv.shape == (2, 2, 8)
    assert_close(torch.cat(outs, 1), full, atol=1e-11, rtol=1e-10, msg=type(attention).__name__)
    with pytest.raises(ValueError, match="short convolution"):
        layer.step(x[:, :1], state._replace(conv=None))


def test_lm_with_short_conv_decodes_like_teacher_forcing_and_round_trips(tmp_path):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=17, max_len=20, d_model=16, n_layers=3, n_heads=2, d_ff=24, init_std=0.3,
                            attention=LinearConfig(), layer_attention={1: SoftmaxConfig()}, short_conv=4)
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    lm = TransformerLM(cfg).double().eval()
    with torch.no_grad():
        for block in lm.blocks:
            block.attn.conv.weight.normal_(std=0.5)
    ids = torch.randint(0, 17, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = lm(ids)
        assert_close(lm.forward_steps(ids)[0], full, atol=1e-10, rtol=1e-9, msg="steps")
        head, state = lm(ids[:, :2], return_state=True)  # shorter than K - 1: zeros in front
        tail, _ = lm.forward_steps(ids[:, 2:], state)
        assert_close(torch.cat([head, tail], 1), full, atol=1e-10, rtol=1e-9, msg="prefill")
    lm.save_pretrained(tmp_path / "m")
    back = TransformerLM.from_pretrained(tmp_path / "m").double().eval()
    with torch.no_grad():
        assert torch.equal(back(ids), full)


def test_encoder_padding_never_reaches_real_tokens_through_the_convolution():
    from linattn import TransformerEncoder

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=11, max_len=9, d_model=8, n_layers=2, n_heads=2, d_ff=16, init_std=0.3,
                            attention=LinearConfig(), short_conv=3)
    enc = TransformerEncoder(cfg).double().eval()
    with torch.no_grad():
        for block in enc.blocks:
            block.attn.conv.weight.normal_()
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :4] = False  # left padding sits inside the kernel of the first real tokens
    other = ids.clone()
    other[~mask] = (other[~mask] + 5) % 11
    with torch.no_grad():
        a, b = enc(ids, key_padding_mask=mask), enc(other, key_padding_mask=mask)
    assert_close(a[mask], b[mask], atol=1e-12, rtol=0, msg="padding leaked through the convolution")
