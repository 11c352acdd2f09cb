"""What the A/B comparison scripts share: the timing loop of those that interleave two versions of
the package in one process (custom_ops/compare.py, custom_ops/channel_ab.py, one_engine/compare.py,
linear_sums/core_ab.py, scan_rounding/cpu_ab.py) and the earlier version those import
(:func:`old_package`),
and the earlier revision's checkout of those that run each version in processes of its own
(first_call/first_call_ab.py, levels/levels_ab.py), with :func:`both_sides` for those whose child
prints one JSON result (the accuracy A/Bs: kda_energies/*.py, tensor_cores/float16_range.py and
gradients.py)."""
import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
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


def old_package(rev: str):
    """``rev``'s linattn, imported beside this checkout's as ``linattn_old`` (for the A/Bs that
    interleave the two in one process): its ``src/linattn`` extracted (``git archive``) into a
    folder of the system's temporary directory named after the revision, as ``linattn_old``, its
    custom ops renamed (``"linattn::"`` -> ``"linattn_old::"``) so that both register, and that
    folder put first on ``sys.path``. Returns the module."""
    import importlib
    import io
    import tarfile

    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    where = Path(tempfile.gettempdir()) / f"linattn_old_{sha}"
    if not (where / "linattn_old").is_dir():
        archive = subprocess.run(["git", "archive", sha, "src/linattn"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
            for path in Path(tmp, "src", "linattn").rglob("*.py"):
                text = path.read_text()
                if '"linattn::' in text:
                    path.write_text(text.replace('"linattn::', '"linattn_old::'))
            where.mkdir(parents=True, exist_ok=True)
            Path(tmp, "src", "linattn").rename(where / "linattn_old")
    sys.path.insert(0, str(where))
    return importlib.import_module("linattn_old")


def run_child(child: str, src: Path, args: tuple[str, ...] = ()) -> object:
    """``python -c child *args`` with ``src`` first on PYTHONPATH and 2 threads: the JSON value on
    the last line it prints. SystemExit with its stderr when it fails."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", child, *args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the side at {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def both_sides(script: str, old_rev: str, child: str, args: tuple[str, ...] = ()) -> dict:
    """:func:`run_child` on a checkout of ``old_rev`` and on this one: ``{"command", "old", "new",
    "old_rows", "new_rows"}``, the shas short (the new one marked when ``src`` has uncommitted
    changes) and the command that reproduces it (``script``: its path from the repository root)."""
    new_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    with old_checkout(old_rev) as (old_sha, old_src):
        old = run_child(child, old_src, args)
    new = run_child(child, ROOT / "src", args)
    return {"command": f"python {script} " + shlex.join(sys.argv[1:]), "old": old_sha[:7],
            "new": new_sha + (" with uncommitted changes to src" if dirty else ""), "old_rows": old, "new_rows": new}


def accuracy_ab(doc: str, script: str, name: str, child: str, args: tuple[str, ...] = ()) -> tuple[dict, Path]:
    """The command line of an A/B whose child prints one JSON result (``OLD_REV --out DIR``; ``doc``:
    the script's docstring, its first paragraph the help): :func:`both_sides`, written to
    ``DIR/<name>.json``. Returns that result and DIR, for the script's table."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("old_rev")
    ap.add_argument("--out", type=Path, required=True)
    parsed = ap.parse_args()
    res = both_sides(script, parsed.old_rev, child, args)
    parsed.out.mkdir(parents=True, exist_ok=True)
    (parsed.out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    return res, parsed.out


def write_table(path: Path, lines: list[str]) -> None:
    """An A/B's Markdown ``lines`` into ``path``, and printed."""
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


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
