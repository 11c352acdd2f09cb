"""``linattn train``: train a TransformerLM (config file, flags and ``--set`` overrides; DDP under torchrun).

The config is built in one order: the file (``--config``; with ``--resume`` and no file, the run's
own ``train_config.json``; else the defaults), then ``--attention`` and its options on the file's
attention, then ``--set`` and the field flags as overrides of the dict form (so
``--attention local --set model.attention.window=64`` works), then validation.
Field flags come from the config dataclasses: :class:`linattn.train.TrainConfig` unprefixed
(``--lr``, ``--out``), :class:`linattn.TransformerConfig` unprefixed too (``--d-model``, applied as
``model.d_model``) and :class:`linattn.train.DataConfig` as ``--data-FIELD`` (``data.FIELD``).

Under torchrun every process parses the same command line, so a config refused before training
(a bad flag value, a context-parallel setup the processes cannot run) is refused alike by all:
rank 0 prints the one line, every rank exits 2, and torchrun's own report follows. A rank that
waited ``--collective-timeout-s`` for the others prints its own line and exits 1; torchrun then
stops the rest, a stopped (SIGSTOP) one only by SIGKILL after its ``--shutdown-timeout`` (30 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
import time
from pathlib import Path

from .common import (
    CommandParser,
    add_attention_arguments,
    add_config_arguments,
    add_set_argument,
    attention_from_args,
    config_overrides,
)

DEFAULT_ATTENTION = "linear"  # the default model's mechanism (TrainConfig's default model)


def _sections():
    """``(config class, dotted prefix, flag prefix)`` of every config whose fields are flags."""
    from ..models import TransformerConfig
    from ..train import DataConfig, TrainConfig

    return ((TrainConfig, "", ""), (TransformerConfig, "model.", ""), (DataConfig, "data.", "data-"))


def build_parser(prog: str) -> CommandParser:
    parser = CommandParser(prog=prog, description="Train a TransformerLM. Under `torchrun --nproc_per_node N` "
                           "every process runs this command and DistributedDataParallel splits each global batch. "
                           "--attention, then --set and the field flags, are applied over the config file in that order.")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="A .json or .toml TrainConfig (default: the built-in recall demo).")
    parser.add_argument("--resume", action="store_true",
                        help="Continue from --out's checkpoints/latest.json (without --config: the run's own config).")
    parser.add_argument("--print-config", action="store_true", help="Print the resolved config as JSON and exit.")
    parser.add_argument("--quiet", action="store_true",
                        help="No header, progress bar or closing line (metrics.jsonl is still written).")
    add_set_argument(parser, example="model.attention.window=64")
    add_attention_arguments(parser, default=DEFAULT_ATTENTION)
    titles = {"": "training (TrainConfig; each flag is --set FIELD=VALUE)",
              "model.": "model size and shape (TransformerConfig; each flag is --set model.FIELD=VALUE)",
              "data.": "data (DataConfig; each flag is --set data.FIELD=VALUE)"}
    for cls, prefix, flag_prefix in _sections():
        add_config_arguments(parser, cls, prefix=prefix, flag_prefix=flag_prefix, title=titles[prefix])
    _model_defaults_in_help(parser)
    return parser


def _model_defaults_in_help(parser: CommandParser) -> None:
    """The model flags' help states the defaults of the model ``linattn train`` builds without a
    file (:func:`linattn.train.config.default_model`), not TransformerConfig's own."""
    from ..train.config import config_from_dict, default_model

    model = default_model()
    for action in parser._actions:
        if action.dest.startswith("field:model."):
            value = getattr(model, action.dest[len("field:model."):])
            text = re.sub(r" ?\(default: [^)]*\)$", "", action.help or "")
            action.help = f"{text} (default: {value})".strip()


def _flag_of(message: str) -> str | None:
    """The flag of the field a config's validation message is about (``"TrainConfig: lr must ..."``
    -> ``--lr``), or None when it names no field."""
    m = re.match(r"(\w+): (?:unknown )?(\w+)", message)
    if m is None:
        return None
    for cls, _, flag_prefix in _sections():
        if cls.__name__ == m.group(1) and m.group(2) in {f.name for f in dataclasses.fields(cls)}:
            if m.group(2) in ("model", "data", "attention", "layer_attention"):
                return None
            return "--" + (flag_prefix + m.group(2)).replace("_", "-")
    return None


def resolve_config(args: argparse.Namespace):
    """The :class:`TrainConfig` the flags describe (see the module docstring). Raises ValueError,
    TypeError or FileNotFoundError; a validation error about one field starts with its flag."""
    from ..config import apply_overrides, read_config_file
    from ..nn.registry import attention_config_from_dict, attention_config_to_dict
    from ..train import TrainConfig
    from ..train.config import config_from_dict, default_model
    from ..train.trainer import CONFIG_FILE

    overrides = config_overrides(args)
    path = args.config
    if path is None and args.resume:
        out = apply_overrides({}, overrides, str_fields=TrainConfig.str_fields()).get("out", TrainConfig().out)
        saved = Path(str(out)) / CONFIG_FILE
        if saved.is_file():
            path = saved
    d = {} if path is None else read_config_file(path)
    # a file without a model table gets the default model's dict for the flags to edit
    model = d.setdefault("model", default_model().to_dict())
    if isinstance(model, dict):
        base = model.get("attention")
        chosen = attention_from_args(args, base=attention_config_from_dict(dict(base)) if isinstance(base, dict) else None)
        if chosen is not None:
            model["attention"] = attention_config_to_dict(chosen)
    try:
        return config_from_dict(d, overrides)
    except (ValueError, TypeError) as e:
        flag = _flag_of(str(e))
        if flag is None:
            raise
        raise type(e)(f"{flag}: {e}") from None


def _with_flag(message: str) -> str:
    """A validation message led by the flag of the field it names, when it names one."""
    flag = _flag_of(message)
    return message if flag is None else f"{flag}: {message}"


# How long a rank other than 0 waits before it exits on a refused config: rank 0 reached the same
# refusal after the same work, and a rank that exits first has torchrun stop rank 0 (SIGTERM) before
# its line is printed (seen once in a loaded test run: no line at all).
REFUSAL_GRACE_S = 5.0


def _refuse(parser: CommandParser, message: str) -> typing.NoReturn:
    """A config every rank refuses alike: the one line on rank 0 only (not once per process, ahead
    of torchrun's report), status 2 on every rank; the other ranks exit after rank 0 has printed it
    (:data:`REFUSAL_GRACE_S`), or are stopped by torchrun once rank 0 has exited."""
    from ..train.dist import is_main_process

    if is_main_process():
        parser.fail(message)
    time.sleep(REFUSAL_GRACE_S)
    parser.exit(2)


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..train import OutDirBusyError, train
    from ..train.dist import CollectiveTimeout, expected_world_size, is_main_process

    try:
        config = resolve_config(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        _refuse(parser, str(e))
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        config.check_processes(expected_world_size())
    except ValueError as e:
        _refuse(parser, _with_flag(str(e)))
    try:
        result = train(config, resume=args.resume, quiet=args.quiet)
    except CollectiveTimeout as e:
        # the run started and failed (not a refused command line, status 2); the rank that gave up
        # says so, whichever it is: rank 0 may be the one that stopped
        print(f"{parser.prog}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, FileNotFoundError, FileExistsError, OutDirBusyError) as e:
        parser.fail(str(e))
    if result.diverged:
        if is_main_process():
            kept = (f"the last checkpoint, {result.checkpoint}, is kept" if result.checkpoint is not None
                    else "no checkpoint was written before it")
            print(f"{parser.prog}: error: the training loss of step {result.step} is not finite: "
                  f"stopped there, without a checkpoint of that step; {kept}", file=sys.stderr, flush=True)
        return 1
    if result.stop_signal is None:
        return 0
    if is_main_process():
        print(f"stopped by {result.stop_signal.name} at step {result.step}; continue with: "
              f"linattn train --resume --out {config.out}", file=sys.stderr)
    # interrupted, not done: 128 + signal as a shell reports it, so `linattn train ... && next` stops
    return 128 + result.stop_signal
