"""The synthetic copy task (Katharopoulos et al., arXiv 2006.16236, section 4.1; Kitaev et al. arXiv
2001.04451 section 5): ``L`` random symbols, a separator, then the same ``L`` symbols again.

The model sees ``x_1 .. x_L, sep, x_1 .. x_{L-1}`` (2L tokens) and predicts the next token
everywhere; loss and accuracy count only the copied half (the L predictions after the separator),
since the first half is random and cannot be predicted. Softmax, linear, FAVOR and Reformer LSH
train the same model for the same steps on the same batches; one plot shows their loss curves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..nn.registry import AttentionConfig, attention_config
from ..progress import say as print_line
from .common import ExperimentConfig, finish_run, masked_cross_entropy, plot_curves, start_run, train_mechanism

__all__ = ["CopyConfig", "copy_batch", "run_copy"]


@dataclass(frozen=True)
class CopyConfig(ExperimentConfig):
    """The copy task's options (see :class:`ExperimentConfig` for the shared ones).

    Attributes:
        length: L, symbols to copy; the model sees 2L tokens (LSH's bucket size must divide 2L).
        symbols: alphabet size (ids 0 .. symbols - 1; the separator is id ``symbols``).
        eval_batches: held-out batches (of ``batch_size``) evaluated at the end.
        eval_every: also evaluate every this many steps (0: only at the end).
    """

    # a minute on one thread: the losses fall, files are written
    quick_settings: ClassVar[dict[str, Any]] = dict(
        length=16, d_model=32, n_heads=2, d_ff=64, steps=40, batch_size=16, warmup_steps=5, log_every=5,
        eval_batches=2, eval_every=0, mechanisms=(attention_config("softmax"), attention_config("linear"),
                                                  attention_config("favor", num_features=16), attention_config("lsh")))

    mechanisms: tuple[AttentionConfig, ...] = (attention_config("softmax"), attention_config("linear"),
                                               attention_config("favor", num_features=64), attention_config("lsh"))
    # L = 32 (65-token sequences): softmax solves it in ~500 steps, linear needs ~2500 (measured)
    steps: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 100
    log_every: int = 25
    length: int = 32
    symbols: int = 10
    eval_batches: int = 16
    eval_every: int = 500

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.length < 2 or self.symbols < 2 or self.eval_batches < 1 or self.eval_every < 0:
            raise ValueError(f"CopyConfig: length and symbols must be >= 2, eval_batches >= 1 and eval_every "
                             f">= 0, got {self.length}, {self.symbols}, {self.eval_batches}, {self.eval_every}")


def copy_batch(config: CopyConfig, step: int, *, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch ``step`` of data stream ``stream`` (0 training, 1 held-out): ``ids (B, 2L)``, ``targets
    (B, 2L)`` and ``mask (B, 2L)``, True on the copied half. A pure function of its arguments."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + stream * 7_919_113 + step)
    B, L = config.batch_size, config.length
    x = torch.randint(0, config.symbols, (B, L), generator=g)  # (B, L)
    sep = torch.full((B, 1), config.symbols, dtype=torch.long)
    seq = torch.cat([x, sep, x], dim=1)  # (B, 2L + 1)
    mask = torch.zeros(B, 2 * L, dtype=torch.bool)
    mask[:, L:] = True  # targets seq[L + 1 ..] are the copy
    return seq[:, :-1], seq[:, 1:], mask


def _evaluate(config: CopyConfig):
    held = [copy_batch(config, i, stream=1) for i in range(config.eval_batches)]

    def evaluate(model) -> dict[str, float]:
        loss_sum, right, count, exact, seqs = 0.0, 0, 0, 0, 0
        for ids, targets, mask in held:
            logits = model(ids)  # (B, 2L, V)
            loss_sum += masked_cross_entropy(logits, targets, mask, reduction="sum").item()
            hit = (logits.argmax(-1) == targets) | ~mask  # (B, 2L)
            right += int(((logits.argmax(-1) == targets) & mask).sum())
            count += int(mask.sum())
            exact += int(hit.all(dim=1).sum())
            seqs += ids.shape[0]
        return {"copy_loss": loss_sum / count, "copy_accuracy": right / count, "sequence_accuracy": exact / seqs}

    return evaluate


def run_copy(config: CopyConfig, *, quick: bool = False, command: str = "", say=print_line) -> dict[str, Any]:
    """Train every mechanism on the copy task; write the run folder and return the summary."""
    run, load, t0 = start_run("copy", config, quick=quick, command=command)
    say(f"copy task: L = {config.length}, {config.symbols} symbols, {config.steps} steps x {config.batch_size}, "
        f"d_model {config.d_model}, {config.n_layers} layers -> {run.path}")
    evaluate = _evaluate(config)
    results = {}
    for name in config.labels:
        mc = config.model_config(name, vocab_size=config.symbols + 1, max_len=2 * config.length)
        _, rec = train_mechanism(name, mc, config, lambda s: copy_batch(config, s), run, evaluate=evaluate,
                                 eval_every=config.eval_every, say=say)
        results[name] = rec
        say(f"  {name}: copy loss {rec['eval']['copy_loss']:.4f}, accuracy {rec['eval']['copy_accuracy']:.3f}, "
            f"{rec['tokens_per_second']:.0f} tokens/s")
    plot_curves(run, config.labels, title=f"copy task, L = {config.length}: training loss on the copied half",
                log_y=True)
    soft = results.get("softmax", {}).get("eval", {}).get("copy_loss")
    lin = results.get("linear", {}).get("eval", {}).get("copy_loss")
    targets = {}
    if soft is not None and lin is not None:
        # "reaches the softmax final loss": within 10% of it, or both below 0.01 nats (both solved)
        targets["linear reaches the softmax final loss"] = bool(lin <= max(1.1 * soft, 0.01))
    line = "copy: " + ", ".join(f"{n} loss {r['eval']['copy_loss']:.4f} acc {r['eval']['copy_accuracy']:.3f}"
                                for n, r in results.items())
    return finish_run(run, "copy", config, quick=quick, command=command, load=load, t0=t0,
                      results={"mechanisms": results, "targets": targets}, line=line, say=say)
