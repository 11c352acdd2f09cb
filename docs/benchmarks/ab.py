"""What the A/B comparison scripts share: the timing loop of those that interleave two versions of
the package in one process (custom_ops/compare.py, custom_ops/channel_ab.py, one_engine/compare.py),
and the earlier revision's checkout of those that run each version in processes of its own
(first_call/first_call_ab.py, levels/levels_ab.py)."""
import contextlib
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def old_checkout(rev: str):
    """``(sha, src)``: ``rev`` resolved, and the ``src`` folder of a temporary git worktree of it
    (for a child's PYTHONPATH), removed again on leaving."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), sha], cwd=ROOT, check=True, capture_output=True)
        try:
            yield sha, old / "src"
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)


def interleaved(f, new, old, calls: int) -> dict:
    """``f(package)`` for the two packages, one warm-up call each, then ``calls`` calls each with the
    order swapped every call (new old, old new, ...): the medians in seconds and their ratio,
    ``{"new": s, "old": s, "new/old": r}``. ``f`` does the whole timed work (forward and backward)."""
    for package in (new, old):
        f(package)
    times = {"new": [], "old": []}
    for rep in range(calls):
        order = (("new", new), ("old", old))
        for label, package in (order[::-1] if rep % 2 else order):
            t0 = time.perf_counter()
            f(package)
            times[label].append(time.perf_counter() - t0)
    row = {label: statistics.median(t) for label, t in times.items()}
    row["new/old"] = row["new"] / row["old"]
    return row


def separate_runs(old_rev: str, runs: int, one_run) -> tuple[str, list[dict]]:
    """``runs`` runs of ``one_run(r, sides) -> samples`` against a checkout of ``old_rev``
    (``sides``: ``{"old": src, "new": src}``, for the children's PYTHONPATH), each with the
    machine's load and reference matmul speed: ``(old sha, [{"samples", "load"}, ...])``."""
    from linattn.bench.harness import OtherLoad

    out = []
    with old_checkout(old_rev) as (sha, old_src):
        sides = {"old": old_src, "new": ROOT / "src"}
        for r in range(runs):
            load = OtherLoad(reference=True)
            samples = one_run(r, sides)
            out.append({"samples": samples, "load": load.finish()})
            print(f"run {r + 1}/{runs} done", flush=True)
    return sha, out


def order(i: int) -> tuple[str, str]:
    """The sides' order for the ``i``-th sample: alternating, old first at even ``i``."""
    return ("old", "new") if i % 2 == 0 else ("new", "old")


def load_lines(runs: list[dict]) -> list[str]:
    """The Markdown lines that give each run's load."""
    lines = ["", "Runs (other processes' CPU share, reference matmul GFLOP/s at start and end):", ""]
    return lines + [f"- run {i + 1}: {json.dumps(r['load'])}" for i, r in enumerate(runs)]
