"""First-call compile time, graph breaks and fullgraph tracing of the public causal fast forms and
of a TransformerLM forward+backward (issue 29), with torch.compile's caches off (a cold start).

Each case runs in its own process, so nothing compiled by one is reused by the next. Writes a JSON
file with the machine's load and reference matmul speed beside the numbers.

    .venv/bin/python docs/benchmarks/compile/first_call.py --out docs/benchmarks/compile/after.json
    .venv/bin/python docs/benchmarks/compile/first_call.py --table docs/benchmarks/compile/before.json \
        docs/benchmarks/compile/after.json --floor docs/benchmarks/compile/floor.json \
        --out docs/benchmarks/compile/README.md
    (floor.json: --cases baseline --out docs/benchmarks/compile/floor.json)
    PYTHONPATH=<checkout of the code before>/src .venv/bin/python docs/benchmarks/compile/first_call.py \\
        --out docs/benchmarks/compile/before.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CASES = ["linear", "linear packed", "favor", "favor packed", "gla per head", "gla per channel", "gla packed",
         "deltanet", "gated deltanet", "gated deltanet packed", "model gated_deltanet", "model gated_deltanet packed",
         "model linear packed", "model favor"]


def _one(case: str, n: int) -> dict:
    import torch
    import torch._dynamo as dynamo
    import torch.nn.functional as F

    import linattn

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cu = torch.tensor([0, n // 3, n // 3 + 1, n], dtype=torch.int64)
    q, k, v = (torch.randn(1, 4, n, 32, requires_grad=True) for _ in range(3))
    kn = F.normalize(torch.randn(1, 4, n, 32), dim=-1).requires_grad_()
    head = F.logsigmoid(torch.randn(1, 4, n) + 2).requires_grad_()
    channel = F.logsigmoid(torch.randn(1, 4, n, 32) + 2).requires_grad_()
    beta = torch.rand(1, 4, n).requires_grad_()
    W = linattn.favor_projection(64, 32, generator=torch.Generator().manual_seed(0))
    forms = {
        "linear": lambda: linattn.linear_attention(q, k, v, causal=True),
        "linear packed": lambda: linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu),
        "favor": lambda: linattn.favor_attention(q, k, v, W, causal=True),
        "favor packed": lambda: linattn.favor_attention(q, k, v, W, causal=True, cu_seqlens=cu),
        "gla per head": lambda: linattn.gated_linear_attention(q, k, v, head),
        "gla per channel": lambda: linattn.gated_linear_attention(q, k, v, channel),
        "gla packed": lambda: linattn.gated_linear_attention(q, k, v, head, cu_seqlens=cu),
        "deltanet": lambda: linattn.delta_rule_attention(q, kn, v, beta),
        "gated deltanet": lambda: linattn.delta_rule_attention(q, kn, v, beta, log_decay=head),
        "gated deltanet packed": lambda: linattn.delta_rule_attention(q, kn, v, beta, log_decay=head, cu_seqlens=cu),
    }
    # the floor: a compiled elementwise function's first call in a fresh process, caches off
    forms["baseline"] = lambda: (q.sin() * k).sum(-1)
    if case.startswith("model"):
        from linattn.models import TransformerConfig, TransformerLM
        from linattn.nn.registry import MECHANISMS

        _, name, *packed = case.split()
        cfg = TransformerConfig(vocab_size=256, d_model=128, n_heads=4, n_layers=4, max_len=n,
                                attention=MECHANISMS[name].default_config())
        model = TransformerLM(cfg)
        ids = torch.randint(0, 256, (1, n))
        kw = {"cu_seqlens": cu} if packed else {}
        fn = lambda: model(ids, **kw)  # noqa: E731
        target = model
    else:
        fn = forms[case]
        target = fn
    try:
        explained = dynamo.explain(fn)()
        breaks = explained.graph_break_count
        reasons = sorted({str(r.reason).splitlines()[0][:160] for r in explained.break_reasons})
    except Exception as e:  # noqa: BLE001 - recorded, not raised: the measurement is what fails
        breaks, reasons = None, [f"explain failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"]
    dynamo.reset()
    compiled = torch.compile(target if case.startswith("model") else fn, fullgraph=True)
    t0 = time.perf_counter()
    try:
        out = compiled(ids, **kw) if case.startswith("model") else compiled()
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        fullgraph, error = True, None
    except Exception as e:  # noqa: BLE001
        fullgraph, error = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    first = time.perf_counter() - t0
    return {"case": case, "linattn": str(Path(linattn.__file__).parent), "graph_breaks": breaks, "break_reasons": reasons, "fullgraph": fullgraph,
            "first_call_s": round(first, 2), "error": error}


def _table(before: Path, after: Path, floor_file: Path | None) -> str:
    """A markdown table of two result files, case by case (and the floor's file's baseline row)."""
    b, a = (json.loads(p.read_text()) for p in (before, after))
    old = {r["case"]: r for r in b["rows"]}
    rows = a["rows"] + (json.loads(floor_file.read_text())["rows"] if floor_file else [])
    floor = [r for r in rows if r["case"] == "baseline"]
    lines = [f"# torch.compile(fullgraph=True), first call (forward+backward, caches off), N = {a['n']}", "",
             f"Written by `python docs/benchmarks/compile/first_call.py --table {before} {after}"
             + (f" --floor {floor_file}" if floor_file else "")
             + "` from the result files beside it (their commands, the code measured and the machine facts are "
               "in them); do not edit by hand. Before: commit 32fdb49; after: this commit's code. Each case in a "
               "fresh process with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, B = 1, H = 4, D = 32 (models: 4 layers, "
               "d_model 128), 2 threads. One cold compile per case and side, one run: the times are single "
               "measurements (each costs minutes), not medians; the graph breaks and whether the whole graph "
               "traced are deterministic.", "",
             "| case | graph breaks before | fullgraph before | first call before (s) | graph breaks after | "
             "fullgraph after | first call after (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in a["rows"]:
        if r["case"] == "baseline":
            continue
        o = old.get(r["case"], {})

        def cells(x):
            first = x.get("first_call_s") if x.get("fullgraph") else None
            return [str(x.get("graph_breaks")), str(x.get("fullgraph")), "-" if first is None else f"{first:.1f}"]
        lines.append("| " + " | ".join([r["case"], *cells(o), *cells(r)]) + " |")
    if floor:
        lines += ["", f"The floor, a compiled elementwise function's first call in a fresh process with the caches "
                      f"off: {floor[0]['first_call_s']:.1f} s ({floor_file})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all; 'baseline': "
                    "the first call of a compiled elementwise function, the floor)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: one case, printed as JSON
    ap.add_argument("--table", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="write the markdown table of two result files to --out instead of measuring")
    ap.add_argument("--floor", type=Path, help="with --table: a result file holding the baseline case")
    args = ap.parse_args()
    if args.table:
        args.out.write_text(_table(*args.table, args.floor))
        return
    if args.case:
        print(json.dumps(_one(args.case, args.n)))
        return
    from linattn.bench.harness import machine_info  # noqa: PLC0415

    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    rows = []
    for case in args.cases.split(","):
        p = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--n", str(args.n), "--case", case],
                           env=env, capture_output=True, text=True, timeout=1800)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        row = json.loads(line) if line.startswith("{") else {"case": case, "error": p.stderr.strip()[-300:]}
        print(row, flush=True)
        rows.append(row)
    import torch
    import linattn

    args.out.write_text(json.dumps({
        "command": " ".join(["python", *sys.argv]),
        "linattn": str(Path(linattn.__file__).parent),
        "torch": torch.__version__, "n": args.n, "machine": machine_info(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
