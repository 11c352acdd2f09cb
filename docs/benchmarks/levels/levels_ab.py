"""The accelerator strategy's blocks between sub-chunks (a gate per key channel: KDA, GLA per
channel), this checkout against an earlier revision: kernel launches, an estimate of the memory
traffic, peak memory and the time of one call on this CPU.

    .venv/bin/python docs/benchmarks/levels/levels_ab.py OLD_REV [--runs 3] [--n 4096]

OLD_REV is checked out into a temporary git worktree and put first on PYTHONPATH for its side. Each
sample is a fresh process (2 threads) running ``linattn.bench.launches.form_call`` (the form at its
checkpoint width, B = 1, float32, the accelerator strategy forced, on the CPU) after one warm-up
call: the peak resident memory of a call above its inputs, the launches (computing leaf aten ops,
``count_launches``), the traffic estimate (every such op's input bytes plus what it allocates, from
one profiled call: what a memory-bound GPU would move, a lower bound that ignores caches), and the
median of 3 timed calls. The sides alternate sample by sample; each run records the machine's load
and reference matmul speed. Writes levels_ab.json and levels_ab.md beside this file.

Launches and traffic are the same in every run (shapes only); the CPU time is a proxy, not a GPU
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import load_lines, order, separate_runs  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CASES = (("kda", "prefill"), ("kda", "train"), ("gla_channel", "prefill"), ("gla_channel", "train"))

_CHILD = r"""
import json, math, statistics, sys, time
import torch
torch.set_num_threads(2)
from torch.profiler import ProfilerActivity, profile
from linattn.bench.harness import peak_rss_bytes, release_free_heap
from linattn.bench.launches import OWN_KERNEL, _computes, count_launches, form_call

form, n, pass_ = sys.argv[1], int(sys.argv[2]), sys.argv[3]
call = form_call(form, n, pass_, "accelerator")
call()
release_free_heap()
peak = peak_rss_bytes(call)
launches = count_launches(call).total
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
    call()


def below(ev):
    return any(_computes(c.name) or below(c) for c in ev.cpu_children)


traffic = 0
for ev in prof.events():
    if _computes(ev.name) and (ev.name in OWN_KERNEL or not below(ev)):
        inputs = sum(math.prod(s) for s in ev.input_shapes if isinstance(s, list) and s
                     and all(isinstance(x, int) for x in s))
        traffic += 4 * inputs + max(ev.cpu_memory_usage, 0)  # float32 everywhere
times = []
for _ in range(3):
    t = time.perf_counter()
    call()
    times.append(time.perf_counter() - t)
print(json.dumps({"launches": launches, "traffic_bytes": traffic, "peak_bytes": peak,
                  "time_s": statistics.median(times)}))
"""


def _sample(form: str, n: int, pass_: str, src: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _CHILD, form, str(n), pass_], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old_rev")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--n", type=int, default=4096)
    a = p.parse_args()
    from linattn.bench.harness import git_state, machine_info

    def one_run(r: int, sides: dict) -> dict:
        samples = {f"{f} {p_}": {} for f, p_ in CASES}
        for i, (form, pass_) in enumerate(CASES):
            for side in order(i + r):
                samples[f"{form} {pass_}"][side] = _sample(form, a.n, pass_, sides[side])
        return samples

    rev, runs = separate_runs(a.old_rev, a.runs, one_run)
    rows = []
    for form, pass_ in CASES:
        case = f"{form} {pass_}"
        row = {"case": case}
        for key in ("launches", "traffic_bytes", "peak_bytes", "time_s"):
            olds = [r["samples"][case]["old"][key] for r in runs]
            news = [r["samples"][case]["new"][key] for r in runs]
            ratios = [n_ / o for o, n_ in zip(olds, news)]
            row[key] = {"old": statistics.median(olds), "new": statistics.median(news),
                        "new_over_old": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    command = f"python docs/benchmarks/levels/levels_ab.py {a.old_rev} --runs {a.runs} --n {a.n}"
    result = {"command": command, "old_rev": rev, "new": git_state(), "machine": machine_info(), "rows": rows,
              "runs": runs}
    (HERE / "levels_ab.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Blocks between sub-chunks on the accelerator strategy: this checkout against {rev[:7]}", "",
             f"Command: `{command}`", "",
             f"N = {a.n}, B = 1, float32, checkpoint widths (KDA 32 x 128, GLA 16 x 128), the accelerator strategy "
             f"forced on this CPU, a fresh process per sample, the sides alternating; {a.runs} runs. Each figure: "
             "the median over runs; new / old: the median over runs of each run's ratio (min-max). Launches and "
             "traffic (every computing leaf op's input bytes plus its allocations: what a memory-bound GPU would "
             "move, at least) depend on shapes only; the CPU time is a proxy, not a GPU figure.", "",
             "| case | launches old / new | traffic old / new | new / old | peak memory old / new | new / old | "
             "CPU time old / new | new / old (min-max) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    gib = 2 ** 30
    for row in rows:
        la, tr, pk, ti = (row[k] for k in ("launches", "traffic_bytes", "peak_bytes", "time_s"))
        lines.append(f"| {row['case']} | {la['old']:.0f} / {la['new']:.0f} | {tr['old'] / gib:.2f} / "
                     f"{tr['new'] / gib:.2f} GiB | {tr['new_over_old']:.2f} | {pk['old'] / gib:.2f} / "
                     f"{pk['new'] / gib:.2f} GiB | {pk['new_over_old']:.2f} | {ti['old']:.3f} / {ti['new']:.3f} s | "
                     f"{ti['new_over_old']:.2f} ({ti['min']:.2f}-{ti['max']:.2f}) |")
    lines += load_lines(runs)
    (HERE / "levels_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
