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

All of that needs the parent alive to run its clean-ups. A parent killed outright (SIGKILL: a
timeout, the OOM killer) runs none, so the children end themselves when their parent ends:

- :func:`die_with_parent`: called first thing in a child, it ends the child (SIGKILL) when its
  parent ends. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel's own signal, then a check
  that the parent did not end before that call. Other POSIX systems: a daemon thread that polls
  ``os.getppid()`` every 0.5 s (an orphan is re-parented, so its parent pid changes). Windows:
  nothing is watched.
- :func:`run_process` runs its command through this file as a small wrapper script (``python -I
  -S processes.py``, about 30 ms) that calls :func:`die_with_parent` and then becomes the command
  (``exec``): on Linux the command runs in the wrapper's process, the signal setting kept. Off
  Linux (POSIX) the wrapper stays as the command's parent and kills the command's whole process
  group when its own parent ends.
- :func:`spawn_pool`: a ``multiprocessing`` pool whose workers call :func:`die_with_parent`.

On Linux the signal comes when the *thread* that started the child ends, not the process: every
function here starts its children from the thread that then waits for them, so the two coincide.
Only the direct child is signalled; a child that starts processes of its own starts them through
these functions, so that each generation watches the one before it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Sequence

__all__ = ["Terminated", "die_with_parent", "run_process", "spawn_pool", "stop_on_sigterm", "stop_processes"]

# How often the fallback off Linux looks at the parent: an orphan ends within about this long.
_POLL_S = 0.5

# How a child learns that its parent ended (see the module docstring); None: it does not.
_WATCH = "pdeathsig" if sys.platform.startswith("linux") else "poll" if os.name == "posix" else None


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


def _end_now() -> None:
    """End this process as the parent-death signal would (SIGKILL; ``os._exit`` where there is none)."""
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(128 + 9)


def _set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when the thread that started it ends.
    Kept across ``exec`` (unless of a set-user-ID program), cleared in a forked child."""
    import ctypes  # here, not at the top: only Linux needs it

    PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    # prctl(int option, unsigned long arg2, ...): its arguments passed at their width
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)):
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG, {sig}): {os.strerror(err)}")


def _watch_parent(parent_pid: int) -> None:
    """A daemon thread that ends this process once its parent is ``parent_pid`` no longer (an
    orphan is re-parented to init or a subreaper), looking every ``_POLL_S`` seconds."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        _end_now()

    threading.Thread(target=watch, name="linattn-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: int | None = None, *, watch: str | None = _WATCH) -> None:
    """End this process (SIGKILL) when its parent process ends, however that ends. Call it first
    thing in a child.

    ``parent_pid``: the pid of the process that started this one; None: the ``multiprocessing``
    parent (``multiprocessing.parent_process()``), right for a child of the ``spawn`` and ``fork``
    start methods, not of ``forkserver`` (there the server is the parent). A parent that has
    already ended (this process's parent is not ``parent_pid`` any more) ends this process at once.

    ``watch``: ``"pdeathsig"`` (Linux: the kernel signals this process when the parent's thread
    that started it ends), ``"poll"`` (POSIX: a daemon thread compares ``os.getppid()`` with
    ``parent_pid`` every 0.5 s) or None (nothing watched); the default is the first of these
    that this platform has."""
    if watch not in ("pdeathsig", "poll", None):
        raise ValueError(f"die_with_parent: watch must be 'pdeathsig', 'poll' or None, got {watch!r}")
    if watch == "pdeathsig" and not sys.platform.startswith("linux"):
        raise ValueError(f"die_with_parent: watch='pdeathsig' needs Linux, this is {sys.platform}")
    if watch == "poll" and os.name != "posix":
        raise ValueError(f"die_with_parent: watch='poll' needs a POSIX system, this is {os.name}")
    if parent_pid is None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        if parent is None:
            raise ValueError("die_with_parent: parent_pid is None and this process is not a multiprocessing child")
        parent_pid = parent.pid
    if watch == "pdeathsig":
        _set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent ended before the signal was set: none will come
            _end_now()
    elif watch == "poll":
        _watch_parent(parent_pid)


def spawn_pool(processes: int) -> Any:
    """``multiprocessing.get_context("spawn").Pool(processes)`` whose workers call
    :func:`die_with_parent` (this process) as they start. Spawn, not fork: a forked worker would
    inherit this process's torch thread pools. Use it as a context manager: leaving the block by
    any exception terminates the workers.

    A worker the pool starts later, to replace one that ended, is started by the pool's own
    thread; on Linux it is then signalled when that thread ends, at the pool's close or terminate."""
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(processes, initializer=die_with_parent, initargs=(os.getpid(),))


def _guarded(cmd: Sequence[str], *, watch: str | None) -> list[str]:
    """``cmd`` run through this file as a wrapper script (:func:`_wrapper_main`) that makes it end
    when this process does; ``cmd`` itself when ``watch`` is None."""
    if watch is None:
        return list(cmd)
    # -I -S: the wrapper reads no environment variables, user or site packages (a fast start), and
    # does not put this file's folder first on its path, where linattn's modules would shadow the
    # standard library's
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), watch, str(os.getpid()), *cmd]


def _wrapper_main(argv: list[str]) -> None:
    """``python processes.py WATCH PARENT_PID CMD...``: run ``CMD`` so that it ends when the
    process ``PARENT_PID`` does.

    ``pdeathsig``: set the parent-death signal, then become ``CMD`` (``exec``). ``poll``: stay as
    ``CMD``'s parent, watching ``os.getppid()``; when it changes, kill this process group (``CMD``
    and what it started) if this process leads it, as under :func:`run_process`, else ``CMD``."""
    watch, parent_pid, cmd = argv[0], int(argv[1]), argv[2:]
    if watch == "pdeathsig":
        die_with_parent(parent_pid, watch=watch)
    try:
        if watch == "pdeathsig":
            os.execvp(cmd[0], cmd)
        child = subprocess.Popen(cmd)
    except OSError as e:
        print(f"linattn.processes: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        os._exit(127)  # as a shell does for a command it cannot run
    leader = os.getpgid(0) == os.getpid()
    while True:
        try:
            status = child.wait(timeout=_POLL_S)
            break
        except subprocess.TimeoutExpired:
            if os.getppid() != parent_pid:
                if leader:
                    os.killpg(0, signal.SIGKILL)  # this process included
                child.kill()
                _end_now()
    if status < 0:  # CMD was killed by a signal: so is this process, as run_process would see CMD
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


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
    killed too.

    The child also ends when this process ends without a clean-up (SIGKILL): see
    :func:`die_with_parent`. A command that cannot be started makes the child exit 127 with the
    reason on its stderr (where ``subprocess.run`` would raise ``OSError``)."""
    proc = subprocess.Popen(_guarded(cmd, watch=_WATCH), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
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


if __name__ == "__main__":  # the wrapper of run_process's children (_guarded)
    _wrapper_main(sys.argv[1:])
