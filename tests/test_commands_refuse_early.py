"""Commands refuse what they would ignore or fail on, before any work (issue 28, defects 1, 2, 5):

- a flag (or field) that the work chosen does not read is refused naming what sets it instead;
- an output folder that cannot be written, and a bad budget, are refused in one line with status 2
  before any measurement or training starts;
- MQAR builds and runs every cell's model once before the first run trains.
"""

from __future__ import annotations

import json
import time

import pytest

from linattn.cli import main
from linattn.experiments.mqar import MqarConfig


def _run(argv, capsys):
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Defect 1: flags accepted and then ignored
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, field, by", [
    (["--d-model", "48"], "d_model", "widths"),
    (["--d-ff", "512"], "d_ff", "ff_ratio"),
    (["--lr", "0.5"], "lr", "lrs"),
    (["--set", "d_model=48"], "d_model", "widths"),
    (["--set", "lr=0.5"], "lr", "lrs"),
])
def test_mqar_refuses_the_fields_its_grid_replaces(argv, field, by, capsys, tmp_path):
    code, _, err, _ = _run(["experiment", "mqar", "--quick", "--out", str(tmp_path / "run"), *argv], capsys)
    assert code == 2
    assert f"{field} (--{field.replace('_', '-')}) is not a setting of this experiment" in err
    assert f"use --{by.replace('_', '-')}" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_mqar_does_not_offer_the_replaced_fields(capsys):
    code, out, _, _ = _run(["experiment", "mqar", "-h"], capsys)
    assert code == 0
    assert "--widths" in out and "--lrs" in out and "--ff-ratio" in out
    for flag in ("--d-model", "--d-ff", "--lr "):
        assert flag not in out
    # the other experiments still offer them: there they are settings
    code, out, _, _ = _run(["experiment", "copy", "-h"], capsys)
    assert "--d-model" in out and "--d-ff" in out and "--lr " in out


def test_mqar_config_leaves_replaced_fields_out_and_refuses_them_by_name():
    config = MqarConfig.preset(quick=True)
    d = config.to_dict()
    assert not {"d_model", "d_ff", "lr"} & set(d)
    assert MqarConfig.from_dict(d) == config
    with pytest.raises(ValueError, match=r"d_model \(--d-model\) is not a setting .* use --widths"):
        MqarConfig.from_dict({**d, "d_model": 64})  # even at the value it would have had
    with pytest.raises(ValueError, match=r"lr \(--lr\) is not a setting"):
        MqarConfig(lr=0.5)
    cell = config.cell_config(32, 1e-2)  # what one run of the grid reads
    assert (cell.d_model, cell.d_ff, cell.lr) == (32, config.ff_ratio * 32, 1e-2)
    assert cell.model_config("softmax", vocab_size=32, max_len=16).d_model == 32


@pytest.mark.parametrize("argv, flag", [
    (["bench", "favor", "--what", "approx", "--n", "100"], "--n"),
    (["bench", "favor", "--what", "approx", "--attention-num-features", "8"], "--attention-num-features"),
    (["bench", "favor", "--what", "approx", "--runs", "2"], "--runs"),
    (["bench", "favor", "--what", "speed", "--seeds", "3"], "--seeds"),
    (["bench", "favor", "--what", "speed", "--num-features", "16"], "--num-features"),
    (["bench", "generate", "--image-batch", "0", "--image-d-model", "64"], "--image-d-model"),
    (["bench", "generate", "--image-batch", "0", "--image-n-layers", "2"], "--image-n-layers"),
    (["bench", "context-parallel", "--no-search", "--budget-gib", "4"], "--budget-gib"),
    (["bench", "sweep", "--no-measure-memory", "--memory-budget-gib", "4"], "--memory-budget-gib"),
])
def test_bench_flags_for_parts_not_run_are_refused(argv, flag, capsys, tmp_path):
    code, _, err, seconds = _run([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and f"error: {flag} is not used: " in err and err.count("\n") == 1
    assert seconds < 10 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Defect 2: output folders and budgets checked before any work
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def unwritable(tmp_path):
    """A path under a plain file: no folder can be created there, whoever runs the test (root too)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker / "out"


@pytest.mark.parametrize("argv", [
    ["bench", "gated"], ["bench", "core"], ["bench", "family"], ["bench", "generate"], ["bench", "sweep"],
    ["bench", "context-parallel"], ["bench", "favor", "--what", "approx"], ["demo"],
    ["experiment", "copy", "--quick"], ["experiment", "mqar", "--quick"], ["convert", "long"],
])
def test_an_unwritable_out_is_refused_before_any_work(argv, unwritable, capsys):
    code, _, err, seconds = _run([*argv, "--out", str(unwritable)], capsys)
    assert code == 2, err
    assert f"--out '{unwritable}': cannot write there" in err and err.count("\n") == 1
    assert seconds < 10  # nothing was measured or trained


@pytest.mark.parametrize("argv", [
    ["bench", "gated"], ["bench", "core"], ["bench", "transformers"], ["bench", "sweep"], ["demo"],
    ["convert", "long"], ["convert", "report"], ["experiment", "report"], ["train"],
])
@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_out_is_refused_before_any_work(argv, empty, capsys, tmp_path, monkeypatch):
    """``Path("")`` is the current folder: an empty --out used to write a benchmark's files there.
    (An experiment's empty ``out`` is its documented default, runs/NAME.)"""
    monkeypatch.chdir(tmp_path)
    code, _, err, seconds = _run([*argv, "--out", empty], capsys)
    assert code == 2, err
    assert "--out" in err and ("is empty" in err or "non-empty" in err) and err.count("\n") == 1, err
    assert seconds < 10 and not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_file_as_out_is_refused(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("")
    code, _, err, _ = _run(["bench", "gated", "--out", str(path)], capsys)
    assert code == 2 and "it exists and is not a folder" in err


def test_documents_need_a_writable_folder(unwritable, capsys, tmp_path):
    code, _, err, _ = _run(["bench", "full", "--doc", str(unwritable / "x.md"), "--out", str(tmp_path)], capsys)
    assert code == 2 and "--doc's folder" in err and "cannot write there" in err
    code, _, err, _ = _run(["experiment", "report", "--out", str(unwritable / "r.md")], capsys)
    assert code == 2 and "cannot write there" in err


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "many"])
def test_context_parallel_budget_must_be_a_positive_number(value, capsys, tmp_path):
    code, _, err, seconds = _run(["bench", "context-parallel", "--budget-gib", value, "--out", str(tmp_path)], capsys)
    assert code == 2 and "argument --budget-gib: must be a" in err and seconds < 10


@pytest.mark.parametrize("flag", ["--time-budget-s", "--memory-budget-gib"])
def test_sweep_budgets_must_be_positive_numbers(flag, capsys, tmp_path):
    code, _, err, _ = _run(["bench", "sweep", flag, "-5", "--out", str(tmp_path)], capsys)
    assert code == 2 and f"argument {flag}: must be a finite number > 0" in err


def test_run_context_parallel_checks_its_arguments_before_measuring(tmp_path):
    from linattn.bench.context_parallel import run_context_parallel

    for kwargs in ({"budget_gib": -1.0}, {"budget_gib": float("nan")}, {"budget_gib": 0}, {"runs": 0},
                   {"ranks": ()}, {"time_n": 0}):
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="run_context_parallel: "):
            run_context_parallel(out=tmp_path / "out", quiet=True, **kwargs)
        assert time.perf_counter() - t0 < 5
    assert not (tmp_path / "out").exists()


def test_run_gated_checks_its_folder_before_measuring(unwritable):
    from linattn.bench.gated import run_gated

    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="cannot write there"):
        run_gated(out=unwritable, ns=(64,), runs=1, repeats=1, hf_repeats=1, memory_n=0, quiet=True)
    assert time.perf_counter() - t0 < 5


# ---------------------------------------------------------------------------------------------
# Defect 5: MQAR checks every cell before the first run
# ---------------------------------------------------------------------------------------------


def test_mqar_refuses_a_cell_that_cannot_run_before_training_any(capsys, tmp_path):
    # bucket 8 divides the first task's N = 16 but not the second's N = 36: the old code trained the
    # whole first task, then failed
    mechanisms = json.dumps(["softmax", {"name": "lsh", "bucket_size": 8}])
    code, _, err, seconds = _run(["experiment", "mqar", "--quick", "--set", f"mechanisms={mechanisms}",
                                  "--seq-lens", "[16, 36]", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "the cell lsh, d_model 16, 4 pairs, N = 36 cannot run" in err and "bucket_size must divide" in err
    assert not (tmp_path / "run").exists() and seconds < 30


def test_mqar_check_runs_passes_the_committed_grid():
    MqarConfig.preset(quick=False).check_runs()
