"""``linattn bench [sweep|core|favor|family|full|generate]``: the benchmarks."""

from __future__ import annotations

import argparse

from .common import CommandParser, command_line, int_list, positive_int


def build_parser(prog: str) -> CommandParser:
    parser = CommandParser(prog=prog, description="benchmarks (no suite: the sweep with its defaults)")
    bench_sub = parser.add_subparsers(dest="suite", required=False)
    sweep = bench_sub.add_parser("sweep", help="time and memory of every mechanism vs N, beside softmax and peers")
    sweep.add_argument("--out", default="report", help="folder for sweep.json/md/png (default: report)")
    sweep.add_argument("--impls", default=None, help="comma-separated contenders (default: all + installed peers)")
    sweep.add_argument("--ns", type=int_list, default=None, help="sequence lengths, e.g. 256,1024,4096")
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
    core.add_argument("--runs", type=positive_int, default=None,
                      help="separate runs (fresh processes) whose ratios give the claim's median and spread (default 3)")

    favor = bench_sub.add_parser("favor", help="FAVOR+ approximation figure and speed against performer-pytorch")
    favor.add_argument("--out", default="docs/benchmarks", help="folder for favor_*.json/md/png")
    favor.add_argument("--what", default="approx,speed",
                       help="comma-separated parts: approx (error vs m), speed (needs performer-pytorch)")
    favor.add_argument("--ms", type=int_list, default=None, help="numbers of random features, e.g. 16,64,256")
    favor.add_argument("--seeds", type=int, default=20)
    favor.add_argument("--n", type=int, default=4096, help="sequence length of the speed comparison")
    favor.add_argument("--repeats", type=int, default=7)
    favor.add_argument("--runs", type=positive_int, default=None,
                       help="speed: separate runs (fresh processes) whose ratios give the claim's median and spread "
                       "(default 3)")
    family = bench_sub.add_parser("family", help="local attention at N = 65536 against softmax at N = 4096")
    family.add_argument("--out", default="docs/benchmarks", help="folder for family.json and family.md")
    family.add_argument("--n-local", type=int, default=65536, help="local attention's N (default 65536)")
    family.add_argument("--n-softmax", type=int, default=4096, help="softmax attention's N (default 4096)")
    family.add_argument("--repeats", type=int, default=3)
    family.add_argument("--runs", type=positive_int, default=None,
                        help="separate runs (fresh processes) whose ratios give the claim's median and spread (default 3)")

    full = bench_sub.add_parser("full", help="the full sweep and generation benchmark, and docs/benchmarks.md")
    full.add_argument("--out", default="docs/benchmarks/full", help="folder for the sweep and generation files")
    full.add_argument("--doc", default="docs/benchmarks.md", help="the Markdown document to write")
    full.add_argument("--doc-only", action="store_true", help="rebuild the document from the files in --out")

    gen = bench_sub.add_parser("generate", help="per-token generation time of a linear vs a softmax (KV cache) LM")
    gen.add_argument("--out", default="docs/benchmarks", help="folder for generate.json and generate.md")
    gen.add_argument("--positions", type=int_list, default=(100, 16000), help="decoding positions, e.g. 100,16000")
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
    gen.add_argument("--runs", type=positive_int, default=None,
                     help="separate runs (fresh processes) whose ratios give the claims' medians and spreads "
                     "(default 3)")

    return parser


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    if args.suite in (None, "sweep"):
        from ..bench.sweep import DEFAULT_NS, SweepConfig, run_sweep

        if args.suite is None:  # `linattn bench`: the sweep with its defaults
            args = parser.parse_args(["sweep"])
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
            parser.fail(str(e))
        command = command_line(argv)
        run_sweep(config, out_dir=args.out, command=command)
    elif args.suite == "core":
        from ..bench.core import run_core

        run_core(out_dir=args.out, n=args.n, repeats=args.repeats, **({} if args.runs is None else {"runs": args.runs}))
    elif args.suite == "favor":
        from ..bench.favor import APPROX_MS, run_favor

        what = tuple(x for x in args.what.split(",") if x)
        unknown = sorted(set(what) - {"approx", "speed"})
        if unknown:
            parser.fail(f"--what: unknown parts {unknown}; choose from approx, speed")
        run_favor(out_dir=args.out, what=what, ms=args.ms or APPROX_MS, seeds=args.seeds, n=args.n,
                  repeats=args.repeats, **({} if args.runs is None else {"runs": args.runs}))
    elif args.suite == "family":
        from ..bench.family import run_family

        run_family(out_dir=args.out, n_local=args.n_local, n_softmax=args.n_softmax, repeats=args.repeats,
                   **({} if args.runs is None else {"runs": args.runs}))
    elif args.suite == "full":
        from ..bench.full import run_full

        try:
            run_full(out_dir=args.out, doc=args.doc, doc_only=args.doc_only)
        except FileNotFoundError as e:
            parser.fail(str(e))
    elif args.suite == "generate":
        from ..bench.generate import run_generate

        try:
            run_generate(out_dir=args.out, positions=args.positions, steps=args.steps, d_model=args.d_model,
                         n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab,
                         mechanisms=tuple(x for x in args.mechanisms.split(",") if x),
                         recompute=not args.no_recompute, image_batch=args.images,
                         image_d_model=args.image_d_model, image_layers=args.image_layers,
                         compile=args.compile, **({} if args.runs is None else {"runs": args.runs}))
        except ValueError as e:
            parser.fail(str(e))
    return 0
