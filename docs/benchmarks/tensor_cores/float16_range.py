"""float16 and bfloat16 inputs on the accelerator strategy (forced on this CPU, which multiplies the
rounded operands in float32: the numbers a GPU's tensor cores give, up to the order of the sums) over
a long sequence, this checkout against an earlier revision: is the output finite, and its error
against float64. A state is a sum over positions and passes float16's 65504 at N ~ 2e4 with inputs
of order 1; every output here is representable in float16. Each side runs in a process of its own.

    python docs/benchmarks/tensor_cores/float16_range.py OLD_REV --out docs/benchmarks/tensor_cores

Inputs (B = 1, H = 1, D = 16, N = 65536, seed 0): q, v ~ N(0, 1) (v + 3), keys |N(0, 1)| (positive,
as a feature map's) except the delta rule's (L2-normalised, values times 3000), queries times 1e-3
for GLA (its output q S is not normalised), log decays -U(0, 1e-5) per head or per key channel.
Error: ||out - ref|| / ||ref||, ref the form in float64 on the CPU strategy.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import json, math
import torch
import torch.nn.functional as F
from linattn.functional import delta_rule_attention, favor_attention, favor_projection, gated_linear_attention, linear_attention

torch.set_num_threads(2)
torch.manual_seed(0)
N, H, D = 65536, 1, 16
q = torch.randn(1, H, N, D)
k = torch.randn(1, H, N, D).abs()
v = torch.randn(1, H, N, D) + 3
kn = F.normalize(torch.randn(1, H, N, D), dim=-1)
b = torch.rand(1, H, N)
gh, gc = -torch.rand(1, H, N) * 1e-5, -torch.rand(1, H, N, D) * 1e-5
proj = favor_projection(32, D, generator=torch.Generator().manual_seed(0))
FORMS = {
    "causal linear (elu+1)": lambda c, **kw: linear_attention(c(q), c(k), c(v), causal=True, **kw),
    "FAVOR+ (32 features)": lambda c, **kw: favor_attention(c(q), c(k), c(v), c(proj), causal=True, **kw),
    "GLA per head": lambda c, **kw: gated_linear_attention(c(q * 1e-3), c(k), c(v), log_decay=c(gh), **kw),
    "GLA per key channel": lambda c, **kw: gated_linear_attention(c(q * 1e-3), c(k), c(v), log_decay=c(gc), **kw),
    "Gated DeltaNet": lambda c, **kw: delta_rule_attention(c(q), c(kn), c(3000 * v), c(b), log_decay=c(gh), **kw),
    "KDA": lambda c, **kw: delta_rule_attention(c(q), c(kn), c(3000 * v), c(b), log_decay=c(gc), **kw),
}
rows = []
with torch.no_grad():
    for name, f in FORMS.items():
        ref = f(lambda t: t.double(), strategy="cpu")
        for dtype in (torch.float16, torch.bfloat16):
            # the log decays stay float32 (as a model passes them), the rest in the half dtype
            out = f(lambda t: t if t is gh or t is gc else t.to(dtype), strategy="accelerator").double()
            err = float((out - ref).norm() / ref.norm())
            rows.append({"form": name, "dtype": str(dtype).split(".")[-1], "finite": bool(torch.isfinite(out).all()),
                         "error": err if math.isfinite(err) else None, "ref_max": float(ref.abs().max())})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/tensor_cores/float16_range.py", "float16_range", _CHILD)
    old, new, command = res["old_rows"], res["new_rows"], res["command"]

    def err(r):
        return f"{r['error']:.1e}" if r["error"] is not None else "-"

    lines = [f"# Half inputs past float16's range on the accelerator: this checkout ({res['new']}) against {res['old']}",
             "", f"Written by `{command}`; do not edit by hand. N = 65536, one head 16 wide, the accelerator strategy "
             "forced on this CPU; the inputs are in the script's docstring. Error against float64; the largest "
             "|output| shows that float16 can hold every output.", "",
             "| form | inputs | largest output | finite old / new | error old | new |",
             "| --- | --- | ---: | --- | ---: | ---: |"]
    for o, n in zip(old, new):
        assert (o["form"], o["dtype"]) == (n["form"], n["dtype"])
        lines.append(f"| {o['form']} | {o['dtype']} | {n['ref_max']:.3g} | {o['finite']} / {n['finite']} | "
                     f"{err(o)} | {err(n)} |")
    write_table(out / "float16_range.md", lines)


if __name__ == "__main__":
    main()
