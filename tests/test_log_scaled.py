"""The decayed engine's running-scale specialisation (FAVOR's causal form) against a step-by-step float64
recurrence."""

import pytest
import torch

from conftest import assert_close
from linattn.functional.decayed import decayed_product


def causal_product_log_scaled(a, kf, w, m, s0=None, *, chunk_size):
    return decayed_product(a, kf, w, s0, running_log_scale=m, chunk_size=chunk_size)


def recurrence(a, kf, w, m, s0):
    """S_i = e^{m_{i-1} - m_i} S_{i-1} + kf_i w_i^T (S_{-1} = s0 at scale m_0), o_i = a_i S_i."""
    B, H, N, F = a.shape
    S = torch.zeros(B, H, F, w.shape[-1], dtype=a.dtype) if s0 is None else s0
    prev, outs = m[..., 0], []
    for i in range(N):
        S = S * torch.exp(prev - m[..., i])[..., None, None] + kf[:, :, i, :, None] * w[:, :, i, None, :]
        prev = m[..., i]
        outs.append((a[:, :, i, None, :] @ S)[:, :, 0])
    return torch.stack(outs, 2), S


@pytest.mark.parametrize("n,chunk", [(1, 64), (2, 1), (63, 16), (65, 16), (300, 7), (1000, 5)])
@pytest.mark.parametrize("with_s0", [False, True])
def test_matches_recurrence(n, chunk, with_s0):
    g = torch.Generator().manual_seed(n + chunk)
    B, H, F, E = 2, 2, 5, 3
    a, kf = (torch.randn(B, H, n, F, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    w = torch.randn(B, H, n, E, generator=g, dtype=torch.float64).requires_grad_()
    # non-decreasing levels with a few large jumps (a stabiliser's running maximum)
    steps = torch.rand(B, H, n, generator=g, dtype=torch.float64) * (torch.rand(B, H, n, generator=g) < 0.05) * 30
    m = torch.cumsum(steps, -1) - 5
    s0 = torch.randn(B, H, F, E, generator=g, dtype=torch.float64).requires_grad_() if with_s0 else None
    o, s = causal_product_log_scaled(a, kf, w, m, s0, chunk_size=chunk)
    o_ref, s_ref = recurrence(a, kf, w, m, s0)
    assert_close(o, o_ref, msg="out")
    assert_close(s, s_ref, msg="state")
    go, gs = torch.randn_like(o), torch.randn_like(s)
    inputs = [a, kf, w] + ([s0] if with_s0 else [])
    got = torch.autograd.grad((o * go).sum() + (s * gs).sum(), inputs)
    want = torch.autograd.grad((o_ref * go).sum() + (s_ref * gs).sum(), inputs)
    for name, x, y in zip(["a", "kf", "w", "s0"], got, want):
        assert_close(x, y, msg=f"d{name}")


def test_huge_level_jumps_stay_finite_and_exact_in_float32():
    """A jump of 5000 in the level underflows everything before it to exactly 0 and loses no
    precision afterwards (factors are differences of given levels, not of cumulative sums)."""
    n = 200
    g = torch.Generator().manual_seed(0)
    a, kf, w = (torch.rand(1, 1, n, 4, generator=g) for _ in range(3))
    m = torch.zeros(1, 1, n)
    m[..., 100:] = 5000.0
    o, _ = causal_product_log_scaled(a, kf, w, m, chunk_size=16)
    assert torch.isfinite(o).all()
    # after the jump only keys from position 100 on count, at their own scale
    o_after, _ = causal_product_log_scaled(a[:, :, 100:], kf[:, :, 100:], w[:, :, 100:], m[..., 100:], chunk_size=16)
    torch.testing.assert_close(o[:, :, 100:], o_after, rtol=1e-6, atol=1e-6)
