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
from typing import Any

from ..datasets import PROTEIN_VOCAB, protein_tokens
from .common import ExperimentConfig, finish_run, plot_curves, start_run, train_contender
from .shakespeare import _contexts
from .stream import StreamBatches, evaluate_stream, measure_steps

__all__ = ["ProteinsConfig", "run_proteins"]

SEPARATOR = 0  # PROTEIN_VOCAB[0]


@dataclass(frozen=True)
class ProteinsConfig(ExperimentConfig):
    """Options of the protein experiment (see :class:`ExperimentConfig` for the shared ones).

    Attributes:
        seq_len: training and evaluation context (residues and separators).
        eval_tokens: held-out tokens evaluated at the end (0: all ~918,000).
        eval_batch: windows per evaluation forward.
        eval_every: also evaluate every this many steps on the first 4 windows.
        speed_contexts: contexts of the step time and memory measurement (empty: skip it).
        speed_tokens: tokens per measured step (batch = max(1, speed_tokens // context)).
        step_time_budget_s: a context predicted to take longer per step is skipped.
        step_memory_budget_gib: a context predicted to need more memory per step is skipped.
    """

    contenders: tuple[str, ...] = ("softmax", "linear", "favor", "favor-relu")
    seq_len: int = 1024
    eval_tokens: int = 0
    eval_batch: int = 4
    eval_every: int = 0
    speed_contexts: str = "1024,2048,4096,8192"
    speed_tokens: int = 8192
    step_time_budget_s: float = 60.0
    step_memory_budget_gib: float = 8.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("seq_len", "eval_batch", "speed_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"ProteinsConfig: {key} must be >= 1, got {getattr(self, key)}")
        if self.eval_tokens < 0 or self.eval_every < 0:
            raise ValueError("ProteinsConfig: eval_tokens and eval_every must be >= 0")
        if not self.step_time_budget_s > 0 or not self.step_memory_budget_gib > 0:
            raise ValueError("ProteinsConfig: step_time_budget_s and step_memory_budget_gib must be > 0")
        _contexts(self.speed_contexts)

    @classmethod
    def preset(cls, quick: bool) -> "ProteinsConfig":
        if quick:
            return cls(d_model=32, n_layers=2, n_heads=2, d_ff=64, steps=40, batch_size=4, seq_len=128, lr=3e-3,
                       warmup_steps=5, log_every=10, eval_tokens=4096, favor_features=16,
                       speed_contexts="128,256", speed_tokens=512)
        # ~0.25-0.5 s per step on one thread: four contenders train in ~8 min, the step sweep takes ~3
        return cls(d_model=64, n_layers=2, n_heads=4, d_ff=256, steps=300, batch_size=8, seq_len=1024, lr=3e-3,
                   warmup_steps=30, log_every=10, eval_tokens=65_536, favor_features=64)


def run_proteins(config: ProteinsConfig, *, quick: bool = False, command: str = "", say=print) -> dict[str, Any]:
    """Train every contender, measure held-out perplexity/accuracy and per-step time and memory
    against context; write the run folder."""
    run, load, t0 = start_run("proteins", config, quick=quick, command=command)
    train, held = protein_tokens("train"), protein_tokens("held_out")
    vocab = len(PROTEIN_VOCAB)
    say(f"proteins: {len(train)} training / {len(held)} held-out tokens, vocab {vocab}, {config.steps} steps x "
        f"{config.batch_size} x {config.seq_len}, d_model {config.d_model}, {config.n_layers} layers -> {run.path}")
    batches = StreamBatches(train, seq_len=config.seq_len, batch_size=config.batch_size, steps=config.steps,
                            seed=config.seed)
    results = {}
    for name in config.contenders:
        mc = config.model_config(name, vocab_size=vocab, max_len=config.seq_len)
        periodic = lambda m: evaluate_stream(m, held, seq_len=config.seq_len, batch_size=config.eval_batch,  # noqa: E731
                                             max_tokens=4 * config.seq_len + 1, ignore=SEPARATOR)
        model, rec = train_contender(name, mc, config, batches, run, evaluate=periodic,
                                     eval_every=config.eval_every, say=say)
        rec["eval"] = evaluate_stream(model, held, seq_len=config.seq_len, batch_size=config.eval_batch,
                                      max_tokens=config.eval_tokens, ignore=SEPARATOR)
        results[name] = rec
        say(f"  {name}: held-out perplexity {rec['eval']['perplexity']:.3f}, accuracy {rec['eval']['accuracy']:.4f}, "
            f"{rec['tokens_per_second']:.0f} tokens/s")
    plot_curves(run, config.contenders, title=f"proteins: training loss per token (context {config.seq_len})")
    speed = {}
    contexts = _contexts(config.speed_contexts)
    if contexts:
        say(f"  training step time and memory at contexts {list(contexts)}, ~{config.speed_tokens} tokens per step")
        for name in config.contenders:
            say(f"   {name}:")
            speed[name] = measure_steps(
                lambda n, name=name: config.model_config(name, vocab_size=vocab, max_len=n), contexts,
                tokens_per_step=config.speed_tokens, quadratic=name == "softmax",
                time_budget_s=config.step_time_budget_s,
                memory_budget_bytes=int(config.step_memory_budget_gib * 2**30), say=say)
    line = "proteins: " + ", ".join(f"{n} ppl {r['eval']['perplexity']:.3f} acc {r['eval']['accuracy']:.3f}"
                                    for n, r in results.items())
    return finish_run(run, "proteins", config, quick=quick, command=command, load=load, t0=t0,
                      results={"vocab": list(PROTEIN_VOCAB), "train_tokens": len(train), "held_out_tokens": len(held),
                               "contenders": results, "speed": speed}, line=line, say=say)
