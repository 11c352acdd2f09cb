"""KDA's chunk length on the CPU strategy: ``delta_rule_attention`` with a gate per key channel at a
few (chunk_size, sub_chunk_size, chunks_per_block) settings, interleaved in one process (the order
reversed every repeat), forward+backward and a prefill (forward without gradients), at two widths:
B = 1, H = 8, D = 64, N = 16384 (``bench gated``'s) and H = 32, D = 128, N = 4096 (Kimi Linear's).

    .venv/bin/python docs/benchmarks/kda_chunks/sweep.py --out docs/benchmarks/kda_chunks [--repeats 6]

Writes ``OUT/sweep_<k>.json`` (k the first free number: one file per run, so that runs are never
overwritten) with every timing, the machine's load and its reference matmul speed at the start and
the end; ``summary.py`` in this folder turns the runs into ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from linattn.bench.harness import OtherLoad, git_state, machine_info
from linattn.functional.delta import delta_rule_attention

WIDTHS = [(8, 16384, 64), (32, 4096, 128)]
SETTINGS = [(16, 4, None), (32, 4, None), (32, 8, None), (32, 4, "half")]


def _inputs(H: int, N: int, D: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, N, D, generator=g).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(1, H, N, D, generator=g), dim=-1).requires_grad_()
    v = torch.randn(1, H, N, D, generator=g).requires_grad_()
    beta = torch.rand(1, H, N, generator=g).requires_grad_()
    decay = (-0.1 * torch.rand(1, H, N, D, generator=g)).requires_grad_()
    return q, k, v, beta, decay


def _knobs(setting: tuple, H: int, D: int) -> dict:
    C, c, blocks = setting
    if blocks == "half":  # as many positions a block as the default blocks of 16 positions' chunks
        from linattn.functional.delta import _chunks_per_block
        blocks = max(1, _chunks_per_block(None, H, D, D) // 2)
    return {"chunk_size": C, "sub_chunk_size": c, "chunks_per_block": blocks}


def run(repeats: int) -> dict:
    torch.set_num_threads(2)
    rows = []
    for H, N, D in WIDTHS:
        q, k, v, beta, decay = _inputs(H, N, D)
        times = {str(s): {"train": [], "prefill": []} for s in SETTINGS}
        for r in range(repeats + 1):  # the first round warms up
            for s in (SETTINGS if r % 2 else SETTINGS[::-1]):
                kw = _knobs(s, H, D)
                t0 = time.perf_counter()
                delta_rule_attention(q, k, v, beta, log_decay=decay, **kw).sum().backward()
                t1 = time.perf_counter()
                with torch.no_grad():
                    delta_rule_attention(q, k, v, beta, log_decay=decay, **kw)
                t2 = time.perf_counter()
                if r:
                    times[str(s)]["train"].append(t1 - t0)
                    times[str(s)]["prefill"].append(t2 - t1)
        for s in SETTINGS:
            t = times[str(s)]
            rows.append({"H": H, "N": N, "D": D, "setting": _knobs(s, H, D), "train_s": t["train"],
                         "prefill_s": t["prefill"], "train_median_s": statistics.median(t["train"]),
                         "prefill_median_s": statistics.median(t["prefill"])})
    return {"rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=6)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    k = 1
    while (a.out / f"sweep_{k}.json").exists():
        k += 1
    load = OtherLoad(reference=True)
    result = run(a.repeats)
    result.update({"command": "python docs/benchmarks/kda_chunks/sweep.py " + " ".join(sys.argv[1:]),
                   "git": git_state(), "machine": machine_info(), "load": load.finish()})
    (a.out / f"sweep_{k}.json").write_text(json.dumps(result, indent=1))
    print(a.out / f"sweep_{k}.json")


if __name__ == "__main__":
    main()
