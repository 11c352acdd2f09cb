"""`linattn bench context-parallel` on a tiny model: it runs 1 and 2 ranks, counts the bytes the
ranks exchange, and the count agrees with the written communication model."""

import json

import pytest

from linattn.bench.context_parallel import fit_message_cost, model_bytes_per_rank, run_context_parallel
from linattn.cli import main

TINY = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def test_tiny_run_counts_what_the_model_says(tmp_path):
    result = run_context_parallel(out=tmp_path, ranks=(1, 2), time_n=256, runs=1, steps=1, search=False,
                                  model=TINY, quiet=True)
    saved = json.loads((tmp_path / "context_parallel.json").read_text())
    assert saved["command"].startswith("linattn bench context-parallel --ranks 1,2")
    row = result["comm"]["by_ranks"]["2"]
    # the model leaves out only the shard/offset checks and the short convolution's halo: tiny here
    assert row["model_bytes"] <= row["counted_bytes"] <= row["model_bytes"] + 4096
    assert row["model_parts"]["summaries"] > 0 and row["calls"] >= 2 * TINY["n_layers"] + 1
    md = (tmp_path / "context_parallel.md").read_text()
    assert "## Time per step at N = 256" in md and "| 1024 |" in md


def test_message_cost_fit_recovers_a_line():
    alpha, beta = 5e-5, 2e9
    P = 4
    seconds = {str(s): (P - 1) * (alpha + s / beta) for s in (1024, 4096, 65536, 1 << 20)}
    fit = fit_message_cost(P, seconds)
    assert fit["alpha_seconds"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_bytes_per_second"] == pytest.approx(beta, rel=1e-6)


def test_model_grows_linearly_in_the_summaries():
    a, b = (model_bytes_per_rank(P, model=TINY, n_params=1000) for P in (2, 3))
    assert b["summaries"] == pytest.approx(2 * a["summaries"]) and model_bytes_per_rank(1, model=TINY, n_params=1)["total"] == 0


def test_cli_parses():
    with pytest.raises(SystemExit) as e:
        main(["bench", "context-parallel", "--help"])
    assert e.value.code == 0
