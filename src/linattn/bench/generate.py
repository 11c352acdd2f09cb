"""`linattn bench generate`: decoding speed against position, and images/s for 784-token images.

Part 1, tokens/s against position (issues 5 and 6). For a TransformerLM (default d_model 512,
8 layers, 8 heads, vocab 32000, float32, batch 1), one model per attention config of
``mechanisms``: by default every registered mechanism with a recurrent form, with its registry
defaults (softmax decoding with a KV cache; linear, favor, local, retnet, gla, deltanet and
gated_deltanet with an O(1) state per layer):

- a random prompt of ``position`` tokens is prefilled with one causal forward that returns every
  layer's state (``TransformerLM.forward(return_state=True, last_only=True)``);
- then ``steps`` decoding steps (``TransformerLM.step``) are timed one by one, interleaved across
  all (model, position) pairs so that a slow spell of a shared machine hits every pair alike; the
  first ``warmup`` steps of each pair are not counted (the KV cache's first step grows its
  storage). The reported time is the median over the counted steps;
- softmax recomputing the whole prefix (the baseline the Linear Transformer paper reported,
  Katharopoulos et al. arXiv 2006.16236 Table 1): one decoding step is a causal forward over the
  ``position + 1`` tokens, logits of the last one only; timed separately (it is slow), median of
  up to three calls after one warm-up call, fewer when a call takes over ``recompute_budget_s``.

Every model uses sinusoidal positions (no parameters, so models differ only in what their
mechanism owns) and one random initialisation. The decoding state's size (bytes of every tensor
in it) is recorded at each position.

Claims checked (issue 5): the linear model's time per token at the largest position is within 1.3x
of its time at the smallest, its state size does not depend on position, and at the largest
position it is at least 5x faster than softmax with a KV cache; with ``compile`` the same claims
again for both models' ``compiled_step``. What to expect from arithmetic alone: at batch 1 a
decoding step is a chain of matrix-vector products plus a few hundred small operations. Every step
reads all weights once (4 bytes x parameters: ~164 MB for the default model, most of it the MLPs
and the 32000 x 512 output layer); a softmax layer also reads its KV cache, 2 x position x d_model
x 4 bytes per layer (500 MiB over 8 layers at 16000); a linear layer reads its (S, z) state, 1 MiB
in all. Were both read at one rate, softmax / linear could not exceed (weights + KV cache) /
(weights + linear state), recorded as ``bytes_ratio`` (~4.0 at 16000 for the default model). On
a CPU whose last-level cache holds the weights (``machine.cpu_caches``; 260 MiB of L3 on the
machine these results were written on) that is no bound: the weights stay in cache from one step
to the next while a KV cache larger than it streams from memory. ``read_rates`` records both: the
weights' rate from a chain of the linear model's matrix-vector products alone, the KV cache's from
softmax's extra time per extra byte between the two positions. Where the weights are read fast, the
linear model's step is dominated by the per-operation overhead of eager PyTorch, which
``compile`` removes.

Part 2, images/s (issue 6): ``image_batch`` images of 28 x 28 = 784 pixel tokens each are sampled
(temperature 1) from a pixel model (vocab 256 pixel values + 1 start token, default d_model 256,
8 layers, 8 heads, d_ff 1024: the size of the Linear Transformer paper's MNIST model), starting
from the start token: recurrently (linear, favor), softmax with a KV cache, and softmax
recomputing the prefix for each pixel. The models are untrained (speed does not depend on the
weights); each generation is timed once, in full, after a 16-token warm-up generation.

Repeated runs: both parts together are one run, and a run is repeated ``runs`` times (default 3),
each in a fresh process (``python -m linattn.bench.generate child SPEC``) with its own load and
reference matmul speed: models built from the same seed, the prefill, the interleaved timed steps,
the recompute timings, the read rates and the images. Each ratio of the claims (and each images/s
speed-up) is computed within a run from that run's medians; generate.json keeps every run's data
(``runs``) and gives each ratio's per-run values with min / median / max (``ratios``), and the
claims are decided on the median ratio, never on the best run. ``seconds_per_token`` is each
pair's median over the runs.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import progress
from ..models import TransformerConfig, TransformerLM, count_parameters
from ..nn.registry import (
    MECHANISMS,
    AttentionConfig,
    attention_config_from_dict,
    attention_config_to_dict,
    config_label,
    get_mechanism,
    spec_for,
)
from .harness import (
    INHERITED_ALLOCATOR,
    RUNS,
    busy_reasons,
    format_run_loads,
    format_spread_cells,
    machine_info,
    run_repeated,
    spread,
    output_folder,
    write_atomically,
)

__all__ = ["IMAGE_MECHANISMS", "IMAGE_PIXELS", "as_repeated", "check_mechanisms", "default_mechanisms",
           "describe_runs_load",
           "format_generate", "generate_recompute", "run_generate", "state_bytes"]

IMAGE_PIXELS = 28 * 28
COMPILE_STEPS = 3  # untimed steps per pair before the timed rounds when compiled steps are timed
# part 2's decoders, each with its registry defaults: two recurrent ones and the KV-cache baseline
IMAGE_MECHANISMS = ("linear", "favor", "softmax")
# the claims compare these two (each with its registry defaults), so every run decodes with both
CLAIMED = ("linear", "softmax")
# The claims' thresholds (issue 5): linear's time per token at the largest position within this
# factor of its time at the smallest, and softmax (KV cache) / linear at the largest at least this.
FLAT_WITHIN = 1.3
FASTER_BY = 5.0


def default_mechanisms() -> tuple[AttentionConfig, ...]:
    """Every registered mechanism with a recurrent form (a decoding state), with its defaults."""
    return tuple(spec.default_config() for spec in MECHANISMS.values() if spec.recurrent)


def check_mechanisms(mechanisms: tuple[AttentionConfig, ...]) -> None:
    """ValueError unless every config has a recurrent form, none comes twice, and linear and softmax
    with their defaults are among them."""
    labels = [config_label(c) for c in mechanisms]
    no_state = [label for label, c in zip(labels, mechanisms) if not spec_for(c).recurrent]
    if no_state:
        raise ValueError(f"{', '.join(no_state)} has no recurrent form (no decoding state); mechanisms with one: "
                         f"{', '.join(config_label(c) for c in default_mechanisms())}")
    if len(set(labels)) < len(labels):
        raise ValueError(f"each config once, got {labels}")
    missing = [name for name in CLAIMED if name not in labels]
    if missing:
        raise ValueError(f"must include {' and '.join(repr(m) for m in missing)} with the registry defaults "
                         f"(the claims compare linear with softmax), got {labels}")


def weight_read_rate(lm: TransformerLM, repeats: int = 20) -> float:
    """GB/s of one token's matrix-vector products over every ``nn.Linear`` of ``lm`` in model order
    and nothing else (median of ``repeats`` after one warm-up pass): how fast this machine reads
    the weights of a decoding step when nothing runs between the products."""
    layers = [m for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features, dtype=m.weight.dtype) for m in layers]
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    ts = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for m, x in zip(layers, inputs):
                torch.nn.functional.linear(x, m.weight, m.bias)
            ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts[1:]) / 1e9


def _cloned(state):
    """A copy of a decoding state (nested NamedTuples of tensors and ints) sharing no storage."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, tuple):
        items = [_cloned(x) for x in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    return state


def state_bytes(state) -> int:
    """Bytes of every tensor of an LMState (a KV cache counts its capacity, allocated or not)."""
    total = 0
    for layer in state.layers:
        for t in layer.mechanism:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def generate_recompute(lm: TransformerLM, prompt_ids: torch.Tensor, max_new_tokens: int, *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample like ``lm.generate`` (temperature 1) but run a full causal forward over the whole
    prefix for every new token, keeping no state: ``prompt_ids (B, P)`` -> ``(B, P + T)``. The
    baseline a decoder without a cache pays: O(position) work per token for the MLPs, O(position²)
    for the attention."""
    ids = prompt_ids
    for _ in range(max_new_tokens):
        logits = lm(ids, last_only=True)[:, -1].float()  # (B, V)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)  # (B, 1)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def _lm(vocab_size: int, max_len: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
        attention) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=vocab_size, max_len=max_len, d_model=d_model, n_layers=n_layers,
                            n_heads=n_heads, d_ff=d_ff, positional="sinusoidal", attention=attention)
    return TransformerLM(cfg).eval()


def run_generate(*, out: str | Path = "docs/benchmarks", positions: tuple[int, ...] = (100, 16000),
                 steps: int = 20, warmup: int = 2, d_model: int = 512, n_layers: int = 8, n_heads: int = 8,
                 vocab_size: int = 32000, mechanisms: tuple[AttentionConfig, ...] | None = None,
                 recompute: bool = True, recompute_budget_s: float = 5.0, image_batch: int = 0,
                 image_d_model: int = 256, image_n_layers: int = 8, compile: bool = False, runs: int = RUNS,
                 quiet: bool = False) -> dict:
    """Run both parts (part 2 only when ``image_batch`` > 0) ``runs`` times, each run in a fresh
    process, write generate.json/md to ``out``, return the result.

    ``mechanisms``: attention configs with a recurrent form, each decoder labelled by
    ``config_label`` (None: :func:`default_mechanisms`); linear and softmax with their defaults
    must be among them (the claims compare them). ``compile``: also time every model's
    ``TransformerLM.compiled_step()`` (as ``<label>+compile``), from its own copy of the prefilled
    state."""
    mechanisms = default_mechanisms() if mechanisms is None else tuple(mechanisms)
    try:
        check_mechanisms(mechanisms)
    except ValueError as e:
        raise ValueError(f"run_generate: mechanisms: {e}") from None
    labels = [config_label(c) for c in mechanisms]
    if not positions or any(p < 1 for p in positions):
        raise ValueError(f"run_generate: positions must be >= 1, got {positions}")
    if image_batch < 0:
        raise ValueError(f"run_generate: image_batch must be >= 0, got {image_batch}")
    if runs < 1:
        raise ValueError(f"run_generate: runs must be >= 1, got {runs}")
    output_folder(out)
    # the children read the same variable; set here too so that machine_info records their count
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = functools.partial(progress.say, quiet=quiet)
    t_start = time.perf_counter()
    say(f"linattn bench generate: d_model {d_model}, {n_layers} layers, {n_heads} heads, vocab {vocab_size}, "
        f"float32, batch 1, positions {list(positions)}, {steps} timed steps, mechanisms {labels}, "
        f"{torch.get_num_threads()} threads, {runs} runs")
    attention = {label: attention_config_to_dict(c) for label, c in zip(labels, mechanisms)}
    spec = {"positions": list(positions), "steps": steps, "warmup": warmup, "d_model": d_model,
            "n_layers": n_layers, "n_heads": n_heads, "vocab_size": vocab_size, "mechanisms": attention,
            "recompute": recompute, "recompute_budget_s": recompute_budget_s, "image_batch": image_batch,
            "image_d_model": image_d_model, "image_n_layers": image_n_layers, "compile": compile}
    names_only = all(label == c["name"] for label, c in attention.items())
    mechanisms_arg = ",".join(labels) if names_only else shlex.quote(json.dumps(list(attention.values())))
    command = (f"linattn bench generate --positions {','.join(map(str, positions))} --steps {steps} "
               f"--d-model {d_model} --n-layers {n_layers} --n-heads {n_heads} --vocab-size {vocab_size} "
               f"--mechanisms {mechanisms_arg}" + ("" if recompute else " --no-recompute")
               + f" --image-batch {image_batch}"
               + (f" --image-d-model {image_d_model} --image-n-layers {image_n_layers}" if image_batch else "")
               + (" --compile" if compile else "") + (f" --runs {runs}" if runs != RUNS else "")
               + f" --out {out}")
    result = {
        "command": command,
        "machine": machine_info(),
        "config": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model,
                   "vocab_size": vocab_size, "positional": "sinusoidal", "dtype": "float32", "batch": 1,
                   "positions": list(positions), "steps": steps, "warmup": warmup,
                   "mechanisms": attention,
                   "compile": compile, "runs": runs,
                   "timing": "median per-token step time over interleaved steps after warm-up"
                             + (f" ({COMPILE_STEPS} more untimed steps per pair first, for compiling)" if compile else "")},
        "runs": run_repeated("linattn.bench.generate", [json.dumps(spec)], runs=runs,
                             allocators=INHERITED_ALLOCATOR, say=say),
    }
    result.update(_summarise(result))
    result["wall_seconds"] = time.perf_counter() - t_start
    md = format_generate(result)
    write_atomically(out, {"generate.json": json.dumps(result, indent=2), "generate.md": md})
    say(md)
    return result


def _measure(*, positions: list[int], steps: int, warmup: int, d_model: int, n_layers: int, n_heads: int,
             vocab_size: int, mechanisms: dict[str, dict], recompute: bool, recompute_budget_s: float,
             image_batch: int, image_d_model: int, image_n_layers: int, compile: bool) -> dict:
    """One run of both parts in this process (a benchmark child): every time, size and rate one run
    measures; no claims (those are decided over the runs). ``mechanisms``: ``{label: attention
    config dict}``."""
    t_start = time.perf_counter()
    max_len = max(positions) + warmup + steps + 1 + (COMPILE_STEPS if compile else 0)
    models = {label: _lm(vocab_size, max_len, d_model, n_layers, n_heads, 4 * d_model,
                         attention_config_from_dict(config))
              for label, config in mechanisms.items()}
    params = {name: count_parameters(lm) for name, lm in models.items()}

    g = torch.Generator().manual_seed(0)
    prompts = {p: torch.randint(0, vocab_size, (1, p + 1), generator=g) for p in positions}
    # decoders: name -> step function; "<name>+compile" steps the same model compiled
    steppers = {name: lm.step for name, lm in models.items()}
    if compile:
        steppers.update({f"{name}+compile": lm.compiled_step() for name, lm in models.items()})
    states, tokens, prefill_s, size_at_prefill = {}, {}, {}, {}
    with torch.no_grad():
        for name, lm in models.items():
            for p in positions:
                t0 = time.perf_counter()
                logits, state = lm(prompts[p][:, :p], return_state=True, last_only=True)
                prefill_s[f"{name}@{p}"] = time.perf_counter() - t0
                states[(name, p)], tokens[(name, p)] = state, logits[:, -1].argmax(-1, keepdim=True)
                size_at_prefill[f"{name}@{p}"] = state_bytes(state)
                if compile:  # its own copy: a KV cache is written in place
                    key = f"{name}+compile"
                    states[(key, p)], tokens[(key, p)] = _cloned(state), tokens[(name, p)]
                    prefill_s[f"{key}@{p}"], size_at_prefill[f"{key}@{p}"] = prefill_s[f"{name}@{p}"], size_at_prefill[f"{name}@{p}"]

        def advance(name: str, p: int) -> float:
            t0 = time.perf_counter()
            logits, state = steppers[name](tokens[(name, p)], states[(name, p)])
            dt = time.perf_counter() - t0
            states[(name, p)], tokens[(name, p)] = state, logits.argmax(-1, keepdim=True)
            return dt

        if compile:
            # compiled steps compile during their first calls (one specialised graph, then one
            # with position and cache length symbolic); every pair takes these untimed steps
            for name, p in list(states):
                for _ in range(COMPILE_STEPS):
                    advance(name, p)
        times: dict[str, list[float]] = {f"{n}@{p}": [] for n, p in states}
        for i in range(warmup + steps):  # interleaved: one step of every pair per round
            for name, p in list(states):
                dt = advance(name, p)
                if i >= warmup:
                    times[f"{name}@{p}"].append(dt)
        recompute_times: dict[str, list[float]] = {}
        if recompute:
            for p in positions:  # one decoding step without a cache = a forward over p + 1 tokens
                ts, key = [], f"softmax-recompute@{p}"
                models["softmax"](prompts[p], last_only=True)  # warm-up
                while len(ts) < 3 and sum(ts) < recompute_budget_s:
                    t0 = time.perf_counter()
                    models["softmax"](prompts[p], last_only=True)
                    ts.append(time.perf_counter() - t0)
                recompute_times[key] = ts
    seconds = {k: statistics.median(v) for k, v in times.items()}
    seconds.update({k: statistics.median(v) for k, v in recompute_times.items()})
    weight_bytes = {n: sum(p.numel() * p.element_size() for p in lm.parameters()) for n, lm in models.items()}
    traffic = {f"{n}@{p}": weight_bytes[n] + size_at_prefill[f"{n}@{p}"] for n, p in states if n in models}
    lo, hi = min(positions), max(positions)
    # how fast each kind of byte was read: the linear model's weights alone, and the KV cache as
    # the softmax model's extra time per extra byte between the two positions
    kv_extra = size_at_prefill[f"softmax@{hi}"] - size_at_prefill[f"softmax@{lo}"]
    read_rates = {"weights, matrix-vector products alone (GB/s)": weight_read_rate(models["linear"])}
    if kv_extra > 0 and seconds[f"softmax@{hi}"] > seconds[f"softmax@{lo}"]:
        read_rates["KV cache, softmax's extra time per extra byte (GB/s)"] = (
            kv_extra / (seconds[f"softmax@{hi}"] - seconds[f"softmax@{lo}"]) / 1e9)
    out = {
        "parameters": params,
        "seconds_per_token": seconds,
        "all_seconds": {**times, **recompute_times},
        "prefill_seconds": prefill_s,
        "state_bytes_after_prefill": size_at_prefill,
        "state_bytes_after_steps": {f"{n}@{p}": state_bytes(s) for (n, p), s in states.items()},
        "weight_bytes": weight_bytes,
        "bytes_read_per_token_estimate": traffic,
        "read_rates": read_rates,
        "bytes_ratio": {f"softmax@{p} / linear@{p}": traffic[f"softmax@{p}"] / traffic[f"linear@{p}"]
                        for p in positions},
    }
    if image_batch:
        out["images"] = _images(image_batch, image_d_model, image_n_layers, n_heads)
    out["wall_seconds"] = time.perf_counter() - t_start
    return out


def _images(batch: int, d_model: int, n_layers: int, n_heads: int) -> dict:
    """Part 2: time one full generation of ``batch`` 784-pixel images per contender."""
    start = 256  # pixel values are 0..255; the start token is one more id
    models = {name: _lm(257, IMAGE_PIXELS + 1, d_model, n_layers, n_heads, 4 * d_model,
                        get_mechanism(name).default_config())
              for name in IMAGE_MECHANISMS}
    prompt = torch.full((batch, 1), start, dtype=torch.long)
    decoders = {f"{name} (recurrent)" if name != "softmax" else "softmax (KV cache)":
                (lambda n, lm=lm: lm.generate(prompt, n, generator=torch.Generator().manual_seed(0)))
                for name, lm in models.items()}
    decoders["softmax (recompute prefix)"] = lambda n: generate_recompute(
        models["softmax"], prompt, n, generator=torch.Generator().manual_seed(0))
    seconds = {}
    with torch.no_grad():
        for name, decode in decoders.items():
            out = decode(16)  # warm-up
            t0 = time.perf_counter()
            out = decode(IMAGE_PIXELS)
            seconds[name] = time.perf_counter() - t0
            if out.shape != (batch, IMAGE_PIXELS + 1):
                raise AssertionError(f"{name} generated {tuple(out.shape)}, expected {(batch, IMAGE_PIXELS + 1)}")
    return {
        "config": {"batch": batch, "pixels": IMAGE_PIXELS, "vocab_size": 257, "d_model": d_model,
                   "n_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model, "dtype": "float32",
                   "sampling": "temperature 1 from a start token", "timing": "one full generation after a "
                   "16-token warm-up",
                   "mechanisms": {name: attention_config_to_dict(get_mechanism(name).default_config())
                                  for name in IMAGE_MECHANISMS}},
        "parameters": {k: count_parameters(m) for k, m in models.items()},
        "seconds": seconds,
    }


LINEAR_IMAGES = "linear (recurrent)"  # the images/s speed-ups are over this decoder


def _per_run(result: dict) -> list[dict]:
    (alloc,) = INHERITED_ALLOCATOR
    return [r["allocators"][alloc] for r in result["runs"]]


def _claim_ratios(seconds: dict[str, float], lo: int, hi: int, suffixes: tuple[str, ...]) -> dict[str, float]:
    """One run's ratios behind the claims, from that run's median seconds per token."""
    out = {}
    for suffix in suffixes:
        lin, soft = f"linear{suffix}", f"softmax{suffix}"
        out[f"{lin}@{hi} / {lin}@{lo}"] = seconds[f"{lin}@{hi}"] / seconds[f"{lin}@{lo}"]
        out[f"{soft}@{hi} / {lin}@{hi}"] = seconds[f"{soft}@{hi}"] / seconds[f"{lin}@{hi}"]
    return out


def _summarise(result: dict) -> dict:
    """From ``result["runs"]``: ``seconds_per_token`` and ``tokens_per_second`` (each pair's median
    over the runs), ``ratios`` (each claim ratio's spread over the runs, each run's ratio from its
    own medians), ``claim`` (each ratio's median and the verdicts decided on it; the state size
    must not depend on position in any run) and, with images, their median times and the
    speed-ups' spreads."""
    runs = _per_run(result)
    cfg = result["config"]
    positions = cfg["positions"]
    lo, hi = min(positions), max(positions)
    suffixes = ("", "+compile") if cfg.get("compile") else ("",)
    per_run = [_claim_ratios(r["seconds_per_token"], lo, hi, suffixes) for r in runs]
    ratios = {k: spread([x[k] for x in per_run]) for k in per_run[0]}
    claim: dict = {}
    for suffix in suffixes:
        lin, soft = f"linear{suffix}", f"softmax{suffix}"
        flat, faster = ratios[f"{lin}@{hi} / {lin}@{lo}"]["median"], ratios[f"{soft}@{hi} / {lin}@{hi}"]["median"]
        claim.update({
            f"{lin}@{hi} / {lin}@{lo}": flat,
            f"{lin}@{hi} within {FLAT_WITHIN}x of {lin}@{lo}": flat <= FLAT_WITHIN,
            f"{soft}@{hi} / {lin}@{hi}": faster,
            f"{lin} at least {FASTER_BY:g}x faster than {soft} (KV cache) at {hi}": faster >= FASTER_BY,
        })
    claim["linear state size independent of position"] = all(
        len({r["state_bytes_after_prefill"][f"linear@{p}"] for p in positions}
            | {r["state_bytes_after_steps"][f"linear@{p}"] for p in positions}) == 1 for r in runs)
    seconds = {k: statistics.median(r["seconds_per_token"][k] for r in runs) for k in runs[0]["seconds_per_token"]}
    out = {"seconds_per_token": seconds, "tokens_per_second": {k: 1.0 / s for k, s in seconds.items()},
           "ratios": ratios, "claim": claim}
    if "bytes_ratio" in runs[0]:  # the same in every run (sizes only); files from before lack it
        out["bytes_ratio"], out["weight_bytes"] = runs[0]["bytes_ratio"], runs[0]["weight_bytes"]
    if "images" in runs[0]:
        first = runs[0]["images"]
        names = list(first["seconds"])
        im_seconds = {k: statistics.median(r["images"]["seconds"][k] for r in runs) for k in names}
        out["images"] = {
            "config": first["config"], "parameters": first["parameters"], "seconds": im_seconds,
            "images_per_second": {k: first["config"]["batch"] / s for k, s in im_seconds.items()},
            "linear speed-up": {k: spread([r["images"]["seconds"][k] / r["images"]["seconds"][LINEAR_IMAGES]
                                           for r in runs]) for k in names if k != LINEAR_IMAGES},
        }
    return out


def as_repeated(result: dict) -> dict:
    """A generate.json result in the current form. A file written before the measurement was
    repeated (one run's fields at the top level, no ``runs``) becomes a result of that one run, with
    ``config["runs"] = 1`` and ``single_run_file = True``; a current result is returned unchanged."""
    if "runs" in result:
        return result
    missing = [k for k in ("command", "machine", "config", "seconds_per_token", "state_bytes_after_prefill",
                           "wall_seconds") if k not in result]
    if missing:
        raise ValueError(f"as_repeated: not a generate.json result (no 'runs', and no {missing})")
    (alloc,) = INHERITED_ALLOCATOR
    run = {k: v for k, v in result.items()
           if k not in ("command", "machine", "config", "load", "claim", "tokens_per_second")}
    out = {"command": result["command"], "machine": result["machine"], "config": {**result["config"], "runs": 1},
           "single_run_file": True,
           "runs": [{"allocators": {alloc: {"env": {}, **run}}, "load": result.get("load") or {}}]}
    out.update(_summarise(out))
    out["wall_seconds"] = result["wall_seconds"]
    return out


def format_generate(result: dict) -> str:
    """generate.md from a result of :func:`run_generate` (or from an older single-run file, see
    :func:`as_repeated`)."""
    r = as_repeated(result)
    c = r["config"]
    runs = _per_run(r)
    first, n = runs[0], len(runs)
    if r.get("single_run_file"):
        how = ("This file was written before the measurement was repeated: it holds one run, so every ratio and "
               "verdict below is that run's alone, not a median over runs; rerun the command to get three.")
    else:
        how = (f"The whole measurement ran {n} time{'s' if n != 1 else ''}, each run in a fresh process (models "
               "built from the same seed, prefilled, every (model, position) pair stepped interleaved within the "
               "run, then the recompute timings and the images). Each ratio is computed within a run from that "
               "run's own medians and stated by its median over the runs, with min and max; the claims are "
               "decided on the median, never on the best run. Times below: the median over the runs, each run's "
               "beside it.")
    lines = [
        "# Generation speed: recurrent decoding vs softmax with a KV cache vs softmax recomputing the prefix",
        "",
        f"Written by `{r['command']}`; do not edit by hand. {how}",
        "",
        "## Claims",
        "",
        "| ratio | median | min | max | per run |",
        "| --- | ---: | ---: | ---: | --- |",
        *[f"| {k} | {format_spread_cells(s)} |" for k, s in r["ratios"].items()],
        "",
        "| claim | verdict (on the median ratio) |",
        "| --- | --- |",
        *[f"| {k} | {'holds' if v else 'does NOT hold'} |" for k, v in r["claim"].items() if isinstance(v, bool)],
        "",
        "## Each run's machine",
        "",
        *format_run_loads([run["load"] for run in r["runs"]]),
        "",
        "## Time per token against position",
        "",
        f"TransformerLM, d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads, vocab "
        f"{c['vocab_size']}, float32, batch 1, {r['machine']['threads']} threads. In each run, the {c['timing']} "
        f"({c['steps']} steps); softmax-recompute = one causal forward over the whole prefix per token. "
        "Prefill: the median over the runs; state sizes depend on the configuration only (from run 1).",
        "",
        "| model | position | ms / token: median over runs | per run | tokens / s | state after prefill (MiB) | "
        "prefill (s) |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for key, s in r["seconds_per_token"].items():
        name, p = key.split("@")
        per_run = ", ".join(f"{1e3 * run['seconds_per_token'][key]:.2f}" for run in runs)
        if key in first["prefill_seconds"]:
            size = f"{first['state_bytes_after_prefill'][key] / 2**20:.2f}"
            prefill = f"{statistics.median(run['prefill_seconds'][key] for run in runs):.2f}"
        else:  # recomputing the prefix keeps no state and needs no prefill
            size, prefill = "0 (no state)", "-"
        lines.append(f"| {name} | {p} | {1e3 * s:.2f} | {per_run} | {1 / s:.2f} | {size} | {prefill} |")
    l3 = r["machine"].get("cpu_caches", {}).get("L3")
    weights = first["weight_bytes"]["linear"]
    if l3 is None:
        where = "(the last-level cache's size is unknown here)"
    elif weights <= l3:
        where = (f"here the {l3 / 2**20:.0f} MiB L3 cache is large enough to keep the {weights / 1e6:.0f} MB of "
                 "weights from one step to the next while a longer KV cache streams from memory, so the ratio "
                 "need not bound anything (the L3 is shared with whatever else runs on the host; the read "
                 "rates below are what these runs got)")
    else:
        where = f"the {weights / 1e6:.0f} MB of weights exceed the {l3 / 2**20:.0f} MiB L3 cache here"
    lines += ["", "Bytes read per token (weights + decoding state). Their ratio would bound softmax / linear "
              f"if both were read at one rate; {where}:", "",
              "| pair | MB read per token | bytes ratio softmax / linear |", "| --- | ---: | ---: |"]
    for key, b in first["bytes_read_per_token_estimate"].items():
        name, p = key.split("@")
        ratio = first["bytes_ratio"][f"softmax@{p} / linear@{p}"] if name == "softmax" else None
        lines.append(f"| {key} | {b / 1e6:.0f} | {'' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", "| read rate | GB/s: median over runs | per run |", "| --- | ---: | --- |"]
    for k in dict.fromkeys(k for run in runs for k in run.get("read_rates", {})):
        # the KV cache's rate is missing from a run where softmax did not slow down with position
        values = [run["read_rates"].get(k) for run in runs]
        lines.append(f"| {k.removesuffix(' (GB/s)')} | {statistics.median(v for v in values if v is not None):.1f} | "
                     + ", ".join("-" if v is None else f"{v:.1f}" for v in values) + " |")
    if "images" in r:
        im = r["images"]
        ic = im["config"]
        lines += ["", f"## Images per second: {ic['batch']} images of {ic['pixels']} pixels", "",
                  f"Pixel model: vocab {ic['vocab_size']}, d_model {ic['d_model']}, {ic['n_layers']} layers, "
                  f"{ic['n_heads']} heads, d_ff {ic['d_ff']}, float32, batch {ic['batch']}; {ic['sampling']}; "
                  f"{ic['timing']}, in each run. Seconds and images/s: the median over the runs; the speed-up: "
                  "its time / linear's within each run, the median over the runs with min and max.", "",
                  f"| decoder | seconds: median over runs | per run | images / s | {LINEAR_IMAGES} is faster by: "
                  "median | min | max |", "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        for k, s in im["seconds"].items():
            up = im["linear speed-up"].get(k)
            cells = " | | " if up is None else f"{up['median']:.1f}x | {up['min']:.1f}x | {up['max']:.1f}x"
            per_run = ", ".join(f"{run['images']['seconds'][k]:.2f}" for run in runs)
            lines.append(f"| {k} | {s:.2f} | {per_run} | {im['images_per_second'][k]:.3f} | {cells} |")
    return "\n".join(lines) + "\n"


def describe_runs_load(result: dict) -> str:
    """One sentence for a document that embeds generate.md: how many runs, and which were busy."""
    r = as_repeated(result)
    busy = [i for i, run in enumerate(r["runs"], 1) if busy_reasons(run["load"])]
    n = len(r["runs"])
    return (f"{n} run{'s' if n != 1 else ''}, "
            + ("none busy" if not busy else "busy: run " + ", ".join(map(str, busy)))
            + " (each run's load and reference matmul speed are in the generation section).")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
        print(json.dumps(_measure(**json.loads(sys.argv[2]))))
    else:
        raise SystemExit("usage: python -m linattn.bench.generate child SPEC_JSON")
