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
and train from ``.sum()`` (a cotangent of strides 0), the accelerator strategy.
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
print(json.dumps(rows))
"""


def main() -> None:
    res, out = accuracy_ab(__doc__, "docs/benchmarks/determinism/determinism.py", "determinism", _CHILD,
                           (str(ROOT / "tests"),))
    old, new, command = res["old_rows"], res["new_rows"], res["command"]
    lines = [f"# Deterministic algorithms and packed documents: this checkout ({res['new']}) against {res['old']}",
             "", f"Written by `{command}`; do not edit by hand. On this CPU; the cases are in the script's "
             "docstring. Counts, no timing: the same in every run.", "",
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
    write_table(out / "determinism.md", lines)


if __name__ == "__main__":
    main()
