"""Child processes never outlive the command that started them (linattn.processes): SIGTERM and
SIGINT to a benchmark or an experiment stop its measurement children, pool workers and ranks, and
the command exits 143 / 130; SIGKILL to the parent, which runs no clean-up, ends them too.

Linux only (the descendants are read from /proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linattn.processes import Terminated, run_process, stop_on_sigterm

from conftest import sigint_default

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")

LINATTN = [sys.executable, "-m", "linattn"]


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process now."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            out[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, frontier = _parents(), set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has stopped


def _wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _stop_command(args: list[str], *, at_least: int, sig: signal.Signals, tmp_path: Path) -> tuple[int, set[int], str]:
    """Start ``linattn *args``, wait until it has ``at_least`` descendants (its children at work),
    send ``sig`` to it alone, and return its exit status, the descendants seen, its stderr."""
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.Popen([*LINATTN, *args], stdout=subprocess.DEVNULL, stderr=fh, cwd=tmp_path,
                                preexec_fn=sigint_default)
    try:
        def working() -> set[int] | None:
            found = _descendants(proc.pid)
            return found if len(found) >= at_least else None

        seen = _wait_for(working, 180, f"{at_least} child processes of linattn {' '.join(args)}")
        time.sleep(1.0)  # let them get into their work
        seen |= _descendants(proc.pid)
        proc.send_signal(sig)
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, seen, err.read_text()


def _assert_all_stopped(seen: set[int], timeout: float = 20) -> None:
    # a multiprocessing resource tracker ends once its pipe closes: give the leftovers a moment
    try:
        _wait_for(lambda: not any(_alive(p) for p in seen), timeout, f"the children {sorted(seen)} to stop")
    finally:  # never leave one behind, busy, for the tests after this one
        for p in seen:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("sig, status, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                               (signal.SIGINT, 130, "interrupted (SIGINT)")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_benchmarks_measurement_child(sig, status, said, tmp_path):
    got, seen, err = _stop_command(["bench", "gated", "--ns", "65536", "--repeats", "1", "--hf-repeats", "1",
                                    "--memory-n", "0", "--runs", "1", "--out", "out"],
                                   at_least=1, sig=sig, tmp_path=tmp_path)
    assert got == status, err
    assert said in err and "Traceback" not in err
    _assert_all_stopped(seen)
    assert not (tmp_path / "out" / "gated.json").exists()


def test_sigterm_stops_mqar_workers(tmp_path):
    # two spawned workers (and the resource tracker multiprocessing starts beside them)
    status, seen, err = _stop_command(["experiment", "mqar", "--quick", "--workers", "2", "--steps", "100000",
                                       "--out", "out"], at_least=2, sig=signal.SIGTERM, tmp_path=tmp_path)
    assert status == 143, err
    _assert_all_stopped(seen)


def test_sigterm_stops_context_parallel_ranks(tmp_path):
    # the measurement's launcher process, its two gloo ranks (and their resource tracker)
    status, seen, err = _stop_command(["bench", "context-parallel", "--ranks", "2", "--time-n", "262144", "--runs", "1",
                                       "--no-search", "--out", "out"], at_least=3, sig=signal.SIGTERM,
                                      tmp_path=tmp_path)
    assert status == 143, err
    _assert_all_stopped(seen)


def _sleeper_with_grandchild(pid_file: Path) -> list[str]:
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    return [sys.executable, "-c", code]


def test_run_process_kills_the_whole_group_on_a_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process(_sleeper_with_grandchild(pid_file), timeout=3)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    _wait_for(lambda: not _alive(grandchild), 10, "the grandchild to stop")


def test_run_process_kills_the_whole_group_when_terminated(tmp_path):
    pid_file = tmp_path / "grandchild.pid"

    def term_soon(signum, frame):  # SIGALRM stands in for a SIGTERM from outside
        os.kill(os.getpid(), signal.SIGTERM)

    sigterm_before = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGALRM, term_soon)
    try:
        with stop_on_sigterm(), pytest.raises(Terminated):
            signal.alarm(3)
            run_process(_sleeper_with_grandchild(pid_file))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert signal.getsignal(signal.SIGTERM) is sigterm_before  # the block restores the handler
    grandchild = int(pid_file.read_text())
    _wait_for(lambda: not _alive(grandchild), 10, "the grandchild to stop")


def test_run_process_returns_what_subprocess_run_does(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"]
    got, want = run_process(cmd), subprocess.run(cmd, capture_output=True, text=True)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr) == (3, "out\n", "err\n")


# ---------------------------------------------------------------------------------------------
# SIGKILL to the parent: no clean-up runs, the children end themselves (die_with_parent)
# ---------------------------------------------------------------------------------------------

# A parent that starts one child by one of linattn's ways, the child writing "pid ppid" to a file
# and then sleeping; the test kills the parent with SIGKILL.
_PARENT = '''
import os, subprocess, sys, time


def sleep_forever(pid_file):
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {os.getppid()}")
    os.replace(pid_file + ".tmp", pid_file)
    time.sleep(600)


def spawned(pid_file, watch):
    from linattn.processes import die_with_parent

    die_with_parent() if watch == "default" else die_with_parent(watch=watch)
    sleep_forever(pid_file)


if __name__ == "__main__":
    how, pid_file = sys.argv[1], sys.argv[2]
    sleeper = [sys.executable, __file__, "sleep", pid_file]
    if how == "sleep":
        sleep_forever(pid_file)
    elif how == "run_process":
        from linattn.processes import run_process

        run_process(sleeper)
    elif how == "run_process_poll":  # the wrapper off Linux, here as it runs there
        from linattn.processes import _guarded

        subprocess.run(_guarded(sleeper, watch="poll"), start_new_session=True)
    elif how == "spawn_pool":
        from linattn.processes import spawn_pool

        with spawn_pool(1) as pool:
            pool.apply(sleep_forever, (pid_file,))
    else:  # a spawned multiprocessing child calling die_with_parent() itself, as spawn_local's ranks can
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=spawned, args=(pid_file, how))
        child.start()
        child.join()
'''


@pytest.mark.parametrize("how", ["run_process", "run_process_poll", "spawn_pool", "default", "poll"])
def test_a_child_ends_within_seconds_when_its_parent_is_killed(how, tmp_path):
    script, pid_file, err = tmp_path / "parent.py", tmp_path / "child.pid", tmp_path / "parent.err"
    script.write_text(_PARENT)
    with open(err, "w") as fh:
        parent = subprocess.Popen([sys.executable, str(script), how, str(pid_file)], stdout=subprocess.DEVNULL,
                                  stderr=fh, cwd=tmp_path)
    child = middle = None
    try:
        def started() -> bool:
            assert parent.poll() is None, f"the parent ended ({parent.returncode}): {err.read_text()}"
            return pid_file.exists()

        _wait_for(started, 120, "the child to start")
        child, child_parent = map(int, pid_file.read_text().split())
        # run_process's wrapper becomes the command (exec) where it can; off Linux it stays between
        middle = child_parent if how == "run_process_poll" else None
        assert child_parent != parent.pid if middle else child_parent == parent.pid
        assert _alive(child) and (middle is None or _alive(middle))
        parent.kill()
        parent.wait()
        _wait_for(lambda: not _alive(child) and not (middle and _alive(middle)), 5,
                  f"the child {child} to end after its parent {parent.pid} was killed")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in (child, middle):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_run_process_says_when_its_command_cannot_run(tmp_path):
    got = run_process([str(tmp_path / "missing")])
    assert got.returncode == 127 and "cannot run" in got.stderr and "missing" in got.stderr


def test_die_with_parent_needs_a_parent():
    from linattn.processes import die_with_parent

    with pytest.raises(ValueError, match="not a multiprocessing child"):
        die_with_parent()
    with pytest.raises(ValueError, match="watch must be"):
        die_with_parent(os.getppid(), watch="signal")


@pytest.mark.parametrize("args, at_least", [
    (["bench", "gated", "--ns", "65536", "--repeats", "1", "--hf-repeats", "1", "--memory-n", "0", "--runs", "1",
      "--out", "out"], 1),
    (["experiment", "mqar", "--quick", "--workers", "2", "--steps", "100000", "--out", "out"], 2),
    # the launcher (run_process's child) and its two gloo ranks (spawn_local's, which die with it)
    (["bench", "context-parallel", "--ranks", "2", "--time-n", "262144", "--runs", "1", "--no-search", "--out", "out"],
     3),
], ids=["bench gated", "experiment mqar", "bench context-parallel"])
def test_sigkill_to_a_command_ends_its_children(args, at_least, tmp_path):
    status, seen, err = _stop_command(args, at_least=at_least, sig=signal.SIGKILL, tmp_path=tmp_path)
    assert status == -signal.SIGKILL, err
    _assert_all_stopped(seen, timeout=5)


def test_the_signal_tests_pass_when_sigint_is_ignored():
    # as under `make test &` in a script: SIGINT ignored from the start, in pytest and what it starts
    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    tests = Path(__file__).parent
    nodes = [f"{tests / 'test_processes.py'}::test_a_signal_stops_a_benchmarks_measurement_child[SIGINT]",
             f"{tests / 'test_train.py'}::test_signal_then_resume_is_bitwise_identical[linear]"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes],
                          cwd=tests.parent, capture_output=True, text=True, timeout=600, preexec_fn=ignore_sigint)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
