"""The delta rule's gradients on the accelerator strategy against the CPU strategy's over long
sequences, this checkout against an earlier revision (each side in a process of its own): the
accelerator's backward forms the states again from the kept pseudo-values, by a recurrence that does
not repeat its forward's rounding (the forward scans the full transitions) and does not damp the
difference; started again from the forward's states every ``delta.ANCHOR_SPAN`` chunks, it drifts
over a span at most.

    python docs/benchmarks/kda_energies/state_anchors.py OLD_REV --out docs/benchmarks/kda_energies

B = 1, H = 2, D = Dv = 32, seed 0: q ~ N(0, 1), k L2-normalised N(0, 1), v ~ N(0, 1), beta ~ U(0, 1),
weak log decays -U(0, 1e-5) per head (Gated DeltaNet) or per key channel (KDA), float32 as a model
passes them; the loss <out, W>, W ~ N(0, 1). Error: the largest over q, k, v, beta of ||grad - ref|| /
||ref||, ref the form in float64 on the CPU strategy (the chunked form, which equals the plain
recurrence to about 1e-15 in the tests).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import json
import torch
import torch.nn.functional as F
from linattn.functional import delta_rule_attention

torch.set_num_threads(2)
H, D = 2, 32
rows = []
for gate in ("head", "channel"):
    for n in (4096, 16384, 65536):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, H, n, D, generator=gen)
        k = F.normalize(torch.randn(1, H, n, D, generator=gen), dim=-1)
        v, beta = torch.randn(1, H, n, D, generator=gen), torch.rand(1, H, n, generator=gen)
        g = -torch.rand(1, H, n, *((D,) if gate == "channel" else ()), generator=gen) * 1e-5
        weight = torch.randn(1, H, n, D, generator=gen, dtype=torch.float64)

        def grads(dtype, strategy):
            x = [t.detach().to(dtype, copy=True).requires_grad_() for t in (q, k, v, beta)]
            out = delta_rule_attention(*x, log_decay=g.double() if dtype == torch.float64 else g, strategy=strategy)
            (out.double() * weight).sum().backward()
            return [t.grad.double() for t in x]

        ref = grads(torch.float64, "cpu")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for strategy in ("cpu", "accelerator"):
                errs = [float((a - b).norm() / b.norm()) for a, b in zip(grads(dtype, strategy), ref)]
                rows.append({"gate": gate, "n": n, "dtype": str(dtype).split(".")[-1], "strategy": strategy,
                             "errors": dict(zip(("q", "k", "v", "beta"), errs))})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/kda_energies/state_anchors.py", "state_anchors", _CHILD)
    old, new, command = res["old_rows"], res["new_rows"], res["command"]

    def worst(errors):
        name = max(errors, key=errors.get)
        return f"{errors[name]:.1e} ({name})", errors[name]

    cells = {(side, r["gate"], r["n"], r["dtype"], r["strategy"]): worst(r["errors"])
             for side, rows in (("old", old), ("new", new)) for r in rows}
    lines = [f"# The delta rule's gradients over long sequences on the accelerator: this checkout ({res['new']}) "
             f"against {res['old']}", "",
             f"Written by `{command}`; do not edit by hand. B = 1, H = 2, D = 32, weak decays; inputs and error in "
             "the script's docstring. Each cell: the largest relative error of the gradients against float64, and "
             "whose; accelerator / cpu: how many times the CPU strategy's.", "",
             "| gate | N | inputs | cpu | accelerator old | new | accelerator / cpu old | new |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in new:
        if r["strategy"] != "cpu":
            continue
        key = (r["gate"], r["n"], r["dtype"])
        (cpu_t, cpu), (ocpu_t, ocpu) = cells[("new", *key, "cpu")], cells[("old", *key, "cpu")]
        (o_t, o), (n_t, n) = cells[("old", *key, "accelerator")], cells[("new", *key, "accelerator")]
        lines.append(f"| {r['gate']} | {r['n']} | {r['dtype']} | {cpu_t} | {o_t} | {n_t} | {o / ocpu:.1f} | "
                     f"{n / cpu:.1f} |")
    write_table(out / "state_anchors.md", lines)


if __name__ == "__main__":
    main()
