"""The training loop: AdamW, warm-up + cosine schedule, clipping, accumulation, DDP, checkpoints.

One optimiser step takes ``batch_size`` windows from the sampler (the global batch, identical on
every rank); accumulation step a of rank r uses the slice ``[(a*W + r)*b, (a*W + r + 1)*b)`` with
``b = batch_size / (grad_accum * W)``. Each micro-batch's mean loss is divided by ``grad_accum`` and
DDP averages over ranks, so the gradient is the mean over the global batch whatever W and
``grad_accum`` are (up to float rounding).

Stopping: SIGINT or SIGTERM sets a flag; at the next step boundary the ranks agree (all-reduce of
the flag), rank 0 writes a checkpoint and :func:`train` returns, its ``stop_signal`` naming the
signal (``linattn train`` then exits 130 or 143, not 0). A second SIGINT raises
KeyboardInterrupt at once. ``train(config, resume=True)`` continues from ``checkpoints/latest.json``
exactly: weights, optimiser, per-rank RNG states, sampler position and step are restored, and
``metrics.jsonl`` records after the checkpoint's step (left by a crash) are dropped, so an
interrupted and resumed run logs the same losses and ends with the same weights as one that was
never interrupted (bitwise on CPU in float32 with the same thread count).

One run per ``out_dir``: rank 0 holds an exclusive lock on ``out_dir/train.lock`` (see
:mod:`linattn.train.lock`) from before it reads or writes anything there until :func:`train`
returns or raises; a second run on the folder raises :class:`linattn.train.OutDirBusyError` on every rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models import TransformerLM
from .checkpoint import capture_rng, latest_checkpoint, load_train_checkpoint, restore_rng, save_train_checkpoint
from .config import RESUMABLE_CHANGES, TrainConfig
from .data import TokenData, WindowSampler, _mix, make_data
from .dist import DistInfo, setup, teardown
from .lock import OutDirLock

__all__ = ["TrainResult", "lr_at", "train"]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"


def lr_at(config: TrainConfig, step: int) -> float:
    """Learning rate of optimiser step ``step`` (0-based): linear warm-up over ``warmup_steps``,
    then a cosine from ``lr`` to ``lr * min_lr_ratio`` at ``schedule_steps``, flat after."""
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    span = max(1, c.schedule_steps - c.warmup_steps)
    progress = min(1.0, (step - c.warmup_steps) / span)
    return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainResult:
    """What :func:`train` did (on rank 0; other ranks get the same step and flags).

    ``stop_signal``: the signal (SIGINT or SIGTERM) that stopped the run before ``max_steps``, after
    its checkpoint was written; None when it ran to the end. ``linattn train`` exits with
    ``128 + stop_signal`` (130, 143), as a shell reports a process killed by it.
    """

    step: int
    stop_signal: signal.Signals | None
    checkpoint: Path | None
    last_loss: float | None
    last_val_loss: float | None
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stopped_by_signal(self) -> bool:
        return self.stop_signal is not None


class _StopFlag:
    """Holds the first SIGINT/SIGTERM received; a second SIGINT raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signal is None:
            self.signal = signal.Signals(signum)
        print(f"\n[linattn train] {signal.Signals(signum).name}: checkpointing and stopping at the next step "
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


def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings (dim >= 2); not biases or norm gains. Tied weights once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _check_resume_config(saved: dict[str, Any], config: TrainConfig, folder: Path) -> None:
    now = config.to_dict()
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ValueError(
            f"--resume: the config differs from the one checkpoint {folder} was trained with in {changed} "
            f"({detail}); only {list(RESUMABLE_CHANGES)} may change on resume"
        )


def _metrics_record(line: bytes) -> dict[str, Any]:
    """One ``metrics.jsonl`` line as a record; ValueError when it is not one."""
    rec = json.loads(line)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(rec, dict) or isinstance(rec.get("step"), bool) or not isinstance(rec.get("step"), int):
        raise ValueError("no integer 'step'")
    return rec


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after ``step`` (written after the checkpoint by a run that then crashed).

    A last line that is not a record is a write torn by a crash or power loss: it is dropped with a
    note on stderr. Any earlier bad line is damage this cannot repair: ValueError naming the line.
    """
    if not path.is_file():
        return
    lines = path.read_bytes().split(b"\n")
    filled = [i for i, line in enumerate(lines) if line.strip()]
    keep = []
    for i in filled:
        try:
            rec = _metrics_record(lines[i])
        except ValueError as e:
            if i != filled[-1]:
                raise ValueError(f"{path}: line {i + 1} is not a metrics record ({e}); only a torn last line "
                                 "is dropped on resume: repair or remove the file") from None
            print(f"[linattn train] {path}: dropped a torn last line (line {i + 1}, {len(lines[i])} bytes: {e})",
                  file=sys.stderr, flush=True)
            continue
        if rec["step"] <= step:
            keep.append(lines[i])
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in keep))
    tmp.replace(path)


class _Reducer:
    """Averages scalars over ranks (identity in a single process)."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info

    def mean(self, values: list[float]) -> list[float]:
        if self.info.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t)
        return (t / self.info.world_size).tolist()

    def max(self, value: int) -> int:
        if self.info.world_size == 1:
            return value
        t = torch.tensor([value], device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


def _micro_slices(batch: list[int], accum: int, info: DistInfo) -> list[list[int]]:
    b = len(batch) // (accum * info.world_size)
    return [batch[(a * info.world_size + info.rank) * b : (a * info.world_size + info.rank + 1) * b]
            for a in range(accum)]


def _loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits (B, T, V)`` against ``targets (B, T)``, in float32 at least
    (bf16 logits under autocast are upcast; float64 stays float64)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def _autocast(config: TrainConfig, device: torch.device):
    if not config.bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@torch.no_grad()
def _evaluate(model: nn.Module, data: TokenData, config: TrainConfig, info: DistInfo, reducer: _Reducer) -> float:
    """Mean next-token loss over the first ``eval_batches * batch_size`` validation windows
    (wrapping around a short validation stream), split over ranks and accumulation steps."""
    was_training = model.training
    model.eval()
    n_val = TokenData.n_windows(data.val, data.seq_len)
    windows = [i % n_val for i in range(config.eval_batches * config.batch_size)]
    total = 0.0
    count = 0
    for k in range(config.eval_batches):
        batch = windows[k * config.batch_size : (k + 1) * config.batch_size]
        for part in _micro_slices(batch, config.grad_accum, info):
            x, y = data.batch(part, split="val")
            x, y = x.to(info.device), y.to(info.device)
            with _autocast(config, info.device):
                logits = model(x)
            total += _loss(logits, y, "sum").item()
            count += y.numel()
    model.train(was_training)
    mean_total, mean_count = reducer.mean([total, float(count)])
    return mean_total / mean_count


def train(config: TrainConfig, *, resume: bool = False, handle_signals: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None, quiet: bool = False) -> TrainResult:
    """Train ``config.model`` on ``config.data``; see the module docstring.

    ``resume``: continue from ``out_dir/checkpoints/latest.json`` (raises if there is none). Without
    it, an ``out_dir`` that already holds checkpoints is refused rather than overwritten.
    ``handle_signals``: install the SIGINT/SIGTERM handlers (main thread only).
    ``on_step(step, record)``: called on every rank after each optimiser step, ``record`` being
    ``{"step", "loss" (this rank's), "lr"}``; for tests and hooks.
    ``quiet``: no progress lines (metrics.jsonl is still written).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train: config must be a TrainConfig, got {type(config).__name__}")
    info = setup(config.device)
    flag = _StopFlag()
    if handle_signals:
        flag.install()
    lock = OutDirLock(config.out_dir)
    try:
        _on_main(info, lock.acquire)  # rank 0 holds it for all ranks
        return _train(config, info, flag, resume=resume, on_step=on_step, quiet=quiet)
    finally:
        lock.release()
        flag.restore()
        teardown(info)


def _on_main(info: DistInfo, fn: Callable[[], None]) -> None:
    """Run ``fn`` on rank 0 only; when it raises, every rank raises its exception, so that no rank
    waits at a collective for one that has given up."""
    error = None
    if info.is_main:
        try:
            fn()
        except Exception as e:
            error = e
    if info.world_size > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


def _train(config: TrainConfig, info: DistInfo, flag: _StopFlag, *, resume: bool,
           on_step, quiet: bool) -> TrainResult:
    c = config
    W = info.world_size
    if c.batch_size % (c.grad_accum * W):
        raise ValueError(
            f"TrainConfig: batch_size = {c.batch_size} must be divisible by grad_accum * world_size = "
            f"{c.grad_accum} * {W}"
        )
    out = Path(c.out_dir)
    dtype = getattr(torch, c.dtype)
    log = (lambda *a: None) if (quiet or not info.is_main) else (lambda msg: print(msg, flush=True))

    # Same initial weights on every rank; then a per-rank stream for dropout.
    random.seed(c.seed)
    np.random.seed(c.seed % 2**32)
    torch.manual_seed(c.seed)
    model = TransformerLM(c.model).to(dtype=dtype, device=info.device)
    torch.manual_seed(_mix(0xD0, c.seed, info.rank))
    optimizer = torch.optim.AdamW(_param_groups(model, c.weight_decay), lr=c.lr, betas=c.betas, eps=c.eps)
    data = make_data(c)
    sampler = WindowSampler(TokenData.n_windows(data.train, c.seq_len), seed=c.seed)
    step = 0
    metrics_path = out / METRICS_FILE

    existing = latest_checkpoint(out)
    if resume:
        if existing is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {out / 'checkpoints'} (no latest.json)")
        ck = load_train_checkpoint(existing)
        meta = ck["meta"]
        _check_resume_config(meta["train_config"], c, existing)
        if meta["world_size"] != W:
            raise ValueError(
                f"--resume: checkpoint {existing} was written by {meta['world_size']} processes, this run has "
                f"{W}; exact resumption needs the same number (per-rank RNG states)"
            )
        model.load_state_dict(ck["model"].state_dict())
        optimizer.load_state_dict(ck["optimizer"])
        sampler.load_state_dict(meta["sampler"])
        restore_rng(ck["rng"][info.rank], info.device)
        step = int(meta["step"])
        log(f"[linattn train] resumed from {existing} at step {step}")
        saved_steps = meta["train_config"]["max_steps"]
        if c.decay_steps is None and saved_steps != c.max_steps:
            log(f"[linattn train] note: max_steps changed from {saved_steps} to {c.max_steps} with decay_steps unset, "
                f"so the cosine schedule now ends at step {c.max_steps} (set decay_steps to keep it)")
    elif existing is not None:
        raise FileExistsError(
            f"{out} already holds checkpoints ({existing}); pass --resume to continue, or choose another out_dir"
        )

    def prepare_out_dir() -> None:  # the lock made the folder
        if resume:
            _truncate_metrics(metrics_path, step)
        else:
            metrics_path.unlink(missing_ok=True)  # a run that died before its first checkpoint
        (out / CONFIG_FILE).write_text(json.dumps(c.to_dict(), indent=2) + "\n")

    _on_main(info, prepare_out_dir)  # a collective too: no rank starts before the folder is ready

    raw_model = model
    if W > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    model.train()
    reducer = _Reducer(info)
    params = [p for p in raw_model.parameters() if p.requires_grad]
    tokens_per_step = c.batch_size * c.seq_len

    def checkpoint() -> Path | None:
        states = [capture_rng(info.device)]
        if W > 1:
            states = [None] * W
            dist.all_gather_object(states, capture_rng(info.device))
        folder = None
        if info.is_main:
            folder = save_train_checkpoint(out, step=step, model=raw_model, optimizer=optimizer,
                                           config_dict=c.to_dict(), sampler_state=sampler.state_dict(),
                                           rng_states=states, keep_last=c.keep_last)
        if W > 1:
            dist.barrier()
        return folder or latest_checkpoint(out)

    history: list[dict[str, Any]] = []
    metrics = open(metrics_path, "a") if info.is_main else None

    def record(rec: dict[str, Any]) -> None:
        history.append(rec)
        if metrics is not None:
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()

    saved_at = step if resume else -1
    last_ckpt: Path | None = existing if resume else None
    last_loss = last_val = None
    stop_signal: signal.Signals | None = None
    t0 = time.perf_counter()
    start_step = step
    try:
        while True:
            # the ranks agree on stopping, and on which signal (the largest one any rank received)
            received = reducer.max(int(flag.signal or 0))
            stop_signal = signal.Signals(received) if received else None
            if stop_signal is not None or step >= c.max_steps:
                if saved_at != step:
                    last_ckpt, saved_at = checkpoint(), step
                if stop_signal is not None:
                    log(f"[linattn train] stopped by {stop_signal.name} at step {step}; checkpoint {last_ckpt}")
                break
            lr = lr_at(c, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = sampler.take(c.batch_size)
            loss_sum = 0.0
            parts = _micro_slices(batch, c.grad_accum, info)
            for a, part in enumerate(parts):
                x, y = data.batch(part)
                x, y = x.to(info.device), y.to(info.device)
                sync = contextlib.nullcontext() if W == 1 or a == len(parts) - 1 else model.no_sync()
                with sync:
                    with _autocast(c, info.device):
                        logits = model(x)  # (b, T, V)
                    loss = _loss(logits, y)
                    (loss / c.grad_accum).backward()
                loss_sum += loss.item()
            if c.grad_clip:
                grad_norm = float(nn.utils.clip_grad_norm_(params, c.grad_clip))
            else:
                grad_norm = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            rank_loss = loss_sum / c.grad_accum
            if on_step is not None:
                on_step(step, {"step": step, "loss": rank_loss, "lr": lr})

            if step % c.log_every == 0 or step == c.max_steps:
                (last_loss,) = reducer.mean([rank_loss])
                elapsed = time.perf_counter() - t0
                done = step - start_step
                tok_s = done * tokens_per_step / elapsed if elapsed > 0 else float("nan")
                eta = (c.max_steps - step) * elapsed / done
                record({"kind": "train", "step": step, "loss": last_loss, "lr": lr, "grad_norm": grad_norm,
                        "tokens": step * tokens_per_step, "tokens_per_s": tok_s, "elapsed_s": elapsed})
                log(f"step {step}/{c.max_steps} | loss {last_loss:.4f} | lr {lr:.2e} | "
                    f"{tok_s:,.0f} tok/s | ETA {_format_eta(eta)}")
            if c.eval_every and (step % c.eval_every == 0 or step == c.max_steps):
                last_val = _evaluate(raw_model, data, c, info, reducer)
                record({"kind": "eval", "step": step, "val_loss": last_val})
                log(f"step {step}/{c.max_steps} | val_loss {last_val:.4f}")
            if c.ckpt_every and step % c.ckpt_every == 0:
                last_ckpt, saved_at = checkpoint(), step
    finally:
        if metrics is not None:
            metrics.close()
    return TrainResult(step=step, stop_signal=stop_signal, checkpoint=last_ckpt, last_loss=last_loss,
                       last_val_loss=last_val, history=history)
