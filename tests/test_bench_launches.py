"""`linattn bench launches` (issue 44): the launch counter on calls with known counts, the
accelerator strategy's launches flat in N for every chunked form (on this CPU, at small widths),
and the command's files."""

from __future__ import annotations

import json

import pytest
import torch

from linattn.bench import launches as bench
from linattn.bench.launches import count_launches
from linattn.cli import main


# ---------------------------------------------------------------------------------------------
# The counter
# ---------------------------------------------------------------------------------------------


def test_an_add_is_one_launch():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    count = count_launches(lambda: x + y)
    assert count.total == 1 and count.by_op == {"aten::add": 1}


def test_views_launch_nothing():
    x = torch.randn(4, 6, 8)
    count = count_launches(lambda: (x.view(24, 8), x.reshape(4, 48), x.transpose(0, 1), x[1:, ::2], x.unsqueeze(0),
                                    x.permute(2, 0, 1), x.flatten(), x.expand(3, 4, 6, 8), x.select(0, 1)))
    assert count.total == 0, count.by_op


def test_in_place_adds_in_a_loop_count_each():
    x, y = torch.zeros(16), torch.ones(16)

    def loop():
        for _ in range(10):
            x.add_(y)

    count = count_launches(loop)
    assert count.total == 10 and count.by_op == {"aten::add_": 10}


def test_a_composite_op_counts_what_it_calls():
    a, b = torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    count = count_launches(lambda: torch.matmul(a, b))
    assert count.total == 1 and count.by_op == {"aten::bmm": 1}  # not aten::matmul, which only calls bmm


def test_a_dtype_conversion_is_one_copy():
    x = torch.randn(8, 8)
    count = count_launches(lambda: x.to(torch.float64))
    assert count.total == 1 and count.by_op == {"aten::copy_": 1}


def test_contiguous_of_a_contiguous_tensor_is_nothing():
    x = torch.randn(8, 8)
    assert count_launches(lambda: x.contiguous()).total == 0
    assert count_launches(lambda: x.t().contiguous()).by_op == {"aten::copy_": 1}  # a real copy counts


# ---------------------------------------------------------------------------------------------
# The accelerator strategy's launches do not grow with N
# ---------------------------------------------------------------------------------------------

SHORT, LONG = 256, 4096


def _launches(form: str, n: int, pass_: str, strategy: str) -> int:
    call = bench.form_call(form, n, pass_, strategy, quick=True)  # 2 heads of 16
    call()  # warm-up, as the benchmark does
    return count_launches(call).total


@pytest.mark.parametrize("pass_", bench.PASSES)
@pytest.mark.parametrize("form", bench.FORMS)
def test_accelerator_launches_are_flat_in_n(form, pass_):
    short, long = _launches(form, SHORT, pass_, "accelerator"), _launches(form, LONG, pass_, "accelerator")
    assert long <= bench.GROWTH * short, f"{form} {pass_}: {long} launches at N = {LONG}, {short} at N = {SHORT}"
    assert long <= bench.LIMITS[pass_], f"{form} {pass_}: {long} launches at N = {LONG}"


@pytest.mark.parametrize("form", [f for f in bench.FORMS if bench.KERNEL_FORMS[f].delta])
def test_the_cpu_strategy_loops_over_chunks(form):
    """The CPU strategy's launches grow with N (a loop over chunks): the flatness above is the
    accelerator's, not a count that cannot see the loop."""
    short, long = _launches(form, SHORT, "prefill", "cpu"), _launches(form, 2048, "prefill", "cpu")
    assert long > 3 * short, f"{form}: {long} launches at N = 2048, {short} at N = {SHORT}"


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def test_bench_launches_quick_writes_both_files(tmp_path):
    out = tmp_path / "launches"
    # in this process: a fresh one per count would start 56 of them (~4 s each); the test below runs one
    argv = ["bench", "launches", "--quick", "--no-fresh-processes", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "launches.json").read_text())
    md = (out / "launches.md").read_text()
    assert result["complete"] and result["command"] == "linattn " + " ".join(argv)
    assert result["config"]["n"] == list(bench.QUICK_NS) and result["commit"]["head"] is not None
    keys = {(r["form"], r["n"], r["pass"], r["strategy"]) for r in result["rows"]}
    assert keys == {(f, n, p, s) for f in bench.FORMS for n in bench.QUICK_NS for p in bench.PASSES
                    for s in bench.STRATEGIES}
    for row in result["rows"]:
        assert "error" not in row, row
        assert row["launches"] == sum(row["by_op"].values()) > 0 and len(row["top"]) <= bench.TOP_OPS
        assert row["peak_bytes"] >= 0
    assert {(v["form"], v["pass"]) for v in result["verdicts"]} == {(f, p) for f in bench.FORMS for p in bench.PASSES}
    assert all(v["holds"] for v in result["verdicts"]), result["verdicts"]
    for form in bench.FORMS:
        for n in bench.QUICK_NS:
            assert f"| `{form}` | {n} | prefill |" in md and f"| `{form}` | {n} | train |" in md


def test_a_count_in_a_fresh_process_is_the_count_here():
    here = bench.measure("linear", 64, "train", "accelerator", quick=True)
    there = bench._measure_in_child("linear", 64, "train", "accelerator", quick=True)
    assert there["launches"] == here["launches"] and there["by_op"] == here["by_op"]


def test_a_killed_count_is_a_row(monkeypatch):
    import signal
    import subprocess

    monkeypatch.setattr(bench, "run_process", lambda argv: subprocess.CompletedProcess(argv, -signal.SIGKILL, "", ""))
    row = bench._measure_in_child("kda", 16384, "train", "accelerator", quick=False)
    assert row["error"].startswith("killed (SIGKILL), most likely for memory")


def test_a_broken_limit_is_said():
    result = {"config": {"forms": ["kda", "delta", "linear"], "n": [4096, 16384]}, "rows": [
        {"form": f, "n": n, "pass": "prefill", "strategy": "accelerator", "launches": c, "top": []}
        for f, n, c in (("kda", 4096, 200), ("kda", 16384, 250), ("delta", 4096, 100), ("delta", 16384, 160),
                        ("linear", 4096, 48))]}
    result["rows"].append({"form": "linear", "n": 16384, "pass": "prefill", "strategy": "accelerator",
                           "error": "killed (SIGKILL), most likely for memory"})
    kda, delta, linear = bench.verdicts(result)
    assert kda["target"] and not kda["within_limit"] and kda["flat"] and not kda["holds"]
    assert not delta["target"] and delta["within_limit"] and not delta["flat"] and delta["growth"] == 1.6
    assert linear["holds"] is None and linear["error"] == "N = 16384: killed (SIGKILL), most likely for memory"
    md = bench.format_launches({"command": "c", "complete": False, "commit": {"head": None, "uncommitted": None},
                                "machine": {"processor": "p", "cpu_count": 2, "torch": "t"},
                                "config": {**result["config"], "widths": {}, "fresh_processes": True},
                                "rows": result["rows"], "verdicts": [kda, delta, linear]})
    assert "- **does not hold**: `kda` prefill" in md and "- does not hold (no target): `delta` prefill" in md
    assert "- not measured: `linear` prefill, accelerator: N = 16384: killed" in md and "**Incomplete**" in md


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="forms must be some of"):
        bench.run_launches(tmp_path, forms=("softmax",))
    with pytest.raises(ValueError, match="n must be sequence lengths"):
        bench.run_launches(tmp_path, n=(0,))
    assert not list(tmp_path.iterdir())  # refused before any work


def test_a_fused_op_counts_itself_and_the_copy_below_it():
    """baddbmm copies its input into the output (a copy_ below it) and multiplies into it: two
    kernels, not only the copy (what counting leaves alone saw)."""
    a, b, c = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 3, 5)
    count = count_launches(lambda: torch.baddbmm(c, a, b))
    assert count.by_op["aten::baddbmm"] == 1
    assert count.total == sum(count.by_op.values()) >= 1
