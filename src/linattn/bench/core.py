"""`linattn bench core`: the core's speed and memory claims, side by side with fast-transformers.

At B = 1, H = 8, D = Dv = 64, float32 (default N = 16384):
- causal forward+backward: linattn.linear_attention vs fast-transformers' CausalLinearAttention (its
  C++ CPU kernel) vs linattn.softmax_attention (PyTorch SDPA), time and peak memory;
- bidirectional forward+backward: linattn vs fast-transformers' LinearAttention;
- one recurrent generation step (Nq = 1) at positions 100 and 60000.

Every timing runs twice, in fresh processes: with glibc's default malloc and with the tuned malloc
settings of ``TUNED_MALLOC_ENV`` (see docs), because the allocator changes the O(N) methods' times
by up to 2x and affects the contenders differently. Linear contenders are interleaved A B A B.
Writes core.json and core.md to the output folder; every number there comes from this code.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import linattn

from .harness import (
    ALLOCATORS,
    IMPLS,
    Case,
    call,
    machine_info,
    make_inputs,
    median,
    peak_memory,
    run_child,
    time_calls,
    write_atomically,
)

MEMORY_CASES = [  # (label, impl, causal)
    ("causal/linattn", "linear", True),
    ("bidirectional/linattn", "linear", False),
    ("causal/softmax_sdpa", "softmax", True),
    ("causal/fast_transformers", "fast_transformers", True),
    ("bidirectional/fast_transformers", "fast_transformers", False),
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
    have_ft = IMPLS["fast_transformers"].available()
    for causal in (True, False):
        mode = "causal" if causal else "bidirectional"
        cases = {"linattn": Case("linear", causal, n)}
        if have_ft:
            cases["fast_transformers"] = Case("fast_transformers", causal, n)
        inputs = {k: make_inputs(c) for k, c in cases.items()}
        fns = {k: (lambda c=c, x=inputs[k]: call(c, x)) for k, c in cases.items()}
        times = time_calls(fns, repeats=repeats, warmup=2)
        out["times"][mode] = {k: {"median_s": median(v), "all_s": v} for k, v in times.items()}
        del inputs, fns
    sm = Case("softmax", True, n)
    x = make_inputs(sm)
    t = time_calls({"softmax": lambda: call(sm, x)}, repeats=3, warmup=1)["softmax"]
    out["times"]["causal"]["softmax_sdpa"] = {"median_s": median(t), "all_s": t}
    out["step_s"] = {str(p): step_time(p) for p in (100, 60000)}
    return out


def run_core(*, out_dir: str | Path = "docs/benchmarks", n: int = 16384, repeats: int = 7) -> dict:
    have_ft = IMPLS["fast_transformers"].available()
    print(f"linattn bench core: N={n}, B=1 H=8 D=64 float32; fast-transformers "
          f"{'found' if have_ft else 'NOT installed (see docs/benchmarks/README.md to install it)'}", flush=True)
    result: dict = {
        "command": f"linattn bench core --n {n} --repeats {repeats} --out {out_dir}",
        "machine": machine_info(),
        "config": {"n": n, "batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32",
                   "repeats": repeats, "pass": "forward+backward"},
        "allocators": {},
    }
    for alloc, env in ALLOCATORS.items():
        print(f"  [{alloc} malloc] timing ...", flush=True)
        res = run_child("linattn.bench.core", ["child", str(n), str(repeats)], env)
        mem = {}
        # with a tuned malloc freed pages stay resident, so RSS says nothing of the call
        if not env:
            print(f"  [{alloc} malloc] peak memory ...", flush=True)
            for label, impl, causal in MEMORY_CASES:
                if impl != "fast_transformers" or have_ft:
                    mem[label] = peak_memory(Case(impl, causal, n), env=env)
        result["allocators"][alloc] = {"env": env, **res, "peak_memory_bytes": mem}
    write_atomically(out_dir, {"core.json": json.dumps(result, indent=2), "core.md": format_core(result)})
    print(format_core(result))
    return result


def format_core(result: dict) -> str:
    cfg = result["config"]
    m = result["machine"]
    lines = [
        f"# Core benchmark: N = {cfg['n']}, B = 1, H = 8, D = Dv = 64, float32, forward+backward",
        "",
        f"Written by `{result['command']}`; do not edit by hand.",
        f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, {m['threads']} threads"
        + (f", fast-transformers {m['fast_transformers']}" if "fast_transformers" in m else "") + ".",
        f"Median of {cfg['repeats']} interleaved repeats after warm-up (softmax: 3 repeats); peak memory = "
        "peak RSS above the inputs, one fresh process per configuration, default malloc only (a tuned "
        "malloc keeps freed pages resident, so RSS would not measure the call).",
        "",
        "| allocator | mode | contender | time | vs linattn | peak memory |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for alloc, res in result["allocators"].items():
        for mode, contenders in res["times"].items():
            base = contenders["linattn"]["median_s"]
            for name, t in contenders.items():
                mem = res["peak_memory_bytes"].get(f"{mode}/{name}")
                mem_s = f"{mem / 2**20:.0f} MiB" if mem is not None else "-"
                ratio = "1.00x" if name == "linattn" else f"linattn {t['median_s'] / base:.2f}x faster"
                lines.append(f"| {alloc} | {mode} | {name} | {t['median_s'] * 1e3:.0f} ms | {ratio} | {mem_s} |")
    lines += ["", "One recurrent step (Nq = 1, B = 1, H = 8, D = 64, no grad):", "",
              "| allocator | position | time per step |", "| --- | --- | --- |"]
    for alloc, res in result["allocators"].items():
        for pos, t in res["step_s"].items():
            lines.append(f"| {alloc} | {pos} | {t * 1e6:.0f} µs |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        print(json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit("usage: python -m linattn.bench.core child N REPEATS")
