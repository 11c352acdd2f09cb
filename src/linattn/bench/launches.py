"""Kernel launches counted on any device, a CPU included: the aten ops of a call that compute.

On a GPU every aten op that computes something launches (at least) one kernel, and a call made of
many small launches is bound by them rather than by arithmetic. torch.profiler records every aten
op on a CPU as well, so the count can be tracked without a GPU: an op counts when it computes (not
a view, a reshape of metadata or an allocation) and no computing aten op runs below it (a
composite op such as ``linalg.vecdot`` counts as the ops it is made of). On the H200 this count
was within a few percent of the CUDA kernels launched (../shared/gpu/README.md).

:func:`run_launches` (``linattn bench launches``, issue 44) counts them for every chunked form of
``linattn bench gpu`` (Gated DeltaNet, DeltaNet, KDA, GLA per channel and per head, Mamba-2's SSD
(the grouped route, with its dt and D), causal linear attention, FAVOR+; B = 1, float32, the
checkpoint widths) at each N, prefill (a forward without
gradients) and train (forward+backward), with the engines' ``strategy`` forced to ``"cpu"`` and to
``"accelerator"``: the accelerator strategy batches every chunk and scans the recurrence across
chunks, so its count should stay flat in N (issue 44: at most 200 launches for a forward and 600
for a forward+backward at N = 16384, and at most 1.5x the count at N = 4096, for Gated DeltaNet,
KDA, per-channel GLA and causal linear attention). Each count runs in a fresh process by default,
so that a setting the system kills for its memory (the accelerator strategy keeps every chunk's
intermediates at once) is a row that says so. Writes launches.json (every op of every row, the
peak memory of each call and the commit counted) and launches.md.

Dimension legend: B batch (1), H heads, N positions, D head width (Dk = Dv).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from .. import progress
from ..processes import run_process
from .gpu import KERNEL_FORMS, form_function, form_projection, make_inputs, width_record, widths
from .harness import (commit_text, git_state, machine_info, moved_lines, output_folder, peak_rss_bytes,
                      release_free_heap, write_atomically)

__all__ = ["DEFAULT_NS", "FORMS", "GROWTH", "LIMITS", "NON_COMPUTING", "PASSES", "QUICK_NS", "STRATEGIES", "TARGETS",
           "LaunchCount", "count_launches", "form_call", "format_launches", "measure", "run_launches", "verdicts"]

# aten ops that only make a view, change metadata or allocate: no kernel runs for them.
NON_COMPUTING = frozenset(f"aten::{name}" for name in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "transpose", "t", "permute", "expand",
    "expand_as", "select", "slice", "narrow", "unsqueeze", "squeeze", "flatten", "unflatten", "unbind", "split",
    "split_with_sizes", "chunk", "diagonal", "alias", "detach", "detach_", "lift_fresh", "view_as", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_", "contiguous", "clone_meta",
    "movedim", "moveaxis", "swapaxes", "real", "_has_compatible_shallow_copy_type", "is_nonzero", "item",
    "_local_scalar_dense", "result_type", "to", "_to_copy_meta", "lift", "flip_meta", "numpy_T", "mT", "mH",
    "matrix_H", "adjoint", "conj", "_conj", "resolve_conj", "resolve_neg", "_neg_view", "view_as_real",
    "unfold", "align_as", "rename", "refine_names", "indices", "values", "squeeze_", "unsqueeze_", "transpose_",
    "as_strided_", "record_stream", "_nested_tensor_size", "size", "stride", "numel", "dim", "is_same_size",
))


# aten ops that run a kernel of their own besides the computing ops they call, so that counting
# leaves alone would miss them: baddbmm/addmm copy their input into the output (a copy_ below them)
# and then multiply into it; the triangular solves copy or clone their right-hand side first.
OWN_KERNEL = frozenset(f"aten::{name}" for name in (
    "baddbmm", "addbmm", "addmm", "addmv", "addr", "linalg_solve_triangular", "triangular_solve",
))


class LaunchCount(NamedTuple):
    """``total`` computing leaf aten ops of a call, and ``by_op`` their count per op name."""

    total: int
    by_op: Counter


def _computes(name: str) -> bool:
    return name.startswith("aten::") and name not in NON_COMPUTING


def count_launches(fn: Callable[[], object]) -> LaunchCount:
    """Run ``fn()`` once under torch.profiler (CPU activity) and count its computing leaf aten ops,
    and the ops of :data:`OWN_KERNEL` whatever they call.

    Why leaves: a composite op calls others (``matmul`` calls ``bmm``; ``to`` calls ``copy_``); only
    the innermost that compute become kernels. ``to``/``contiguous`` count through the ``copy_``
    below them, when there is one. A fused op that prepares its output with a copy and then
    computes into it (``baddbmm``) is two kernels: its copy and itself."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    by_op: Counter = Counter()

    def computing_below(ev) -> bool:
        return any(_computes(c.name) or computing_below(c) for c in ev.cpu_children)

    for ev in prof.events():
        if _computes(ev.name) and (ev.name in OWN_KERNEL or not computing_below(ev)):
            by_op[ev.name] += 1
    return LaunchCount(sum(by_op.values()), by_op)


# ---------------------------------------------------------------------------------------------
# `linattn bench launches`: the chunked forms under each strategy (issue 44)
# ---------------------------------------------------------------------------------------------

# Dimension legend of what follows: B batch (1), H heads, N positions, D head width (Dk = Dv).

PASSES = ("prefill", "train")
STRATEGIES = ("cpu", "accelerator")
FORMS = tuple(KERNEL_FORMS)  # bench gpu's forms: gated_delta, delta, kda, gla_channel, gla_head, ssd, linear, favor
DEFAULT_NS = (4096, 16384)
QUICK_NS = (256, 1024)
# Issue 44's targets, with the accelerator strategy forced: at the largest N at most this many launches
# per pass, and at most GROWTH times the count at the smallest N; for these forms
LIMITS = {"prefill": 200, "train": 600}
GROWTH = 1.5
TARGETS = ("gated_delta", "kda", "gla_channel", "linear")
TOP_OPS = 8  # the most frequent ops kept per row in launches.json


def form_call(form: str, n: int, pass_: str, strategy: str, *, quick: bool = False) -> Callable[[], None]:
    """One call of ``form`` at ``n`` (B = 1, float32, the form's checkpoint width; 2 heads of 16 with
    ``quick``) with ``strategy`` forced, on the CPU: ``prefill`` a forward without gradients,
    ``train`` a forward and a backward into every input's gradient (reset to None first: no
    accumulation) from a cotangent of ones made here, outside the call."""
    spec = KERNEL_FORMS[form]
    heads, head_dim, state = widths(spec, quick)
    tensors = make_inputs(spec, n, heads, head_dim, dtype=torch.float32, device=torch.device("cpu"), state=state)
    fn = form_function(spec, strategy=strategy, projection=form_projection(spec, head_dim))
    if pass_ == "prefill":
        def prefill() -> None:
            with torch.no_grad():
                fn(*tensors)
        return prefill
    for t in tensors:
        t.requires_grad_(True)
    cotangent = torch.ones_like(tensors[2])  # (B, H, N, Dv), the output's shape

    def train() -> None:
        for t in tensors:
            t.grad = None
        fn(*tensors).backward(cotangent)
    return train


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300].rstrip(": ")


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def measure(form: str, n: int, pass_: str, strategy: str, *, quick: bool = False) -> dict:
    """One row in this process (:func:`form_call`): after a warm-up call (first-call work such as
    registrations and caches is neither counted nor measured), the peak memory of one call (resident
    set above the inputs, ``peak_bytes``), then the launches of the next, ``launches``, with every
    op's count, ``by_op``, and the most frequent ones, ``top``."""
    call = form_call(form, n, pass_, strategy, quick=quick)
    call()
    release_free_heap()
    peak = peak_rss_bytes(call)
    count = count_launches(call)
    ops = dict(count.by_op.most_common())
    return {"launches": count.total, "top": list(ops.items())[:TOP_OPS], "by_op": ops, "peak_bytes": peak}


def _measure_in_child(form: str, n: int, pass_: str, strategy: str, *, quick: bool) -> dict:
    """:func:`measure` in a fresh process: its row, or ``{"error": ...}`` when it raised or was killed."""
    argv = [sys.executable, "-m", "linattn.bench.launches", "count", form, str(n), pass_, strategy]
    proc = run_process([*argv, *(["--quick"] if quick else [])])
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode == -signal.SIGKILL:
        memory = _memory_bytes()
        return {"error": "killed (SIGKILL), most likely for memory"
                         + (f": this machine has {memory / 2**30:.0f} GiB" if memory else "")}
    last = proc.stderr.strip().splitlines()[-1:] or [""]
    return {"error": f"exit status {proc.returncode}: {last[0]}"[:300]}


def verdicts(result: dict) -> list[dict]:
    """Per form and pass: the accelerator's count at the smallest and the largest N, its growth, and
    whether issue 44's limits hold there (``target``: the issue sets them for this form; ``holds``
    None with the ``error`` when a count is missing)."""
    ns = result["config"]["n"]
    lo, hi = min(ns), max(ns)
    rows = {(r["form"], r["n"], r["pass"]): r for r in result["rows"] if r["strategy"] == "accelerator"}
    out = []
    for form in result["config"]["forms"]:
        for pass_ in PASSES:
            first, last = rows.get((form, lo, pass_)), rows.get((form, hi, pass_))
            if first is None or last is None:  # not reached yet
                continue
            v = {"form": form, "pass": pass_, "smallest_n": lo, "largest_n": hi, "target": form in TARGETS,
                 "launches_smallest": first.get("launches"), "launches_largest": last.get("launches")}
            missing = [r for r in (first, last) if "launches" not in r]
            if missing:
                v.update(holds=None, error=f"N = {missing[-1]['n']}: {missing[-1]['error']}")
            else:
                growth = last["launches"] / first["launches"] if hi != lo else None
                within = last["launches"] <= LIMITS[pass_]
                flat = growth is None or growth <= GROWTH
                v.update(growth=growth, within_limit=within, flat=flat, holds=within and flat)
            out.append(v)
    return out


def run_launches(out: str | Path = "docs/benchmarks/launches", *, n: Sequence[int] | None = None,
                 forms: Sequence[str] = FORMS, quick: bool = False, fresh_processes: bool = True,
                 command: str | None = None, quiet: bool = False) -> dict:
    """Count the launches (:func:`count_launches`) of one call of every form of ``forms`` at every N of
    ``n`` (None: 4096 and 16384; 256 and 1024 with ``quick``, which also takes 2 heads of 16), each
    pass (``prefill``, ``train``) and strategy (``cpu``, ``accelerator``), after one warm-up call and
    one whose peak memory is measured (:func:`measure`); write launches.json and launches.md into ``out``
    (after every form: a stopped run leaves what it counted), print the Markdown and return the
    result. ``fresh_processes``: each count in a process of its own (a clean heap, and a count that
    the system kills for memory is a row), else all in this one. ``command``: the command line
    recorded (None: one rebuilt from the arguments). ValueError before any work for a bad argument.
    A call that raises is a row with its error, not the end of the run."""
    unknown = [f for f in forms if f not in FORMS]
    if unknown or not forms:
        raise ValueError(f"run_launches: forms must be some of {', '.join(FORMS)}, got {list(forms)}")
    ns = tuple(n) if n is not None else (QUICK_NS if quick else DEFAULT_NS)
    if not ns or any(not isinstance(x, int) or x < 1 for x in ns):
        raise ValueError(f"run_launches: n must be sequence lengths >= 1, got {n}")
    output_folder(out)
    say = functools.partial(progress.say, quiet=quiet)
    if command is None:
        command = ("linattn bench launches" + (f" --n {','.join(map(str, n))}" if n is not None else "")
                   + (f" --forms {','.join(forms)}" if tuple(forms) != FORMS else "")
                   + (" --quick" if quick else "") + ("" if fresh_processes else " --no-fresh-processes")
                   + f" --out {out}")
    t_start = time.perf_counter()
    result: dict = {
        "command": command,
        "complete": False,
        "commit": git_state(),
        "machine": {**machine_info(), "memory_bytes": _memory_bytes()},
        "config": {"forms": list(forms), "n": list(ns), "passes": list(PASSES), "strategies": list(STRATEGIES),
                   "quick": quick, "fresh_processes": fresh_processes, "dtype": "float32", "batch_size": 1,
                   "warmup": 1, "widths": {f: width_record(KERNEL_FORMS[f], quick) for f in forms},
                   "limits": {"launches": LIMITS, "growth": GROWTH, "targets": list(TARGETS)}},
        "rows": [],
    }
    say(f"linattn bench launches at {(result['commit']['head'] or 'no commit')[:12]}: {', '.join(forms)} at N = "
        f"{', '.join(map(str, ns))}, {', '.join(PASSES)}, strategies {', '.join(STRATEGIES)}")

    def save() -> None:
        result["verdicts"] = verdicts(result)
        result["elapsed_seconds"] = time.perf_counter() - t_start
        write_atomically(out, {"launches.json": json.dumps(result, indent=2), "launches.md": format_launches(result)})

    for form in forms:
        for x in ns:
            for pass_ in PASSES:
                for strategy in STRATEGIES:
                    t0 = time.perf_counter()
                    if fresh_processes:
                        row = _measure_in_child(form, x, pass_, strategy, quick=quick)
                    else:
                        try:
                            row = measure(form, x, pass_, strategy, quick=quick)
                        except Exception as e:  # noqa: BLE001 - one failed setting is a row, not the end of the run
                            row = {"error": _first_line(e)}
                    result["rows"].append({"form": form, "n": x, "pass": pass_, "strategy": strategy, **row})
                    what = (f"error: {row['error']}" if "error" in row else
                            f"{row['launches']} launches, peak {_memory(row['peak_bytes'])}")
                    say(f"  {form}, N = {x}, {pass_}, {strategy}: {what} ({time.perf_counter() - t0:.1f} s)")
        save()
    result["complete"] = True
    end = git_state()
    if end != result["commit"]:  # the counts of a run whose code moved under it belong to no one commit
        result["commit_at_end"] = end
    save()
    say(format_launches(result))
    return result


def _memory(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _top(row: dict | None, k: int = 3) -> str:
    if row is None or "launches" not in row:
        return "-"
    return ", ".join(f"{op.removeprefix('aten::')} {c}" for op, c in row["top"][:k])


def format_launches(result: dict) -> str:
    cfg, m, commit = result["config"], result["machine"], result["commit"]
    ns = cfg["n"]
    lo, hi = min(ns), max(ns)
    width_text = "; ".join(f"{f} {w['heads']} x {w['head_dim']}" + (f" (state {w['state']})" if "state" in w else "")
                           for f, w in cfg["widths"].items())
    names = {"gated_delta": "Gated DeltaNet", "kda": "KDA", "gla_channel": "per-channel GLA",
             "linear": "causal linear attention"}
    lines = ["# Kernel launches of the chunked forms: the CPU strategy against the accelerator strategy", "",
             f"Written by `{result['command']}`; do not edit by hand. Commit {commit_text(commit)}. "
             f"Machine: {m['processor']}, {m['cpu_count']} CPUs, torch {m['torch']}.", "",
             *moved_lines(result.get("commit_at_end"), "counts made after the change count other code"),
             "A count is the computing leaf aten ops of one call, after one warm-up call, recorded by "
             "torch.profiler on the CPU (`linattn.bench.launches.count_launches`): ops that compute (no view, "
             "metadata change or allocation) and call no other computing op, and fused ops that compute into "
             "an output they first fill by a copy (`baddbmm`, `addmm`, the triangular solves: "
             "`linattn.bench.launches.OWN_KERNEL`), counted besides that copy. On a GPU each launches a kernel; "
             "on an H200 the count of leaves was within a few percent of the CUDA kernels torch.profiler saw "
             "there (1497 against 1409 for one Gated DeltaNet forward at N = 4096, 16 heads of 128). "
             f"B = 1, float32, heads x head width: {width_text}. prefill: a forward without gradients; train: a "
             "forward and a backward into every input's gradient. cpu / accelerator: the engines' `strategy=` "
             "forced. Peak memory: one call's resident set above its inputs, after the warm-up"
             + (", each count in a fresh process." if cfg.get("fresh_processes") else "."), "",
             f"Issue 44's limits, with the accelerator strategy, for {', '.join(names[f] for f in TARGETS)}: at the "
             f"largest N at most {LIMITS['prefill']} launches for a prefill and {LIMITS['train']} for a forward+"
             f"backward, and at most {GROWTH:g}x the count at the smallest N (here N = {hi} against {lo}). The other "
             "forms are held to the same limits without a target."]
    if not result.get("complete"):
        lines += ["", "**Incomplete**: the run stopped before its end; these are the settings it finished."]
    lines += ["", "## Limits", ""]
    for v in result.get("verdicts", []):
        if v["holds"] is None:
            lines.append(f"- not measured{'' if v['target'] else ' (no target)'}: `{v['form']}` {v['pass']}, "
                         f"accelerator: {v['error']}")
            continue
        growth = "-" if v["growth"] is None else f"{v['growth']:.2f}x"
        state = "holds" if v["holds"] else ("**does not hold**" if v["target"] else "does not hold")
        lines.append(f"- {state}{'' if v['target'] else ' (no target)'}: `{v['form']}` {v['pass']}, accelerator: "
                     f"{v['launches_largest']} launches at N = {v['largest_n']} (at most {LIMITS[v['pass']]}), "
                     f"{growth} the {v['launches_smallest']} at N = {v['smallest_n']} (at most {GROWTH:g}x)")
    lines += ["", "## Counts", "",
              f"growth: the accelerator's count / its count at N = {lo}. Most frequent: the accelerator's three most "
              "frequent ops (launches.json has every op of every row).", "",
              "| form | N | pass | cpu | accelerator | accelerator growth | limits | most frequent (accelerator) | "
              "peak memory (cpu / accelerator) |",
              "| --- | ---: | --- | ---: | ---: | ---: | --- | --- | ---: |"]
    rows = {(r["form"], r["n"], r["pass"], r["strategy"]): r for r in result["rows"]}
    by_key = {(v["form"], v["pass"]): v for v in result.get("verdicts", [])}

    def cell(row: dict | None) -> str:
        if row is None:
            return "-"
        return str(row["launches"]) if "launches" in row else f"error: {row['error']}".replace("|", "/")

    for form in cfg["forms"]:
        for x in ns:
            for pass_ in PASSES:
                cpu, acc = rows.get((form, x, pass_, "cpu")), rows.get((form, x, pass_, "accelerator"))
                if cpu is None and acc is None:
                    continue
                v = by_key.get((form, pass_)) if x == hi else None
                growth = "-" if v is None or v.get("growth") is None else f"{v['growth']:.2f}x"
                if v is None:
                    verdict = "-"
                elif v["holds"] is None:
                    verdict = "not measured"
                else:
                    why = [f"{v['launches_largest']} > {LIMITS[pass_]}"] * (not v["within_limit"]) + \
                          [f"{v['growth']:.2f}x > {GROWTH:g}x"] * (not v["flat"])
                    verdict = "holds" if v["holds"] else ("**does not hold**" if v["target"] else "does not hold") + \
                        f": {'; '.join(why)}"
                    verdict += "" if v["target"] else " (no target)"
                peaks = " / ".join(_memory((r or {}).get("peak_bytes")) for r in (cpu, acc))
                lines.append(f"| `{form}` | {x} | {pass_} | {cell(cpu)} | {cell(acc)} | {growth} | {verdict} | "
                             f"{_top(acc)} | {peaks} |")
    lines += ["", f"Elapsed: {result.get('elapsed_seconds', 0):.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # one count in a fresh process (run_launches' fresh_processes)
    args = sys.argv[1:]
    quick_flag = "--quick" in args
    args = [a for a in args if a != "--quick"]
    if len(args) != 5 or args[0] != "count":
        raise SystemExit("usage: python -m linattn.bench.launches count FORM N PASS STRATEGY [--quick]")
    print(json.dumps(measure(args[1], int(args[2]), args[3], args[4], quick=quick_flag)))
