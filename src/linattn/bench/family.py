"""`linattn bench family`: the local-attention claim of the family (issue 4).

Claim: local attention forward+backward at N = 65536, window 256 (B = 1, H = 8, D = 64, float32)
runs in less time than softmax_attention forward+backward at N = 4096.

Times local attention (causal and bidirectional) at ``n_local`` and softmax attention (PyTorch SDPA,
bidirectional and causal) at ``n_softmax``, interleaved A B C D A B C D ..., median of ``repeats``
after one warm-up round. Writes family.json and family.md; every number there comes from this code.

What to expect from arithmetic alone: a causal local query scores window + 1 = 257 keys, a
bidirectional one 2 window + 1 = 513, a softmax query at N = 4096 scores 4096 (2048 on average
when causal). 65536 x 257 is 1.004 x 4096 x 4096: causal local at 65536 and bidirectional
softmax at 4096 do the same useful work; the other pairings differ by 2x.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .harness import LOCAL_WINDOW, Case, call, machine_info, make_inputs, median, time_calls, write_atomically

CONTENDERS = [  # (label, impl, causal, which n)
    ("local causal", "local", True, "n_local"),
    ("local bidirectional", "local", False, "n_local"),
    ("softmax bidirectional", "softmax", False, "n_softmax"),
    ("softmax causal", "softmax", True, "n_softmax"),
]


def run_family(*, out_dir: str | Path = "docs/benchmarks", n_local: int = 65536, n_softmax: int = 4096,
               repeats: int = 3, quiet: bool = False) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    ns = {"n_local": n_local, "n_softmax": n_softmax}
    say(f"linattn bench family: local (window {LOCAL_WINDOW}) at N = {n_local} vs softmax at N = {n_softmax}, "
        f"B=1 H=8 D=64 float32, forward+backward, {torch.get_num_threads()} threads")
    t_start = time.perf_counter()
    cases = {label: Case(impl, causal, ns[which]) for label, impl, causal, which in CONTENDERS}
    inputs = {label: make_inputs(c) for label, c in cases.items()}
    fns = {label: (lambda c=c, x=inputs[label]: call(c, x)) for label, c in cases.items()}
    times = time_calls(fns, repeats=repeats, warmup=1)
    seconds = {label: median(ts) for label, ts in times.items()}
    result = {
        "command": f"linattn bench family --n-local {n_local} --n-softmax {n_softmax} --repeats {repeats} --out {out_dir}",
        "machine": machine_info(),
        "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "window": LOCAL_WINDOW,
                   "n_local": n_local, "n_softmax": n_softmax, "repeats": repeats, "pass": "forward+backward",
                   "timing": "median of interleaved repeats after one warm-up round"},
        "cases": {label: cases[label].to_dict() for label in cases},
        "seconds": seconds,
        "all_seconds": times,
        "claim": {
            "text": f"local attention fwd+bwd at N = {n_local}, window {LOCAL_WINDOW} takes less time than "
                    f"softmax_attention fwd+bwd at N = {n_softmax}",
            "local causal < softmax bidirectional": seconds["local causal"] < seconds["softmax bidirectional"],
            "local bidirectional < softmax bidirectional":
                seconds["local bidirectional"] < seconds["softmax bidirectional"],
        },
        "elapsed_seconds": time.perf_counter() - t_start,
    }
    md = format_family(result)
    out_dir = write_atomically(out_dir, {"family.json": json.dumps(result, indent=2), "family.md": md})
    say(md)
    say(f"written: {out_dir / 'family.json'} and family.md ({result['elapsed_seconds']:.0f} s)")
    return result


def format_family(result: dict) -> str:
    cfg, m, s = result["config"], result["machine"], result["seconds"]
    lines = [
        f"# Local attention at N = {cfg['n_local']} vs softmax attention at N = {cfg['n_softmax']}",
        "",
        f"Written by `{result['command']}`; do not edit by hand.",
        f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['threads']} threads. "
        f"Forward+backward, B = 1, H = 8, D = 64, float32, window {cfg['window']}; {cfg['timing']} "
        f"({cfg['repeats']} repeats).",
        "",
        "| contender | N | time | vs softmax bidirectional |",
        "| --- | --- | --- | --- |",
    ]
    base = s["softmax bidirectional"]
    for label, case in result["cases"].items():
        lines.append(f"| {label} | {case['n']} | {s[label]:.2f} s | {s[label] / base:.2f}x |")
    lines += ["", f"Claim: {result['claim']['text']}."]
    for key, holds in result["claim"].items():
        if key != "text":
            lines.append(f"- {key}: {'holds' if holds else 'does NOT hold'}")
    return "\n".join(lines) + "\n"
