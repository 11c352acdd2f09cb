"""Hedgehog attention with float16/bfloat16 inputs: sums and normalisers in float32, the output in
the input dtype, within rounding of the float64 reference run on the same (rounded) inputs."""

import pytest
import torch

from linattn.functional.hedgehog import (
    HedgehogMaps,
    hedgehog_attention,
    hedgehog_attention_reference,
    hedgehog_attention_weights,
)

FORMS = {"fast": hedgehog_attention, "reference": hedgehog_attention_reference}


def _inputs(dtype, v_scale, *, B=2, H=2, N=200, D=8, F=4, seed=0):
    """q, k, v and maps rounded to ``dtype``; with a large ``v_scale`` every value is positive near
    it, so that the sums over keys grow with N (2000 * N / F overflows float16 at N = 200)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    v = v if v_scale == 1 else v_scale * (1 + 0.1 * v)
    maps = HedgehogMaps(*(torch.randn(*s, generator=g) for s in [(H, D, F), (H, F), (H, D, F), (H, F), (H,)]))
    maps = HedgehogMaps(*(t.to(dtype).requires_grad_() for t in maps))
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], maps


def _as64(ts):
    return [t.detach().double().requires_grad_() for t in ts]


def _assert_rounded_close(out, ref, dtype, v_scale, msg):
    """Within one unit of ``dtype``'s precision of the float64 result: float32 arithmetic plus one
    final rounding fit; sums kept in ``dtype`` do not (float16 overflows at large values)."""
    assert out.dtype == dtype, msg
    assert torch.isfinite(out).all(), f"{msg}: non-finite output"
    err = (out.double() - ref).abs()
    tol = torch.finfo(dtype).eps * ref.abs() + 1e-4 * v_scale
    worst = (err / tol).max().item()
    assert worst <= 1, f"{msg}: error {worst:.2f} x tolerance"


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("v_scale", [1.0, 2000.0])
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("masked", [False, True])
def test_half_inputs_match_float64_reference(form, dtype, v_scale, window, masked):
    (q, k, v), maps = _inputs(dtype, v_scale)
    mask = None
    if masked:
        mask = torch.rand(2, 200, generator=torch.Generator().manual_seed(3)) > 0.3
    out = FORMS[form](q, k, v, maps, window=window, key_padding_mask=mask)
    (q64, k64, v64), maps64 = _as64((q, k, v)), HedgehogMaps(*_as64(maps))
    ref = hedgehog_attention_reference(q64, k64, v64, maps64, window=window, key_padding_mask=mask)
    _assert_rounded_close(out, ref, dtype, v_scale, f"{form} {dtype} v~{v_scale} window {window}")
    # gradients come back in the inputs' dtypes and finite (the sums behind them are float32)
    ins = (q, k, v, *maps)
    for name, g in zip(["q", "k", "v", "q_weight", "q_bias", "k_weight", "k_bias", "log_gain"],
                       torch.autograd.grad(out, ins, torch.ones_like(out), allow_unused=True)):
        if g is not None:
            assert g.dtype == dtype and torch.isfinite(g).all(), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_keeps_float32_sums(dtype):
    (q, k, v), maps = _inputs(torch.float32, 2000.0)
    plain = hedgehog_attention(q, k, v, maps, window=5)
    with torch.autocast("cpu", dtype=dtype):
        auto = hedgehog_attention(q, k, v, maps, window=5)
    assert auto.dtype == torch.float32
    torch.testing.assert_close(auto, plain, atol=0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_half_weights_match_float64(dtype, window):
    (q, k, _), maps = _inputs(dtype, 1.0, N=100)
    w = hedgehog_attention_weights(q, k, maps, window=window)
    ref = hedgehog_attention_weights(*_as64((q, k)), HedgehogMaps(*_as64(maps)), window=window)
    assert w.dtype == dtype
    err = (w.double() - ref).abs()
    assert (err <= torch.finfo(dtype).eps * ref.abs() + 1e-7).all(), err.max().item()
