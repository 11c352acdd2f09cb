"""One run per output folder: an exclusive ``flock`` on ``out_dir/train.lock`` held for the whole run.

Two runs writing one ``out_dir`` would interleave their metrics and overwrite each other's
checkpoints, so the second one is refused at once, with the holder's pid, host and start time (which
the holder writes into the lock file). The kernel drops a ``flock`` when its process ends however it
ends (exception, signal, SIGKILL, power loss of a local disk), so a stale lock file never blocks
the next run; the file itself stays in place, since removing it would let a third run lock a new
file while a second still holds the removed one. POSIX only (``fcntl``); on NFS it relies on the
client's lock support (Linux emulates ``flock`` with NFS byte-range locks).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path

__all__ = ["LOCK_FILE", "OutDirBusyError", "OutDirLock"]

LOCK_FILE = "train.lock"


class OutDirBusyError(RuntimeError):
    """Another run holds the output folder's lock."""


class OutDirLock:
    """The lock of ``out_dir``: :meth:`acquire` (creating the folder) or raise
    :class:`OutDirBusyError` naming the holder; :meth:`release` (also when never acquired)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        if self._fd is not None:
            raise RuntimeError(f"OutDirLock: {self.path} is already held by this object")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's details stay
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._describe_holder(fd)
            os.close(fd)
            raise OutDirBusyError(
                f"{self.out_dir} is in use by another training run ({holder}; lock file {self.path}): "
                "wait for it to end, or choose another out_dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        import fcntl

        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a lock file left behind names no one
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @staticmethod
    def _describe_holder(fd: int) -> str:
        raw = os.pread(fd, 4096, 0)
        try:
            info = json.loads(raw)
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, TypeError):  # locked an instant ago, details not written yet
            return "holder's pid not written yet"
