"""Pixel-by-pixel autoregressive MNIST (Katharopoulos et al., arXiv 2006.16236, section 4.2.1, Table 1).

Each image is a sequence of 784 8-bit pixel tokens in row-major order after a start token (ids 0..255
are pixel values, 256 starts an image). Softmax and linear attention train the same model for the
same steps and are compared on test bits/dim (mean negative log2-likelihood per pixel). Then the
trained models generate images: linear attention recurrently (O(1) state per layer), softmax with
a KV cache, and softmax recomputing the whole prefix for every pixel (the baseline of the paper's
317x); images/s of each come from one full 784-pixel generation of ``gen_batch`` images. PNG grids
show unconditional samples and completions of the top half of test digits.

The quick preset uses scikit-learn's 8 x 8 digits (64 pixels of 17 levels, a start token 17)
so the test suite needs no MNIST; its bits/dim are not comparable to MNIST's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..bench.generate import generate_recompute
from ..datasets import digits_images, mnist_images
from ..progress import say as print_line
from .common import (
    LN2,
    ExperimentConfig,
    RunFolder,
    finish_run,
    masked_cross_entropy,
    plot_curves,
    start_run,
    train_mechanism,
)

__all__ = ["MnistConfig", "run_mnist"]

DATASETS = ("mnist", "digits")


@dataclass(frozen=True)
class MnistConfig(ExperimentConfig):
    """Options of the MNIST experiment (see :class:`ExperimentConfig` for the shared ones).

    Attributes:
        dataset: mnist (28 x 28, 256 levels) or digits (8 x 8, 17 levels; tests).
        train_images: the first this many training images are sampled from (0: all 60,000).
        test_images: bits/dim are measured on the first this many test images (0: all 10,000).
        eval_batch: images per evaluation forward.
        eval_every: also evaluate every this many steps on ``min(test_images, eval_batch)`` images.
        gen_batch: images per timed generation (images/s).
        recompute: also time softmax recomputing the prefix (the slow baseline).
        samples: unconditional samples and top-half completions per model in the PNG grids.
    """

    quick_settings: ClassVar[dict[str, Any]] = dict(
        dataset="digits", d_model=32, n_heads=2, d_ff=64, steps=60, lr=3e-3, warmup_steps=5, log_every=10,
        test_images=200, eval_batch=100, gen_batch=4, samples=4)

    steps: int = 800
    lr: float = 2e-3
    warmup_steps: int = 100
    log_every: int = 25
    dataset: str = field(default="mnist", metadata={"choices": DATASETS})
    train_images: int = 0
    test_images: int = 2000
    eval_batch: int = 50
    eval_every: int = 0
    gen_batch: int = 16
    recompute: bool = True
    samples: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dataset not in DATASETS:
            raise ValueError(f"MnistConfig: dataset must be one of {list(DATASETS)}, got {self.dataset!r}")
        for key in ("train_images", "test_images", "eval_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"MnistConfig: {key} must be >= 0, got {getattr(self, key)}")
        for key in ("eval_batch", "gen_batch", "samples"):
            if getattr(self, key) < 1:
                raise ValueError(f"MnistConfig: {key} must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class _Images:
    train: np.ndarray  # (N_train, P) uint8
    test: np.ndarray  # (N_test, P) uint8
    side: int
    levels: int

    @property
    def pixels(self) -> int:
        return self.side * self.side

    @property
    def start(self) -> int:
        return self.levels  # the start token follows the pixel values


def _load(config: MnistConfig) -> _Images:
    if config.dataset == "mnist":
        train, test, side, levels = mnist_images("train")[0], mnist_images("test")[0], 28, 256
    else:  # sklearn digits: no separate test split, so hold out every 5th image
        x = digits_images()[0]
        idx = np.arange(len(x))
        train, test, side, levels = x[idx % 5 != 4], x[idx % 5 == 4], 8, 17
    if config.train_images:
        train = train[: config.train_images]
    if config.test_images:
        test = test[: config.test_images]
    return _Images(train, test, side, levels)


def _sequences(data: _Images, images: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, P), targets (B, P))``: the start token then every pixel but the last, and the pixels."""
    px = torch.from_numpy(images.astype(np.int64))  # (B, P)
    start = torch.full((px.shape[0], 1), data.start, dtype=torch.long)
    return torch.cat([start, px[:, :-1]], dim=1), px


def _bits_per_dim(model, data: _Images, images: np.ndarray, batch: int) -> float:
    nats, count = 0.0, 0
    for i in range(0, len(images), batch):
        ids, targets = _sequences(data, images[i : i + batch])
        nats += masked_cross_entropy(model(ids), targets, reduction="sum").item()
        count += targets.numel()
    return nats / count / LN2


def _grid(run: RunFolder, name: str, rows: dict[str, np.ndarray], side: int, levels: int, title: str) -> None:
    """A PNG with one row of images per entry of ``rows`` (``(k, P)`` pixel arrays)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = max(len(v) for v in rows.values())
    fig, axes = plt.subplots(len(rows), k, figsize=(0.9 * k + 1.2, 1.0 * len(rows) + 0.4), squeeze=False)
    for r, (label, imgs) in enumerate(rows.items()):
        for c in range(k):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c < len(imgs):
                ax.imshow(imgs[c].reshape(side, side), cmap="gray", vmin=0, vmax=levels - 1)
            if c == 0:
                ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = run.path / name
    fig.savefig(path, dpi=90)
    plt.close(fig)


@torch.no_grad()
def _generation(models: dict, data: _Images, config: MnistConfig, run: RunFolder, say) -> dict[str, Any]:
    """Images/s of recurrent, KV-cache and recompute decoding of the trained models, and the grids."""
    P = data.pixels
    prompt = torch.full((config.gen_batch, 1), data.start, dtype=torch.long)
    decoders = {}
    for name, lm in models.items():
        label = "softmax (KV cache)" if name == "softmax" else f"{name} (recurrent)"
        decoders[label] = lambda n, lm=lm: lm.generate(prompt, n, generator=torch.Generator().manual_seed(1))
    if config.recompute and "softmax" in models:
        decoders["softmax (recompute prefix)"] = lambda n: generate_recompute(
            models["softmax"], prompt, n, generator=torch.Generator().manual_seed(1))
    seconds = {}
    for label, decode in decoders.items():
        decode(8)  # warm-up
        t0 = time.perf_counter()
        out = decode(P)
        seconds[label] = time.perf_counter() - t0
        assert out.shape == (config.gen_batch, P + 1), out.shape
        say(f"  generation {label}: {seconds[label]:.2f} s for {config.gen_batch} images")
    ips = {k: config.gen_batch / s for k, s in seconds.items()}
    # Grids: unconditional samples and completions of the top half of the first test images.
    k = min(config.samples, len(data.test))
    half = (data.side // 2) * data.side
    top = torch.from_numpy(data.test[:k, :half].astype(np.int64))  # (k, half)
    prompt_half = torch.cat([torch.full((k, 1), data.start, dtype=torch.long), top], dim=1)
    uncond, compl = {}, {"original": data.test[:k]}
    for name, lm in models.items():
        g = torch.Generator().manual_seed(2)
        uncond[name] = lm.generate(torch.full((k, 1), data.start, dtype=torch.long), P, generator=g)[:, 1:].numpy()
        compl[name] = lm.generate(prompt_half, P - half, generator=g)[:, 1:].numpy()
    _grid(run, "samples.png", uncond, data.side, data.levels, "unconditional samples (temperature 1)")
    _grid(run, "completions.png", compl, data.side, data.levels, "completions of the top half of test digits")
    out: dict[str, Any] = {"batch": config.gen_batch, "pixels": P, "seconds": seconds, "images_per_second": ips,
                           "timing": "one full generation from the start token after an 8-token warm-up, "
                                     "temperature 1, trained models"}
    lin = ips.get("linear (recurrent)")
    if lin is not None:
        out["linear speed-up"] = {k: lin / v for k, v in ips.items() if k != "linear (recurrent)"}
    return out


def run_mnist(config: MnistConfig, *, quick: bool = False, command: str = "", say=print_line) -> dict[str, Any]:
    """Train every mechanism, measure test bits/dim and generation speed; write the run folder."""
    run, load, t0 = start_run("mnist", config, quick=quick, command=command)
    data = _load(config)
    say(f"mnist ({config.dataset}): {len(data.train)} training / {len(data.test)} test images of {data.pixels} "
        f"pixels, {config.steps} steps x {config.batch_size}, d_model {config.d_model}, {config.n_layers} layers "
        f"-> {run.path}")
    order = np.random.default_rng(config.seed).integers(0, len(data.train), size=(config.steps, config.batch_size))

    def batches(step: int):
        ids, targets = _sequences(data, data.train[order[step]])
        return ids, targets, None

    quick_test = data.test[: min(len(data.test), config.eval_batch)]
    results, models = {}, {}
    for name in config.labels:
        mc = config.model_config(name, vocab_size=data.levels + 1, max_len=data.pixels + 1)
        evaluate = lambda m, imgs=quick_test: {"bits_per_dim": _bits_per_dim(m, data, imgs, config.eval_batch)}  # noqa: E731
        model, rec = train_mechanism(name, mc, config, batches, run, evaluate=evaluate,
                                     eval_every=config.eval_every, say=say)
        t_eval = time.perf_counter()
        rec["eval"] = {"bits_per_dim": _bits_per_dim(model, data, data.test, config.eval_batch),
                       "test_images": len(data.test)}
        rec["eval_seconds"] = time.perf_counter() - t_eval
        results[name], models[name] = rec, model
        say(f"  {name}: test {rec['eval']['bits_per_dim']:.4f} bits/dim on {len(data.test)} images, "
            f"{rec['tokens_per_second']:.0f} tokens/s")
    plot_curves(run, config.labels, title=f"{config.dataset}: training loss per pixel")
    generation = _generation(models, data, config, run, say)
    targets = {}
    if "softmax" in results and "linear" in results:
        gap = results["linear"]["eval"]["bits_per_dim"] - results["softmax"]["eval"]["bits_per_dim"]
        targets["linear within 0.05 bits/dim of softmax"] = bool(gap <= 0.05)
        ups = generation.get("linear speed-up", {})
        if "softmax (recompute prefix)" in ups:
            targets["generation at least 50x faster than softmax recomputing the prefix"] = bool(
                ups["softmax (recompute prefix)"] >= 50)
        if "softmax (KV cache)" in ups:
            targets["generation faster than softmax with a KV cache"] = bool(ups["softmax (KV cache)"] > 1)
    line = "mnist: " + ", ".join(f"{n} {r['eval']['bits_per_dim']:.4f} bits/dim" for n, r in results.items())
    line += "; images/s " + ", ".join(f"{k} {v:.3g}" for k, v in generation["images_per_second"].items())
    return finish_run(run, "mnist", config, quick=quick, command=command, load=load, t0=t0,
                      results={"dataset": config.dataset, "mechanisms": results, "generation": generation,
                               "targets": targets, "bits_per_dim_nan": not all(
                                   math.isfinite(r["eval"]["bits_per_dim"]) for r in results.values())},
                      line=line, say=say)
