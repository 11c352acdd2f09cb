"""`linattn bench gated` runs on a tiny grid and states each claim from its measurements."""

import json

import torch

from linattn import functional
from linattn.bench.gated import (
    BASE,
    ENGINE_PROBES,
    OURS,
    WITHIN,
    _memory_child,
    claims,
    favor_product_on_gated_engine,
    linear_on_gated_engine,
    make_inputs,
    run_gated,
)
from linattn.cli import main
from linattn.functional.decayed import decayed_product


def test_gated_bench_tiny(tmp_path):
    result = run_gated(out=tmp_path, ns=(64, 128), repeats=1, hf_repeats=1, memory_n=0, runs=2, quiet=True)
    saved = json.loads((tmp_path / "gated.json").read_text())
    assert saved["command"].startswith("linattn bench gated --ns 64,128")
    assert set(saved["ratios"]["128"]) == set(OURS) and len(saved["ratios"]["128"]["delta"]["runs"]) == 2
    assert set(saved["engine_ratios"]["64"]) == set(ENGINE_PROBES)
    assert set(saved["hf_ratios"]) == set(saved["hf_linear_ratios"]) == {"64", "128"}  # transformers is installed here
    assert "memory" not in saved  # memory_n = 0 skips it
    md = (tmp_path / "gated.md").read_text()
    assert "## Claims" in md
    # per contender a step claim, a time claim for those with a target, transformers' two, KDA's two
    n_claims = len(OURS) + len(WITHIN) + 2 + 2
    assert md.count("- holds: ") + md.count("- **does not hold**: ") == len(result["claims"]) == n_claims


def test_engine_probes_compute_what_the_engines_they_replace_compute():
    # the "specialise, don't route" timings compare like with like only if the results are the same
    x = {k: t.double() for k, t in make_inputs(77, favor=True, requires_grad=False).items()}
    torch.testing.assert_close(linear_on_gated_engine(x["q"], x["k"], x["v"]),
                               functional.linear_attention(x["q"], x["k"], x["v"], causal=True))
    favor = (x["fq"], x["fk"], x["fv"], x["favor_scale"])
    torch.testing.assert_close(favor_product_on_gated_engine(*favor), decayed_product(*favor[:3], running_log_scale=favor[3])[0])


def test_memory_child_checks_finiteness_and_the_reference():
    for name in OURS:  # in this process: the peak means little, the accuracy check is what is tested
        mem = _memory_child(name, 96)
        assert mem["finite"] and mem["rel_err"] < 1e-4, (name, mem)
    assert _memory_child(BASE, 96)["rel_err"] is None  # linear's reference is O(N^2): not run at a long N


def test_claims_follow_the_median_not_the_best_run():
    def s(*runs):
        runs = sorted(runs)
        return {"median": runs[len(runs) // 2], "min": runs[0], "max": runs[-1], "runs": list(runs)}

    result = {"config": {"ns": [64], "memory_n": 0},
              "ratios": {"64": {"gla_head": s(1.2, 1.6, 1.7), "gla_channel": s(1.0, 1.0, 1.0),
                                "delta": s(2.0, 2.0, 2.0), "gated_delta": s(2.0, 2.0, 2.0)}},
              "hf_ratios": {"64": s(9.0, 9.5, 30.0)}, "step_ratios": {name: s(1.0, 1.0, 1.0) for name in OURS},
              "kda_ratios": {"64": s(1.5, 2.1, 2.2)}, "kda_step_ratio": s(1.0, 1.1, 1.2)}
    c = claims(result)
    assert not c["gla_head within 1.5x of linear at N = 64"]["holds"]  # one run at 1.2x is not enough
    assert c["delta within 3.0x of linear at N = 64"]["holds"]
    assert not c["10x faster than transformers at N = 64"]["holds"]  # nor one run at 30x
    assert not c["kda within 2x of Gated DeltaNet at N = 64"]["holds"]  # nor one at 1.5x
    assert c["kda step within 2x of Gated DeltaNet's"]["holds"]


def test_cli_reaches_the_benchmark(tmp_path, monkeypatch):
    import linattn.bench.gated as gated

    seen = {}
    monkeypatch.setattr(gated, "run_gated", lambda **kw: seen.update(kw))
    assert main(["bench", "gated", "--ns", "64", "--repeats", "2", "--memory-n", "0", "--runs", "1",
                 "--out", str(tmp_path)]) == 0
    assert seen == {"out": str(tmp_path), "ns": (64,), "repeats": 2, "hf_repeats": 2, "memory_n": 0, "runs": 1}
