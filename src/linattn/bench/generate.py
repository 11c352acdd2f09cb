"""`linattn bench generate`: per-token generation time at a short and a long position (issue 5).

Claims: for a TransformerLM with d_model 512, 8 layers, 8 heads, float32, batch 1,
- the linear-attention model's time per token at position 16000 is within 1.3x of its time at
  position 100 (its decoding state does not grow with position), and
- at position 16000 it is at least 5x faster than the softmax model decoding with a KV cache.

Method: for each (model, position), a random prompt of ``position`` tokens is prefilled with one
causal forward that returns every layer's state (``TransformerLM.forward(return_state=True,
last_only=True)``). Then ``steps`` decoding steps (``TransformerLM.step``) are timed one by one,
interleaved across all (model, position) pairs so that a slow spell of a shared machine hits every
pair alike; the first ``warmup`` steps of each pair are not counted (the KV cache's first step
grows its storage). The reported time is the median over the counted steps. Both models use
sinusoidal positions (no parameters, so the two have identical parameter counts) and one random
initialisation each. The decoding state's size (bytes of every tensor in it) is recorded at both
positions.

What to expect from arithmetic alone: at batch 1 a decoding step is a chain of matrix-vector
products, bound by memory traffic. Every step reads all weights once (4 bytes x parameters:
~164 MB here, most of it the MLPs and the 32000 x 512 output layer); a softmax layer also reads
its KV cache, 2 x position x d_model x 4 bytes per layer (500 MiB over 8 layers at 16000); a linear
layer reads its (S, z) state, 1 MiB in all. The ratio softmax / linear at a position can therefore
not exceed about (weights + KV cache) / (weights + linear state), which the result records as
``traffic_ratio_bound``: ~4.0 at 16000 for this model, so the 5x claim cannot hold for it at that
position on hardware where both stream memory at one rate (it would from ~20500 positions on).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..models import TransformerConfig, TransformerLM, count_parameters
from ..nn import LinearConfig, SoftmaxConfig
from .harness import machine_info, write_atomically

__all__ = ["run_generate", "state_bytes"]

MECHANISMS = {"linear": LinearConfig(), "softmax": SoftmaxConfig()}


def state_bytes(state) -> int:
    """Bytes of every tensor of an LMState (a KV cache counts its capacity, allocated or not)."""
    total = 0
    for layer in state.layers:
        for t in layer.mechanism:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def run_generate(*, out_dir: str | Path = "docs/benchmarks", positions: tuple[int, ...] = (100, 16000),
                 steps: int = 20, warmup: int = 2, d_model: int = 512, n_layers: int = 8, n_heads: int = 8,
                 vocab_size: int = 32000, quiet: bool = False) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    max_len = max(positions) + warmup + steps + 1
    say(f"linattn bench generate: d_model {d_model}, {n_layers} layers, {n_heads} heads, vocab {vocab_size}, "
        f"float32, batch 1, positions {list(positions)}, {steps} timed steps, {torch.get_num_threads()} threads")
    models, params = {}, {}
    for name, att in MECHANISMS.items():
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=vocab_size, max_len=max_len, d_model=d_model, n_layers=n_layers,
                                n_heads=n_heads, d_ff=4 * d_model, positional="sinusoidal", attention=att)
        models[name] = TransformerLM(cfg).eval()
        params[name] = count_parameters(models[name])

    g = torch.Generator().manual_seed(0)
    states, tokens, prefill_s, size_at_prefill = {}, {}, {}, {}
    with torch.no_grad():
        for name, lm in models.items():
            for p in positions:
                prompt = torch.randint(0, vocab_size, (1, p), generator=g)
                t0 = time.perf_counter()
                logits, state = lm(prompt, return_state=True, last_only=True)
                prefill_s[f"{name}@{p}"] = time.perf_counter() - t0
                states[(name, p)], tokens[(name, p)] = state, logits[:, -1].argmax(-1, keepdim=True)
                size_at_prefill[f"{name}@{p}"] = state_bytes(state)
                say(f"  prefilled {name} at {p} in {prefill_s[f'{name}@{p}']:.2f} s")
        times: dict[str, list[float]] = {f"{n}@{p}": [] for n, p in states}
        for i in range(warmup + steps):  # interleaved: one step of every pair per round
            for (name, p), state in list(states.items()):
                t0 = time.perf_counter()
                logits, state = models[name].step(tokens[(name, p)], state)
                dt = time.perf_counter() - t0
                states[(name, p)], tokens[(name, p)] = state, logits.argmax(-1, keepdim=True)
                if i >= warmup:
                    times[f"{name}@{p}"].append(dt)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    weight_bytes = {n: sum(p.numel() * p.element_size() for p in lm.parameters()) for n, lm in models.items()}
    traffic = {f"{n}@{p}": weight_bytes[n] + size_at_prefill[f"{n}@{p}"] for n, p in states}
    size_after = {f"{n}@{p}": state_bytes(s) for (n, p), s in states.items()}
    lo, hi = min(positions), max(positions)
    lin_ratio = seconds[f"linear@{hi}"] / seconds[f"linear@{lo}"]
    speedup = seconds[f"softmax@{hi}"] / seconds[f"linear@{hi}"]
    result = {
        "command": (f"linattn bench generate --positions {','.join(map(str, positions))} --steps {steps} "
                    f"--d-model {d_model} --layers {n_layers} --heads {n_heads} --vocab {vocab_size} --out {out_dir}"),
        "machine": machine_info(),
        "config": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "d_ff": 4 * d_model,
                   "vocab_size": vocab_size, "positional": "sinusoidal", "dtype": "float32", "batch": 1,
                   "positions": list(positions), "steps": steps, "warmup": warmup,
                   "timing": "median per-token step time over interleaved steps after warm-up"},
        "parameters": params,
        "seconds_per_token": seconds,
        "all_seconds": times,
        "prefill_seconds": prefill_s,
        "state_bytes_after_prefill": size_at_prefill,
        "state_bytes_after_steps": size_after,
        "weight_bytes": weight_bytes,
        "bytes_read_per_token_estimate": traffic,
        "traffic_ratio_bound": {f"softmax@{p} / linear@{p}": traffic[f"softmax@{p}"] / traffic[f"linear@{p}"]
                                for p in positions},
        "claim": {
            f"linear@{hi} / linear@{lo}": lin_ratio,
            f"linear@{hi} within 1.3x of linear@{lo}": lin_ratio <= 1.3,
            f"softmax@{hi} / linear@{hi}": speedup,
            f"linear at least 5x faster than softmax+KV cache at {hi}": speedup >= 5.0,
            "linear state size independent of position": len({size_at_prefill[f"linear@{p}"] for p in positions}
                                                               | {size_after[f"linear@{p}"] for p in positions}) == 1,
        },
        "wall_seconds": time.perf_counter() - t_start,
    }
    md = _markdown(result, positions)
    write_atomically(out_dir, {"generate.json": json.dumps(result, indent=2), "generate.md": md})
    say(md)
    return result


def _markdown(r: dict, positions) -> str:
    lines = [
        "# Per-token generation time: linear attention vs softmax with a KV cache",
        "",
        f"Written by `{r['command']}`; do not edit by hand.",
        "",
        f"TransformerLM, d_model {r['config']['d_model']}, {r['config']['n_layers']} layers, "
        f"{r['config']['n_heads']} heads, vocab {r['config']['vocab_size']}, float32, batch 1, "
        f"{r['machine']['threads']} threads. {r['config']['timing']} ({r['config']['steps']} steps).",
        "",
        "| model | position | ms / token | state after prefill (MiB) | prefill (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, s in r["seconds_per_token"].items():
        name, p = key.split("@")
        lines.append(f"| {name} | {p} | {1e3 * s:.2f} | {r['state_bytes_after_prefill'][key] / 2**20:.2f} | "
                     f"{r['prefill_seconds'][key]:.2f} |")
    lines += ["", "Bytes read per token (weights + decoding state), and the ratio they bound softmax / linear to:", "",
              "| pair | MB read per token | bound on softmax / linear |", "| --- | ---: | ---: |"]
    for key, b in r["bytes_read_per_token_estimate"].items():
        name, p = key.split("@")
        bound = r["traffic_ratio_bound"][f"softmax@{p} / linear@{p}"] if name == "softmax" else None
        lines.append(f"| {key} | {b / 1e6:.0f} | {'' if bound is None else f'{bound:.2f}'} |")
    lines += ["", "| claim | value |", "| --- | --- |"]
    for k, v in r["claim"].items():
        lines.append(f"| {k} | {v if isinstance(v, bool) else f'{v:.2f}'} |")
    return "\n".join(lines) + "\n"
