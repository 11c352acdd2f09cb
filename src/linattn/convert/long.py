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

Threads: ``--threads`` (default 1) in every subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

__all__ = ["LONG_MODELS", "add_long_arguments", "run_long"]

# name -> attention config dict (None: the original softmax model with transformers' attention)
LONG_MODELS: dict[str, dict | None] = {
    "original (eager)": None,
    "original (sdpa)": None,
    "favor m=128": {"name": "favor", "num_features": 128},
    "hedgehog w=0": {"name": "hedgehog", "window": 0},
    "hedgehog w=64": {"name": "hedgehog", "window": 64},
    "local w=64": {"name": "local", "window": 64},
}


# glibc: every block of 64 KiB or more is its own mapping, returned to the system when freed
MEMORY_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def add_long_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="docs/convert", help="folder for long.json (default docs/convert)")
    p.add_argument("--ns", default="512,2048,8192", help="sequence lengths (default 512,2048,8192)")
    p.add_argument("--models", default=",".join(LONG_MODELS), help="comma-separated names from: " + ", ".join(LONG_MODELS))
    p.add_argument("--student", action="append", default=[], metavar="NAME=RUN_DIR",
                   help="also time a distilled student from a `convert distill` run folder (repeatable)")
    p.add_argument("--repeats", type=int, default=2, help="timed forwards per configuration (default 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--position-method", default="tile", choices=["tile", "interpolate"])


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


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
            base = _vm_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the high-water mark VmHWM to the current RSS
            model(input_ids=ids, attention_mask=mask)
            return {"peak_bytes": (_vm_kib("VmHWM") - base) * 1024}
        model(input_ids=ids, attention_mask=mask)  # warm-up
        times = []
        for _ in range(spec["repeats"]):
            t = time.perf_counter()
            out = model(input_ids=ids, attention_mask=mask)
            times.append(time.perf_counter() - t)
        emb = mean_pool(out.last_hidden_state, mask)
    return {"seconds": sorted(times)[len(times) // 2], "all_seconds": times,
            "finite": bool(torch.isfinite(out.last_hidden_state).all()), "embedding": emb[0].tolist()}


def run_long(args: argparse.Namespace, *, command: str = "") -> dict:
    from ..bench.harness import OtherLoad, machine_info, write_atomically

    ns = [int(x) for x in args.ns.split(",") if x]
    specs: list[tuple[str, dict]] = []
    for name in [x for x in args.models.split(",") if x]:
        if name not in LONG_MODELS:
            raise ValueError(f"--models: unknown {name!r}; known: {list(LONG_MODELS)}")
        impl = "sdpa" if "sdpa" in name else "eager"
        specs.append((name, {"attention": LONG_MODELS[name], "impl": impl}))
    for item in args.student:
        name, _, run = item.rpartition("=")  # the name may hold "=" (w=0), the folder not
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
            spec = {**base, "n": n, "threads": args.threads, "repeats": args.repeats,
                    "position_method": args.position_method}
            res, error = {}, None
            for mode, env in (("time", {}), ("memory", MEMORY_MALLOC_ENV)):
                proc = subprocess.run([sys.executable, "-m", "linattn.convert.long", json.dumps({**spec, "mode": mode})],
                                      capture_output=True, text=True,
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
            result = {"command": command, "threads": args.threads, "position_method": args.position_method,
                      "rows": rows, "machine": machine_info(), "load": load.finish()}
            write_atomically(args.out, {"long.json": json.dumps(result, indent=1)})
    return result


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
