"""Command-line flags of ``linattn train``, generated from the config dataclasses.

Every scalar field gets a flag: ``TrainConfig.max_steps`` -> ``--max-steps``,
``DataConfig.path`` -> ``--data-path``, ``TransformerConfig.d_model`` -> ``--model-d-model``;
its help is the field's line in the class docstring. A flag's value is read like a ``--set``
value (JSON when it parses, else a string; string fields always keep the text) and applied as the override ``section.field=value``,
after the config file and before validation. ``--set`` reaches everything else
(``--set 'model.attention={"name": "local", "window": 64}'``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

from ..models import TransformerConfig
from .config import DataConfig, TrainConfig

__all__ = ["add_train_arguments", "overrides_from_args", "resolve_config"]

_SECTIONS = (("", TrainConfig), ("model", TransformerConfig), ("data", DataConfig))
_NOT_FLAGS = {"model", "data", "attention", "layer_attention"}


def _attribute_help(cls) -> dict[str, str]:
    """``{field: first sentence of its 'name: text' entry}`` from the class docstring."""
    out: dict[str, str] = {}
    doc = cls.__doc__ or ""
    for m in re.finditer(r"^\s{8}(\w+): (.+?)(?=^\s{8}\w+: |\Z)", doc, flags=re.M | re.S):
        text = " ".join(m.group(2).split())
        out[m.group(1)] = text.split(". ")[0].rstrip(".")
    return out


def _flags():
    for section, cls in _SECTIONS:
        helps = _attribute_help(cls)
        for f in dataclasses.fields(cls):
            if f.name in _NOT_FLAGS:
                continue
            key = f"{section}.{f.name}" if section else f.name
            flag = "--" + key.replace(".", "-").replace("_", "-")
            yield flag, key, helps.get(f.name, ""), f.type in ("str", "str | None")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a .json or .toml TrainConfig (default: the built-in demo)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override any field by its dotted name, e.g. lr=3e-4 or model.n_layers=4 (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from out_dir/checkpoints/latest.json (without --config: the run's own config)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (metrics.jsonl is still written)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    group = parser.add_argument_group("config fields (each is --set section.field=VALUE)")
    for flag, key, text, _ in _flags():
        group.add_argument(flag, dest="field:" + key, default=None, metavar="VALUE", help=text)


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    """``--set`` values, then the generated flags, as ``key=value`` strings."""
    out = list(args.overrides)
    for _, key, _, is_str in _flags():
        val = getattr(args, "field:" + key)
        if val is not None:
            # a string field keeps its text as given (--out-dir 2024 is a folder, not a number)
            out.append(f"{key}={json.dumps(val)}" if is_str else f"{key}={val}")
    return out


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The config of ``linattn train``: the file (or, for ``--resume`` without ``--config``, the
    run's saved ``train_config.json``, or else the defaults) with the overrides applied."""
    from .config import _parse_value, load_config
    from .loop import CONFIG_FILE

    overrides = overrides_from_args(args)
    path = args.config
    if path is None and args.resume:
        out_dir = TrainConfig().out_dir
        for item in overrides:
            key, _, val = item.partition("=")
            if key.strip() == "out_dir":
                out_dir = str(_parse_value(val))
        saved = Path(out_dir) / CONFIG_FILE
        if saved.is_file():
            path = saved
    return load_config(path, overrides)
