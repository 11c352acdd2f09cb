"""`linattn bench favor`: FAVOR+ approximation quality and speed, with performer-pytorch beside it.

- Approximation (the Performer paper's variance figure): relative error ||out - ref|| / ||ref|| of
  ``favor_attention`` against ``softmax_attention`` (default scale) for m = 16 ... 4096 random
  features, positive vs trig features, orthogonal vs i.i.d. projections, N = 256, D = 64,
  q, k ~ 0.25 N(0, 1), v ~ N(0, 1), float64, mean and standard deviation over seeds. Every variant
  and m sees the same inputs for a given seed. Writes favor_approx.json and favor_approx.png.
- Speed: forward+backward at N = 4096, B = 1, H = 8, D = 64, float32, of the FAVOR+ config the
  benchmark states (``attention``, default ``FavorConfig(num_features=256)``: positive orthogonal
  features), against performer-pytorch 1.1.4 ``FastAttention`` with the same number of random
  features (causal: with fast-transformers' CPU kernel plugged in,
  its fastest CPU path), interleaved A B A B in one process. Timed twice, in fresh processes:
  with glibc's default malloc and with the tuned settings of ``TUNED_MALLOC_ENV`` (as in
  ``linattn bench core``): performer-pytorch's causal path allocates about 0.7 GB per call,
  and the default allocator faults those pages in afresh each time, which costs it far more
  than it costs linattn. The whole timing is repeated ``runs`` times (default 3), each run in
  fresh processes with its own load and reference matmul speed; each ratio is stated by its median
  over the runs, with min and max. Peak memory once, under the default malloc. Writes
  favor_speed.json and favor_speed.md.

Every number in those files is written by this code.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

import linattn

from .. import progress
from ..extras import require_extra
from ..nn import FavorConfig
from ..nn.registry import attention_config_from_dict, attention_config_to_dict, config_label
from .harness import (
    PEERS,
    RUNS,
    TUNED_MALLOC_ENV,
    Case,
    attention_fn,
    call,
    format_allocator_times,
    format_run_loads,
    format_spread_cells,
    machine_info,
    make_inputs,
    median,
    peak_memory,
    ratio_claim,
    ratio_spreads,
    run_repeated,
    time_calls,
    output_folder,
    write_atomically,
)

APPROX_NUM_FEATURES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
VARIANTS = (("positive", True), ("positive", False), ("trig", True), ("trig", False))


def _variant(features: str, orthogonal: bool) -> str:
    return f"{features}-{'orthogonal' if orthogonal else 'iid'}"


def approximation_errors(
    num_features: tuple[int, ...] = APPROX_NUM_FEATURES, *, seeds: int = 20, n: int = 256, d: int = 64
) -> dict:
    """Relative errors per variant and number of features m (each of ``num_features``);
    ``errors[variant][str(m)]`` lists one value per seed."""
    ms = num_features
    errors: dict[str, dict[str, list[float]]] = {_variant(f, o): {str(m): [] for m in ms} for f, o in VARIANTS}
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.25
        k = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64) * 0.25
        v = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
        ref = linattn.softmax_attention(q, k, v)
        for m in ms:
            for features, orthogonal in VARIANTS:
                # one projection seed per (seed, m), shared by the variants with the same draw type
                pg = torch.Generator().manual_seed(1_000_003 * seed + m)
                W = linattn.favor_projection(m, d, orthogonal=orthogonal, generator=pg, dtype=torch.float64)
                out = linattn.favor_attention(q, k, v, W, features=features)
                err = ((out - ref).norm() / ref.norm()).item()
                errors[_variant(features, orthogonal)][str(m)].append(err)
    summary = {
        var: {m: {"mean": sum(e) / len(e), "std": _std(e)} for m, e in per_m.items()}
        for var, per_m in errors.items()
    }
    return {
        "config": {"num_features": list(ms), "seeds": seeds, "n": n, "head_dim": d, "dtype": "float64",
                   "q,k": "0.25 N(0,1)", "v": "N(0,1)", "scale": "1/sqrt(D)"},
        "summary": summary,
        "errors": errors,
    }


def approx_num_features(config: dict) -> list[int]:
    """The numbers of features of a favor_approx.json config (``ms`` in files written before the
    flag became ``--num-features``)."""
    return config["num_features"] if "num_features" in config else config["ms"]


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def plot_approximation(result: dict, path: str | Path) -> None:
    """Error vs m on log-log axes with error bars (one standard deviation over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for var, per_m in result["summary"].items():
        ms = [int(m) for m in per_m]
        ax.errorbar(ms, [per_m[str(m)]["mean"] for m in ms], yerr=[per_m[str(m)]["std"] for m in ms],
                    marker="o", capsize=3, label=var)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("random features m")
    ax.set_ylabel("||favor - softmax|| / ||softmax||")
    ax.set_title(f"FAVOR approximation, N={cfg['n']}, D={cfg['head_dim']}, {cfg['seeds']} seeds")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def _cases(causal: bool, n: int, heads: int, d: int, attention: FavorConfig) -> dict[str, Case]:
    """linattn's FAVOR+ with ``attention`` and performer-pytorch with as many random features."""
    return {"linattn": Case("favor", causal, n, n_heads=heads, head_dim=d, attention=attention),
            "performer_pytorch": Case("performer_pytorch", causal, n, n_heads=heads, head_dim=d, attention=attention)}


def _times_vs_performer(n: int, repeats: int, heads: int, d: int, attention: FavorConfig) -> dict:
    """Median and all times, causal and bidirectional, in this process (the child's work)."""
    result: dict = {}
    for causal in (True, False):
        cases = _cases(causal, n, heads, d, attention)
        inputs = {name: make_inputs(c) for name, c in cases.items()}
        fns = {name: (lambda c=c, x=inputs[name], f=attention_fn(c): call(c, x, f)) for name, c in cases.items()}
        times = time_calls(fns, repeats=repeats, warmup=2)
        result["causal" if causal else "bidirectional"] = {
            name: {"median_s": median(ts), "all_s": ts} for name, ts in times.items()
        }
    return result


def _require_performer() -> None:
    if not PEERS["performer_pytorch"].available():
        raise RuntimeError(
            "linattn bench favor --what speed needs performer-pytorch 1.1.4 and fast-transformers 0.4.0 "
            "(see docs/benchmarks/README.md); they are benchmark peers, not dependencies"
        )


def speed_vs_performer(*, attention: FavorConfig, n: int = 4096, repeats: int = 7, runs: int = RUNS,
                       heads: int = 8, d: int = 64, say=lambda text: None) -> dict:
    """Interleaved forward+backward times of linattn and performer-pytorch, ``runs`` times under
    each allocator (a fresh process each, with each run's load), peak memory once under the default
    allocator, and the spread over runs of each performer-pytorch / linattn ratio."""
    _require_performer()
    args = [str(n), str(repeats), str(heads), str(d), json.dumps(attention_config_to_dict(attention))]
    result: dict = {"runs": run_repeated("linattn.bench.favor", args, runs=runs, say=say)}
    say("  peak memory (default malloc) ...")
    result["peak_memory_bytes"] = {
        f"{'causal' if causal else 'bidirectional'}/{name}": peak_memory(case)
        for causal in (True, False) for name, case in _cases(causal, n, heads, d, attention).items()
    }
    result["ratios"] = ratio_spreads(result["runs"], "linattn")
    result["claims"] = {f"{alloc} {mode}": ratio_claim(f"{mode}, {alloc} malloc", "linattn", "performer-pytorch",
                                                       names["performer_pytorch"])
                        for alloc, modes in result["ratios"].items() for mode, names in modes.items()}
    return result


def format_speed(result: dict) -> str:
    cfg = result["config"]
    runs = result["runs"]
    lines = [
        f"# FAVOR+ speed: N = {cfg['n']}, B = 1, H = {cfg['heads']}, D = {cfg['head_dim']}, "
        f"m = {cfg['num_features'] if 'num_features' in cfg else cfg['m']}, float32, forward+backward",
        "",
        f"Written by `{result['command']}`; do not edit by hand. "
        f"torch {result['machine']['torch']}, {result['machine']['threads']} threads. "
        f"The whole timing ran {len(runs)} times, each run in a fresh process per allocator: glibc's "
        "default malloc, and the tuned settings `"
        + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC_ENV.items())
        + "` under which freed pages stay resident (what a long training job would use; "
        "performer-pytorch's causal path allocates about 0.7 GB per call and gains most from it). "
        f"Within a run, the median of {cfg['repeats']} interleaved repeats; each ratio is stated by its "
        "median over the runs, with min and max, each run's ratio from that run's own medians. "
        "Peak memory = peak RSS above the inputs in a fresh process per configuration, default malloc, "
        "measured once. performer-pytorch causal uses fast-transformers' CPU kernel (its fastest CPU path).",
        "",
        "## Claims",
        "",
        *[f"- {text}" for text in result["claims"].values()],
        "",
        "| allocator | mode | performer-pytorch / linattn: median | min | max | per run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for alloc, modes in result["ratios"].items():
        for mode, names in modes.items():
            lines.append(f"| {alloc} | {mode} | {format_spread_cells(names['performer_pytorch'])} |")
    lines += ["", "## Each run's machine", "", *format_run_loads([r["load"] for r in runs]), "",
              "## Times", "", *format_allocator_times(runs, result["peak_memory_bytes"])]
    return "\n".join(lines) + "\n"


def format_approx(result: dict) -> str:
    cfg = result["config"]
    ms = approx_num_features(cfg)
    lines = [
        f"# FAVOR+ approximation error vs softmax attention (N = {cfg['n']}, D = {cfg['head_dim']}, "
        f"{cfg['seeds']} seeds, float64)",
        "",
        f"Written by `{result['command']}`; do not edit by hand. Mean ± std of "
        "||favor - softmax|| / ||softmax||. Figure: favor_approx.png.",
        "",
        "| variant | " + " | ".join(f"m={m}" for m in ms) + " |",
        "| --- |" + " --- |" * len(ms),
    ]
    for var, per_m in result["summary"].items():
        cells = [f"{per_m[str(m)]['mean']:.4f} ± {per_m[str(m)]['std']:.4f}" for m in ms]
        lines.append(f"| {var} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


WHAT = ("approx", "speed")


def run_favor(
    *, out: str | Path = "docs/benchmarks", what: tuple[str, ...] = WHAT,
    num_features: tuple[int, ...] = APPROX_NUM_FEATURES, seeds: int = 20,
    attention: FavorConfig = FavorConfig(num_features=256), n: int = 4096, repeats: int = 7, runs: int = RUNS,
    quiet: bool = False,
) -> dict:
    """Run the parts in ``what`` and write their files to ``out``. Approximation: every number of
    features in ``num_features``, ``seeds`` seeds. Speed: ``attention`` (the FAVOR+ config compared
    with performer-pytorch) at ``n``, ``repeats`` interleaved calls per run, ``runs`` runs."""
    unknown = [w for w in what if w not in WHAT]
    if unknown:
        raise ValueError(f"run_favor: unknown part {unknown[0]!r}; the parts: {', '.join(WHAT)}")
    if not isinstance(attention, FavorConfig):
        raise TypeError(f"run_favor: attention must be a FavorConfig, got {type(attention).__name__}")
    if "approx" in what:  # its figure needs matplotlib: fail before any part runs
        require_extra("bench", command="linattn bench favor --what approx")
    if "speed" in what:  # nor run the approximation part first when the speed part cannot run
        if runs < 1:
            raise ValueError(f"run_favor: runs must be >= 1, got {runs}")
        _require_performer()
    out = output_folder(out)
    say = functools.partial(progress.say, quiet=quiet)
    results: dict = {}
    if "approx" in what:
        res = approximation_errors(num_features, seeds=seeds)
        res["command"] = (f"linattn bench favor --what approx --num-features {','.join(map(str, num_features))} "
                          f"--seeds {seeds} --out {out}")
        res["machine"] = machine_info()
        md = format_approx(res)
        write_atomically(out, {"favor_approx.json": json.dumps(res, indent=2), "favor_approx.md": md})
        plot_approximation(res, out / "favor_approx.png")
        results["approx"] = res
        say(md)
    if "speed" in what:
        say(f"linattn bench favor --what speed: N={n}, {config_label(attention)}, {runs} runs")
        options = "".join(f" --attention-{k.replace('_', '-')} {v}" for k, v in attention.to_dict().items()
                          if v != getattr(FavorConfig(), k))
        res = {
            "command": f"linattn bench favor --what speed --n {n}{options} --repeats {repeats}"
                       + (f" --runs {runs}" if runs != RUNS else "") + f" --out {out}",
            "machine": machine_info(),
            "config": {"n": n, "heads": 8, "head_dim": 64, "num_features": attention.num_features,
                       "attention": attention_config_to_dict(attention), "repeats": repeats, "runs": runs,
                       "dtype": "float32"},
            **speed_vs_performer(attention=attention, n=n, repeats=repeats, runs=runs, say=say),
        }
        md = format_speed(res)
        write_atomically(out, {"favor_speed.json": json.dumps(res, indent=2), "favor_speed.md": md})
        results["speed"] = res
        say(md)
    return results


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "child":
        torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
        attention = attention_config_from_dict(json.loads(sys.argv[6]))
        print(json.dumps({"times": _times_vs_performer(*(int(a) for a in sys.argv[2:6]), attention)}))
    else:
        raise SystemExit("usage: python -m linattn.bench.favor child N REPEATS HEADS HEAD_DIM ATTENTION_JSON")
