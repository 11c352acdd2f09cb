"""``linattn demo``: the main job (a short sweep, fast-vs-reference errors, decoding speed)."""

from __future__ import annotations

import argparse

from .common import CommandParser, add_out_argument, int_list


def build_parser(prog: str) -> CommandParser:
    parser = CommandParser(prog=prog, description="quick sweep, fast-vs-reference errors and generation timing")
    parser.add_argument("--ns", type=int_list, default=None, help="sequence lengths, e.g. 256,1024")
    add_out_argument(parser, "report", "output folder for demo.json/md and the parts' files")
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..bench import demo

    demo.run_demo(args.ns or demo.DEFAULT_NS, out_dir=args.out)
    return 0
