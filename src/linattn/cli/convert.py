"""``linattn convert fidelity|distill|long|report``: pretrained MiniLM converted to linear attention."""

from __future__ import annotations

import argparse

from .common import CommandParser


def build_parser(prog: str) -> CommandParser:
    from ..convert.cli_args import add_convert_arguments

    parser = CommandParser(prog=prog, description="convert pretrained MiniLM to linear attention, measure, distil")
    add_convert_arguments(parser)
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..convert.cli_args import normalise_argv, run_convert

    return run_convert(parser, args, normalise_argv(argv))
