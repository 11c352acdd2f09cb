"""What every experiment shares: typed configs (their mechanisms from the registry), the run
folder, the training of one mechanism, measurements (time, tokens/s, peak RSS, other load) and plots.

Dimension legend: B batch, N sequence length, V vocabulary size.

A run folder ``runs/NAME/`` (or ``--out DIR``) holds ``config.json``, ``metrics_<label>.jsonl``
(one record per logged step), ``summary.json`` (the numbers ``linattn experiment report`` puts in
docs/results.md) and the PNG plots. Every mechanism of an experiment trains the same model size for
the same steps, batch, learning rate schedule and seed; only the attention differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
import torch.nn.functional as F

from ..bench.harness import OtherLoad, machine_info, proc_status_kib, write_atomically
from ..config import Config, apply_overrides
from ..extras import require_extra
from ..models import TransformerConfig, TransformerLM, count_parameters
from ..nn.registry import (
    MECHANISMS,
    AttentionConfig,
    attention_config,
    attention_config_from_dict,
    attention_config_to_dict,
    config_label,
    parse_mechanisms,
    spec_for,
)
from ..progress import say as print_line
from ..train.loop import CosineSchedule, MetricsLog, TrainingLoop, decay_groups

__all__ = [
    "CannotRunError",
    "ExperimentConfig",
    "HYBRID_SUFFIX",
    "PeakRSS",
    "RunFolder",
    "as_mechanisms",
    "masked_cross_entropy",
    "mechanism_labels",
    "metrics_file_name",
    "plot_curves",
    "read_metrics",
    "run_path",
    "train_mechanism",
]

LN2 = math.log(2)

# the label of a hybrid layout: its mechanism in every layer but the last, softmax in the last
HYBRID_SUFFIX = "+softmax@-1"


def as_mechanisms(value: Any, field: str = "mechanisms") -> tuple[AttentionConfig, ...]:
    """Attention configs from any form a config file or override gives: a tuple of configs, a list
    of registered names and ``{"name": ..., **options}`` dicts, or the command-line text (names
    separated by commas, or a JSON list). ValueError naming ``field`` and what exists otherwise."""
    try:
        if isinstance(value, str):
            return parse_mechanisms(value) if value.strip() else ()
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list of mechanisms, got {type(value).__name__}")
        out = []
        for item in value:
            if isinstance(item, str):
                item = attention_config(item)
            elif isinstance(item, Mapping):
                item = attention_config_from_dict(dict(item))
            spec_for(item)  # TypeError for anything that is not an attention config
            out.append(item)
        return tuple(out)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{field}: {e}") from None


def mechanism_labels(configs: Iterable[AttentionConfig]) -> list[str]:
    """The label of each config: its :func:`linattn.nn.registry.config_label` without the options
    that every config of the same mechanism in ``configs`` shares. Default configs keep their plain
    names (``"softmax"``, ``"linear"``); a lone FAVOR with 64 features is ``"favor"`` (config.json
    holds every option); beside it, a ReLU-kernel FAVOR is ``"favor kernel=relu"``."""
    words = [config_label(c).split(" ") for c in configs]
    out = []
    for name, *options in words:
        shared = set.intersection(*(set(w[1:]) for w in words if w[0] == name))
        out.append(" ".join([name, *(o for o in options if o not in shared)]))
    return out


def metrics_file_name(label: str) -> str:
    """``metrics_<label>.jsonl``, spaces in the label written as underscores."""
    return f"metrics_{label.replace(' ', '_')}.jsonl"


class CannotRunError(ValueError):
    """A run of an experiment cannot start with its config (:meth:`ExperimentConfig.check_runs`):
    found before any run trains, so ``linattn experiment`` reports it in one line."""


@dataclass(frozen=True)
class ExperimentConfig(Config):
    """Fields every experiment has; each experiment subclasses it, adds its own and sets the
    defaults of its full run (``--quick`` applies the class's ``quick_settings`` on top).

    Attributes:
        mechanisms: the attention mechanisms to train, each in every layer: registered names or
            configs (``{"name": "favor", "num_features": 64}``). Their labels in file names and
            tables are the registry's labels, with the options every same-named entry shares left out.
        hybrids: mechanisms trained once more with softmax attention in the last layer, labelled
            ``<mechanism>+softmax@-1`` (arXiv 2006.16236 leaves mixing to future work; the last layer
            is where sharp, content-based lookups matter most for a language model). Empty: none.
        d_model: the model width, the same for every mechanism.
        n_layers: transformer blocks.
        n_heads: attention heads; must divide d_model.
        d_ff: hidden width of each block's MLP; 0 = attention-only blocks, no MLP.
        short_conv: K > 0 gives every mechanism's attention layers the same causal depthwise
            convolution of kernel size K over their input (``TransformerConfig.short_conv``); 0 = none.
        steps: optimiser steps per mechanism.
        batch_size: sequences per step.
        lr: peak learning rate of AdamW (betas 0.9, 0.98).
        warmup_steps: linear warm-up of the learning rate over this many steps.
        min_lr_ratio: the cosine after the warm-up ends at ``lr * min_lr_ratio`` at the last step.
        weight_decay: AdamW's, on matrices and embeddings only.
        grad_clip: clip the gradient's global norm to this.
        seed: seeds the model initialisation and the data order (the same for every mechanism).
        threads: torch threads (1 leaves a core to others on a shared 2-core machine).
        log_every: record the mean training loss every this many steps.
        out: the run folder; empty means runs/NAME.
    """

    # old names, so that an old config.json or override is refused with the new one in the message
    renamed: ClassVar[dict[str, str]] = {
        "contenders": "mechanisms",
        "favor_features": "num_features (an option of each favor entry of mechanisms)",
    }
    # the changes --quick makes to a class's defaults: tiny settings that finish in about a minute
    quick_settings: ClassVar[dict[str, Any]] = {}
    # shared fields an experiment sets itself, from its own fields, in every run it trains (MQAR's grid
    # sets d_model from widths): {field: the field that sets it}. Such a field is no setting of the
    # experiment: giving it (a flag, --set, a config file) is refused naming the field to use instead,
    # and to_dict leaves it out, so config.json never shows a value that no run used.
    replaced_by: ClassVar[dict[str, str]] = {}

    mechanisms: tuple[AttentionConfig, ...] = (attention_config("softmax"), attention_config("linear"))
    hybrids: tuple[AttentionConfig, ...] = ()
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
    seed: int = 0
    threads: int = 1
    log_every: int = 10
    out: str = ""

    def __post_init__(self) -> None:
        name = type(self).__name__
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key in self.replaced_by:
            if getattr(self, key) != defaults[key]:
                raise ValueError(self._replaced_message(key))
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(val, bool) or not isinstance(val, int)):
                raise TypeError(f"{name}: {f.name} must be an int, got {val!r}")
            if f.type in ("float", float) and (isinstance(val, bool) or not isinstance(val, (int, float))):
                raise TypeError(f"{name}: {f.name} must be a number, got {val!r}")
            if f.type in ("bool", bool) and not isinstance(val, bool):
                raise TypeError(f"{name}: {f.name} must be true or false, got {val!r}")
            if f.type in ("str", str) and not isinstance(val, str):
                raise TypeError(f"{name}: {f.name} must be a string, got {val!r}")
        for key in ("d_model", "n_layers", "n_heads", "steps", "batch_size", "threads", "log_every"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: {key} must be >= 1, got {getattr(self, key)!r}")
        if self.d_ff < 0:
            raise ValueError(f"{name}: d_ff must be >= 0 (0 = no MLP), got {self.d_ff!r}")
        if self.short_conv < 0:
            raise ValueError(f"{name}: short_conv must be >= 0 (0 = none), got {self.short_conv!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"{name}: warmup_steps must be in [0, steps = {self.steps}), got {self.warmup_steps}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"{name}: lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        for key in ("mechanisms", "hybrids"):
            try:
                configs = as_mechanisms(getattr(self, key), key)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{name}: {e}") from None
            for c in configs:
                spec = spec_for(c)
                if not spec.causal:  # every experiment trains a causal language model
                    raise ValueError(f"{name}: {key}: {spec.name!r} attention has no causal form; causal ones: "
                                     f"{self.causal_names()}")
            object.__setattr__(self, key, configs)
        if not self.mechanisms:
            raise ValueError(f"{name}: mechanisms must name at least one mechanism")
        labels = self.labels
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"{name}: mechanisms and hybrids give {twice} twice")

    def check_runs(self) -> None:
        """Raise :class:`CannotRunError` naming the run when a model the experiment would train
        cannot take its inputs; :func:`start_run` calls it before the run folder exists (an
        experiment that finds out mid-way loses the runs before). Here: nothing beyond the fields'
        own checks; an experiment whose runs vary their models or lengths overrides it."""

    @classmethod
    def _replaced_message(cls, key: str) -> str:
        by = cls.replaced_by[key]
        return (f"{cls.__name__}: {key} (--{key.replace('_', '-')}) is not a setting of this experiment: every run "
                f"sets it from {by}; use --{by.replace('_', '-')}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """:meth:`Config.from_dict`, refusing the fields of :attr:`replaced_by` by name."""
        for key in cls.replaced_by:
            if isinstance(d, Mapping) and key in d:
                raise ValueError(cls._replaced_message(key))
        return super().from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """:meth:`Config.to_dict` without the fields of :attr:`replaced_by`."""
        return {k: v for k, v in super().to_dict().items() if k not in self.replaced_by}

    @staticmethod
    def causal_names() -> list[str]:
        """The registered mechanisms an experiment can train (those with a causal form)."""
        return [n for n, s in MECHANISMS.items() if s.causal]

    @classmethod
    def preset(cls, quick: bool = False):
        """The full run's config, or with ``quick`` its tiny settings."""
        return cls.from_dict({**cls().to_dict(), **(cls.quick_settings if quick else {})})

    @classmethod
    def resolve(cls, *, quick: bool = False, mechanisms: Iterable[AttentionConfig] | None = None,
                overrides: Iterable[str] = ()):
        """The preset with ``mechanisms`` (when given) and the ``dotted.key=value`` overrides applied
        through the dict form (:func:`linattn.config.apply_overrides`), then validated by
        :meth:`from_dict`: unknown keys are refused naming the closest field."""
        d = cls.preset(quick).to_dict()
        if mechanisms is not None:
            d["mechanisms"] = [attention_config_to_dict(c) for c in mechanisms]
        return cls.from_dict(apply_overrides(d, overrides, str_fields=cls.str_fields()))

    def encode_field(self, name: str, value: Any) -> Any:
        """``mechanisms`` and ``hybrids`` as lists of registry dicts ``{"name": ..., **options}``."""
        if name in ("mechanisms", "hybrids"):
            return [attention_config_to_dict(c) for c in value]
        return super().encode_field(name, value)

    @property
    def labels(self) -> list[str]:
        """The label of every model trained: the mechanisms', then the hybrids'."""
        return [*mechanism_labels(self.mechanisms),
                *(label + HYBRID_SUFFIX for label in mechanism_labels(self.hybrids))]

    def layouts(self) -> dict[str, tuple[AttentionConfig, dict[int, AttentionConfig]]]:
        """``{label: (attention of every layer, per-layer overrides)}`` of every model trained."""
        last = {self.n_layers - 1: attention_config("softmax")}
        pairs = [(c, {}) for c in self.mechanisms] + [(c, last) for c in self.hybrids]
        return dict(zip(self.labels, pairs))

    def model_config(self, label: str, *, vocab_size: int, max_len: int) -> TransformerConfig:
        """The model of the mechanism labelled ``label`` (one of :attr:`labels`)."""
        attention, layer_attention = self.layouts()[label]
        return TransformerConfig(vocab_size=vocab_size, max_len=max_len, d_model=self.d_model,
                                 n_layers=self.n_layers, n_heads=self.n_heads, d_ff=self.d_ff,
                                 attention=attention, layer_attention=layer_attention, short_conv=self.short_conv)


class RunFolder:
    """``runs/NAME/``: config.json, metrics_<label>.jsonl, summary.json and plots, written atomically."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, obj: Any) -> Path:
        write_atomically(self.path, {name: json.dumps(obj, indent=2) + "\n"})
        return self.path / name

    def metrics_path(self, label: str) -> Path:
        return self.path / metrics_file_name(label)

    def start_metrics(self, label: str) -> Path:
        path = self.metrics_path(label)
        path.write_text("")
        return path


class PeakRSS:
    """Peak resident memory above the level at :meth:`start`, from ``/proc/self`` (Linux).

    Writing 5 to ``/proc/self/clear_refs`` resets the high-water mark VmHWM to the current RSS, so
    each mechanism's peak is its own even though they share a process; what the allocator kept
    from an earlier mechanism is in the baseline and not counted again.
    """

    def start(self) -> None:
        self.base_kib = proc_status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass

    def peak_bytes(self) -> int:
        return max(0, proc_status_kib("VmHWM") - self.base_kib) * 1024


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


def train_mechanism(
    label: str,
    model_config: TransformerConfig,
    config: ExperimentConfig,
    batches: Callable[[int], Batch],
    run: RunFolder,
    *,
    evaluate: Callable[[TransformerLM], dict[str, float]] | None = None,
    eval_every: int = 0,
    say: Callable[..., None] = print_line,
    quiet: bool = False,
) -> tuple[TransformerLM, dict[str, Any]]:
    """Train the model of one mechanism on :class:`linattn.train.TrainingLoop` and return
    ``(model in eval mode, record)``.

    ``batches(step)`` returns ``(ids (B, N), targets (B, N), mask (B, N) or None)`` for a step; it
    must depend on the step only, so every mechanism sees the same data. ``evaluate(model)`` (on
    held-out data, in eval mode, no grad) runs every ``eval_every`` steps (0: only at the end);
    its numbers go to the metrics file and the record's ``"eval"`` holds the last. The record also
    holds the parameter count, training time (forward, backward and optimiser steps only), tokens/s,
    peak RSS above the baseline, the final training loss and the load other processes put on the
    machine. Progress is the loop's bar; ``quiet`` hides it.
    """
    torch.manual_seed(config.seed)
    model = TransformerLM(model_config)
    opt = torch.optim.AdamW(decay_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    rss, load = PeakRSS(), OtherLoad()
    rss.start()
    t0 = time.perf_counter()
    current: dict[str, Batch] = {}
    losses: list[float] = []
    tokens = 0

    def fetch(step: int) -> None:  # outside the loop's timed part: data is not training time
        nonlocal tokens
        current["batch"] = batches(step)
        tokens += current["batch"][0].numel()

    def micro_loss(step: int, a: int) -> torch.Tensor:
        ids, targets, mask = current["batch"]
        model.train()
        return masked_cross_entropy(model(ids), targets, mask)

    def held_out(step: int) -> dict[str, float]:
        model.eval()
        with torch.no_grad():
            return evaluate(model)

    with MetricsLog(run.metrics_path(label), fresh=True) as metrics:
        loop = TrainingLoop(
            opt, params=model.parameters(), grad_clip=config.grad_clip, max_steps=config.steps,
            schedule=CosineSchedule(config.lr, config.warmup_steps, config.steps, config.min_lr_ratio),
            log_every=config.log_every, window_loss=True, metrics=metrics,
            eval_every=eval_every if evaluate is not None else 0, evaluate=None if evaluate is None else held_out,
            stop_on_nonfinite=True, before_step=fetch, on_step=lambda step, rec: losses.append(rec["loss"]),
            handle_signals=False,  # Ctrl-C ends the whole experiment, as it always has
            tokens_per_step=batches(0)[0].numel(), desc=label, quiet=quiet)
        result = loop.run(micro_loss)
        final_eval = result.last_eval or {}
        if result.diverged:
            say(f"  {label}: loss is {losses[-1]} at step {result.step - 1}; stopping this mechanism")
            if evaluate is not None:  # the diverged model is still measured, so its row has numbers
                final_eval = held_out(result.step)
                metrics.write({"kind": "eval", "step": result.step, **final_eval})
    model.eval()
    return model, {
        "label": label,
        "attention": model_config.to_dict()["attention"],
        "layer_attention": model_config.to_dict()["layer_attention"],
        "parameters": count_parameters(model),
        "steps_done": result.step,
        "diverged": result.diverged or result.step < config.steps,
        "first_loss": losses[0],
        "final_train_loss": losses[-1] if result.last_loss is None else result.last_loss,
        "train_seconds": result.elapsed_s,
        "tokens_per_second": tokens / result.elapsed_s if result.elapsed_s > 0 else None,
        "peak_rss_bytes": rss.peak_bytes(),
        "eval": final_eval,
        "wall_seconds": time.perf_counter() - t0,
        "load": load.finish(),
    }


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(run: RunFolder, labels: Iterable[str], *, title: str, ylabel: str = "training loss (nats)",
                key: str = "loss", name: str = "loss.png", log_y: bool = False) -> Path:
    """One line per mechanism from its metrics file: ``key`` against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label in labels:
        recs = [r for r in read_metrics(run.metrics_path(label)) if key in r]
        ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=label)
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


def run_path(name: str, config: ExperimentConfig) -> str:
    """The run folder of experiment ``name``: ``config.out``, or runs/NAME when it is empty."""
    return config.out or f"runs/{name}"


def start_run(name: str, config: ExperimentConfig, *, quick: bool, command: str) -> tuple[RunFolder, OtherLoad, float]:
    """Set the thread count, check every run (:meth:`ExperimentConfig.check_runs`), create the run
    folder and write config.json; return the folder, the whole run's load meter and its start time.
    Every experiment plots its curves at the end: the plotting library is checked first, before
    the folder exists or any training starts."""
    require_extra("experiments", command=f"linattn experiment {name}")
    torch.set_num_threads(config.threads)
    config.check_runs()
    run = RunFolder(run_path(name, config))
    run.write_json("config.json", {"experiment": name, "quick": quick, "command": command,
                                   "config": config.to_dict(), "machine": machine_info()})
    return run, OtherLoad(), time.perf_counter()


def finish_run(run: RunFolder, name: str, config: ExperimentConfig, *, quick: bool, command: str,
               load: OtherLoad, t0: float, results: Mapping[str, Any], line: str,
               say: Callable[..., None] = print_line) -> dict[str, Any]:
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
