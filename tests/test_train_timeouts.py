"""`linattn train` under several processes: a stopped rank fails the others after
``--collective-timeout-s`` (one line, the checkpoint kept), and a context-parallel configuration
that linattn refuses is one line on rank 0, before any process group is joined."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from linattn.cli import main
from linattn.train import TrainConfig, latest_checkpoint, load_train_checkpoint
from linattn.train.dist import MAX_COLLECTIVE_TIMEOUT_S, DistInfo, collective_timeout, context_groups, free_port
from ranks import gloo_ranks

TINY_FLAGS = ["--vocab-size", "20", "--max-len", "16", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
              "--d-ff", "32", "--seq-len", "16", "--batch-size", "4", "--eval-every", "0", "--warmup-steps", "1",
              "--data-recall-pairs", "4", "--data-recall-queries", "2", "--data-recall-tokens", "4000",
              "--data-recall-val-tokens", "400", "--device", "cpu", "--quiet"]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world`` processes on this machine."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


# ---------------------------------------------------------------------------------------------
# collective_timeout_s: the field, its flag, and what a stopped rank does to the others
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, -math.inf, math.nan, True, "5", 1e14, MAX_COLLECTIVE_TIMEOUT_S * 1.01])
def test_collective_timeout_must_be_positive_and_at_most_ten_years_or_inf(value):
    with pytest.raises(ValueError, match=r"TrainConfig: collective_timeout_s must be a number of seconds in "
                                         r"\(0, 315360000\] \(ten years.*or inf \(no limit\), got"):
        TrainConfig(collective_timeout_s=value)


def test_an_infinite_collective_timeout_is_the_longest_torch_holds(tmp_path, capsys):
    """inf (and the longest finite value) become a timedelta that every torch.distributed clock
    holds: two ranks join and all-reduce with it (near timedelta's own maximum they would fail at
    once, "timed out")."""
    assert TrainConfig(collective_timeout_s=math.inf).collective_timeout_s == math.inf
    assert collective_timeout(math.inf) == collective_timeout(MAX_COLLECTIVE_TIMEOUT_S)
    assert collective_timeout(math.inf).total_seconds() == MAX_COLLECTIVE_TIMEOUT_S
    assert main(["train", "--collective-timeout-s", "inf", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["collective_timeout_s"] == math.inf
    results = gloo_ranks(_all_reduce_without_limit, 2, tmp_path)
    assert [r["sum"] for r in results] == [3.0, 3.0], results


def test_collective_timeout_flag_default_and_resume(tmp_path, capsys):
    assert TrainConfig().collective_timeout_s == 300.0
    assert main(["train", "--collective-timeout-s", "2.5", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["collective_timeout_s"] == 2.5
    with pytest.raises(SystemExit) as e:
        main(["train", "--collective-timeout-s", "0", "--print-config"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("linattn train: error: --collective-timeout-s: TrainConfig: collective_timeout_s must be "
                          "a number of seconds in (0, 315360000]") and err.count("\n") == 1, err
    # how long to wait for other ranks does not change the run: a resumed run may change it
    out = str(tmp_path / "run")
    assert main(["train", *TINY_FLAGS, "--max-steps", "1", "--out", out]) == 0
    assert main(["train", "--resume", "--out", out, "--max-steps", "2", "--collective-timeout-s", "60", "--quiet"]) == 0
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"] == 2


def _late_context_gather(rank: int, P: int) -> dict:
    """Rank 1 arrives 20 s late at an all-gather of the context group made with a 1 s timeout."""
    info = DistInfo(rank=rank, world_size=P, local_rank=rank, device=torch.device("cpu"), owns_group=False,
                    collective_timeout_s=1.0)
    group = context_groups(info, P)
    t0 = time.monotonic()
    error = None
    if rank == 0:
        try:
            dist.all_gather([torch.zeros(1) for _ in range(P)], torch.ones(1), group=group)
        except RuntimeError as e:
            error = str(e)
    dist.barrier()  # the world group (60 s): rank 1 waits here for rank 0 to give up
    return {"waited_s": time.monotonic() - t0, "error": error}


def _all_reduce_without_limit(rank: int, P: int) -> dict:
    info = DistInfo(rank=rank, world_size=P, local_rank=rank, device=torch.device("cpu"), owns_group=False,
                    collective_timeout_s=math.inf)
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t, group=context_groups(info, P))
    return {"sum": float(t)}


def test_context_groups_take_the_collective_timeout(tmp_path):
    """Without the timeout passed on, a context group waits gloo's default 30 minutes."""
    r0, _ = gloo_ranks(_late_context_gather, 2, tmp_path)
    assert r0["error"] is not None and "timed out" in r0["error"].lower(), r0
    assert r0["waited_s"] < 15, r0


def test_a_stopped_rank_fails_the_other_within_the_timeout(tmp_path):
    """Rank 1 is stopped (SIGSTOP) after the first checkpoint: rank 0 exits 1 after about
    ``--collective-timeout-s`` with one line naming what it waited in, and the checkpoint loads."""
    timeout_s = 8  # not less: it bounds the rendezvous and first step too, on a loaded 2-core machine
    out = tmp_path / "run"
    port = free_port()
    argv = [sys.executable, "-m", "linattn", "train", *TINY_FLAGS, "--context-parallel", "2", "--max-steps", "100000",
            "--ckpt-every", "2", "--log-every", "1", "--collective-timeout-s", str(timeout_s), "--out", str(out)]
    procs = [subprocess.Popen(argv, env=_rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest.json").is_file():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise AssertionError(f"the run did not reach its first checkpoint: {[p.communicate() for p in procs]}")
            time.sleep(0.05)
        os.kill(procs[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout_s + 60)
        waited = time.monotonic() - t0
    finally:
        procs[1].kill()  # SIGKILL ends a stopped process too
        procs[1].communicate()
        procs[0].kill()
        procs[0].communicate()
    print(f"rank 0 exited {waited:.1f} s after rank 1 was stopped (timeout {timeout_s} s)")
    assert procs[0].returncode == 1, err
    # it waited for the timeout (less when rank 0 was already waiting as rank 1 stopped), not 30 minutes
    assert timeout_s / 2 < waited < timeout_s + 20, (waited, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, err
    m = re.fullmatch(rf"linattn train: error: rank 0 waited {timeout_s} s for the other ranks in (.+) "
                     rf"\(--collective-timeout-s {timeout_s}\): a rank stopped or is stuck; "
                     r"the checkpoint of step (\d+) in (\S+) is kept", lines[0])
    assert m, lines[0]
    folder = latest_checkpoint(out)
    assert str(folder) == m.group(3)
    step = load_train_checkpoint(folder)["meta"]["step"]  # complete: every file there, hashes verified
    assert step == int(m.group(2)) and step >= 2 and step % 2 == 0


# ---------------------------------------------------------------------------------------------
# Context parallelism refused under torchrun: one line, on rank 0, before any group is joined
# ---------------------------------------------------------------------------------------------

REFUSED = {
    "packed": (2, ["--data-document-separator", "0"],
               "--context-parallel: TrainConfig: context_parallel = 2 with data.document_separator = 0: packed "
               "documents are not sharded across ranks"),
    "world": (3, [], "--context-parallel: TrainConfig: context_parallel = 2 must divide the number of processes 3"),
    "lsh": (2, ["--attention", "lsh"], "TrainConfig: model: layer 0 uses 'lsh' attention, which has no sharded form"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_context_parallelism_is_one_line_before_torchruns_report(tmp_path, case):
    nprocs, extra, message = REFUSED[case]
    out = tmp_path / "run"
    argv = ["-m", "linattn", "train", *TINY_FLAGS, "--context-parallel", "2", "--max-steps", "1", *extra,
            "--out", str(out)]
    proc = subprocess.run([TORCHRUN, "--nproc-per-node", str(nprocs), "--master-port", str(free_port()), *argv],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    text = proc.stdout
    assert proc.returncode != 0, text
    lines = text.splitlines()
    ours = [i for i, line in enumerate(lines) if line.startswith("linattn train: error: ")]
    assert len(ours) == 1, text  # rank 0 only
    assert lines[ours[0]].startswith(f"linattn train: error: {message}"), text
    # torchrun's own report (its "E..." log line and its traceback) comes after linattn's line
    theirs = [i for i, line in enumerate(lines) if re.match(r"E\d{4} ", line) or "Traceback" in line]
    assert theirs and ours[0] < theirs[0], text
    assert not re.search(r'File ".*linattn', text), text  # no traceback through linattn's code
    assert re.search(r"exitcode\s*: 2\b", text), text  # the root cause torchrun names: linattn's status 2
    assert not out.exists()  # refused before any work

    # another rank, alone: status 2, silent, and without waiting for a group it would never join
    rank1 = subprocess.run([sys.executable, *argv], env=_rank_env(1, nprocs, free_port()), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    assert rank1.returncode == 2 and rank1.stdout == rank1.stderr == "", (rank1.stdout, rank1.stderr)
