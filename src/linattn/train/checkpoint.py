"""Training checkpoints: everything needed to continue a run exactly.

``out/checkpoints/step_00000100/`` holds

- ``model.safetensors`` + ``config.json``: the model, written by
  :func:`linattn.models.save_checkpoint` (so ``TransformerLM.from_pretrained`` opens it);
- ``trainer.pt``: ``torch.save`` of the optimiser state, every rank's RNG states (torch, CUDA,
  Python ``random``, numpy) and the model's non-tensor state-dict entries (modules' extra state,
  such as a FAVOR layer's redraw generator and counter, which ``model.safetensors`` cannot hold),
  loaded back with ``weights_only=True``;
- ``trainer.json``: step, sampler position, world size, the :class:`TrainConfig` and the sha256
  of ``trainer.pt``.

The learning-rate schedule is a function of the step, so it has no state of its own.

Every file is written to a temporary name, fsync'ed and renamed (``os.replace``); the folder is
complete before ``checkpoints/latest.json`` is atomically switched to it, so a crash at any point
leaves ``latest.json`` naming a complete checkpoint (or no checkpoint at all).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..models import TransformerLM, load_checkpoint, save_checkpoint
from ..models.checkpoint import check_sha256, fsync_dir, write_atomic

__all__ = ["LATEST_FILE", "capture_rng", "latest_checkpoint", "load_train_checkpoint", "restore_rng",
           "save_train_checkpoint"]

LATEST_FILE = "latest.json"
TRAINER_FILE = "trainer.pt"
TRAINER_META = "trainer.json"
FORMAT = "linattn-train"
FORMAT_VERSION = 1


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` reads back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
    }


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _extra_state(model: nn.Module) -> dict[str, Any]:
    """The entries of ``model.state_dict()`` that are not tensors (``get_extra_state`` values)."""
    return {k: v for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor)}


def save_train_checkpoint(out: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                          config_dict: dict[str, Any], sampler_state: dict[str, int],
                          rng_states: list[dict[str, Any]], keep_last: int) -> Path:
    """Write the checkpoint of ``step`` under ``out/checkpoints``, point ``latest.json`` at it
    and delete all but the newest ``keep_last`` checkpoints. Returns its folder."""
    root = Path(out) / "checkpoints"
    folder = root / f"step_{step:08d}"
    save_checkpoint(model, folder)
    buf = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng_states, "extra_state": _extra_state(model)}, buf)
    blob = buf.getvalue()
    write_atomic(folder / TRAINER_FILE, blob)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "sampler": sampler_state,
        "world_size": len(rng_states),
        "train_config": config_dict,
        "trainer_file": TRAINER_FILE,
        "trainer_sha256": hashlib.sha256(blob).hexdigest(),
    }
    write_atomic(folder / TRAINER_META, (json.dumps(meta, indent=2) + "\n").encode())
    fsync_dir(folder)
    write_atomic(root / LATEST_FILE, (json.dumps({"step": step, "dir": folder.name}) + "\n").encode())
    fsync_dir(root)
    kept = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in kept[: max(0, len(kept) - keep_last)]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def latest_checkpoint(out: str | Path) -> Path | None:
    """The folder ``out/checkpoints/latest.json`` names, or None when there is none."""
    root = Path(out) / "checkpoints"
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    try:
        name = json.loads(pointer.read_text())["dir"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupted {pointer}: {e!r}") from None
    folder = root / name
    if not folder.is_dir():
        raise ValueError(f"{pointer} names {folder}, which does not exist")
    return folder


def load_train_checkpoint(folder: str | Path) -> dict[str, Any]:
    """``{"meta": trainer.json, "model": verified TransformerLM (CPU) with its extra state restored,
    "optimizer": state dict, "rng": [per-rank states]}`` of a checkpoint folder. Raises ValueError
    when a file is missing, damaged or from another format."""
    folder = Path(folder)
    meta_path = folder / TRAINER_META
    if not meta_path.is_file():
        raise ValueError(f"not a linattn training checkpoint: {meta_path} does not exist")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupted checkpoint: {meta_path} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: expected format {FORMAT!r} version {FORMAT_VERSION}, got "
                         f"{meta.get('format')!r} version {meta.get('format_version')!r}")
    blob_path = folder / meta["trainer_file"]
    if not blob_path.is_file():
        raise ValueError(f"incomplete checkpoint: {blob_path} does not exist")
    blob = blob_path.read_bytes()
    check_sha256(blob, meta["trainer_sha256"], path=blob_path, named_in=meta_path)
    trainer = torch.load(io.BytesIO(blob), weights_only=True)
    model = load_checkpoint(TransformerLM, folder)
    expected = set(_extra_state(model))
    saved = trainer.get("extra_state")
    if saved is None and expected:  # written before trainer.pt carried it
        raise ValueError(f"{blob_path} lacks the model's extra state {sorted(expected)} (e.g. FAVOR redraw "
                         "generators), so this checkpoint cannot be resumed exactly")
    if saved is not None and set(saved) != expected:
        raise ValueError(f"{blob_path}: extra state {sorted(saved)} does not match the model's {sorted(expected)}")
    model.load_state_dict(saved or {}, strict=False)  # strict=False: the tensors are loaded already
    return {"meta": meta, "model": model, "optimizer": trainer["optimizer"], "rng": trainer["rng"]}
