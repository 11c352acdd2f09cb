"""Recovery: distil a converted model back toward the original on unlabeled sentences.

The original (teacher, softmax, frozen) and the converted model (student) read the same training
texts: Shakespeare lines of the training plays, and passages of consecutive training lines of about
1,500 characters, cut at 384 tokens (every ``passage_every``-th step), so that a windowed student also learns the keys outside
its window. Never the held-out plays that fidelity is measured on. Two stages, as in LoLCATs
(arXiv 2410.10254), the first only for mechanisms that can form their attention weights (Hedgehog):

1. attention transfer, the first ``stage1_fraction`` of the time: only the mechanism's own
   parameters train, each layer separately, to match the softmax weights the teacher's formula
   gives for the same queries and keys (cross-entropy of the student's rows against the softmax
   rows, Hedgehog's objective, arXiv 2402.04347);
2. end to end, the rest: every parameter trains (the mechanism's at ``lr_maps``, the pretrained
   ones at ``lr_model``) on the mean over layers of the hidden-state MSE on real tokens (each
   divided by the teacher layer's mean square) plus 1 - cosine of the pooled sentence embeddings.

The budget counts training time only (steps, not evaluation or checkpoints) and is enforced by
:class:`linattn.train.TrainingLoop` (``budget_s``, resumed with the time already spent):
the run stops at the first step boundary past ``minutes``. Checkpoints (every
``ckpt_every`` steps, at the end and on SIGINT/SIGTERM) hold the student (safetensors), the
optimiser, RNG states, data positions, stage and elapsed time; ``--resume`` continues exactly there.
Fidelity (:mod:`linattn.convert.fidelity`) is measured before and after on the same held-out texts.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from ..models.checkpoint import fsync_dir, write_atomic
from ..nn.registry import attention_config_from_dict
from ..train.checkpoint import capture_rng, restore_rng
from ..train.loop import TrainingLoop
from .data import Encoded, encode, load_pretrained, mean_pool, train_sentences
from .fidelity import config_label, cosine_summary, embeddings, load_eval_sets
from .linearize import linearize, linearized_layers

__all__ = ["DistillConfig", "distill"]

TRAINING_PASSAGE_MAX_TOKENS = 384  # passages for training are cut here: long enough to exceed a window of 64


@dataclass(frozen=True)
class DistillConfig(Config):
    """Options of :func:`distill` (CLI flags of the same names, with dashes).

    Attributes:
        attention: the student's mechanism, a registry dict (``{"name": "hedgehog", "window": 0}``).
        minutes: training-time budget.
        stage1_fraction: share of the budget for attention transfer (mechanisms with explicit
            weights only; otherwise all the time goes to stage 2).
        batch_sentences: sentences per sentence step.
        batch_passages: passages per passage step.
        passage_every: every this many steps is a passage step (0: sentences only).
        lr_maps: learning rate of the mechanism's parameters.
        lr_model: learning rate of the pretrained parameters in stage 2 (0 freezes them).
        ckpt_every: steps between checkpoints.
        seed: data order and any initialisation.
        eval_sentences, eval_passages: held-out texts for fidelity before and after.
    """

    attention: dict
    minutes: float = 15.0
    stage1_fraction: float = 0.2
    batch_sentences: int = 32
    batch_passages: int = 2
    passage_every: int = 2
    lr_maps: float = 1e-2
    lr_model: float = 5e-5
    ckpt_every: int = 100
    seed: int = 0
    eval_sentences: int = 1000
    eval_passages: int = 200

    renamed = {"checkpoint_every": "ckpt_every"}  # one name with TrainConfig's

    def __post_init__(self) -> None:
        attention_config_from_dict(dict(self.attention))  # raises for unknown mechanisms/options
        if not self.minutes > 0:
            raise ValueError(f"DistillConfig: minutes must be > 0, got {self.minutes}")
        if not 0 <= self.stage1_fraction <= 1:
            raise ValueError(f"DistillConfig: stage1_fraction must be in [0, 1], got {self.stage1_fraction}")
        for name in ("batch_sentences", "batch_passages", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"DistillConfig: {name} must be >= 1, got {getattr(self, name)}")


# ---------------------------------------------------------------------------------------------
# Data: a deterministic stream of batches whose position is two integers
# ---------------------------------------------------------------------------------------------


class _Stream:
    """Items in a fresh seeded permutation each epoch; ``pos`` counts items served so far."""

    def __init__(self, items: list[str], seed: int) -> None:
        self.items, self.seed, self.pos = items, seed, 0

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.pos, len(self.items))
            perm = self._perm(epoch)
            out.append(self.items[perm[i]])
            self.pos += 1
        return out

    def _perm(self, epoch: int) -> list[int]:
        if getattr(self, "_epoch", None) != epoch:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._cached = torch.randperm(len(self.items), generator=g).tolist()
            self._epoch = epoch
        return self._cached


TRAINING_PASSAGE_CHARS = 1500  # ~350 tokens of this text (about 4.3 characters a token); no tokenising needed


def _train_passages(lines: list[str]) -> list[str]:
    """Consecutive training lines joined until each passage has TRAINING_PASSAGE_CHARS characters."""
    out, cur, chars = [], [], 0
    for line in lines:
        cur.append(line)
        chars += len(line) + 1
        if chars >= TRAINING_PASSAGE_CHARS:
            out.append(" ".join(cur))
            cur, chars = [], 0
    return out


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def attention_transfer_loss(student: nn.Module, batch: Encoded) -> Tensor:
    """Stage 1: sum over layers of the cross-entropy of the student's attention rows against the
    softmax rows of the same queries and keys, averaged over real queries and heads."""
    layers = linearized_layers(student)
    for layer in layers:
        layer.capture = []
    try:
        with torch.no_grad():
            student(**batch.kwargs())
        total = torch.zeros(())
        real_q = batch.attention_mask.bool()  # (B, N)
        for layer in layers:
            (q, k, kpm), = layer.capture
            scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, N, N)
            if kpm is not None:
                scores = scores.masked_fill(~kpm[:, None, None, :], float("-inf"))
            target = torch.softmax(scores, dim=-1)
            w = layer.mechanism.attention_weights(q, k, key_padding_mask=kpm)  # (B, H, N, N)
            ce = -(target * torch.log(w.clamp_min(1e-12))).sum(-1)  # (B, H, N)
            ce = ce.masked_fill(~real_q[:, None, :], 0.0)
            total = total + ce.sum() / (real_q.sum() * q.shape[1])
        return total
    finally:
        for layer in layers:
            layer.capture = None


def end_to_end_loss(student: nn.Module, teacher: nn.Module, batch: Encoded) -> Tensor:
    """Stage 2: mean over layers of normalised hidden-state MSE on real tokens, plus 1 - cosine of
    the pooled sentence embeddings."""
    with torch.no_grad():
        t = teacher(**batch.kwargs(), output_hidden_states=True)
    s = student(**batch.kwargs(), output_hidden_states=True)
    real = batch.attention_mask.bool()
    mse = torch.zeros(())
    for hs, ht in zip(s.hidden_states[1:], t.hidden_states[1:]):  # [0] is the embeddings, untouched
        mse = mse + (hs[real] - ht[real]).square().mean() / ht[real].square().mean()
    mse = mse / (len(s.hidden_states) - 1)
    cos = (mean_pool(s.last_hidden_state, batch.attention_mask)
           * mean_pool(t.last_hidden_state, batch.attention_mask)).sum(-1)
    return mse + (1 - cos).mean()


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def _optimizer(student: nn.Module, stage: int, config: DistillConfig) -> torch.optim.Optimizer:
    maps = [p for layer in linearized_layers(student) for p in layer.parameters()]
    ids = {id(p) for p in maps}
    rest = [p for p in student.parameters() if id(p) not in ids]
    train_rest = stage == 2 and config.lr_model > 0  # stage 1 trains the mechanism alone
    for p in student.parameters():
        p.requires_grad_(id(p) in ids or train_rest)
    groups = [{"params": maps, "lr": config.lr_maps}]
    if stage == 2 and config.lr_model > 0:
        groups.append({"params": rest, "lr": config.lr_model})
    return torch.optim.AdamW(groups, weight_decay=0.0)


def _save(out: Path, student: nn.Module, optimizer, state: dict) -> Path:
    from safetensors.torch import save_file

    root = out / "checkpoints"
    folder = root / f"step_{state['step']:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    sd = student.state_dict()
    tensors = {k: v.contiguous() for k, v in sd.items() if isinstance(v, Tensor)}
    extras = {k: v for k, v in sd.items() if not isinstance(v, Tensor)}  # e.g. FAVOR's generator state
    tmp = folder / "student.safetensors.tmp"
    save_file(tensors, str(tmp))
    (folder / "student.safetensors.tmp").replace(folder / "student.safetensors")
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "rng": capture_rng(torch.device("cpu")), "extras": extras}, buf)
    write_atomic(folder / "trainer.pt", buf.getvalue())
    write_atomic(folder / "state.json", (json.dumps(state, indent=1) + "\n").encode())
    fsync_dir(folder)
    write_atomic(root / "latest.json", (json.dumps({"dir": folder.name}) + "\n").encode())
    for old in root.glob("step_*"):
        if old != folder and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _latest(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest.json"
    if not pointer.is_file():
        return None
    return out / "checkpoints" / json.loads(pointer.read_text())["dir"]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def _fidelity(model, sets, teacher_emb) -> dict:
    return {s.name: cosine_summary(embeddings(model, s), teacher_emb[s.name]) for s in sets}


def distill(config: DistillConfig, out_dir: str | Path, *, resume: bool = False, result_path: str | Path | None = None,
            command: str = "", quiet: bool = False, model_and_tokenizer=None) -> dict:
    """Run (or resume) a distillation; returns and writes ``distill.json`` (also to ``result_path``)."""
    from safetensors.torch import load_file

    from ..bench.harness import OtherLoad, machine_info

    out = Path(out_dir)
    latest = _latest(out)
    if latest is not None and not resume:
        raise FileExistsError(f"{out} already holds a distillation checkpoint; pass --resume to continue it or "
                              "choose another --out")
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {out}/checkpoints")
    out.mkdir(parents=True, exist_ok=True)
    teacher, tok = model_and_tokenizer or load_pretrained()
    teacher.eval().requires_grad_(False)
    attention = attention_config_from_dict(dict(config.attention))
    student = linearize(teacher, attention)
    student.eval()  # no dropout: the student must reproduce a deterministic teacher
    torch.manual_seed(config.seed)

    sets = load_eval_sets(tok, eval_sentences=config.eval_sentences, eval_passages=config.eval_passages)
    t0 = time.perf_counter()
    teacher_emb = {s.name: embeddings(teacher, s) for s in sets}
    lines = train_sentences()
    sentences = _Stream(lines, config.seed)
    passages = _Stream(_train_passages(lines), config.seed + 1)
    has_weights = hasattr(linearized_layers(student)[0].mechanism, "attention_weights")
    budget = config.minutes * 60.0
    stage1_budget = budget * config.stage1_fraction if has_weights else 0.0

    if resume:
        state = json.loads((latest / "state.json").read_text())
        # the budget may grow on resume (train for longer); every other option must match
        same = {k: v for k, v in state["config"].items() if k != "minutes"}
        if same != {k: v for k, v in config.to_dict().items() if k != "minutes"}:
            raise ValueError(f"--resume: the checkpoint was made with {state['config']}, not {config.to_dict()}")
        state["config"] = config.to_dict()
        trainer = torch.load(latest / "trainer.pt", weights_only=False)
        sd = load_file(str(latest / "student.safetensors"))
        sd.update(trainer["extras"])
        student.load_state_dict(sd)
        optimizer = _optimizer(student, state["stage"], config)
        optimizer.load_state_dict(trainer["optimizer"])
        restore_rng(trainer["rng"], torch.device("cpu"))
        sentences.pos, passages.pos = state["data"]["sentences"], state["data"]["passages"]
    else:
        before = _fidelity(student, sets, teacher_emb)
        stage = 1 if stage1_budget > 0 else 2
        state = {"config": config.to_dict(), "step": 0, "stage": stage, "elapsed_s": 0.0, "before": before,
                 "stage1_steps": 0, "loss_log": [], "data": {"sentences": 0, "passages": 0}, "resumed": 0}
        optimizer = _optimizer(student, stage, config)
    eval_seconds = time.perf_counter() - t0
    if resume:
        state["resumed"] += 1

    load = OtherLoad()
    running: list[float] = []  # the smoothed loss of loss_log (one value)

    def before_step(step: int) -> None:
        if state["stage"] == 1 and loop.elapsed_s >= stage1_budget:
            state["stage"], state["stage1_steps"] = 2, step
            loop.optimizer = _optimizer(student, 2, config)

    def micro_loss(step: int, a: int) -> Tensor:
        passage_step = config.passage_every and step % config.passage_every == config.passage_every - 1
        texts = passages.take(config.batch_passages) if passage_step else sentences.take(config.batch_sentences)
        batch = encode(tok, texts, max_length=TRAINING_PASSAGE_MAX_TOKENS if passage_step else 128)
        if state["stage"] == 1:
            return attention_transfer_loss(student, batch)
        return end_to_end_loss(student, teacher, batch)

    def on_step(step: int, record: dict) -> None:
        state["elapsed_s"], state["step"] = loop.elapsed_s, step
        state["data"] = {"sentences": sentences.pos, "passages": passages.pos}
        value = record["loss"]
        running[:] = [value if not running else 0.95 * running[0] + 0.05 * value]
        if step % 20 == 0:
            state["loss_log"].append([step, state["stage"], round(state["elapsed_s"], 1), running[0]])

    loop = TrainingLoop(optimizer, params=None, grad_clip=1.0, budget_s=budget, log_every=20,
                        ckpt_every=config.ckpt_every, save=lambda step: _save(out, student, loop.optimizer, state),
                        before_step=before_step, on_step=on_step, desc=f"distil {config_label(config.attention)}",
                        quiet=quiet)
    run = loop.run(micro_loss, start_step=state["step"], start_elapsed_s=state["elapsed_s"],
                   checkpoint=latest if resume else None)
    stopped = run.stop_signal is not None
    result = {"command": command, "config": config.to_dict(), "label": config_label(config.attention),
              "steps": state["step"], "stage1_steps": state["stage1_steps"] if state["stage"] == 2 else state["step"],
              "training_minutes": state["elapsed_s"] / 60, "before": state["before"], "loss_log": state["loss_log"],
              "resumed": state["resumed"], "machine": machine_info(), "load": load.finish(),
              "stopped_by_signal": stopped, "eval_seconds_before": eval_seconds}
    if not stopped:
        result["after"] = _fidelity(student, sets, teacher_emb)
        result["eval_sets"] = {s.name: s.token_stats() for s in sets}
    text = json.dumps(result, indent=1)
    write_atomic(out / "distill.json", text.encode())
    if result_path is not None and not stopped:
        Path(result_path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(result_path), text.encode())
    if not quiet and "after" in result:
        for name in result["after"]:
            print(f"{name}: mean cosine {result['before'][name]['mean_cosine']:.4f} -> "
                  f"{result['after'][name]['mean_cosine']:.4f}")
    return result
