"""`linattn demo`, the main job (`make demo`): the scaling and generation evidence in a few minutes.

Three parts, all written to ``report/`` (or ``--out``):
1. a quick sweep (``bench/sweep.py``): forward+backward time and peak memory of every registered
   mechanism but LSH, each with its registry defaults, and every installed peer, causal and
   bidirectional, N = 256 ... 16384, B = 1, H = 8, D = 64, float32; configurations predicted over
   20 s per call are skipped and marked (sweep.json/md/png); a progress bar follows it on a terminal;
2. the largest error of every registered mechanism's fast form against its reference form (float32
   vs float64), in each of its forms, read from the registry;
3. per-token generation time of linear vs softmax + KV cache language models at two positions
   (``bench/generate.py``, generate.json/md);
4. when transformers is installed (the transformers extra; ``make setup`` installs it): a small
   Qwen3.5 hybrid's prefill on transformers' own path and on linattn, and packed documents through
   Qwen3.5 and Kimi Linear, which transformers' own path refuses or mixes up
   (``bench/transformers.py``'s ``demo_part``; seconds).
demo.json and demo.md hold the summary (crossover N per mechanism, the table at the largest N, the
errors, the generation claims, the load from other processes and a reference matmul's speed at the
start and end, with a warning when the machine was busy: see ``harness.busy_reasons``); the summary
is printed.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from .. import progress
from ..extras import require_extra
from ..nn.registry import MECHANISMS
from .harness import OtherLoad, busy_reasons, format_seconds, machine_info, output_folder, write_atomically

DEFAULT_NS = (256, 1024, 4096, 16384)
GENERATE_POSITIONS = (100, 4096)
# softmax bidirectional forward+backward at N = 16384 takes several seconds on 2 cores and its
# power-law prediction from the two shorter N runs higher: 20 s keeps the baseline of the headline
# table measured
TIME_BUDGET_S = 20.0
# LSH is left to the full sweep: slower than softmax at every N of the demo (docs/benchmarks.md),
# it alone took about a third of the demo's time
NOT_IN_DEMO = ("lsh",)


def _max_err(fast, ref, inputs) -> float:
    """Largest |fast - ref| over the output and the gradients of the inputs (ref in float64)."""
    g = torch.Generator().manual_seed(3)
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gf = torch.autograd.grad(fast, inputs[0], cot.to(fast.dtype))
    gr = torch.autograd.grad(ref, inputs[1], cot)
    errs = [(fast.double() - ref).abs().max()]
    errs += [(a.double() - b).abs().max() for a, b in zip(gf, gr)]
    return max(e.item() for e in errs)


ERRORS_N = 1024  # positions of the error table: a multiple of LSH's default bucket size (32)


def fast_vs_reference_errors(n: int = ERRORS_N, d: int = 64, seed: int = 0) -> dict[str, float]:
    """Every registered mechanism's fast form in float32 against its reference form in float64
    (``MECHANISMS[name].function`` and ``.reference``), in each form it has: bidirectional and
    causal with one key in five padded, and for the recurrent ones 64 positions decoded one at a
    time (``.step``) against the causal reference. Two heads of width ``d``; q, k, v and the layer
    input N(0, 1); each module with its default config and initial parameters, its float64 copy
    for the reference, the inputs of both forms from the module (``functional_inputs``), and the
    module's own output step (``functional_output``) after both. The error is the largest
    |fast - reference| over the output and the gradients of q, k and v."""
    H = 2
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(1, H, n, d, generator=g) for _ in range(3)]
    x = torch.randn(1, n, H * d, generator=g)
    mask = torch.rand(1, n, generator=g) > 0.2
    out: dict[str, float] = {}
    for name, spec in MECHANISMS.items():
        torch.manual_seed(seed)  # the module's initial parameters
        module = spec.build(n_heads=H, head_dim=d, max_len=n)
        reference = copy.deepcopy(module).double()

        def leaves(dtype):
            q, k, v = (t.to(dtype).requires_grad_() for t in base)
            return (q, q, v) if spec.shared_qk else (q, k, v)

        def run(mech, fn, qkv, xx, causal, key_padding_mask):
            tensors, options = mech.functional_inputs(*qkv, xx, causal=causal)
            return mech.functional_output(fn(*tensors, key_padding_mask=key_padding_mask, **options), xx)

        for form in ("bidirectional", "causal"):
            if form not in spec.forms:
                continue
            f32, f64 = leaves(torch.float32), leaves(torch.float64)
            fast = run(module, spec.function, f32, x, form == "causal", mask)
            ref = run(reference, spec.reference, f64, x.double(), form == "causal", mask)
            grads = (f32[0::2], f64[0::2]) if spec.shared_qk else (f32, f64)
            out[f"{name} {form}"] = _max_err(fast, ref, grads)
        if spec.recurrent:
            m = min(n, 64)
            f32, f64 = leaves(torch.float32), leaves(torch.float64)
            state, steps = module.initial_state(1, dtype=torch.float32), []
            for i in range(m):
                o, state = spec.step(module, *(t[:, :, i:i + 1] for t in f32), state, x=x[:, i:i + 1])
                steps.append(o)
            ref = run(reference, spec.reference, [t[:, :, :m] for t in f64], x[:, :m].double(), True, None)
            out[f"{name} recurrent (step by step)"] = _max_err(torch.cat(steps, 2), ref, (f32, f64))
    return out


def run_demo(ns=DEFAULT_NS, *, out: str | Path = "report", quiet: bool = False,
             generate_positions: tuple[int, ...] = GENERATE_POSITIONS, generate_model: dict | None = None,
             measure_memory: bool = True, load: OtherLoad | None = None, transformers_part: bool | None = None,
             transformers_model: dict | None = None) -> dict:
    """Run the three parts, write demo.json/md (and the parts' own files) to ``out``, print the
    summary; a progress bar on standard error follows the sweep (on a terminal, not ``quiet``).

    ``load`` measures how busy the machine was over the whole demo (default: an ``OtherLoad``
    with the reference matmul, started here); anything with its ``finish() -> dict`` will do.
    ``transformers_part``: run part 4 (None: when transformers is installed); ``transformers_model``:
    its model's sizes (``demo_part``'s keywords).
    """
    require_extra("bench", command="linattn demo")  # the sweep part draws plots
    output_folder(out)
    from .generate import run_generate
    from .sweep import SweepConfig, run_sweep

    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = functools.partial(progress.say, quiet=quiet)
    installed = importlib.util.find_spec("transformers") is not None
    with_transformers = installed if transformers_part is None else transformers_part
    if with_transformers and not installed:
        require_extra("transformers", command="linattn demo (part 4)")
    if not installed and transformers_part is None:
        say("linattn demo: transformers is not installed, so part 4 (its models on linattn) is left out; "
            "pip install 'linattn[transformers]' adds it")
    command = ("linattn demo" + ("" if tuple(ns) == DEFAULT_NS else " --ns " + ",".join(map(str, ns)))
               + ("" if str(out) == "report" else f" --out {out}"))
    t_start = time.perf_counter()
    load = load or OtherLoad(reference=True)
    say(f"linattn demo [1/4]: sweep, forward+backward, N = {list(ns)}, B=1 H=8 D=64 float32, "
        f"{torch.get_num_threads()} threads")
    mechanisms = tuple(spec.default_config() for spec in MECHANISMS.values() if spec.name not in NOT_IN_DEMO)
    sweep = run_sweep(SweepConfig(mechanisms=mechanisms, ns=tuple(ns), passes=("forward+backward",), repeats=2,
                                  time_budget_s=TIME_BUDGET_S, measure_memory=measure_memory),
                      out=out, command=command + " (sweep part)", quiet=quiet, print_tables=False)
    say(f"linattn demo [2/4]: each fast form against its reference form ({time.perf_counter() - t_start:.0f} s)")
    errors = fast_vs_reference_errors(ERRORS_N)
    say(f"linattn demo [3/4]: generation at positions {list(generate_positions)} "
        f"({time.perf_counter() - t_start:.0f} s)")
    gen = run_generate(out=out, positions=tuple(generate_positions), steps=10, quiet=True,
                       mechanisms=tuple(MECHANISMS[name].default_config() for name in ("linear", "softmax")),
                       **(generate_model or {}))
    part4 = None
    if with_transformers:
        from .transformers import demo_part

        say(f"linattn demo [4/4]: transformers' models on linattn ({time.perf_counter() - t_start:.0f} s)")
        part4 = demo_part(**(transformers_model or {}))
    result = {
        "command": command,
        "machine": machine_info(),
        "files": ["sweep.json", "sweep.md", "sweep_time.png", "sweep_memory.png", "generate.json", "generate.md"],
        "sweep": {"config": sweep["config"], "crossover": sweep["crossover"], "largest_n": _largest_n(sweep)},
        "max_error_vs_reference": {"n": ERRORS_N, "dtype": "float32 vs float64 reference",
                                   "what": "max |diff| over output and q, k, v gradients", "errors": errors},
        "generate": {"config": gen["config"], "seconds_per_token": gen["seconds_per_token"], "claim": gen["claim"],
                     "why": _why_not_faster(gen)},
        "transformers": part4,
        "elapsed_seconds": time.perf_counter() - t_start,
        "load": load.finish(),
    }
    result["busy"] = busy_reasons(result["load"])
    md = format_summary(result)
    out = write_atomically(out, {"demo.json": json.dumps(result, indent=2), "demo.md": md})
    say(md)
    say(f"written: {out}/demo.json, demo.md and the parts' files ({result['elapsed_seconds']:.0f} s)")
    if result["busy"]:  # again last, where it cannot scroll away above the tables
        say(_busy_warning(result["busy"]))
    return result


def _busy_warning(reasons: list[str]) -> str:
    return (f"WARNING: the machine was busy during this demo: {'; '.join(reasons)}. Its timings are "
            "inflated and noisy, its ratios can be off several times; rerun it on a quiet machine.")


def _load_line(load: dict) -> str:
    share, ref = load.get("other_cpu_share"), load.get("reference_gflops")
    share_s = "not recorded" if share is None else f"{share:.0%} of the CPU time"
    ref_s = "not recorded" if not ref else f"{ref['start']:.0f} GFLOP/s at the start, {ref['end']:.0f} at the end"
    return (f"Machine during the demo: other processes used {share_s}; a reference 512 x 512 float32 matmul "
            f"ran at {ref_s}.")


def _largest_n(sweep: dict) -> dict:
    """Per mode: each contender's status, time and memory at the largest N of the sweep."""
    n = max(r["n"] for r in sweep["rows"])
    out: dict = {"n": n}
    for r in sweep["rows"]:
        if r["n"] == n:
            out.setdefault(r["mode"], {})[r["impl"]] = {
                "status": r["status"], "median_s": r.get("median_s"), "peak_memory_bytes": r.get("peak_memory_bytes"),
                "reason": r.get("reason")}
    return out


def format_summary(result: dict) -> str:
    m = result["machine"]
    big = result["sweep"]["largest_n"]
    lines = [
        "# linattn demo", "",
        f"Written by `{result['command']}` on {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}, "
        f"{m['threads']} threads, in {result['elapsed_seconds']:.0f} s; do not edit by hand. Full tables: "
        "sweep.md (and the PNG plots), generate.md.", "",
        _load_line(result["load"]), "",
        *([_busy_warning(result["busy"]), ""] if result["busy"] else []),
        f"## At N = {big['n']} (forward+backward, B = 1, H = 8, D = 64, float32)", "",
        "| contender | causal | vs softmax | peak memory | bidirectional | vs softmax | peak memory |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    impls = list(dict.fromkeys([*big.get("causal", {}), *big.get("bidirectional", {})]))
    for impl in impls:
        cells = []
        for mode in ("causal", "bidirectional"):
            r = big.get(mode, {}).get(impl)
            soft = big.get(mode, {}).get("softmax", {})
            if r is None or r["status"] == "unsupported":
                cells += ["-", "-", "-"]
            elif r["status"] != "ok":
                cells += [r["status"], "", ""]
            else:
                ratio = (f"{soft['median_s'] / r['median_s']:.1f}x" if soft.get("status") == "ok"
                         else f"softmax {soft.get('status', '-')}")
                mem = r["peak_memory_bytes"]
                cells += [format_seconds(r["median_s"]), ratio, "-" if mem is None else f"{mem / 2**20:.0f} MiB"]
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    lines += ["", "`vs softmax` = softmax time / this time (> 1: faster than softmax). `skipped`: predicted "
              "over the demo's time budget.", "", "## Where each contender overtakes softmax", ""]
    for key, per in result["sweep"]["crossover"].items():
        lines.append(f"- {key}: " + ", ".join(f"{i} {v}" for i, v in per.items()))
    lines += ["", "## Largest error of each fast form against its reference form (float32 vs float64, "
              f"N = {result['max_error_vs_reference']['n']}, output and the gradients of q, k and v)", ""]
    lines += [f"- {name}: {err:.2e}" for name, err in result["max_error_vs_reference"]["errors"].items()]
    gen = result["generate"]
    c = gen["config"]
    lines += ["", f"## Generation (TransformerLM d_model {c['d_model']}, {c['n_layers']} layers, vocab "
              f"{c['vocab_size']}, batch 1): ms per token at each position", ""]
    lines += [f"- {k}: {v * 1e3:.2f} ms" for k, v in gen["seconds_per_token"].items()]
    lines += [f"- {k}: {v:.2f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in gen["claim"].items()]
    if gen.get("why"):
        lines.append(f"- why not: {gen['why']}")
    if result.get("transformers"):
        from .transformers import format_demo_part

        lines += ["", *format_demo_part(result["transformers"])]
    return "\n".join(lines) + "\n"


def _why_not_faster(gen: dict) -> str | None:
    """One line on why linear decodes less than FASTER_BY x faster than softmax (KV cache) at the
    largest position, when it does: at batch 1 a step reads every weight once for both models, and
    the KV cache adds little at short positions. None when the claim holds."""
    from .generate import FASTER_BY

    hi = max(gen["config"]["positions"])
    if all(v for k, v in gen["claim"].items() if "faster than" in k) or "bytes_ratio" not in gen:
        return None
    bound = gen["bytes_ratio"][f"softmax@{hi} / linear@{hi}"]
    return (f"at batch 1 every decoding step reads all {gen['weight_bytes']['linear'] / 1e6:.3g} MB of weights, the same for "
            f"both models; softmax's KV cache at position {hi} adds little to that, so the bytes each token reads "
            f"put softmax / linear near {bound:.1f}x, not {FASTER_BY:g}x (the gap grows with the position: "
            "`linattn bench generate` measures it at 16000)")


if __name__ == "__main__":
    run_demo()
    sys.exit(0)
