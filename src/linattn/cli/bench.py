"""``linattn bench [sweep|core|favor|family|full|generate|gated|transformers|context-parallel|gpu|launches|tensor-cores]``: the
benchmarks.

Each sub-command's flags carry the names of its ``run_*`` function's parameters (``--out`` is
``out``, ``--n-layers`` is ``n_layers``, ``--num-features`` is ``num_features``); mechanisms come
from the registry (``--mechanisms``), the peers from ``linattn.bench.harness.PEERS``.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Callable, Sequence

from ..config import did_you_mean
from ..bench import favor as favor_options
from ..bench import gpu as gpu_options
from ..bench import launches as launches_options
from ..bench import sweep as sweep_options
from .common import (
    CommandParser,
    add_mechanisms_argument,
    add_out_argument,
    command_line,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
    refuse_unused,
    reported,
)

# the allowed values are the benchmarks' own (bench.sweep, bench.favor), listed once there
PASSES = tuple(sweep_options.PASSES)
MODES = tuple(sweep_options.MODES)
DTYPES = tuple(sweep_options.DTYPES)
FAVOR_PARTS = tuple(favor_options.WHAT)
GPU_FORMS = tuple(gpu_options.FORMS)
GPU_DTYPES = tuple(gpu_options.DTYPES)
LAUNCH_FORMS = tuple(launches_options.FORMS)
RUNS_HELP = ("Separate runs, each in fresh processes, whose ratios give each claim's median and spread "
             "(default: 3).")


def choice_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argument type: comma-separated values, each one of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"give at least one of {', '.join(choices)}")
        for v in values:
            if v not in choices:
                raise argparse.ArgumentTypeError(f"unknown value {v!r}{did_you_mean(v, choices)}; "
                                                 f"choose from {', '.join(choices)}")
        return values

    return parse


def _peers(text: str) -> tuple[str, ...]:
    from ..bench.harness import PEERS

    if text.strip() == "none":
        return ()
    return choice_list(tuple(PEERS))(text)


def _wrapped(text: str) -> str:
    return textwrap.fill(text, 100)


def _add_runs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=positive_int, default=None, help=RUNS_HELP)


def build_parser(prog: str) -> CommandParser:
    from ..bench.harness import PEERS
    from ..nn.registry import MECHANISMS

    parser = CommandParser(prog=prog, description=_wrapped("The benchmarks. Without a sub-command, the sweep with its "
                           "defaults."))
    bench_sub = parser.add_subparsers(dest="suite", required=False, metavar="SUITE")

    sweep = bench_sub.add_parser(
        "sweep", help="Time and memory of every mechanism against N, beside softmax and the peers.",
        description=_wrapped("Time and peak memory of attention against the sequence length N, every mechanism of the "
        "registry with its defaults unless --mechanisms says otherwise, beside the installed peers."))
    add_out_argument(sweep, "report", "Folder for sweep.json, sweep.md and the plots")
    add_mechanisms_argument(sweep, default=None, what="Mechanisms to time (default: every registered one, "
                            "with its registry defaults)")
    sweep.add_argument("--peers", type=_peers, default=None, metavar="A,B",
                       help=f"Peers from other projects to time beside them: comma-separated names from "
                       f"{', '.join(PEERS)}, or none (default: the installed ones).")
    sweep.add_argument("--ns", type=int_list, default=None, metavar="N,N",
                       help="Sequence lengths, e.g. 256,1024,4096 (default: 256 to 65536 in powers of 2).")
    sweep.add_argument("--passes", type=choice_list(PASSES), default=PASSES, metavar="PASS,PASS",
                       help=f"Comma-separated passes to time, from {', '.join(PASSES)} (default: both).")
    sweep.add_argument("--modes", type=choice_list(MODES), default=MODES, metavar="MODE,MODE",
                       help=f"Comma-separated modes, from {', '.join(MODES)} (default: both).")
    sweep.add_argument("--batch-size", type=positive_int, default=1, help="Batch size B (default: 1).")
    sweep.add_argument("--n-heads", type=positive_int, default=8, help="Heads H (default: 8).")
    sweep.add_argument("--head-dim", type=positive_int, default=64, help="Head width D = Dv (default: 64).")
    sweep.add_argument("--dtype", default="float32", choices=DTYPES, help="The inputs' dtype (default: float32).")
    sweep.add_argument("--device", default="cpu", help="cpu, or a GPU such as cuda (default: cpu).")
    sweep.add_argument("--repeats", type=positive_int, default=3,
                       help="Timed calls per configuration; their median is reported (default: 3).")
    sweep.add_argument("--time-budget-s", type=positive_float, default=20.0,
                       help="A configuration predicted to take longer per call, in seconds, is skipped and "
                       "marked (default: 20).")
    sweep.add_argument("--memory-budget-gib", type=positive_float, default=None,
                       help="A configuration predicted to need more peak memory, in GiB, is skipped and marked "
                       "(default: 8).")
    sweep.add_argument("--measure-memory", action=argparse.BooleanOptionalAction, default=True,
                       help="Measure each configuration's peak memory in a fresh process (default: on).")

    core = bench_sub.add_parser(
        "core", help="The core speed and memory claims against fast-transformers.",
        description=_wrapped("Causal and bidirectional linear attention against fast-transformers' CPU kernels and "
        "softmax (SDPA), forward+backward, under two allocators, and one recurrent step."))
    add_out_argument(core, "docs/benchmarks", "Folder for core.json and core.md")
    core.add_argument("--n", type=positive_int, default=16384, help="Sequence length N (default: 16384).")
    core.add_argument("--repeats", type=positive_int, default=7,
                      help="Interleaved timed calls per run (default: 7).")
    _add_runs(core)

    favor = bench_sub.add_parser(
        "favor", help="FAVOR+ approximation error and speed against performer-pytorch.",
        description=_wrapped("FAVOR+: its error against softmax attention for several numbers of random features, and "
        "its speed against performer-pytorch with as many features."))
    add_out_argument(favor, "docs/benchmarks", "Folder for the favor_approx and favor_speed files")
    favor.add_argument("--what", type=choice_list(FAVOR_PARTS), default=FAVOR_PARTS, metavar="PART,PART",
                       help="Comma-separated parts, from approx (error against the number of features) and speed "
                       "(needs performer-pytorch) (default: both).")
    favor.add_argument("--num-features", type=int_list, default=None, metavar="M,M",
                       help="Approximation: the numbers of random features m, e.g. 16,64,256 "
                       "(default: 16 to 4096 in powers of 2).")
    favor.add_argument("--seeds", type=positive_int, default=None,
                       help="Approximation: seeds (inputs and projections) per number of features (default: 20).")
    favor.add_argument("--attention-num-features", type=positive_int, default=None, metavar="M",
                       help="Speed: the random features of the FAVOR+ config timed, and of performer-pytorch "
                       "beside it (default: 256).")
    favor.add_argument("--n", type=positive_int, default=None, help="Speed: sequence length N (default: 4096).")
    favor.add_argument("--repeats", type=positive_int, default=None,
                       help="Speed: interleaved timed calls per run (default: 7).")
    _add_runs(favor)

    family = bench_sub.add_parser(
        "family", help="Local attention at N = 65536 against softmax at N = 4096.",
        description=_wrapped("Local attention forward+backward at a long N against softmax attention at a short one."))
    add_out_argument(family, "docs/benchmarks", "Folder for family.json and family.md")
    family.add_argument("--n-local", type=positive_int, default=65536,
                        help="Local attention's sequence length (default: 65536).")
    family.add_argument("--n-softmax", type=positive_int, default=4096,
                        help="Softmax attention's sequence length (default: 4096).")
    family.add_argument("--attention-window", type=positive_int, default=256, metavar="W",
                        help="Local attention's window, part of the claim (default: 256, not the registry's "
                        "default).")
    family.add_argument("--repeats", type=positive_int, default=3,
                        help="Interleaved timed calls per run (default: 3).")
    _add_runs(family)

    full = bench_sub.add_parser(
        "full", help="The full sweep and generation benchmark, and docs/benchmarks.md.",
        description=_wrapped("The sweep with its defaults and the generation benchmark, then the document written "
        "from their files."))
    add_out_argument(full, "docs/benchmarks/full", "Folder for the sweep and generation files")
    full.add_argument("--doc", default="docs/benchmarks.md", metavar="PATH",
                      help="The Markdown document to write (default: docs/benchmarks.md).")
    full.add_argument("--doc-only", action="store_true",
                      help="Rebuild the document from the files already in --out, measuring nothing.")

    gen = bench_sub.add_parser(
        "generate", help="Per-token decoding time of each recurrent mechanism against softmax with a KV cache.",
        description=_wrapped("Decoding speed of TransformerLMs against position (one per mechanism with a recurrent "
        "form, softmax with a KV cache and recomputing the prefix), and images per second."))
    add_out_argument(gen, "docs/benchmarks", "Folder for generate.json and generate.md")
    gen.add_argument("--positions", type=int_list, default=(100, 16000), metavar="P,P",
                     help="Decoding positions, e.g. 100,16000 (default: 100,16000).")
    gen.add_argument("--steps", type=positive_int, default=20, help="Timed steps per position (default: 20).")
    add_mechanisms_argument(gen, default=None, names=[s.name for s in MECHANISMS.values() if s.recurrent],
                            what="Decoders to time, each a mechanism with a recurrent form (default: every one, "
                            "with its registry defaults; linear and softmax with their defaults are required)")
    gen.add_argument("--d-model", type=positive_int, default=512, help="The model's width d_model (default: 512).")
    gen.add_argument("--n-layers", type=positive_int, default=8, help="The model's layers (default: 8).")
    gen.add_argument("--n-heads", type=positive_int, default=8, help="The model's heads (default: 8).")
    gen.add_argument("--vocab-size", type=positive_int, default=32000,
                     help="The model's vocabulary size (default: 32000).")
    gen.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                     help="Also time softmax recomputing the whole prefix for each token (default: on).")
    gen.add_argument("--image-batch", type=non_negative_int, default=8, metavar="B",
                     help="Images of 784 pixels generated at once for images per second; 0 skips that part "
                     "(default: 8).")
    gen.add_argument("--image-d-model", type=positive_int, default=None,
                     help="The pixel model's width d_model (default: 256).")
    gen.add_argument("--image-n-layers", type=positive_int, default=None, help="The pixel model's layers (default: 8).")
    gen.add_argument("--compile", action="store_true",
                     help="Also time each model's compiled decoding step (TransformerLM.compiled_step).")
    _add_runs(gen)

    gated = bench_sub.add_parser(
        "gated", help="Gated and delta-rule attention against linear attention and transformers' gated delta rule.",
        description=_wrapped("gated_linear_attention and delta_rule_attention, causal forward+backward, against "
        "linear_attention and against transformers' torch_chunk_gated_delta_rule, interleaved; one recurrent step "
        "of each; peak memory, finiteness and error against the float64 reference at a long N."))
    add_out_argument(gated, "docs/benchmarks", "Folder for gated.json and gated.md")
    gated.add_argument("--ns", type=int_list, default=(4096, 16384), metavar="N,N",
                       help="Sequence lengths timed (default: 4096,16384).")
    gated.add_argument("--repeats", type=positive_int, default=5,
                       help="Interleaved timed calls per run against linear attention (default: 5).")
    gated.add_argument("--hf-repeats", type=positive_int, default=2,
                       help="Interleaved timed calls per run beside transformers' gated delta rule, which takes "
                       "seconds per call at N = 16384 (default: 2).")
    gated.add_argument("--memory-n", type=non_negative_int, default=65536, metavar="N",
                       help="Sequence length of the memory and accuracy check; 0 skips it (default: 65536).")
    _add_runs(gated)

    hf = bench_sub.add_parser(
        "transformers", help="transformers' Gated DeltaNet, KDA and Mamba-2 layers and models on their own path "
        "against linattn's (linattn.integrations.transformers).",
        description=_wrapped("Qwen3.5-0.8B's Gated DeltaNet layer, Kimi Linear's KDA layer, Mamba-2 1.3B's mixer, "
        "each family's recurrence alone and a small whole model of each family, at checkpoint widths: prefill, forward+backward and decoding time on transformers' own PyTorch "
        "path and on linattn, interleaved on the same module; peak memory of a prefill in fresh processes. Needs the "
        "transformers extra. Runs for tens of minutes."))
    add_out_argument(hf, "docs/benchmarks/transformers", "Folder for transformers.json and transformers.md")
    hf.add_argument("--repeats", type=positive_int, default=2,
                    help="Interleaved timed calls per setting and run, after one warm-up round (default: 2).")
    hf.add_argument("--sizes", choices=("checkpoint", "tiny"), default="checkpoint",
                    help="checkpoint: the real layer widths and N = 1024 .. 16384; tiny: a seconds-long check of "
                    "the command itself (default: checkpoint).")
    hf.add_argument("--measure-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="Measure each prefill's peak memory in fresh processes (default: on).")
    hf.add_argument("--subjects", type=_subjects, default=None,
                    help="Comma-separated subjects to time (default: all): gdn_core, kda_core, gdn_layer, kda_layer, "
                    "gdn_model, kda_model, kda_small_model, ssd_core, ssd_layer, ssd_model.")
    _add_runs(hf)

    cp = bench_sub.add_parser(
        "context-parallel", help="One training step with the sequence sharded over 1, 2, 4 ranks: the longest "
        "sequence within a memory budget, the time per step, the bytes exchanged.",
        description=_wrapped("A Gated DeltaNet TransformerLM trained one step with its sequence sharded over P gloo "
        "processes (context parallelism): the longest sequence whose ranks fit the memory budget together, the time "
        "per step beside one process, and the bytes each rank receives, counted and against the written model "
        "(extended to 8 .. 1024 ranks). Runs for tens of minutes."))
    add_out_argument(cp, "docs/benchmarks", "Folder for context_parallel.json and context_parallel.md")
    cp.add_argument("--ranks", type=int_list, default=(1, 2, 4), metavar="P,P",
                    help="Rank counts, the first the baseline of the time ratios (default: 1,2,4).")
    cp.add_argument("--time-n", type=positive_int, default=32768, metavar="N",
                    help="Sequence length of the timed steps (default: 32768).")
    cp.add_argument("--budget-gib", type=positive_float, default=None,
                    help="Memory all ranks together may use in the search, GiB (default: 20, of this machine's 24).")
    cp.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                    help="Search the longest sequence within the budget (default: on).")
    _add_runs(cp)

    gpu = bench_sub.add_parser(
        "gpu", help="Every chunked form and the transformers backend on a GPU, beside FLA's kernels, transformers' "
        "PyTorch path and SDPA.",
        description=_wrapped("Every chunked form (Gated DeltaNet, DeltaNet, KDA, GLA per channel and per head, causal "
        "linear attention, FAVOR+) and the transformers backend (a Qwen3.5-width model of 2 Gated DeltaNet layers) at "
        "checkpoint widths, B = 1: prefill, forward+backward and peak memory, the median of the runs with their "
        "spread, beside flash-linear-attention's Triton kernels (when fla imports), transformers' own PyTorch path "
        "and SDPA, interleaved. Records the device and the versions; writes gpu.json and gpu.md. A contender that "
        "does not import or raises is a row of the table, not the end of the run."))
    add_out_argument(gpu, "docs/benchmarks/gpu", "Folder for gpu.json and gpu.md")
    gpu.add_argument("--device", default="cuda",
                     help="cuda or cuda:<index>; cpu only checks the script, with no memory figures (default: cuda).")
    gpu.add_argument("--n", type=int_list, default=None, metavar="N,N",
                     help="Sequence lengths (default: 4096,16384; 64,128 with --quick).")
    gpu.add_argument("--forms", type=choice_list(GPU_FORMS), default=GPU_FORMS, metavar="FORM,FORM",
                     help=f"Comma-separated forms, from {', '.join(GPU_FORMS)} (default: all).")
    gpu.add_argument("--dtype", choices=GPU_DTYPES, default="bfloat16",
                     help="q, k, v's dtype (and beta's, and the model's); log decays stay float32 (default: bfloat16).")
    gpu.add_argument("--repeats", type=positive_int, default=gpu_options.REPEATS,
                     help=f"Timed calls per contender and run, interleaved; a run's time is their median "
                     f"(default: {gpu_options.REPEATS}).")
    gpu.add_argument("--runs", type=positive_int, default=None,
                     help="Runs in this one process (FLA's autotuning is not repeated); a time is the median of "
                     "the runs' medians, with min and max (default: 3).")
    gpu.add_argument("--fla", action=argparse.BooleanOptionalAction, default=True,
                     help="Time flash-linear-attention's kernels when fla imports; --no-fla leaves FLA out "
                     "everywhere, transformers' model path included (its Triton kernels autotune for minutes on "
                     "the first call of each shape) (default: on).")
    gpu.add_argument("--quick", action="store_true",
                     help="Tiny sizes (2 heads of 16, N = 64,128, a tiny model): a check of the script, e.g. "
                     "with --device cpu.")
    gpu.add_argument("--chunk-sizes", type=int_list, default=(), metavar="C,C",
                     help="Also time linattn with these chunk sizes, beside its default (every form but ssd and "
                     "the model): the accelerator's defaults chosen by measurement (default: none).")
    gpu.add_argument("--sub-chunk-sizes", type=int_list, default=(), metavar="c,c",
                     help="Also time linattn with these sub-chunk sizes, with the default and every --chunk-sizes "
                     "(kda and gla_channel, a gate per key channel) (default: none).")
    gpu.add_argument("--solve-blocks", type=int_list, default=(), metavar="b,b",
                     help="Also time linattn with these solve blocks (the largest block of a chunk's triangular "
                     "inverse solved directly), with the default and every --chunk-sizes (gated_delta, delta, kda) "
                     "(default: none).")
    gpu.add_argument("--cuda-graphs", action="store_true",
                     help="Also time linattn replayed from CUDA graphs (every kernel form): its kernels without the "
                     "host's launch overhead (CUDA only; a row 'left out' elsewhere).")
    gpu.add_argument("--profile", action="store_true",
                     help="Also profile one linattn Gated DeltaNet forward and forward+backward at the first N: "
                     "kernels and GPU-busy time on a GPU, leaf aten ops on either device.")
    launches = bench_sub.add_parser(
        "launches", help="Kernel launches of every chunked form, the CPU strategy against the accelerator strategy.",
        description=_wrapped("Every chunked form (Gated DeltaNet, DeltaNet, KDA, GLA per channel and per head, causal "
        "linear attention, FAVOR+) at checkpoint widths, B = 1, float32: the kernel launches of one prefill and one "
        "forward+backward with the engines' strategy forced to cpu and to accelerator, counted on this CPU as the "
        "computing leaf aten ops torch.profiler records (they track a GPU's kernels), and whether issue 44's limits "
        "hold (accelerator: at most 200 launches forward, 600 forward+backward at the largest N, at most 1.5x the "
        "count at the smallest N). Writes launches.json and launches.md; minutes at full size."))
    add_out_argument(launches, "docs/benchmarks/launches", "Folder for launches.json and launches.md")
    launches.add_argument("--n", type=int_list, default=None, metavar="N,N",
                          help="Sequence lengths; the limits are read at the largest against the smallest "
                          "(default: 4096,16384; 256,1024 with --quick).")
    launches.add_argument("--forms", type=choice_list(LAUNCH_FORMS), default=LAUNCH_FORMS, metavar="FORM,FORM",
                          help=f"Comma-separated forms, from {', '.join(LAUNCH_FORMS)} (default: all).")
    launches.add_argument("--quick", action="store_true",
                          help="Tiny widths (2 heads of 16) and N = 256,1024: a check of the command in seconds.")
    launches.add_argument("--fresh-processes", action=argparse.BooleanOptionalAction, default=True,
                          help="Each count in a process of its own: a clean heap, and a setting the system kills "
                          "for its memory is a row that says so, not the end of the run (default: on).")
    tensor_cores = bench_sub.add_parser(
        "tensor-cores", help="The share of every chunked form's product FLOPs with half operands on the accelerator "
        "strategy, and the accuracy they cost against float64 and FLA.",
        description=_wrapped("Every chunked form (Gated DeltaNet, DeltaNet, KDA, GLA per channel and per head, causal "
        "linear attention, FAVOR+) at checkpoint widths, B = 1, bfloat16 inputs, one forward: the share of its "
        "matrix-product FLOPs with half operands, strategy accelerator against cpu, and the bf16 output's error "
        "against float64 on the same inputs beside float32 products and FLA's figure recorded on the H200 (issue 44). "
        "Writes tensor_cores.json and tensor_cores.md; minutes at full size."))
    add_out_argument(tensor_cores, "docs/benchmarks/tensor_cores", "Folder for tensor_cores.json and tensor_cores.md")
    tensor_cores.add_argument("--n", type=positive_int, default=None,
                              help="Sequence length N (default: 4096; 256 with --quick).")
    tensor_cores.add_argument("--quick", action="store_true",
                              help="Tiny widths (2 heads of 16) and N = 256: a check of the command in seconds.")
    for sub in (sweep, core, favor, family, full, gen, gated, hf, cp, gpu, launches,
                tensor_cores):  # its validation errors name it, not `linattn bench`
        sub.set_defaults(suite_parser=sub)
    return parser


def _subjects(text: str) -> tuple[str, ...]:
    """``--subjects``: comma-separated names of ``linattn bench transformers``' subjects."""
    from ..bench.transformers import check_subjects

    try:
        return check_subjects(name.strip() for name in text.split(",") if name.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("run_transformers: ")) from None


def _given(args: argparse.Namespace, *names: str) -> dict:
    """``{name: value}`` of the flags (defaults None) that were given: the others keep the defaults of
    the function called, stated once there."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def run(parser: CommandParser, args: argparse.Namespace, argv: list[str]) -> int:
    from ..bench.harness import output_folder

    if args.suite is None:  # `linattn bench`: the sweep with its defaults
        args = parser.parse_args(["sweep"])
    chosen = args.suite_parser
    # flags that the chosen work would not read are refused, not ignored
    if args.suite == "favor":
        if "speed" not in args.what:
            refuse_unused(chosen, args, ("--attention-num-features", "--n", "--repeats", "--runs"),
                          "it sets the speed part, and --what does not include speed")
        if "approx" not in args.what:
            refuse_unused(chosen, args, ("--num-features", "--seeds"),
                          "it sets the approximation part, and --what does not include approx")
    elif args.suite == "generate" and args.image_batch == 0:
        refuse_unused(chosen, args, ("--image-d-model", "--image-n-layers"),
                      "it sets the pixel model, which --image-batch 0 skips")
    elif args.suite == "sweep" and not args.measure_memory:
        refuse_unused(chosen, args, ("--memory-budget-gib",),
                      "memory is predicted from measured peaks, and --no-measure-memory measures none")
    elif args.suite == "context-parallel" and not args.search:
        refuse_unused(chosen, args, ("--budget-gib",), "it bounds the search, which --no-search skips")
    # the output folder is created and checked before any work: a run that finds out at its end that
    # it cannot write loses its measurement
    with reported(chosen, ValueError):
        if args.suite == "full":
            output_folder(Path(args.doc).parent, what="--doc's folder", keep=False)
        if not getattr(args, "doc_only", False):
            output_folder(args.out, what="--out", keep=False)
    if args.suite == "sweep":
        from ..bench.sweep import DEFAULT_NS, SweepConfig, run_sweep

        with reported(chosen, ValueError):
            config = SweepConfig(
                mechanisms=args.mechanisms, peers=args.peers, ns=args.ns or DEFAULT_NS, passes=args.passes,
                modes=args.modes, batch_size=args.batch_size, n_heads=args.n_heads, head_dim=args.head_dim, dtype=args.dtype,
                device=args.device, repeats=args.repeats, time_budget_s=args.time_budget_s,
                measure_memory=args.measure_memory,
                **({} if args.memory_budget_gib is None else {"memory_budget_bytes": int(args.memory_budget_gib * 2**30)}),
            )
        run_sweep(config, out=args.out, command=command_line(argv))
    elif args.suite == "core":
        from ..bench.core import run_core

        run_core(out=args.out, n=args.n, repeats=args.repeats, **_given(args, "runs"))
    elif args.suite == "favor":
        from ..bench.favor import APPROX_NUM_FEATURES, run_favor
        from ..nn import FavorConfig

        with reported(chosen, ValueError, RuntimeError):
            m = args.attention_num_features
            run_favor(out=args.out, what=args.what, num_features=args.num_features or APPROX_NUM_FEATURES,
                      **({} if m is None else {"attention": FavorConfig(num_features=m)}),
                      **_given(args, "seeds", "n", "repeats", "runs"))
    elif args.suite == "family":
        from ..bench.family import run_family
        from ..nn import LocalConfig

        run_family(out=args.out, n_local=args.n_local, n_softmax=args.n_softmax,
                   attention=LocalConfig(window=args.attention_window), repeats=args.repeats, **_given(args, "runs"))
    elif args.suite == "full":
        from ..bench.full import run_full

        with reported(chosen, FileNotFoundError, ValueError):
            run_full(out=args.out, doc=args.doc, doc_only=args.doc_only)
    elif args.suite == "gated":
        from ..bench.gated import run_gated

        # the flags' types already hold run_gated's preconditions: an error from here on is a failure
        run_gated(out=args.out, ns=args.ns, repeats=args.repeats, hf_repeats=args.hf_repeats,
                  memory_n=args.memory_n, **_given(args, "runs"))
    elif args.suite == "transformers":
        from ..bench.transformers import run_transformers
        from ..extras import MissingExtraError

        with reported(chosen, MissingExtraError):
            run_transformers(out=args.out, repeats=args.repeats, sizes=args.sizes,
                             measure_memory=args.measure_memory, **_given(args, "runs", "subjects"))
    elif args.suite == "gpu":
        from ..bench.gpu import check_device, check_tunings, run_gpu

        with reported(chosen, ValueError):  # before any work: no CUDA here is one line, not a traceback
            check_device(args.device)
            check_tunings(args.forms, args.chunk_sizes, args.sub_chunk_sizes, args.solve_blocks)
        run_gpu(out=args.out, device=args.device, n=args.n, forms=args.forms, dtype=args.dtype, repeats=args.repeats,
                fla=args.fla, quick=args.quick, profile=args.profile, chunk_sizes=args.chunk_sizes,
                sub_chunk_sizes=args.sub_chunk_sizes, solve_blocks=args.solve_blocks, cuda_graphs=args.cuda_graphs,
                command=command_line(argv),
                **_given(args, "runs"))
    elif args.suite == "launches":
        from ..bench.launches import run_launches

        run_launches(out=args.out, n=args.n, forms=args.forms, quick=args.quick,
                     fresh_processes=args.fresh_processes, command=command_line(argv))
    elif args.suite == "tensor-cores":
        from ..bench.tensor_cores import run_tensor_cores

        run_tensor_cores(out=args.out, n=args.n, quick=args.quick, command=command_line(argv))
    elif args.suite == "context-parallel":
        from ..bench.context_parallel import run_context_parallel

        with reported(chosen, ValueError):
            run_context_parallel(out=args.out, ranks=tuple(args.ranks), time_n=args.time_n, search=args.search,
                                 **_given(args, "budget_gib", "runs"))
    elif args.suite == "generate":
        from ..bench.generate import check_mechanisms, run_generate

        if args.mechanisms is not None:
            try:
                check_mechanisms(args.mechanisms)
            except ValueError as e:
                chosen.fail(f"--mechanisms: {e}")
        with reported(chosen, ValueError):
            run_generate(out=args.out, positions=args.positions, steps=args.steps, d_model=args.d_model,
                         n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=args.vocab_size,
                         mechanisms=args.mechanisms, recompute=args.recompute, image_batch=args.image_batch,
                         **_given(args, "image_d_model", "image_n_layers"),
                         compile=args.compile, **_given(args, "runs"))
    return 0
