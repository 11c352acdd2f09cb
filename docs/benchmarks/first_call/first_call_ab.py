"""A process's first call of a fast form, this checkout against an earlier revision: what a user
pays once per process before the engines run at speed (import, operator registration, and what the
first call of an operator sets up).

    .venv/bin/python docs/benchmarks/first_call/first_call_ab.py OLD_REV [--runs 3] [--per-run 8]

OLD_REV is checked out into a temporary git worktree and put first on PYTHONPATH for its side.
Each sample is a fresh process (2 threads) that imports torch, then linattn, then makes one call of
the case (small sizes: B = 1, H = 4, N = 256, D = Dv = 32, float32), then 30 more (their median:
the per-call cost at speed, where the operators' dispatch shows at these sizes); it reports how long
the import of linattn and the first call took, and the parent times the whole process (the 30 calls
included). The sides alternate
sample by sample; each run records the machine's load and reference matmul speed. Writes
first_call_ab.json and first_call_ab.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import load_lines, order, separate_runs  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CASES = ("gated deltanet prefill", "gla forward+backward")

_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import torch
torch.set_num_threads(2)
t1 = time.perf_counter()
import linattn
t2 = time.perf_counter()
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 256, 32, generator=g) for _ in range(3))
decay = torch.nn.functional.logsigmoid(torch.randn(1, 4, 256, generator=g) + 3)
kn, beta = torch.nn.functional.normalize(k, dim=-1), torch.rand(1, 4, 256, generator=g)
leaves = [t.clone().requires_grad_() for t in (q, k, v, decay)]


def call():
    if sys.argv[1] == "gated deltanet prefill":
        with torch.no_grad():
            linattn.delta_rule_attention(q, kn, v, beta, log_decay=decay)
    else:
        linattn.gated_linear_attention(*leaves).square().sum().backward()


call()
t3 = time.perf_counter()
dynamo = "torch._dynamo" in sys.modules
steady = []
for _ in range(30):  # the calls after it: what the operators' dispatch costs at speed
    t = time.perf_counter()
    call()
    steady.append(time.perf_counter() - t)
steady.sort()
print(json.dumps({"torch_import_s": t1 - t0, "linattn_import_s": t2 - t1, "first_call_s": t3 - t2,
                  "steady_call_s": steady[len(steady) // 2], "dynamo_imported": dynamo}))
"""


def _sample(case: str, src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old_rev")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--per-run", type=int, default=8)
    a = p.parse_args()
    from linattn.bench.harness import git_state, machine_info

    def one_run(r: int, sides: dict) -> dict:
        samples = {case: {s: [] for s in sides} for case in CASES}
        for i in range(a.per_run):
            for case in CASES:
                for side in order(i + r):
                    samples[case][side].append(_sample(case, sides[side]))
        return samples

    rev, runs = separate_runs(a.old_rev, a.runs, one_run)

    def med(run, case, side, key):
        return statistics.median(s[key] for s in run["samples"][case][side])

    rows = []
    for case in CASES:
        for key in ("first_call_s", "process_s", "linattn_import_s", "steady_call_s"):
            per_run = [(med(r, case, "old", key), med(r, case, "new", key)) for r in runs]
            diffs = [o - n for o, n in per_run]
            rows.append({"case": case, "what": key, "old_s": statistics.median(o for o, _ in per_run),
                         "new_s": statistics.median(n for _, n in per_run), "saved_s": statistics.median(diffs),
                         "saved_min_s": min(diffs), "saved_max_s": max(diffs),
                         "dynamo_imported": {s: any(x["dynamo_imported"] for r in runs for x in r["samples"][case][s])
                                             for s in ("old", "new")}})
    command = f"python docs/benchmarks/first_call/first_call_ab.py {a.old_rev} --runs {a.runs} --per-run {a.per_run}"
    result = {"command": command, "old_rev": rev, "new": git_state(), "machine": machine_info(), "rows": rows,
              "runs": runs}
    (HERE / "first_call_ab.json").write_text(json.dumps(result, indent=1))
    lines = ["# A process's first call: this checkout against " + rev[:7], "",
             f"Command: `{command}`", "",
             f"Fresh processes, sides alternating sample by sample, {a.per_run} samples per side, case and run; "
             f"{a.runs} runs. Each figure: the median over runs of each run's median; saved = old - new, "
             "median over runs (min-max). B = 1, H = 4, N = 256, D = Dv = 32, float32, 2 threads.", "",
             "| case | measured | old | new | saved (median) | min | max | torch._dynamo imported (old / new) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        d = row["dynamo_imported"]
        ms = [f"{row[k] * 1e3:.3f} ms" for k in ("old_s", "new_s", "saved_s", "saved_min_s", "saved_max_s")]
        lines.append(f"| {row['case']} | {row['what']} | " + " | ".join(ms) + " | "
                     f"{'yes' if d['old'] else 'no'} / {'yes' if d['new'] else 'no'} |")
    lines += load_lines(runs)
    (HERE / "first_call_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
