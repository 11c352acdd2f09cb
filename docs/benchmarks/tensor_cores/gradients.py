"""Gradients with half inputs on the accelerator strategy against the CPU strategy's, both against
float64, this checkout against an earlier revision (each side in a process of its own). The
accelerator's forward takes half operands (tensor cores on a GPU; on this CPU the rounded operands
multiplied in float32: the same numbers up to the order of the sums); the CPU strategy's keeps
float32 operands, so its error is that of the half inputs and gradients themselves.

    python docs/benchmarks/tensor_cores/gradients.py OLD_REV --out docs/benchmarks/tensor_cores

B = 1, H = 2, D = Dv = 64, seed 0: q, k ~ N(0, 1) (k L2-normalised for the delta rule), v ~ N(mean, 1),
beta ~ U(0, 1), log decays -U(0, s) per head or per key channel (float32, as a model passes them);
the loss is <out, W> with W ~ N(0, 1). Error: ||grad - ref|| / ||ref||, ref the form in float64 on the
CPU strategy, for each of q, k, v (and beta); the table gives the largest and which input it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import accuracy_ab, write_table  # noqa: E402

# (form, N, mean of v, log-decay scale s)
CASES = [("linear", 4096, 0.0, 0.0), ("linear", 4096, 3.0, 0.0), ("linear", 16384, 3.0, 0.0),
         ("favor", 4096, 3.0, 0.0), ("gla_head", 16384, 0.0, 1e-3), ("gla_channel", 16384, 0.0, 1e-3),
         ("gated_delta", 4096, 0.0, 0.05), ("gated_delta", 16384, 0.0, 1e-5), ("gated_delta", 4096, 3.0, 1e-3),
         ("kda", 16384, 0.0, 1e-5)]

_CHILD = r"""
import json, sys
import torch
import torch.nn.functional as F
from linattn.functional import delta_rule_attention, favor_attention, favor_projection, gated_linear_attention, linear_attention

torch.set_num_threads(2)
CASES = json.loads(sys.argv[1])
H, D = 2, 64
proj = favor_projection(256, D, generator=torch.Generator().manual_seed(0))


def call(form, x, g, strategy):
    if form == "linear":
        return linear_attention(*x, causal=True, strategy=strategy)
    if form == "favor":
        q, k, v = x
        return favor_attention(q / D ** 0.25, k / D ** 0.25, v, proj.to(q.dtype), causal=True, strategy=strategy)
    if form.startswith("gla"):
        return gated_linear_attention(*x, log_decay=g, strategy=strategy)
    return delta_rule_attention(*x, log_decay=g, strategy=strategy)


rows = []
for form, n, mean, s in CASES:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, H, n, D, generator=gen), torch.randn(1, H, n, D, generator=gen)
    v = torch.randn(1, H, n, D, generator=gen) + mean
    inputs = [q, k, v]
    names = ["q", "k", "v"]
    if form in ("gated_delta", "kda"):
        inputs = [q, F.normalize(k, dim=-1), v, torch.rand(1, H, n, generator=gen)]
        names.append("beta")
    g = None
    if form in ("gla_head", "gated_delta"):
        g = -torch.rand(1, H, n, generator=gen) * s
    elif form in ("gla_channel", "kda"):
        g = -torch.rand(1, H, n, D, generator=gen) * s
    weight = torch.randn(1, H, n, D, generator=gen, dtype=torch.float64)

    def grads(dtype, strategy):
        x = [t.to(dtype).requires_grad_() for t in inputs]
        gg = None if g is None else (g.double() if dtype == torch.float64 else g)
        (call(form, x, gg, strategy).double() * weight).sum().backward()
        return [t.grad.double() for t in x]

    ref = grads(torch.float64, "cpu")
    for dtype in (torch.bfloat16, torch.float16):
        for strategy in ("cpu", "accelerator"):
            errs = {name: float((a - b).norm() / b.norm()) for name, a, b in zip(names, grads(dtype, strategy), ref)}
            rows.append({"form": form, "n": n, "mean": mean, "s": s, "dtype": str(dtype).split(".")[-1],
                         "strategy": strategy, "errors": errs})
print(json.dumps(rows))
"""


def _worst(errors: dict) -> tuple[str, float]:
    name = max(errors, key=errors.get)
    return name, errors[name]


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/tensor_cores/gradients.py", "gradients", _CHILD, (json.dumps(CASES),))
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    lines = [f"# Gradients with half inputs: the accelerator strategy against the CPU strategy, this checkout "
             f"({res['new']}) against {res['old']}", "",
             f"Written by `{command}`; do not edit by hand. The inputs and the error are in the script's docstring "
             "(B = 1, H = 2, D = 64). Each cell: the largest relative error of the inputs' gradients against float64, "
             "and whose. accelerator / cpu: how many times the CPU strategy's error (which is the half dtype's own).",
             "", "| form | N | mean of v | s | inputs | cpu | accelerator old | new | accelerator / cpu old | new |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    by = {}
    for side, rows in (("old", old), ("new", new)):
        for r in rows:
            by[(side, r["form"], r["n"], r["mean"], r["s"], r["dtype"], r["strategy"])] = r["errors"]
    for r in new:
        if r["strategy"] != "cpu":
            continue
        key = (r["form"], r["n"], r["mean"], r["s"], r["dtype"])
        cpu_name, cpu = _worst(by[("new", *key, "cpu")])
        (on, o), (nn_, n) = _worst(by[("old", *key, "accelerator")]), _worst(by[("new", *key, "accelerator")])
        _, ocpu = _worst(by[("old", *key, "cpu")])
        lines.append(f"| {r['form']} | {r['n']} | {r['mean']:g} | {r['s']:g} | {r['dtype']} | {cpu:.1e} ({cpu_name}) | "
                     f"{o:.1e} ({on}) | {n:.1e} ({nn_}) | {o / ocpu:.1f} | {n / cpu:.1f} |")
    write_table(out / "gradients.md", lines)


if __name__ == "__main__":
    main()
