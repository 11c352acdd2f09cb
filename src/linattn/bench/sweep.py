"""`linattn bench sweep`: time and memory of every mechanism against N, beside softmax and the peers.

The contenders are attention configs (by default every mechanism of ``linattn.nn.registry``
with its registry defaults: a new registry entry is swept without a change here), each timed
through the module its spec builds (``harness.attention_fn``), plus the installed peers
(``harness.PEERS``). Which modes a contender runs in comes from its spec's forms.

For each mode (causal, bidirectional), pass (forward, forward+backward) and N in the grid, every
contender that supports the mode is timed (median of the repeats after a warm-up, contenders
interleaved A B A B at each N) and its peak memory is measured in a fresh subprocess (peak RSS
above the baseline on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU).

Budgets: before running a configuration, its time and memory are predicted from the contender's
two largest measured N in the same mode and pass (a power law through them, the exponent held
between 1 and 2); a configuration predicted to exceed ``time_budget_s`` per call or
``memory_budget_bytes`` is not run and is recorded as skipped with the prediction, never dropped.
A contender that fails (e.g. out of memory) is recorded as an error and the sweep goes on.

Writes sweep.json (machine, torch version, threads, every row), sweep.md (tables and the crossover
N where each mechanism overtakes softmax) and sweep_time.png / sweep_memory.png (log-log, with
reference slopes 1 and 2) atomically to the output folder.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, did_you_mean
from ..extras import require_extra
from ..nn.registry import (
    MECHANISMS,
    AttentionConfig,
    attention_config_from_dict,
    attention_config_to_dict,
    config_label,
)
from ..progress import progress_bar, say
from .harness import (
    PEERS,
    Case,
    OtherLoad,
    attention_fn,
    call,
    describe,
    describe_load,
    format_seconds,
    installed_peers,
    keep_peer_results,
    machine_info,
    make_inputs,
    median,
    peak_memory,
    supports,
    time_calls,
    output_folder,
    write_atomically,
)

__all__ = ["DEFAULT_NS", "MODES", "PASSES", "SweepConfig", "crossovers", "format_sweep", "plot_sweep", "run_sweep"]

DEFAULT_NS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PASSES = {"forward": False, "forward+backward": True}
MODES = {"causal": True, "bidirectional": False}
DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass(frozen=True)
class SweepConfig(Config):
    """What ``linattn bench sweep`` times.

    Attributes:
        mechanisms: the attention configs to time, each a contender labelled by its name and the
            options it sets (``config_label``); None means every registered mechanism with its
            registry defaults.
        peers: implementations from other projects to time beside them (names in
            ``harness.PEERS``); None means every installed one.
        ns: the sequence lengths N.
        passes: "forward" and/or "forward+backward".
        modes: "causal" and/or "bidirectional"; a contender without that form is marked, not run.
        batch_size: B.
        n_heads: H.
        head_dim: D = Dv.
        dtype: the inputs' dtype.
        device: "cpu", or a GPU such as "cuda".
        repeats: timed calls per configuration (their median is reported).
        time_budget_s: a configuration predicted to take longer per call is skipped and marked.
        memory_budget_bytes: a configuration predicted to need more peak memory is skipped and marked.
        measure_memory: measure each configuration's peak memory in a fresh process.
    """

    mechanisms: tuple[AttentionConfig, ...] | None = None
    peers: tuple[str, ...] | None = None
    ns: tuple[int, ...] = DEFAULT_NS
    passes: tuple[str, ...] = tuple(PASSES)
    modes: tuple[str, ...] = tuple(MODES)
    batch_size: int = 1
    n_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    time_budget_s: float = 20.0
    memory_budget_bytes: int = 8 * 2**30
    measure_memory: bool = True

    renamed = {"batch": "batch_size", "heads": "n_heads", "impls": "mechanisms"}

    def __post_init__(self) -> None:
        for name, values, known in (("passes", self.passes, PASSES), ("modes", self.modes, MODES),
                                    ("peers", self.peers or (), PEERS)):
            bad = [v for v in values if v not in known]
            if bad:
                raise ValueError(f"SweepConfig: unknown {name} {bad[0]!r}{did_you_mean(bad[0], known)}; "
                                 f"known: {', '.join(known)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"SweepConfig: unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if not self.ns or any(n < 1 for n in self.ns):
            raise ValueError(f"SweepConfig: ns must be positive sequence lengths, got {self.ns}")
        if self.repeats < 1:
            raise ValueError(f"SweepConfig: repeats must be >= 1, got {self.repeats}")
        labels = [config_label(c) for c in self.mechanisms or ()]
        if len(set(labels)) < len(labels):
            raise ValueError(f"SweepConfig: the same mechanism config twice in {labels}")

    def encode_field(self, name: str, value: Any) -> Any:
        if name == "mechanisms" and value is not None:
            return [attention_config_to_dict(c) for c in value]
        return super().encode_field(name, value)

    @classmethod
    def decode_field(cls, name: str, value: Any) -> Any:
        if name == "mechanisms" and value is not None:
            return tuple(attention_config_from_dict(c) for c in value)
        return tuple(value) if isinstance(value, list) else value

    def contenders(self) -> dict[str, AttentionConfig | None]:
        """``{label: attention config}`` of the mechanisms, then ``{peer: None}`` of the peers."""
        mechanisms = (self.mechanisms if self.mechanisms is not None
                      else tuple(spec.default_config() for spec in MECHANISMS.values()))
        out: dict[str, AttentionConfig | None] = {config_label(c): c for c in mechanisms}
        out.update({p: None for p in (self.peers if self.peers is not None else installed_peers())})
        return out


@dataclass
class _History:
    """Measured (N, seconds, bytes) of one contender in one mode and pass, for the predictions."""

    points: list[tuple[int, float, float | None]] = field(default_factory=list)

    def predict(self, n: int) -> tuple[float | None, float | None]:
        if not self.points:
            return None, None
        if len(self.points) == 1:
            n0, t0, m0 = self.points[0]
            return t0 * n / n0, None if m0 is None else m0 * n / n0
        (n0, t0, m0), (n1, t1, m1) = self.points[-2], self.points[-1]

        def extrapolate(y0: float, y1: float) -> float:
            if y0 <= 0 or y1 <= 0:
                return y1 * n / n1
            slope = min(2.0, max(1.0, math.log(y1 / y0) / math.log(n1 / n0)))
            return y1 * (n / n1) ** slope

        mem = None if m0 is None or m1 is None else extrapolate(max(m0, 1.0), max(m1, 1.0))
        return extrapolate(t0, t1), mem


def run_sweep(config: SweepConfig = SweepConfig(), *, out: str | Path = "report", command: str | None = None,
              quiet: bool = False, print_tables: bool = True) -> dict:
    """Run the sweep, write its files to ``out``, return the result (the content of sweep.json).

    A progress bar on standard error (on a terminal, and not ``quiet``) follows the (mode, pass, N)
    steps; the tables are printed at the end unless ``quiet`` or not ``print_tables``."""
    require_extra("bench", command="linattn bench sweep")
    output_folder(out)
    keep_peer_results(out, "sweep.json", command=command or "linattn bench sweep")
    contenders = config.contenders()
    rows: list[dict] = []
    history: dict[tuple[str, str, str], _History] = {}
    started = time.perf_counter()
    load = OtherLoad(reference=True)
    steps = [(mode, pass_name, n) for mode in config.modes for pass_name in config.passes for n in sorted(config.ns)]
    with progress_bar(len(steps), desc="sweep", unit="step", quiet=quiet) as bar:
        for mode, pass_name, n in steps:
            causal, backward = MODES[mode], PASSES[pass_name]
            cases, pending = {}, []
            for label, attention in contenders.items():
                row = {"impl": label, "mode": mode, "pass": pass_name, "n": n}
                case = Case(label, causal, n, batch_size=config.batch_size, n_heads=config.n_heads, head_dim=config.head_dim,
                            dtype=config.dtype, backward=backward, device=config.device, attention=attention)
                if not supports(case):
                    rows.append({**row, "status": "unsupported", "reason": f"{label} has no {mode} form"})
                    continue
                t_pred, m_pred = history.setdefault((label, mode, pass_name), _History()).predict(n)
                if t_pred is not None and t_pred > config.time_budget_s:
                    rows.append({**row, "status": "skipped",
                                 "reason": f"predicted {t_pred:.1f} s per call > budget {config.time_budget_s} s"})
                    continue
                if m_pred is not None and m_pred > config.memory_budget_bytes:
                    rows.append({**row, "status": "skipped",
                                 "reason": f"predicted {m_pred / 2**30:.1f} GiB > budget "
                                           f"{config.memory_budget_bytes / 2**30:.1f} GiB"})
                    continue
                cases[label] = case
                pending.append(row)
            bar.set_postfix_str(f"{mode} {pass_name} N={n}: {', '.join(cases) or 'nothing to run'}")
            rows.extend(_measure(config, cases, pending, history))
            bar.update()
    result = {
        "command": command or "linattn bench sweep",
        "machine": machine_info(),
        "config": config.to_dict(),
        "contenders": {label: describe(label, attention) for label, attention in contenders.items()},
        "attention": {label: attention_config_to_dict(a) for label, a in contenders.items() if a is not None},
        "rows": rows,
        "crossover": crossovers(rows),
        "seconds": time.perf_counter() - started,
        "load": load.finish(),
    }
    write_atomically(out, {"sweep.json": json.dumps(result, indent=2), "sweep.md": format_sweep(result)})
    plot_sweep(result, Path(out))
    say(format_sweep(result), quiet=quiet or not print_tables)
    return result


def _measure(config: SweepConfig, cases: dict[str, Case], rows: list[dict], history) -> list[dict]:
    """Time the cases interleaved (dropping any that fail), then measure their memory."""
    inputs, fns, out = {}, {}, {}
    for (label, case), row in zip(list(cases.items()), rows):
        try:
            fn = attention_fn(case)  # the module is built here, outside the timed calls
            inputs[label] = make_inputs(case)
            call(case, inputs[label], fn)  # a first call: fail here rather than inside the timing loop
            fns[label] = lambda c=case, x=inputs[label], f=fn: call(c, x, f)
            out[label] = row
        except (RuntimeError, ValueError, MemoryError) as e:
            out[label] = {**row, "status": "error", "reason": f"{type(e).__name__}: {str(e)[:300]}"}
            inputs.pop(label, None)
    times = time_calls(fns, repeats=config.repeats, warmup=0) if fns else {}
    inputs.clear()
    fns.clear()
    for label, ts in times.items():
        row = {**out[label], "status": "ok", "median_s": median(ts), "all_s": ts, "peak_memory_bytes": None}
        if config.measure_memory:
            try:
                row["peak_memory_bytes"] = peak_memory(cases[label])
            except (RuntimeError, OSError) as e:
                row["memory_error"] = str(e)[-300:]
        history[(label, row["mode"], row["pass"])].points.append((row["n"], row["median_s"], row["peak_memory_bytes"]))
        out[label] = row
    return list(out.values())


def crossovers(rows: list[dict]) -> dict[str, dict[str, str | int]]:
    """Per (mode, pass) and contender: the smallest measured N from which it is faster than softmax
    at every larger N where both were measured ("always", "never", or "n/a" without data)."""
    result: dict[str, dict[str, str | int]] = {}
    ok = [r for r in rows if r["status"] == "ok"]
    for key in sorted({(r["mode"], r["pass"]) for r in ok}):
        soft = {r["n"]: r["median_s"] for r in ok if (r["mode"], r["pass"]) == key and r["impl"] == "softmax"}
        per: dict[str, str | int] = {}
        for impl in sorted({r["impl"] for r in ok if (r["mode"], r["pass"]) == key} - {"softmax"}):
            mine = {r["n"]: r["median_s"] for r in ok if (r["mode"], r["pass"]) == key and r["impl"] == impl}
            common = sorted(set(mine) & set(soft))
            if not common:
                per[impl] = "n/a"
                continue
            faster = [mine[n] < soft[n] for n in common]
            if all(faster):
                per[impl] = "always"
            elif not faster[-1]:
                per[impl] = "never"
            else:
                first = max(i for i, f in enumerate(faster) if not f) + 1
                per[impl] = common[first]
        result[f"{key[0]} {key[1]}"] = per
    return result


def format_sweep(result: dict) -> str:
    cfg, m = result["config"], result["machine"]
    lines = [
        f"# Sweep: B = {cfg.get('batch_size', cfg.get('batch'))}, H = {cfg.get('n_heads', cfg.get('heads'))}, D = {cfg['head_dim']}, {cfg['dtype']}, {cfg['device']}",
        "",
        f"Written by `{result['command']}`; do not edit by hand. torch {m['torch']}, {m['threads']} threads, "
        f"{m['cpu_count']} CPUs. Median of {cfg['repeats']} interleaved repeats; memory = peak above the "
        "baseline in a fresh process. `skip` = predicted over budget (see the JSON for the prediction), "
        "`err` = failed, `-` = no such form. " + describe_load(result.get("load")),
        "",
    ]
    ns = sorted({r["n"] for r in result["rows"]})
    impls = list(result["contenders"])
    for mode in cfg["modes"]:
        for pass_name in cfg["passes"]:
            lines += [f"## {mode}, {pass_name}", "", "| contender | " + " | ".join(f"N={n}" for n in ns) + " |",
                      "| --- |" + " --- |" * len(ns)]
            for impl in impls:
                cells = []
                for n in ns:
                    r = next((r for r in result["rows"] if (r["impl"], r["mode"], r["pass"], r["n"]) ==
                              (impl, mode, pass_name, n)), None)
                    if r is None or r["status"] == "unsupported":
                        cells.append("-")
                    elif r["status"] == "ok":
                        mem = r.get("peak_memory_bytes")
                        cells.append(format_seconds(r["median_s"]) + ("" if mem is None else f" / {mem / 2**20:.0f} MiB"))
                    else:
                        cells.append("skip" if r["status"] == "skipped" else "err")
                lines.append(f"| {impl} | " + " | ".join(cells) + " |")
            lines.append("")
    others = [i for i in impls if i != "softmax"]
    if len(others) == len(impls):  # no softmax among the contenders: nothing to overtake
        return "\n".join(lines) + "\n"
    lines += ["## Where each contender overtakes softmax", "",
              "Smallest N from which it is faster than softmax at every larger measured N.", "",
              "| mode, pass | " + " | ".join(others) + " |",
              "| --- |" + " --- |" * len(others)]
    for key, per in result["crossover"].items():
        lines.append(f"| {key} | " + " | ".join(str(per.get(i, "-")) for i in others) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(result: dict, out_dir: Path) -> None:
    """sweep_time.png and sweep_memory.png: one panel per (mode, pass), log-log, with slopes 1 and 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    keys = [(mode, p) for mode in cfg["modes"] for p in cfg["passes"]]
    for what, field_name, unit, scale in (("time", "median_s", "seconds", 1.0),
                                          ("memory", "peak_memory_bytes", "MiB", 2**20)):
        fig, axes = plt.subplots(1, len(keys), figsize=(4.8 * len(keys), 4.2), squeeze=False)
        for ax, (mode, p) in zip(axes[0], keys):
            anchor = None
            for idx, impl in enumerate(result["contenders"]):  # one colour per contender in every panel
                pts = [(r["n"], r[field_name] / scale) for r in result["rows"]
                       if (r["impl"], r["mode"], r["pass"]) == (impl, mode, p) and r["status"] == "ok"
                       and r.get(field_name) is not None and r[field_name] > 0]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{idx % 10}", label=impl)
                    anchor = anchor or pts[0]
            if anchor:
                n0, y0 = anchor
                ns = sorted({r["n"] for r in result["rows"]})
                for slope, style in ((1, ":"), (2, "--")):
                    ax.plot(ns, [y0 * (n / n0) ** slope for n in ns], "k" + style, lw=0.8, label=f"slope {slope}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{mode}, {p}")
            ax.set_xlabel("N")
            ax.set_ylabel(unit)
            ax.grid(True, which="both", alpha=0.3)
        if axes[0][-1].get_legend_handles_labels()[1]:  # nothing to label when no memory was measured
            axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        tmp = out_dir / f"sweep_{what}.tmp.png"
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(out_dir / f"sweep_{what}.png")
