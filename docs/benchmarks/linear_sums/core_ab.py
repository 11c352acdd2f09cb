"""Causal linear attention on the CPU strategy, this checkout against the code before the sums
across chunks changed (commit f183d80), forward+backward, float32, 2 threads, the two versions
interleaved in one process (7 calls each after a warm-up; medians), with the machine's load and
reference matmul speed:

- N = 16384, 8 heads of 64 (the `bench core` line against fast-transformers);
- N = 16384, 16 heads of 128 (bench gpu's checkpoint width);
- N = 4000, 8 heads of 64 (a filled last chunk).

A one-off comparison, not a `linattn bench` command; the old package is f183d80's, imported beside
this one (``ab.old_package``):

    .venv/bin/python docs/benchmarks/linear_sums/core_ab.py > docs/benchmarks/linear_sums/run_i.json
    .venv/bin/python docs/benchmarks/ab_summary.py docs/benchmarks/linear_sums \\
        "Causal linear attention, CPU strategy, against f183d80" \\
        > docs/benchmarks/linear_sums/summary.md
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # docs/benchmarks: ab.py
import torch  # noqa: E402

import linattn  # noqa: E402
from ab import interleaved, old_package  # noqa: E402
from linattn.bench.harness import OtherLoad  # noqa: E402

linattn_old = old_package("f183d80")

torch.set_num_threads(2)
load = OtherLoad(reference=True)
res = {}
for N, H, D in ((16384, 8, 64), (16384, 16, 128), (4000, 8, 64)):
    g = torch.Generator().manual_seed(N)
    q, k, v = (torch.randn(1, H, N, D, generator=g).requires_grad_() for _ in range(3))

    def call(m, q=q, k=k, v=v):
        for t in (q, k, v):
            t.grad = None
        m.linear_attention(q, k, v, causal=True).sum().backward()

    res[f"linear causal N={N} {H}x{D}"] = interleaved(call, linattn, linattn_old, 7)
print(json.dumps({"command": "python docs/benchmarks/linear_sums/core_ab.py", "results": res, "load": load.finish()}))
