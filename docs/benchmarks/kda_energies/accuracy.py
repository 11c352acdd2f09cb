"""The gradients' error against the float64 reference before and after a revision, for the delta rule
with a gate per key channel (KDA) and per head (Gated DeltaNet), both strategies, weak to strong
decays: what telescoping gamma_C's gradient from the block's end (``delta._energies``) costs in
digits. Each side runs in a process of its own (this checkout, and a worktree of ``old_rev``).

    python docs/benchmarks/kda_energies/accuracy.py OLD_REV --out docs/benchmarks/kda_energies
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import ROOT, old_checkout  # noqa: E402

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


def run_side(src: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"accuracy.py: the side at {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_rev")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    command = "python docs/benchmarks/kda_energies/accuracy.py " + shlex.join(sys.argv[1:])
    new_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    with old_checkout(args.old_rev) as (old_sha, old_src):
        old = run_side(old_src)
    new = run_side(ROOT / "src")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps({"command": command, "old": old_sha, "new": new_sha,
                                                        "old_rows": old, "new_rows": new}, indent=1) + "\n")
    lines = [f"# Gradient error against the float64 reference: this checkout ({new_sha}) against {old_sha[:7]}", "",
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
    (args.out / "accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
