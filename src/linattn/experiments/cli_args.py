"""The ``linattn experiment`` subcommand: ``linattn experiment NAME [--quick] [key=value ...]`` and
``linattn experiment report [--runs runs] [--out docs/results.md]``."""

from __future__ import annotations

import argparse
import importlib

from . import EXPERIMENTS

# experiment name -> (module, config class, run function); imported only when the command runs
_RUNNERS = {"copy": ("copy", "CopyConfig", "run_copy"), "mnist": ("mnist", "MnistConfig", "run_mnist"),
            "shakespeare": ("shakespeare", "ShakespeareConfig", "run_shakespeare"),
            "proteins": ("proteins", "ProteinsConfig", "run_proteins")}


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=(*EXPERIMENTS, "report"),
                        help="the experiment to run, or `report` to write docs/results.md from the runs")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. steps=200 contenders=softmax,linear out=runs/x")
    parser.add_argument("--quick", action="store_true", help="tiny settings that finish in about a minute")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--runs", default=None,
                        help="report: folder holding one run folder per experiment (default docs/results)")
    parser.add_argument("--out", default="docs/results.md", help="report: the Markdown file to write")
    parser.add_argument("--convert-runs", default="docs/convert",
                        help="report: folder of the `linattn convert` run files whose fidelity and recovery "
                        "tables are added (default docs/convert; skipped when it has no fidelity.json)")


def resolve(name: str, quick: bool, overrides: list[str]):
    """``(config, run function)`` of experiment ``name`` with its preset and the overrides applied."""
    from .common import parse_overrides

    module_name, config_name, run_name = _RUNNERS[name]
    module = importlib.import_module(f"{__package__}.{module_name}")
    config = parse_overrides(getattr(module, config_name).preset(quick), overrides)
    return config, getattr(module, run_name)


def run_experiment_command(parser: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> int:
    import json

    if args.name == "report":
        from .report import DEFAULT_RUNS, write_report

        if args.overrides:
            parser.error(f"report takes no key=value overrides, got {args.overrides}")
        try:
            path = write_report(runs=args.runs or DEFAULT_RUNS, out=args.out, convert_runs=args.convert_runs)
        except FileNotFoundError as e:
            parser.error(str(e))
        print(f"wrote {path}")
        return 0
    try:
        config, run = resolve(args.name, args.quick, args.overrides)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    run(config, quick=args.quick, command=command)
    return 0
