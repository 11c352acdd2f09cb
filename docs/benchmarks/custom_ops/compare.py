"""The gated and delta-rule chunked forms as torch.library custom ops (issue 29) against the
autograd.Functions they replace: forward+backward of gated_linear_attention (per head, per channel)
and delta_rule_attention (no decay, and with a decay), B = 1, H = 8, D = Dv = 64, float32,
2 threads, at N = 256 (where a per-call overhead would show), 4096 and 16384 (the rows of
`linattn bench gated`), the two versions interleaved in one process (5 calls each after a
warm-up, 101 at N = 256; medians), with the machine's load and reference matmul speed.

A one-off comparison, not a `linattn bench` command: the old version is the package as of commit
32fdb49 copied to /tmp/oldpkg2/linattn_old (`git worktree add /tmp/before 32fdb49 && cp -r
/tmp/before/src/linattn /tmp/oldpkg2/linattn_old`); run as `.venv/bin/python
docs/benchmarks/custom_ops/compare.py > docs/benchmarks/custom_ops/run_i.json`, three times.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, "/tmp/oldpkg2")
sys.path.insert(0, str(Path(__file__).parent.parent))  # docs/benchmarks: ab.py
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402
import linattn_old  # noqa: E402
from ab import interleaved  # noqa: E402
from linattn.bench.harness import OtherLoad  # noqa: E402

torch.set_num_threads(2)
B, H, D = 1, 8, 64
load = OtherLoad(reference=True)
res = {}
for N in (256, 4096, 16384):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
    kn = F.normalize(torch.randn(B, H, N, D, generator=g), dim=-1).requires_grad_()
    head = F.logsigmoid(torch.randn(B, H, N, generator=g) + 4).requires_grad_()
    chan = F.logsigmoid(torch.randn(B, H, N, D, generator=g) + 4).requires_grad_()
    beta = torch.sigmoid(torch.randn(B, H, N, generator=g)).requires_grad_()
    cases = {
        "gla head": lambda m: m.gated_linear_attention(q, k, v, head),
        "gla channel": lambda m: m.gated_linear_attention(q, k, v, chan),
        "deltanet": lambda m: m.delta_rule_attention(q, kn, v, beta),
        "gated deltanet": lambda m: m.delta_rule_attention(q, kn, v, beta, log_decay=head),
    }
    calls = 101 if N == 256 else 5  # short calls: more of them (noise there is +-8% with 25)
    for name, f in cases.items():
        res[f"{name} N={N}"] = interleaved(lambda m, f=f: f(m).sum().backward(), linattn, linattn_old, calls)
print(json.dumps({"command": "python docs/benchmarks/custom_ops/compare.py", "results": res, "load": load.finish()}))
