"""The gradients' error against the float64 reference before and after a revision, for the delta rule
with a gate per key channel (KDA) and per head (Gated DeltaNet), both strategies, weak to strong
decays: what telescoping gamma_C's gradient from the block's end (``delta._energies``) costs in
digits. Each side runs in a process of its own (this checkout, and a worktree of ``old_rev``).

    python docs/benchmarks/kda_energies/accuracy.py OLD_REV --out docs/benchmarks/kda_energies
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import json, sys
import torch
from linattn.functional import delta_rule_attention
from linattn.functional.delta import delta_rule_attention_reference

GRADS = ("q", "k", "v", "beta", "log_decay")


def errors(gate, n, scale_g, strategy, resets):
    gen = torch.Generator().manual_seed(1)
    B, H, D = 1, 2, 32
    f64 = dict(dtype=torch.float64, generator=gen)
    q = torch.randn(B, H, n, D, **f64)
    k = torch.nn.functional.normalize(torch.randn(B, H, n, D, **f64), dim=-1)
    v = torch.randn(B, H, n, D, **f64)
    beta = torch.rand(B, H, n, **f64)
    g = -torch.rand(*((B, H, n, D) if gate == "channel" else (B, H, n)), **f64) * scale_g
    if resets:
        g[:, :, n // 3] = -1e4
    weights = torch.linspace(-1, 1, B * H * n * D, dtype=torch.float64).view(B, H, n, D)

    def grads(dtype, fn, **kw):
        xs = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in (q, k, v, beta, g)]
        (fn(*xs[:4], log_decay=xs[4], **kw) * weights.to(dtype)).sum().backward()
        return [x.grad.double() for x in xs]

    ref = grads(torch.float64, delta_rule_attention_reference)
    got = grads(torch.float32, delta_rule_attention, strategy=strategy)
    return {name: float((a - b).norm() / b.norm()) for name, a, b in zip(GRADS, got, ref)}


rows = []
for gate in ("channel", "head"):
    for strategy in ("cpu", "accelerator"):
        for n, scale_g, resets in ((300, 0.01, False), (300, 3.0, True), (4096, 0.001, False), (4096, 0.01, False),
                                   (4096, 1.0, True)):
            rows.append({"gate": gate, "strategy": strategy, "n": n, "scale_g": scale_g, "resets": resets,
                         "errors": errors(gate, n, scale_g, strategy, resets)})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/kda_energies/accuracy.py", "accuracy", _CHILD)
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    lines = [f"# Gradient error against the float64 reference: this checkout ({res['new']}) against {res['old']}", "",
             f"Written by `{command}`; do not edit by hand. float32 against float64 "
             "(`delta_rule_attention_reference`), B = 1, H = 2, D = 32, log decays -U(0, s), "
             "resets: every channel's log decay -1e4 at N/3; ||grad - ref|| / ||ref|| of a weighted sum's gradient.",
             "", "| gate | strategy | N | s | resets | dlog_decay old | new | new / old | dk old | new |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for o, n in zip(old, new):
        eo, en = o["errors"], n["errors"]
        lines.append(f"| {o['gate']} | {o['strategy']} | {o['n']} | {o['scale_g']} | {o['resets']} | "
                     f"{eo['log_decay']:.1e} | {en['log_decay']:.1e} | {en['log_decay'] / eo['log_decay']:.1f} | "
                     f"{eo['k']:.1e} | {en['k']:.1e} |")
    write_table(out / "accuracy.md", lines)


if __name__ == "__main__":
    main()
