"""functional.conv.causal_conv1d (the short convolution's engine: ShortConv and the transformers
integration) against its loop reference: bias, packed documents' positions, gradients, bad shapes."""

import pytest
import torch

from linattn.functional.conv import causal_conv1d, causal_conv1d_reference
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
