"""Command line: `linattn demo` (the main job), `linattn bench [sweep|core|favor|family|generate|full]`,
`linattn train`, `linattn experiment NAME|report` and `linattn convert [fidelity|distill|long|report]`."""

from __future__ import annotations

import argparse
import os
import sys


def _parse_ns(text: str) -> tuple[int, ...]:
    try:
        ns = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ns must be comma-separated integers, got {text!r}") from None
    if any(n < 1 for n in ns):
        raise argparse.ArgumentTypeError(f"--ns must be positive, got {text!r}")
    return ns


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="linattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="quick sweep, fast-vs-reference errors and generation timing (~5 min)")
    demo.add_argument("--ns", type=_parse_ns, default=None, help="sequence lengths, e.g. 256,1024")
    demo.add_argument("--out", default="report", help="output folder for demo.json/md and the parts' files")

    bench = sub.add_parser("bench", help="benchmarks (no suite: the sweep with its defaults)")
    bench_sub = bench.add_subparsers(dest="suite", required=False)
    sweep = bench_sub.add_parser("sweep", help="time and memory of every mechanism vs N, beside softmax and peers")
    sweep.add_argument("--out", default="report", help="folder for sweep.json/md/png (default: report)")
    sweep.add_argument("--impls", default=None, help="comma-separated contenders (default: all + installed peers)")
    sweep.add_argument("--ns", type=_parse_ns, default=None, help="sequence lengths, e.g. 256,1024,4096")
    sweep.add_argument("--passes", default="forward,forward+backward")
    sweep.add_argument("--modes", default="causal,bidirectional")
    sweep.add_argument("--batch", type=int, default=1)
    sweep.add_argument("--heads", type=int, default=8)
    sweep.add_argument("--head-dim", type=int, default=64)
    sweep.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    sweep.add_argument("--device", default="cpu")
    sweep.add_argument("--repeats", type=int, default=3)
    sweep.add_argument("--time-budget", type=float, default=20.0, help="seconds per call (predicted) before skipping")
    sweep.add_argument("--memory-budget-gib", type=float, default=8.0)
    sweep.add_argument("--no-memory", action="store_true", help="skip the per-configuration memory subprocesses")
    core = bench_sub.add_parser("core", help="the core speed/memory claims against fast-transformers")
    core.add_argument("--out", default="docs/benchmarks", help="folder for core.json and core.md")
    core.add_argument("--n", type=int, default=16384, help="sequence length (default 16384)")
    core.add_argument("--repeats", type=int, default=7)
    core.add_argument("--runs", type=_positive, default=None,
                      help="separate runs (fresh processes) whose ratios give the claim's median and spread (default 3)")

    favor = bench_sub.add_parser("favor", help="FAVOR+ approximation figure and speed against performer-pytorch")
    favor.add_argument("--out", default="docs/benchmarks", help="folder for favor_*.json/md/png")
    favor.add_argument("--what", default="approx,speed",
                       help="comma-separated parts: approx (error vs m), speed (needs performer-pytorch)")
    favor.add_argument("--ms", type=_parse_ns, default=None, help="numbers of random features, e.g. 16,64,256")
    favor.add_argument("--seeds", type=int, default=20)
    favor.add_argument("--n", type=int, default=4096, help="sequence length of the speed comparison")
    favor.add_argument("--repeats", type=int, default=7)
    favor.add_argument("--runs", type=_positive, default=None,
                       help="speed: separate runs (fresh processes) whose ratios give the claim's median and spread "
                       "(default 3)")
    family = bench_sub.add_parser("family", help="local attention at N = 65536 against softmax at N = 4096")
    family.add_argument("--out", default="docs/benchmarks", help="folder for family.json and family.md")
    family.add_argument("--n-local", type=int, default=65536, help="local attention's N (default 65536)")
    family.add_argument("--n-softmax", type=int, default=4096, help="softmax attention's N (default 4096)")
    family.add_argument("--repeats", type=int, default=3)
    family.add_argument("--runs", type=_positive, default=None,
                        help="separate runs (fresh processes) whose ratios give the claim's median and spread (default 3)")

    full = bench_sub.add_parser("full", help="the full sweep and generation benchmark, and docs/benchmarks.md")
    full.add_argument("--out", default="docs/benchmarks/full", help="folder for the sweep and generation files")
    full.add_argument("--doc", default="docs/benchmarks.md", help="the Markdown document to write")
    full.add_argument("--doc-only", action="store_true", help="rebuild the document from the files in --out")

    gen = bench_sub.add_parser("generate", help="per-token generation time of a linear vs a softmax (KV cache) LM")
    gen.add_argument("--out", default="docs/benchmarks", help="folder for generate.json and generate.md")
    gen.add_argument("--positions", type=_parse_ns, default=(100, 16000), help="decoding positions, e.g. 100,16000")
    gen.add_argument("--steps", type=int, default=20, help="timed steps per position (default 20)")
    gen.add_argument("--d-model", type=int, default=512)
    gen.add_argument("--layers", type=int, default=8)
    gen.add_argument("--heads", type=int, default=8)
    gen.add_argument("--vocab", type=int, default=32000)
    gen.add_argument("--mechanisms", default="linear,favor,local,softmax",
                     help="decoders to time (linear and softmax required; default: linear,favor,local,softmax)")
    gen.add_argument("--no-recompute", action="store_true", help="skip softmax recomputing the prefix")
    gen.add_argument("--images", type=int, default=8,
                     help="batch of 784-pixel images to generate for images/s (0: skip; default 8)")
    gen.add_argument("--image-d-model", type=int, default=256)
    gen.add_argument("--image-layers", type=int, default=8)
    gen.add_argument("--compile", action="store_true",
                     help="also time each model's torch.compile'd decoding step (TransformerLM.compiled_step)")
    gen.add_argument("--runs", type=_positive, default=None,
                     help="separate runs (fresh processes) whose ratios give the claims' medians and spreads "
                     "(default 3)")

    from .train.cli_args import add_train_arguments

    tr = sub.add_parser("train", help="train a TransformerLM (config file + overrides; torchrun for DDP)",
                        description="Train a TransformerLM. Under `torchrun --nproc_per_node N` every process "
                        "runs this command and DistributedDataParallel splits each global batch.")
    add_train_arguments(tr)

    from .experiments.cli_args import add_experiment_arguments

    ex = sub.add_parser("experiment", help="the papers' experiments on real data: copy, mnist, shakespeare, "
                        "proteins; `report` writes docs/results.md",
                        description="Run an experiment (runs/NAME/: config, metrics, plots, samples, summary) "
                        "or write docs/results.md from the runs' files.")
    add_experiment_arguments(ex)

    argv = list(sys.argv[1:] if argv is None else argv)
    conv = None
    if argv[:1] == ["convert"]:  # its arguments import the convert package: only when converting
        from .convert.cli_args import add_convert_arguments, normalise_argv

        argv = normalise_argv(argv)
        conv = sub.add_parser("convert", help="convert pretrained MiniLM to linear attention, measure, distil")
        add_convert_arguments(conv)
    else:
        sub.add_parser("convert", help="convert pretrained MiniLM to linear attention, measure, distil "
                       "(linattn convert -h)", add_help=False)

    # key=value overrides of an experiment may come after its options (`copy --quick steps=50`),
    # which argparse leaves unparsed once the positional list has matched; they are collected here.
    args, extra = parser.parse_known_args(argv)
    from .extras import MissingExtraError

    try:
        return _run(parser, args, argv, extra, tr, ex, conv)
    except MissingExtraError as e:  # checked before any work: a usage error, not a crash
        parser.error(str(e))


def _run(parser, args, argv, extra, tr, ex, conv) -> int:
    if extra and not (args.command == "experiment" and all("=" in x and not x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "experiment":
        args.overrides = [*args.overrides, *extra]
    if args.command == "train":
        return _train(tr, args)
    if args.command == "convert":
        from .convert.cli_args import run_convert

        return run_convert(conv, args, argv)
    if args.command == "experiment":
        from .experiments.cli_args import run_experiment_command

        return run_experiment_command(ex, args, "linattn " + " ".join(argv))
    if args.command == "demo":
        from .bench import demo

        demo.run_demo(args.ns or demo.DEFAULT_NS, out_dir=args.out)
    elif args.command == "bench" and args.suite in (None, "sweep"):
        from .bench.sweep import DEFAULT_NS, SweepConfig, run_sweep

        if args.suite is None:  # `linattn bench`: the sweep with its defaults
            args = parser.parse_args(["bench", "sweep"])
        split = lambda text: tuple(x for x in text.split(",") if x)  # noqa: E731
        try:
            config = SweepConfig(
                impls=split(args.impls) if args.impls else None, ns=args.ns or DEFAULT_NS,
                passes=split(args.passes), modes=split(args.modes), batch=args.batch, heads=args.heads,
                head_dim=args.head_dim, dtype=args.dtype, device=args.device, repeats=args.repeats,
                time_budget_s=args.time_budget, memory_budget_bytes=int(args.memory_budget_gib * 2**30),
                measure_memory=not args.no_memory,
            )
        except ValueError as e:
            parser.error(str(e))
        command = "linattn " + " ".join(argv if argv is not None else sys.argv[1:])
        run_sweep(config, out_dir=args.out, command=command)
    elif args.command == "bench" and args.suite == "core":
        from .bench.core import run_core

        run_core(out_dir=args.out, n=args.n, repeats=args.repeats, **({} if args.runs is None else {"runs": args.runs}))
    elif args.command == "bench" and args.suite == "favor":
        from .bench.favor import APPROX_MS, run_favor

        what = tuple(x for x in args.what.split(",") if x)
        unknown = sorted(set(what) - {"approx", "speed"})
        if unknown:
            parser.error(f"--what: unknown parts {unknown}; choose from approx, speed")
        run_favor(out_dir=args.out, what=what, ms=args.ms or APPROX_MS, seeds=args.seeds, n=args.n,
                  repeats=args.repeats, **({} if args.runs is None else {"runs": args.runs}))
    elif args.command == "bench" and args.suite == "family":
        from .bench.family import run_family

        run_family(out_dir=args.out, n_local=args.n_local, n_softmax=args.n_softmax, repeats=args.repeats,
                   **({} if args.runs is None else {"runs": args.runs}))
    elif args.command == "bench" and args.suite == "full":
        from .bench.full import run_full

        try:
            run_full(out_dir=args.out, doc=args.doc, doc_only=args.doc_only)
        except FileNotFoundError as e:
            parser.error(str(e))
    elif args.command == "bench" and args.suite == "generate":
        from .bench.generate import run_generate

        try:
            run_generate(out_dir=args.out, positions=args.positions, steps=args.steps, d_model=args.d_model,
                         n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab,
                         mechanisms=tuple(x for x in args.mechanisms.split(",") if x),
                         recompute=not args.no_recompute, image_batch=args.images,
                         image_d_model=args.image_d_model, image_layers=args.image_layers,
                         compile=args.compile, **({} if args.runs is None else {"runs": args.runs}))
        except ValueError as e:
            parser.error(str(e))
    return 0


def _train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    from .train import OutDirBusyError, train
    from .train.cli_args import resolve_config

    try:
        config = resolve_config(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        result = train(config, resume=args.resume, quiet=args.quiet)
    except (ValueError, FileNotFoundError, FileExistsError, OutDirBusyError) as e:
        parser.error(str(e))
    if result.stop_signal is None:
        return 0
    if os.environ.get("RANK", "0") == "0":
        print(f"stopped by {result.stop_signal.name} at step {result.step}; continue with: "
              f"linattn train --resume --out-dir {config.out_dir}", file=sys.stderr)
    # interrupted, not done: 128 + signal as a shell reports it, so `linattn train ... && next` stops
    return 128 + result.stop_signal


if __name__ == "__main__":
    sys.exit(main())
