"""`linattn bench transformers`: Hugging Face transformers' linear-attention layers and models on
their own PyTorch path against the same modules on linattn (``linattn.integrations.transformers``).

Subjects, at checkpoint widths (``sizes="checkpoint"``), B = 1, float32, 2 threads:

- ``gdn_core`` / ``kda_core``: the recurrence itself at those layers' widths, the function the
  layer calls: transformers' ``torch_chunk_gated_delta_rule`` (Qwen3.5's) or
  ``chunk_kimi_delta_attention`` (Kimi Linear's), with q/k normalisation in the kernel and the final
  state returned (as a prefill with a cache asks), against ``linattn.integrations.transformers.delta_rule``
  (the same semantics on linattn's engine: what the replacement layers call). The speed targets
  are about this: a layer adds projections that are the same matmuls on both paths;
- ``gdn_layer``: Qwen3.5-0.8B's Gated DeltaNet layer (hidden 1024, 16 query/key and 16 value heads,
  Dk = Dv = 128), a ``Qwen3_5GatedDeltaNet``;
- ``kda_layer``: Kimi Linear's KDA layer (hidden 2304, 32 heads of 128), a ``KimiLinearDeltaAttention``;
- ``gdn_model`` / ``kda_model``: a small whole model of each family at that width (Qwen3.5 and Kimi
  Linear, 3 linear-attention layers and 1 full-attention layer, vocabulary 1024);
- ``kda_small_model``: a one-layer Kimi Linear model at a small width (hidden 256, 8 heads of 64,
  vocabulary 1024), where the fixed costs around the recurrence (layouts, convolution, gates) weigh
  most. Its prefill runs without a cache: transformers 5.23's cache cannot serve a model without an
  attention layer (``get_seq_length`` raises).
- ``ssd_core``: Mamba-2's SSD scan at Mamba-2 1.3B's width (64 heads of 64, state 128, one group of
  B and C): transformers' ``mamba2_chunk_scan`` (its chunk 256, Mamba-2's default) against
  ``linattn.integrations.transformers.ssd``, with D, dt_bias, softplus and the final state;
- ``ssd_layer``: Mamba-2 1.3B's mixer (hidden 2048, the widths above), a ``Mamba2Mixer``;
- ``ssd_model``: a small whole Mamba-2 model at that width (4 mixer layers, vocabulary 1024).

``--subjects`` times some of them (the Mamba-2 family apart from the delta rule's, say), into a
folder of their own.

Alone: every target's setting is also timed with each path alone in a fresh process of its own (a
warm-up call where the interleaved timing has one, then ``repeats + 1`` timed calls), as a user
runs one of them; transformers' calls leave glibc's heap large, which spares the calls after them
page faults, so interleaving alone could flatter either side. Each run times every
(setting, path) pair this way, the paths' order alternating from run to run.

For each: prefill (forward without gradients, with a fresh cache as ``generate`` has), forward+backward
(every parameter's and the input's gradient), decoding ms/token after ``DECODE_POSITIONS`` tokens
(through transformers' cache), and the peak memory of a prefill (in fresh processes). The two paths
are the same module with the same weights: its class is switched between transformers' own and
linattn's replacement (``attach`` / ``detach``) from call to call, so they are timed interleaved in
one process. Each setting's N list is in :data:`PLAN`; the slow ones (transformers' KDA takes tens of
seconds and ~13 GB at N = 4096) are limited to what fits this machine. The whole timing is repeated
``runs`` times, each in a fresh process with its own load and reference matmul speed; a ratio is the
median over the runs, with min and max. Writes transformers.json and transformers.md; every number
there comes from this code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .. import progress
from ..processes import run_process
from .gpu import ssd_inputs
from .harness import (
    INHERITED_ALLOCATOR,
    RUNS,
    OtherLoad,
    format_run_loads,
    commit_text,
    format_seconds,
    git_state,
    machine_info,
    median,
    moved_lines,
    output_folder,
    run_child,
    run_repeated,
    spread,
    write_atomically,
)

SUBJECTS = ("gdn_core", "kda_core", "gdn_layer", "kda_layer", "gdn_model", "kda_model", "kda_small_model",
            "ssd_core", "ssd_layer", "ssd_model")
DECODED = ("gdn_layer", "kda_layer", "gdn_model", "kda_model", "ssd_layer", "ssd_model")
PATHS = ("transformers", "linattn")
PASSES = ("prefill", "train")
SIZES = ("checkpoint", "tiny")
DECODE_POSITIONS = (100, 8000)
DECODE_STEPS = 20
# subject -> pass -> the Ns timed (checkpoint sizes); "tiny" scales them down for tests
PLAN = {
    "gdn_core": {"prefill": (1024, 4096, 16384), "train": (1024, 4096, 16384)},
    "kda_core": {"prefill": (1024, 4096), "train": (1024,)},
    "gdn_layer": {"prefill": (1024, 4096), "train": (1024,)},
    "kda_layer": {"prefill": (1024,), "train": (1024,)},
    "gdn_model": {"prefill": (1024,), "train": (1024,)},
    "kda_model": {"prefill": (1024,)},
    "kda_small_model": {"prefill": (2048,)},
    "ssd_core": {"prefill": (1024, 4096, 16384), "train": (1024, 4096, 16384)},
    "ssd_layer": {"prefill": (1024, 4096), "train": (1024, 4096)},
    "ssd_model": {"prefill": (1024,), "train": (1024,)},
}
# peak memory of one prefill, per subject: the Ns for both paths, and linattn's alone further on
MEMORY_PLAN = {"gdn_core": ((1024, 4096, 16384), ()), "kda_core": ((1024, 4096), (16384,)),
               "ssd_core": ((1024, 4096, 16384), ()), "ssd_layer": ((1024, 4096, 16384), ())}
# the issue's targets, transformers' time / linattn's at least this: (subject, pass, N) -> factor
TARGETS = {
    ("gdn_core", "prefill", 1024): 2.0, ("gdn_core", "prefill", 4096): 3.0, ("gdn_core", "prefill", 16384): 3.0,
    ("gdn_core", "train", 1024): 3.0, ("gdn_core", "train", 4096): 10.0, ("gdn_core", "train", 16384): 30.0,
    ("kda_core", "prefill", 4096): 20.0, ("kda_small_model", "prefill", 2048): 10.0,
    # issue 45's, for the Mamba-2 family's scan at Mamba-2 1.3B's width (its mixer adds projections of
    # ~0.2 TFLOP at N = 4096, the same matmuls on both paths: timed, no target)
    ("ssd_core", "prefill", 4096): 20.0, ("ssd_core", "train", 4096): 20.0, ("ssd_core", "train", 16384): 50.0,
}
# the targets also timed with each path alone in fresh processes (as a user runs one of them): all
# but the slowest (transformers' gdn_core train at 4096 and 16384 takes seconds to a minute a call)
ALONE = tuple(key for key in TARGETS if not (key[1] == "train" and key[2] > 1024))
KDA_MEMORY_TARGET = 10.0  # transformers' KDA prefill peak / linattn's at N = 4096, at least


def alone_plan(sizes: str) -> tuple[tuple[str, str, int], ...]:
    """:data:`ALONE` for ``sizes``: the tiny sizes (tests) time each subject's first setting alone,
    one fresh process per path, instead of every setting: the same children and code, about half
    the processes."""
    if sizes == "tiny":
        first: dict[str, tuple[str, str, int]] = {}
        for key in ALONE:
            first.setdefault(key[0], key)
        return tuple(first.values())
    return ALONE


def memory_plan(sizes: str) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """:data:`MEMORY_PLAN` for ``sizes``: the tiny sizes (tests) measure each subject's first N on
    both paths and linattn's own Ns, one fresh process each, instead of every N: the same children
    and code, a third of the processes."""
    if sizes == "tiny":
        return {s: (both[:1], ours) for s, (both, ours) in MEMORY_PLAN.items()}
    return MEMORY_PLAN


def _warm(subject: str, n: int) -> bool:
    """Whether a setting gets a warm-up round: not where one of transformers' calls takes tens of
    seconds (its one-time costs are nothing beside that)."""
    return n < 16384 and not (subject.startswith("kda") and n >= 4096)
TINY = 64  # the "tiny" sizes' N unit: N = 1024 becomes 64


def _family(subject: str) -> str:
    return {"gdn": "qwen3_5", "kda": "kimi_linear", "ssd": "mamba2"}[subject[:3]]


def _ssd_scan(path: str):
    """transformers' scan or linattn's, called the same way: ``(x, dt, A, B, C, D, dt_bias, final)``."""
    from ..integrations import transformers as lt

    if path == "linattn":
        return lambda x, dt, A, B, C, D, dt_bias, final: lt.ssd(
            x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True, output_final_state=final)
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    return lambda x, dt, A, B, C, D, dt_bias, final: mamba2_chunk_scan(
        x, dt, A, B, C, chunk_size=256, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=final)


def build(subject: str, sizes: str, paths: tuple[str, ...] = PATHS):
    """``(model, module timed, config)``: the subject's small model built by ``from_config`` (weights
    initialised as transformers does), and the layer or the model itself. A core subject's module is
    ``{path: function}`` for ``paths`` only: a child that times or measures linattn's alone does not
    import transformers' modeling code (seconds a process, and not what a user of linattn's runs)."""
    from ..integrations import transformers as lt

    family = _family(subject)
    if subject == "ssd_core":
        big = sizes == "checkpoint"
        return None, {p: _ssd_scan(p) for p in paths}, {"heads": 64 if big else 4, "head_dim": 64 if big else 16,
                                                         "state": 128 if big else 16, "groups": 1}
    if subject.endswith("core"):
        import importlib

        fns = {"linattn": lt.delta_rule}
        if "transformers" in paths:
            module = importlib.import_module(lt.FAMILIES[family].module)
            fns["transformers"] = (module.chunk_kimi_delta_attention if family == "kimi_linear"
                                   else module.torch_chunk_gated_delta_rule)
        H = (16 if family == "qwen3_5" else 32) if sizes == "checkpoint" else 4
        D = 128 if sizes == "checkpoint" else 16
        return None, {p: fns[p] for p in paths}, {"heads": H, "head_dim": D, "kda": family == "kimi_linear"}
    if sizes == "tiny":
        dims = dict(hidden_size=64, heads=4, head_dim=16)
    elif family == "mamba2":  # Mamba-2 1.3B's mixer
        dims = dict(hidden_size=2048, heads=64, head_dim=64, key_heads=1, state_size=128)
    elif subject == "kda_small_model":
        dims = dict(hidden_size=256, heads=8, head_dim=64)
    elif family == "qwen3_5":
        dims = dict(hidden_size=1024, heads=16, key_heads=16, head_dim=128)
    else:
        dims = dict(hidden_size=2304, heads=32, head_dim=128)
    layers = ("linear_attention",) if subject.endswith("layer") or subject == "kda_small_model" else lt.SMALL_LAYER_TYPES
    config = lt.small_config(family, layer_types=layers, vocab_size=1024 if sizes == "checkpoint" else 99, **dims)
    torch.manual_seed(0)
    model = lt.causal_lm(config)
    if subject.endswith("model"):
        return model, model, config
    layer = next(m for m in model.modules() if type(m).__name__ == lt.FAMILIES[family].layer)
    return model, layer, config


def _switch(module, path: str) -> None:
    """Put ``module``'s linear-attention layers on ``path``: linattn's replacement class
    (``attach``) or transformers' own (``detach``). A core subject's functions are picked per call."""
    from ..integrations import transformers as lt

    if not isinstance(module, dict):
        lt.attach(module) if path == "linattn" else lt.detach(module)


def _n(n: int, sizes: str) -> int:
    """The N timed for the plan's ``n``: itself at checkpoint sizes, ``TINY`` per 1024 at tiny ones."""
    return n if sizes == "checkpoint" else max(n // 1024, 1) * TINY


def _position(position: int, sizes: str) -> int:
    return position if sizes == "checkpoint" else max(position // 50, 1)


def _inputs(subject: str, module, config, n: int, *, grad: bool):
    if subject == "ssd_core":
        # transformers' layout; A and dt_bias initialised as Mamba-2 does (A = -1 .. -H, dt in
        # [1e-3, 1e-1] log-uniform), the raw time steps around 0: bench gpu's ssd inputs, float32
        x = ssd_inputs(n, config["heads"], config["head_dim"], config["state"], dtype=torch.float32,
                       device=torch.device("cpu"), seed=1, groups=config["groups"])
        return {k: t.requires_grad_(grad) for k, t in x.items()}
    g = torch.Generator().manual_seed(1)
    if subject.endswith("core"):
        # transformers' layout (B, N, heads, D); decays near 1 as trained models have, beta in (0, 1)
        H, D = config["heads"], config["head_dim"]
        x = {"query": torch.randn(1, n, H, D, generator=g), "key": torch.randn(1, n, H, D, generator=g),
             "value": torch.randn(1, n, H, D, generator=g),
             "g": torch.nn.functional.logsigmoid(torch.randn(1, n, H, *((D,) if config["kda"] else ()), generator=g) + 4),
             "beta": torch.sigmoid(torch.randn(1, n, H, generator=g))}
        return {k: t.requires_grad_(grad) for k, t in x.items()}
    if subject.endswith("layer"):
        h = torch.randn(1, n, config.hidden_size, generator=g)
        return h.requires_grad_(grad)
    return torch.randint(3, config.vocab_size, (1, n), generator=g)


def _call(subject: str, module, config, x, pass_: str, path: str = "linattn") -> None:
    if subject == "ssd_core":
        if pass_ == "prefill":
            with torch.no_grad():
                module[path](**x, final=True)
            return
        for t in x.values():
            t.grad = None
        out = module[path](**x, final=False)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        return
    if subject.endswith("core"):
        fn = module[path]
        if pass_ == "prefill":
            with torch.no_grad():
                fn(x["query"], x["key"], x["value"], g=x["g"], beta=x["beta"], output_final_state=True,
                   **({"use_qk_l2norm_in_kernel": True} if path == "transformers" else {}))
            return
        for t in x.values():
            t.grad = None
        out, _ = fn(x["query"], x["key"], x["value"], g=x["g"], beta=x["beta"],
                    **({"use_qk_l2norm_in_kernel": True} if path == "transformers" else {}))
        out.backward(torch.ones_like(out))
        return
    if pass_ == "prefill":
        with torch.no_grad():
            if subject.endswith("layer"):
                from transformers import DynamicCache  # here: a core subject's call needs none of transformers

                module(x, cache_params=DynamicCache(config=config))
            else:  # a model without attention layers cannot have transformers' cache (docstring)
                module(x, use_cache=subject != "kda_small_model")
        return
    module.zero_grad(set_to_none=True)
    if subject.endswith("layer"):
        x.grad = None
        out = module(x)
        out.backward(torch.ones_like(out))
    else:
        module(x, labels=x, use_cache=False).loss.backward()


def _time_pass(subject, module, config, pass_, n, repeats) -> dict:
    x = _inputs(subject, module, config, n, grad=pass_ == "train")
    times = {p: [] for p in PATHS}
    first = 0 if _warm(subject, n) else 1  # round 0 warms up, interleaved like the others
    for rep in range(first, repeats + 1):
        order = PATHS if rep % 2 else PATHS[::-1]
        for path in order:
            _switch(module, path)
            t0 = time.perf_counter()
            _call(subject, module, config, x, pass_, path)
            if rep:
                times[path].append(time.perf_counter() - t0)
    return {p: {"median_s": median(t), "all_s": t} for p, t in times.items()}


def _alone_child(key: str, path: str, sizes: str, repeats: int) -> dict:
    """One target setting ``key`` (``subject/pass/N``, N as timed) on ``path`` only, in
    this fresh process: a warm-up call where :func:`_warm` gives one, then ``repeats`` timed calls."""
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    subject, pass_, n = key.split("/")
    model, module, config = build(subject, sizes, (path,))
    if model is not None:
        module.train(False)
    n = int(n)
    x = _inputs(subject, module, config, n, grad=pass_ == "train")
    _switch(module, path)
    if _warm(subject, n):
        _call(subject, module, config, x, pass_, path)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _call(subject, module, config, x, pass_, path)
        times.append(time.perf_counter() - t0)
    return {"median_s": median(times), "all_s": times}


def _alone(sizes: str, repeats: int, runs: int, say, subjects: tuple[str, ...] = SUBJECTS) -> list[dict]:
    """Each :func:`alone_plan` setting of ``subjects`` on each path alone, a fresh process per
    (setting, path), ``runs`` times; one ``{"times": {key: {path: {...}}}, "load": {...}}`` per run."""
    out = []
    settings = [key for key in alone_plan(sizes) if key[0] in subjects]
    if not settings:
        return out
    for i in range(runs):
        say(f"  run {i + 1}/{runs}: each path alone, a fresh process per setting ...")
        load = OtherLoad(reference=True)
        times: dict = {}
        for subject, pass_, n in settings:
            key = f"{subject}/{pass_}/{_n(n, sizes)}"
            for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                times.setdefault(key, {})[path] = run_child(
                    "linattn.bench.transformers", ["alone", key, path, sizes, str(repeats)], {})
        out.append({"times": times, "load": load.finish()})
    return out


def _decode(subject, module, config, position: int, steps: int) -> dict:
    """Median seconds per decoding step after ``position`` tokens, the paths interleaved step by step
    on caches of their own (prefilled by linattn: same states' shapes, less waiting)."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(2)
    caches = {}
    with torch.no_grad():
        _switch(module, "linattn")
        for path in PATHS:
            if subject.endswith("layer"):
                caches[path] = DynamicCache(config=config)
                module(torch.randn(1, position, config.hidden_size, generator=g), cache_params=caches[path])
            else:  # Mamba-2's causal LM names its cache cache_params
                out = module(torch.randint(3, config.vocab_size, (1, position), generator=g), use_cache=True)
                caches[path] = out.cache_params if hasattr(out, "cache_params") else out.past_key_values
        times = {p: [] for p in PATHS}
        for step in range(steps + 2):  # two warm-up steps each
            for path in (PATHS if step % 2 else PATHS[::-1]):
                _switch(module, path)
                if subject.endswith("layer"):
                    x = torch.randn(1, 1, config.hidden_size, generator=g)
                    t0 = time.perf_counter()
                    module(x, cache_params=caches[path])
                else:
                    x = torch.randint(3, config.vocab_size, (1, 1), generator=g)
                    t0 = time.perf_counter()
                    cache = {"cache_params" if config.model_type == "mamba2" else "past_key_values": caches[path]}
                    module(x, **cache, use_cache=True)
                if step >= 2:
                    times[path].append(time.perf_counter() - t0)
    return {p: {"median_s": median(t), "all_s": t} for p, t in times.items()}


def _child(sizes: str, repeats: int, subjects: tuple[str, ...] = SUBJECTS) -> dict:
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    out: dict = {"times": {}, "decode": {}}
    for subject in subjects:
        model, module, config = build(subject, sizes)
        if model is not None:
            module.train(False)
        for pass_, ns in PLAN[subject].items():
            for n in map(functools.partial(_n, sizes=sizes), ns):
                out["times"][f"{subject}/{pass_}/{n}"] = _time_pass(subject, module, config, pass_, n, repeats)
        if subject not in DECODED:
            continue
        for position in map(functools.partial(_position, sizes=sizes), DECODE_POSITIONS):
            out["decode"][f"{subject}/{position}"] = _decode(subject, module, config, position,
                                                             DECODE_STEPS if sizes == "checkpoint" else 4)
        del model, module
    return out


def _memory_child(subject: str, path: str, n: int, sizes: str) -> dict:
    """Peak RSS above the weights and inputs of one prefill (run in a fresh process)."""
    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    from .harness import peak_rss_bytes, release_free_heap

    model, module, config = build(subject, sizes, (path,))
    _switch(module, path)
    short = _inputs(subject, module, config, 64, grad=False)
    _call(subject, module, config, short, "prefill", path)  # lazy initialisation first
    x = _inputs(subject, module, config, n, grad=False)
    release_free_heap()
    return {"peak_bytes": peak_rss_bytes(lambda: _call(subject, module, config, x, "prefill", path))}


def memory(subject: str, path: str, n: int, sizes: str, *, timeout: float = 3600) -> dict:
    proc = run_process([sys.executable, "-m", "linattn.bench.transformers", "memory", subject, path, str(n), sizes],
                       timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement of {subject} ({path}) at N = {n} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_subjects(subjects) -> tuple[str, ...]:
    """``subjects`` as a tuple in :data:`SUBJECTS`' order; ValueError naming an unknown one or none."""
    subjects = tuple(subjects)
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown or not subjects:
        raise ValueError(f"run_transformers: subjects must be some of {', '.join(SUBJECTS)}, got "
                         f"{', '.join(map(repr, subjects)) or 'none'}")
    return tuple(s for s in SUBJECTS if s in subjects)


def run_transformers(*, out: str | Path = "docs/benchmarks/transformers", repeats: int = 2, runs: int = RUNS,
                     sizes: str = "checkpoint", measure_memory: bool = True, quiet: bool = False,
                     subjects: tuple[str, ...] = SUBJECTS) -> dict:
    """Time ``subjects`` ``runs`` times (a fresh process each), measure peak memory, write
    transformers.json and transformers.md in ``out``, print the Markdown; return the result.
    transformers must be installed (the ``transformers`` extra)."""
    from ..extras import require_extra

    require_extra("transformers", command="linattn bench transformers")
    for name, value in (("runs", runs), ("repeats", repeats)):
        if value < 1:
            raise ValueError(f"run_transformers: {name} must be >= 1, got {value}")
    if sizes not in SIZES:
        raise ValueError(f"run_transformers: sizes must be one of {SIZES}, got {sizes!r}")
    subjects = check_subjects(subjects)
    output_folder(out)
    say = functools.partial(progress.say, quiet=quiet)
    say(f"linattn bench transformers: {sizes} sizes, {runs} runs of {repeats} interleaved calls per setting")
    t0 = time.perf_counter()
    import transformers

    result: dict = {
        "command": (f"linattn bench transformers --repeats {repeats}" + (f" --runs {runs}" if runs != RUNS else "")
                    + (f" --sizes {sizes}" if sizes != "checkpoint" else "")
                    + ("" if measure_memory else " --no-measure-memory")
                    + ("" if subjects == SUBJECTS else f" --subjects {','.join(subjects)}") + f" --out {out}"),
        "commit": git_state(),
        "machine": machine_info(),
        "config": {"sizes": sizes, "plan": {s: dict(p) for s, p in PLAN.items()}, "repeats": repeats, "runs": runs,
                   "decode_positions": list(DECODE_POSITIONS), "decode_steps": DECODE_STEPS,
                   "transformers": transformers.__version__, "dtype": "float32", "batch_size": 1,
                   "subjects": list(subjects)},
        "runs": run_repeated("linattn.bench.transformers", [sizes, str(repeats), ",".join(subjects)], runs=runs,
                             allocators=INHERITED_ALLOCATOR, say=say),
    }
    children = [r["allocators"]["inherited"] for r in result["runs"]]
    result["ratios"] = {key: spread([c["times"][key]["transformers"]["median_s"] / c["times"][key]["linattn"]["median_s"]
                                     for c in children]) for key in children[0]["times"]}
    result["decode_ratios"] = {key: spread([c["decode"][key]["transformers"]["median_s"]
                                            / c["decode"][key]["linattn"]["median_s"] for c in children])
                               for key in children[0]["decode"]}
    result["alone"] = _alone(sizes, repeats + 1, runs, say, subjects)
    result["alone_ratios"] = {key: spread([r["times"][key]["transformers"]["median_s"]
                                           / r["times"][key]["linattn"]["median_s"] for r in result["alone"]])
                              for key in (result["alone"][0]["times"] if result["alone"] else ())}
    if measure_memory:
        say("  peak memory of one prefill (fresh processes) ...")
        result["memory"] = {}
        for subject, (both, ours_only) in memory_plan(sizes).items():
            if subject not in subjects:
                continue
            for n in (*both, *ours_only):
                for path in (PATHS if n in both else ("linattn",)):
                    n_real = _n(n, sizes)
                    result["memory"][f"{subject}/{path}/{n_real}"] = memory(subject, path, n_real, sizes)["peak_bytes"]
    result["claims"] = claims(result)
    result["elapsed_seconds"] = time.perf_counter() - t0
    end = git_state()
    if end != result["commit"]:  # the times of a run whose code moved under it belong to no one commit
        result["commit_at_end"] = end
    md = format_transformers(result)
    write_atomically(out, {"transformers.json": json.dumps(result, indent=2), "transformers.md": md})
    say(md)
    return result


def _medians(result: dict, table: str, key: str, path: str) -> float:
    return median([r["allocators"]["inherited"][table][key][path]["median_s"] for r in result["runs"]])


def claims(result: dict) -> dict[str, dict]:
    """Each target: its statement, the measured median and spread, and whether the median holds it."""
    out: dict[str, dict] = {}
    if result["config"]["sizes"] != "checkpoint":  # the targets are about the checkpoint widths
        return out
    for (subject, pass_, n), factor in TARGETS.items():
        key = f"{subject}/{pass_}/{n}"
        if key in result["ratios"]:
            s = result["ratios"][key]
            out[key] = {"statement": f"{subject} {pass_} at N = {n}: linattn at least {factor:g}x faster than "
                                     f"transformers' own path", "spread": s, "holds": s["median"] >= factor}
        if key in result.get("alone_ratios", {}):
            s = result["alone_ratios"][key]
            out[f"{key}/alone"] = {"statement": f"{subject} {pass_} at N = {n}, each path alone in a fresh process: "
                                                f"linattn at least {factor:g}x faster than transformers' own path",
                                   "spread": s, "holds": s["median"] >= factor}
    for subject in (s for s in DECODED if f"{s}/{DECODE_POSITIONS[0]}" in result["decode_ratios"]):
        near, far = (result["decode_ratios"].get(f"{subject}/{p}") for p in DECODE_POSITIONS)
        out[f"{subject}/decode"] = {
            "statement": f"{subject} decoding no slower per token than transformers' own path at positions "
                         f"{DECODE_POSITIONS[0]} and {DECODE_POSITIONS[1]}",
            "spread": {"near": near, "far": far}, "holds": near["median"] >= 1 and far["median"] >= 1}
        flat = _medians(result, "decode", f"{subject}/{DECODE_POSITIONS[1]}", "linattn") / _medians(
            result, "decode", f"{subject}/{DECODE_POSITIONS[0]}", "linattn")
        out[f"{subject}/decode_flat"] = {
            "statement": f"{subject} linattn's time per token at position {DECODE_POSITIONS[1]} within 1.5x of "
                         f"position {DECODE_POSITIONS[0]}'s", "ratio": flat, "holds": flat <= 1.5}
    mem = result.get("memory", {})
    if "kda_core/transformers/4096" in mem:
        r = mem["kda_core/transformers/4096"] / mem["kda_core/linattn/4096"]
        out["kda_core/memory"] = {"statement": f"kda_core prefill at N = 4096: peak memory at least "
                                                f"{KDA_MEMORY_TARGET:g}x less than transformers'", "ratio": r,
                                   "holds": r >= KDA_MEMORY_TARGET}
    for subject, (both, ours_only) in MEMORY_PLAN.items():
        ns = sorted(_n(n, result["config"]["sizes"]) for n in (*both, *ours_only))
        peaks = [mem.get(f"{subject}/linattn/{n}") for n in ns]
        if None in peaks or len(ns) < 2:
            continue
        growth = (peaks[-1] / peaks[0]) / (ns[-1] / ns[0])
        out[f"{subject}/memory_linear"] = {
            "statement": f"{subject} linattn prefill peak memory growing linearly in N: peak({ns[-1]}) / "
                         f"peak({ns[0]}) within 1.25x of {ns[-1] // ns[0]}", "ratio": growth, "holds": growth <= 1.25}
    return out


def _ratio_table(ratios: dict, time_of: Callable[[str, str], float]) -> list[str]:
    """Markdown rows of ``ratios`` (``subject/pass/N`` -> spread), each path's time from ``time_of(key, path)``."""
    lines = ["| subject | pass | N | transformers | linattn | ratio (median) | min | max | target | holds |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key, s in ratios.items():
        subject, pass_, n = key.split("/")
        target = TARGETS.get((subject, pass_, int(n)))
        lines.append(f"| {subject} | {pass_} | {n} | {format_seconds(time_of(key, 'transformers'))} | "
                     f"{format_seconds(time_of(key, 'linattn'))} | {s['median']:.2f}x | "
                     f"{s['min']:.2f}x | {s['max']:.2f}x | {'-' if target is None else f'{target:g}x'} | "
                     f"{'-' if target is None else ('yes' if s['median'] >= target else 'NO')} |")
    return lines


def format_transformers(result: dict) -> str:
    cfg = result["config"]
    lines = ["# transformers' linear-attention layers: their PyTorch path against linattn", "",
             f"Command: `{result['command']}`", "",
             *([f"Code: {commit_text(result['commit'])}.", ""] if "commit" in result else []),  # absent: older runs
             *moved_lines(result.get("commit_at_end"), "times taken after the change time other code"),
             f"transformers {cfg['transformers']}, {cfg['sizes']} sizes (see the module docstring of "
             "linattn/bench/transformers.py), B = 1, float32, the same module and weights on both paths, "
             f"interleaved; {cfg['runs']} runs in fresh processes, {cfg['repeats']} timed calls per setting and run. "
             "Times are the median over runs of each run's median; a ratio is transformers' time / linattn's, "
             "median over runs with min and max.", "",
             *_ratio_table(result["ratios"], lambda key, path: _medians(result, "times", key, path))]
    if result.get("alone"):
        lines += ["", "Each path alone, as a user runs one of them: a fresh process per setting and path (a warm-up "
                  f"call where the interleaved timing has one, then {cfg['repeats'] + 1} timed calls); times are the "
                  "median over runs of each process's median:", "",
                  *_ratio_table(result["alone_ratios"], lambda key, path: median(
                      [r["times"][key][path]["median_s"] for r in result["alone"]]))]
    lines += ["", "Decoding, per token, after the given number of tokens (through transformers' cache):", "",
              "| subject | position | transformers | linattn | ratio (median) | min | max |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, s in result["decode_ratios"].items():
        subject, pos = key.split("/")
        lines.append(f"| {subject} | {pos} | {_medians(result, 'decode', key, 'transformers') * 1e3:.2f} ms | "
                     f"{_medians(result, 'decode', key, 'linattn') * 1e3:.2f} ms | {s['median']:.2f}x | "
                     f"{s['min']:.2f}x | {s['max']:.2f}x |")
    if "memory" in result:
        lines += ["", "Peak memory of one prefill above the weights and inputs (RSS high-water mark, fresh "
                  "processes, one measurement each):", "", "| subject | path | N | peak |", "| --- | --- | ---: | ---: |"]
        for key, b in result["memory"].items():
            subject, path, n = key.split("/")
            lines.append(f"| {subject} | {path} | {n} | {b / 2**20:.0f} MiB |")
    lines += ["", "Claims:", ""]
    for c in result["claims"].values():
        s = c.get("spread")
        if s is not None and "median" in s:
            measured = f"{s['median']:.2f}x (min {s['min']:.2f}x, max {s['max']:.2f}x)"
        elif s is not None:
            measured = (f"{s['near']['median']:.2f}x and {s['far']['median']:.2f}x (min "
                        f"{min(s['near']['min'], s['far']['min']):.2f}x)")
        else:
            measured = f"{c['ratio']:.2f}x"
        lines.append(f"- {c['statement']}: {measured}: {'holds' if c['holds'] else 'DOES NOT HOLD'}")
    lines += ["", "Runs (load from other processes, reference matmul speed):", ""]
    lines += format_run_loads([r["load"] for r in result["runs"]])
    if result.get("alone"):
        lines += ["", "Each path alone, its runs:", ""]
        lines += format_run_loads([r["load"] for r in result["alone"]])
    lines += ["", f"Elapsed: {result['elapsed_seconds'] / 60:.1f} min.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# `linattn demo`'s part: seconds, not minutes
# ---------------------------------------------------------------------------------------------

DEMO_N = 2048


def demo_part(*, n: int = DEMO_N, hidden_size: int = 512, heads: int = 8, head_dim: int = 64) -> dict:
    """A small Qwen3.5 hybrid (``hidden_size``, 3 Gated DeltaNet layers of ``heads`` heads of
    ``head_dim`` and one full-attention layer) and a small Mamba-2 (4 mixers of ``2 hidden_size /
    head_dim`` heads of ``head_dim``, one group, state ``2 head_dim``): prefill of ``n`` tokens on
    transformers' own path and on linattn, interleaved (2 calls each after a warm-up round); then
    packed documents in tiny float64 Qwen3.5, Kimi Linear and Bamba models: linattn's packed output
    against the documents one by one, and what transformers' own path does with the same packed
    batch (refuses, or mixes the documents)."""
    from ..integrations import transformers as lt

    torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
    config = lt.small_config("qwen3_5", hidden_size=hidden_size, heads=heads, key_heads=heads, head_dim=head_dim,
                             vocab_size=1024)
    torch.manual_seed(0)
    model = lt.causal_lm(config)
    times = _time_pass("gdn_model", model, config, "prefill", n, repeats=2)
    prefill = {"n": n, "hidden_size": hidden_size, "heads": heads, "head_dim": head_dim,
               **{f"{p}_s": t["median_s"] for p, t in times.items()}}
    prefill["ratio"] = prefill["transformers_s"] / prefill["linattn_s"]
    ssd_heads = max(2 * hidden_size // head_dim, 1)
    ssd_config = lt.small_config("mamba2", hidden_size=hidden_size, heads=ssd_heads, key_heads=1, head_dim=head_dim,
                                 state_size=2 * head_dim, vocab_size=1024)
    torch.manual_seed(0)
    times = _time_pass("ssd_model", lt.causal_lm(ssd_config), ssd_config, "prefill", n, repeats=2)
    ssd_prefill = {"n": n, "hidden_size": hidden_size, "heads": ssd_heads, "head_dim": head_dim,
                   "state_size": 2 * head_dim, **{f"{p}_s": t["median_s"] for p, t in times.items()}}
    ssd_prefill["ratio"] = ssd_prefill["transformers_s"] / ssd_prefill["linattn_s"]
    packed = {}
    lengths = [7, 1, 12, 5]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(3, 99, (1, n), generator=g) for n in lengths]
    kwargs = dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=max(lengths), max_length_k=max(lengths), use_cache=False)
    for family in ("qwen3_5", "kimi_linear", "bamba"):
        torch.manual_seed(0)
        tiny = lt.causal_lm(lt.small_config(family), dtype=torch.float64, experts_implementation="eager")
        row = {}
        with torch.no_grad():
            for path in ("linattn", "transformers"):
                _switch(tiny, path)
                alone = torch.cat([tiny(d, use_cache=False).logits[0] for d in docs])
                try:
                    got = tiny(torch.cat(docs, 1), **kwargs).logits[0]
                    row[path] = {"rel_err": float((got - alone).abs().max() / alone.abs().max())}
                except ValueError as err:
                    row[path] = {"refused": str(err).split(".")[0]}
        packed[family] = row
    return {"prefill": prefill, "ssd_prefill": ssd_prefill, "packed": packed, "documents": lengths}


def format_demo_part(part: dict) -> list[str]:
    p = part["prefill"]
    lines = [f"## transformers' models on linattn (`linattn.integrations.transformers`)", "",
             f"A small Qwen3.5 hybrid (hidden {p['hidden_size']}, 3 Gated DeltaNet layers of {p['heads']} heads of "
             f"{p['head_dim']}, 1 full-attention layer), prefill of {p['n']} tokens, the same weights on both paths, interleaved: transformers' own "
             f"PyTorch path {format_seconds(p['transformers_s'])}, linattn {format_seconds(p['linattn_s'])}: "
             f"{p['ratio']:.1f}x. Checkpoint widths: `linattn bench transformers`.", ""]
    q = part.get("ssd_prefill")
    if q is not None:
        lines += [f"A small Mamba-2 (hidden {q['hidden_size']}, 4 mixers of {q['heads']} heads of {q['head_dim']}, state "
                  f"{q['state_size']}, one group), prefill of {q['n']} tokens, likewise: transformers' own PyTorch path "
                  f"{format_seconds(q['transformers_s'])}, linattn {format_seconds(q['linattn_s'])}: {q['ratio']:.1f}x.",
                  ""]
    lines += [f"Packed documents (lengths {part['documents']}, one batch row, `cu_seq_lens_q`), float64, largest "
              "difference from running the documents one by one, relative to the logits' scale:", ""]
    for family, row in part["packed"].items():
        cells = []
        for path in ("linattn", "transformers"):
            r = row[path]
            cells.append(f"{path}: " + (f"{r['rel_err']:.1e}" if "rel_err" in r else f"refused (\"{r['refused']}\")"))
        lines.append(f"- {family}: " + "; ".join(cells))
    return lines


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]), tuple(sys.argv[4].split(",")))))
    elif len(sys.argv) == 6 and sys.argv[1] == "alone":
        print(json.dumps(_alone_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
    elif len(sys.argv) == 6 and sys.argv[1] == "memory":
        print(json.dumps(_memory_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
    else:
        raise SystemExit("usage: python -m linattn.bench.transformers child SIZES REPEATS SUBJECTS | "
                         "alone SUBJECT/PASS/N PATH SIZES REPEATS | memory SUBJECT PATH N SIZES")
