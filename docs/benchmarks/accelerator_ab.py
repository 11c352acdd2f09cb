"""The accelerator strategy (or with ``--strategy cpu`` the CPU's), this checkout against an earlier
revision: kernel launches, an estimate of the memory traffic, peak memory and the time of one call on
this CPU, for chosen (form, pass) cases.

    .venv/bin/python docs/benchmarks/accelerator_ab.py OLD_REV --cases kda:prefill,kda:train --out DIR \
        [--runs 3] [--n 4096] [--title TEXT] [--strategy accelerator|cpu]

OLD_REV is checked out into a temporary git worktree and put first on PYTHONPATH for its side. Each
sample is a fresh process (2 threads) running ``linattn.bench.launches.form_call`` (the form at its
checkpoint width, B = 1, float32, the strategy forced (the accelerator unless --strategy), on the CPU) after one warm-up
call: the peak resident memory of a call above its inputs, the launches (computing leaf aten ops,
``count_launches``), the traffic estimate (every such op's input bytes plus what it allocates, from
one profiled call: what a memory-bound GPU would move, a lower bound that ignores caches), and the
median of 3 timed calls. The sides alternate sample by sample; each run records the machine's load
and reference matmul speed. Writes ``DIR/<name>.json`` and ``DIR/<name>.md`` (name: ``--name``,
default the folder's name followed by ``_ab``).

Launches and traffic are the same in every run (shapes only); the CPU time is a proxy, not a GPU
figure. levels/levels_ab.py is this script with its cases, folder and title fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # docs/benchmarks: ab.py
from ab import ROOT, load_lines, order, separate_runs  # noqa: E402

_CHILD = r"""
import json, math, statistics, sys, time
import torch
torch.set_num_threads(2)
from torch.profiler import ProfilerActivity, profile
from linattn.bench.harness import peak_rss_bytes, release_free_heap
from linattn.bench.launches import OWN_KERNEL, _computes, count_launches, form_call

form, n, pass_, strategy = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
call = form_call(form, n, pass_, strategy)
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
KEYS = ("launches", "traffic_bytes", "peak_bytes", "time_s")


def _sample(form: str, n: int, pass_: str, src: Path, strategy: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _CHILD, form, str(n), pass_, strategy], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rows(cases: list[tuple[str, str]], runs: list[dict]) -> list[dict]:
    rows = []
    for form, pass_ in cases:
        case = f"{form} {pass_}"
        row = {"case": case}
        for key in KEYS:
            olds = [r["samples"][case]["old"][key] for r in runs]
            news = [r["samples"][case]["new"][key] for r in runs]
            ratios = [n_ / o for o, n_ in zip(olds, news)]
            row[key] = {"old": statistics.median(olds), "new": statistics.median(news),
                        "new_over_old": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    return rows


def compare(old_rev: str, cases: list[tuple[str, str]], out: Path, *, runs: int, n: int, title: str, command: str,
            name: str, strategy: str = "accelerator") -> None:
    """``runs`` runs of every case on both sides; writes ``out/name.json`` and ``out/name.md``."""
    from linattn.bench.harness import git_state, machine_info

    def one_run(r: int, sides: dict) -> dict:
        samples = {f"{f} {p_}": {} for f, p_ in cases}
        for i, (form, pass_) in enumerate(cases):
            for side in order(i + r):
                samples[f"{form} {pass_}"][side] = _sample(form, n, pass_, sides[side], strategy)
        return samples

    rev, done = separate_runs(old_rev, runs, one_run)
    rows = _rows(cases, done)
    result = {"command": command, "old_rev": rev, "new": git_state(), "machine": machine_info(), "rows": rows,
              "runs": done}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# {title}: this checkout against {rev[:7]}", "", f"Command: `{command}`", "",
             f"N = {n}, B = 1, float32, checkpoint widths (`linattn.bench.gpu.widths`), the {strategy} strategy "
             f"forced on this CPU, a fresh process per sample, the sides alternating; {runs} runs. Each figure: "
             "the median over runs; new / old: the median over runs of each run's ratio (min-max). Launches and "
             "traffic (every computing leaf op's input bytes plus its allocations: what a memory-bound GPU would "
             "move, at least) depend on shapes only; the CPU time is a proxy, not a GPU figure.", "",
             "| case | launches old / new | traffic old / new | new / old | peak memory old / new | new / old | "
             "CPU time old / new | new / old (min-max) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    gib = 2 ** 30
    for row in rows:
        la, tr, pk, ti = (row[k] for k in KEYS)
        lines.append(f"| {row['case']} | {la['old']:.0f} / {la['new']:.0f} | {tr['old'] / gib:.2f} / "
                     f"{tr['new'] / gib:.2f} GiB | {tr['new_over_old']:.2f} | {pk['old'] / gib:.2f} / "
                     f"{pk['new'] / gib:.2f} GiB | {pk['new_over_old']:.2f} ({pk['min']:.2f}-{pk['max']:.2f}) | "
                     f"{ti['old']:.3f} / {ti['new']:.3f} s | {ti['new_over_old']:.2f} ({ti['min']:.2f}-{ti['max']:.2f}) |")
    lines += load_lines(done)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_cases(text: str) -> list[tuple[str, str]]:
    """``"kda:prefill,gated_delta:train"`` -> ``[("kda", "prefill"), ("gated_delta", "train")]``."""
    cases = []
    for item in text.split(","):
        form, _, pass_ = item.partition(":")
        if pass_ not in ("prefill", "train"):
            raise SystemExit(f"accelerator_ab.py: --cases: each case is FORM:prefill or FORM:train, got {item!r}")
        cases.append((form, pass_))
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old_rev")
    p.add_argument("--cases", required=True, help="FORM:PASS,... (PASS: prefill or train)")
    p.add_argument("--out", required=True, help="the folder the results go to")
    p.add_argument("--name", default=None, help="the results' file name (default: the folder's name + _ab)")
    p.add_argument("--title", default="The accelerator strategy")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--strategy", choices=("accelerator", "cpu"), default="accelerator",
                   help="the engines' strategy forced on both sides (default: accelerator)")
    a = p.parse_args()
    cases = parse_cases(a.cases)
    out = Path(a.out)
    command = "python docs/benchmarks/accelerator_ab.py " + shlex.join(sys.argv[1:])
    compare(a.old_rev, cases, out, runs=a.runs, n=a.n, title=a.title, command=command,
            name=a.name or f"{out.resolve().name}_ab", strategy=a.strategy)


if __name__ == "__main__":
    main()
