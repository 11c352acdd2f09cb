"""Float32 against float64 with every running sum in a CPU's order and in CUDA's (emulated), this
checkout against an earlier revision, each side in a process of its own, on this CPU.

    python docs/benchmarks/scan_rounding/scan_rounding.py OLD_REV --out docs/benchmarks/scan_rounding

A CPU's cumsum carries a float's running sum in double, so each of its sums is rounded once;
CUDA's adds in float, by a Sklansky tree in blocks along the last dimension and one term after
another along any other (aten's ScanUtils.cuh). ``tests/probes.py``'s ``cuda_scan_order`` sums
every floating cumsum of a call (the engines' own included) that way on a CPU. Cases: the hardest
of tests/test_float32_decays.py: B = 1, H = 2, D = 16, N = 65536, q, v ~ N(0, 1), k L2-normalised,
beta = sigmoid(N(0, 1)), log decays logsigmoid(N(0, 1) + 6) (about -0.0025) with 5% of them -39
(just above the reset threshold), one per head or one per key channel; Gated DeltaNet, GLA per
head and per key channel, and Mamba-2's SSD route (GLA with value_scale and skip, grouped heads:
one group of keys for the two heads, dt = softplus(N(0, 1)), log decays -dt exp(N(0, 1)) with 5%
of them -39), on each strategy. Error: max |out - ref| / max |ref|, ref the same form in float64
with a CPU's order (float64 sums carry far more digits than float32 needs). No timing: the same
in every run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import ROOT, accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import contextlib, json, sys
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
sys.path.insert(0, sys.argv[1])  # this checkout's tests/: the emulation, the same on both sides
from probes import cuda_scan_order
from linattn.functional import delta_rule_attention, gated_linear_attention

g = torch.Generator().manual_seed(1)
N, H, D = 65536, 2, 16
q, k, v = (torch.randn(1, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
k = F.normalize(k, dim=-1)
beta = torch.sigmoid(torch.randn(1, H, N, generator=g, dtype=torch.float64))
large = lambda shape: torch.rand(shape, generator=g, dtype=torch.float64) < 0.05
head = F.logsigmoid(torch.randn(1, H, N, generator=g, dtype=torch.float64) + 6).masked_fill(large((1, H, N)), -39.0)
chan = F.logsigmoid(torch.randn(1, H, N, D, generator=g, dtype=torch.float64) + 6).masked_fill(large((1, H, N, D)), -39.0)
dt = F.softplus(torch.randn(1, H, N, generator=g, dtype=torch.float64))
ssd = (-dt * torch.randn(1, H, 1, generator=g, dtype=torch.float64).exp()).masked_fill(large((1, H, N)), -39.0)
skip = torch.randn(H, generator=g, dtype=torch.float64)
FORMS = {
    "Gated DeltaNet": lambda c, s: delta_rule_attention(c(q), c(k), c(v), c(beta), log_decay=c(head), strategy=s),
    "GLA per head": lambda c, s: gated_linear_attention(c(q), c(k), c(v), c(head), strategy=s),
    "GLA per key channel": lambda c, s: gated_linear_attention(c(q), c(k), c(v), c(chan), strategy=s),
    "SSD (grouped)": lambda c, s: gated_linear_attention(c(q[:, :1]), c(k[:, :1]), c(v), c(ssd), scale=1.0,
                                                         value_scale=c(dt), skip=c(skip), strategy=s),
}
rows = []
for name, f in FORMS.items():
    for strategy in ("cpu", "accelerator"):
        ref = f(lambda t: t, strategy)
        for order in ("cpu", "cuda"):
            with cuda_scan_order() if order == "cuda" else contextlib.nullcontext():
                out = f(lambda t: t.float(), strategy).double()
            rows.append({"form": name, "strategy": strategy, "order": order,
                         "error": float((out - ref).abs().max() / ref.abs().max())})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/scan_rounding/scan_rounding.py", "scan_rounding", _CHILD,
                           (str(ROOT / "tests"),))
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    lines = [f"# Float32 against float64 in a CPU's and CUDA's scan order: this checkout ({res['new']}) "
             f"against {res['old']}", "", f"Written by `{command}`; do not edit by hand. On this CPU, CUDA's order "
             "emulated (tests/probes.py, `cuda_scan_order`); the cases are in the script's docstring. Errors, "
             "no timing: the same in every run.", "",
             "| form | strategy | error, CPU order: old | new | CUDA order: old | new |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for i in range(0, len(old), 2):
        (oc, ok), (nc, nk) = old[i:i + 2], new[i:i + 2]
        assert oc["form"] == ok["form"] == nc["form"] == nk["form"] and (oc["order"], ok["order"]) == ("cpu", "cuda")
        lines.append(f"| {oc['form']} | {oc['strategy']} | {oc['error']:.2e} | {nc['error']:.2e} | "
                     f"{ok['error']:.2e} | {nk['error']:.2e} |")
    write_table(out / "scan_rounding.md", lines)


if __name__ == "__main__":
    main()
