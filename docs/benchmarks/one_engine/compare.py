"""The decayed engine with its specialisations in one module on one chunk layout (issue 29's last
step) against the code before it (commit 5f691f5: linear attention's tiles in linear.py, the
running-scale product in log_scaled.py), forward+backward, B = 1, H = 8, D = Dv = 64, float32,
2 threads, the two versions interleaved in one process (5 calls each after a warm-up; medians),
with the machine's load and reference matmul speed:

- causal linear_attention (elu+1) at N = 16384 (the bench core line), and at N = 4000 (a
  partial last chunk: the filled tile);
- causal favor_attention, 256 features, at N = 4096 (the bench favor line);
- gated_linear_attention per head and per key channel at N = 16384 (code moved, not changed).

A one-off comparison, not a `linattn bench` command. The old package is commit 5f691f5's with its
custom ops renamed so both can load in one process:

    mkdir -p /tmp/oldpkg5 && git archive 5f691f5 src/linattn | tar -x -C /tmp/oldpkg5 \\
        && mv /tmp/oldpkg5/src/linattn /tmp/oldpkg5/linattn_old \\
        && grep -rl '"linattn::' /tmp/oldpkg5/linattn_old | xargs sed -i 's/"linattn::/"linattn_old::/g'
    .venv/bin/python docs/benchmarks/one_engine/compare.py > docs/benchmarks/one_engine/run_i.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, "/tmp/oldpkg5")
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


def inputs(N):
    g = torch.Generator().manual_seed(N)
    q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
    head = F.logsigmoid(torch.randn(B, H, N, generator=g) + 4).requires_grad_()
    chan = F.logsigmoid(torch.randn(B, H, N, D, generator=g) + 4).requires_grad_()
    return q, k, v, head, chan


cases = []
for N in (16384, 4000):
    q, k, v, _, _ = inputs(N)
    cases.append((f"linear causal N={N}", lambda m, q=q, k=k, v=v: m.linear_attention(q, k, v, causal=True)))
q, k, v, _, _ = inputs(4096)
proj = linattn.functional.favor_projection(256, D, generator=torch.Generator().manual_seed(1))
cases.append(("favor causal N=4096",
              lambda m: m.functional.favor_attention(q, k, v, proj, causal=True)))
q2, k2, v2, head, chan = inputs(16384)
cases.append(("gla head N=16384", lambda m: m.gated_linear_attention(q2, k2, v2, head)))
cases.append(("gla channel N=16384", lambda m: m.gated_linear_attention(q2, k2, v2, chan)))

for name, f in cases:
    res[name] = interleaved(lambda m, f=f: f(m).sum().backward(), linattn, linattn_old, 5)
print(json.dumps({"command": "python docs/benchmarks/one_engine/compare.py", "results": res, "load": load.finish()}))
