"""The running sums down the chunks of causal linear attention's states on this CPU: contiguous
slots (the accelerator strategy's layout, a scan CUDA runs as it is) against slots 16 elements
longer than their contents (the CPU strategy's), at checkpoint widths.

    .venv/bin/python docs/benchmarks/linear_sums/cumsum_strides.py --out docs/benchmarks/linear_sums

``(R, Nc, F*E)`` = (16, 256, 128 * 128), N = 16384 at C = 64, float32, 2 threads: ``cumsum_`` along
the chunks in place, the two layouts alternating, 5 repeats each, 3 runs; writes ``cumsum_strides.json``
and ``.md`` with each run's medians, the machine's load and its reference matmul speed. Why it is
kept: the accelerator strategy's CPU time (``accelerator_ab.md``) is a proxy, and this is the part
of it that a CPU's caches make slower and a GPU's scan does not share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import load_lines  # noqa: E402

R, NC, M = 16, 256, 128 * 128


def one_run() -> dict:
    from linattn.bench.harness import OtherLoad

    monitor = OtherLoad(reference=True)
    layouts = {"contiguous": torch.randn(R * NC, M), "padded by 16": torch.randn(R * NC, M + 16)}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for rep in range(6):  # the first is a warm-up
        for name in (list(layouts) if rep % 2 else list(layouts)[::-1]):
            rows = layouts[name][:, :M].view(R, NC, M)
            t = time.perf_counter()
            rows.cumsum_(1)
            if rep:
                times[name].append(time.perf_counter() - t)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"medians_s": medians, "contiguous_over_padded": medians["contiguous"] / medians["padded by 16"],
            "load": monitor.finish()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    runs = [one_run() for _ in range(args.runs)]
    ratios = [r["contiguous_over_padded"] for r in runs]
    command = "python docs/benchmarks/linear_sums/cumsum_strides.py --out docs/benchmarks/linear_sums"
    result = {"command": command, "shape": [R, NC, M], "runs": runs,
              "contiguous_over_padded": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cumsum_strides.json").write_text(json.dumps(result, indent=1))
    med = {name: statistics.median(r["medians_s"][name] for r in runs) for name in runs[0]["medians_s"]}
    lines = ["# Running sums down the chunks: contiguous slots against padded ones, on this CPU", "",
             f"Written by `{command}`; do not edit by hand. `cumsum_` along dim 1 of ({R}, {NC}, {M}) float32, "
             "in place, 2 threads; the layouts alternating, the median of 5 repeats a run, "
             f"{args.runs} runs.", "",
             "| layout | time (median over runs) |", "| --- | ---: |"]
    lines += [f"| {name} | {1e3 * t:.1f} ms |" for name, t in med.items()]
    r = result["contiguous_over_padded"]
    lines += ["", f"contiguous / padded: {r['median']:.1f}x (min {r['min']:.1f}x, max {r['max']:.1f}x): slots "
              f"{M * 4 // 1024} KiB apart map the scan's every step to the same cache sets.", ""]
    lines += load_lines(runs)
    (args.out / "cumsum_strides.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
