"""`linattn bench core`: the core's speed and memory claims, side by side with fast-transformers.

At B = 1, H = 8, D = Dv = 64, float32 (default N = 16384):
- causal forward+backward: linattn.linear_attention vs fast-transformers' CausalLinearAttention (its
  C++ CPU kernel) vs linattn.softmax_attention (PyTorch SDPA), time and peak memory;
- bidirectional forward+backward: linattn vs fast-transformers' LinearAttention;
- one recurrent generation step (Nq = 1) at positions 100 and 60000.

Every timing runs twice, in fresh processes: with glibc's default malloc and with the tuned malloc
settings of ``TUNED_MALLOC_ENV`` (see docs), because the allocator changes the O(N) methods' times
by up to 2x and affects the contenders differently. Linear contenders are interleaved A B A B.
The whole measurement is repeated ``runs`` times (default 3), each run in fresh processes with its
own load and reference matmul speed; each ratio is stated by its median over the runs, with min and
max. Peak memory is measured once. Writes core.json and core.md to the output folder; every number
there comes from this code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

import linattn

from .. import progress
from ..nn import LinearConfig
from ..nn.registry import attention_config_to_dict
from .harness import (
    PEERS,
    RUNS,
    Case,
    attention_fn,
    call,
    format_allocator_times,
    format_run_loads,
    format_spread_cells,
    keep_peer_results,
    machine_info,
    make_inputs,
    median,
    peak_memory,
    ratio_claim,
    ratio_spreads,
    run_repeated,
    spread,
    time_calls,
    output_folder,
    write_atomically,
)

# The core claims are about linear attention with its default elu+1 feature map, the feature map
# fast-transformers' (Causal)LinearAttention uses.
ATTENTION = LinearConfig()
MEMORY_CASES = [  # (label, contender, causal, its attention config: None for softmax's defaults and peers)
    ("causal/linattn", "linear", True, ATTENTION),
    ("bidirectional/linattn", "linear", False, ATTENTION),
    ("causal/softmax_sdpa", "softmax", True, None),
    ("causal/fast_transformers", "fast_transformers", True, None),
    ("bidirectional/fast_transformers", "fast_transformers", False, None),
]


def step_time(position: int, *, steps: int = 300, warmup: int = 100, heads: int = 8, d: int = 64) -> float:
    """Median seconds of one generation step (Nq = 1, no grad) with a state after ``position`` tokens."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        prefix = [torch.randn(1, heads, position, d, generator=g) for _ in range(3)]
        _, state = linattn.linear_attention(*prefix, causal=True, return_state=True)
        toks = [torch.randn(1, heads, 1, d, generator=g) for _ in range(3)]
        times = []
        for i in range(steps + warmup):
            t0 = time.perf_counter()
            linattn.linear_attention(*toks, causal=True, initial_state=state, return_state=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return median(times)


def _child(n: int, repeats: int) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    out: dict = {"times": {}}
    have_ft = PEERS["fast_transformers"].available()
    for causal in (True, False):
        mode = "causal" if causal else "bidirectional"
        cases = {"linattn": Case("linear", causal, n, attention=ATTENTION)}
        if have_ft:
            cases["fast_transformers"] = Case("fast_transformers", causal, n)
        inputs = {k: make_inputs(c) for k, c in cases.items()}
        fns = {k: (lambda c=c, x=inputs[k], f=attention_fn(c): call(c, x, f)) for k, c in cases.items()}
        times = time_calls(fns, repeats=repeats, warmup=2)
        out["times"][mode] = {k: {"median_s": median(v), "all_s": v} for k, v in times.items()}
        del inputs, fns
    sm = Case("softmax", True, n)
    x, fn = make_inputs(sm), attention_fn(sm)
    t = time_calls({"softmax": lambda: call(sm, x, fn)}, repeats=3, warmup=1)["softmax"]
    out["times"]["causal"]["softmax_sdpa"] = {"median_s": median(t), "all_s": t}
    out["step_s"] = {str(p): step_time(p) for p in (100, 60000)}
    return out


def run_core(*, out: str | Path = "docs/benchmarks", n: int = 16384, repeats: int = 7, runs: int = RUNS,
             quiet: bool = False) -> dict:
    """Time the contenders ``runs`` times (fresh processes per run and allocator), measure peak
    memory once, write core.json and core.md, print the Markdown; return the result."""
    if runs < 1:
        raise ValueError(f"run_core: runs must be >= 1, got {runs}")
    output_folder(out)
    keep_peer_results(out, "core.json", command="linattn bench core")
    say = functools.partial(progress.say, quiet=quiet)
    have_ft = PEERS["fast_transformers"].available()
    say(f"linattn bench core: N={n}, B=1 H=8 D=64 float32, {runs} runs; fast-transformers "
        f"{'found' if have_ft else 'NOT installed (see docs/benchmarks/README.md to install it)'}")
    result: dict = {
        "command": f"linattn bench core --n {n} --repeats {repeats}" + (f" --runs {runs}" if runs != RUNS else "")
                   + f" --out {out}",
        "machine": machine_info(),
        "config": {"n": n, "batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32",
                   "repeats": repeats, "runs": runs, "pass": "forward+backward",
                   "attention": attention_config_to_dict(ATTENTION)},
        "runs": run_repeated("linattn.bench.core", [str(n), str(repeats)], runs=runs, say=say),
    }
    # with a tuned malloc freed pages stay resident, so RSS says nothing of the call: default only
    say("  peak memory (default malloc) ...")
    result["peak_memory_bytes"] = {label: peak_memory(Case(contender, causal, n, attention=attention))
                                   for label, contender, causal, attention in MEMORY_CASES
                                   if contender != "fast_transformers" or have_ft}
    result["ratios"] = ratio_spreads(result["runs"], "linattn")
    first = result["runs"][0]["allocators"]
    result["step_s"] = {alloc: {pos: spread([r["allocators"][alloc]["step_s"][pos] for r in result["runs"]])
                                for pos in first[alloc]["step_s"]} for alloc in first}
    result["claims"] = {f"{alloc} {mode} {name}": ratio_claim(f"{mode}, {alloc} malloc", "linattn", name, s)
                        for alloc, modes in result["ratios"].items() for mode, names in modes.items()
                        for name, s in names.items()}
    md = format_core(result)
    write_atomically(out, {"core.json": json.dumps(result, indent=2), "core.md": md})
    say(md)
    return result


def format_core(result: dict) -> str:
    cfg = result["config"]
    m = result["machine"]
    runs = result["runs"]
    lines = [
        f"# Core benchmark: N = {cfg['n']}, B = 1, H = 8, D = Dv = 64, float32, forward+backward",
        "",
        f"Written by `{result['command']}`; do not edit by hand.",
        f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['threads']} threads"
        + (f", fast-transformers {m['fast_transformers']}" if "fast_transformers" in m else "") + ".",
        f"The whole measurement ran {len(runs)} times, each run in fresh processes (one per allocator); "
        f"within a run, the median of {cfg['repeats']} interleaved repeats after warm-up (softmax: 3 "
        "repeats). Each ratio below is stated by its median over the runs, with min and max; each run's "
        "ratio comes from that run's own medians. Peak memory = peak RSS above the inputs, measured once, "
        "one fresh process per configuration, default malloc only (a tuned malloc keeps freed pages "
        "resident, so RSS would not measure the call).",
        "",
        "## Claims",
        "",
        *[f"- {text}" for text in result["claims"].values()],
        "",
        "| allocator | mode | contender | its time / linattn's: median | min | max | per run |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for alloc, modes in result["ratios"].items():
        for mode, names in modes.items():
            for name, s in names.items():
                lines.append(f"| {alloc} | {mode} | {name} | {format_spread_cells(s)} |")
    lines += ["", "## Each run's machine", "", *format_run_loads([r["load"] for r in runs]), "",
              "## Times", "", *format_allocator_times(runs, result["peak_memory_bytes"])]
    lines += ["", "One recurrent step (Nq = 1, B = 1, H = 8, D = 64, no grad):", "",
              "| allocator | position | time per step: median over runs | per run |", "| --- | --- | --- | --- |"]
    for alloc, steps in result["step_s"].items():
        for pos, s in steps.items():
            lines.append(f"| {alloc} | {pos} | {s['median'] * 1e6:.0f} µs | "
                         + ", ".join(f"{x * 1e6:.0f} µs" for x in s["runs"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        print(json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit("usage: python -m linattn.bench.core child N REPEATS")
