"""``linattn bench context-parallel``: one training step of a TransformerLM whose sequence is
sharded over P ranks (context parallelism, :mod:`linattn.distributed`), on this machine.

Three measurements, each rank a fresh gloo process (:func:`linattn.train.dist.spawn_local`):

- **The longest sequence** one step (forward, backward, the gradient all-reduce, an AdamW step)
  can take within ``budget_gib`` of this machine's memory, for P = 1, 2, 4 ranks. Every rank's
  peak resident memory (VmHWM) is measured at two lengths; per rank it grows linearly with its
  N / P positions, so a line through the two predicts the longest N whose ranks' peaks add up to
  the budget, and a third run at that N (rounded down) verifies it. On this one machine the ranks
  share its memory, so the sum over ranks is what must fit; the per-rank peak, which falls as
  1 / P, is what P machines of that memory each would need.
- **The time per step** at one length, P = 1, 2, 4, repeated in ``runs`` separate runs (the
  ratios to one process are stated by their median and spread). The machine has 2 cores: one
  process uses 2 threads, P ranks 1 thread each, so 4 ranks share 2 cores (the ratios say what
  the sharding costs here, not what P machines would gain).
- **The bytes the ranks exchange**, counted at every collective call in the ranks (a counting
  wrapper around ``torch.distributed``'s collectives, installed in the benchmark's workers only),
  against the written model of :func:`model_bytes_per_rank` (docs/context_parallel.md). The time a
  ring message takes, ``alpha + bytes / beta``, is fitted from all-gathers of 1 KiB .. 4 MiB timed
  alone on the ranks (gloo over localhost); with it the model predicts the time of a step's
  collectives, compared with the time the ranks spent inside them (which also holds the wait for
  the slowest rank), and is extended to 8 .. 1024 ranks.

Per-rank volumes count what a rank receives in the ring algorithms gloo runs: an all-gather of
s bytes per rank brings in ``(P - 1) s``; an all-reduce of s bytes moves ``2 (P - 1) / P s`` each
way. Latency terms: ``P - 1`` messages for a ring all-gather, ``2 (P - 1)`` for a ring all-reduce
(a tree would take ``log2 P``).

Dimension legend: N the sequence length, P ranks, n = N / P positions per rank, B batch (1),
H heads, D head width, C the model width.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import progress
from ..processes import run_process
from ..models import TransformerConfig, TransformerLM
from ..nn.gated import GatedDeltaNetConfig
from .harness import (OtherLoad, format_run_loads, machine_info, median, output_folder, proc_status_kib, spread,
                      write_atomically)

__all__ = ["CommCounter", "model_bytes_per_rank", "run_context_parallel"]

RANKS = (1, 2, 4)
DEFAULT_MODEL = dict(vocab_size=256, d_model=256, n_layers=2, n_heads=4, d_ff=1024)
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce_scatter_tensor",
               "all_to_all_single")


class CommCounter:
    """Counts every collective call of ``torch.distributed`` in this process: calls, the bytes a
    rank receives in gloo's ring algorithms (see the module docstring) and the wall time spent in
    the (blocking) calls. :meth:`install` wraps the functions; a measurement tool, not library code."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0.0
        self.seconds = 0.0
        self.by_kind: dict[str, dict[str, float]] = {}

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds, self.by_kind = 0, 0.0, 0.0, {}

    def install(self) -> "CommCounter":
        import torch.distributed as dist

        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn):
        import torch.distributed as dist

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            P = dist.get_world_size(group)
            volume = self._volume(name, args, P)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            dt = time.perf_counter() - t0
            self.calls += 1
            self.bytes += volume
            self.seconds += dt
            k = self.by_kind.setdefault(name, {"calls": 0, "bytes": 0.0, "seconds": 0.0})
            k["calls"] += 1
            k["bytes"] += volume
            k["seconds"] += dt
            return out

        return counted

    @staticmethod
    def _volume(name: str, args, P: int) -> float:
        def nbytes(t) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        if name == "all_gather":  # (tensor_list, tensor)
            return (P - 1) * nbytes(args[1])
        if name == "all_gather_into_tensor":  # (output, input)
            return (P - 1) * nbytes(args[1])
        if name == "all_reduce":
            return 2 * (P - 1) / P * nbytes(args[0])
        if name == "broadcast":
            return nbytes(args[0])
        if name == "reduce_scatter_tensor":  # (output, input)
            return (P - 1) / P * nbytes(args[1])
        return nbytes(args[0]) * (P - 1) / P


def model_config(n: int, model: dict) -> TransformerConfig:
    """The benchmark's model for sequences of ``n`` tokens: Gated DeltaNet in every layer with its
    paper's short convolution (kernel 4) and no position table (whose ``max_len`` rows would be
    memory of their own on every rank)."""
    return TransformerConfig(max_len=n, attention=GatedDeltaNetConfig(), short_conv=4, positional="none", **model)


def model_bytes_per_rank(P: int, *, model: dict, n_params: int, batch: int = 1) -> dict[str, float]:
    """The written model: bytes a rank receives per training step with P ranks, for the benchmark's
    Gated DeltaNet stack (see docs/context_parallel.md for every layer kind).

    Per layer, the forward all-gathers every rank's summary ``[S_r | M_r]``, ``B H D (Dv + D)``
    float32 (Dv = D), and the backward all-reduces the gradient of the gathered ``P`` summaries;
    the shard check before it exchanges a few numbers (not counted here: under 100 bytes). The
    step ends with one all-reduce of the parameters' gradients (what data parallelism over the
    ranks of one sequence does). Returns the parts and their ``total``."""
    if P == 1:
        return {"summaries": 0.0, "summary_gradients": 0.0, "parameter_gradients": 0.0, "total": 0.0}
    H = model["n_heads"]
    D = model["d_model"] // H
    layers = model["n_layers"]
    s = batch * H * D * 2 * D * 4  # one rank's summary: S (D x Dv) and M (D x D), float32
    gather = (P - 1) * s * layers
    reduce = 2 * (P - 1) / P * (P * s) * layers  # the gathered (P, ...) gradient, all-reduced
    grads = 2 * (P - 1) / P * n_params * 4
    return {"summaries": gather, "summary_gradients": reduce, "parameter_gradients": grads,
            "total": gather + reduce + grads}


def model_messages_per_rank(P: int, *, layers: int) -> int:
    """Ring messages per rank per step of the written model: per layer an all-gather (P - 1) and an
    all-reduce 2 (P - 1), then the gradients' all-reduce 2 (P - 1). (The shard checks add one small
    all-gather per layer; counted by the measurement, left out of the model.)"""
    return 0 if P == 1 else layers * 3 * (P - 1) + 2 * (P - 1)


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------


def _rank_main(spec: dict, out_dir: str) -> None:
    """One rank: build the model (same seed everywhere), run ``warmup + steps`` training steps on
    its shard, write its peak memory, step times and collective counts to ``out_dir/rank_R.json``."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..distributed import ContextParallel
    from ..train.dist import join_group

    P = int(os.environ.get("WORLD_SIZE", "1"))
    counter = CommCounter().install() if P > 1 else None
    if P > 1:
        join_group("gloo")
    rank = dist.get_rank() if P > 1 else 0
    torch.set_num_threads(spec["threads"])
    N = spec["n"]
    torch.manual_seed(0)
    model = TransformerLM(model_config(N, spec["model"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec["model"]["vocab_size"], (1, N + 1), generator=g)
    n = N // P
    x, y = tokens[:, rank * n : (rank + 1) * n], tokens[:, rank * n + 1 : (rank + 1) * n + 1]
    context = ContextParallel(None, rank * n) if P > 1 else None
    params = [p for p in model.parameters()]
    micro = _time_all_gathers(P) if P > 1 and spec.get("micro", True) else None
    base = proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the high-water mark VmHWM back to the current RSS
    times = []
    for step in range(spec["warmup"] + spec["steps"]):
        if counter is not None and step == spec["warmup"]:
            counter.reset()
        if P > 1:
            dist.barrier()
        t0 = time.perf_counter()
        logits = model(x, context_parallel=context) if context is not None else model(x)
        # the mean over the whole sequence: each rank's share of it, so the summed gradient is the whole's
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / N
        loss.backward()
        if P > 1:
            flat = torch.cat([p.grad.flatten() for p in params])
            dist.all_reduce(flat)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if P > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    out = {"rank": rank, "peak_bytes": proc_status_kib("VmHWM") * 1024, "base_bytes": base * 1024,
           "step_seconds": times[spec["warmup"]:],
           "n_params": sum(p.numel() for p in params), "all_gather_seconds": micro}
    if counter is not None:
        steps = spec["steps"]
        out["comm"] = {"calls_per_step": counter.calls / steps, "bytes_per_step": counter.bytes / steps,
                       "seconds_per_step": counter.seconds / steps,
                       "by_kind": {k: {f: v / steps for f, v in d.items()} for k, d in counter.by_kind.items()}}
        dist.barrier()
        dist.destroy_process_group()
    Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(out))


MICRO_SIZES = tuple(1024 * 4**i for i in range(7))  # bytes per rank: 1 KiB .. 4 MiB


def _time_all_gathers(P: int, repeats: int = 7) -> dict[str, float]:
    """Median seconds of an all-gather of each of :data:`MICRO_SIZES` bytes per rank, alone (a
    barrier before every call, so that no rank waits for another's compute)."""
    import torch.distributed as dist

    out = {}
    for size in MICRO_SIZES:
        x = torch.zeros(size // 4)
        rows = [torch.empty_like(x) for _ in range(P)]
        ts = []
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather(rows, x)
            ts.append(time.perf_counter() - t0)
        out[str(size)] = median(ts[1:])
    return out


def fit_message_cost(P: int, seconds: dict[str, float]) -> dict[str, float]:
    """``alpha`` (s) and ``beta`` (bytes/s) of one ring message, ``alpha + bytes / beta``, from the
    timed all-gathers of P ranks: an all-gather of s bytes per rank is P - 1 messages of s bytes,
    so ``t(s) / (P - 1) = alpha + s / beta``; a least-squares line through the sizes."""
    xs = [float(k) for k in seconds]
    ys = [v / (P - 1) for v in seconds.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = my - slope * mx
    return {"alpha_seconds": alpha, "beta_bytes_per_second": 1 / slope if slope > 0 else float("inf")}


def model_seconds_per_rank(P: int, *, model: dict, n_params: int, alpha: float, beta: float) -> float:
    """The written model's time in a step's collectives: ring messages times alpha plus the bytes a
    rank receives over beta (:func:`model_messages_per_rank`, :func:`model_bytes_per_rank`)."""
    if P == 1:
        return 0.0
    return (model_messages_per_rank(P, layers=model["n_layers"]) * alpha
            + model_bytes_per_rank(P, model=model, n_params=n_params)["total"] / beta)


def measure(P: int, n: int, *, model: dict, warmup: int = 1, steps: int = 2, threads: int | None = None,
            timeout: float = 3600, micro: bool = True) -> dict:
    """One measurement: P fresh rank processes train ``warmup + steps`` steps on a sequence of ``n``
    tokens. Returns every rank's record (see :func:`_rank_main`) and their sums and maxima."""
    if n % P:
        raise ValueError(f"measure: P = {P} must divide n = {n}")
    threads = threads if threads is not None else max(1, 2 // P)
    spec = {"n": n, "model": model, "warmup": warmup, "steps": steps, "threads": threads, "micro": micro}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        code = ("import json, sys; from linattn.bench.context_parallel import _launch; "
                "_launch(json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]))")
        proc = run_process([sys.executable, "-c", code, json.dumps(spec), tmp, str(P)], env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"context-parallel measurement P = {P}, n = {n} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        ranks = [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(P)]
    step = [max(r["step_seconds"][i] for r in ranks) for i in range(steps)]
    return {"P": P, "n": n, "ranks": ranks, "peak_sum_bytes": sum(r["peak_bytes"] for r in ranks),
            "peak_max_bytes": max(r["peak_bytes"] for r in ranks), "step_seconds": median(step),
            "n_params": ranks[0]["n_params"]}


def _launch(spec: dict, out_dir: str, P: int) -> None:
    """The body of one measurement's launcher process: P ranks (one process when P = 1)."""
    if P == 1:
        _rank_main(spec, out_dir)
        return
    from ..train.dist import spawn_local

    spawn_local(_rank_entry, P, (spec, out_dir), threads_per_proc=spec["threads"])


def _rank_entry(spec: dict, out_dir: str) -> None:
    _rank_main(spec, out_dir)


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def longest(P: int, *, model: dict, budget_bytes: float, probes: tuple[int, int], say,
            max_n: int = 1 << 22) -> dict:
    """The longest N (a multiple of 1024 P, at most ``max_n``) whose P ranks' summed peak memory
    stays within the budget: two probes give the line, a third run at its prediction verifies it (a
    fourth, 10% shorter, if the third overshoots)."""
    a, b = (measure(P, n, model=model, warmup=0, steps=1, micro=False) for n in probes)
    slope = (b["peak_sum_bytes"] - a["peak_sum_bytes"]) / (b["n"] - a["n"])
    at0 = a["peak_sum_bytes"] - slope * a["n"]
    unit = 1024 * P
    pred = min(int((budget_bytes - at0) / slope) if slope > 0 else max_n, max_n) // unit * unit
    say(f"    P = {P}: {a['peak_sum_bytes'] / 2**30:.2f} GiB at N = {a['n']}, {b['peak_sum_bytes'] / 2**30:.2f} GiB at "
        f"{b['n']}: predicts N = {pred} within {budget_bytes / 2**30:.1f} GiB; verifying ...")
    tries = []
    n = pred
    for _ in range(2):
        m = measure(P, n, model=model, warmup=0, steps=1, micro=False)
        tries.append(m)
        if m["peak_sum_bytes"] <= budget_bytes:
            break
        n = int(n * 0.9) // unit * unit
    ok = tries[-1]["peak_sum_bytes"] <= budget_bytes
    return {"P": P, "probes": [_brief(a), _brief(b)], "predicted_n": pred, "verified": [_brief(t) for t in tries],
            "longest_n": tries[-1]["n"] if ok else None}


def _brief(m: dict) -> dict:
    return {"n": m["n"], "peak_sum_bytes": m["peak_sum_bytes"], "peak_max_bytes": m["peak_max_bytes"],
            "step_seconds": m["step_seconds"]}


def run_context_parallel(*, out: str | Path = "docs/benchmarks", ranks: tuple[int, ...] = RANKS,
                         time_n: int = 32768, runs: int = 3, steps: int = 3, budget_gib: float = 20.0,
                         probes: tuple[int, int] = (32768, 131072), model: dict | None = None,
                         search: bool = True, quiet: bool = False) -> dict:
    """Measure, write context_parallel.json and .md under ``out``, print the Markdown, return the result.

    Every argument is checked and ``out`` created before the first measurement (tens of minutes)."""
    say = functools.partial(progress.say, quiet=quiet)
    model = dict(DEFAULT_MODEL if model is None else model)
    for name, value in (("runs", runs), ("steps", steps), ("time_n", time_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"run_context_parallel: {name} must be an integer >= 1, got {value!r}")
    if not ranks or any(isinstance(P, bool) or not isinstance(P, int) or P < 1 for P in ranks):
        raise ValueError(f"run_context_parallel: ranks must be rank counts >= 1, got {ranks!r}")
    if not (isinstance(budget_gib, (int, float)) and math.isfinite(budget_gib) and budget_gib > 0):
        raise ValueError(f"run_context_parallel: budget_gib must be a finite number of GiB > 0, got {budget_gib!r}")
    for P in ranks:
        if time_n % P or any(n % (1024 * P) for n in probes):
            raise ValueError(f"run_context_parallel: every rank count must divide time_n and probes / 1024, got P = {P}")
    output_folder(out)
    t0 = time.perf_counter()
    result: dict = {
        "command": (f"linattn bench context-parallel --ranks {','.join(map(str, ranks))} --time-n {time_n} --runs {runs} "
                    f"--budget-gib {budget_gib:g}" + ("" if search else " --no-search") + f" --out {out}"),
        "machine": machine_info(),
        "config": {"model": model, "attention": "gated_deltanet", "batch": 1, "ranks": list(ranks), "time_n": time_n,
                   "runs": runs, "steps": steps, "budget_gib": budget_gib, "probes": list(probes)},
        "timing": [],
    }
    for i in range(runs):
        load = OtherLoad(reference=True)
        say(f"  run {i + 1}/{runs}: one step at N = {time_n} with {list(ranks)} ranks ...")
        per = {str(P): measure(P, time_n, model=model, steps=steps) for P in ranks}
        result["timing"].append({"by_ranks": per, "load": load.finish()})
    base = str(ranks[0])
    result["time_ratios"] = {str(P): spread([r["by_ranks"][str(P)]["step_seconds"] / r["by_ranks"][base]["step_seconds"]
                                             for r in result["timing"]]) for P in ranks}
    result["comm"] = _comm(result, model)
    if search:
        load = OtherLoad(reference=True)
        say(f"  the longest N within {budget_gib:g} GiB ...")
        result["longest"] = {str(P): longest(P, model=model, budget_bytes=budget_gib * 2**30, probes=probes, say=say)
                             for P in ranks}
        result["longest_load"] = load.finish()
    result["elapsed_seconds"] = time.perf_counter() - t0
    md = format_context_parallel(result)
    write_atomically(out, {"context_parallel.json": json.dumps(result, indent=2), "context_parallel.md": md})
    say(md)
    return result


def _comm(result: dict, model: dict) -> dict:
    """Per P > 1: counted bytes and calls per rank per step (median over ranks and runs), the model's
    bytes and messages, the message cost fitted from the timed all-gathers (median of the ranks' and
    runs' fits), and the model's time of a step's collectives against the time spent inside them."""
    rows = {}
    for P_key in result["timing"][0]["by_ranks"]:
        P = int(P_key)
        if P == 1:
            continue
        per_run = [r["by_ranks"][P_key] for r in result["timing"]]
        ranks = [rk for m in per_run for rk in m["ranks"]]
        fits = [fit_message_cost(P, rk["all_gather_seconds"]) for rk in ranks if rk.get("all_gather_seconds")]
        alpha = median([f["alpha_seconds"] for f in fits])
        beta = median([f["beta_bytes_per_second"] for f in fits])
        n_params = per_run[0]["n_params"]
        rows[P_key] = {
            "counted_bytes": median([rk["comm"]["bytes_per_step"] for rk in ranks]),
            "model_parts": model_bytes_per_rank(P, model=model, n_params=n_params),
            "calls": median([rk["comm"]["calls_per_step"] for rk in ranks]),
            "model_messages": model_messages_per_rank(P, layers=model["n_layers"]),
            "seconds_inside": median([rk["comm"]["seconds_per_step"] for rk in ranks]),
            "alpha_seconds": alpha, "beta_bytes_per_second": beta,
            "model_seconds": model_seconds_per_rank(P, model=model, n_params=n_params, alpha=alpha, beta=beta),
        }
        rows[P_key]["model_bytes"] = rows[P_key]["model_parts"]["total"]
    return {"by_ranks": rows}


def format_context_parallel(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    model = cfg["model"]
    lines = [
        f"# Context parallelism: one training step of a {model['n_layers']}-layer Gated DeltaNet LM "
        f"(d_model {model['d_model']}, {model['n_heads']} heads, d_ff {model['d_ff']}, vocabulary "
        f"{model['vocab_size']}), batch 1, float32",
        "",
        f"Written by `{result['command']}`; do not edit by hand. Machine: {m['processor']}, {m['cpu_count']} CPUs, "
        f"torch {m['torch']}; one process uses 2 threads, P ranks 1 thread each (gloo over localhost), so 4 ranks "
        "share the 2 cores. A step is forward, backward, the all-reduce of the parameters' gradients and an AdamW "
        "step; its time is the slowest rank's.",
        "",
        f"## Time per step at N = {cfg['time_n']} ({len(result['timing'])} runs, each the median of {cfg['steps']} "
        "steps after one warm-up)",
        "",
        "| ranks | time per step (median over runs) | / one process: median | min | max | per run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for P, s in result["time_ratios"].items():
        ts = [r["by_ranks"][P]["step_seconds"] for r in result["timing"]]
        lines.append(f"| {P} | {median(ts):.2f} s | {s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x | "
                     + ", ".join(f"{x:.2f}x" for x in s["runs"]) + " |")
    lines += ["", f"Peak memory at N = {cfg['time_n']} (first run): "
              + "; ".join(f"{P} rank{'s' if P != '1' else ''}: {r['peak_sum_bytes'] / 2**30:.2f} GiB in all, "
                          f"{r['peak_max_bytes'] / 2**30:.2f} GiB the largest rank"
                          for P, r in result["timing"][0]["by_ranks"].items()) + "."]
    if "longest" in result:
        lines += ["", f"## The longest sequence within {cfg['budget_gib']:g} GiB of this machine (all ranks together)",
                  "", "| ranks | longest N (verified) | summed peak there | largest rank's peak | step time there | "
                  "probes (N: summed peak) |", "| --- | --- | --- | --- | --- | --- |"]
        for P, r in result["longest"].items():
            v = r["verified"][-1]
            probes = ", ".join(f"{p['n']}: {p['peak_sum_bytes'] / 2**30:.2f} GiB" for p in r["probes"])
            n = "none (over the budget)" if r["longest_n"] is None else str(r["longest_n"])
            lines.append(f"| {P} | {n} | {v['peak_sum_bytes'] / 2**30:.2f} GiB | {v['peak_max_bytes'] / 2**30:.2f} GiB | "
                         f"{v['step_seconds']:.1f} s | {probes} |")
    comm = result["comm"]["by_ranks"]
    lines += ["", "## Bytes a rank receives per step: counted at every collective call, against the model", "",
              "| ranks | counted | model | model: summaries / their gradients / parameter gradients | collective calls "
              "counted | model's ring messages |", "| --- | --- | --- | --- | --- | --- |"]
    for P, r in comm.items():
        p = r["model_parts"]
        lines.append(f"| {P} | {r['counted_bytes'] / 2**20:.3f} MiB | {r['model_bytes'] / 2**20:.3f} MiB | "
                     f"{p['summaries'] / 2**20:.3f} / {p['summary_gradients'] / 2**20:.3f} / "
                     f"{p['parameter_gradients'] / 2**20:.3f} MiB | {r['calls']:.0f} | {r['model_messages']} |")
    lines += ["", "The counted bytes exceed the model's by the small collectives it leaves out: the shard and offset "
              "checks and the short convolution's halo (a few KiB). Calls are collective calls; the model counts "
              "the ring messages they make.", "",
              "## Time in collectives: the model with the message cost of timed all-gathers, against the time inside "
              "them", "", "| ranks | alpha (one message) | beta | model: time per step | time inside the collectives "
              "per step (with the wait for the slowest rank) |", "| --- | --- | --- | --- | --- |"]
    for P, r in comm.items():
        lines.append(f"| {P} | {r['alpha_seconds'] * 1e6:.0f} us | {r['beta_bytes_per_second'] / 2**30:.2f} GiB/s | "
                     f"{r['model_seconds'] * 1e3:.1f} ms | {r['seconds_inside'] * 1e3:.1f} ms |")
    if comm:
        last = comm[max(comm, key=int)]
        alpha, beta = last["alpha_seconds"], last["beta_bytes_per_second"]
        n_params = result["timing"][0]["by_ranks"][str(cfg["ranks"][0])]["n_params"]
        lines += ["", f"## The model extended (per rank per step; ring collectives; alpha and beta of the {max(comm, key=int)}"
                  "-rank all-gathers above, gloo over localhost: a network between machines has its own)", "",
                  "| ranks | bytes received | ring messages | modelled time in collectives |", "| --- | --- | --- | --- |"]
        for P in (8, 16, 64, 256, 1024):
            b = model_bytes_per_rank(P, model=model, n_params=n_params)["total"]
            msgs = model_messages_per_rank(P, layers=model["n_layers"])
            t = model_seconds_per_rank(P, model=model, n_params=n_params, alpha=alpha, beta=beta)
            lines.append(f"| {P} | {b / 2**20:.1f} MiB | {msgs} | {t:.3f} s |")
        lines += ["", "Every rank receives every other rank's summary (an all-gather), so the bytes per rank grow "
                  "linearly in P while each rank's compute falls as 1 / P, and a ring's latency term grows linearly "
                  "in P too; the parameters' gradients (2 (P - 1) / P of their bytes) stay nearly constant. Past the P "
                  "where communication meets compute, a rank should receive only the prefix it needs (a scan: "
                  "log2 P messages of one summary each) rather than every summary."]
    lines += ["", "## Each run's machine", "", *format_run_loads([r["load"] for r in result["timing"]])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("use `linattn bench context-parallel`")
