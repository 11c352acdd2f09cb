"""Kernel launches of the Mamba-2 family's scan (gated_linear_attention's grouped route,
linattn.functional.grouped) under each strategy, counted as `linattn bench launches` counts them
(linattn.bench.launches.count_launches: computing leaf aten ops, and fused ops), at Mamba-2 1.3B's
width: B = 1, one group of B and C (state 128), 64 heads of 64, float32, mild per-head decays.

    .venv/bin/python docs/benchmarks/launches/ssd_launches.py

writes ssd_launches.json and ssd_launches.md beside this file: prefill (a forward without gradients)
and train (forward and backward into every input) at N = 4096 and 16384, with issue 44's limits for
the accelerator strategy (at most 200 / 600 at the largest N, at most 1.5x the count at the smallest).
"""

import json
import subprocess
from pathlib import Path

import torch

from linattn.bench.launches import GROWTH, LIMITS, count_launches
from linattn.functional import gated_linear_attention

HERE = Path(__file__).resolve().parent
NS = (4096, 16384)


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 1, n, 128, generator=g), torch.randn(1, 1, n, 128, generator=g),
            torch.randn(1, 64, n, 64, generator=g), -torch.rand(1, 64, n, generator=g) * 0.1)


def count(strategy: str, n: int, pass_: str) -> int:
    x = _inputs(n)
    if pass_ == "prefill":
        def call():
            with torch.no_grad():
                gated_linear_attention(*x, strategy=strategy)
    else:
        ins = [t.requires_grad_() for t in x]
        cotangent = torch.ones(1, 64, n, 64)

        def call():
            for t in ins:
                t.grad = None
            gated_linear_attention(*ins, strategy=strategy).backward(cotangent)
    return count_launches(call).total


def main() -> None:
    torch.set_num_threads(2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    counts = {f"{s}/{p}/{n}": count(s, n, p) for s in ("cpu", "accelerator") for p in ("prefill", "train") for n in NS}
    verdicts = {}
    for p in ("prefill", "train"):
        big, small = counts[f"accelerator/{p}/{NS[-1]}"], counts[f"accelerator/{p}/{NS[0]}"]
        verdicts[p] = {"limit": LIMITS[p], "growth": big / small, "holds": big <= LIMITS[p] and big <= GROWTH * small}
    result = {"command": "python docs/benchmarks/launches/ssd_launches.py", "commit": commit, "counts": counts,
              "verdicts": verdicts}
    (HERE / "ssd_launches.json").write_text(json.dumps(result, indent=2))
    lines = ["# Launches of the Mamba-2 family's scan (the grouped route)", "",
             f"Written by `{result['command']}` at {commit}: Mamba-2 1.3B's width (one group of B and C, state 128; "
             "64 heads of 64), B = 1, float32; see its docstring.", "",
             "| strategy | pass | " + " | ".join(f"N = {n}" for n in NS) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in NS) + " |"]
    for s in ("cpu", "accelerator"):
        for p in ("prefill", "train"):
            lines.append(f"| {s} | {p} | " + " | ".join(str(counts[f"{s}/{p}/{n}"]) for n in NS) + " |")
    lines += ["", "Issue 44's limits, accelerator strategy:", ""]
    for p, v in verdicts.items():
        lines.append(f"- {p}: {counts[f'accelerator/{p}/{NS[-1]}']} at N = {NS[-1]} (limit {v['limit']}), "
                     f"{v['growth']:.2f}x the count at N = {NS[0]} (limit {GROWTH}x): "
                     f"{'holds' if v['holds'] else 'DOES NOT HOLD'}")
    (HERE / "ssd_launches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
