"""Long inputs: the converted model past BERT's 512 positions, its time and memory vs the original.

MiniLM has 512 learned positions; :func:`linattn.convert.extend_positions` tiles the table (row p =
row p mod 512, Longformer's initialisation) for every model timed here, the original included, so
that all read the same inputs: the held-out Shakespeare text, tokenised, cut to N tokens, batch 1.

Each (model, N) runs in two fresh subprocesses (inference, no grad), after loading, converting and
extending:

- time: one warm-up forward at N, then the timed forwards (median reported);
- memory: a warm-up forward at 128 tokens (lazy initialisation), then one forward at N; peak memory
  is the resident set's high-water mark during it above the resident set just before it
  (``/proc/self/clear_refs``), so the weights are not counted. This subprocess runs with
  ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0`` so that freed blocks go back to
  the system at once and the resident set follows the live tensors (with glibc's defaults, memory
  freed by the warm-up stays resident and hides part of the peak).

Threads: ``threads`` (``--threads``, default 1) in every subprocess.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ..bench.harness import proc_status_kib
from ..nn.registry import AttentionConfig, attention_config, attention_config_to_dict
from ..processes import run_process
from .linearize import POSITION_METHODS

__all__ = ["LONG_MODELS", "run_long"]

# name (the value of --models) -> the mechanism config it is converted to (None: the original
# softmax model with transformers' attention of that name)
LONG_MODELS: dict[str, AttentionConfig | None] = {
    "original (eager)": None,
    "original (sdpa)": None,
    "favor m=128": attention_config("favor", num_features=128),
    "hedgehog w=0": attention_config("hedgehog", window=0),
    "hedgehog w=64": attention_config("hedgehog", window=64),
    "local w=64": attention_config("local", window=64),
}

# glibc: every block of 64 KiB or more is its own mapping, returned to the system when freed
MEMORY_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _child(spec: dict) -> dict:
    """One measurement (runs in the subprocess)."""
    torch.set_num_threads(spec["threads"])
    from ..nn.registry import attention_config_from_dict
    from .data import heldout_sentences, load_pretrained, mean_pool
    from .linearize import extend_positions, linearize

    model, tok = load_pretrained()
    if spec["attention"] is None:
        model.set_attn_implementation(spec["impl"])
    else:
        model = linearize(model, attention_config_from_dict(spec["attention"]), inplace=True)
        if spec.get("checkpoint"):
            from safetensors.torch import load_file

            sd = load_file(spec["checkpoint"])
            extras = {k: v for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)}
            model.load_state_dict({**sd, **extras})
    n = spec["n"]
    if n > model.config.max_position_embeddings:
        extend_positions(model, n, method=spec["position_method"])
    text = " ".join(heldout_sentences(100000))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n - 2:
        ids = ids + ids
    ids = torch.tensor([[tok.cls_token_id, *ids[: n - 2], tok.sep_token_id]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if spec["mode"] == "memory":
            model(input_ids=ids[:, :128], attention_mask=mask[:, :128])  # lazy initialisation only
            base = proc_status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the high-water mark VmHWM to the current RSS
            model(input_ids=ids, attention_mask=mask)
            return {"peak_bytes": (proc_status_kib("VmHWM") - base) * 1024}
        model(input_ids=ids, attention_mask=mask)  # warm-up
        times = []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            out = model(input_ids=ids, attention_mask=mask)
            times.append(time.perf_counter() - t)
        emb = mean_pool(out.last_hidden_state, mask)
    return {"seconds": sorted(times)[len(times) // 2], "all_seconds": times,
            "finite": bool(torch.isfinite(out.last_hidden_state).all()), "embedding": emb[0].tolist()}


def run_long(out_dir: str | Path, *, ns: Sequence[int] = (512, 2048, 8192), models: Sequence[str] = tuple(LONG_MODELS),
             students: Mapping[str, str | Path] | None = None, repeats: int = 2, threads: int = 1,
             position_method: str = "tile", command: str = "") -> dict:
    """Time and peak memory of each of ``models`` (names of :data:`LONG_MODELS`) and each distilled
    student (``{name: run folder of linattn convert distill}``) at every length of ``ns``; writes
    ``long.json`` in ``out_dir`` after each measurement."""
    from ..bench.harness import OtherLoad, machine_info, write_atomically

    if position_method not in POSITION_METHODS:
        raise ValueError(f"position_method must be one of {POSITION_METHODS}, got {position_method!r}")
    specs: list[tuple[str, dict]] = []
    for name in models:
        if name not in LONG_MODELS:
            raise ValueError(f"unknown model {name!r}; known: {list(LONG_MODELS)}")
        impl = "sdpa" if "sdpa" in name else "eager"
        config = LONG_MODELS[name]
        specs.append((name, {"attention": None if config is None else attention_config_to_dict(config), "impl": impl}))
    for name, run in (students or {}).items():
        state_dir = Path(run) / "checkpoints"
        latest = json.loads((state_dir / "latest.json").read_text())["dir"]
        state = json.loads((state_dir / latest / "state.json").read_text())
        specs.append((name, {"attention": state["config"]["attention"], "impl": "eager",
                             "checkpoint": str(state_dir / latest / "student.safetensors")}))
    load = OtherLoad()
    rows = []
    ref_emb: dict[int, list[float]] = {}
    for n in ns:
        for name, base in specs:
            spec = {**base, "n": n, "threads": threads, "repeats": repeats, "position_method": position_method}
            res, error = {}, None
            for mode, env in (("time", {}), ("memory", MEMORY_MALLOC_ENV)):
                proc = run_process([sys.executable, "-m", "linattn.convert.long", json.dumps({**spec, "mode": mode})],
                                   env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
                if proc.returncode != 0:
                    error = proc.stderr.strip().splitlines()[-1:]
                    break
                res.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            if error is not None:
                row = {"model": name, "n": n, "error": error}
            else:
                emb = torch.tensor(res.pop("embedding"))
                if name == "original (eager)":
                    ref_emb[n] = emb
                cos = float(emb @ ref_emb[n]) if n in ref_emb else None
                row = {"model": name, "n": n, **res, "cosine_to_original": cos}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "all_seconds"}), flush=True)
            result = {"command": command, "threads": threads, "position_method": position_method,
                      "rows": rows, "machine": machine_info(), "load": load.finish()}
            write_atomically(out_dir, {"long.json": json.dumps(result, indent=1)})
    return result


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
