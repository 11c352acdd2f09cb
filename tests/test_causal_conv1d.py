"""functional.conv.causal_conv1d (the short convolution's engine: ShortConv and the transformers
integration) against its loop reference: bias, packed documents' positions, gradients, bad shapes."""

import pytest
import torch

from linattn.functional.conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_step
from linattn.nn.positional import document_positions


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d_matches_reference(K, packed):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2 if not packed else 1, 13, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, K, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    pos = document_positions(torch.tensor([0, 3, 4, 4, 10, 13]), 13) if packed else None  # an empty document too
    got = causal_conv1d(x, w, bias=b, positions=pos)
    want = causal_conv1d_reference(x, w, bias=b, positions=pos)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    cot = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, c in zip(torch.autograd.grad((got * cot).sum(), (x, w, b)), torch.autograd.grad((want * cot).sum(), (x, w, b))):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-12)
    if packed:  # the first token of a document reads nothing of the one before it
        y = causal_conv1d(x.detach(), w.detach(), positions=pos)
        alone = causal_conv1d(x.detach()[:, 4:10], w.detach())
        torch.testing.assert_close(y[:, 4:10], alone, atol=1e-12, rtol=1e-12)


def test_causal_conv1d_names_bad_shapes():
    x = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match=r"weight \(C, K\).*weight \(3, 2\)"):
        causal_conv1d(x, torch.randn(3, 2))
    with pytest.raises(ValueError, match=r"bias must be \(C,\) = \(4,\).*got \(5,?\)"):
        causal_conv1d(x, torch.randn(4, 2), bias=torch.randn(5))
    with pytest.raises(ValueError, match=r"positions must be \(N,\) = \(6,\).*got \(5,?\)"):
        causal_conv1d(x, torch.randn(4, 2), positions=torch.arange(5))


@pytest.mark.parametrize("K", [1, 4])
def test_step_is_the_last_output_over_the_window(K):
    """causal_conv1d_step against causal_conv1d's last position, over a window given in the
    positions-second layout and as a cache's channels-first window transposed; shapes named."""
    g = torch.Generator().manual_seed(K)
    window = torch.randn(2, K, 6, generator=g, dtype=torch.float64)
    w, b = torch.randn(6, K, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    want = causal_conv1d(window, w, bias=b)[:, -1:]
    assert torch.allclose(causal_conv1d_step(window, w, bias=b), want, rtol=1e-14, atol=0)
    channels_first = window.transpose(1, 2).contiguous()  # (B, C, K), as transformers' cache holds it
    assert torch.allclose(causal_conv1d_step(channels_first.transpose(1, 2), w, bias=b), want, rtol=1e-14, atol=0)
    assert torch.allclose(causal_conv1d_step(window, w), causal_conv1d(window, w)[:, -1:], rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="window must be"):
        causal_conv1d_step(window, torch.randn(6, K + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias must be"):
        causal_conv1d_step(window, w, bias=torch.randn(5, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packed", [False, True])
def test_half_inputs_are_rounded_once(dtype, packed):
    """Half inputs accumulate the K products in float32: each output is the exact sum (of inputs
    and weights exactly representable in the half type) rounded once, within half a unit in its
    last place; rounding after every tap would not be."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 300, 24, generator=g).to(dtype)
    w = torch.randn(24, 4, generator=g).to(dtype)
    bias = torch.randn(24, generator=g).to(dtype)
    positions = document_positions(torch.tensor([0, 7, 8, 150, 300]), 300) if packed else None
    got = causal_conv1d(x, w, bias=bias, positions=positions)
    exact = causal_conv1d_reference(x.double(), w.double(), bias=bias.double(), positions=positions)
    assert got.dtype == dtype
    ulp = torch.finfo(dtype).eps * exact.abs()  # a unit in the last place, relative (up to 2x)
    assert ((got.double() - exact).abs() <= ulp / 2 + torch.finfo(dtype).tiny).all()
