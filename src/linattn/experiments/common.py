"""What every experiment shares: typed configs with presets and ``key=value`` overrides, the run
folder, one training loop for a contender, measurements (time, tokens/s, peak RSS, other load) and
plots.

Dimension legend: B batch, N sequence length, V vocabulary size.

A run folder ``runs/NAME/`` (or ``out=...``) holds ``config.json``, ``metrics_<contender>.jsonl``
(one record per logged step), ``summary.json`` (the numbers ``linattn experiment report`` puts in
docs/results.md) and the PNG plots. Every contender of an experiment trains the same model size for
the same steps, batch, learning rate schedule and seed; only the attention mechanism differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F

from ..bench.harness import OtherLoad, _vm_kib, machine_info, write_atomically
from ..extras import require_extra
from ..models import TransformerConfig, TransformerLM, count_parameters
from ..nn import FavorConfig, LinearConfig, LSHConfig, SoftmaxConfig
from ..train.loop import _param_groups, lr_at

__all__ = [
    "ExperimentConfig",
    "PeakRSS",
    "RunFolder",
    "attention_for",
    "masked_cross_entropy",
    "parse_overrides",
    "plot_curves",
    "read_metrics",
    "train_contender",
]

LN2 = math.log(2)


@dataclass(frozen=True)
class ExperimentConfig:
    """Fields every experiment has; each experiment subclasses it and adds its own.

    Attributes:
        contenders: attention mechanisms to train, names from :func:`attention_for`.
        d_model, n_layers, n_heads, d_ff: the model size, the same for every contender.
        short_conv: K > 0 gives every contender's attention layers the same causal depthwise
            convolution of kernel size K over their input (``TransformerConfig.short_conv``); 0 = none.
        steps: optimiser steps per contender.
        batch_size: sequences per step.
        lr: peak learning rate of AdamW (linear warm-up over ``warmup_steps``, cosine down to
            ``lr * min_lr_ratio`` at ``steps``; :func:`linattn.train.lr_at`).
        weight_decay: AdamW's, on matrices and embeddings only.
        grad_clip: clip the gradient's global norm to this.
        favor_features: m, random features of the FAVOR contenders.
        seed: seeds the model initialisation and the data order (same for every contender).
        threads: torch threads (1 leaves a core to others on a shared 2-core machine).
        log_every: record the mean training loss every this many steps.
        out: the run folder; empty means ``runs/<experiment name>``.
    """

    contenders: tuple[str, ...] = ("softmax", "linear")
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    short_conv: int = 0
    steps: int = 100
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    favor_features: int = 64
    seed: int = 0
    threads: int = 1
    log_every: int = 10
    out: str = ""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(val, bool) or not isinstance(val, int)):
                raise TypeError(f"{name}: {f.name} must be an int, got {val!r}")
            if f.type in ("float", float) and (isinstance(val, bool) or not isinstance(val, (int, float))):
                raise TypeError(f"{name}: {f.name} must be a number, got {val!r}")
        for key in ("d_model", "n_layers", "n_heads", "d_ff", "steps", "batch_size", "favor_features",
                    "threads", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: {key} must be >= 1, got {getattr(self, key)!r}")
        if self.short_conv < 0:
            raise ValueError(f"{name}: short_conv must be >= 0 (0 = none), got {self.short_conv!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"{name}: warmup_steps must be in [0, steps = {self.steps}), got {self.warmup_steps}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{name}: lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if not self.contenders or not all(isinstance(c, str) for c in self.contenders):
            raise ValueError(f"{name}: contenders must be a non-empty list of names, got {self.contenders!r}")
        object.__setattr__(self, "contenders", tuple(self.contenders))
        for c in self.contenders:
            attention_for(c, self)  # raises for unknown names

    @property
    def schedule_steps(self) -> int:
        """The step where the cosine ends (what :func:`linattn.train.lr_at` reads)."""
        return self.steps

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["contenders"] = list(self.contenders)
        return d

    def model_config(self, contender: str, *, vocab_size: int, max_len: int) -> TransformerConfig:
        attention, layer_attention = attention_for(contender, self)
        return TransformerConfig(vocab_size=vocab_size, max_len=max_len, d_model=self.d_model,
                                 n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                                 attention=attention, layer_attention=layer_attention, short_conv=self.short_conv)


def attention_for(contender: str, config: ExperimentConfig) -> tuple[Any, dict]:
    """``(attention config, per-layer overrides)`` of a contender name.

    ``hybrid`` is linear attention with softmax in the last layer (arXiv 2006.16236 leaves mixing
    to future work; the last layer is where sharp, content-based lookups matter most for an LM).
    """
    m = config.favor_features
    table = {
        "softmax": (SoftmaxConfig(), {}),
        "linear": (LinearConfig(), {}),
        "favor": (FavorConfig(num_features=m), {}),
        "favor-relu": (FavorConfig(num_features=m, kernel="relu"), {}),
        "lsh": (LSHConfig(n_hashes=4, bucket_size=32), {}),
        "hybrid": (LinearConfig(), {config.n_layers - 1: SoftmaxConfig()}),
    }
    if contender not in table:
        raise ValueError(f"unknown contender {contender!r}; known: {sorted(table)}")
    return table[contender]


def _field_types(cls) -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(cls)}


def parse_overrides(base: ExperimentConfig, overrides: Iterable[str]) -> ExperimentConfig:
    """``base`` with every ``key=value`` applied: a number, ``true``/``false``, a string, or for
    ``contenders`` a comma-separated list. Unknown keys and values of the wrong type raise
    ValueError naming the key and the known keys."""
    cls = type(base)
    types = _field_types(cls)
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. steps=200)")
        if key not in types:
            raise ValueError(f"unknown key {key!r} for {cls.__name__}; known: {sorted(types)}")
        kind = types[key]
        try:
            if key == "contenders":
                val: Any = tuple(x for x in raw.split(",") if x)
            elif kind == "int":
                val = int(raw)
            elif kind == "float":
                val = float(raw)
            elif kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                val = raw.lower() in ("true", "1")
            else:
                val = raw
        except ValueError:
            raise ValueError(f"override {key}={raw!r}: {key} must be {'an' if kind == 'int' else 'a'} {kind}") from None
        changes[key] = val
    return dataclasses.replace(base, **changes)


class RunFolder:
    """``runs/NAME/``: config.json, metrics_<contender>.jsonl, summary.json and plots, written atomically."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, obj: Any) -> Path:
        write_atomically(self.path, {name: json.dumps(obj, indent=2) + "\n"})
        return self.path / name

    def metrics_path(self, contender: str) -> Path:
        return self.path / f"metrics_{contender}.jsonl"

    def start_metrics(self, contender: str) -> Path:
        path = self.metrics_path(contender)
        path.write_text("")
        return path


class PeakRSS:
    """Peak resident memory above the level at :meth:`start`, from ``/proc/self`` (Linux).

    Writing 5 to ``/proc/self/clear_refs`` resets the high-water mark VmHWM to the current RSS, so
    each contender's peak is its own even though they share a process; what the allocator kept
    from an earlier contender is in the baseline and not counted again.
    """

    def start(self) -> None:
        self.base_kib = _vm_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def peak_bytes(self) -> int:
        return max(0, _vm_kib("VmHWM") - self.base_kib) * 1024


def masked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None,
                         *, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in nats of ``logits (B, N, V)`` against ``targets (B, N)``, over the positions
    where ``mask (B, N)`` is True (None: all). ``reduction="sum"`` returns the sum (for exact means
    over many batches)."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")  # (B*N,)
    if mask is not None:
        loss = loss[mask.flatten()]
    return loss.sum() if reduction == "sum" else loss.mean()


Batch = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def train_contender(
    contender: str,
    model_config: TransformerConfig,
    config: ExperimentConfig,
    batches: Callable[[int], Batch],
    run: RunFolder,
    *,
    evaluate: Callable[[TransformerLM], dict[str, float]] | None = None,
    eval_every: int = 0,
    say: Callable[..., None] = print,
) -> tuple[TransformerLM, dict[str, Any]]:
    """Train one contender and return ``(model in eval mode, record)``.

    ``batches(step)`` returns ``(ids (B, N), targets (B, N), mask (B, N) or None)`` for a step; it
    must depend on the step only, so every contender sees the same data. ``evaluate(model)`` (on
    held-out data, in eval mode, no grad) runs every ``eval_every`` steps (0: only at the end) and
    its numbers are logged and returned under ``"eval"``. The record holds the parameter count,
    wall time of training, tokens/s, peak RSS above the baseline, the final training loss and the
    load other processes put on the machine.
    """
    torch.manual_seed(config.seed)
    model = TransformerLM(model_config)
    opt = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    metrics = run.start_metrics(contender)
    rss, load = PeakRSS(), OtherLoad()
    rss.start()
    losses: list[float] = []
    tokens, train_s, t0 = 0, 0.0, time.perf_counter()
    last: dict[str, Any] = {}
    with metrics.open("a") as fh:
        for step in range(config.steps):
            ids, targets, mask = batches(step)
            model.train()
            t_step = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = lr_at(config, step)  # duck-typed: lr, warmup_steps, schedule_steps, min_lr_ratio
            loss = masked_cross_entropy(model(ids), targets, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            train_s += time.perf_counter() - t_step
            tokens += ids.numel()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                say(f"  {contender}: loss is {losses[-1]} at step {step}; stopping this contender")
                break
            done = step + 1
            if done % config.log_every == 0 or done == config.steps:
                rec: dict[str, Any] = {"step": done, "loss": sum(losses[-config.log_every:]) / len(losses[-config.log_every:]),
                                       "lr": lr_at(config, step), "elapsed_s": time.perf_counter() - t0}
                if evaluate is not None and eval_every and done % eval_every == 0 and done != config.steps:
                    model.eval()
                    with torch.no_grad():
                        rec["eval"] = evaluate(model)
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
                last = rec
                if done % (config.log_every * 10) == 0 or done == config.steps:
                    say(f"  {contender} step {done}/{config.steps}: loss {rec['loss']:.4f} "
                        f"({rec['elapsed_s']:.0f} s)")
        model.eval()
        final_eval: dict[str, float] = {}
        if evaluate is not None:
            with torch.no_grad():
                final_eval = evaluate(model)
            fh.write(json.dumps({"step": len(losses), "final": True, "eval": final_eval,
                                 "elapsed_s": time.perf_counter() - t0}) + "\n")
    record = {
        "contender": contender,
        "attention": model_config.to_dict()["attention"],
        "layer_attention": model_config.to_dict()["layer_attention"],
        "parameters": count_parameters(model),
        "steps_done": len(losses),
        "diverged": len(losses) < config.steps or not math.isfinite(losses[-1]),
        "first_loss": losses[0],
        "final_train_loss": last.get("loss", losses[-1]),
        "train_seconds": train_s,
        "tokens_per_second": tokens / train_s if train_s > 0 else None,
        "peak_rss_bytes": rss.peak_bytes(),
        "eval": final_eval,
        "wall_seconds": time.perf_counter() - t0,
        "load": load.finish(),
    }
    return model, record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(run: RunFolder, contenders: Iterable[str], *, title: str, ylabel: str = "training loss (nats)",
                key: str = "loss", name: str = "loss.png", log_y: bool = False) -> Path:
    """One line per contender from its metrics file: ``key`` against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for c in contenders:
        recs = [r for r in read_metrics(run.metrics_path(c)) if key in r]
        ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=c)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run.path / name
    tmp = run.path / (name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def start_run(name: str, config: ExperimentConfig, *, quick: bool, command: str) -> tuple[RunFolder, OtherLoad, float]:
    """Set the thread count, create the run folder and write config.json; return the folder, the
    whole run's load meter and its start time. Every experiment plots its curves at the end: the
    plotting library is checked first, before the folder exists or any training starts."""
    require_extra("experiments", command=f"linattn experiment {name}")
    torch.set_num_threads(config.threads)
    run = RunFolder(config.out or f"runs/{name}")
    run.write_json("config.json", {"experiment": name, "quick": quick, "command": command,
                                   "config": config.to_dict(), "machine": machine_info()})
    return run, OtherLoad(), time.perf_counter()


def finish_run(run: RunFolder, name: str, config: ExperimentConfig, *, quick: bool, command: str,
               load: OtherLoad, t0: float, results: Mapping[str, Any], line: str,
               say: Callable[..., None] = print) -> dict[str, Any]:
    """Write summary.json (command, config, machine, per-experiment results, wall time, other
    load) and print the summary line."""
    summary = {"experiment": name, "quick": quick, "command": command, "config": config.to_dict(),
               "machine": machine_info(), **results, "wall_seconds": time.perf_counter() - t0,
               "load": load.finish(), "summary_line": line}
    run.write_json("summary.json", summary)
    share = summary["load"].get("other_cpu_share")
    say(f"{line} (wall {summary['wall_seconds']:.0f} s, other load "
        f"{'n/a' if share is None else f'{share:.0%}'}) -> {run.path}")
    return summary
