"""Per-channel GLA, forward+backward at N = 16384 (B = 1, H = 8, D = 64, float32, 2 threads, decays
logsigmoid(randn + 4) as in `linattn bench gated`), this code against the package of commit 617da44
(the code of the previous committed docs/benchmarks/gated.md run), interleaved in one process, 6 calls
each after a warm-up, medians; with the machine's load and reference matmul speed.

Why: `bench gated` rerun in this session found per-channel GLA at 3.33x linear attention's time
(2.47x in the committed run of 617da44). This says whether the code or the machine moved.

    mkdir -p /tmp/oldpkg4 && git archive 617da44 src/linattn | tar -x -C /tmp/oldpkg4 \\
        && mv /tmp/oldpkg4/src/linattn /tmp/oldpkg4/linattn_old
    .venv/bin/python docs/benchmarks/custom_ops/channel_ab.py > docs/benchmarks/custom_ops/channel_ab_i.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, "/tmp/oldpkg4")
sys.path.insert(0, str(Path(__file__).parent.parent))  # docs/benchmarks: ab.py
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import linattn  # noqa: E402
import linattn_old  # noqa: E402
from ab import interleaved  # noqa: E402
from linattn.bench.harness import OtherLoad  # noqa: E402

torch.set_num_threads(2)
B, H, N, D = 1, 8, 16384, 64
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
ch = F.logsigmoid(torch.randn(1, H, N, D, generator=g) + 4).requires_grad_()
lin = {}
load = OtherLoad(reference=True)


def gla(m):
    m.gated_linear_attention(q, k, v, ch).sum().backward()


def linear(m):
    m.linear_attention(q, k, v, causal=True).sum().backward()


res = {}
for name, f in (("gla channel", gla), ("linear", linear)):
    res[name] = interleaved(f, linattn, linattn_old, 6)
print(json.dumps({"command": "python docs/benchmarks/custom_ops/channel_ab.py", "results": res,
                  "load": load.finish()}))
