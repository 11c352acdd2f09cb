"""Child processes that never outlive the command that started them.

Below every tier (no linattn imports). The benchmarks measure in fresh processes, experiments
time steps in them, the context-parallel benchmark starts ranks from a launcher: when the command
is stopped (SIGINT, SIGTERM, a timeout, an error), whatever it started must stop too, or an orphan
keeps a core busy for the rest of its measurement and skews every timing after it.

- :func:`stop_on_sigterm`: SIGTERM raises :class:`Terminated` in the main thread, as SIGINT raises
  KeyboardInterrupt, so that the stack unwinds through the ``finally`` blocks that stop children;
  ``linattn`` then exits 143 (130 for SIGINT), as a shell reports a process killed by the signal.
- :func:`run_process`: ``subprocess.run`` with captured text output, the child in a process group
  of its own that is killed whole (its own children included) when the call ends, however it ends.
- :func:`stop_processes`: kill and reap ``multiprocessing`` processes still running (a pool's
  workers, spawned ranks) when their parent gives up on them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from typing import Any, Iterable, Iterator, Sequence

__all__ = ["Terminated", "run_process", "stop_on_sigterm", "stop_processes"]


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM under :func:`stop_on_sigterm`. A BaseException, as
    KeyboardInterrupt is, so that ``except Exception`` blocks do not swallow it."""

    exit_status = 128 + signal.SIGTERM  # 143


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere, or off
    the main thread, the block changes nothing). The previous handler is restored at the end; a
    handler installed inside the block (the training loop's, which checkpoints first) takes
    precedence while it is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group ``proc`` leads (the child and everything it started), then reap
    the child. A group already gone is not an error."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # no process groups (Windows): the child alone
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_process(cmd: Sequence[str], *, env: dict[str, str] | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end and return its ``CompletedProcess`` (stdout and stderr as text),
    as ``subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)`` does.

    The child leads a process group of its own (a new session), so a terminal's Ctrl-C reaches this
    process only, and this call decides: when it ends by any exception (KeyboardInterrupt,
    :class:`Terminated`, ``subprocess.TimeoutExpired``) the whole group is killed before the
    exception goes on, and after a normal end any process the child left behind in its group is
    killed too."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        _kill_group(proc)  # before Popen's own clean-up, which would wait for a child still running
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def stop_processes(processes: Iterable[Any], *, grace_s: float = 5.0) -> None:
    """Terminate (SIGTERM), then after ``grace_s`` kill, and reap every ``multiprocessing.Process``
    of ``processes`` that is still alive."""
    processes = [p for p in processes if p.is_alive()]
    for p in processes:
        p.terminate()
    for p in processes:
        p.join(grace_s)
        if p.is_alive():
            p.kill()
            p.join()
