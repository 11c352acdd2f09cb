"""The median and spread over runs of each case's new/old ratio in custom_ops/run_*.json, as a
markdown table: `.venv/bin/python docs/benchmarks/custom_ops/summary.py > docs/benchmarks/custom_ops/summary.md`."""
import json
import statistics
from pathlib import Path

here = Path(__file__).parent
runs = [json.loads(p.read_text()) for p in sorted(here.glob("run_*.json"))]
print(f"# Custom ops / autograd.Functions (commit 32fdb49), forward+backward, {len(runs)} runs\n")
print("Written by `python docs/benchmarks/custom_ops/summary.py` from run_*.json; do not edit by hand. "
      "A ratio below 1 is faster now.\n")
print("| case | median new/old | min | max | per run | reference matmul GFLOP/s at each run's start |")
print("| --- | --- | --- | --- | --- | --- |")
for case in runs[0]["results"]:
    r = [run["results"][case]["new/old"] for run in runs]
    ref = [run["load"]["reference_gflops"]["start"] for run in runs]  # at the run's start
    refs = ", ".join("-" if x is None else f"{x:.0f}" for x in ref)
    print(f"| {case} | {statistics.median(r):.3f}x | {min(r):.3f}x | {max(r):.3f}x | "
          f"{', '.join(f'{x:.3f}x' for x in r)} | {refs} |")
