"""The one training loop of linattn: language-model training (:func:`linattn.train.train`), the
experiments' contenders and distillation all run :class:`TrainingLoop`.

The caller builds the model, the optimiser and the data; the loop owns what every run shares:

- the learning rate of each optimiser step from a schedule (:class:`CosineSchedule`);
- gradient accumulation: ``micro_loss(step, a)`` gives the loss of micro-batch ``a`` of optimiser
  step ``step``; the loop divides it by ``grad_accum`` and calls ``backward`` (under DDP inside
  ``no_sync`` for all but the step's last micro-batch, so the ranks average gradients once);
- clipping, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``;
- stopping: after ``max_steps``, once its own training time (forward, backward and optimiser steps
  only; not evaluation, checkpoints or the caller's ``before_step``) reaches ``budget_s``, on a
  non-finite loss (``stop_on_nonfinite``), or at the step boundary after SIGINT/SIGTERM. Ranks
  agree on every stop (an all-reduce max), so none waits at a collective for one that left;
- metrics records (:class:`MetricsLog`), evaluation and checkpoint cadence, and progress
  (:func:`linattn.progress.progress_bar` with the current tokens/s);
- a collective that timed out (another rank stopped or is stuck) is raised as a
  :class:`linattn.train.dist.CollectiveTimeout` naming what this rank was doing: gloo's own error
  names no collective.

"At the end" (the last record, an evaluation, a checkpoint) means reaching ``max_steps`` or the
budget. A signal stop writes a checkpoint but no extra record, so that a resumed run logs the same
records as one that was never interrupted; a divergence (non-finite loss) writes neither.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..progress import progress_bar
from .dist import CollectiveTimeout, World, timed_out

__all__ = ["CosineSchedule", "LoopResult", "MetricsLog", "StopFlag", "TrainingLoop", "decay_groups", "lr_at"]


@dataclass(frozen=True)
class CosineSchedule:
    """Learning rate of optimiser step ``step`` (0-based): linear warm-up from ``lr / warmup_steps``
    to ``lr`` over ``warmup_steps``, then a cosine from ``lr`` to ``lr * min_lr_ratio`` at step
    ``decay_steps``, flat after.

    Attributes:
        lr: peak learning rate.
        warmup_steps: steps of the linear warm-up (0: none).
        decay_steps: the step where the cosine reaches its floor.
        min_lr_ratio: the floor as a share of ``lr``.
    """

    lr: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.decay_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lr_at(config: Any, step: int) -> float:
    """Learning rate of optimiser step ``step`` under a config with ``lr``, ``warmup_steps``,
    ``schedule_steps`` and ``min_lr_ratio`` (a :class:`linattn.train.TrainConfig`): its
    :class:`CosineSchedule` at ``step``."""
    return CosineSchedule(lr=config.lr, warmup_steps=config.warmup_steps, decay_steps=config.schedule_steps,
                          min_lr_ratio=config.min_lr_ratio)(step)


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: decay on matrices and embeddings (dim >= 2), not on biases or norm
    gains. Tied weights appear once; frozen parameters not at all."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class MetricsLog:
    """A JSONL file of records, one a line, each flushed as it is written (so that a crash loses
    at most the line being written). ``fresh=True`` empties the file first; otherwise records are
    appended (a resumed run continues the file)."""

    def __init__(self, path: str | Path, *, fresh: bool = False) -> None:
        self.path = Path(path)
        self._fh = open(self.path, "w" if fresh else "a")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class StopFlag:
    """Holds the first SIGINT/SIGTERM received; a second SIGINT raises KeyboardInterrupt (abort
    without a checkpoint). ``label`` names the run in the note printed on stderr."""

    def __init__(self, label: str = "linattn") -> None:
        self.label = label
        self.signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal is None:
            self.signal = signal.Signals(signum)
        print(f"\n[{self.label}] {signal.Signals(signum).name}: checkpointing and stopping at the next step "
              "boundary (SIGINT again to abort without a checkpoint)", file=sys.stderr, flush=True)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


@dataclass
class LoopResult:
    """What :meth:`TrainingLoop.run` did (every rank gets the same step and flags).

    Attributes:
        step: optimiser steps done, counting those before ``start_step``.
        stop_signal: the signal that stopped the run (after its checkpoint), or None.
        diverged: a step's loss was not finite (``stop_on_nonfinite``); that step was taken.
        last_loss: the loss of the last record (None when none was written).
        last_eval: the last evaluation's numbers (None when there was none).
        history: the records written by this run, in order (on every rank; the metrics file is
            the main rank's).
        elapsed_s: training time, ``start_elapsed_s`` included (what ``budget_s`` counts).
        wall_s: wall time of this run, evaluation and checkpoints included.
        checkpoint: the newest checkpoint (the resumed one when none was written).
    """

    step: int
    stop_signal: signal.Signals | None = None
    diverged: bool = False
    last_loss: float | None = None
    last_eval: dict[str, float] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    wall_s: float = 0.0
    checkpoint: Path | None = None

    @property
    def stopped_by_signal(self) -> bool:
        return self.stop_signal is not None


def _check_count(name: str, value: Any, lo: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"TrainingLoop: {name} must be an int >= {lo}{' or None' if optional else ''}, got {value!r}")


class TrainingLoop:
    """Optimiser steps until ``max_steps`` or ``budget_s``; see the module docstring.

    ``params``: the tensors whose global gradient norm is clipped to ``grad_clip`` (None or 0: no
    clipping); None clips the parameters of ``self.optimizer`` as they are at each step (so that a
    ``before_step`` that replaces the optimiser clips the new one's).
    ``schedule(step)``: the learning rate of optimiser step ``step`` (0-based), set on every group;
    None keeps the groups' own rates.
    ``metrics``: where the records go (None: only ``LoopResult.history``). A record is
    ``{"kind": "train", "step", "loss", "lr", "grad_norm", ["tokens", "tokens_per_s",]
    "elapsed_s"}`` every ``log_every`` steps and at the end, and ``{"kind": "eval", "step",
    **evaluate(step)}`` every ``eval_every`` steps (0: never) and at the end. ``loss`` is the step's
    loss averaged over ranks, or with ``window_loss`` the mean over the last ``log_every`` steps (the
    steps since the previous record); ``tokens_per_s`` is the average since this run started,
    ``elapsed_s`` its wall time.
    ``save(step)``: write a checkpoint (on every rank: it may gather); every ``ckpt_every`` steps
    (0: only at the end and on a signal). Returns its folder (or None).
    ``before_step(step)``: called before each step, outside the timed part; it may assign
    ``loop.optimizer`` (distillation's change of stage) and read ``loop.elapsed_s``.
    ``on_step(step, record)``: after each optimiser step, on every rank, with ``{"step" (steps done),
    "loss" (this rank's), "lr"}``.
    ``world``: ranks and collectives (:class:`linattn.train.dist.World`); None is one process.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, params: Iterable[torch.Tensor] | None,
                 schedule: Callable[[int], float] | None = None, grad_clip: float | None = None,
                 grad_accum: int = 1, max_steps: int | None = None, budget_s: float | None = None,
                 log_every: int = 10, metrics: MetricsLog | None = None, window_loss: bool = False,
                 eval_every: int = 0, evaluate: Callable[[int], dict[str, float]] | None = None,
                 ckpt_every: int = 0, save: Callable[[int], Path | None] | None = None,
                 stop_on_nonfinite: bool = False, before_step: Callable[[int], None] | None = None,
                 on_step: Callable[[int, dict[str, Any]], None] | None = None, handle_signals: bool = True,
                 tokens_per_step: int | None = None, desc: str = "train", quiet: bool = False,
                 world: World | None = None) -> None:
        _check_count("grad_accum", grad_accum, 1)
        _check_count("max_steps", max_steps, 0, optional=True)
        _check_count("log_every", log_every, 1)
        _check_count("eval_every", eval_every, 0)
        _check_count("ckpt_every", ckpt_every, 0)
        _check_count("tokens_per_step", tokens_per_step, 1, optional=True)
        if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s > 0):
            raise ValueError(f"TrainingLoop: budget_s must be a number of seconds > 0 or None, got {budget_s!r}")
        if max_steps is None and budget_s is None:
            raise ValueError("TrainingLoop: give max_steps, budget_s or both (the loop needs a stopping rule)")
        if eval_every and evaluate is None:
            raise ValueError(f"TrainingLoop: eval_every = {eval_every} needs an evaluate function")
        self.optimizer = optimizer
        self.params = None if params is None else list(params)
        self.schedule = schedule
        self.grad_clip = grad_clip
        self.grad_accum = grad_accum
        self.max_steps = max_steps
        self.budget_s = None if budget_s is None else float(budget_s)
        self.log_every = log_every
        self.metrics = metrics
        self.window_loss = window_loss
        self.eval_every = eval_every
        self.evaluate = evaluate
        self.ckpt_every = ckpt_every
        self.save = save
        self.stop_on_nonfinite = stop_on_nonfinite
        self.before_step = before_step
        self.on_step = on_step
        self.handle_signals = handle_signals
        self.tokens_per_step = tokens_per_step
        self.desc = desc
        self.quiet = quiet
        self.world = world or World()
        self.step = 0
        self.elapsed_s = 0.0

    # -- one optimiser step ------------------------------------------------------------------

    def _clipped(self) -> list[torch.Tensor]:
        if self.params is not None:
            return self.params
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _one_step(self, micro_loss: Callable[[int, int], torch.Tensor], step: int) -> tuple[float, float, float | None]:
        """Run optimiser step ``step``; returns (this rank's loss, lr, grad norm or None)."""
        opt = self.optimizer
        if self.schedule is not None:
            lr = self.schedule(step)
            for group in opt.param_groups:
                group["lr"] = lr
        else:
            lr = opt.param_groups[0]["lr"]
        loss_sum = 0.0
        last = self.grad_accum - 1
        for a in range(self.grad_accum):
            with self.world.no_sync() if a != last else contextlib.nullcontext():
                loss = micro_loss(step, a)
                (loss / self.grad_accum).backward()
            loss_sum += loss.item()
        grad_norm = float(nn.utils.clip_grad_norm_(self._clipped(), self.grad_clip)) if self.grad_clip else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss_sum / self.grad_accum, lr, grad_norm

    # -- the run -----------------------------------------------------------------------------

    def _bar(self, start_step: int, start_elapsed_s: float):
        quiet = self.quiet or not self.world.is_main
        if self.max_steps is not None:
            return progress_bar(self.max_steps, initial=start_step, desc=self.desc, unit="step", quiet=quiet)
        # a time budget: the bar counts training seconds; n_fmt/total_fmt because tqdm sets total to
        # None once n passes it, and a format spec on None would raise inside the loop
        return progress_bar(round(self.budget_s), initial=min(round(start_elapsed_s), round(self.budget_s)),
                            desc=self.desc, unit="s", quiet=quiet,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}s [{elapsed}<{remaining}]{postfix}")

    def run(self, micro_loss: Callable[[int, int], torch.Tensor], *, start_step: int = 0,
            start_elapsed_s: float = 0.0, checkpoint: Path | None = None) -> LoopResult:
        """Train from optimiser step ``start_step`` (0, or a resumed checkpoint's step) with
        ``start_elapsed_s`` of the budget already spent; ``checkpoint``: the checkpoint resumed
        from, so that its step is not written again. Returns a :class:`LoopResult`."""
        _check_count("start_step", start_step, 0)
        w = self.world
        self.step, self.elapsed_s = start_step, float(start_elapsed_s)
        flag = StopFlag(f"linattn {self.desc}")
        if self.handle_signals:
            flag.install()
        result = LoopResult(step=start_step, checkpoint=checkpoint)
        saved_at = start_step if checkpoint is not None else -1
        logged_at = evaluated_at = -1
        window: collections.deque[float] = collections.deque(maxlen=self.log_every)
        lr = grad_norm = None
        t0 = time.perf_counter()
        mark_elapsed, mark_step = self.elapsed_s, start_step  # the bar's tokens/s counts from here

        def record(rec: dict[str, Any]) -> None:
            result.history.append(rec)
            if self.metrics is not None:
                self.metrics.write(rec)

        def log(step: int, rank_loss: float) -> None:
            nonlocal logged_at, mark_elapsed, mark_step
            value = sum(window) / len(window) if self.window_loss else rank_loss
            (result.last_loss,) = w.mean([value])
            wall = time.perf_counter() - t0
            rec: dict[str, Any] = {"kind": "train", "step": step, "loss": result.last_loss, "lr": lr,
                                   "grad_norm": grad_norm}
            postfix = f"loss {result.last_loss:.4f}"
            if self.tokens_per_step is not None:
                done = step - start_step
                rec["tokens"] = step * self.tokens_per_step
                rec["tokens_per_s"] = done * self.tokens_per_step / wall if wall > 0 else float("nan")
                spent = self.elapsed_s - mark_elapsed
                if spent > 0:
                    postfix += f" | {(step - mark_step) * self.tokens_per_step / spent:,.0f} tok/s"
            rec["elapsed_s"] = wall
            record(rec)
            bar.set_postfix_str(postfix, refresh=False)
            logged_at, mark_elapsed, mark_step = step, self.elapsed_s, step

        def evaluate(step: int) -> None:
            nonlocal evaluated_at
            result.last_eval = dict(self.evaluate(step))
            record({"kind": "eval", "step": step, **result.last_eval})
            evaluated_at = step

        def save(step: int) -> None:
            nonlocal saved_at
            if self.save is not None:
                result.checkpoint = self.save(step) or result.checkpoint
            saved_at = step

        bar = self._bar(start_step, start_elapsed_s)
        doing = f"step {start_step + 1}"  # what this rank is doing: named when a collective times out
        try:
            self.optimizer.zero_grad(set_to_none=True)
            while True:
                step = self.step
                over_budget = self.budget_s is not None and self.elapsed_s >= self.budget_s
                # the ranks agree on stopping, and on which signal (the largest one any rank received)
                doing = f"the agreement on stopping before step {step + 1}"
                received, over_budget = w.max([int(flag.signal or 0), int(over_budget)])
                result.stop_signal = signal.Signals(received) if received else None
                at_max = self.max_steps is not None and step >= self.max_steps
                if result.stop_signal is not None or at_max or over_budget:
                    if result.stop_signal is None and step > start_step:  # the end: its record and evaluation
                        if logged_at != step:
                            doing = f"the loss average of step {step}"
                            log(step, window[-1])
                        if self.evaluate is not None and evaluated_at != step:
                            doing = f"the evaluation at step {step}"
                            evaluate(step)
                    if saved_at != step:
                        doing = f"the checkpoint of step {step}"
                        save(step)
                    break
                if self.before_step is not None:
                    doing = f"before_step of step {step + 1}"
                    self.before_step(step)
                t_step = time.perf_counter()
                doing = f"step {step + 1}'s forward and backward"
                rank_loss, lr, grad_norm = self._one_step(micro_loss, step)
                self.elapsed_s += time.perf_counter() - t_step
                step += 1
                self.step = step
                window.append(rank_loss)
                if self.on_step is not None:
                    doing = f"on_step after step {step}"
                    self.on_step(step, {"step": step, "loss": rank_loss, "lr": lr})
                if self.stop_on_nonfinite:
                    doing = f"the agreement on whether step {step}'s loss is finite"
                    if w.max([int(not math.isfinite(rank_loss))])[0]:
                        result.diverged = True
                        break
                if self.max_steps is not None:
                    bar.update(1)
                else:
                    bar.update(min(round(self.elapsed_s), round(self.budget_s)) - bar.n)
                end = step == self.max_steps
                if step % self.log_every == 0 or end:
                    doing = f"the loss average of step {step}"
                    log(step, rank_loss)
                if self.evaluate is not None and ((self.eval_every and step % self.eval_every == 0) or end):
                    doing = f"the evaluation at step {step}"
                    evaluate(step)
                if self.ckpt_every and step % self.ckpt_every == 0:
                    doing = f"the checkpoint of step {step}"
                    save(step)
        except RuntimeError as e:
            if isinstance(e, CollectiveTimeout) or not timed_out(e):
                raise
            raise CollectiveTimeout(rank=w.rank, during=doing, timeout_s=w.info.collective_timeout_s) from e
        finally:
            bar.close()
            flag.restore()
        result.step = self.step
        result.elapsed_s = self.elapsed_s
        result.wall_s = time.perf_counter() - t0
        return result

