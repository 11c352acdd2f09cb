"""Float32 cumulative log decays (functional/log_decays.py) against the float64 sums they replace:
forward+backward of gated_linear_attention (per head, per channel) and delta_rule_attention with a
decay at N = 16384, B = 1, H = 8, D = 64, float32, 2 threads, the two versions interleaved in one
process (5 calls each after a warm-up, medians), with the machine's load and reference matmul speed.

A one-off comparison, not a `linattn bench` command: the old version is the package as of commit
f78df96 copied to /tmp/oldpkg/linattn_old (`git worktree add /tmp/old f78df96 && cp -r
/tmp/old/src/linattn /tmp/oldpkg/linattn_old`); run as `.venv/bin/python
docs/benchmarks/float32_decays/compare.py > run_i.json`, three times (run_1..3.json).
"""
import sys, time, statistics, json
sys.path.insert(0, "/tmp/oldpkg")
import torch, torch.nn.functional as F
torch.set_num_threads(2)
import linattn
import linattn_old
from linattn.bench.harness import OtherLoad
N, B, H, D = 16384, 1, 8, 64
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B,H,N,D, generator=g).requires_grad_() for _ in range(3))
kn = F.normalize(torch.randn(B,H,N,D, generator=g), dim=-1).requires_grad_()
head = F.logsigmoid(torch.randn(B,H,N, generator=g) + 4).requires_grad_()
chan = F.logsigmoid(torch.randn(B,H,N,D, generator=g) + 4).requires_grad_()
beta = torch.sigmoid(torch.randn(B,H,N, generator=g)).requires_grad_()
cases = {
  "gla head": lambda m: m.gated_linear_attention(q,k,v,head),
  "gla channel": lambda m: m.gated_linear_attention(q,k,v,chan),
  "gated delta": lambda m: m.delta_rule_attention(q,kn,v,beta,log_decay=head),
}
load = OtherLoad(reference=True)
res = {}
for name, f in cases.items():
    for m in (linattn, linattn_old):  # warm-up
        f(m).sum().backward()
    t = {"new": [], "old": []}
    for rep in range(5):
        for label, m in (("new", linattn), ("old", linattn_old)) if rep % 2 == 0 else (("old", linattn_old), ("new", linattn)):
            t0 = time.perf_counter(); f(m).sum().backward(); t[label].append(time.perf_counter() - t0)
    res[name] = {k: statistics.median(x) for k, x in t.items()}
    res[name]["new/old"] = res[name]["new"] / res[name]["old"]
print(json.dumps({"results": res, "load": load.finish()}))
