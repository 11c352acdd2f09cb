"""The median and spread over runs of each case's new/old ratio in DIR/run_*.json (written by an
A/B comparison script such as custom_ops/compare.py or one_engine/compare.py), as a markdown table:

    .venv/bin/python docs/benchmarks/ab_summary.py DIR "TITLE" > DIR/summary.md
"""
import json
import statistics
import sys
from pathlib import Path

here, title = Path(sys.argv[1]), sys.argv[2]
runs = [json.loads(p.read_text()) for p in sorted(here.glob("run_*.json"))]
print(f"# {title}, forward+backward, {len(runs)} runs\n")
print(f"Written by `python docs/benchmarks/ab_summary.py {sys.argv[1]} \"{title}\"` from run_*.json; do not edit "
      "by hand. A ratio below 1 is faster now.\n")
print("| case | median new/old | min | max | per run | new, old (median of runs) | reference matmul GFLOP/s "
      "at each run's start | other load's CPU share |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for case in runs[0]["results"]:
    rows = [run["results"][case] for run in runs]
    r = [row["new/old"] for row in rows]
    ref = [run["load"]["reference_gflops"]["start"] for run in runs]
    refs = ", ".join("-" if x is None else f"{x:.0f}" for x in ref)
    other = ", ".join(f"{run['load']['other_cpu_share']:.3f}" for run in runs)
    new, old = (statistics.median(row[k] for row in rows) for k in ("new", "old"))
    print(f"| {case} | {statistics.median(r):.3f}x | {min(r):.3f}x | {max(r):.3f}x | "
          f"{', '.join(f'{x:.3f}x' for x in r)} | {new * 1e3:.1f} ms, {old * 1e3:.1f} ms | {refs} | {other} |")
