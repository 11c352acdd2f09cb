"""`linattn bench generate`: decoding speed against position, and images/s for 784-token images.

Part 1, tokens/s against position (issues 5 and 6). For a TransformerLM (default d_model 512,
8 layers, 8 heads, vocab 32000, float32, batch 1), one model per mechanism that decodes
recurrently (linear, favor, local: O(1) state per layer) plus softmax decoding with a KV cache:

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
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..models import TransformerConfig, TransformerLM, count_parameters
from ..nn import FavorConfig, LinearConfig, LocalConfig, SoftmaxConfig
from .harness import OtherLoad, describe_load, machine_info, write_atomically

__all__ = ["IMAGE_PIXELS", "MECHANISMS", "generate_recompute", "run_generate", "state_bytes"]

# The recurrent contenders and the KV-cache baseline. Local's window is the one the family
# benchmark uses; FAVOR+ has its default m = 256 positive orthogonal features.
MECHANISMS = {"linear": LinearConfig(), "favor": FavorConfig(), "local": LocalConfig(window=256),
              "softmax": SoftmaxConfig()}
IMAGE_PIXELS = 28 * 28
COMPILE_STEPS = 3  # untimed steps per pair before the timed rounds when compiled steps are timed
IMAGE_MECHANISMS = ("linear", "favor", "softmax")


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


def run_generate(*, out_dir: str | Path = "docs/benchmarks", positions: tuple[int, ...] = (100, 16000),
                 steps: int = 20, warmup: int = 2, d_model: int = 512, n_layers: int = 8, n_heads: int = 8,
                 vocab_size: int = 32000, mechanisms: tuple[str, ...] = tuple(MECHANISMS),
                 recompute: bool = True, recompute_budget_s: float = 5.0, image_batch: int = 0,
                 image_d_model: int = 256, image_layers: int = 8, compile: bool = False,
                 quiet: bool = False) -> dict:
    """Run both parts (part 2 only when ``image_batch`` > 0), write generate.json/md, return the
    result. ``mechanisms`` must include "linear" and "softmax" (the claims compare them).
    ``compile``: also time every mechanism's ``TransformerLM.compiled_step()`` (as
    ``<name>+compile``), from its own copy of the prefilled state."""
    unknown = sorted(set(mechanisms) - set(MECHANISMS))
    if unknown or not {"linear", "softmax"} <= set(mechanisms):
        raise ValueError(f"run_generate: mechanisms must include 'linear' and 'softmax' and come from "
                         f"{list(MECHANISMS)}, got {list(mechanisms)}")
    if not positions or any(p < 1 for p in positions):
        raise ValueError(f"run_generate: positions must be >= 1, got {positions}")
    if image_batch < 0:
        raise ValueError(f"run_generate: image_batch must be >= 0, got {image_batch}")
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    load = OtherLoad(reference=True)
    max_len = max(positions) + warmup + steps + 1 + (COMPILE_STEPS if compile else 0)
    say(f"linattn bench generate: d_model {d_model}, {n_layers} layers, {n_heads} heads, vocab {vocab_size}, "
        f"float32, batch 1, positions {list(positions)}, {steps} timed steps, mechanisms {list(mechanisms)}, "
        f"{torch.get_num_threads()} threads")
    models = {name: _lm(vocab_size, max_len, d_model, n_layers, n_heads, 4 * d_model, MECHANISMS[name])
              for name in mechanisms}
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
                say(f"  prefilled {name} at {p} in {prefill_s[f'{name}@{p}']:.2f} s")
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
            say(f"  compiled and stepped {COMPILE_STEPS} steps per pair ({time.perf_counter() - t_start:.0f} s so far)")
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
                say(f"  softmax recomputing the prefix at {p}: {statistics.median(ts):.3f} s per token")
    seconds = {k: statistics.median(v) for k, v in times.items()}
    seconds.update({k: statistics.median(v) for k, v in recompute_times.items()})
    weight_bytes = {n: sum(p.numel() * p.element_size() for p in lm.parameters()) for n, lm in models.items()}
    traffic = {f"{n}@{p}": weight_bytes[n] + size_at_prefill[f"{n}@{p}"] for n, p in states if n in models}
    size_after = {f"{n}@{p}": state_bytes(s) for (n, p), s in states.items()}
    lo, hi = min(positions), max(positions)
    claim = {}
    for suffix in ("", "+compile") if compile else ("",):
        lin, soft = f"linear{suffix}", f"softmax{suffix}"
        lin_ratio = seconds[f"{lin}@{hi}"] / seconds[f"{lin}@{lo}"]
        speedup = seconds[f"{soft}@{hi}"] / seconds[f"{lin}@{hi}"]
        claim.update({
            f"{lin}@{hi} / {lin}@{lo}": lin_ratio,
            f"{lin}@{hi} within 1.3x of {lin}@{lo}": lin_ratio <= 1.3,
            f"{soft}@{hi} / {lin}@{hi}": speedup,
            f"{lin} at least 5x faster than {soft} (KV cache) at {hi}": speedup >= 5.0,
        })
    # how fast each kind of byte was read: the linear model's weights alone, and the KV cache as
    # the softmax model's extra time per extra byte between the two positions
    kv_extra = size_at_prefill[f"softmax@{hi}"] - size_at_prefill[f"softmax@{lo}"]
    read_rates = {"weights, matrix-vector products alone (GB/s)": weight_read_rate(models["linear"])}
    if kv_extra > 0 and seconds[f"softmax@{hi}"] > seconds[f"softmax@{lo}"]:
        read_rates["KV cache, softmax's extra time per extra byte (GB/s)"] = (
            kv_extra / (seconds[f"softmax@{hi}"] - seconds[f"softmax@{lo}"]) / 1e9)
    claim["linear state size independent of position"] = len(
        {size_at_prefill[f"linear@{p}"] for p in positions} | {size_after[f"linear@{p}"] for p in positions}) == 1
    command = (f"linattn bench generate --positions {','.join(map(str, positions))} --steps {steps} "
               f"--d-model {d_model} --layers {n_layers} --heads {n_heads} --vocab {vocab_size} "
               f"--mechanisms {','.join(mechanisms)}" + ("" if recompute else " --no-recompute")
               + f" --images {image_batch}"
               + (f" --image-d-model {image_d_model} --image-layers {image_layers}" if image_batch else "")
               + (" --compile" if compile else "") + f" --out {out_dir}")
    result = {
        "command": command,
        "machine": machine_info(),
        "config": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model,
                   "vocab_size": vocab_size, "positional": "sinusoidal", "dtype": "float32", "batch": 1,
                   "positions": list(positions), "steps": steps, "warmup": warmup,
                   "mechanisms": {n: MECHANISMS[n].to_dict() for n in mechanisms},
                   "compile": compile,
                   "timing": "median per-token step time over interleaved steps after warm-up"
                             + (f" ({COMPILE_STEPS} more untimed steps per pair first, for compiling)" if compile else "")},
        "parameters": params,
        "seconds_per_token": seconds,
        "tokens_per_second": {k: 1.0 / s for k, s in seconds.items()},
        "all_seconds": {**times, **recompute_times},
        "prefill_seconds": prefill_s,
        "state_bytes_after_prefill": size_at_prefill,
        "state_bytes_after_steps": size_after,
        "weight_bytes": weight_bytes,
        "bytes_read_per_token_estimate": traffic,
        "read_rates": read_rates,
        "bytes_ratio": {f"softmax@{p} / linear@{p}": traffic[f"softmax@{p}"] / traffic[f"linear@{p}"]
                        for p in positions},
        "claim": claim,
    }
    if image_batch:
        say(f"  images: {image_batch} x {IMAGE_PIXELS} pixels, d_model {image_d_model}, {image_layers} layers "
            f"({time.perf_counter() - t_start:.0f} s so far)")
        result["images"] = _images(image_batch, image_d_model, image_layers, n_heads, say)
    result["wall_seconds"] = time.perf_counter() - t_start
    result["load"] = load.finish()
    md = _markdown(result)
    write_atomically(out_dir, {"generate.json": json.dumps(result, indent=2), "generate.md": md})
    say(md)
    return result


def _images(batch: int, d_model: int, n_layers: int, n_heads: int, say) -> dict:
    """Part 2: time one full generation of ``batch`` 784-pixel images per contender."""
    start = 256  # pixel values are 0..255; the start token is one more id
    models = {name: _lm(257, IMAGE_PIXELS + 1, d_model, n_layers, n_heads, 4 * d_model, MECHANISMS[name])
              for name in IMAGE_MECHANISMS}
    prompt = torch.full((batch, 1), start, dtype=torch.long)
    runs = {f"{name} (recurrent)" if name != "softmax" else "softmax (KV cache)":
            (lambda n, lm=lm: lm.generate(prompt, n, generator=torch.Generator().manual_seed(0)))
            for name, lm in models.items()}
    runs["softmax (recompute prefix)"] = lambda n: generate_recompute(
        models["softmax"], prompt, n, generator=torch.Generator().manual_seed(0))
    seconds = {}
    with torch.no_grad():
        for name, run in runs.items():
            out = run(16)  # warm-up
            t0 = time.perf_counter()
            out = run(IMAGE_PIXELS)
            seconds[name] = time.perf_counter() - t0
            if out.shape != (batch, IMAGE_PIXELS + 1):
                raise AssertionError(f"{name} generated {tuple(out.shape)}, expected {(batch, IMAGE_PIXELS + 1)}")
            say(f"    {name}: {seconds[name]:.2f} s for {batch} images")
    ips = {k: batch / s for k, s in seconds.items()}
    lin = ips["linear (recurrent)"]
    return {
        "config": {"batch": batch, "pixels": IMAGE_PIXELS, "vocab_size": 257, "d_model": d_model,
                   "n_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model, "dtype": "float32",
                   "sampling": "temperature 1 from a start token", "timing": "one full generation after a "
                   "16-token warm-up"},
        "parameters": {k: count_parameters(m) for k, m in models.items()},
        "seconds": seconds,
        "images_per_second": ips,
        "linear speed-up": {k: lin / v for k, v in ips.items() if k != "linear (recurrent)"},
    }


def _markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        "# Generation speed: recurrent decoding vs softmax with a KV cache vs softmax recomputing the prefix",
        "",
        f"Written by `{r['command']}`; do not edit by hand. " + describe_load(r.get("load")),
        "",
        "## Time per token against position",
        "",
        f"TransformerLM, d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads, vocab "
        f"{c['vocab_size']}, float32, batch 1, {r['machine']['threads']} threads. {c['timing']} "
        f"({c['steps']} steps); softmax-recompute = one causal forward over the whole prefix per token.",
        "",
        "| model | position | ms / token | tokens / s | state after prefill (MiB) | prefill (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, s in r["seconds_per_token"].items():
        name, p = key.split("@")
        if key in r["prefill_seconds"]:
            size, prefill = f"{r['state_bytes_after_prefill'][key] / 2**20:.2f}", f"{r['prefill_seconds'][key]:.2f}"
        else:  # recomputing the prefix keeps no state and needs no prefill
            size, prefill = "0 (no state)", "-"
        lines.append(f"| {name} | {p} | {1e3 * s:.2f} | {1 / s:.2f} | {size} | {prefill} |")
    l3 = r["machine"].get("cpu_caches", {}).get("L3")
    weights = r["weight_bytes"]["linear"]
    if l3 is None:
        where = "(the last-level cache's size is unknown here)"
    elif weights <= l3:
        where = (f"here the {l3 / 2**20:.0f} MiB L3 cache is large enough to keep the {weights / 1e6:.0f} MB of "
                 "weights from one step to the next while a longer KV cache streams from memory, so the ratio "
                 "need not bound anything (the L3 is shared with whatever else runs on the host; the read "
                 "rates below are what this run got)")
    else:
        where = f"the {weights / 1e6:.0f} MB of weights exceed the {l3 / 2**20:.0f} MiB L3 cache here"
    lines += ["", "Bytes read per token (weights + decoding state). Their ratio would bound softmax / linear "
              f"if both were read at one rate; {where}:", "",
              "| pair | MB read per token | bytes ratio softmax / linear |", "| --- | ---: | ---: |"]
    for key, b in r["bytes_read_per_token_estimate"].items():
        name, p = key.split("@")
        ratio = r["bytes_ratio"][f"softmax@{p} / linear@{p}"] if name == "softmax" else None
        lines.append(f"| {key} | {b / 1e6:.0f} | {'' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", "| read rate | GB/s |", "| --- | ---: |"]
    lines += [f"| {k.removesuffix(' (GB/s)')} | {v:.1f} |" for k, v in r.get("read_rates", {}).items()]
    lines += ["", "| claim | value |", "| --- | --- |"]
    for k, v in r["claim"].items():
        lines.append(f"| {k} | {v if isinstance(v, bool) else f'{v:.2f}'} |")
    if "images" in r:
        im = r["images"]
        ic = im["config"]
        lines += ["", f"## Images per second: {ic['batch']} images of {ic['pixels']} pixels", "",
                  f"Pixel model: vocab {ic['vocab_size']}, d_model {ic['d_model']}, {ic['n_layers']} layers, "
                  f"{ic['n_heads']} heads, d_ff {ic['d_ff']}, float32, batch {ic['batch']}; {ic['sampling']}; "
                  f"{ic['timing']}.", "",
                  "| decoder | seconds | images / s | linear (recurrent) is faster by |", "| --- | ---: | ---: | ---: |"]
        for k, s in im["seconds"].items():
            up = im["linear speed-up"].get(k)
            lines.append(f"| {k} | {s:.2f} | {im['images_per_second'][k]:.3f} | {'' if up is None else f'{up:.1f}x'} |")
    return "\n".join(lines) + "\n"
