"""Causal forward+backward at N = 65536 fits in 2 GB above the inputs (the plain cumsum form needs
more than 30 GB). Measured as peak RSS in a fresh process, as `linattn bench` does."""

import sys

import pytest

from linattn.bench.harness import Case, peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc is Linux-only")
def test_causal_65536_forward_backward_under_2gb():
    peak = peak_memory(Case("linear", causal=True, n=65536, batch_size=1, n_heads=8, head_dim=64))
    # a lower bound too, so that a broken measurement (always 0) cannot pass: the outputs and
    # gradients alone are 4 x 16 MiB
    assert 64 * 2**20 < peak < 2 * 10**9, peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc is Linux-only")
def test_memory_baseline_does_not_hide_what_the_warm_up_left_resident():
    """FAVOR's causal forward+backward keeps its query and key features (N x m each) and one
    state per chunk of 64 (N/64 x m x 65) for backward: at N = 4096, H = 8, m = 256 that is
    8 x (4 + 4 + 4.1) MiB, about 97 MiB live at once. With the baseline taken while the warm-up's
    freed pages were still resident, the measured call reused them unseen and read 28 MiB."""
    peak = peak_memory(Case("favor", causal=True, n=4096, batch_size=1, n_heads=8, head_dim=64))
    assert peak > 90 * 2**20, peak
