"""`linattn bench family`: the local-attention claim of the family (issue 4).

Claim: local attention forward+backward at N = 65536, window 256 (B = 1, H = 8, D = 64, float32)
runs in less time than softmax_attention forward+backward at N = 4096. The window is part of the
claim, so the benchmark states its local attention config as its own parameter (``attention``,
default ``LocalConfig(window=256)``, not the registry's default window) and records it.

Times local attention (causal and bidirectional) at ``n_local`` and softmax attention (PyTorch SDPA,
bidirectional and causal) at ``n_softmax``, interleaved A B C D A B C D ..., median of ``repeats``
after one warm-up round. That whole measurement is repeated ``runs`` times (default 3), each run in
a fresh process with its own load and reference matmul speed; each contender's time / softmax
bidirectional's is computed within a run and stated by its median over the runs, with min and max,
and the claim is decided on that median. Writes family.json and family.md; every number there comes
from this code.

What to expect from arithmetic alone: a causal local query scores window + 1 = 257 keys, a
bidirectional one 2 window + 1 = 513, a softmax query at N = 4096 scores 4096 (2048 on average
when causal). 65536 x 257 is 1.004 x 4096 x 4096: causal local at 65536 and bidirectional
softmax at 4096 do the same useful work; the other pairings differ by 2x.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from .. import progress
from ..nn import LocalConfig
from ..nn.registry import attention_config_from_dict, attention_config_to_dict, config_label
from .harness import (
    INHERITED_ALLOCATOR,
    RUNS,
    Case,
    attention_fn,
    call,
    format_run_loads,
    format_seconds,
    format_spread,
    machine_info,
    make_inputs,
    median,
    run_repeated,
    spread,
    time_calls,
    output_folder,
    write_atomically,
)

CONTENDERS = [  # (label, mechanism, causal, which n)
    ("local causal", "local", True, "n_local"),
    ("local bidirectional", "local", False, "n_local"),
    ("softmax bidirectional", "softmax", False, "n_softmax"),
    ("softmax causal", "softmax", True, "n_softmax"),
]
BASE = "softmax bidirectional"  # every ratio is a contender's time / this one's
CLAIMED = ("local causal", "local bidirectional")  # the claim: each of these takes less time than BASE


def _cases(n_local: int, n_softmax: int, attention: LocalConfig) -> dict[str, Case]:
    ns = {"n_local": n_local, "n_softmax": n_softmax}
    return {label: Case(name, causal, ns[which], attention=attention if name == "local" else None)
            for label, name, causal, which in CONTENDERS}


def _child(n_local: int, n_softmax: int, repeats: int, attention: LocalConfig) -> dict:
    """One run, in this process: every contender interleaved, ``{"seconds": {label: median},
    "all_seconds": {label: [every repeat]}}``."""
    cases = _cases(n_local, n_softmax, attention)
    inputs = {label: make_inputs(c) for label, c in cases.items()}
    fns = {label: (lambda c=c, x=inputs[label], f=attention_fn(c): call(c, x, f)) for label, c in cases.items()}
    times = time_calls(fns, repeats=repeats, warmup=1)
    return {"seconds": {label: median(ts) for label, ts in times.items()}, "all_seconds": times}


def run_family(*, out: str | Path = "docs/benchmarks", n_local: int = 65536, n_softmax: int = 4096,
               attention: LocalConfig = LocalConfig(window=256), repeats: int = 3, runs: int = RUNS,
               quiet: bool = False) -> dict:
    """Time the contenders ``runs`` times (a fresh process per run), write family.json and
    family.md to ``out``, print the Markdown; return the result. ``attention``: the local
    attention config the claim is about."""
    if runs < 1:
        raise ValueError(f"run_family: runs must be >= 1, got {runs}")
    if not isinstance(attention, LocalConfig):
        raise TypeError(f"run_family: attention must be a LocalConfig, got {type(attention).__name__}")
    output_folder(out)
    # the children read the same variable; set here too so that machine_info records their count
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = functools.partial(progress.say, quiet=quiet)
    say(f"linattn bench family: {config_label(attention)} at N = {n_local} vs softmax at N = {n_softmax}, "
        f"B=1 H=8 D=64 float32, forward+backward, {torch.get_num_threads()} threads, {runs} runs")
    t_start = time.perf_counter()
    cases = _cases(n_local, n_softmax, attention)
    result = {
        "command": f"linattn bench family --n-local {n_local} --n-softmax {n_softmax} --attention-window "
                   f"{attention.window} --repeats {repeats}" + (f" --runs {runs}" if runs != RUNS else "")
                   + f" --out {out}",
        "machine": machine_info(),
        "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "window": attention.window,
                   "attention": attention_config_to_dict(attention),
                   "n_local": n_local, "n_softmax": n_softmax, "repeats": repeats, "runs": runs,
                   "pass": "forward+backward",
                   "timing": "median of interleaved repeats after one warm-up round"},
        "cases": {label: cases[label].to_dict() for label in cases},
        "runs": run_repeated("linattn.bench.family", [str(n_local), str(n_softmax), str(repeats),
                                                      json.dumps(attention_config_to_dict(attention))], runs=runs,
                             allocators=INHERITED_ALLOCATOR, say=say),
    }
    result.update(_summarise(result))
    result["elapsed_seconds"] = time.perf_counter() - t_start
    md = format_family(result)
    out = write_atomically(out, {"family.json": json.dumps(result, indent=2), "family.md": md})
    say(md)
    say(f"written: {out / 'family.json'} and family.md ({result['elapsed_seconds']:.0f} s)")
    return result


def _per_run(result: dict) -> list[dict]:
    (alloc,) = INHERITED_ALLOCATOR
    return [r["allocators"][alloc] for r in result["runs"]]


def _summarise(result: dict) -> dict:
    """From ``result["runs"]``: ``seconds`` (each contender's median over the runs of its run
    medians), ``ratios`` (the :func:`~linattn.bench.harness.spread` over runs of its time / BASE's,
    each run's ratio from that run's own medians) and ``claim`` (decided on the median ratio)."""
    runs = _per_run(result)
    cfg = result["config"]
    labels = list(runs[0]["seconds"])
    ratios = {label: spread([r["seconds"][label] / r["seconds"][BASE] for r in runs])
              for label in labels if label != BASE}
    claim: dict = {"text": f"local attention fwd+bwd at N = {cfg['n_local']}, window {cfg['window']} takes less "
                           f"time than softmax_attention fwd+bwd at N = {cfg['n_softmax']}"}
    for label in CLAIMED:
        claim[f"{label} < {BASE}"] = ratios[label]["median"] < 1
    return {"seconds": {label: median([r["seconds"][label] for r in runs]) for label in labels},
            "ratios": ratios, "claim": claim}


def format_family(result: dict) -> str:
    cfg, m, s = result["config"], result["machine"], result["seconds"]
    runs = _per_run(result)
    lines = [
        f"# Local attention at N = {cfg['n_local']} vs softmax attention at N = {cfg['n_softmax']}",
        "",
        f"Written by `{result['command']}`; do not edit by hand.",
        f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['threads']} threads. "
        f"Forward+backward, B = 1, H = 8, D = 64, float32, window {cfg['window']}. The whole measurement ran "
        f"{len(runs)} time{'s' if len(runs) != 1 else ''}, each run in a fresh process; within a run, the "
        f"{cfg['timing']} ({cfg['repeats']} repeats). Each ratio is computed "
        f"within a run from that run's medians and stated by its median over the runs, with min and max; "
        "the claim is decided on the median, never on the best run.",
        "",
        f"Claim: {result['claim']['text']}.",
    ]
    for label in CLAIMED:
        key = f"{label} < {BASE}"
        lines.append(f"- {key}: {'holds' if result['claim'][key] else 'does NOT hold'} ({label} time / {BASE} "
                     f"time {format_spread(result['ratios'][label])})")
    lines += ["", f"| contender | N | time: median over runs | per run | its time / {BASE}'s: median | min | max |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, case in result["cases"].items():
        per_run = ", ".join(format_seconds(r["seconds"][label]) for r in runs)
        r = result["ratios"].get(label)
        ratio = "1.00x | - | -" if r is None else f"{r['median']:.2f}x | {r['min']:.2f}x | {r['max']:.2f}x"
        lines.append(f"| {label} | {case['n']} | {format_seconds(s[label])} | {per_run} | {ratio} |")
    lines += ["", "## Each run's machine", "", *format_run_loads([r["load"] for r in result["runs"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
        print(json.dumps(_child(*(int(a) for a in sys.argv[2:5]), attention_config_from_dict(json.loads(sys.argv[5])))))
    else:
        raise SystemExit("usage: python -m linattn.bench.family child N_LOCAL N_SOFTMAX REPEATS ATTENTION_JSON")
