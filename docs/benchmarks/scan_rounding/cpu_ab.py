"""The forms with cumulative log decays on the CPU strategy, this checkout against the code before
they were rounded once in any order (commit 59c1918), forward+backward, float32, 2 threads, the two
versions interleaved in one process (7 calls each after a warm-up; medians), with the machine's
load and reference matmul speed, at `bench gated`'s width (8 heads of 64):

- Gated DeltaNet and GLA per head at N = 16384 (its claims' length) and 4096;
- Mamba-2's SSD route (GLA with value_scale, skip and one group of keys for the 8 heads) at 16384;
- Gated DeltaNet at `bench transformers`' gdn_core width (16 heads of 128, q and k L2-normalised in
  the engine) at N = 1024, where its training target is tightest.

A one-off comparison, not a `linattn bench` command; the old package is 59c1918's, imported beside
this one (``ab.old_package``):

    .venv/bin/python docs/benchmarks/scan_rounding/cpu_ab.py > docs/benchmarks/scan_rounding/run_i.json
    .venv/bin/python docs/benchmarks/ab_summary.py docs/benchmarks/scan_rounding "Log-decay forms, CPU strategy, against 59c1918" \\
        > docs/benchmarks/scan_rounding/summary.md
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # docs/benchmarks: ab.py
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402
from ab import interleaved, old_package  # noqa: E402
from linattn.bench.harness import OtherLoad  # noqa: E402

linattn_old = old_package("59c1918")

torch.set_num_threads(2)
load = OtherLoad(reference=True)
res = {}
for N in (16384, 4096):
    g = torch.Generator().manual_seed(N)
    q, k, v = (torch.randn(1, 8, N, 64, generator=g).requires_grad_() for _ in range(3))
    kn = F.normalize(k.detach(), dim=-1).requires_grad_()
    beta = torch.sigmoid(torch.randn(1, 8, N, generator=g)).requires_grad_()
    head = F.logsigmoid(torch.randn(1, 8, N, generator=g) + 4).requires_grad_()
    dt = F.softplus(torch.randn(1, 8, N, generator=g)).requires_grad_()
    skip = torch.randn(8, generator=g).requires_grad_()
    leaves = (q, k, v, kn, beta, head, dt, skip)
    cases = {"gated delta": lambda m: m.delta_rule_attention(q, kn, v, beta, log_decay=head),
             "gla per head": lambda m: m.gated_linear_attention(q, k, v, head)}
    if N == 16384:
        cases["ssd"] = lambda m: m.gated_linear_attention(q[:, :1], k[:, :1], v, head, scale=1.0, value_scale=dt,
                                                          skip=skip)
    for name, f in cases.items():
        def call(m, f=f):
            for t in leaves:
                t.grad = None
            f(m).sum().backward()

        res[f"{name} N={N} 8x64"] = interleaved(call, linattn, linattn_old, 7)
g = torch.Generator().manual_seed(1024)
q, k, v = (torch.randn(1, 16, 1024, 128, generator=g).requires_grad_() for _ in range(3))
beta = torch.sigmoid(torch.randn(1, 16, 1024, generator=g)).requires_grad_()
head = F.logsigmoid(torch.randn(1, 16, 1024, generator=g) + 4).requires_grad_()


def core(m):
    for t in (q, k, v, beta, head):
        t.grad = None
    m.delta_rule_attention(q, k, v, beta, log_decay=head, qk_l2norm_eps=1e-6).sum().backward()


res["gated delta N=1024 16x128 l2norm"] = interleaved(core, linattn, linattn_old, 7)
print(json.dumps({"command": "python docs/benchmarks/scan_rounding/cpu_ab.py", "results": res, "load": load.finish()}))
