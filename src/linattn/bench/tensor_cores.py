"""How much of a call's matrix-product arithmetic takes half-precision operands: the share a GPU
runs on tensor cores, measured on any device.

torch.profiler records every ``aten::bmm``, ``baddbmm``, ``mm``, ``addmm`` and ``matmul``-made
product with its FLOPs. A product counts as *half* when its operands are float16 or bfloat16
(on CUDA, ``strategy.mixed_bmm`` multiplies them so, accumulating in float32), or when it runs
under the ``linattn::half_operands`` label (elsewhere ``mixed_bmm`` multiplies the rounded
operands in float32: the same numbers, labelled); every other product counts as *full*.

:func:`run_tensor_cores` (``linattn bench tensor-cores``, issue 44) measures, for every chunked
form of ``linattn bench gpu`` (Gated DeltaNet, DeltaNet, KDA, GLA per channel and per head, Mamba-2's
SSD, causal linear attention, FAVOR+; B = 1, bfloat16 inputs, the checkpoint widths), a forward's half share
with the engines' ``strategy`` forced to ``"accelerator"`` and to ``"cpu"``, and what the half
operands cost in accuracy: the bf16 output's error against float64 on the same input values,
beside the error of float32 products and of a float32 output cast to bf16, and beside FLA's
recorded error from the H200 run (issue 44: at least half of a forward's product FLOPs with half
operands, accuracy no worse than FLA's). Writes tensor_cores.json and tensor_cores.md.

Dimension legend: B batch (1), H heads, N positions, D head width (Dk = Dv), m FAVOR+'s random
features.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import progress
from ..functional.strategy import HALF_OPERANDS
from .gpu import FAVOR_FEATURES, KERNEL_FORMS, Form, form_function, form_projection, relative_error, width_record, widths
from .gpu import make_inputs as scan_inputs
from .harness import commit_text, git_state, machine_info, output_folder, write_atomically

__all__ = ["DEFAULT_N", "FLA_RESULTS", "FORMS", "QUICK_N", "STRATEGIES", "ProductFlops", "fla_recorded",
           "format_tensor_cores", "make_inputs", "measure_form", "product_flops", "relative_error", "run_tensor_cores"]

_PRODUCTS = frozenset({"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::addbmm"})
# in-place products, to which torch.profiler (2.13) gives no FLOPs: counted from their operands' shapes
_IN_PLACE_PRODUCTS = frozenset({"aten::baddbmm_", "aten::addmm_", "aten::addbmm_"})
_HALF = frozenset({"c10::BFloat16", "c10::Half", "BFloat16", "Half"})


class ProductFlops(NamedTuple):
    """FLOPs of a call's matrix products with half operands (``half``) and with others (``full``)."""

    half: int
    full: int

    @property
    def half_share(self) -> float:
        """``half / (half + full)`` (0 for a call without products)."""
        total = self.half + self.full
        return self.half / total if total else 0.0


def _in_place_flops(ev) -> int:
    """``2 x rows x inner x columns`` (times the batch) of an in-place product ``self.op_(a, b)``, from
    the recorded shapes of ``a`` and ``b``."""
    a, b = ev.input_shapes[1], ev.input_shapes[2]
    return 2 * math.prod(a) * b[-1]


def product_flops(fn: Callable[[], object]) -> ProductFlops:
    """Run ``fn()`` once under torch.profiler and sum its matrix products' FLOPs by operand kind
    (the in-place ones, ``baddbmm_`` and the like, counted from their shapes: the profiler gives them
    none)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        fn()
    half = full = 0

    def walk(ev, labelled: bool) -> None:
        nonlocal half, full
        labelled = labelled or ev.name == HALF_OPERANDS
        flops = ev.flops if ev.name in _PRODUCTS else _in_place_flops(ev) if ev.name in _IN_PLACE_PRODUCTS else 0
        if flops:
            dtypes = set(ev.input_dtypes or ())
            if labelled or dtypes & _HALF:
                half += flops
            else:
                full += flops
            return  # a product's own children (a copy, a bmm under addmm) are not counted again
        for child in ev.cpu_children:
            walk(child, labelled)

    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev, False)
    return ProductFlops(half, full)


# ---------------------------------------------------------------------------------------------
# `linattn bench tensor-cores`: the half share and the accuracy it costs, every chunked form (issue 44)
# ---------------------------------------------------------------------------------------------

# the H200 run that measured FLA's Gated DeltaNet prefill against float64 (section F of check.py)
FLA_RESULTS = Path(__file__).resolve().parents[4] / "shared" / "gpu" / "results-run2.jsonl"
STRATEGIES = ("accelerator", "cpu")
FORMS = tuple(KERNEL_FORMS)  # bench gpu's forms: gated_delta, delta, kda, gla_channel, gla_head, ssd, linear, favor
DEFAULT_N = 4096
QUICK_N = 256
HALF_SHARE_TARGET = 0.5  # issue 44: at least half of a forward's product FLOPs take half operands
INPUT_DTYPE = torch.bfloat16


def make_inputs(form: Form, n: int, heads: int, head_dim: int, *, seed: int = 0, state: int | None = None) -> list[Tensor]:
    """``[q, k, v, beta?, log_decay?]`` for ``form``, every one bfloat16 (the log decay too), drawn as
    the H200 run drew FLA's Gated DeltaNet inputs (check.py's section F): q, v N(0, 1); k N(0, 1),
    rows L2-normalised for the delta rule; beta U(0, 1) ``(B, H, N)``; log decays
    log-sigmoid(N(0, 1) + 3), ``(B, H, N)`` per head or ``(B, H, N, D)`` per key channel. SSD
    (``form.state``): ``linattn.bench.gpu.make_inputs``'s Mamba-2 scan inputs of width ``state``, in
    bfloat16."""
    if form.state is not None:
        return [t.to(INPUT_DTYPE) for t in scan_inputs(form, n, heads, head_dim, dtype=torch.float32,
                                                        device=torch.device("cpu"), seed=seed, state=state)]
    g = torch.Generator().manual_seed(seed)
    shape = (1, heads, n, head_dim)  # (B, H, N, D)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    if form.delta:
        k = F.normalize(k, dim=-1)
    out = [q, k, v]
    if form.delta:
        out.append(torch.rand(shape[:3], generator=g))  # (B, H, N)
    if form.decay is not None:
        decay_shape = shape if form.decay == "channel" else shape[:3]  # (B, H, N, D) or (B, H, N)
        out.append(F.logsigmoid(torch.randn(decay_shape, generator=g) + 3))
    return [t.to(INPUT_DTYPE) for t in out]


def measure_form(form: str, n: int, *, quick: bool = False) -> dict:
    """One row: ``form`` at ``n`` (B = 1, bfloat16 inputs, the form's checkpoint width; 2 heads of 16
    with ``quick``), no gradients. Per strategy, the forward's product FLOPs with half operands and
    the rest (:func:`product_flops`) and the bf16 output's error against the float64 reference (the
    same function on the inputs' bf16 values in float64, strategy ``"cpu"``); and the error of the
    float32 output of the accelerator strategy on the same values (float32 inputs: no half operands)
    and of that output cast to bf16."""
    spec = KERNEL_FORMS[form]
    heads, head_dim, state = widths(spec, quick)
    inputs = make_inputs(spec, n, heads, head_dim, state=state)
    projection = form_projection(spec, head_dim)  # FAVOR+'s (m, D), rounded to bf16 like the other inputs
    projection = None if projection is None else projection.to(INPUT_DTYPE)

    def fn(strategy: str, *tensors: Tensor) -> Tensor:  # computed in the tensors' dtype
        return form_function(spec, strategy=strategy, projection=projection)(*tensors)

    row: dict = {"form": form, "n": n, "heads": heads, "head_dim": head_dim}
    t0 = time.perf_counter()
    with torch.no_grad():
        reference = fn("cpu", *(t.double() for t in inputs))  # (B, H, N, D)
        row["reference_seconds"] = time.perf_counter() - t0
        for strategy in STRATEGIES:
            box: dict = {}
            flops = product_flops(lambda: box.setdefault("out", fn(strategy, *inputs)))
            if box["out"].dtype != INPUT_DTYPE:
                raise RuntimeError(f"{form}, {strategy}: the output is {box['out'].dtype}, not {INPUT_DTYPE}")
            row[strategy] = {"half_flops": flops.half, "full_flops": flops.full, "half_share": flops.half_share,
                             "error": relative_error(box["out"], reference)}
        out32 = fn("accelerator", *(t.float() for t in inputs))
        row["float32"] = {"error": relative_error(out32, reference),
                          "cast_error": relative_error(out32.to(INPUT_DTYPE), reference)}
    row["seconds"] = time.perf_counter() - t0
    return row


def fla_recorded(path: str | Path = FLA_RESULTS) -> list[dict] | None:
    """FLA's Gated DeltaNet prefill error against float64 as the H200 run recorded it (section F of
    ``path``): ``[{"n", "heads", "head_dim", "fla_error", "linattn_error", "name"}]`` by N, or None
    when the file is not there or holds no such row. The linattn figure is the code of that run
    (all products float32), not this one."""
    path = Path(path)
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        match = re.fullmatch(r"gdn_prefill_bf16_B1_N(\d+)_H(\d+)_D(\d+)", str(rec.get("name", "")))
        if rec.get("section") != "F" or match is None or rec.get("fla_err_vs_fp64") is None:
            continue
        n, heads, head_dim = map(int, match.groups())
        rows.append({"n": n, "heads": heads, "head_dim": head_dim, "fla_error": rec["fla_err_vs_fp64"],
                     "linattn_error": rec.get("linattn_err_vs_fp64"), "name": rec["name"]})
    return sorted(rows, key=lambda r: r["n"]) or None


def run_tensor_cores(out: str | Path = "docs/benchmarks/tensor_cores", *, n: int | None = None, quick: bool = False,
                     command: str | None = None, quiet: bool = False) -> dict:
    """Measure every form of :data:`FORMS` at ``n`` (None: 4096; 256 with ``quick``, which also takes
    2 heads of 16) with :func:`measure_form`; write tensor_cores.json and tensor_cores.md into
    ``out`` after every form (a stopped run leaves what it measured), print the Markdown and return
    the result. ``command``: the command line recorded (None: one rebuilt from the arguments).
    ValueError before any work for a bad argument; a form that raises is a row with its error."""
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"run_tensor_cores: n must be a sequence length >= 1, got {n!r}")
    if command is None:
        command = ("linattn bench tensor-cores" + (f" --n {n}" if n is not None else "") + (" --quick" if quick else "")
                   + f" --out {out}")
    n = (QUICK_N if quick else DEFAULT_N) if n is None else n
    output_folder(out)
    say = functools.partial(progress.say, quiet=quiet)
    t_start = time.perf_counter()
    result: dict = {
        "command": command,
        "complete": False,
        "commit": git_state(),
        "machine": machine_info(),
        "config": {"forms": list(FORMS), "n": n, "quick": quick, "batch_size": 1, "dtype": "bfloat16",
                   "strategies": list(STRATEGIES), "favor_features": FAVOR_FEATURES,
                   "widths": {f: width_record(KERNEL_FORMS[f], quick) for f in FORMS},
                   "half_share_target": HALF_SHARE_TARGET},
        "fla": {"source": str(FLA_RESULTS), "rows": fla_recorded()},
        "rows": [],
    }
    say(f"linattn bench tensor-cores at {(result['commit']['head'] or 'no commit')[:12]}: {', '.join(FORMS)} at "
        f"N = {n}, bfloat16, strategies {', '.join(STRATEGIES)}")

    def save() -> None:
        result["elapsed_seconds"] = time.perf_counter() - t_start
        write_atomically(out, {"tensor_cores.json": json.dumps(result, indent=2),
                               "tensor_cores.md": format_tensor_cores(result)})

    for form in FORMS:
        try:
            row = measure_form(form, n, quick=quick)
        except Exception as e:  # noqa: BLE001 - one failed form is a row, not the end of the run
            lines = str(e).strip().splitlines()
            row = {"form": form, "n": n, "error": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}
            say(f"  {form}: error: {row['error']}")
        else:
            acc, cpu = row["accelerator"], row["cpu"]
            say(f"  {form}: half share {acc['half_share']:.3f} (cpu {cpu['half_share']:.3f}), error "
                f"{acc['error']:.2e} (cpu {cpu['error']:.2e}, float32 {row['float32']['error']:.2e}) "
                f"({row['seconds']:.1f} s)")
        result["rows"].append(row)
        save()
    result["complete"] = True
    save()
    say(format_tensor_cores(result))
    return result


def _gflop(side: dict) -> str:
    return f"{(side['half_flops'] + side['full_flops']) / 1e9:.3g}"


def format_tensor_cores(result: dict) -> str:
    cfg, m, commit = result["config"], result["machine"], result["commit"]
    n = cfg["n"]
    fla = result["fla"]["rows"]
    fla_text = "; ".join(f"{r['fla_error']:.2e} at N = {r['n']}" for r in fla) if fla else "not available"
    then = "; ".join(f"{r['linattn_error']:.2e} at N = {r['n']}" for r in fla or () if r["linattn_error"] is not None)
    lines = ["# Half operands in the chunked forms' products: their share of the FLOPs and the accuracy they cost",
             "",
             f"Written by `{result['command']}`; do not edit by hand. Commit {commit_text(commit)}. "
             f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}.", "",
             f"Every form at N = {n}, B = 1, bfloat16 inputs (log decays included), one forward without "
             "gradients. Inputs as the H200 run drew FLA's Gated DeltaNet inputs: q, v N(0, 1); k N(0, 1), rows "
             "L2-normalised for the delta rule; beta U(0, 1); log decays log-sigmoid(N(0, 1) + 3), per head or per "
             f"key channel; FAVOR+ with {cfg['favor_features']} positive random features.", "",
             "- **half share**: the forward's matrix-product FLOPs whose operands are bfloat16, over all its "
             "product FLOPs (torch.profiler's FLOPs of bmm/baddbmm/mm/addmm, `linattn.bench.tensor_cores."
             "product_flops`), with the engines' `strategy=` forced. On the accelerator strategy "
             "`strategy.mixed_bmm` rounds the large products' operands to bf16 and accumulates in float32: on "
             "CUDA on tensor cores, on this CPU as the rounded operands multiplied in float32, the same numbers "
             "up to the order of the sums. So these shares and errors are the GPU's, up to summation order. "
             f"Issue 44 asks for at least {cfg['half_share_target']:g}.",
             "- **error**: max |out - ref| / max |ref|, ref the same function in float64 on the inputs' bf16 "
             "values (the chunked form, strategy cpu; it equals the plain recurrence to about 1e-15). "
             "*accelerator*: bf16 output, half operands; *cpu*: bf16 output, float32 products; *float32*: "
             "the accelerator strategy on the same values as float32 inputs (no half operands), its float32 "
             "output, and that output cast to bf16: the floor a bf16 output cannot go below.",
             "- **GFLOP**: all product FLOPs of the forward, per strategy (the accelerator forms every chunk "
             "at once and does more arithmetic).", "",
             f"FLA's figure (flash-linear-attention 0.6.0's `chunk_gated_delta_rule`, bf16, 16 heads of 128, "
             f"B = 1) is **from the H200 run, on inputs of the same distribution, not these inputs**: "
             f"{fla_text}"
             + (f" (linattn's then, all products float32: {then})" if then else "")
             + f". Read from `../shared/gpu/results-run2.jsonl`, section F, when this ran."]
    if not result.get("complete"):
        lines += ["", "**Incomplete**: the run stopped before its end; these are the forms it finished."]
    lines += ["", "| form | H x D | half share, accelerator | half share, cpu | GFLOP accelerator / cpu | "
              "error, accelerator (half operands) | error, cpu (float32 products) | error, float32 output | "
              "error, float32 output cast to bf16 | FLA, H200 run (other inputs) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in result["rows"]:
        form = row["form"]
        fla_cell = "-"
        if form == "gated_delta":
            fla_cell = fla_text
        if "error" in row:
            error = row["error"].replace("|", "/")
            lines.append(f"| `{form}` | - | error: {error} | - | - | - | - | - | - | {fla_cell} |")
            continue
        acc, cpu, f32 = row["accelerator"], row["cpu"], row["float32"]
        lines.append(f"| `{form}` | {row['heads']} x {row['head_dim']} | {acc['half_share']:.3f} | "
                     f"{cpu['half_share']:.3f} | {_gflop(acc)} / {_gflop(cpu)} | {acc['error']:.2e} | "
                     f"{cpu['error']:.2e} | {f32['error']:.2e} | {f32['cast_error']:.2e} | {fla_cell} |")
    measured = [r for r in result["rows"] if "error" not in r]
    if measured:
        lines += ["", "## Against issue 44", ""]
        for row in measured:
            share = row["accelerator"]["half_share"]
            state = "holds" if share >= cfg["half_share_target"] else "**does not hold**"
            lines.append(f"- {state}: `{row['form']}` half share {share:.3f} (at least "
                         f"{cfg['half_share_target']:g})")
        gdn = next((r for r in measured if r["form"] == "gated_delta"), None)
        same_n = next((r for r in fla or () if r["n"] == n), None)
        if gdn is not None and same_n is not None:
            err = gdn["accelerator"]["error"]
            state = "holds" if err <= same_n["fla_error"] else "**does not hold**"
            lines.append(f"- {state}: `gated_delta` error {err:.2e} with half operands, FLA's {same_n['fla_error']:.2e} "
                         f"at N = {n} (H200 run, other inputs of the same distribution)")
        elif gdn is not None:
            lines.append(f"- not compared: FLA's error has no record at N = {n} ({fla_text})")
    lines += ["", f"Elapsed: {result.get('elapsed_seconds', 0):.0f} s.", ""]
    return "\n".join(lines)
