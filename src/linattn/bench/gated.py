"""`linattn bench gated`: the gated and delta-rule forms against plain linear attention and against
Hugging Face's pure-PyTorch gated delta rule (issue 20's speed and memory claims).

At B = 1, H = 8, D = Dv = 64, float32, causal forward+backward (every input's gradient):

- ``gated_linear_attention`` with one decay per head and position (B, H, N) and with one per key
  channel (B, H, N, D), ``delta_rule_attention`` without and with a decay, each against
  ``linear_attention`` interleaved in one process (A B C D E A B ...), at each N;
- our gated delta rule against ``torch_chunk_gated_delta_rule`` of transformers (the function its
  Qwen3-Next falls back to without the Triton kernels), interleaved, at each N (fewer repeats: it
  takes seconds per call at N = 16384);
- one recurrent step (Nq = 1, no grad) of each against a linear-attention step;
- what the decayed engine's specialisations are worth: linear attention's and FAVOR+'s causal
  products routed through its log-decay path (gated_linear_attention) against the no-gate and
  running-scale specialisations that serve them, interleaved (timed, not claims);
- in fresh processes at ``memory_n`` (65536): peak memory of forward+backward of each form, whether
  the output and gradients are finite, and the output's largest error relative to the float64
  reference recurrence (forward, computed in that process).

Inputs: q, v N(0, 1); k N(0, 1) rows L2-normalised (the delta rule expects unit keys); decays
log-sigmoid(N(0, 1) + 4) (about -0.02, a gate near 1 as trained models have); beta sigmoid(N(0, 1)).
The whole timing is repeated ``runs`` times (default 3), each run in a fresh process with its own
load and reference matmul speed; a claim is the median ratio over the runs, with min and max.
Writes gated.json and gated.md; every number there comes from this code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torch import Tensor

from .. import functional, progress
from ..processes import run_process
from ..functional.decayed import decayed_product
from ..nn.registry import MECHANISMS
from .harness import (
    INHERITED_ALLOCATOR,
    RUNS,
    format_run_loads,
    format_seconds,
    format_spread,
    format_spread_cells,
    machine_info,
    median,
    peak_rss_bytes,
    run_repeated,
    spread,
    time_calls,
    output_folder,
    write_atomically,
)

H, D = 8, 64
BASE = "linear"
OURS = ("gla_head", "gla_channel", "delta", "gated_delta", "kda")
# The products of linear attention and of FAVOR+ routed through the decayed engine's log-decay path
# (gated_linear_attention), each timed beside the specialisation that serves it: what specialising
# inside the engine is worth (docs/design/one_engine.md). probe -> the contender it is divided by.
# Timed, not claims.
ENGINE_PROBES = {"linear_on_gated_engine": "linear", "favor_on_gated_engine": "favor_product"}
FAVOR_FEATURES = 256  # FAVOR+'s registry default num_features; the product's values carry Dv + 1 columns
TIMED = (BASE, *OURS, *ENGINE_PROBES, "favor_product")  # the forward+backward timings, interleaved
# the claims of issue 20: (contender, its time / linear's at most this)
WITHIN = {"gla_head": 1.5, "gla_channel": 3.0, "delta": 3.0, "gated_delta": 3.0}
# issue 31's: Kimi Delta Attention against Gated DeltaNet, whose per-head decay it makes per channel
# (time and one recurrent step at most this), and its peak memory at memory_n
KDA_WITHIN = 2.0
MEMORY_LIMITS = {"kda": 2e9}
HF_FASTER_BY = 10.0  # torch_chunk_gated_delta_rule's time / our gated delta rule's at least this
STEP_WITHIN = 2.0  # one recurrent step / a linear-attention step at most this
MEMORY_LIMIT_BYTES = 1.5e9
REL_ERR_LIMIT = 1e-4
DESCRIPTIONS = {
    "linear": "linear_attention (elu+1), causal",
    "gla_head": "gated_linear_attention, log_decay (B, H, N)",
    "gla_channel": "gated_linear_attention, log_decay (B, H, N, D)",
    "delta": "delta_rule_attention, no decay (DeltaNet)",
    "gated_delta": "delta_rule_attention, log_decay (B, H, N) (Gated DeltaNet)",
    "kda": "delta_rule_attention, log_decay (B, H, N, D) (Kimi Delta Attention)",
    "hf_gated_delta": "transformers' torch_chunk_gated_delta_rule (chunk 64), same inputs",
    "linear_on_gated_engine": "linear attention (elu+1) routed through the decayed engine's log-decay path "
                              "(gated_linear_attention): decay 0, normaliser as a value column",
    "favor_product": f"FAVOR+'s causal product on the decayed engine's running-scale specialisation, "
                     f"{FAVOR_FEATURES} features, Dv + 1 value columns",
    "favor_on_gated_engine": "the same FAVOR+ product routed through the log-decay path: the running rescale "
                             "as a per-head log decay",
}


def hf_gated_delta_rule():
    """transformers' pure-PyTorch chunked gated delta rule, or None when transformers is missing."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError:
        return None
    return torch_chunk_gated_delta_rule


def make_inputs(n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, requires_grad: bool = True,
                favor: bool = False) -> dict:
    """Leaf tensors of every contender's inputs: q, k (unit rows), v ``(1, H, n, D)``, decays
    ``(1, H, n)`` and ``(1, H, n, D)``, beta ``(1, H, n)``; with ``favor``, FAVOR+'s product inputs
    too: query and key features ``fq, fk (1, H, n, FAVOR_FEATURES)`` in [0, 1) (keys as if divided
    by their running scale), values ``fv (1, H, n, D + 1)`` with the normaliser's column of ones,
    and the running log-scale ``favor_scale (1, H, n)``, non-decreasing, without gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g, dtype=dtype) for _ in range(3))
    k = F.normalize(k, dim=-1)
    x = {"q": q, "k": k, "v": v,
         "decay_head": F.logsigmoid(torch.randn(1, H, n, generator=g, dtype=dtype) + 4),
         "decay_channel": F.logsigmoid(torch.randn(1, H, n, D, generator=g, dtype=dtype) + 4),
         "beta": torch.sigmoid(torch.randn(1, H, n, generator=g, dtype=dtype))}
    if favor:
        x.update(fq=torch.rand(1, H, n, FAVOR_FEATURES, generator=g, dtype=dtype),
                 fk=torch.rand(1, H, n, FAVOR_FEATURES, generator=g, dtype=dtype),
                 fv=torch.cat([torch.randn(1, H, n, D, generator=g, dtype=dtype), torch.ones(1, H, n, 1, dtype=dtype)], -1))
    x = {name: t.requires_grad_(requires_grad) for name, t in x.items()}
    if favor:
        x["favor_scale"] = torch.randn(1, H, n, generator=g, dtype=dtype).cummax(-1).values
    return x


# Each timed linattn form: (the registered mechanism whose functional form and reference it calls,
# the make_inputs entries it takes positionally, those it takes by keyword, fixed options). One
# table for the timing, the decoding steps and the accuracy check; the functions are the
# registry's (linattn.nn.MECHANISMS), the inputs this benchmark's own (a per-head decay for RetNet's
# form, a per-channel one for GLA's, unit keys for the delta rule).
_FORMS = {
    "linear": ("linear", ("q", "k", "v"), {}, {"causal": True}),
    "gla_head": ("retnet", ("q", "k", "v", "decay_head"), {}, {}),
    "gla_channel": ("gla", ("q", "k", "v", "decay_channel"), {}, {}),
    "delta": ("deltanet", ("q", "k", "v", "beta"), {}, {}),
    "gated_delta": ("gated_deltanet", ("q", "k", "v", "beta"), {"log_decay": "decay_head"}, {}),
    "kda": ("kda", ("q", "k", "v", "beta"), {"log_decay": "decay_channel"}, {}),
}


def _call(name: str, x: dict, *, reference: bool = False, **options):
    """The form ``name`` of :data:`_FORMS` (or its reference) on the inputs ``x``, ``options``
    (``return_state``, ``initial_state``) added to its own."""
    mechanism, args, keywords, fixed = _FORMS[name]
    spec = MECHANISMS[mechanism]
    return (spec.reference if reference else spec.function)(*(x[a] for a in args),
                                                             **{k: x[a] for k, a in keywords.items()},
                                                             **fixed, **options)


def forms(x: dict) -> dict:
    """``name -> () -> output`` for every contender on the inputs ``x`` (forward only)."""
    out = {name: functools.partial(_call, name, x) for name in _FORMS}
    out["linear_on_gated_engine"] = lambda: linear_on_gated_engine(x["q"], x["k"], x["v"])
    if "fq" in x:
        favor = (x["fq"], x["fk"], x["fv"], x["favor_scale"])
        out["favor_product"] = lambda: decayed_product(*favor[:3], running_log_scale=favor[3])[0]
        out["favor_on_gated_engine"] = lambda: favor_product_on_gated_engine(*favor)
    hf = hf_gated_delta_rule()
    if hf is not None:
        def hf_call():  # (B, N, H, D) layout; the transposes are views, part of what a caller pays
            o, _ = hf(*(x[a].transpose(1, 2) for a in ("q", "k", "v", "decay_head", "beta")), chunk_size=64)
            return o
        out["hf_gated_delta"] = hf_call
    return out


def linear_on_gated_engine(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """elu+1 causal linear attention through ``gated_linear_attention`` with a zero log decay: the
    numerator and the normaliser in one pass (v with a column of ones), then their quotient."""
    qf, kf = functional.feature_maps.elu_feature_map(q), functional.feature_maps.elu_feature_map(k)
    zero = q.new_zeros(q.shape[:-1])
    o = functional.gated_linear_attention(qf, kf, torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1), zero, scale=1.0)
    return o[..., :-1] / o[..., -1:]


def favor_product_on_gated_engine(a: Tensor, kf: Tensor, w: Tensor, m: Tensor) -> Tensor:
    """The running-scale product ``decayed_product(a, kf, w, running_log_scale=m)`` through
    ``gated_linear_attention``: its
    state ``S_i = e^(m_(i-1) - m_i) S_(i-1) + kf_i w_i^T`` is a per-head decayed state with
    ``log_decay_i = m_(i-1) - m_i <= 0`` (0 at i = 0), read with scale 1. ``m`` gets no gradient."""
    m = m.detach()
    log_decay = torch.cat([m.new_zeros(*m.shape[:-1], 1), m[..., :-1] - m[..., 1:]], dim=-1)
    return functional.gated_linear_attention(a, kf, w, log_decay, scale=1.0)


def _forward_backward(fn, x: dict):
    def call() -> None:
        for t in x.values():
            t.grad = None
        o = fn()
        o.backward(torch.ones_like(o))
    return call


def step_times(*, position: int = 1000, steps: int = 300, warmup: int = 50) -> dict[str, float]:
    """Median seconds of one decoding step (Nq = 1, no grad) of each form after ``position`` tokens,
    interleaved."""
    x = make_inputs(position + 1, requires_grad=False)
    with torch.no_grad():
        prefix = {k: t[:, :, :position] for k, t in x.items()}
        tok = {k: t[:, :, position:] for k, t in x.items()}
        states = {name: _call(name, prefix, return_state=True)[1] for name in _FORMS}
        steps_of = {name: functools.partial(_call, name, tok, return_state=True, initial_state=states[name])
                    for name in _FORMS}
        times = time_calls(steps_of, repeats=steps, warmup=warmup)
    return {name: median(ts) for name, ts in times.items()}


def _child(ns: list[int], repeats: int, hf_repeats: int) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    out: dict = {"times": {}, "hf_times": {}}
    for n in ns:
        x = make_inputs(n, favor=True)
        f = forms(x)
        ours = {name: _forward_backward(f[name], x) for name in TIMED}
        times = time_calls(ours, repeats=repeats, warmup=1)
        out["times"][str(n)] = {k: {"median_s": median(v), "all_s": v} for k, v in times.items()}
        if "hf_gated_delta" in f:
            # linear_attention beside them too: what the simplest chunked product of this library
            # gains over transformers' delta rule bounds what a delta rule (a superset of its
            # products) can gain
            trio = {"gated_delta": ours["gated_delta"], BASE: ours[BASE],
                    "hf_gated_delta": _forward_backward(f["hf_gated_delta"], x)}
            times = time_calls(trio, repeats=hf_repeats, warmup=1)
            out["hf_times"][str(n)] = {k: {"median_s": median(v), "all_s": v} for k, v in times.items()}
        del x, f, ours
    out["step_s"] = step_times()
    return out


def _memory_child(name: str, n: int) -> dict:
    """Peak RSS above the inputs of one forward+backward of ``name`` at ``n``, finiteness, and the
    output's error relative to the float64 reference (run in a fresh process)."""
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    x = make_inputs(n)
    fn = forms(x)[name]
    o = None

    def forward_backward() -> None:
        nonlocal o
        o = fn()
        o.backward(torch.ones_like(o))

    peak = peak_rss_bytes(forward_backward)
    finite = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(t.grad).all())
                                                    for t in x.values() if t.grad is not None)
    o = o.detach()
    if name == BASE:  # its reference is the O(N^2) kernel-matrix form: no accuracy check at this N
        return {"peak_bytes": peak, "finite": finite, "rel_err": None}
    x64 = {k: t.detach().double() for k, t in x.items()}
    with torch.no_grad():
        ref = _call(name, x64, reference=True)
    rel = float((o.double() - ref).abs().max() / ref.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
    return {"peak_bytes": peak, "finite": finite, "rel_err": rel}


def memory(name: str, n: int, *, timeout: float = 1800) -> dict:
    proc = run_process([sys.executable, "-m", "linattn.bench.gated", "memory", name, str(n)], timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement of {name} at N = {n} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_gated(*, out: str | Path = "docs/benchmarks", ns: tuple[int, ...] = (4096, 16384), repeats: int = 5,
              hf_repeats: int = 2, memory_n: int = 65536, runs: int = RUNS, quiet: bool = False) -> dict:
    """Time ``runs`` times (a fresh process each), measure memory and accuracy at ``memory_n``
    (0 skips it), write gated.json and gated.md, print the Markdown; return the result."""
    for name, value, lo in (("runs", runs, 1), ("repeats", repeats, 1), ("hf_repeats", hf_repeats, 1),
                            ("memory_n", memory_n, 0)):
        if value < lo:
            raise ValueError(f"run_gated: {name} must be >= {lo}, got {value}")
    if not ns or any(n < 1 for n in ns):
        raise ValueError(f"run_gated: ns must be positive sequence lengths, got {ns}")
    output_folder(out)
    say = functools.partial(progress.say, quiet=quiet)
    have_hf = hf_gated_delta_rule() is not None
    say(f"linattn bench gated: N = {list(ns)}, B=1 H={H} D={D} float32, {runs} runs; transformers' "
        f"torch_chunk_gated_delta_rule {'found' if have_hf else 'NOT installed (the convert extra installs it)'}")
    t0 = time.perf_counter()
    result: dict = {
        "command": (f"linattn bench gated --ns {','.join(map(str, ns))} --repeats {repeats} --hf-repeats {hf_repeats} "
                    f"--memory-n {memory_n}" + (f" --runs {runs}" if runs != RUNS else "") + f" --out {out}"),
        "machine": machine_info(),
        "config": {"ns": list(ns), "batch_size": 1, "n_heads": H, "head_dim": D, "dtype": "float32",
                   "repeats": repeats, "hf_repeats": hf_repeats, "memory_n": memory_n, "runs": runs,
                   "pass": "forward+backward", "contenders": DESCRIPTIONS},
        "runs": run_repeated("linattn.bench.gated", [",".join(map(str, ns)), str(repeats), str(hf_repeats)],
                             runs=runs, allocators=INHERITED_ALLOCATOR, say=say),
    }
    children = [r["allocators"]["inherited"] for r in result["runs"]]
    def ratios(times: str, n: int, num: str, den: str) -> dict:
        return spread([c[times][str(n)][num]["median_s"] / c[times][str(n)][den]["median_s"] for c in children])

    result["ratios"] = {str(n): {name: ratios("times", n, name, BASE) for name in OURS} for n in ns}
    result["engine_ratios"] = {str(n): {probe: ratios("times", n, probe, own) for probe, own in ENGINE_PROBES.items()}
                               for n in ns}
    if have_hf:
        result["hf_ratios"] = {str(n): ratios("hf_times", n, "hf_gated_delta", "gated_delta") for n in ns}
        result["hf_linear_ratios"] = {str(n): ratios("hf_times", n, "hf_gated_delta", BASE) for n in ns}
    result["step_ratios"] = {name: spread([c["step_s"][name] / c["step_s"][BASE] for c in children]) for name in OURS}
    result["kda_ratios"] = {str(n): ratios("times", n, "kda", "gated_delta") for n in ns}
    result["kda_step_ratio"] = spread([c["step_s"]["kda"] / c["step_s"]["gated_delta"] for c in children])
    if memory_n:
        say(f"  memory and accuracy at N = {memory_n} (fresh processes) ...")
        result["memory"] = {name: memory(name, memory_n) for name in (BASE, *OURS)}
    result["claims"] = claims(result)
    result["elapsed_seconds"] = time.perf_counter() - t0
    md = format_gated(result)
    write_atomically(out, {"gated.json": json.dumps(result, indent=2), "gated.md": md})
    say(md)
    return result


def claims(result: dict) -> dict[str, dict]:
    """Each of issue 20's claims: its statement, the measured spread and whether the median holds it."""
    out = {}
    largest = str(max(result["config"]["ns"]))
    for name, limit in WITHIN.items():
        s = result["ratios"][largest][name]
        out[f"{name} within {limit}x of linear at N = {largest}"] = {
            "text": f"{DESCRIPTIONS[name]} / linear_attention time at N = {largest}: {format_spread(s)}; "
                    f"at most {limit}x wanted", "holds": s["median"] <= limit}
    s = result["kda_ratios"][largest]
    out[f"kda within {KDA_WITHIN:g}x of Gated DeltaNet at N = {largest}"] = {
        "text": f"{DESCRIPTIONS['kda']} / {DESCRIPTIONS['gated_delta']} time at N = {largest}: {format_spread(s)}; "
                f"at most {KDA_WITHIN:g}x wanted", "holds": s["median"] <= KDA_WITHIN}
    s = result["kda_step_ratio"]
    out[f"kda step within {KDA_WITHIN:g}x of Gated DeltaNet's"] = {
        "text": f"one recurrent step of {DESCRIPTIONS['kda']} / one of {DESCRIPTIONS['gated_delta']}: "
                f"{format_spread(s)}; at most {KDA_WITHIN:g}x wanted", "holds": s["median"] <= KDA_WITHIN}
    for n, s in result.get("hf_ratios", {}).items():
        out[f"{HF_FASTER_BY:g}x faster than transformers at N = {n}"] = {
            "text": f"torch_chunk_gated_delta_rule / our gated delta rule time at N = {n}: {format_spread(s)}; "
                    f"at least {HF_FASTER_BY:g}x wanted", "holds": s["median"] >= HF_FASTER_BY}
    for name, s in result["step_ratios"].items():
        out[f"{name} step within {STEP_WITHIN:g}x of linear's"] = {
            "text": f"one recurrent step of {DESCRIPTIONS[name]} / a linear-attention step: {format_spread(s)}; "
                    f"at most {STEP_WITHIN:g}x wanted", "holds": s["median"] <= STEP_WITHIN}
    for name, m in result.get("memory", {}).items():
        if name == BASE:
            continue
        limit = MEMORY_LIMITS.get(name, MEMORY_LIMIT_BYTES)
        ok = m["peak_bytes"] < limit and m["finite"] and m["rel_err"] <= REL_ERR_LIMIT
        out[f"{name} memory and accuracy at N = {result['config']['memory_n']}"] = {
            "text": f"{DESCRIPTIONS[name]} at N = {result['config']['memory_n']}: peak {m['peak_bytes'] / 2**20:.0f} MiB "
                    f"(under {limit / 1e9:g} GB wanted), finite: {m['finite']}, output error relative "
                    f"to the float64 reference {m['rel_err']:.1e} (at most {REL_ERR_LIMIT:g} wanted)", "holds": ok}
    return out


def format_gated(result: dict) -> str:
    cfg, m, runs = result["config"], result["machine"], result["runs"]
    children = [r["allocators"]["inherited"] for r in runs]
    lines = [
        f"# Gated and delta-rule attention: B = 1, H = {cfg['n_heads']}, D = Dv = {cfg['head_dim']}, float32, "
        "causal forward+backward",
        "",
        f"Written by `{result['command']}`; do not edit by hand. Machine: {m['processor']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}, {m['threads']} threads. The timing ran {len(runs)} times, each in a fresh process; "
        f"within a run the median of {cfg['repeats']} interleaved repeats (transformers beside our gated delta rule: "
        f"{cfg['hf_repeats']}). Each ratio is the median over the runs with min and max, each run's ratio from its "
        "own medians.",
        "",
        "## Claims",
        "",
        *[f"- {'holds' if c['holds'] else '**does not hold**'}: {c['text']}" for c in result["claims"].values()],
        "",
        "## Time / linear_attention's, forward+backward",
        "",
        "| N | contender | median | min | max | per run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, names in result["ratios"].items():
        for name, s in names.items():
            lines.append(f"| {n} | {DESCRIPTIONS[name]} | {format_spread_cells(s)} |")
    lines += ["", "## Specialise, don't route: each product routed through the decayed engine's log-decay path / "
              "on the specialisation that serves it, forward+backward", "", "| N | contender | median | min | max | per run |",
              "| --- | --- | --- | --- | --- | --- |"]
    for n, probes in result["engine_ratios"].items():
        for name, s in probes.items():
            lines.append(f"| {n} | {DESCRIPTIONS[name]} / {DESCRIPTIONS[ENGINE_PROBES[name]]} | {format_spread_cells(s)} |")
    if "hf_ratios" in result:
        lines += ["", "## transformers' torch_chunk_gated_delta_rule time / ours, interleaved in one process", "",
                  "| N | / our gated delta rule | / linear_attention (elu+1), causal |", "| --- | --- | --- |"]
        lines += [f"| {n} | {format_spread(s)} | {format_spread(result['hf_linear_ratios'][n])} |"
                  for n, s in result["hf_ratios"].items()]
    lines += ["", "## Times (median over runs of each run's median)", "", "| N | contender | time | per run |",
              "| --- | --- | --- | --- |"]
    for n in result["ratios"]:
        for name in TIMED:
            ts = [c["times"][n][name]["median_s"] for c in children]
            lines.append(f"| {n} | {DESCRIPTIONS[name]} | {format_seconds(median(ts))} | "
                         + ", ".join(format_seconds(t) for t in ts) + " |")
        if "hf_ratios" in result:
            ts = [c["hf_times"][n]["hf_gated_delta"]["median_s"] for c in children]
            lines.append(f"| {n} | {DESCRIPTIONS['hf_gated_delta']} | {format_seconds(median(ts))} | "
                         + ", ".join(format_seconds(t) for t in ts) + " |")
    lines += ["", "## One recurrent step (Nq = 1, no grad, after 1000 positions)", "",
              "| contender | time per step: median over runs | / linear's step (median, min, max) |",
              "| --- | --- | --- |"]
    for name in (BASE, *OURS):
        ts = [c["step_s"][name] for c in children]
        ratio = "" if name == BASE else (f"{result['step_ratios'][name]['median']:.2f}x "
                                         f"({result['step_ratios'][name]['min']:.2f}-{result['step_ratios'][name]['max']:.2f}x)")
        lines.append(f"| {DESCRIPTIONS[name]} | {median(ts) * 1e6:.0f} µs | {ratio} |")
    if "memory" in result:
        lines += ["", f"## N = {cfg['memory_n']}: peak memory of forward+backward (RSS above the inputs, fresh "
                  "process), finiteness, error against the float64 reference recurrence", "",
                  "| contender | peak memory | finite (output, gradients) | max abs error / max abs reference output |",
                  "| --- | --- | --- | --- |"]
        for name, mem in result["memory"].items():
            err = "- (its reference is O(N^2))" if mem["rel_err"] is None else f"{mem['rel_err']:.1e}"
            lines.append(f"| {DESCRIPTIONS[name]} | {mem['peak_bytes'] / 2**20:.0f} MiB | {mem['finite']} | {err} |")
    lines += ["", "## Each run's machine", "", *format_run_loads([r["load"] for r in runs])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        print(json.dumps(_child([int(n) for n in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]))))
    elif len(sys.argv) == 4 and sys.argv[1] == "memory":
        print(json.dumps(_memory_child(sys.argv[2], int(sys.argv[3]))))
    else:
        raise SystemExit("usage: python -m linattn.bench.gated child NS REPEATS HF_REPEATS | memory NAME N")
