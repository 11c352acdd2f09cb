"""One training step with context parallelism on 2 ranks, this code against the code before issue 30's
change (commit f7ba87d: four per-mechanism skeletons in distributed/context.py, the mechanisms
branching on context_parallel), each side `linattn bench context-parallel --ranks 1,2 --time-n 32768
--no-search --runs 1` in fresh processes (a 2-layer Gated DeltaNet LM, d_model 256, batch 1,
float32; the step is forward, backward, gradient all-reduce, AdamW; the slowest rank's time), the
two sides alternated, three times each: old, new, old, new, old, new.

A one-off comparison, not a `linattn bench` command. The old code is a worktree of f7ba87d:

    git worktree add /tmp/oldcp f7ba87d
    .venv/bin/python docs/benchmarks/context_parallel_ab/run.py

Writes run_{old,new}_{1,2,3}/context_parallel.json (each with its load and reference matmul speed)
and summary.md beside this file.
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
root = here.parent.parent.parent
sides = {"old": "/tmp/oldcp/src", "new": str(root / "src")}
if "--summary" not in sys.argv:
    for i in (1, 2, 3):
        for side, src in sides.items():
            out = here / f"run_{side}_{i}"
            env = dict(os.environ, PYTHONPATH=src)
            subprocess.run([sys.executable, "-m", "linattn", "bench", "context-parallel", "--ranks", "1,2",
                            "--time-n", "32768", "--no-search", "--runs", "1", "--out", str(out)], env=env,
                           check=True, cwd=root)

rows = {}
for side in sides:
    rows[side] = []
    for i in (1, 2, 3):
        d = json.loads((here / f"run_{side}_{i}" / "context_parallel.json").read_text())
        t = d["timing"][0]
        rows[side].append({"P2": t["by_ranks"]["2"]["step_seconds"], "P1": t["by_ranks"]["1"]["step_seconds"],
                           "other": t["load"]["other_cpu_share"], "gflops": t["load"]["reference_gflops"]["start"]})
lines = ["# Context parallelism on 2 ranks: one training step, this code / the code before (f7ba87d)", "",
         "Written by `python docs/benchmarks/context_parallel_ab/run.py` (its docstring gives the setup); do not edit "
         "by hand. Runs alternate old, new, old, ...; each is one `linattn bench context-parallel --ranks 1,2 "
         "--time-n 32768 --no-search --runs 1` in fresh processes, its step time the median of 3 steps after a "
         "warm-up, the slowest rank's.", "",
         "| run | old: 2 ranks | new: 2 ranks | new / old | old: 2 ranks / 1 process | new: 2 ranks / 1 process | "
         "other load (old, new) | matmul GFLOP/s (old, new) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
ratios, rel_old, rel_new = [], [], []
for i in range(3):
    o, n = rows["old"][i], rows["new"][i]
    ratios.append(n["P2"] / o["P2"])
    rel_old.append(o["P2"] / o["P1"])
    rel_new.append(n["P2"] / n["P1"])
    lines.append(f"| {i + 1} | {o['P2']:.2f} s | {n['P2']:.2f} s | {ratios[-1]:.3f}x | {rel_old[-1]:.2f}x | "
                 f"{rel_new[-1]:.2f}x | {o['other']:.3f}, {n['other']:.3f} | {o['gflops']:.0f}, {n['gflops']:.0f} |")
lines += ["", f"- new / old, 2 ranks: median {statistics.median(ratios):.3f}x (min {min(ratios):.3f}x, max "
          f"{max(ratios):.3f}x)",
          f"- 2 ranks / 1 process within a run: old median {statistics.median(rel_old):.2f}x "
          f"({min(rel_old):.2f}x-{max(rel_old):.2f}x), new median {statistics.median(rel_new):.2f}x "
          f"({min(rel_new):.2f}x-{max(rel_new):.2f}x)", ""]
(here / "summary.md").write_text("\n".join(lines))
print("\n".join(lines))
