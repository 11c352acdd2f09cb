"""Language modelling on one long token stream (Shakespeare's characters, concatenated proteins):
random training windows, held-out evaluation on fixed windows, and the time and memory of one
training step at several context lengths.

Dimension legend: B batch, N context length (tokens per window), V vocabulary size.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..models import TransformerConfig, TransformerLM
from ..processes import run_process
from ..progress import say as print_line
from .common import ExperimentConfig, PeakRSS, RunFolder, masked_cross_entropy, plot_curves, train_mechanism

__all__ = ["StreamBatches", "StreamConfig", "evaluate_stream", "measure_steps", "train_on_stream"]


@dataclass(frozen=True)
class StreamConfig(ExperimentConfig):
    """Options of a language model on a token stream (see :class:`ExperimentConfig` for the shared ones).

    Attributes:
        seq_len: training and evaluation context (tokens).
        eval_tokens: held-out tokens evaluated at the end (0: all).
        eval_batch: windows per evaluation forward.
        eval_every: also evaluate every this many steps on the first 4 held-out windows.
        speed_contexts: comma-separated contexts of the step time and memory measurement (empty: skip it).
        speed_tokens: tokens per measured step (batch = max(1, speed_tokens // context)).
        step_time_budget_s: a context predicted to take longer per step is skipped.
        step_memory_budget_gib: a context predicted to need more memory per step is skipped.
        step_in_child: measure each context in a fresh child process (its own peak memory); False
            measures in this process (quick runs: no interpreter start-up per context, but memory an
            earlier measurement freed may be reused without counting).
    """

    seq_len: int = 256
    eval_tokens: int = 0
    eval_batch: int = 16
    eval_every: int = 0
    speed_contexts: str = "256,4096"
    speed_tokens: int = 8192
    step_time_budget_s: float = 60.0
    step_memory_budget_gib: float = 8.0
    step_in_child: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        for key in ("seq_len", "eval_batch", "speed_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{name}: {key} must be >= 1, got {getattr(self, key)}")
        if self.eval_tokens < 0 or self.eval_every < 0:
            raise ValueError(f"{name}: eval_tokens and eval_every must be >= 0")
        if not self.step_time_budget_s > 0 or not self.step_memory_budget_gib > 0:
            raise ValueError(f"{name}: step_time_budget_s and step_memory_budget_gib must be > 0")
        self.contexts  # noqa: B018 -- validates speed_contexts

    @property
    def contexts(self) -> tuple[int, ...]:
        """``speed_contexts`` as ints."""
        try:
            out = tuple(int(x) for x in self.speed_contexts.split(",") if x)
        except ValueError:
            raise ValueError(f"{type(self).__name__}: speed_contexts must be comma-separated ints, "
                             f"got {self.speed_contexts!r}") from None
        if any(n < 1 for n in out):
            raise ValueError(f"{type(self).__name__}: speed_contexts must be >= 1, got {self.speed_contexts!r}")
        return out


def train_on_stream(config: StreamConfig, run: RunFolder, train: np.ndarray, held: np.ndarray, *, vocab_size: int,
                    title: str, ignore: int | None = None,
                    say: Callable[..., None] = print_line) -> tuple[dict, dict]:
    """Train every mechanism on windows of ``train``, evaluate it on ``held`` (targets equal to
    ``ignore`` not counted), plot the loss curves, then measure the training step against context.
    Returns ``(records by label, step measurements by label)``."""
    batches = StreamBatches(train, seq_len=config.seq_len, batch_size=config.batch_size, steps=config.steps,
                            seed=config.seed)
    results = {}
    for name in config.labels:
        mc = config.model_config(name, vocab_size=vocab_size, max_len=config.seq_len)
        periodic = lambda m: evaluate_stream(m, held, seq_len=config.seq_len, batch_size=config.eval_batch,  # noqa: E731
                                             max_tokens=4 * config.seq_len + 1, ignore=ignore)
        model, rec = train_mechanism(name, mc, config, batches, run, evaluate=periodic,
                                     eval_every=config.eval_every, say=say)
        rec["eval"] = evaluate_stream(model, held, seq_len=config.seq_len, batch_size=config.eval_batch,
                                      max_tokens=config.eval_tokens, ignore=ignore)
        results[name] = rec
        e = rec["eval"]
        say(f"  {name}: held-out {e['bits_per_token']:.4f} bits/token, perplexity {e['perplexity']:.3f}, "
            f"accuracy {e['accuracy']:.4f}, {rec['tokens_per_second']:.0f} tokens/s")
    plot_curves(run, config.labels, title=title)
    speed = {}
    if config.contexts:
        say(f"  training step time and memory at contexts {list(config.contexts)}, ~{config.speed_tokens} "
            "tokens per step")
        for name in config.labels:
            say(f"   {name}:")
            # softmax (and any stack with a softmax layer) grows with N², the others with N
            quadratic = "softmax" in config.model_config(name, vocab_size=2, max_len=1).layer_mechanisms()
            speed[name] = measure_steps(
                lambda n, name=name: config.model_config(name, vocab_size=vocab_size, max_len=n), config.contexts,
                tokens_per_step=config.speed_tokens, quadratic=quadratic, time_budget_s=config.step_time_budget_s,
                memory_budget_bytes=int(config.step_memory_budget_gib * 2**30), in_child=config.step_in_child,
                say=say)
    return results, speed


class StreamBatches:
    """Batch ``step`` of random windows from ``tokens``: ``(ids (B, N), targets (B, N), None)``, the
    targets being the ids shifted by one. The window starts are drawn once from ``seed``, so every
    mechanism trains on the same windows in the same order."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, batch_size: int, steps: int, seed: int) -> None:
        if len(tokens) < seq_len + 2:
            raise ValueError(f"StreamBatches: {len(tokens)} tokens cannot fill a window of {seq_len} + 1")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len = seq_len
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, len(tokens) - seq_len - 1, size=(steps, batch_size))

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        idx = torch.from_numpy(self.starts[step])[:, None] + torch.arange(self.seq_len + 1)  # (B, N + 1)
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:], None


def evaluate_stream(model: TransformerLM, tokens: np.ndarray, *, seq_len: int, batch_size: int,
                    max_tokens: int = 0, ignore: int | None = None) -> dict[str, float]:
    """Mean negative log-likelihood (nats and bits) and next-token accuracy of ``model`` on
    consecutive non-overlapping windows of ``seq_len`` + 1 tokens covering the first ``max_tokens``
    of ``tokens`` (0: all). Each window starts from an empty context, as in training. Targets equal
    to ``ignore`` (a separator that is not part of the data's content) are not counted."""
    n = len(tokens) if not max_tokens else min(len(tokens), max_tokens)
    windows = (n - 1) // seq_len
    if windows < 1:
        raise ValueError(f"evaluate_stream: {n} tokens cannot fill a window of {seq_len} + 1")
    t = torch.from_numpy(tokens[: windows * seq_len + 1].astype(np.int64))
    nats, right, count = 0.0, 0, 0
    for i in range(0, windows, batch_size):
        idx = torch.arange(i, min(i + batch_size, windows))[:, None] * seq_len + torch.arange(seq_len + 1)
        w = t[idx]  # (B, N + 1)
        ids, targets = w[:, :-1], w[:, 1:]
        mask = None if ignore is None else targets != ignore
        logits = model(ids)  # (B, N, V)
        nats += masked_cross_entropy(logits, targets, mask, reduction="sum").item()
        hit = logits.argmax(-1) == targets
        right += int(hit.sum() if mask is None else (hit & mask).sum())
        count += int(targets.numel() if mask is None else mask.sum())
    mean = nats / count
    return {"nats_per_token": mean, "bits_per_token": mean / math.log(2), "perplexity": math.exp(mean),
            "accuracy": right / count, "tokens": count}


def measure_steps(make_config: Callable[[int], TransformerConfig], contexts: tuple[int, ...], *,
                  tokens_per_step: int, quadratic: bool, repeats: int = 2, time_budget_s: float = 60.0,
                  memory_budget_bytes: int = 6 * 2**30, in_child: bool = True,
                  say: Callable[..., None] = print_line) -> dict[str, Any]:
    """Time and peak memory of one training step (forward, backward, AdamW) at each context N.

    The batch is ``max(1, tokens_per_step // N)`` windows, so every N processes about the same
    number of tokens. Each N runs one warm-up step and ``repeats`` timed steps (median). Before
    running an N, its cost is predicted from the previous N: growing with batch x N² when
    ``quadratic`` (softmax's attention matrices), with batch x N otherwise; an N predicted over
    ``time_budget_s`` per step or ``memory_budget_bytes`` is
    recorded as skipped with the prediction as its reason, and so are all longer contexts. With
    ``in_child`` each N runs in a fresh child process (same thread count), so its peak RSS is its
    own and not memory an earlier measurement left with the allocator.
    Returns ``{str(N): {"seconds", "tokens_per_second", "peak_rss_bytes", "batch"} or {"skipped": reason}}``.
    """
    out: dict[str, Any] = {}
    prev: tuple[int, float, int] | None = None
    skip_reason = None
    for n in contexts:
        batch = max(1, tokens_per_step // n)
        if skip_reason is None and prev is not None:
            pn, ps, pm = prev
            pbatch = max(1, tokens_per_step // pn)
            growth = (batch * n ** (1 + quadratic)) / (pbatch * pn ** (1 + quadratic))
            t_pred, m_pred = ps * growth, pm * growth
            if t_pred > time_budget_s:
                skip_reason = f"predicted {t_pred:.0f} s per step from N = {pn} (budget {time_budget_s:.0f} s)"
            elif m_pred > memory_budget_bytes:
                skip_reason = (f"predicted {m_pred / 2**30:.1f} GiB per step from N = {pn} "
                               f"(budget {memory_budget_bytes / 2**30:.1f} GiB)")
        if skip_reason is not None:
            out[str(n)] = {"skipped": skip_reason, "batch": batch}
            say(f"    N = {n}: skipped, {skip_reason}")
            continue
        job = {"model": make_config(n).to_dict(), "batch": batch, "repeats": repeats,
               "threads": torch.get_num_threads()}
        m = _step_in_child(job) if in_child else _measure_step(job)
        s, peak = m["seconds"], m["peak_rss_bytes"]
        out[str(n)] = {"seconds": s, "tokens_per_second": batch * n / s, "peak_rss_bytes": peak, "batch": batch}
        say(f"    N = {n}, batch {batch}: {s:.2f} s per step, {batch * n / s:.0f} tokens/s, "
            f"peak {peak / 2**20:.0f} MiB")
        prev = (n, s, peak)
    return out


def _step_in_child(job: dict) -> dict[str, float]:
    """Run :func:`_measure_step` in a child process; ``{"seconds", "peak_rss_bytes"}``."""
    proc = run_process([sys.executable, "-m", __name__, json.dumps(job)], timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"step measurement (batch {job['batch']}, N = {job['model']['max_len']}) failed:\n"
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_step(job: dict) -> dict[str, float]:
    """Median time of ``repeats`` training steps after a warm-up, and the peak RSS above the level
    reached once model, optimiser and batch exist (activations, gradients, AdamW moments)."""
    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig.from_dict(job["model"])).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (job["batch"], model.config.max_len + 1))

    def step() -> None:
        loss = masked_cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    rss = PeakRSS()
    rss.start()
    step()  # warm-up; AdamW allocates its moments here, so the peak includes them once
    times = []
    for _ in range(job["repeats"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"seconds": float(np.median(times)), "peak_rss_bytes": rss.peak_bytes()}


if __name__ == "__main__":
    print(json.dumps(_measure_step(json.loads(sys.argv[1]))))
