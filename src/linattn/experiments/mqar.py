"""Multi-query associative recall (MQAR, Zoology: Arora et al., arXiv 2312.04927): how much a
fixed-size state can recall, as a grid of mechanisms x model width x number of key-value pairs.

Each example is ``N = seq_len`` tokens: ``P = num_kv_pairs`` key-value pairs ``k_1 v_1 .. k_P v_P``
at the start, then every key once more as a query somewhere later; the model must predict, at each
query, the value its key was paired with. Loss and accuracy count those P predictions only. A
mechanism with an exact lookup (softmax) solves it at any width; one whose state is a fixed
``D x D`` matrix per head has to fit P associations into it, which is where kernel linear attention
fails at small width and the delta rule (which overwrites instead of only adding) does better
(arXiv 2406.06484).

The data, as Zoology defines it, with every choice this module had to make:

- Vocabulary of V = ``vocab_size`` ids: keys are ids ``1 .. V//2 - 1`` and values ``V//2 .. V - 1``
  (Zoology's split of one vocabulary into halves). Within an example the P keys are distinct and
  the P values are distinct (both drawn without replacement, as Zoology draws them).
- Positions ``0 .. 2P - 1`` hold ``k_1 v_1 k_2 v_2 .. k_P v_P``.
- The rest, positions ``2P .. N - 1``, is cut into ``S = (N - 2P) // 2`` two-token slots; slot s
  starts at position ``2P + 2s``. The P queries take P distinct slots drawn without replacement
  with probability proportional to ``(s + 1) ** (power_a - 1)`` (Zoology's power law, its
  ``power_a = 0.01``: queries tend to come soon after the pairs, as repeated words do in text); key
  i is queried in the i-th slot drawn. The query key sits on the slot's first position, and the
  target there is its value. Zoology's sequence is ``N + 1`` tokens shifted by one into inputs and
  targets, so the value is the target at the query and never an input token; the same here.
- Every other position (the second token of every slot, the slots left unqueried, an odd last
  position) is filler with no target, never scored: id 0 (no key or value uses it) by default, as
  in Zoology's published MQAR configurations (``random_non_queries=False``), or with
  ``random_non_queries=True`` (its generator's default) an id uniform over all V ids, which can
  equal a key or a value: a harder task with distractors.
- Needs ``S >= P`` (``N >= 4P``) and ``V // 2 - 1 >= P``; anything else is refused by name.

Generation is counter-based: every random draw is the splitmix64 hash
(:func:`linattn.train.data.splitmix64`) of (seed, stream, batch index, row, draw, slot), so a batch
is a pure function of those numbers and identical on every machine (integer arithmetic; the slot
race uses ``log`` of a float64 uniform, whose last-bit differences between libms could only swap
two race keys equal to 1e-16, never seen). Training batch ``i`` is stream 0, index i; the
held-out examples are stream 1. Slots are drawn without replacement by the exponential race of
Efraimidis and Spirakis (2006): the P largest ``log(u_s) / w_s`` are a weighted draw without
replacement in drawing order, the distribution of Zoology's sequential draw.

Where this differs from Zoology, and why:

- Scale. Zoology trains on a GPU: vocabulary 8192, 100,000 fixed training examples for 64 epochs
  in batches of up to 512, widths 64 to 512, sequences 64 to 512 with 4 to 64 pairs, learning
  rates logspace(1e-4, 1e-2, 4). Here the grid must finish on a 2-core CPU in about two hours, so
  the vocabulary is smaller (``vocab_size``, 64 by default), training batches are fresh examples
  every step (an endless stream, not epochs of a fixed set: nothing to memorise), the steps are
  far fewer, the learning rates are the top of Zoology's range, and the default tasks hold N at
  64 and vary P (4, 8, 16; at P = 16 every one of the 16 query slots is used, so the power law
  only orders them). A cell that fails here might succeed with more steps.
- Heads. One head by default (``n_heads = 1``); a recurrent state is then one C x C matrix.
  RetNet's fixed decay is then the single 1 - 2^-5 (a memory of about 32 tokens), which is
  RetNet's own recipe at H = 1, not a choice made against it.
- Model. The same TransformerLM for every mechanism: ``n_layers`` blocks, learned positions,
  ``n_heads`` heads, and by default no MLP (``ff_ratio = 0``: attention-only blocks, Zoology's
  identity "state mixer"; ``ff_ratio * d_model`` is the MLP width otherwise). Every attention layer
  has the same short causal convolution (``short_conv``) in front of it (DeltaNet's recipe; it
  lets a layer see the previous token, which binds a value to its key). The learning rate is swept over ``lrs`` per cell and the best held-out accuracy kept,
  as Zoology does.
- Accuracy is measured once, after the last step, on ``eval_examples`` held-out examples: the
  fraction of queries whose arg-max over all V ids is the right value.

State size (:func:`state_bytes`): bytes of one layer's decoding state for one sequence of length
N in float32, so accuracy can be read against memory: softmax's KV cache grows with N, the others
do not.

Dimension legend: B batch, N sequence length, P pairs, S query slots, V vocabulary, C width, H
heads, D = C / H head width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from ..functional.feature_maps import FEATURE_MAPS
from ..models import TransformerLM
from ..nn.registry import AttentionConfig, attention_config, spec_for
from ..processes import spawn_pool
from ..progress import say as print_line
from ..train.data import mix_seed, splitmix64
from .common import (CannotRunError, ExperimentConfig, RunFolder, finish_run, masked_cross_entropy, start_run,
                     train_mechanism)

__all__ = ["MqarConfig", "markdown_tables", "mqar_batch", "run_mqar", "state_bytes"]

FLOAT_BYTES = 4  # states are float32 in these runs
EVAL_CHUNK = 64  # held-out examples are generated and scored in batches of this many

# draw offsets of the counter: one range per kind of draw, so no two draws share a counter
_KEYS, _VALUES, _SLOTS, _NOISE = 0, 1 << 24, 2 << 24, 3 << 24


def _check_tuple(owner: str, name: str, value: Any, kind: type, minimum: float, unique: bool = True) -> tuple:
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{owner}: {name} must be a non-empty list such as [32, 64] (JSON on the command line), "
                         f"got {value!r}")
    value = tuple(value)
    for x in value:
        if isinstance(x, bool) or not isinstance(x, kind if kind is int else (int, float)) or not x >= minimum:
            what = "an int" if kind is int else "a number"
            raise ValueError(f"{owner}: every entry of {name} must be {what} >= {minimum}, got {value!r}")
    if unique and len(set(value)) != len(value):
        raise ValueError(f"{owner}: {name} has an entry twice: {value!r}")
    return value


def check_task(owner: str, *, seq_len: int, num_kv_pairs: int, vocab_size: int) -> None:
    """Raise ValueError unless P pairs and their P queries fit in N tokens and the key vocabulary."""
    if num_kv_pairs < 1:
        raise ValueError(f"{owner}: num_kv_pairs must be >= 1, got {num_kv_pairs}")
    slots = (seq_len - 2 * num_kv_pairs) // 2
    if slots < num_kv_pairs:
        raise ValueError(f"{owner}: {num_kv_pairs} pairs need seq_len >= 4 * {num_kv_pairs} = {4 * num_kv_pairs} "
                         f"(2P tokens of pairs, then P query slots of 2 tokens), got seq_len = {seq_len}")
    n_keys = vocab_size // 2 - 1
    if n_keys < num_kv_pairs:
        raise ValueError(f"{owner}: {num_kv_pairs} distinct keys need vocab_size >= {2 * (num_kv_pairs + 1)} "
                         f"(keys are ids 1 .. V//2 - 1), got vocab_size = {vocab_size} ({n_keys} keys)")


def mqar_batch(*, batch_size: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float = 0.01,
               random_non_queries: bool = False, seed: int = 0, stream: int = 0,
               index: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``index`` of MQAR stream ``stream`` (0 training, 1 held-out): ``ids (B, N)``,
    ``targets (B, N)`` and ``mask (B, N)``, True exactly at the P query positions of each row,
    where ``targets`` holds the queried key's value (0 elsewhere, never scored).

    A pure function of its arguments (counter-based splitmix64 draws; the module docstring gives
    the layout). ValueError when the pairs do not fit (see :func:`check_task`).
    """
    B, N, P, V = batch_size, seq_len, num_kv_pairs, vocab_size
    check_task("mqar_batch", seq_len=N, num_kv_pairs=P, vocab_size=V)
    if B < 1 or not power_a > 0:
        raise ValueError(f"mqar_batch: batch_size must be >= 1 and power_a > 0, got {B}, {power_a}")
    n_keys, n_vals, S = V // 2 - 1, V - V // 2, (N - 2 * P) // 2
    row = splitmix64(np.arange(B, dtype=np.uint64) ^ np.uint64(mix_seed(0x3A9, seed, stream, index)))  # (B,)

    def draw(offset: int, count: int) -> np.ndarray:  # (B, count) uint64 hashes of (row, offset + j)
        return splitmix64(row[:, None] ^ (np.uint64(offset) + np.arange(count, dtype=np.uint64))[None, :])

    # a random permutation's first P entries: P distinct keys, P distinct values
    keys = 1 + np.argsort(draw(_KEYS, n_keys), axis=1, kind="stable")[:, :P]  # (B, P)
    vals = V // 2 + np.argsort(draw(_VALUES, n_vals), axis=1, kind="stable")[:, :P]  # (B, P)
    # weighted draw of P slots without replacement (exponential race): the P largest log(u) / w
    u = ((draw(_SLOTS, S) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # (B, S) in (0, 1)
    w = np.arange(1, S + 1, dtype=np.float64) ** (power_a - 1)  # (S,) Zoology's power law
    slots = np.argsort(-(np.log(u) / w), axis=1, kind="stable")[:, :P]  # (B, P), in drawing order
    if random_non_queries:  # (B, N) filler everywhere first
        ids = (draw(_NOISE, N) % np.uint64(V)).astype(np.int64)
    else:
        ids = np.zeros((B, N), dtype=np.int64)
    ids[:, 0 : 2 * P : 2] = keys
    ids[:, 1 : 2 * P : 2] = vals
    query = 2 * P + 2 * slots  # (B, P) positions of the queries: key i at its slot's first token
    np.put_along_axis(ids, query, keys, axis=1)
    targets = np.zeros((B, N), dtype=np.int64)
    np.put_along_axis(targets, query, vals, axis=1)
    mask = np.zeros((B, N), dtype=bool)
    np.put_along_axis(mask, query, True, axis=1)
    return torch.from_numpy(ids), torch.from_numpy(targets), torch.from_numpy(mask)


def state_bytes(attention: AttentionConfig, *, d_model: int, n_heads: int, seq_len: int) -> int | None:
    """Bytes of one layer's decoding state for one sequence of ``seq_len`` tokens, float32 (C =
    ``d_model``, H = ``n_heads``, D = C / H, N = ``seq_len``):

    - softmax: the KV cache, ``2 N C`` floats (grows with N);
    - linear: ``S (H, F, D)`` and the normaliser ``z (H, F)``, F the feature map's width (D for elu);
    - favor: the same with F = m random features (2m for trig) plus a running scale per head;
    - local: the ring of the last ``window`` keys and values, ``2 W C`` floats, and a valid flag
      (1 byte) per slot;
    - retnet, gla, deltanet, gated_deltanet: one ``(H, D, D)`` matrix.

    The short convolution's ``(K - 1) C`` floats, the same for every mechanism, are not counted.
    None for a mechanism with no recurrent form (LSH).
    """
    spec = spec_for(attention)
    C, H, N = d_model, n_heads, seq_len
    D = C // H
    if spec.name == "softmax":
        return 2 * N * C * FLOAT_BYTES
    if spec.name == "linear":
        F = FEATURE_MAPS[attention.feature_map](torch.zeros(1, D)).shape[-1]
        return (H * F * D + H * F) * FLOAT_BYTES
    if spec.name == "favor":
        F = attention.num_features * (2 if attention.features == "trig" and attention.kernel == "softmax" else 1)
        return (H * F * D + H * F + H) * FLOAT_BYTES
    if spec.name == "local":
        return 2 * attention.window * C * FLOAT_BYTES + attention.window
    if spec.name in ("retnet", "gla", "deltanet", "gated_deltanet", "kda"):
        return H * D * D * FLOAT_BYTES  # one (D, D) matrix per (value) head, whatever n_key_heads
    if not spec.recurrent:
        return None
    raise ValueError(f"state_bytes: no formula for {spec.name!r} attention; add one beside the others")


@dataclass(frozen=True)
class MqarConfig(ExperimentConfig):
    """MQAR's options (see :class:`ExperimentConfig` for the shared ones). Every cell of the grid
    (mechanism x width x task) trains once per learning rate with everything else equal.

    ``d_model``, ``d_ff`` and ``lr`` are not settings of MQAR: each cell sets them from ``widths``,
    ``ff_ratio`` times the width and each of ``lrs`` (:attr:`replaced_by`), so giving one is refused
    and config.json leaves them out.

    Attributes:
        widths: the model widths d_model of the grid (each must be divisible by n_heads).
        num_kv_pairs: P of each task; the tasks are ``zip(num_kv_pairs, seq_lens)``.
        seq_lens: N of each task, one per entry of num_kv_pairs (N >= 4P).
        lrs: the learning rates tried in every cell; the best held-out accuracy is kept.
        vocab_size: V; keys are ids 1 .. V//2 - 1, values V//2 .. V - 1 (needs V//2 - 1 >= P).
        power_a: the queries' slots are drawn with probability proportional to (s + 1)^(power_a - 1).
        random_non_queries: fill the unscored positions with random ids instead of id 0.
        ff_ratio: the MLP's hidden width is ff_ratio * d_model; 0 = attention-only blocks (Zoology's).
        eval_examples: held-out examples (stream 1) scored after the last step.
        workers: training runs at once, each in its own process with ``threads`` threads; the
            results do not depend on it (every run is a function of its settings), only the wall time.
    """

    # seconds, not minutes: what the tests run (2 tasks x 2 widths x 4 models x 2 learning rates)
    quick_settings: ClassVar[dict[str, Any]] = dict(
        mechanisms=(attention_config("softmax"), attention_config("linear"), attention_config("deltanet")),
        hybrids=(attention_config("linear"),), widths=(16, 32), num_kv_pairs=(2, 4), seq_lens=(16, 32),
        lrs=(3e-3, 1e-2), vocab_size=32, steps=24, batch_size=8, warmup_steps=2, log_every=4, eval_examples=32,
        workers=1)
    replaced_by: ClassVar[dict[str, str]] = {"d_model": "widths", "d_ff": "ff_ratio", "lr": "lrs"}

    mechanisms: tuple[AttentionConfig, ...] = (
        attention_config("softmax"), attention_config("linear"), attention_config("favor", num_features=64),
        attention_config("local", window=32), attention_config("retnet"), attention_config("gla"),
        attention_config("deltanet"), attention_config("gated_deltanet"))
    hybrids: tuple[AttentionConfig, ...] = (attention_config("linear"),)
    # Zoology's MQAR model (arXiv 2312.04927, its published configurations): 2 attention-only blocks
    # (ff_ratio 0: no MLP), 1 head, filler id 0, a learning-rate sweep whose top is 1e-2. Sized
    # for this 2-core machine (two workers of one thread): N is held at 64 and the pairs vary
    # (P = 16 fills all 16 query slots). Probes before the run, softmax only: 1 head at d 64, P 8
    # solved (loss < 0.02) by step 800 at lr 3e-3 and by 400 at 1e-2; at d 32, P 16 it was still at
    # chance after 4000 steps at 3e-3 and solved from about step 1600 at 1e-2. Longer tasks (N 128,
    # P 8: 43% after 400 steps) would not fit the steps two hours allow across 9 models.
    n_heads: int = 1
    short_conv: int = 4
    steps: int = 1500
    batch_size: int = 32
    warmup_steps: int = 150
    weight_decay: float = 0.1
    log_every: int = 50
    widths: tuple[int, ...] = (32, 64, 128)
    num_kv_pairs: tuple[int, ...] = (4, 8, 16)
    seq_lens: tuple[int, ...] = (64, 64, 64)
    lrs: tuple[float, ...] = (3e-3, 1e-2)
    vocab_size: int = 64
    power_a: float = 0.01
    random_non_queries: bool = False
    ff_ratio: int = 0
    eval_examples: int = 256
    workers: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        # tasks are named by their number of pairs (tables, plots, targets): P must differ, N may repeat
        for field, kind, lo, unique in (("widths", int, 1, True), ("num_kv_pairs", int, 1, True),
                                        ("seq_lens", int, 1, False), ("lrs", float, 1e-12, True)):
            value = _check_tuple(name, field, getattr(self, field), kind, lo, unique)
            object.__setattr__(self, field, value)
        if len(self.num_kv_pairs) != len(self.seq_lens):
            raise ValueError(f"{name}: num_kv_pairs and seq_lens pair up into tasks and must have one entry each, "
                             f"got {list(self.num_kv_pairs)} and {list(self.seq_lens)}")
        for w in self.widths:
            if w % self.n_heads:
                raise ValueError(f"{name}: n_heads = {self.n_heads} must divide every width, got {w}")
        for P, N in self.tasks:
            check_task(name, seq_len=N, num_kv_pairs=P, vocab_size=self.vocab_size)
        if not self.power_a > 0 or self.ff_ratio < 0 or self.eval_examples < 1 or self.workers < 1:
            raise ValueError(f"{name}: power_a must be > 0, ff_ratio >= 0, eval_examples and workers >= 1, got "
                             f"{self.power_a}, {self.ff_ratio}, {self.eval_examples}, {self.workers}")

    @property
    def tasks(self) -> list[tuple[int, int]]:
        """``[(P, N), ...]``: the number of pairs and sequence length of each task."""
        return list(zip(self.num_kv_pairs, self.seq_lens))

    def check_runs(self) -> None:
        """Build the model of every cell (mechanism x width x task) and run it once on one example of
        its task, without gradients: a mechanism option that does not fit a task (an LSH bucket size
        that does not divide N) is refused naming the cell before the first run trains."""
        for P, N in self.tasks:
            ids = mqar_batch(batch_size=1, seq_len=N, num_kv_pairs=P, vocab_size=self.vocab_size, seed=self.seed)[0]
            for width in self.widths:
                cell = self.cell_config(width, self.lrs[0])
                for label in self.labels:
                    try:
                        model = TransformerLM(cell.model_config(label, vocab_size=self.vocab_size, max_len=N))
                        with torch.no_grad():
                            model(ids)
                        _cell_layers(self, label, width, N)  # the summary's state sizes, known before training
                    except (ValueError, TypeError) as e:
                        raise CannotRunError(f"{type(self).__name__}: the cell {label}, d_model {width}, {P} pairs, "
                                         f"N = {N} cannot run: {e}") from None

    def cell_config(self, width: int, lr: float) -> ExperimentConfig:
        """The shared fields of this config with d_model = ``width``, d_ff = ff_ratio * width and
        lr = ``lr``: what one training run of the grid reads."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ExperimentConfig)}
        return ExperimentConfig(**{**shared, "d_model": width, "d_ff": self.ff_ratio * width, "lr": lr})


def _held_out(config: MqarConfig, P: int, N: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out, done = [], 0
    while done < config.eval_examples:
        n = min(EVAL_CHUNK, config.eval_examples - done)
        out.append(mqar_batch(batch_size=n, seq_len=N, num_kv_pairs=P, vocab_size=config.vocab_size,
                              power_a=config.power_a, random_non_queries=config.random_non_queries,
                              seed=config.seed, stream=1, index=len(out)))
        done += n
    return out


def _evaluate(held: list):
    def evaluate(model) -> dict[str, float]:
        loss_sum, right, count = 0.0, 0, 0
        for ids, targets, mask in held:
            logits = model(ids)  # (B, N, V)
            loss_sum += masked_cross_entropy(logits, targets, mask, reduction="sum").item()
            right += int(((logits.argmax(-1) == targets) & mask).sum())
            count += int(mask.sum())
        return {"loss": loss_sum / count, "accuracy": right / count}

    return evaluate


def _train_run(config: MqarConfig, label: str, P: int, N: int, width: int, lr: float,
               metrics_dir: str) -> dict[str, Any]:
    """Train one run of the grid (model ``label`` at this task, width and learning rate) and return
    its record. Module-level and a function of its arguments only, so that a worker process can
    run it: the data are regenerated from their counters, never sent."""
    torch.set_num_threads(config.threads)
    evaluate = _evaluate(_held_out(config, P, N))

    def batches(step: int):
        return mqar_batch(batch_size=config.batch_size, seq_len=N, num_kv_pairs=P, vocab_size=config.vocab_size,
                          power_a=config.power_a, random_non_queries=config.random_non_queries, seed=config.seed,
                          stream=0, index=step)

    cc = config.cell_config(width, lr)
    mc = cc.model_config(label, vocab_size=config.vocab_size, max_len=N)
    _, rec = train_mechanism(_run_label(label, P, N, width, lr), mc, cc, batches, RunFolder(metrics_dir),
                             evaluate=evaluate, say=lambda *a, **k: None, quiet=True)
    return rec


def _train_job(job: tuple[MqarConfig, tuple[int, int, int, str, float], str]) -> tuple[tuple, dict[str, Any]]:
    """``(key, record)`` of the run ``key = (P, N, width, label, lr)``: :func:`_train_run` in the
    form a pool maps."""
    config, key, metrics_dir = job
    P, N, width, label, lr = key
    return key, _train_run(config, label, P, N, width, lr, metrics_dir)


def _run_label(label: str, P: int, N: int, width: int, lr: float) -> str:
    return f"{label} P{P} N{N} d{width} lr{lr:g}"


def _cell_layers(config: MqarConfig, label: str, width: int, N: int) -> list[int | None]:
    """State bytes of every layer of the model labelled ``label`` at this width and length."""
    attention, overrides = config.layouts()[label]
    return [state_bytes(overrides.get(i, attention), d_model=width, n_heads=config.n_heads, seq_len=N)
            for i in range(config.n_layers)]


def _targets(config: MqarConfig, cells: list[dict]) -> dict[str, dict[str, Any]]:
    """The issue's targets, judged from the cells: ``{target: {"holds": bool or None, "figures": str}}``
    (None: the grid cannot judge it, e.g. the mechanism is not in it)."""
    acc = {(c["mechanism"], c["num_kv_pairs"], c["d_model"]): c["best_accuracy"] for c in cells}
    out: dict[str, dict[str, Any]] = {}
    soft = [(P, w, acc[("softmax", P, w)]) for P, _ in config.tasks for w in config.widths if ("softmax", P, w) in acc]
    out["softmax >= 99% accuracy at every width"] = {
        "holds": all(a >= 0.99 for *_, a in soft) if soft else None,
        "figures": "; ".join(f"P={P} d={w}: {a:.3f}" for P, w, a in soft) or "softmax not in the grid"}
    for name in ("deltanet", "gated_deltanet"):
        checks, figures = [], []
        for P, _ in config.tasks:
            below = [w for w in sorted(config.widths) if acc.get(("linear", P, w), 1.0) < 0.5]
            if not below or (name, P, below[0]) not in acc:
                continue
            a, w = acc[(name, P, below[0])], below[0]
            checks.append(a >= 0.9)
            figures.append(f"P={P}: linear {acc[('linear', P, w)]:.3f} at d={w}, {name} {a:.3f}")
        out[f"{name} >= 90% at the smallest width where linear < 50%"] = {
            "holds": all(checks) if checks else None,
            "figures": "; ".join(figures) or f"linear never below 50% with {name} beside it"}
    return out


def markdown_tables(summary: dict[str, Any]) -> list[str]:
    """One Markdown table per task: a row per mechanism, a column per width with the best held-out
    accuracy (its learning rate) and the state bytes per layer per sequence."""
    cells, lines = summary["cells"], []
    widths = sorted({c["d_model"] for c in cells})
    for P, N in dict.fromkeys((c["num_kv_pairs"], c["seq_len"]) for c in cells):
        lines += [f"**{P} pairs, sequence length {N}**: best held-out accuracy (learning rate) [state KiB per layer "
                  "per sequence]", "", "| attention | " + " | ".join(f"d_model {w}" for w in widths) + " |",
                  "| --- |" + " ---: |" * len(widths)]
        rows: dict[str, dict[int, dict]] = {}
        for c in cells:
            if (c["num_kv_pairs"], c["seq_len"]) == (P, N):
                rows.setdefault(c["mechanism"], {})[c["d_model"]] = c
        for name, per in rows.items():
            out = []
            for w in widths:
                c = per.get(w)
                if c is None:
                    out.append("-")
                    continue
                kib = " + ".join("-" if b is None else f"{b / 1024:.4g}" for b in dict.fromkeys(c["state_bytes_layers"]))
                out.append(f"{c['best_accuracy']:.3f} ({c['best_lr']:g}) [{kib}]")
            lines.append(f"| {name} | " + " | ".join(out) + " |")
        lines.append("")
    return lines


def _plot(run: RunFolder, config: MqarConfig, cells: list[dict]) -> list[str]:
    """One PNG per task: held-out accuracy against width, one line per mechanism; their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for P, N in config.tasks:
        fig, ax = plt.subplots(figsize=(5.6, 4.0))
        for label in config.labels:
            pts = sorted((c["d_model"], c["best_accuracy"]) for c in cells
                         if c["mechanism"] == label and c["num_kv_pairs"] == P)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(config.widths), [str(w) for w in config.widths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("model width d_model")
        ax.set_ylabel("held-out accuracy (best learning rate)")
        ax.set_title(f"MQAR: {P} pairs, sequence length {N}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        name = f"accuracy_P{P}_N{N}.png"
        fig.savefig(run.path / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def run_mqar(config: MqarConfig, *, quick: bool = False, command: str = "", say=print_line) -> dict[str, Any]:
    """Train every cell of the grid at every learning rate; write the run folder (summary.json,
    results.md, one accuracy plot per task, metrics/ with one file per training run) and return
    the summary."""
    run, load, t0 = start_run("mqar", config, quick=quick, command=command)
    metrics = RunFolder(run.path / "metrics")
    n_runs = len(config.tasks) * len(config.widths) * len(config.labels) * len(config.lrs)
    say(f"MQAR: tasks (pairs, length) {config.tasks}, widths {list(config.widths)}, {len(config.labels)} models, "
        f"learning rates {list(config.lrs)}: {n_runs} runs of {config.steps} steps x {config.batch_size} -> {run.path}")
    runs = [(P, N, width, label, lr) for P, N in config.tasks for width in config.widths
            for label in config.labels for lr in config.lrs]
    records = {}
    jobs = [(config, key, str(metrics.path)) for key in runs]
    with contextlib.ExitStack() as stack:
        if config.workers > 1:
            # A multiprocessing Pool, not a ProcessPoolExecutor: leaving its block by any exception
            # (a run's failure, Ctrl-C, SIGTERM) terminates the workers, where the executor would
            # wait for the runs in progress to finish; and its workers end if this process is killed.
            pool = stack.enter_context(spawn_pool(config.workers))
            done = pool.imap_unordered(_train_job, jobs)  # a run's failure raises here
        else:
            done = map(_train_job, jobs)
        for (P, N, width, label, lr), rec in done:
            records[(P, N, width, label, lr)] = rec
            say(f"  {_run_label(label, P, N, width, lr)}: held-out accuracy {rec['eval']['accuracy']:.3f}, loss "
                f"{rec['eval']['loss']:.3f}, {rec['train_seconds']:.1f} s ({len(records)}/{n_runs})")
    cells = []
    for P, N in config.tasks:
        for width in config.widths:
            for label in config.labels:
                per_lr = {lr: records[(P, N, width, label, lr)] for lr in config.lrs}
                # the best final held-out accuracy over the learning rates (ties: the first lr listed)
                best = max(config.lrs, key=lambda lr: per_lr[lr]["eval"]["accuracy"])
                layers = _cell_layers(config, label, width, N)
                cells.append({
                    "mechanism": label, "num_kv_pairs": P, "seq_len": N, "d_model": width,
                    "best_accuracy": per_lr[best]["eval"]["accuracy"], "best_lr": best,
                    "accuracy_by_lr": {f"{lr:g}": per_lr[lr]["eval"]["accuracy"] for lr in config.lrs},
                    "loss_by_lr": {f"{lr:g}": per_lr[lr]["eval"]["loss"] for lr in config.lrs},
                    "diverged_lrs": [f"{lr:g}" for lr in config.lrs if per_lr[lr]["diverged"]],
                    "parameters": per_lr[best]["parameters"],
                    "train_seconds": sum(r["train_seconds"] for r in per_lr.values()),
                    "state_bytes": next((b for b in layers if b is not None), None),
                    "state_bytes_layers": layers,
                })
    plots = _plot(run, config, cells)
    targets = _targets(config, cells)
    line = "mqar: " + ", ".join(f"{k}: {'n/a' if v['holds'] is None else 'yes' if v['holds'] else 'no'}"
                                for k, v in targets.items())
    summary = finish_run(run, "mqar", config, quick=quick, command=command, load=load, t0=t0,
                         results={"cells": cells, "targets": targets, "plots": plots}, line=line, say=say)
    verdict = {True: "holds", False: "does not hold", None: "not judged"}
    doc = ["# MQAR", "", f"Command: `{command or 'linattn experiment mqar'}`; wall time "
           f"{summary['wall_seconds'] / 60:.1f} min; {config.steps} steps of {config.batch_size} examples, vocabulary "
           f"{config.vocab_size}, {config.n_layers} layers, {config.n_heads} head(s), short convolution "
           f"{config.short_conv}.", "", *markdown_tables(summary), *(f"![{p}]({p})" for p in plots), "",
           *(f"- {k}: {verdict[v['holds']]} ({v['figures']})" for k, v in targets.items()), ""]
    (run.path / "results.md").write_text("\n".join(doc) + "\n")
    return summary
