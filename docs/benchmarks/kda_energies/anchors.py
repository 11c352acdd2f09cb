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


def run_side(src: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"anchors.py: the side at {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old_rev")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    command = "python docs/benchmarks/kda_energies/anchors.py " + shlex.join(sys.argv[1:])
    new_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    with old_checkout(args.old_rev) as (old_sha, old_src):
        old = run_side(old_src)
    new = run_side(ROOT / "src")
    args.out.mkdir(parents=True, exist_ok=True)
    label = new_sha + (" with uncommitted changes to src" if dirty else "")
    (args.out / "anchors.json").write_text(json.dumps({"command": command, "old": old_sha, "new": label,
                                                       "old_rows": old, "new_rows": new}, indent=1) + "\n")
    worst = {side: max(r["dlog_decay"] for r in rows) for side, rows in (("old", old), ("new", new))}
    lines = [f"# The log decay's gradient over long sequences: this checkout ({label}) against {old_sha[:7]}", "",
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
    (args.out / "anchors.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
