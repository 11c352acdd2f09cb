"""Checkpoints: weights in safetensors plus a JSON config, written atomically and verified on load.

A checkpoint is a folder with

- ``model.safetensors``: every tensor of the state dict, once (a tensor shared by two names, such
  as tied embeddings, is stored under its first name; the JSON lists the aliases);
- ``config.json``: ``{"format": "linattn", "format_version": 1, "model": <class name>,
  "config": TransformerConfig.to_dict(), "dtype": ..., "weights_file": ..., "weights_sha256": ...,
  "aliases": {...}, "config_sha256": ...}``.

``config_sha256`` is the sha256 of every other field of ``config.json`` written as canonical JSON
(:func:`config_digest`: sorted keys, no spaces, ASCII), so the digest follows the content, not the
layout: re-indenting the file is no change, while editing the attention name or feature map (which
the weights alone cannot reveal: elu and relu features load the same tensors) or the weights'
sha256 fails loading with an error naming the file. It protects against edits and damage, not
against someone who recomputes it. A ``config.json`` without ``config_sha256`` (written before
this check existed, or with the field deleted) is refused unless the caller passes
``trust_legacy_config=True`` to :func:`load_checkpoint`; saving that model again adds the digest.

Each file is written to a temporary name in the same folder, flushed and fsync'ed, then renamed
over the final name (``os.replace``, atomic on POSIX), weights first. A crash leaves either the
old checkpoint or the new one; a crash between the two renames leaves a config whose sha256 does
not match the weights, which loading reports. Loading checks the sha256 before parsing, so a
truncated or corrupted weights file raises ValueError instead of loading garbage.

Not saved: the non-tensor extra state of FAVOR modules (the redraw generator state and counter,
which matter only to resume training with ``redraw_every``); the projection buffer itself is saved.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import TransformerConfig

__all__ = ["CONFIG_FILE", "FORMAT_VERSION", "WEIGHTS_FILE", "check_sha256", "config_digest", "fsync_dir",
           "load_checkpoint", "save_checkpoint", "write_atomic"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_VERSION = 1


def check_sha256(blob: bytes, expected: str, *, path: Path, named_in: Path) -> None:
    """Raise ValueError unless ``blob`` (the bytes of file ``path``) has the sha256 ``expected``
    that file ``named_in`` records: the one integrity check of every checkpoint file."""
    digest = hashlib.sha256(blob).hexdigest()
    if digest != expected:
        raise ValueError(
            f"corrupted or truncated checkpoint: sha256 of {path} ({len(blob)} bytes) is {digest}, "
            f"{named_in} expects {expected}"
        )


def config_digest(meta: dict[str, Any]) -> str:
    """sha256 of ``meta`` without its ``config_sha256`` field, as canonical JSON (sorted keys, no
    whitespace, ASCII): the same for every layout of the same content. ``meta`` is taken through
    JSON first, so a dict about to be written and the one read back digest alike."""
    body = {k: v for k, v in json.loads(json.dumps(meta)).items() if k != "config_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file in the same folder, flushed
    and fsync'ed, then renamed over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path`` so that the renames into it survive a power loss (where the
    platform can open a folder)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tensors_and_aliases(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict's tensors, each storage once, and ``{alias: stored name}``."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue  # extra state (see the module docstring)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def save_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """Save ``model`` (a TransformerLM or TransformerEncoder) into folder ``path``; returns it."""
    from safetensors.torch import save

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, aliases = _tensors_and_aliases(model)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    blob = save(tensors)
    write_atomic(path / WEIGHTS_FILE, blob)
    meta: dict[str, Any] = {
        "format": "linattn",
        "format_version": FORMAT_VERSION,
        "model": model._kind,
        "config": model.config.to_dict(),
        "dtype": dtypes.pop() if len(dtypes) == 1 else None,
        "weights_file": WEIGHTS_FILE,
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "aliases": aliases,
    }
    meta["config_sha256"] = config_digest(meta)  # last: it covers every field above
    write_atomic(path / CONFIG_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    fsync_dir(path)
    return path


def _read_meta(path: Path, *, trust_legacy_config: bool) -> dict[str, Any]:
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        raise ValueError(f"not a linattn checkpoint: {cfg} does not exist")
    try:
        meta = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupted checkpoint: {cfg} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "linattn":
        raise ValueError(f"not a linattn checkpoint: {cfg} has no \"format\": \"linattn\"")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{cfg}: checkpoint format_version {meta.get('format_version')!r}; this linattn reads {FORMAT_VERSION}"
        )
    if "config_sha256" in meta:
        digest = config_digest(meta)
        if digest != meta["config_sha256"]:
            raise ValueError(
                f"edited or corrupted checkpoint: the content of {cfg} has sha256 {digest}, but its "
                f"config_sha256 says {meta['config_sha256']!r}; a checkpoint's config must not be edited: "
                "build the model you want and save it with save_pretrained"
            )
    elif not trust_legacy_config:
        raise ValueError(
            f"{cfg} has no config_sha256 (written before linattn checked configs, or the field was "
            "deleted), so an edit to it cannot be detected. If you trust this folder, load it with "
            "linattn.models.load_checkpoint(cls, path, trust_legacy_config=True) and write it again "
            "with save_pretrained, which adds the digest"
        )
    for key in ("model", "config", "weights_file", "weights_sha256", "aliases"):
        if key not in meta:
            raise ValueError(f"corrupted checkpoint: {cfg} lacks {key!r}")
    return meta


def load_checkpoint(cls, path: str | Path, *, device: str | torch.device = "cpu",
                    trust_legacy_config: bool = False):
    """Build ``cls`` from the verified config in folder ``path`` and load its verified weights.

    ``trust_legacy_config=True`` accepts a ``config.json`` that has no ``config_sha256`` (a save
    from before the config was digested) unverified; a digest that is present must match always.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    meta = _read_meta(path, trust_legacy_config=trust_legacy_config)
    if meta["model"] != cls._kind:
        raise ValueError(f"{path} holds a {meta['model']} checkpoint, not a {cls._kind}")
    weights = path / meta["weights_file"]
    if not weights.is_file():
        raise ValueError(f"incomplete checkpoint: weights file {weights} does not exist")
    blob = weights.read_bytes()
    check_sha256(blob, meta["weights_sha256"], path=weights, named_in=path / CONFIG_FILE)
    try:
        tensors = load(blob)
    except SafetensorError as e:
        raise ValueError(f"corrupted checkpoint: {weights} is not a readable safetensors file ({e})") from None
    config = TransformerConfig.from_dict(meta["config"])
    model = cls(config)
    if meta.get("dtype") is not None:
        model.to(getattr(torch, meta["dtype"]))
    for alias, name in meta["aliases"].items():
        if name not in tensors:
            raise ValueError(f"corrupted checkpoint: alias {alias!r} points at missing tensor {name!r}")
        tensors[alias] = tensors[name]
    expected = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        legacy = any(key.endswith(("q_proj.weight", "qk_proj.weight")) for key in unexpected)
        raise ValueError(
            f"checkpoint {path} does not match its config: missing tensors {missing}, unexpected {unexpected}"
            + ("; its separate q/k/v projections are from linattn before 0.2: load it and save it once with "
               "linattn 0.2 (which merges them into in_proj) to use it here" if legacy else "")
        )
    result = model.load_state_dict(tensors, strict=False)  # strict=False: FAVOR extra state is not saved
    assert not result.unexpected_keys, result.unexpected_keys
    return model.to(device)
