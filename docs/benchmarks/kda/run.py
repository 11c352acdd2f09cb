"""Kimi Delta Attention and grouped value heads (issue 31), three runs, each part in fresh processes:

1. ours against transformers' `chunk_kimi_delta_attention` (its CPU path, transformers 5.23.0) at
   Kimi Linear's layer width: B = 1, H = 32, D = Dv = 128, N = 4096, float32, forward without grad,
   q and k L2-normalised, per-channel log decays logsigmoid(N(0, 1) + 4), beta sigmoid(N(0, 1)).
   Each side in its own process: the time of one call after a warm-up call at N = 256, and the
   process's peak RSS above the inputs (VmHWM). Their outputs are compared once at N = 256.
2. grouped value heads: `delta_rule_attention` with a per-channel decay (KDA) and with a per-head
   one (Gated DeltaNet), q and k with Hk = H / 2 heads against the same call with q and k repeated
   by the caller, B = 1, H = 8, D = Dv = 64, N = 16384, forward+backward, interleaved in one process
   (5 calls each after a warm-up, medians).

    .venv/bin/python docs/benchmarks/kda/run.py   (writes run_1.json .. run_3.json and summary.md here)
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

here = Path(__file__).parent
sys.path.insert(0, str(here.parent))  # docs/benchmarks: ab.py


def _inputs(B, H, N, D, seed=0, hk=None):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    hk = hk or H
    q = F.normalize(torch.randn(B, hk, N, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, hk, N, D, generator=g), dim=-1)
    v = torch.randn(B, H, N, D, generator=g)
    ld = F.logsigmoid(torch.randn(B, H, N, D, generator=g) + 4)
    beta = torch.sigmoid(torch.randn(B, H, N, generator=g))
    return q, k, v, ld, beta


def _rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])


def child_side(side: str) -> dict:
    import torch

    torch.set_num_threads(2)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    import linattn

    def ours(q, k, v, ld, beta):
        return linattn.delta_rule_attention(q, k, v, beta, log_decay=ld)

    def theirs(q, k, v, ld, beta):  # (B, N, H, D) layout
        o, _ = chunk_kimi_delta_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          g=ld.transpose(1, 2), beta=beta.transpose(1, 2))
        return o.transpose(1, 2)

    fn = ours if side == "linattn" else theirs
    with torch.no_grad():
        fn(*_inputs(1, 32, 256, 128))  # warm-up
        x = _inputs(1, 32, 4096, 128)
        base = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        o = fn(*x)
        seconds = time.perf_counter() - t0
        peak = (_rss_kib("VmHWM") - base) * 1024
    return {"seconds": seconds, "peak_bytes": peak, "finite": bool(torch.isfinite(o).all())}


def child_agree() -> dict:
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    import linattn

    q, k, v, ld, beta = (t.double() for t in _inputs(1, 4, 256, 32))
    ours = linattn.functional.delta_rule_attention_reference(q, k, v, beta, log_decay=ld)
    theirs, _ = chunk_kimi_delta_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           g=ld.transpose(1, 2), beta=beta.transpose(1, 2))
    theirs = theirs.transpose(1, 2).double()
    return {"max_abs_diff_vs_our_reference": float((ours - theirs).abs().max()),
            "output_scale": float(ours.abs().max())}


def child_grouped() -> dict:
    import torch

    torch.set_num_threads(2)
    import linattn
    from ab import interleaved
    from linattn.bench.harness import OtherLoad

    load = OtherLoad(reference=True)
    out = {}
    for label, per_channel in (("kda", True), ("gated deltanet", False)):
        q, k, v, ld, beta = _inputs(1, 8, 16384, 64, hk=4)
        ld = ld if per_channel else ld[..., 0]
        leaves = [t.requires_grad_() for t in (q, k, v, ld, beta)]

        class Grouped:  # the call with Hk = 4 query/key heads
            @staticmethod
            def run():
                return linattn.delta_rule_attention(leaves[0], leaves[1], leaves[2], leaves[4], log_decay=leaves[3])

        class Repeated:  # q and k repeated by the caller (inside the timed call, as a caller would)
            @staticmethod
            def run():
                return linattn.delta_rule_attention(leaves[0].repeat_interleave(2, 1), leaves[1].repeat_interleave(2, 1),
                                                    leaves[2], leaves[4], log_decay=leaves[3])

        def f(pkg):
            for t in leaves:
                t.grad = None
            pkg.run().sum().backward()

        out[label] = interleaved(f, Grouped, Repeated, 5)  # "new" = grouped, "old" = repeated
    return {"results": out, "load": load.finish()}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        kind = sys.argv[2]
        res = child_side(sys.argv[3]) if kind == "side" else child_agree() if kind == "agree" else child_grouped()
        print(json.dumps(res))
        sys.exit(0)

    def child(*args):
        done = subprocess.run([sys.executable, __file__, "child", *args], capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    if "--summary" not in sys.argv:
        agree = child("agree")
        for i in (1, 2, 3):
            run = {"command": "python docs/benchmarks/kda/run.py", "agreement": agree,
                   "transformers": child("side", "transformers"), "linattn": child("side", "linattn"),
                   "grouped": child("grouped")}
            (here / f"run_{i}.json").write_text(json.dumps(run, indent=2))
    runs = [json.loads((here / f"run_{i}.json").read_text()) for i in (1, 2, 3)]

    def spread(xs):
        return f"{statistics.median(xs):.2f}x (min {min(xs):.2f}x, max {max(xs):.2f}x; runs {', '.join(f'{x:.2f}x' for x in xs)})"

    speed = [r["transformers"]["seconds"] / r["linattn"]["seconds"] for r in runs]
    mem = [r["transformers"]["peak_bytes"] / r["linattn"]["peak_bytes"] for r in runs]
    a = runs[0]["agreement"]
    lines = ["# Kimi Delta Attention against transformers' CPU path, and grouped value heads", "",
             "Written by `python docs/benchmarks/kda/run.py` (its docstring gives the setup); do not edit by hand.", "",
             "## transformers' chunk_kimi_delta_attention / ours: B = 1, H = 32, D = Dv = 128, N = 4096, forward, "
             "no grad, float32", "",
             f"- time: {spread(speed)}",
             f"- peak memory above the inputs: {spread(mem)}", "",
             "| run | transformers | ours | transformers' peak | our peak |", "| --- | --- | --- | --- | --- |"]
    for i, r in enumerate(runs, 1):
        t, o = r["transformers"], r["linattn"]
        lines.append(f"| {i} | {t['seconds']:.2f} s | {o['seconds']:.3f} s | {t['peak_bytes'] / 2**30:.2f} GiB | "
                     f"{o['peak_bytes'] / 2**30:.3f} GiB |")
    lines += ["", f"Agreement (float64, B = 1, H = 4, D = 32, N = 256): transformers' output against our reference "
              f"recurrence differs by at most {a['max_abs_diff_vs_our_reference']:.1e} (output scale "
              f"{a['output_scale']:.2f}).", "",
              "## Grouped value heads (Hk = H / 2) / q and k repeated by the caller: B = 1, H = 8, D = 64, N = 16384, "
              "forward+backward", ""]
    for label in ("kda", "gated deltanet"):
        xs = [r["grouped"]["results"][label]["new/old"] for r in runs]
        lines.append(f"- {label}: {spread(xs)}")
    lines.append("")
    (here / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
