"""Language modelling on one long token stream (Shakespeare's characters, concatenated proteins):
random training windows, held-out evaluation on fixed windows, and the time and memory of one
training step at several context lengths.

Dimension legend: B batch, N context length (tokens per window), V vocabulary size.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np
import torch

from ..models import TransformerConfig, TransformerLM
from .common import PeakRSS, masked_cross_entropy

__all__ = ["StreamBatches", "evaluate_stream", "measure_steps"]


class StreamBatches:
    """Batch ``step`` of random windows from ``tokens``: ``(ids (B, N), targets (B, N), None)``, the
    targets being the ids shifted by one. The window starts are drawn once from ``seed``, so every
    contender trains on the same windows in the same order."""

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
                  memory_budget_bytes: int = 6 * 2**30, say: Callable[..., None] = print) -> dict[str, Any]:
    """Time and peak memory of one training step (forward, backward, AdamW) at each context N.

    The batch is ``max(1, tokens_per_step // N)`` windows, so every N processes about the same
    number of tokens. Each N runs one warm-up step and ``repeats`` timed steps (median). Before
    running an N, its cost is predicted from the previous N: growing with batch x N² when
    ``quadratic`` (softmax's attention matrices), with batch x N otherwise; an N predicted over ``time_budget_s`` per step or ``memory_budget_bytes`` is
    recorded as skipped with the prediction as its reason, and so are all longer contexts.
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
        torch.manual_seed(0)
        model = TransformerLM(make_config(n)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, model.config.vocab_size, (batch, n + 1))

        def step() -> None:
            loss = masked_cross_entropy(model(ids[:, :-1]), ids[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        rss = PeakRSS()
        rss.start()
        step()  # warm-up; AdamW allocates its moments here, so the peak includes them once
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        peak = rss.peak_bytes()
        s = float(np.median(times))
        out[str(n)] = {"seconds": s, "tokens_per_second": batch * n / s, "peak_rss_bytes": peak, "batch": batch}
        say(f"    N = {n}, batch {batch}: {s:.2f} s per step, {batch * n / s:.0f} tokens/s, "
            f"peak {peak / 2**20:.0f} MiB")
        prev = (n, s, peak)
        del model, opt
    return out
