"""The log decay's gradient against float64 before and after a revision, over long sequences:
``delta._energies`` telescopes the states' energies between exact ones, and a block can be long (the
accelerator's is the whole sequence; a CPU block of narrow rows is ``BLOCK_WIDTH / (R (D + Dv))``
chunks, 1024 for one head 16 wide). Delta rule with a gate per head (Gated DeltaNet) and per key
channel (KDA), both strategies, float32 against float64. Each side runs in a process of its own (this
checkout, and a worktree of ``old_rev``).

    python docs/benchmarks/kda_energies/anchors.py OLD_REV --out docs/benchmarks/kda_energies

The float64 reference is the chunked form's CPU strategy (each side's own): at N = 65536 the
recurrent ``delta_rule_attention_reference`` takes minutes, and the chunked form equals it in
float64 to 1e-10 in the tests (``test_the_energies_are_exact_at_every_span_of_a_block``); the
telescoping's float64 rounding is below 1e-12 of these errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import json
import torch
from linattn.functional import delta_rule_attention

torch.set_num_threads(2)


def errors(gate, n, H, D, scale_g):
    gen = torch.Generator().manual_seed(1)
    f64 = dict(dtype=torch.float64, generator=gen)
    q = torch.randn(1, H, n, D, **f64)
    k = torch.nn.functional.normalize(torch.randn(1, H, n, D, **f64), dim=-1)
    v = torch.randn(1, H, n, D, **f64)
    beta = torch.rand(1, H, n, **f64)
    g = -torch.rand(*((1, H, n, D) if gate == "channel" else (1, H, n)), **f64) * scale_g
    weights = torch.linspace(-1, 1, H * n * D, dtype=torch.float64).view(1, H, n, D)

    def decay_grad(dtype, strategy):
        xs = [t.detach().to(dtype, copy=True).requires_grad_(True) for t in (q, k, v, beta, g)]
        (delta_rule_attention(*xs[:4], log_decay=xs[4], strategy=strategy) * weights.to(dtype)).sum().backward()
        return xs[4].grad.double()

    ref = decay_grad(torch.float64, "cpu")
    return {s: float((decay_grad(torch.float32, s) - ref).norm() / ref.norm()) for s in ("cpu", "accelerator")}


rows = []
for gate in ("head", "channel"):
    for H, D in ((1, 16), (2, 32)):
        for n in (4096, 16384, 65536):
            for scale_g in (0.001, 0.01):
                for strategy, err in errors(gate, n, H, D, scale_g).items():
                    rows.append({"gate": gate, "H": H, "D": D, "n": n, "scale_g": scale_g, "strategy": strategy,
                                 "dlog_decay": err})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/kda_energies/anchors.py", "anchors", _CHILD)
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    worst = {side: max(r["dlog_decay"] for r in rows) for side, rows in (("old", old), ("new", new))}
    lines = [f"# The log decay's gradient over long sequences: this checkout ({res['new']}) against {res['old']}", "",
             f"Written by `{command}`; do not edit by hand. float32 against float64 (the chunked form in "
             "float64, see the script), B = 1, H heads D wide (Dv = D), log decays -U(0, s) per head or per key "
             "channel, default chunk sizes and blocks; ||grad - ref|| / ||ref|| of a weighted sum's log-decay "
             f"gradient. Worst: {worst['old']:.1e} before, {worst['new']:.1e} after.", "",
             "| gate | H x D | N | s | strategy | old | new | new / old |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for o, n in zip(old, new):
        assert all(o[key] == n[key] for key in ("gate", "H", "D", "n", "scale_g", "strategy"))
        lines.append(f"| {o['gate']} | {o['H']} x {o['D']} | {o['n']} | {o['scale_g']} | {o['strategy']} | "
                     f"{o['dlog_decay']:.1e} | {n['dlog_decay']:.1e} | {n['dlog_decay'] / o['dlog_decay']:.2f} |")
    write_table(out / "anchors.md", lines)


if __name__ == "__main__":
    main()
