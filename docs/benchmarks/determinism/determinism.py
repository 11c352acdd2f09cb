"""Deterministic algorithms (``torch.use_deterministic_algorithms(True)``, transformers'
``full_determinism``) and packed documents, this checkout against an earlier revision: the ops of
each call that CUDA refuses under that setting, the call's kernel launches with the setting off and
on, and the launches of packed calls at two lengths. Each side runs in a process of its own, on
this CPU.

    python docs/benchmarks/determinism/determinism.py OLD_REV --out docs/benchmarks/determinism

Cases: bench gpu's chunked forms (``linattn.bench.launches.form_call``: checkpoint widths, B = 1,
float32, N = 4096, the accelerator strategy forced; prefill, and train with a cotangent of ones).
Refused: the ops CUDA raises on under the setting (tests/probes.py ``refused_by_cuda``, counted by
its ``OpProbe`` inside the engines' operators: a floating cumsum first of all); on a CPU they run,
so the old side's counts are what a deterministic GPU run would have stopped at. Launches:
``count_launches`` (computing leaf aten ops), the setting on including the NaN fills of
uninitialised memory that it adds on every device. Packed: each form at the quick widths (2 heads
of 16), four documents (``cu_seqlens = [0, 1000, T / 2, T - 5, T]``), T = 4096 and 16384, prefill
and train from ``.sum()`` (a cotangent of strides 0), the accelerator strategy. Accuracy: float32
GLA and Gated DeltaNet (a log decay per head), B = 1, H = 2, D = 16, N = 65536, the default strategy,
with the setting off and on, against the same form in float64: max |out - ref| / max |ref|. Inputs
as tests/test_float32_decays.py's hardest case: q, v ~ N(0, 1), k L2-normalised, log decays
logsigmoid(N(0, 1) + 6) (about -0.0025) with 5% of them -39, just above the reset threshold, where
the digits of the small decays after a large one are hardest to keep.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: ab.py
from ab import ROOT, accuracy_ab, write_table  # noqa: E402

_CHILD = r"""
import json, sys
import torch
torch.set_num_threads(2)
sys.path.insert(0, sys.argv[1])  # this checkout's tests/: the probe, the same on both sides
from probes import OpProbe, deterministic_algorithms
from linattn.bench.gpu import KERNEL_FORMS, form_function, form_projection, make_inputs, widths
from linattn.bench.launches import count_launches, form_call

rows = []
for form in ("gated_delta", "kda", "gla_channel", "linear"):
    for pass_ in ("prefill", "train"):
        call = form_call(form, 4096, pass_, "accelerator")
        call()
        normal = count_launches(call).total
        with deterministic_algorithms():
            call()
            deterministic = count_launches(call).total
            with OpProbe(engines=True) as p:
                call()
        rows.append({"case": "deterministic", "form": form, "pass": pass_, "launches": normal,
                     "deterministic_launches": deterministic, "refused": sum(p.cuda_refusals.values())})
for form_name, form in KERNEL_FORMS.items():
    heads, head_dim, state = widths(form, True)
    for T in (4096, 16384):
        tensors = make_inputs(form, T, heads, head_dim, dtype=torch.float32, device=torch.device("cpu"), state=state)
        fn = form_function(form, strategy="accelerator", projection=form_projection(form, head_dim),
                           cu_seqlens=torch.tensor([0, 1000, T // 2, T - 5, T]))

        def prefill():
            with torch.no_grad():
                fn(*tensors)

        def train():
            for t in tensors:
                t.grad = None
            fn(*tensors).sum().backward()
        prefill()
        counts = {"prefill": count_launches(prefill).total}
        for t in tensors:
            t.requires_grad_(t.is_floating_point())
        train()
        counts["train"] = count_launches(train).total
        rows.append({"case": "packed", "form": form_name, "T": T, **counts})
import contextlib
import torch.nn.functional as F
from linattn.functional import delta_rule_attention, gated_linear_attention
g = torch.Generator().manual_seed(1)
N, H, D = 65536, 2, 16
q, k, v = (torch.randn(1, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
k = F.normalize(k, dim=-1)
beta = torch.sigmoid(torch.randn(1, H, N, generator=g, dtype=torch.float64))
ld = F.logsigmoid(torch.randn(1, H, N, generator=g, dtype=torch.float64) + 6)
ld = ld.masked_fill(torch.rand(1, H, N, generator=g, dtype=torch.float64) < 0.05, -39.0)
FORMS = {"GLA per head": lambda c: gated_linear_attention(c(q), c(k), c(v), c(ld)),
         "Gated DeltaNet": lambda c: delta_rule_attention(c(q), c(k), c(v), c(beta), log_decay=c(ld))}
for form_name, f in FORMS.items():
    ref = f(lambda t: t)
    for deterministic in (False, True):
        with deterministic_algorithms() if deterministic else contextlib.nullcontext():
            out = f(lambda t: t.float()).double()
        rows.append({"case": "accuracy", "form": form_name, "deterministic": deterministic,
                     "error": float((out - ref).abs().max() / ref.abs().max())})
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/determinism/determinism.py", "determinism", _CHILD,
                           (str(ROOT / "tests"),))
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    lines = [f"# Deterministic algorithms and packed documents: this checkout ({res['new']}) against {res['old']}",
             "", f"Written by `{command}`; do not edit by hand. On this CPU; the cases are in the script's "
             "docstring. Counts and errors, no timing: the same in every run.", "",
             "## Under torch.use_deterministic_algorithms(True)", "",
             "Refused: ops CUDA raises on under the setting (0 is what runs there). Launches: the setting off / on.",
             "", "| form | pass | refused old | new | launches old | new |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    pairs = list(zip(old, new))
    for o, n in pairs:
        if o["case"] == "deterministic":
            assert (o["form"], o["pass"]) == (n["form"], n["pass"])
            lines.append(f"| `{o['form']}` | {o['pass']} | {o['refused']} | {n['refused']} | "
                         f"{o['launches']} / {o['deterministic_launches']} | "
                         f"{n['launches']} / {n['deterministic_launches']} |")
    lines += ["", "## Packed documents: launches at T = 4096 and 16384", "",
              "| form | pass | old 4096 | old 16384 | new 4096 | new 16384 |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    packed = [(o, n) for o, n in pairs if o["case"] == "packed"]
    for (o4, n4), (o16, n16) in zip(packed[::2], packed[1::2]):
        assert o4["form"] == o16["form"] == n4["form"] == n16["form"] and (o4["T"], o16["T"]) == (4096, 16384)
        for pass_ in ("prefill", "train"):
            lines.append(f"| `{o4['form']}` | {pass_} | {o4[pass_]} | {o16[pass_]} | {n4[pass_]} | {n16[pass_]} |")
    lines += ["", "## float32 against float64, log decays of -39 (N = 65536)", "",
              "| form | deterministic algorithms | error old | new |", "| --- | --- | ---: | ---: |"]
    for o, n in pairs:
        if o["case"] == "accuracy":
            assert (o["form"], o["deterministic"]) == (n["form"], n["deterministic"])
            lines.append(f"| {o['form']} | {'on' if o['deterministic'] else 'off'} | {o['error']:.2e} | "
                         f"{n['error']:.2e} |")
    write_table(out / "determinism.md", lines)


if __name__ == "__main__":
    main()
