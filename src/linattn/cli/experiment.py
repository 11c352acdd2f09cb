"""``linattn experiment NAME|report``: the papers' experiments on real data, and their report.

``linattn experiment NAME [--quick] [--mechanisms A,B] [--FIELD VALUE ...] [--set KEY=VALUE ...]
[--out DIR] [--print-config]``: each experiment's flags are generated from its config dataclass
(:mod:`linattn.experiments`), and a flag is the override ``--set FIELD=VALUE`` spelled as a flag.
``linattn experiment report [--runs DIR] [--out FILE] [--convert-runs DIR]`` writes docs/results.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from .common import (
    CommandParser,
    add_config_arguments,
    add_mechanisms_argument,
    add_out_argument,
    add_set_argument,
    command_line,
    config_overrides,
    reported,
)

# experiment name -> (module of linattn.experiments, config class, run function)
RUNNERS = {
    "copy": ("copy", "CopyConfig", "run_copy"),
    "mnist": ("mnist", "MnistConfig", "run_mnist"),
    "shakespeare": ("shakespeare", "ShakespeareConfig", "run_shakespeare"),
    "proteins": ("proteins", "ProteinsConfig", "run_proteins"),
    "mqar": ("mqar", "MqarConfig", "run_mqar"),
}


def _runner(name: str):
    module_name, config_name, run_name = RUNNERS[name]
    module = importlib.import_module(f"linattn.experiments.{module_name}")
    return getattr(module, config_name), getattr(module, run_name), module


def _summary(module) -> str:
    """The first sentence of an experiment module's docstring, for the list of experiments."""
    first = " ".join((module.__doc__ or "").split("\n\n")[0].split())
    first = first.split(" (")[0].split(": ")[0].rstrip(".")
    return first[:1].lower() + first[1:]


def _defaults(cls, field: str) -> str:
    """``default: a,b`` of a list of mechanisms, and its --quick value when that differs."""
    from ..experiments.common import mechanism_labels

    full, quick = (",".join(mechanism_labels(getattr(cls.preset(q), field))) or "none" for q in (False, True))
    return f"default: {full}" + ("" if quick == full else f"; with --quick: {quick}")


def build_parser(prog: str) -> CommandParser:
    from ..experiments.report import DEFAULT_CONVERT_RUNS, DEFAULT_RUNS

    parser = CommandParser(prog=prog, usage=f"{prog} [-h] NAME ...",
                           description="Run an experiment (runs/NAME/: config, metrics, plots, samples, summary) "
                           "or write docs/results.md from the runs' files.")
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True,
                                title="NAME (`linattn experiment NAME -h` gives its flags)")
    for name in RUNNERS:
        cls, _, module = _runner(name)
        usage = (f"%(prog)s [-h] [--quick] [--mechanisms A,B] [--FIELD VALUE ...] [--set KEY=VALUE ...] "
                 "[--out DIR] [--print-config]")
        p = sub.add_parser(name, prog=f"{prog} {name}", help=_summary(module), usage=usage,
                           description=(module.__doc__ or "").strip().replace("``", ""))
        p.add_argument("--quick", action="store_true", help="tiny settings that finish in about a minute")
        add_mechanisms_argument(p, default=None, names=cls.causal_names(),
                                what=f"the mechanisms to train, each in every layer ({_defaults(cls, 'mechanisms')})")
        p.add_argument("--hybrids", default=None, metavar="A,B",
                       help="mechanisms trained once more with softmax attention in the last layer, labelled "
                       f"MECHANISM+softmax@-1, in the form of --mechanisms; '' for none ({_defaults(cls, 'hybrids')})")
        add_set_argument(p, example="steps=200")
        p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
        add_config_arguments(p, cls, skip=("mechanisms", "hybrids", *cls.replaced_by),
                             title=f"{cls.__name__} fields (each is --set FIELD=VALUE; defaults are the full run's)")
        for field in cls.replaced_by:  # not offered; given anyway, the config refuses it naming its replacement
            p.add_argument("--" + field.replace("_", "-"), dest="field:" + field, default=None, help=argparse.SUPPRESS)
        p.set_defaults(command_parser=p)
    report = sub.add_parser("report", prog=f"{prog} report", help="write docs/results.md from the runs' files",
                            usage="%(prog)s [-h] [--runs DIR] [--out FILE] [--convert-runs DIR]",
                            description="Write the results document from each run folder's summary.json and "
                            "metrics files.")
    report.add_argument("--runs", default=DEFAULT_RUNS, metavar="DIR",
                        help=f"folder holding one run folder per experiment (default: {DEFAULT_RUNS})")
    add_out_argument(report, "docs/results.md", "the Markdown file to write")
    report.add_argument("--convert-runs", default=DEFAULT_CONVERT_RUNS, metavar="DIR",
                        help="folder of the `linattn convert` run files whose fidelity and recovery tables are added "
                        f"(default: {DEFAULT_CONVERT_RUNS}; left out when it has no fidelity.json)")
    report.set_defaults(command_parser=report)
    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..progress import say

    from ..bench.harness import output_folder

    sub = args.command_parser
    if args.name == "report":
        from ..experiments.report import write_report

        with reported(sub, ValueError):  # the document's folder, before any work
            output_folder(Path(args.out).parent if args.out.strip() else args.out, what="--out's folder", keep=False)
        with reported(sub, FileNotFoundError):
            path = write_report(runs=args.runs, out=args.out, convert_runs=args.convert_runs)
        say(f"wrote {path}")
        return 0
    cls, run_experiment, _ = _runner(args.name)
    overrides = ([] if args.hybrids is None else [f"hybrids={args.hybrids}"]) + config_overrides(args)
    with reported(sub):
        config = cls.resolve(quick=args.quick, mechanisms=args.mechanisms, overrides=overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from ..experiments.common import CannotRunError, run_path

    with reported(sub, ValueError):  # the run folder, created and checked before any work
        output_folder(run_path(args.name, config), what="--out", keep=False)
    with reported(sub, CannotRunError):  # a run its config cannot start, found before any trains
        run_experiment(config, quick=args.quick, command=command_line(argv))
    return 0
