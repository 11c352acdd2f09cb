"""``linattn train``: train a TransformerLM (config file, flags and ``--set`` overrides; DDP under torchrun)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .common import CommandParser


def build_parser(prog: str) -> CommandParser:
    from ..train.cli_args import add_train_arguments

    parser = CommandParser(prog=prog, description="Train a TransformerLM. Under `torchrun --nproc_per_node N` "
                           "every process runs this command and DistributedDataParallel splits each global batch.")
    add_train_arguments(parser)
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..train import OutDirBusyError, train
    from ..train.cli_args import resolve_config

    try:
        config = resolve_config(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.fail(str(e))
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        result = train(config, resume=args.resume, quiet=args.quiet)
    except (ValueError, FileNotFoundError, FileExistsError, OutDirBusyError) as e:
        parser.fail(str(e))
    if result.stop_signal is None:
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(f"stopped by {result.stop_signal.name} at step {result.step}; continue with: "
              f"linattn train --resume --out-dir {config.out_dir}", file=sys.stderr)
    # interrupted, not done: 128 + signal as a shell reports it, so `linattn train ... && next` stops
    return 128 + result.stop_signal
