"""``linattn demo``: the main job (a short sweep, fast-vs-reference errors, decoding speed)."""

from __future__ import annotations

import argparse
import textwrap

from .common import CommandParser, add_out_argument, int_list, reported


def build_parser(prog: str) -> CommandParser:
    parser = CommandParser(
        prog=prog, description=textwrap.fill("The main job: a short sweep of every mechanism but LSH against softmax "
        "(forward+backward time and peak memory, with a progress bar on a terminal), each fast form against its "
        "reference form, and decoding speed of linear against softmax language models. It prints how long it "
        "took; the run committed in docs/benchmarks/demo/demo.md states its own duration.", 100))
    parser.add_argument("--ns", type=int_list, default=None, metavar="N,N",
                        help="Sequence lengths of the sweep, e.g. 256,1024 (default: 256,1024,4096,16384).")
    add_out_argument(parser, "report", "Folder for demo.json, demo.md and the parts' files")
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..bench import demo
    from ..bench.harness import output_folder

    with reported(parser, ValueError):  # created and checked before any work
        output_folder(args.out, what="--out", keep=False)
    demo.run_demo(args.ns or demo.DEFAULT_NS, out=args.out)
    return 0
