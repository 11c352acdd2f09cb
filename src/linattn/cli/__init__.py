"""The ``linattn`` command.

``linattn COMMAND ...``: each command is a module of this package with ``build_parser(prog)`` and
``run(parser, args, argv) -> exit status``, imported only when that command runs, so that a
command pays for its own imports only (transformers for ``convert``, matplotlib for plots).
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Sequence

from ..config import did_you_mean
from .common import CommandParser

__all__ = ["COMMANDS", "main"]

# name -> one line for `linattn -h`; the module linattn.cli.<name> builds and runs it
COMMANDS = {
    "demo": "the main job: a short sweep, fast-vs-reference errors and decoding speed, with progress",
    "bench": "benchmarks: sweep (default), core, favor, family, generate, full",
    "train": "train a TransformerLM from a config file, flags and --set overrides (torchrun for DDP)",
    "experiment": "the papers' experiments on real data (copy, mnist, shakespeare, proteins) and their report",
    "convert": "convert pretrained MiniLM to linear attention: fidelity, distill, long, report",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("linattn")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _top_parser() -> CommandParser:
    lines = "\n".join(f"  {name:<11} {text}" for name, text in COMMANDS.items())
    parser = CommandParser(prog="linattn", usage="linattn [-h] [--version] COMMAND ...",
                           description="Attention in time and memory linear in sequence length.",
                           epilog=f"commands:\n{lines}\n\n`linattn COMMAND -h` gives a command's own flags.")
    parser.add_argument("--version", action="version", version=f"linattn {_version()}")
    parser.add_argument("command", metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv[:1])  # -h, --version, or a usage error
        top.error("the following arguments are required: COMMAND")
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}{did_you_mean(name, COMMANDS)}; commands: {', '.join(COMMANDS)}")
    module = importlib.import_module(f"{__name__}.{name}")
    parser = module.build_parser(f"linattn {name}")
    args = parser.parse_args(rest)
    from ..extras import MissingExtraError
    from ..processes import Terminated, stop_on_sigterm

    # SIGTERM unwinds the stack as SIGINT does, through the clean-ups that stop the command's child
    # processes (linattn.processes); the exit status is the shell's for a process the signal killed
    try:
        with stop_on_sigterm():
            return module.run(parser, args, argv)
    except MissingExtraError as e:  # checked before any work: a usage error, not a crash
        top.fail(str(e))  # the message names the whole command already
    except KeyboardInterrupt:
        print(f"\nlinattn {name}: interrupted (SIGINT); stopped with its child processes", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print(f"\nlinattn {name}: terminated (SIGTERM); stopped with its child processes", file=sys.stderr)
        return Terminated.exit_status
