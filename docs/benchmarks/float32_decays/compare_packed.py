"""Packed causal linear attention and FAVOR+ (cu_seqlens: documents of 100, 4900, 1, 6999 and 4384
tokens, T = 16384, H = 8, D = 64, FAVOR m = 256), forward+backward, float32 running sums and
integer running-max key against the float64 ones of commit f78df96, interleaved in one process
(5 calls each, medians), with load and reference matmul speed. Set-up as in compare.py; run as
`.venv/bin/python docs/benchmarks/float32_decays/compare_packed.py > packed_run_i.json`."""
import sys, time, statistics, json
sys.path.insert(0, "/tmp/oldpkg")
import torch
torch.set_num_threads(2)
import linattn, linattn_old
from linattn.bench.harness import OtherLoad
T, H, D = 16384, 8, 64
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, H, T, D, generator=g).requires_grad_() for _ in range(3))
W = linattn.favor_projection(256, D, generator=torch.Generator().manual_seed(1))
cu = torch.tensor([0, 100, 5000, 5001, 12000, T])
cases = {"linear packed": lambda m: m.linear_attention(q, k, v, causal=True, cu_seqlens=cu),
         "favor packed": lambda m: m.favor_attention(q, k, v, W, causal=True, cu_seqlens=cu)}
load = OtherLoad(reference=True); res = {}
for name, f in cases.items():
    for m in (linattn, linattn_old): f(m).sum().backward()
    t = {"new": [], "old": []}
    for rep in range(5):
        order = (("new", linattn), ("old", linattn_old)) if rep % 2 == 0 else (("old", linattn_old), ("new", linattn))
        for label, m in order:
            t0 = time.perf_counter(); f(m).sum().backward(); t[label].append(time.perf_counter() - t0)
    res[name] = {k: statistics.median(x) for k, x in t.items()}; res[name]["new/old"] = res[name]["new"] / res[name]["old"]
print(json.dumps({"results": res, "load": load.finish()}))
