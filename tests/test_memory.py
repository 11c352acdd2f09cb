"""Causal forward+backward at N = 65536 fits in 2 GB above the inputs (the plain cumsum form needs
more than 30 GB). Measured as peak RSS in a fresh process, as `linattn bench` does."""

import sys

import pytest

from linattn.bench.harness import Case, peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc is Linux-only")
def test_causal_65536_forward_backward_under_2gb():
    peak = peak_memory(Case("linear", causal=True, n=65536, batch=1, heads=8, head_dim=64))
    # a lower bound too, so that a broken measurement (always 0) cannot pass: the outputs and
    # gradients alone are 4 x 16 MiB
    assert 64 * 2**20 < peak < 2 * 10**9, peak
