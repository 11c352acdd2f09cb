"""`linattn bench transformers` end to end at its tiny sizes: both paths timed interleaved for every
subject and pass, decoding at both positions, peak memory in fresh processes, result files written
by the command (claims only at checkpoint sizes)."""

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from linattn.bench import transformers as bench  # noqa: E402
from linattn.cli import main  # noqa: E402


def test_bench_transformers_tiny(tmp_path, capsys):
    out = tmp_path / "bt"
    assert main(["bench", "transformers", "--sizes", "tiny", "--runs", "1", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads((out / "transformers.json").read_text())
    md = (out / "transformers.md").read_text()
    assert result["command"].startswith("linattn bench transformers --repeats 1 --runs 1 --sizes tiny")
    # the code it timed: this checkout's commit (and any uncommitted change under src/)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    if head.returncode == 0:
        assert result["commit"]["head"] == head.stdout.strip() and f"Code: {head.stdout.strip()[:12]}" in md
    else:
        assert result["commit"]["head"] is None and "Code: unknown (not a git checkout)." in md
    want = {f"{s}/{p}/{bench._n(n, 'tiny')}" for s, plan in bench.PLAN.items() for p, ns in plan.items() for n in ns}
    assert set(result["ratios"]) == want
    child = result["runs"][0]["allocators"]["inherited"]
    for key in want:
        for path in bench.PATHS:
            assert child["times"][key][path]["median_s"] > 0
    assert set(result["decode_ratios"]) == {f"{s}/{bench._position(p, 'tiny')}" for s in bench.DECODED
                                            for p in bench.DECODE_POSITIONS}
    assert len(result["memory"]) == sum(len(both) * 2 + len(alone) for both, alone in bench.memory_plan("tiny").values())
    assert {key.split("/")[0] for key in result["memory"]} == set(bench.MEMORY_PLAN)
    assert all(b > 0 for b in result["memory"].values())
    assert result["claims"] == {}  # the targets are the checkpoint widths'
    # every target's setting timed with each path alone, in processes of their own
    alone = {f"{s}/{p}/{bench._n(n, 'tiny')}" for s, p, n in bench.alone_plan("tiny")}
    assert set(result["alone_ratios"]) == alone and alone <= want
    assert {s for s, _, _ in bench.alone_plan("tiny")} == {s for s, _, _ in bench.ALONE}  # every subject alone
    assert bench.alone_plan("checkpoint") == bench.ALONE
    assert ("gdn_core", "prefill", 16384) in bench.ALONE and ("kda_small_model", "prefill", 2048) in bench.ALONE
    for key in alone:
        for path in bench.PATHS:
            assert len(result["alone"][0]["times"][key][path]["all_s"]) == 2  # repeats + 1
    assert "Each path alone" in md
    assert "| gdn_core | prefill | 64 |" in md and "| kda_core | linattn | 1024 |" in md
    assert "other processes' CPU share" in md


def test_bench_transformers_refuses_bad_values(tmp_path):
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench.run_transformers(out=tmp_path, repeats=0)
    with pytest.raises(ValueError, match="sizes must be one of"):
        bench.run_transformers(out=tmp_path, sizes="huge")


def test_bench_transformers_subjects_tiny(tmp_path):
    """``--subjects``: only those are timed (a Mamba-2 model and Kimi Linear's small model here: two
    families, one decoded, one timed alone), into a folder of their own, and the command line written
    says so. Subjects with memory children are left to the whole run above (each child a fresh
    process: tens of seconds)."""
    out = tmp_path / "some"
    assert main(["bench", "transformers", "--sizes", "tiny", "--runs", "1", "--repeats", "1", "--subjects",
                 "ssd_model,kda_small_model", "--out", str(out)]) == 0
    result = json.loads((out / "transformers.json").read_text())
    subjects = ("kda_small_model", "ssd_model")
    assert "--subjects kda_small_model,ssd_model" in result["command"]
    want = {f"{s}/{p}/{bench._n(n, 'tiny')}" for s in subjects for p, ns in bench.PLAN[s].items() for n in ns}
    assert set(result["ratios"]) == want
    assert set(result["decode_ratios"]) == {f"ssd_model/{bench._position(p, 'tiny')}" for p in bench.DECODE_POSITIONS}
    assert result["memory"] == {} and not any(s in bench.MEMORY_PLAN for s in subjects)
    alone = {f"{s}/{p}/{bench._n(n, 'tiny')}" for s, p, n in bench.ALONE if s in subjects}
    assert set(result["alone_ratios"]) == alone == {"kda_small_model/prefill/128"}


def test_bench_transformers_refuses_unknown_subjects(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "transformers", "--subjects", "ssd_core,mamba"])
    assert exit_.value.code != 0
    assert "subjects must be some of" in capsys.readouterr().err
    with pytest.raises(ValueError, match="subjects must be some of"):
        bench.run_transformers(subjects=())
