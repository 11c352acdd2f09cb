"""`linattn demo`: forward+backward time of every mechanism against exact softmax for N = 256..16384,
and the largest error of each fast form against its reference form.

Writes ``report/demo.json`` (machine, torch version, threads, the command) and prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import linattn
from linattn.functional import (
    efficient_attention_reference,
    linear_attention_reference,
    softmax_attention_reference,
)

from .harness import Case, call, machine_info, make_inputs, median, time_calls, write_atomically

DEFAULT_NS = (256, 512, 1024, 2048, 4096, 8192, 16384)
COLUMNS = [  # (impl, causal, label)
    ("softmax", False, "softmax"),
    ("linear", False, "linear"),
    ("efficient", False, "efficient"),
    ("softmax", True, "softmax causal"),
    ("linear", True, "linear causal"),
]


def _max_err(fast, ref, inputs) -> float:
    """Largest |fast - ref| over the output and the gradients of q, k, v (ref in float64)."""
    g = torch.Generator().manual_seed(3)
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gf = torch.autograd.grad(fast, inputs[0], cot.to(fast.dtype))
    gr = torch.autograd.grad(ref, inputs[1], cot)
    errs = [(fast.double() - ref).abs().max()]
    errs += [(a.double() - b).abs().max() for a, b in zip(gf, gr)]
    return max(e.item() for e in errs)


def fast_vs_reference_errors(n: int = 1000, d: int = 64, seed: int = 0) -> dict[str, float]:
    """Each fast form in float32 against its reference form in float64, inputs N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, 2, n, d, generator=g) for _ in range(3)]
    mask = torch.rand(1, n, generator=g) > 0.2

    def pair():
        f32 = [t.clone().requires_grad_() for t in base]
        f64 = [t.double().requires_grad_() for t in base]
        return f32, f64

    out: dict[str, float] = {}
    forms = {
        "softmax (SDPA)": (lambda q, k, v: linattn.softmax_attention(q, k, v, key_padding_mask=mask),
                           lambda q, k, v: softmax_attention_reference(q, k, v, key_padding_mask=mask)),
        "softmax causal (SDPA)": (lambda q, k, v: linattn.softmax_attention(q, k, v, causal=True),
                                  lambda q, k, v: softmax_attention_reference(q, k, v, causal=True)),
        "linear": (lambda q, k, v: linattn.linear_attention(q, k, v, key_padding_mask=mask),
                   lambda q, k, v: linear_attention_reference(q, k, v, key_padding_mask=mask)),
        "linear causal (chunked)": (
            lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, key_padding_mask=mask),
            lambda q, k, v: linear_attention_reference(q, k, v, causal=True, key_padding_mask=mask)),
        "efficient": (lambda q, k, v: linattn.efficient_attention(q, k, v, key_padding_mask=mask),
                      lambda q, k, v: efficient_attention_reference(q, k, v, key_padding_mask=mask)),
    }
    for name, (fast_fn, ref_fn) in forms.items():
        f32, f64 = pair()
        out[name] = _max_err(fast_fn(*f32), ref_fn(*f64), (f32, f64))
    # recurrent: one token at a time through the returned state
    f32, f64 = pair()
    m = min(n, 256)
    state, steps = None, []
    for i in range(m):
        o, state = linattn.linear_attention(
            *(t[:, :, i : i + 1] for t in f32), causal=True, initial_state=state, return_state=True
        )
        steps.append(o)
    ref = linear_attention_reference(*(t[:, :, :m] for t in f64), causal=True)
    out["linear recurrent (step by step)"] = _max_err(torch.cat(steps, 2), ref, (f32, f64))
    return out


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def run_demo(ns=DEFAULT_NS, *, out_dir: str | Path = "report", quiet: bool = False) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, **k, flush=True))
    say(f"linattn demo: B=1 H=8 D=64 float32, forward+backward, {torch.get_num_threads()} threads")
    rows = []
    t_start = time.perf_counter()
    for i, n in enumerate(ns):
        t_n = time.perf_counter()
        cases = {label: Case(impl, causal, n) for impl, causal, label in COLUMNS}
        inputs = {label: make_inputs(c) for label, c in cases.items()}
        fns = {label: (lambda c=c, x=inputs[label]: call(c, x)) for label, c in cases.items()}
        repeats = 5 if n <= 2048 else 3
        times = time_calls(fns, repeats=repeats, warmup=1)
        rows.append({"n": n, "seconds": {label: median(ts) for label, ts in times.items()},
                     "repeats": repeats})
        say(f"  [{i + 1}/{len(ns)}] N = {n} timed ({time.perf_counter() - t_n:.1f} s)")
    say("  checking each fast form against its reference form ...")
    errors = fast_vs_reference_errors()
    result = {
        "command": "linattn demo" + ("" if tuple(ns) == DEFAULT_NS else " --ns " + ",".join(map(str, ns)))
                   + ("" if str(out_dir) == "report" else f" --out {out_dir}"),
        "machine": machine_info(),
        "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "pass": "forward+backward",
                   "timing": "median of interleaved repeats after one warm-up"},
        "rows": rows,
        "max_error_vs_reference": {"n": 1000, "dtype": "float32 vs float64 reference",
                                   "what": "max |diff| over output and q, k, v gradients",
                                   "errors": errors},
        "elapsed_seconds": time.perf_counter() - t_start,
    }
    m = result["machine"]
    md = (f"# linattn demo\n\nWritten by `{result['command']}` on {m['processor']}, {m['cpu_count']} CPUs, "
          f"torch {m['torch']}, {m['threads']} threads; do not edit by hand.\n"
          "Forward+backward, B = 1, H = 8, D = 64, float32; median of interleaved repeats.\n\n"
          + format_table(result) + "\n")
    out_dir = write_atomically(out_dir, {"demo.json": json.dumps(result, indent=2), "demo.md": md})
    say(format_table(result))
    say(f"\nwritten: {out_dir / 'demo.json'} and demo.md  ({result['elapsed_seconds']:.0f} s)")
    return result


def format_table(result: dict) -> str:
    labels = [label for _, _, label in COLUMNS]
    head = ["N"] + labels + ["speed-up linear", "speed-up linear causal"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row in result["rows"]:
        s = row["seconds"]
        cells = [str(row["n"])] + [_fmt_time(s.get(label)) for label in labels]
        cells.append(f"{s['softmax'] / s['linear']:.1f}x")
        cells.append(f"{s['softmax causal'] / s['linear causal']:.1f}x")
        lines.append(" | ".join(cells))
    lines.append("(speed-up = softmax time / linear time, same direction; > 1 means linear is faster)")
    lines.append("")
    lines.append("Largest error of each fast form against its reference form "
                 "(float32 vs float64, N = 1000, output and all gradients):")
    for name, err in result["max_error_vs_reference"]["errors"].items():
        lines.append(f"  {name:<34s} {err:.2e}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_demo()
    sys.exit(0)
