"""``summary.md`` from the runs of ``sweep.py`` in this folder: per width and setting, the median over
runs of each run's median time, each setting's time over the default's (16, 4) as the median of the
runs' ratios with min and max, for forward+backward and for the prefill.

    .venv/bin/python docs/benchmarks/kda_chunks/summary.py docs/benchmarks/kda_chunks
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("sweep_*.json"))]
    lines = ["# KDA's chunk length on the CPU strategy", "",
             f"Written by `python docs/benchmarks/kda_chunks/summary.py {folder}` from {len(runs)} runs of "
             f"`{runs[0]['command']}` (commit {runs[0]['git']['head'][:7]}); do not edit by hand. "
             "B = 1, float32, 2 threads; settings interleaved in one process, each run's median of its "
             "repeats. Ratio: a setting's time over (chunk 16, sub-chunks of 4, default blocks), the median "
             "over runs of each run's ratio (min-max).", "",
             "| H x D, N | chunk, sub-chunk, chunks per block | forward+backward | / default | prefill | / default |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    keys = [(r["H"], r["D"], r["N"], json.dumps(r["setting"])) for r in runs[0]["rows"]]
    for H, D, N, setting in keys:
        def pick(run, s=setting):
            return next(r for r in run["rows"] if (r["H"], r["D"], r["N"], json.dumps(r["setting"])) == (H, D, N, s))
        base = [next(r for r in run["rows"] if (r["H"], r["D"], r["N"]) == (H, D, N)) for run in runs]
        cells = []
        for kind in ("train_median_s", "prefill_median_s"):
            mine = [pick(run)[kind] for run in runs]
            ratios = [m / b[kind] for m, b in zip(mine, base)]
            cells += [f"{statistics.median(mine) * 1e3:.0f} ms",
                      f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"]
        s = json.loads(setting)
        lines.append(f"| {H} x {D}, {N} | {s['chunk_size']}, {s['sub_chunk_size']}, {s['chunks_per_block']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Runs (other processes' CPU share, reference matmul GFLOP/s at start and end):", ""]
    lines += [f"- {run['load']}" for run in runs]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
