"""Training configuration: :class:`DataConfig` and :class:`TrainConfig`, and config files.

A config file (JSON or TOML) holds ``TrainConfig.to_dict()``, or any part of it: top-level fields,
a ``[model]`` table (a whole :class:`linattn.TransformerConfig`; ``vocab_size`` and ``max_len``
are required there) and a ``[data]`` table. Missing fields take their defaults. Both classes are
:class:`linattn.config.Config` dataclasses (``to_dict``/``from_dict`` with the unknown-key check);
overrides (``lr=3e-4``, ``model.d_model=128``, ``model.attention.window=64``) are read by
:func:`linattn.config.apply_overrides`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..config import Config, apply_overrides, read_config_file
from ..models import TransformerConfig
from ..nn import LinearConfig
from .dist import MAX_COLLECTIVE_TIMEOUT_S

__all__ = [
    "DATA_SOURCES",
    "RESUMABLE_CHANGES",
    "DataConfig",
    "TrainConfig",
    "apply_overrides",
    "load_config",
]

DATA_SOURCES = ("recall", "file")
TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
PARAM_DTYPES = ("float32", "float64")
DEVICES = ("auto", "cpu", "cuda")

# Fields that may differ between a checkpoint's config and the config a run resumes with; any
# other difference would make the resumed run a different run, so resuming refuses it.
RESUMABLE_CHANGES = ("max_steps", "eval_every", "eval_batches", "ckpt_every", "keep_last", "log_every",
                     "out", "device", "collective_timeout_s")


def _int(owner: str, name: str, val: Any, lo: int) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < lo:
        raise ValueError(f"{owner}: {name} must be an int >= {lo}, got {val!r}")


def _float(owner: str, name: str, val: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """A finite number in [lo, hi] (``(lo, hi]`` with ``lo_open``; ``hi = inf``: no upper bound,
    though inf itself is refused)."""
    ok = not isinstance(val, bool) and isinstance(val, (int, float)) and math.isfinite(val)
    ok = ok and (val > lo if lo_open else val >= lo) and val <= hi
    if not ok:
        interval = ("(" if lo_open else "[") + f"{lo}, " + ("inf)" if hi == math.inf else f"{hi}]")
        raise ValueError(f"{owner}: {name} must be a number in {interval}, got {val!r}")


@dataclass(frozen=True)
class DataConfig(Config):
    """Where the tokens come from.

    Attributes:
        source: ``"recall"``, the built-in synthetic associative-recall stream (see
            :func:`linattn.train.data.recall_tokens`; identical on every machine), or ``"file"``,
            a token file read through a numpy memmap.
        path: the token file (``source="file"``): ``.npy`` (a 1-D integer array saved by
            ``numpy.save``) or ``.bin`` (raw little-endian integers of ``dtype``, no header).
        val_path: a separate validation token file; when None the last ``val_fraction`` of
            ``path`` is held out.
        dtype: element type of a ``.bin`` file (``uint16`` suits vocabularies up to 65536;
            ``uint8`` reads any file as bytes).
        val_fraction: share of ``path`` held out for validation when there is no ``val_path``.
        recall_pairs: key-value pairs per recall episode.
        recall_queries: queries per recall episode (each a key from the episode and its value).
        recall_tokens: length of the recall training stream.
        recall_val_tokens: length of the recall validation stream (a different stream).
        document_separator: the token that opens every document of a stream of documents (an
            end-of-text token between them: it ends one and, as the first token, opens the next;
            0 opens every recall episode). Set, training packs documents: the rows of a batch
            are joined into one sequence cut at every separator (and row start), no position
            attends another document, positions restart at each, and no padding is added
            (``TransformerLM.forward(..., cu_seqlens=...)``). None: rows are plain windows whose
            attention runs across whatever they contain.
    """

    source: str = field(default="recall", metadata={"choices": DATA_SOURCES})
    path: str | None = None
    val_path: str | None = None
    dtype: str = field(default="uint16", metadata={"choices": TOKEN_DTYPES})
    val_fraction: float = 0.05
    recall_pairs: int = 8
    recall_queries: int = 8
    recall_tokens: int = 1 << 20
    recall_val_tokens: int = 1 << 16
    document_separator: int | None = None

    def __post_init__(self) -> None:
        o = "DataConfig"
        if self.source not in DATA_SOURCES:
            raise ValueError(f"{o}: unknown source {self.source!r}; known: {list(DATA_SOURCES)}")
        for name in ("path", "val_path"):
            val = getattr(self, name)
            if val is not None and not isinstance(val, str):
                raise TypeError(f"{o}: {name} must be a string path or None, got {val!r}")
        if self.source == "file" and not self.path:
            raise ValueError(f"{o}: source='file' needs path (a .npy or .bin token file)")
        if self.source == "recall" and (self.path or self.val_path):
            raise ValueError(f"{o}: path/val_path are read only with source='file', got source='recall'")
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"{o}: unknown dtype {self.dtype!r}; known: {list(TOKEN_DTYPES)}")
        _float(o, "val_fraction", self.val_fraction, 0.0, 0.5, lo_open=True)
        for name in ("recall_pairs", "recall_queries"):
            _int(o, name, getattr(self, name), 1)
        for name in ("recall_tokens", "recall_val_tokens"):
            _int(o, name, getattr(self, name), 2)
        if self.document_separator is not None:
            _int(o, "document_separator", self.document_separator, 0)


def default_model() -> TransformerConfig:
    """The model of the built-in demo (and of a config file without a ``model`` table)."""
    return TransformerConfig(vocab_size=64, max_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=512,
                             attention=LinearConfig())


@dataclass(frozen=True)
class TrainConfig(Config):
    """One training run of a :class:`linattn.TransformerLM`.

    Attributes:
        model: the language model.
        data: the token source.
        seed: seeds the initial weights (same on every rank), the data order and dropout.
        batch_size: sequences per optimiser step, over all ranks and accumulation steps (the
            global batch); each micro-batch has ``batch_size / (grad_accum * world_size)``.
        seq_len: tokens per sequence (the model sees ``seq_len`` inputs and predicts ``seq_len``
            next tokens); at most ``model.max_len``.
        grad_accum: micro-batches accumulated per optimiser step on each rank.
        max_steps: optimiser steps of the run.
        lr: peak learning rate.
        min_lr_ratio: the cosine decays from ``lr`` to ``lr * min_lr_ratio``.
        warmup_steps: linear warm-up from ``lr / warmup_steps`` to ``lr``.
        decay_steps: the step where the cosine reaches its floor; None means ``max_steps``
            (set it to extend ``max_steps`` on resume without changing the schedule so far).
        weight_decay: AdamW decoupled weight decay, on matrices and embeddings (parameters with
            2 or more dimensions) only, not on biases and norm gains.
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        grad_clip: clip the global gradient norm to this; None or 0 disables clipping.
        bf16: run forward and loss under ``torch.autocast(dtype=torch.bfloat16)``; parameters,
            gradients and optimiser state stay in ``dtype``.
        dtype: parameter dtype, ``"float32"`` or ``"float64"``.
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``; under
            ``torchrun`` each rank takes ``cuda:LOCAL_RANK``.
        eval_every: evaluate the validation loss every this many steps and at the end; 0: never.
        eval_batches: validation batches of ``batch_size`` sequences per evaluation (always the
            same leading windows of the validation stream).
        ckpt_every: checkpoint every this many steps; 0: only at the end and on SIGINT/SIGTERM.
        keep_last: checkpoints kept in ``out/checkpoints`` (older ones are deleted).
        log_every: append a ``metrics.jsonl`` record, and update the progress bar's loss and
            tokens/s, every this many steps (and at the last step).
        out: folder of ``train_config.json``, ``metrics.jsonl`` and ``checkpoints/``.
        context_parallel: P, the ranks that share each sequence (context parallelism,
            :mod:`linattn.distributed`): each holds ``seq_len / P`` consecutive tokens of the same
            sequences, and the layers pass state summaries (recurrent mechanisms), halos (local
            attention, the short convolution) or keys and values (softmax) between them. The
            world size must be a multiple of P; its ``world_size / P`` groups split the batch as
            data parallelism does. 1: off. Every layer needs a sharded form (all causal
            mechanisms but LSH); not with ``data.document_separator``.
        collective_timeout_s: seconds a rank waits in a collective (an all-reduce, a barrier)
            for the other ranks before giving up: with several processes, a rank that stopped or
            is stuck then ends the run with one line naming what timed out, and the last
            checkpoint is kept. Under nccl the same timeout arms its watchdog, which aborts the
            process instead. Raise it when writing a checkpoint (the other ranks wait for rank 0)
            or a rank's data can take longer. inf: no limit (in practice ten years, the most
            torch.distributed holds).
    """

    model: TransformerConfig = field(default_factory=default_model)
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 0
    batch_size: int = 32
    seq_len: int = 128
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    bf16: bool = False
    dtype: str = field(default="float32", metadata={"choices": PARAM_DTYPES})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 500
    keep_last: int = 2
    log_every: int = 10
    out: str = "runs/train"
    context_parallel: int = 1
    # torch's default is 30 minutes of a stalled run; the longest legitimate wait here is the other
    # ranks waiting for rank 0 to write a checkpoint, which takes seconds for the models this trains
    collective_timeout_s: float = 300.0

    renamed = {"out_dir": "out"}  # a class attribute (no annotation), not a field

    def __post_init__(self) -> None:
        o = "TrainConfig"
        if not isinstance(self.model, TransformerConfig):
            raise TypeError(f"{o}: model must be a TransformerConfig, got {type(self.model).__name__}")
        if not isinstance(self.data, DataConfig):
            raise TypeError(f"{o}: data must be a DataConfig, got {type(self.data).__name__}")
        # A language model needs a causal form in every layer; say so before building anything.
        self.model.check_form("causal", owner=f"{o}: model", user="a language model")
        _int(o, "seed", self.seed, 0)
        for name in ("batch_size", "seq_len", "grad_accum", "max_steps", "eval_batches", "keep_last", "log_every"):
            _int(o, name, getattr(self, name), 1)
        for name in ("warmup_steps", "eval_every", "ckpt_every"):
            _int(o, name, getattr(self, name), 0)
        if self.decay_steps is not None:
            _int(o, "decay_steps", self.decay_steps, 1)
        _int(o, "context_parallel", self.context_parallel, 1)
        if self.context_parallel > 1:
            self.model.check_form("sharded", owner=f"{o}: model", user="context parallelism")
            if self.seq_len % self.context_parallel:
                raise ValueError(f"{o}: context_parallel = {self.context_parallel} must divide seq_len = {self.seq_len} "
                                 "(each rank holds seq_len / context_parallel tokens of every sequence)")
            if self.data.document_separator is not None:
                raise ValueError(f"{o}: context_parallel = {self.context_parallel} with data.document_separator = "
                                 f"{self.data.document_separator}: packed documents are not sharded across ranks")
        t = self.collective_timeout_s
        if not (t == math.inf or (not isinstance(t, bool) and isinstance(t, (int, float))
                                  and 0 < t <= MAX_COLLECTIVE_TIMEOUT_S)):
            raise ValueError(f"{o}: collective_timeout_s must be a number of seconds in (0, "
                             f"{MAX_COLLECTIVE_TIMEOUT_S:.0f}] (ten years, the longest wait torch.distributed's "
                             f"clocks hold) or inf (no limit), got {t!r}")
        if self.seq_len > self.model.max_len:
            raise ValueError(f"{o}: seq_len = {self.seq_len} exceeds model.max_len = {self.model.max_len}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"{o}: grad_accum = {self.grad_accum} must divide batch_size = {self.batch_size}")
        _float(o, "lr", self.lr, 0.0, math.inf, lo_open=True)
        _float(o, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _float(o, "weight_decay", self.weight_decay, 0.0, math.inf)
        _float(o, "eps", self.eps, 0.0, math.inf, lo_open=True)
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ValueError(f"{o}: betas must be two numbers (beta1, beta2), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _float(o, f"betas[{i}]", b, 0.0, 1.0)
            if b == 1.0:
                raise ValueError(f"{o}: betas[{i}] must be < 1, got {b!r}")
        if self.grad_clip is not None:
            _float(o, "grad_clip", self.grad_clip, 0.0, math.inf)
        if not isinstance(self.bf16, bool):
            raise TypeError(f"{o}: bf16 must be a bool, got {self.bf16!r}")
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"{o}: unknown dtype {self.dtype!r}; known: {list(PARAM_DTYPES)}")
        if self.bf16 and self.dtype != "float32":
            raise ValueError(f"{o}: bf16 autocast needs dtype='float32' parameters, got dtype={self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"{o}: device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not isinstance(self.out, str) or not self.out.strip():
            raise ValueError(f"{o}: out must be a non-empty path string, got {self.out!r}")
        sep = self.data.document_separator
        if sep is not None and sep >= self.model.vocab_size:
            raise ValueError(f"{o}: data.document_separator = {sep} is not a token of model.vocab_size = "
                             f"{self.model.vocab_size}")
        if self.data.source == "recall":
            n_keys = (self.model.vocab_size - 2) // 2
            if n_keys < self.data.recall_pairs:
                raise ValueError(
                    f"{o}: the recall task with recall_pairs = {self.data.recall_pairs} needs "
                    f"model.vocab_size >= {2 + 2 * self.data.recall_pairs}, got {self.model.vocab_size}"
                )

    def check_processes(self, world_size: int) -> None:
        """Raise ValueError unless ``world_size`` processes can run this config: ``context_parallel``
        must divide it, and ``batch_size`` must split over its data-parallel groups and
        ``grad_accum``. :func:`linattn.train.train` checks it before joining a process group, so
        that every rank refuses at once and none waits for the others."""
        _int("check_processes", "world_size", world_size, 1)
        P = self.context_parallel
        if world_size % P:
            raise ValueError(f"TrainConfig: context_parallel = {P} must divide the number of processes {world_size} "
                             f"(each group of {P} consecutive ranks shares its sequences)")
        groups = world_size // P
        if self.batch_size % (self.grad_accum * groups):
            raise ValueError(
                f"TrainConfig: batch_size = {self.batch_size} must be divisible by grad_accum * data-parallel groups = "
                f"{self.grad_accum} * {groups} ({world_size} processes, context_parallel = {P})"
            )

    @property
    def schedule_steps(self) -> int:
        """The step where the cosine reaches its floor."""
        return self.max_steps if self.decay_steps is None else self.decay_steps


def config_from_dict(d: Mapping[str, Any], overrides: Iterable[str] = ()) -> TrainConfig:
    """A :class:`TrainConfig` from a config file's dict with ``overrides`` (see
    :func:`linattn.config.apply_overrides`) applied before validation, so that they can repair or
    complete it; a dict without a ``model`` table gets the default model's for them to edit."""
    d = dict(d)
    d.setdefault("model", default_model().to_dict())
    return TrainConfig.from_dict(apply_overrides(d, overrides, str_fields=TrainConfig.str_fields()))


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """A :class:`TrainConfig` from a ``.json`` or ``.toml`` file (None: the defaults), with
    ``overrides`` applied on top (:func:`config_from_dict`). A file's ``model`` table is a whole
    model config; without one, the default model is kept and overrides edit it."""
    return config_from_dict({} if path is None else read_config_file(path), overrides)
