"""Causal language model over amino acids: the Performer's protein comparison (Choromanski et al.,
arXiv 2009.14794, section 4.3: softmax vs FAVOR-softmax vs FAVOR-ReLU on concatenated TrEMBL
sequences, context up to 8192).

Data: 20,000 UniProt sequences (Debian's mmseqs2-examples); every 10th is held out. Sequences are
concatenated with a separator token before each, and the model reads windows of ``seq_len`` tokens
of that stream; the separator is not counted as a target (it says where a protein starts, not what
it is made of). Softmax, linear, FAVOR-softmax and FAVOR-ReLU train the same model for the same
steps on the same windows and are compared on held-out perplexity and next-residue accuracy.
Then one training step (forward, backward, AdamW) is timed, and its peak memory measured, at
contexts 1024 .. 8192 for each mechanism; softmax contexts predicted to exceed a per-step time or
memory budget are recorded as skipped with the prediction, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..datasets import PROTEIN_VOCAB, protein_tokens
from ..nn.registry import AttentionConfig, attention_config
from ..progress import say as print_line
from .common import finish_run, start_run
from .stream import StreamConfig, train_on_stream

__all__ = ["ProteinsConfig", "run_proteins"]

SEPARATOR = 0  # PROTEIN_VOCAB[0]


@dataclass(frozen=True)
class ProteinsConfig(StreamConfig):
    """Options of the protein experiment (see :class:`StreamConfig`); tokens are residues and separators."""

    quick_settings: ClassVar[dict[str, Any]] = dict(
        d_model=32, n_heads=2, d_ff=64, steps=40, batch_size=4, seq_len=128, warmup_steps=5, eval_tokens=4096,
        speed_contexts="128,256", speed_tokens=512, step_in_child=False,
        mechanisms=(attention_config("softmax"), attention_config("linear"), attention_config("favor", num_features=16),
                    attention_config("favor", num_features=16, kernel="relu")))

    mechanisms: tuple[AttentionConfig, ...] = (attention_config("softmax"), attention_config("linear"),
                                               attention_config("favor", num_features=64),
                                               attention_config("favor", num_features=64, kernel="relu"))
    # ~0.15-0.3 s per step on one thread: four mechanisms train in ~16 min, the step sweep takes ~2
    steps: int = 1200
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 60
    seq_len: int = 1024
    eval_tokens: int = 131_072
    eval_batch: int = 4
    speed_contexts: str = "1024,2048,4096,8192"


def run_proteins(config: ProteinsConfig, *, quick: bool = False, command: str = "",
                 say=print_line) -> dict[str, Any]:
    """Train every mechanism, measure held-out perplexity/accuracy and per-step time and memory
    against context; write the run folder."""
    run, load, t0 = start_run("proteins", config, quick=quick, command=command)
    train, held = protein_tokens("train"), protein_tokens("held_out")
    say(f"proteins: {len(train)} training / {len(held)} held-out tokens, vocab {len(PROTEIN_VOCAB)}, {config.steps} "
        f"steps x {config.batch_size} x {config.seq_len}, d_model {config.d_model}, {config.n_layers} layers "
        f"-> {run.path}")
    results, speed = train_on_stream(config, run, train, held, vocab_size=len(PROTEIN_VOCAB), ignore=SEPARATOR,
                                     title=f"proteins: training loss per token (context {config.seq_len})", say=say)
    line = "proteins: " + ", ".join(f"{n} ppl {r['eval']['perplexity']:.3f} acc {r['eval']['accuracy']:.3f}"
                                    for n, r in results.items())
    return finish_run(run, "proteins", config, quick=quick, command=command, load=load, t0=t0,
                      results={"vocab": list(PROTEIN_VOCAB), "train_tokens": len(train), "held_out_tokens": len(held),
                               "mechanisms": results, "speed": speed}, line=line, say=say)
