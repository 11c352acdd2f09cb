"""``linattn experiment NAME|report``: the papers' experiments on real data, and their report."""

from __future__ import annotations

import argparse

from .common import CommandParser, command_line


def build_parser(prog: str) -> CommandParser:
    from ..experiments.cli_args import add_experiment_arguments

    parser = CommandParser(prog=prog, description="Run an experiment (runs/NAME/: config, metrics, plots, samples, "
                           "summary) or write docs/results.md from the runs' files.")
    add_experiment_arguments(parser)
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..experiments.cli_args import run_experiment_command

    return run_experiment_command(parser, args, command_line(argv))
