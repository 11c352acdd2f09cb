"""Training a :class:`linattn.TransformerLM` on a :class:`TrainConfig`: :func:`train` builds the
model, optimiser (AdamW, warm-up + cosine) and data, and runs :class:`linattn.train.TrainingLoop`.

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

One run per output folder ``out``: rank 0 holds an exclusive lock on ``out/train.lock`` (see
:mod:`linattn.train.lock`) from before it reads or writes anything there until :func:`train`
returns or raises; a second run on the folder raises :class:`linattn.train.OutDirBusyError` on every rank.

Several processes: a config that cannot run on their number (``context_parallel`` not dividing
it, a batch that does not split) is refused on every rank before any process group is joined. A
rank that waits longer than ``collective_timeout_s`` for the others (one stopped or is stuck)
raises :class:`linattn.train.dist.CollectiveTimeout` naming what it waited in and the checkpoint
left to resume from; it skips the closing barrier, as the others would not come.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import ContextParallel
from ..models import TransformerLM, count_parameters
from ..progress import say
from .checkpoint import (TRAINER_META, capture_rng, latest_checkpoint, load_train_checkpoint, restore_rng,
                         save_train_checkpoint)
from .config import RESUMABLE_CHANGES, TrainConfig
from .data import TokenData, WindowSampler, make_data, mix_seed, pack_documents
from .dist import (CollectiveTimeout, DistInfo, World, context_groups, expected_world_size, setup, spawn_local,
                   teardown, timed_out)
from .lock import OutDirLock
from .loop import CosineSchedule, MetricsLog, TrainingLoop, decay_groups, lr_at

__all__ = ["CONFIG_FILE", "METRICS_FILE", "TrainResult", "launch_local", "lr_at", "schedule_of", "train"]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "train_config.json"


def schedule_of(config: TrainConfig) -> CosineSchedule:
    """The learning-rate schedule of a :class:`TrainConfig`."""
    return CosineSchedule(lr=config.lr, warmup_steps=config.warmup_steps, decay_steps=config.schedule_steps,
                          min_lr_ratio=config.min_lr_ratio)


@dataclass
class TrainResult:
    """What :func:`train` did (on rank 0; other ranks get the same step and flags).

    ``stop_signal``: the signal (SIGINT or SIGTERM) that stopped the run before ``max_steps``, after
    its checkpoint was written; None when it ran to the end. ``linattn train`` exits with
    ``128 + stop_signal`` (130, 143), as a shell reports a process killed by it.
    ``diverged``: step ``step``'s loss was not finite on some rank; the run stopped there without a
    checkpoint of that step (its weights may hold the non-finite values), ``checkpoint`` is the
    last one written before, and ``linattn train`` exits 1 saying so.
    """

    step: int
    stop_signal: signal.Signals | None
    checkpoint: Path | None
    last_loss: float | None
    last_val_loss: float | None
    history: list[dict[str, Any]] = field(default_factory=list)
    diverged: bool = False

    @property
    def stopped_by_signal(self) -> bool:
        return self.stop_signal is not None


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


def _micro_slices(batch: list[int], accum: int, world: World) -> list[list[int]]:
    """This rank's rows of each micro-batch: the batch split over the data-parallel groups (the
    ranks of one context-parallel group take the same rows)."""
    n, r = world.data_size, world.data_rank
    b = len(batch) // (accum * n)
    return [batch[(a * n + r) * b : (a * n + r + 1) * b] for a in range(accum)]


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


def _shard(x: torch.Tensor, world: World) -> torch.Tensor:
    """This rank's positions of ``x (b, T)``: ``(b, T / P)``, the whole of it without context parallelism."""
    n = x.shape[1] // world.context_parallel
    return x[:, world.context_rank * n : (world.context_rank + 1) * n]


def _logits(model: nn.Module, x: torch.Tensor, config: TrainConfig, world: World) -> torch.Tensor:
    """``model(x)`` for ``x (b, n)``: ``(b, n, V)``. With ``data.document_separator`` the rows are
    packed into one sequence of documents (:func:`pack_documents`) and the logits viewed back; with
    context parallelism ``x`` is this rank's shard (:func:`_shard`) of the group's sequences."""
    if world.context_parallel > 1:
        offset = world.context_rank * x.shape[1]
        return model(x, context_parallel=ContextParallel(world.context_group, offset))
    sep = config.data.document_separator
    if sep is None:
        return model(x)
    ids, cu_seqlens = pack_documents(x, sep)
    return model(ids, cu_seqlens=cu_seqlens).view(*x.shape, -1)


@torch.no_grad()
def _evaluate(model: nn.Module, data: TokenData, config: TrainConfig, world: World) -> float:
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
        for part in _micro_slices(batch, config.grad_accum, world):
            x, y = data.batch(part, split="val")
            x, y = _shard(x, world).to(world.device), _shard(y, world).to(world.device)
            with _autocast(config, world.device):
                logits = _logits(model, x, config, world)
            total += _loss(logits, y, "sum").item()
            count += y.numel()
    model.train(was_training)
    mean_total, mean_count = world.mean([total, float(count)])
    return mean_total / mean_count


def train(config: TrainConfig, *, resume: bool = False, handle_signals: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None, quiet: bool = False) -> TrainResult:
    """Train ``config.model`` on ``config.data``; see the module docstring.

    ``resume``: continue from ``out/checkpoints/latest.json`` (raises if there is none). Without
    it, an output folder that already holds checkpoints is refused rather than overwritten.
    ``handle_signals``: install the SIGINT/SIGTERM handlers (main thread only).
    ``on_step(step, record)``: called on every rank after each optimiser step, ``record`` being
    ``{"step", "loss" (this rank's), "lr"}``; for tests and hooks.
    ``quiet``: no header, progress bar or closing line (metrics.jsonl is still written).
    Raises ValueError before any process group is joined when the config cannot run on this many
    processes (:meth:`TrainConfig.check_processes`), and :class:`linattn.train.dist.CollectiveTimeout`
    when this rank waited ``config.collective_timeout_s`` for the others.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train: config must be a TrainConfig, got {type(config).__name__}")
    config.check_processes(expected_world_size())  # every rank refuses alike, before any waits for the others
    try:
        info = setup(config.device, collective_timeout_s=config.collective_timeout_s)
    except CollectiveTimeout as e:
        raise _named_timeout(e, config, rank=e.rank, during=e.during) from e
    lock = OutDirLock(config.out)
    waited_out = False
    try:
        _on_main(info, lock.acquire)  # rank 0 holds it for all ranks
        return _train(config, info, resume=resume, handle_signals=handle_signals, on_step=on_step, quiet=quiet)
    except RuntimeError as e:
        if not timed_out(e):
            raise
        waited_out = True
        raise _named_timeout(e, config, rank=info.rank, during="the run's setup") from e
    finally:
        lock.release()
        try:
            teardown(info, barrier=not waited_out)
        except RuntimeError as e:
            if not timed_out(e):
                raise
            raise _named_timeout(e, config, rank=info.rank, during="the closing barrier") from e


def _named_timeout(error: RuntimeError, config: TrainConfig, *, rank: int, during: str) -> CollectiveTimeout:
    """``error``, a collective's timeout, as the one line ``linattn train`` prints: which rank
    waited in what (``error``'s own when it is a :class:`CollectiveTimeout`, else ``rank`` and
    ``during``), the flag that sets the timeout, and the checkpoint a resumed run starts from."""
    if isinstance(error, CollectiveTimeout):
        rank, during = error.rank, error.during
    out = Path(config.out)
    try:
        folder = latest_checkpoint(out)
        step = None if folder is None else json.loads((folder / TRAINER_META).read_text())["step"]
    except (OSError, ValueError, KeyError):  # a message about a timeout must not fail on a damaged pointer
        folder = step = None
    # the checkpoint is whole whatever the timeout interrupted: rank 0 writes it between two
    # collectives, and latest.json moves to a folder only once it is complete
    kept = (f"the checkpoint of step {step} in {folder} is kept" if folder is not None
            else f"there is no checkpoint in {out / 'checkpoints'}")
    return CollectiveTimeout(rank=rank, during=during, timeout_s=config.collective_timeout_s,
                             setting="--collective-timeout-s", kept=kept)


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


def _train(config: TrainConfig, info: DistInfo, *, resume: bool, handle_signals: bool, on_step,
           quiet: bool) -> TrainResult:
    c = config
    W = info.world_size
    P = c.context_parallel  # c.check_processes(W) held before the group was joined
    out = Path(c.out)
    dtype = getattr(torch, c.dtype)
    quiet = quiet or not info.is_main  # under torchrun only rank 0 prints

    # Same initial weights on every rank; then a per-rank stream for dropout.
    random.seed(c.seed)
    np.random.seed(c.seed % 2**32)
    torch.manual_seed(c.seed)
    model = TransformerLM(c.model).to(dtype=dtype, device=info.device)
    torch.manual_seed(mix_seed(0xD0, c.seed, info.rank))
    optimizer = torch.optim.AdamW(decay_groups(model, c.weight_decay), lr=c.lr, betas=c.betas, eps=c.eps)
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
        say(f"[linattn train] resumed from {existing} at step {step}", quiet=quiet)
        saved_steps = meta["train_config"]["max_steps"]
        if c.decay_steps is None and saved_steps != c.max_steps:
            say(f"[linattn train] note: max_steps changed from {saved_steps} to {c.max_steps} with decay_steps unset, "
                f"so the cosine schedule now ends at step {c.max_steps} (set decay_steps to keep it)", quiet=quiet)
    elif existing is not None:
        raise FileExistsError(
            f"{out} already holds checkpoints ({existing}); pass --resume to continue, or choose another --out"
        )

    def prepare_out() -> None:  # the lock made the folder
        if resume:
            _truncate_metrics(metrics_path, step)
        else:
            metrics_path.unlink(missing_ok=True)  # a run that died before its first checkpoint
        (out / CONFIG_FILE).write_text(json.dumps(c.to_dict(), indent=2) + "\n")

    _on_main(info, prepare_out)  # a collective too: no rank starts before the folder is ready

    raw_model = model
    if W > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None)
    model.train()
    world = World(info, model, context_parallel=P, context_group=context_groups(info, P))
    say(f"[linattn train] {count_parameters(raw_model):,} parameters, device {info.device}, "
        f"{W} process{'es' if W > 1 else ''}, output {out}", quiet=quiet)

    def save(at: int) -> Path | None:
        states = [capture_rng(info.device)]
        if W > 1:
            states = [None] * W
            dist.all_gather_object(states, capture_rng(info.device))
        folder = None
        if info.is_main:
            folder = save_train_checkpoint(out, step=at, model=raw_model, optimizer=optimizer,
                                           config_dict=c.to_dict(), sampler_state=sampler.state_dict(),
                                           rng_states=states, keep_last=c.keep_last)
        if W > 1:
            dist.barrier()
        return folder or latest_checkpoint(out)

    parts: list[list[int]] = []

    def micro_loss(at: int, a: int) -> torch.Tensor:
        if a == 0:
            parts[:] = _micro_slices(sampler.take(c.batch_size), c.grad_accum, world)
        x, y = data.batch(parts[a])
        x, y = _shard(x, world).to(info.device), _shard(y, world).to(info.device)
        with _autocast(c, info.device):
            logits = _logits(model, x, c, world)  # (b, T / P, V)
        return _loss(logits, y)

    metrics = MetricsLog(metrics_path) if info.is_main else None
    loop = TrainingLoop(
        optimizer, params=[p for p in raw_model.parameters() if p.requires_grad], schedule=schedule_of(c),
        grad_clip=c.grad_clip, grad_accum=c.grad_accum, max_steps=c.max_steps, log_every=c.log_every,
        metrics=metrics, eval_every=c.eval_every,
        evaluate=(lambda at: {"val_loss": _evaluate(raw_model, data, c, world)}) if c.eval_every else None,
        ckpt_every=c.ckpt_every, save=save, on_step=on_step, handle_signals=handle_signals,
        tokens_per_step=c.batch_size * c.seq_len, desc="train", quiet=quiet, world=world,
        # a non-finite loss (a NaN or inf in any document of a packed row reaches the whole row's
        # loss) ends the run at that step: every later step would train on garbage
        stop_on_nonfinite=True)
    try:
        r = loop.run(micro_loss, start_step=step, checkpoint=existing if resume else None)
    finally:
        if metrics is not None:
            metrics.close()
    last_val = None if r.last_eval is None else r.last_eval["val_loss"]
    if r.stop_signal is None and not r.diverged:
        numbers = "".join(f", {name} {value:.4f}" for name, value in
                          (("loss", r.last_loss), ("val_loss", last_val)) if value is not None)
        say(f"[linattn train] finished at step {r.step}/{c.max_steps}{numbers}; final checkpoint {r.checkpoint}",
            quiet=quiet)
    return TrainResult(step=r.step, stop_signal=r.stop_signal, checkpoint=r.checkpoint, last_loss=r.last_loss,
                       last_val_loss=last_val, history=r.history, diverged=r.diverged)


def _spawned_train(config_dict: dict[str, Any], resume: bool) -> None:
    train(TrainConfig.from_dict(config_dict), resume=resume, handle_signals=False)


def launch_local(config: TrainConfig, nprocs: int, *, resume: bool = False, threads_per_proc: int = 1) -> None:
    """Run :func:`train` in ``nprocs`` spawned CPU processes (gloo, localhost). Raises if any
    process fails."""
    if config.device == "cuda":
        raise ValueError("launch_local starts CPU processes; use torchrun for CUDA runs")
    spawn_local(_spawned_train, nprocs, (config.to_dict(), resume), threads_per_proc=threads_per_proc)
