"""``linattn convert fidelity|distill|long|report``: pretrained MiniLM converted to linear attention.

- ``fidelity``: embedding fidelity of the converted model without training, over ``--mechanisms``
  (default: the sweep of :data:`linattn.convert.fidelity.FIDELITY_CONFIGS`);
- ``distill``: distil the model converted to ``--attention NAME`` (options as
  ``--attention-OPTION VALUE``) back toward the original; every other field of
  :class:`linattn.convert.distill.DistillConfig` is a flag of the same name or ``--set FIELD=VALUE``;
- ``long``: time and peak memory past BERT's 512 positions against the original;
- ``report``: docs/convert.md from the run files.

Every sub-command but ``report`` needs transformers (the optional extra ``convert``); without it
the command stops before any work with one line that says how to install it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import typing
from pathlib import Path

from .common import (
    CommandParser,
    add_attention_arguments,
    add_config_arguments,
    add_mechanisms_argument,
    add_out_argument,
    add_set_argument,
    attention_from_args,
    command_line,
    config_overrides,
    int_list,
    non_negative_int,
    positive_int,
    reported,
)

# the mechanism `convert distill` trains when no --attention is given: Hedgehog's feature maps are
# learned to reproduce softmax weights (arXiv 2402.04347), so it is the one meant for distillation
DEFAULT_STUDENT = "hedgehog"

# sub-commands that load the pretrained model through transformers
NEEDS_TRANSFORMERS = ("fidelity", "distill", "long")


def _add_threads(parser: argparse.ArgumentParser, where: str = "") -> None:
    parser.add_argument("--threads", type=positive_int, default=1, metavar="N",
                        help=f"Torch threads{where} (default: 1, since the machine is shared).")


def build_parser(prog: str) -> CommandParser:
    from ..convert.distill import DistillConfig
    from ..convert.linearize import POSITION_METHODS, convertible_mechanisms
    from ..convert.long import LONG_MODELS

    parser = CommandParser(prog=prog, description="Convert pretrained MiniLM to linear attention, measure how "
                           "faithful the conversion is, and distil it back toward the original.")
    sub = parser.add_subparsers(dest="convert_command", required=True, metavar="SUBCOMMAND",
                                title="sub-commands (`linattn convert SUBCOMMAND -h` gives its flags)")

    fid = sub.add_parser("fidelity", help="Embedding fidelity of converted MiniLM without training (a sweep).",
                         description="Embedding fidelity of converted MiniLM without training: the mean cosine "
                         "between converted and original sentence embeddings over held-out texts, one "
                         "configuration at a time; a rerun skips the configurations fidelity.json already holds.")
    add_out_argument(fid, "docs/convert", "Folder for fidelity.json")
    fid.add_argument("--eval-sentences", type=positive_int, default=1000, metavar="N",
                     help="Held-out sentences to embed (default: 1000).")
    fid.add_argument("--eval-passages", type=non_negative_int, default=200, metavar="N",
                     help="Held-out passages of 320 to 512 tokens to embed; 0 skips them (default: 200).")
    add_mechanisms_argument(fid, default=None, names=convertible_mechanisms(),
                            what="The mechanism configurations to measure (default: the full sweep, FAVOR+ "
                            "with m = 16 to 512 orthogonal and i.i.d. features, then every other mechanism)")
    _add_threads(fid)

    dis = sub.add_parser("distill", help="Distil a converted MiniLM toward the original.",
                         description="Distil MiniLM converted to --attention toward the original on training "
                         "texts, within a budget of training minutes; fidelity is measured before and after. "
                         "Checkpoints are written to --out; --resume continues from the latest one.")
    add_out_argument(dis, None, "Run folder for checkpoints and distill.json, e.g. runs/convert/hedgehog.")
    dis.add_argument("--result", default=None, metavar="PATH",
                     help="Also write distill.json to this file, e.g. docs/convert/distill_hedgehog.json.")
    dis.add_argument("--resume", action="store_true", help="Continue the run in --out from its latest checkpoint.")
    dis.add_argument("--quiet", action="store_true", help="Print no progress bar and no summary.")
    dis.add_argument("--print-config", action="store_true",
                     help="Print the resolved DistillConfig as JSON and exit without loading or training anything.")
    _add_threads(dis)
    add_attention_arguments(dis, default=DEFAULT_STUDENT)
    add_config_arguments(dis, DistillConfig, title="distillation (each flag is also --set FIELD=VALUE)")
    add_set_argument(dis, example="attention.window=32")

    long = sub.add_parser("long", help="Time and peak memory at N = 512, 2048 and 8192 against the original.",
                          description="Time and peak memory of the converted models past BERT's 512 positions, "
                          "against the original, each measurement in fresh subprocesses.")
    add_out_argument(long, "docs/convert", "Folder for long.json")
    long.add_argument("--ns", type=int_list, default=(512, 2048, 8192), metavar="N,N",
                      help="Sequence lengths, comma-separated (default: 512,2048,8192).")
    long.add_argument("--models", default=",".join(LONG_MODELS), metavar="A,B",
                      help="Models to time, comma-separated names from: " + ", ".join(LONG_MODELS)
                      + " (default: all of them).")
    long.add_argument("--student", action="append", default=[], metavar="NAME=RUN_DIR",
                      help="Also time a distilled student from the run folder of `linattn convert distill`, under "
                      "the row name NAME (repeatable).")
    long.add_argument("--repeats", type=positive_int, default=2, metavar="N",
                      help="Timed forwards per configuration; the median is reported (default: 2).")
    long.add_argument("--position-method", default="tile", choices=POSITION_METHODS,
                      help="How the 512-row position table is extended: tile repeats it, interpolate squeezes it. "
                      f"One of: {', '.join(POSITION_METHODS)} (default: tile).")
    _add_threads(long, " in every measuring subprocess")

    rep = sub.add_parser("report", help="Write docs/convert.md from the run files.",
                         description="Write the conversion document from fidelity.json, every distill_*.json and "
                         "long.json in --runs.")
    rep.add_argument("--runs", default="docs/convert", metavar="PATH",
                     help="Folder holding fidelity.json, distill_*.json and long.json (default: docs/convert).")
    add_out_argument(rep, "docs/convert.md", "The Markdown document to write")

    for name, sub_parser in sub.choices.items():
        sub_parser.set_defaults(command_parser=sub_parser)
    return parser


def transformers_missing(command: str) -> str | None:
    """The one-line message for ``command`` when transformers cannot be imported, else None.

    Looks the package up without importing it; a package set to None in ``sys.modules`` counts as
    missing, as it does for ``import``.
    """
    if importlib.util.find_spec("transformers") is not None:
        return None
    return (f"{command} needs transformers, which is not installed; nothing was run. Install the optional "
            "extra: pip install 'linattn[convert]' (make setup installs it from requirements-convert.txt)")


def distill_config(args: argparse.Namespace):
    """The :class:`DistillConfig` the ``distill`` flags describe: the mechanism from ``--attention``
    and its ``--attention-OPTION`` flags (default :data:`DEFAULT_STUDENT`), then the field flags and
    ``--set`` overrides applied in that order over the defaults.

    Raises ValueError or TypeError naming the flag or field that does not hold.
    """
    from ..config import apply_overrides
    from ..convert.distill import DistillConfig
    from ..nn.registry import attention_config, attention_config_from_dict, attention_config_to_dict, parse_attention

    try:
        attention = attention_from_args(args, base=attention_config(DEFAULT_STUDENT))
    except (ValueError, TypeError) as e:
        raise ValueError(str(e) if str(e).startswith("--") else f"--attention: {e}") from None
    if attention is None:
        attention = attention_config(DEFAULT_STUDENT)
    base = {f.name: f.default for f in dataclasses.fields(DistillConfig) if f.default is not dataclasses.MISSING}
    base["attention"] = attention_config_to_dict(attention)
    d = apply_overrides(base, config_overrides(args), str_fields=DistillConfig.str_fields())
    chosen = d["attention"]
    chosen = parse_attention(chosen) if isinstance(chosen, str) else attention_config_from_dict(chosen)
    _convertible("--attention", chosen)
    d["attention"] = attention_config_to_dict(chosen)
    types = typing.get_type_hints(DistillConfig)
    for name, value in d.items():
        expected = types.get(name)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            d[name] = value = float(value)
        if expected in (int, float) and (type(value) is not expected):
            raise ValueError(f"--{name.replace('_', '-')}: expected {'an integer' if expected is int else 'a number'}, "
                             f"got {value!r}")
    return DistillConfig.from_dict(d)


def _convertible(flag: str, config) -> None:
    from ..convert.linearize import check_convertible

    try:
        check_convertible(config)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _students(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, run = item.rpartition("=")  # the name may hold "=" (w=0), the folder not
        if not sep or not name or not run:
            raise ValueError(f"--student: expected NAME=RUN_DIR, got {item!r}")
        out[name] = run
    return out


def _models(text: str) -> list[str]:
    from ..config import did_you_mean
    from ..convert.long import LONG_MODELS

    names = [x for x in text.split(",") if x]
    for name in names:
        if name not in LONG_MODELS:
            raise ValueError(f"--models: unknown model {name!r}{did_you_mean(name, LONG_MODELS)}; "
                             f"known: {', '.join(LONG_MODELS)}")
    return names


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    sub: CommandParser = args.command_parser
    command = command_line(argv)
    what = f"linattn convert {args.convert_command}"
    with reported(sub):
        if args.convert_command == "fidelity":
            for config in args.mechanisms or ():
                _convertible("--mechanisms", config)
        elif args.convert_command == "distill":
            config = distill_config(args)
            if args.print_config:
                print(json.dumps(config.to_dict(), indent=2))
                return 0
        elif args.convert_command == "long":
            models, students = _models(args.models), _students(args.student)
    if args.convert_command in NEEDS_TRANSFORMERS:
        missing = transformers_missing(what)
        if missing:
            sub.fail(missing)
        import torch

        torch.set_num_threads(args.threads)
    with reported(sub):  # created and checked before any work (a document's folder for report)
        from ..bench.harness import output_folder

        document = args.convert_command == "report" and args.out.strip()  # an empty one is refused as it is
        folder = Path(args.out).parent if document else args.out
        output_folder(folder, what="--out", keep=False)

    if args.convert_command == "fidelity":
        from ..convert.fidelity import run_fidelity

        run_fidelity(args.out, configs=args.mechanisms, eval_sentences=args.eval_sentences, eval_passages=args.eval_passages,
                     command=command)
    elif args.convert_command == "distill":
        from ..convert.distill import distill

        with reported(sub, ValueError, FileNotFoundError, FileExistsError):
            result = distill(config, args.out, resume=args.resume, result_path=args.result, command=command,
                             quiet=args.quiet)
        if result.get("stopped_by_signal"):
            print(f"stopped; continue with: {command} --resume", file=sys.stderr)
    elif args.convert_command == "long":
        from ..convert.long import run_long

        run_long(args.out, ns=args.ns, models=models, students=students, repeats=args.repeats, threads=args.threads,
                 position_method=args.position_method, command=command)
    elif args.convert_command == "report":
        from ..convert.report import write_report

        with reported(sub, FileNotFoundError):
            write_report(args.runs, args.out)
    return 0
