"""``linattn convert ...``: arguments and dispatch (imported lazily by :mod:`linattn.cli`).

Subcommands: ``fidelity`` (sweep without training), ``distill`` (recovery; ``linattn convert
--distill ...`` is the same), ``long`` (inputs past 512 tokens: time and memory) and ``report``
(writes docs/convert.md from the run files).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

__all__ = ["add_convert_arguments", "normalise_argv", "run_convert"]


def normalise_argv(argv: list[str]) -> list[str]:
    """``convert --distill ...`` (the issue's spelling) -> ``convert distill ...``."""
    if argv[:1] == ["convert"] and "--distill" in argv[1:]:
        rest = [a for a in argv[1:] if a != "--distill"]
        return ["convert", "distill", *rest]
    return argv


def _threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="convert_command", required=True)

    fid = sub.add_parser("fidelity", help="embedding fidelity of converted MiniLM without training (sweep)")
    fid.add_argument("--out", default="docs/convert", help="folder for fidelity.json (default docs/convert)")
    fid.add_argument("--sentences", type=int, default=1000, help="held-out sentences (default 1000)")
    fid.add_argument("--passages", type=int, default=200, help="held-out passages of 320+ tokens (default 200)")
    fid.add_argument("--configs", default=None,
                     help="JSON list of attention configs, e.g. '[{\"name\": \"local\", \"window\": 8}]' "
                          "(default: the full sweep)")
    _threads(fid)

    from .distill import add_distill_arguments

    add_distill_arguments(sub.add_parser("distill", help="distil a converted MiniLM toward the original"))

    from .long import add_long_arguments

    add_long_arguments(sub.add_parser("long", help="time and peak memory at N = 512, 2048, 8192 vs the original"))

    rep = sub.add_parser("report", help="write docs/convert.md from the run files")
    rep.add_argument("--runs", default="docs/convert", help="folder with fidelity.json, distill_*.json, long.json")
    rep.add_argument("--doc", default="docs/convert.md")


def run_convert(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    command = "linattn " + shlex.join(argv)  # quoted: the recorded command can be pasted back
    if hasattr(args, "threads"):
        torch.set_num_threads(args.threads)
    if args.convert_command == "fidelity":
        from .fidelity import run_fidelity

        try:
            configs = json.loads(args.configs) if args.configs else None
        except json.JSONDecodeError as e:
            parser.error(f"--configs must be a JSON list of attention configs: {e}")
        run_fidelity(args.out, configs=configs, n_sentences=args.sentences, n_passages=args.passages,
                     command=command)
    elif args.convert_command == "distill":
        from .distill import run_distill_from_args

        try:
            result = run_distill_from_args(args, command=command)
        except (ValueError, FileNotFoundError, FileExistsError) as e:
            parser.error(str(e))
        if result.get("stopped_by_signal"):
            print(f"stopped; continue with: {command} --resume", file=sys.stderr)
    elif args.convert_command == "long":
        from .long import run_long

        run_long(args, command=command)
    elif args.convert_command == "report":
        from .report import write_report

        try:
            write_report(args.runs, args.doc)
        except FileNotFoundError as e:
            parser.error(str(e))
    return 0
