"""The peak of live tensors during one call, counted by storage: what a call itself holds at its
worst, free of the allocator's caching (a resident-set peak on a CPU also counts memory glibc kept
or mapped). Revisions side by side, so that a resident-set ratio in an A/B can be told from a real
change in what the call keeps alive.

    .venv/bin/python docs/benchmarks/live_peak.py OLD_REV NEW_REV --case kda:train --out FILE.json \
        [--n 4096] [--strategy accelerator|cpu]

Each revision is checked out into a temporary git worktree and run in a fresh process with its
``src`` first on PYTHONPATH: ``linattn.bench.launches.form_call`` (the form at its checkpoint width,
B = 1, float32, the strategy forced) after one warm-up call, under a dispatch mode that enters the
engines' operators (``checks.ENGINE_OPS``) and adds every new storage an op makes to a running
total, which drops as each storage is freed. Shapes only: the figure is the same in every run.
Writes FILE.json with both peaks (bytes above the inputs) and the command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys, weakref
import torch
torch.set_num_threads(2)
from torch.utils._python_dispatch import TorchDispatchMode
from linattn.bench.launches import form_call
from linattn.functional.checks import ENGINE_OPS
form, n, pass_, strategy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
call = form_call(form, n, pass_, strategy)
call()
live, now, peak = set(), [0], [0]

def freed(key, size):
    live.discard(key)
    now[0] -= size

class Live(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        engine = ENGINE_OPS.get(func.name())
        if engine is not None:  # into the engine: the storages its kernel makes are counted too
            with self:
                out = engine._run(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                s = o.untyped_storage()
                key = s.data_ptr()
                if key in live or s.nbytes() == 0:
                    continue
                live.add(key)
                now[0] += s.nbytes()
                weakref.finalize(s, freed, key, s.nbytes())
                peak[0] = max(peak[0], now[0])
        return out

with Live():
    call()
print(json.dumps({"peak_bytes": peak[0]}))
"""


def _peak(rev: str, form: str, n: int, pass_: str, strategy: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            out = subprocess.run([sys.executable, "-c", _CHILD, form, str(n), pass_, strategy], check=True,
                                 capture_output=True, text=True,
                                 env={"PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--case", required=True, help="form:pass, as accelerator_ab.py takes them")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--strategy", default="accelerator", choices=["accelerator", "cpu"])
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    form, pass_ = a.case.split(":")
    result = {"command": "python docs/benchmarks/live_peak.py " + " ".join(sys.argv[1:]), "case": a.case, "n": a.n,
              "strategy": a.strategy,
              "peak_bytes": {rev: _peak(rev, form, a.n, pass_, a.strategy) for rev in (a.old, a.new)}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["peak_bytes"]))


if __name__ == "__main__":
    main()
