"""Timing and memory harness shared by `linattn demo` and `linattn bench`.

Inputs follow the SDPA layout ``(B, H, N, D)`` except for peers that want another layout, which get
their inputs created in that layout directly so that no transpose is timed.

Time: median wall time of repeated calls after warm-up, gradients reset to None before each call
(so gradient accumulation is never timed). Memory: peak resident set size above the baseline after
the inputs exist, measured in a fresh subprocess per configuration (Linux: the kernel's high-water
mark VmHWM, reset through /proc/self/clear_refs just before the call).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import platform
import resource
import statistics
import tempfile
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

import linattn

from ..nn import FavorConfig
from ..processes import run_process
from ..nn.registry import (
    AttentionConfig,
    attention_config_from_dict,
    attention_config_to_dict,
    get_mechanism,
    spec_for,
)

__all__ = ["Case", "INHERITED_ALLOCATOR", "OtherLoad", "PEERS", "Peer", "REFERENCE_DRIFT", "RUNS", "attention_fn",
           "build_module", "busy_reasons", "call", "commit_text", "describe", "describe_load", "format_allocator_times",
           "format_run_loads",
           "format_seconds", "format_spread", "format_spread_cells", "forms", "installed_peers", "machine_info",
           "keep_peer_results", "make_inputs", "moved_lines", "needs_input", "peak_memory", "proc_status_kib", "ratio_claim", "ratio_spreads",
           "git_state", "output_folder", "run_repeated", "spread", "supports", "time_calls", "write_atomically"]

# Settings that stop glibc from returning every large freed buffer to the OS (each call would
# otherwise fault in fresh pages, which costs the O(N) methods 25-50% of their time at N = 16k).
TUNED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "17179869184",
    "MALLOC_TOP_PAD_": "1073741824",
}
# The allocators a timing runs under, each in a fresh process (see run_child).
ALLOCATORS = {"default": {}, "tuned": TUNED_MALLOC_ENV}


@dataclass(frozen=True)
class Case:
    """One benchmark configuration.

    ``contender`` is a peer's name (:data:`PEERS`) or a registered mechanism's; a mechanism runs
    with ``attention`` (its config), or with its registry defaults when ``attention`` is None.
    """

    contender: str
    causal: bool
    n: int
    batch_size: int = 1
    n_heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    backward: bool = True
    device: str = "cpu"
    attention: AttentionConfig | None = None

    def config(self) -> AttentionConfig | None:
        """The mechanism's config (None for a peer)."""
        if self.contender in PEERS:
            return None
        return self.attention if self.attention is not None else get_mechanism(self.contender).default_config()

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["attention"] = None if self.attention is None else attention_config_to_dict(self.attention)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        attention = d.get("attention")
        return cls(**{**d, "attention": None if attention is None else attention_config_from_dict(attention)})


@dataclass(frozen=True)
class Peer:
    """An attention implementation from another project, timed beside linattn's mechanisms:
    ``fn(q, k, v, causal, attention) -> out``, where ``attention`` is the linattn config it is
    compared with (None: that mechanism's registry defaults), so that a peer with options of its
    own (performer-pytorch's number of random features) runs with the same ones."""

    name: str
    fn: Callable
    note: str
    available: Callable[[], bool]
    layout: str = "bhnd"  # "bnhd" for fast-transformers
    forms: frozenset[str] = frozenset({"bidirectional", "causal"})


def _fast_transformers_fn(q, k, v, causal, attention):
    from fast_transformers.attention import CausalLinearAttention, LinearAttention
    from fast_transformers.masking import LengthMask, TriangularCausalMask

    B, N, H, D = q.shape
    lengths = LengthMask(torch.full((B,), N, dtype=torch.long), max_len=N)
    if causal:
        return CausalLinearAttention(D)(q, k, v, TriangularCausalMask(N), lengths, lengths)
    # LinearAttention only reads `attn_mask.all_ones`; FullMask(N) would allocate an N x N bool
    # matrix that is no part of its algorithm, so hand it the one attribute it reads.
    return LinearAttention(D)(q, k, v, SimpleNamespace(all_ones=True), lengths, lengths)


def _has(module: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            __import__(module)
        except Exception:
            return False
        return True

    return check




@functools.lru_cache(maxsize=4)
def _performer_module(d: int, causal: bool, num_features: int):
    from performer_pytorch.performer_pytorch import FastAttention, causal_linear_attention

    fa = FastAttention(dim_heads=d, nb_features=num_features, causal=causal)
    if causal:
        # performer-pytorch looks only for the CUDA build of fast-transformers' kernel and otherwise
        # falls back to a path that needs gigabytes; this plugs in the CPU build, its fastest CPU path
        fa.causal_linear_fn = causal_linear_attention
    return fa


def _performer_fn(q, k, v, causal, attention):
    # FAVOR+'s counterpart: as many random features as the FavorConfig it is compared with
    favor = attention if isinstance(attention, FavorConfig) else FavorConfig()
    return _performer_module(q.shape[-1], causal, favor.num_features)(q, k, v)


# The peers: implementations from other projects (benchmark-only installs, docs/benchmarks/README.md).
# linattn's own mechanisms are not listed here: they come from linattn.nn.registry.MECHANISMS.
PEERS: dict[str, Peer] = {
    "performer_pytorch": Peer("performer_pytorch", _performer_fn,
                              note="performer-pytorch 1.1.4 FastAttention with as many random features as FAVOR+ "
                                   f"(default m = {FavorConfig().num_features}), causal with fast-transformers' "
                                   "CPU kernel",
                              available=_has("performer_pytorch")),
    "fast_transformers": Peer("fast_transformers", _fast_transformers_fn, layout="bnhd",
                              note="fast-transformers 0.4.0 (Causal)LinearAttention, elu+1, C++ CPU kernel",
                              available=_has("fast_transformers")),
}


def installed_peers() -> tuple[str, ...]:
    """The peers importable here, in :data:`PEERS` order."""
    return tuple(name for name, peer in PEERS.items() if peer.available())


def _keys(obj) -> set[str]:
    """Every key of every dict in a JSON value, however deep."""
    if isinstance(obj, dict):
        return set(obj).union(*map(_keys, obj.values()))
    if isinstance(obj, list):
        return set().union(*map(_keys, obj))
    return set()


def keep_peer_results(out: str | Path, name: str, *, command: str) -> None:
    """Refuse, before any work, a run that would replace the result ``out/name`` compared with a
    peer by one without it because that peer is not installed here: the committed comparison would
    be gone without a word (a peer is a benchmark-only install, easily missing from a fresh venv).
    A peer the result names as a key (a contender's times, its memory) counts as compared with.
    RuntimeError naming the peers, the file and the two ways out; nothing when no such file exists
    or every peer it names is installed. A peer left out on purpose (``bench sweep --peers``) is
    installed, so its comparison may go."""
    path = Path(out) / name
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{command}: cannot read {path}, the result this run would replace ({e}); "
                           "move it away or write elsewhere with --out") from None
    lost = sorted(p for p in _keys(old) & set(PEERS) if not PEERS[p].available())
    if lost:
        raise RuntimeError(
            f"{command}: {path} compares with {', '.join(lost)}, which {'is' if len(lost) == 1 else 'are'} not "
            "installed here, so this run would replace it with a result without "
            f"{'that comparison' if len(lost) == 1 else 'those comparisons'}. Install the peers (docs/benchmarks/README.md says how) or write "
            "elsewhere with --out.")


def forms(contender: str, config: AttentionConfig | None = None) -> frozenset[str]:
    """The forms a contender has: a peer's own, or its mechanism's from the registry."""
    if contender in PEERS:
        return PEERS[contender].forms
    return (spec_for(config) if config is not None else get_mechanism(contender)).forms


def supports(case: Case) -> bool:
    return ("causal" if case.causal else "bidirectional") in forms(case.contender, case.config())


def describe(contender: str, config: AttentionConfig | None = None) -> str:
    """One line for a results document: a peer's note, or the mechanism's summary and options."""
    if contender in PEERS:
        return PEERS[contender].note
    config = config if config is not None else get_mechanism(contender).default_config()
    spec = spec_for(config)
    options = ", ".join(f"{k} = {v}" for k, v in config.to_dict().items())
    return f"linattn {spec.name}: {spec.summary}" + (f" ({options})" if options else "")


def build_module(case: Case) -> torch.nn.Module:
    """The mechanism module of ``case`` (not a peer's), built from its registry spec with the case's
    heads, head width and N, on its device and in its dtype, parameters frozen: Linformer's E and F
    and Hedgehog's maps get no gradients, so a backward timing is attention's alone. Its randomness
    (FAVOR's projection, Linformer's E and F, LSH's rotations) is fixed by the config's seed.
    ValueError when the mechanism has no form for the case's mode."""
    if not supports(case):
        mode = "causal" if case.causal else "bidirectional"
        raise ValueError(f"{case.contender!r} has no {mode} form")
    config = case.config()
    module = spec_for(config).build(config, n_heads=case.n_heads, head_dim=case.head_dim, max_len=case.n)
    return module.requires_grad_(False).to(device=case.device, dtype=getattr(torch, case.dtype))


def needs_input(case: Case) -> bool:
    """The case's mechanism also reads the layer input ``x`` (its gates do; a peer never does)."""
    return case.contender not in PEERS and spec_for(case.config()).needs_input


def attention_fn(case: Case) -> Callable:
    """What :func:`call` times for ``case``: ``fn(q, k, v) -> out`` (``fn(q, k, v, x)`` when
    :func:`needs_input`), built here, once per case and outside any timed region: a peer's
    function, or the mechanism's module (:func:`build_module`). Shared query-key mechanisms (LSH)
    get q as the shared vector; k goes unused."""
    if case.contender in PEERS:
        peer = PEERS[case.contender]
        return lambda q, k, v: peer.fn(q, k, v, case.causal, case.attention)
    module = build_module(case)
    if needs_input(case):
        return lambda q, k, v, x: module(q, k, v, x=x, causal=case.causal)
    if spec_for(case.config()).shared_qk:
        return lambda q, k, v: module(q, q, v, causal=case.causal)
    return lambda q, k, v: module(q, k, v, causal=case.causal)


def output_folder(path: str | Path, *, what: str = "out", keep: bool = True) -> Path:
    """Create the folder ``path`` (and its parents) if needed and check that a file can be written
    in it, before a command does any work: a benchmark that finds out at the end that it cannot
    write loses its whole measurement. ValueError naming ``what`` and the reason otherwise.

    ``keep=False`` only checks: the folders this call created are removed again (a command line
    checks its folder before the command's own checks, such as a missing extra, which must leave
    nothing behind). The check writes a file, because permissions alone do not say (root, a
    read-only or virtual file system). An empty string is refused (``Path("")`` is the current
    folder, which nobody means by it)."""
    if isinstance(path, str) and not path.strip():
        raise ValueError(f"{what} is empty ({path!r}): give the folder to write into")
    path = Path(path)
    created = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        if isinstance(e, FileExistsError) or (path.exists() and not path.is_dir()):
            reason = "it exists and is not a folder"
        raise ValueError(f"{what} {str(path)!r}: cannot write there ({reason})") from None
    finally:
        if not keep:
            for p in created:  # deepest first
                with contextlib.suppress(OSError):
                    p.rmdir()
    return path


def write_atomically(out_dir: str | Path, files: dict[str, str]) -> Path:
    """Write each ``name -> text`` into ``out_dir``: whole to a temporary file, then renamed, so a
    reader never sees a half-written result."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
    return out_dir


def make_inputs(case: Case, *, seed: int = 0, requires_grad: bool | None = None):
    """q, k, v for ``case``, ``(B, H, N, D)`` (a peer's own layout when it has another), N(0, 1);
    for a mechanism that reads the layer input (:func:`needs_input`) also ``x (B, N, H * D)``, drawn
    alike and with gradients alike, so that a backward timing includes its gates' backward."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    shape = (case.batch_size, case.n_heads, case.n, case.head_dim)
    if case.contender in PEERS and PEERS[case.contender].layout == "bnhd":
        shape = (case.batch_size, case.n, case.n_heads, case.head_dim)
    shapes = [shape] * 3
    if needs_input(case):
        shapes.append((case.batch_size, case.n, case.n_heads * case.head_dim))
    rg = case.backward if requires_grad is None else requires_grad
    return [torch.randn(s, generator=g).to(dtype=dtype, device=case.device).requires_grad_(rg) for s in shapes]


def call(case: Case, inputs, fn: Callable) -> None:
    """One forward (and backward when ``case.backward``) of ``fn = attention_fn(case)``; on a GPU
    it waits for the device, so that wall time measures the work."""
    for t in inputs:
        t.grad = None
    if case.backward:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(*inputs)
    if case.device.startswith("cuda"):
        torch.cuda.synchronize(case.device)


def time_calls(fns: dict[str, Callable[[], None]], *, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time several contenders interleaved (A B A B ...), so machine noise hits them alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return times


def format_seconds(t: float | None) -> str:
    """``12.3 ms`` below a second, ``1.23 s`` above; ``-`` for no measurement."""
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def proc_status_kib(field_name: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) as an int (Linux)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``), so that the baseline is
    the live memory: pages the warm-up freed but left resident would otherwise be reused by the
    measured call unseen, and its peak would read low by however much the warm-up happened to
    leave behind (tens of MiB, differently for each implementation)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to release, the baseline is as it is
        pass


def peak_rss_bytes(fn: Callable[[], object]) -> int:
    """Peak resident set size above the current one while ``fn()`` runs, in bytes (Linux: the
    high-water mark VmHWM, reset to the current RSS through /proc/self/clear_refs just before)."""
    base = proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the high-water mark VmHWM to the current RSS
    fn()
    return (proc_status_kib("VmHWM") - base) * 1024


def _memory_child(case_json: str) -> None:
    case = Case.from_dict(json.loads(case_json))
    fn = attention_fn(case)  # the module and its parameters exist before the baseline
    inputs = make_inputs(case)
    call(case, make_inputs(case), fn)  # warm-up: lazy initialisation is not the call's memory
    for t in inputs:
        t.grad = None
    if case.device.startswith("cuda"):  # allocator peak above what is allocated now
        torch.cuda.synchronize(case.device)
        base = torch.cuda.memory_allocated(case.device)
        torch.cuda.reset_peak_memory_stats(case.device)
        call(case, inputs, fn)
        print(json.dumps({"peak_bytes": torch.cuda.max_memory_allocated(case.device) - base}))
        return
    release_free_heap()
    print(json.dumps({"peak_bytes": peak_rss_bytes(lambda: call(case, inputs, fn))}))


def run_child(module: str, args: list[str], env: dict[str, str], *, timeout: float = 3600) -> dict:
    """Run ``python -m module *args`` in a fresh process with ``env`` added to this one's
    environment (an allocator's settings only take effect at process start) and return the JSON
    object its last line of output prints."""
    proc = run_process([sys.executable, "-m", module, *args], env={**os.environ, **env}, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {module} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# How many times `bench core`, `bench favor --what speed`, `bench family` and `bench generate`
# repeat their whole measurement, each time in fresh processes: one run's ratio can be off by a slow
# spell of the machine, so a claim is the median over at least three runs, with the spread beside it.
RUNS = 3

# For benchmarks that time under one allocator, the one of the environment they were started in
# (`bench family`, `bench generate`): no settings of its own, so whatever malloc settings that
# environment has (machine_info's malloc_env) carry into every child.
INHERITED_ALLOCATOR = {"inherited": {}}


def run_repeated(module: str, args: list[str], *, runs: int = RUNS,
                 allocators: dict[str, dict[str, str]] = ALLOCATORS,
                 say: Callable[[str], None] = lambda text: None) -> list[dict]:
    """The whole measurement of ``python -m module child *args`` ``runs`` times. Each run starts one
    fresh child per allocator of ``allocators`` (default ``ALLOCATORS``; ``INHERITED_ALLOCATOR`` for
    one child per run in this process's environment) in turn, so allocators interleave run by run,
    and records its own load and reference matmul speed (:class:`OtherLoad`). Returns one
    ``{"allocators": {name: {"env": env, **child's JSON}}, "load": {...}}`` per run."""
    if runs < 1:
        raise ValueError(f"run_repeated: runs must be >= 1, got {runs}")
    if not allocators:
        raise ValueError("run_repeated: allocators is empty; give at least one (INHERITED_ALLOCATOR for none)")
    out = []
    for i in range(runs):
        load = OtherLoad(reference=True)
        results = {}
        for alloc, env in allocators.items():
            say(f"  run {i + 1}/{runs}, {alloc} malloc: timing ...")
            results[alloc] = {"env": env, **run_child(module, ["child", *args], env)}
        out.append({"allocators": results, "load": load.finish()})
    return out


def ratio_spreads(runs: list[dict], base: str) -> dict[str, dict[str, dict[str, dict]]]:
    """``[allocator][mode][contender]``: the :func:`spread` over runs of contender time / ``base``
    time, each run's ratio from that run's own medians (runs as :func:`run_repeated` returns them,
    each child's JSON holding ``times[mode][contender]["median_s"]``)."""
    out: dict = {}
    for alloc in runs[0]["allocators"]:
        for mode, contenders in runs[0]["allocators"][alloc]["times"].items():
            for name in contenders:
                if name == base:
                    continue
                per_run = [r["allocators"][alloc]["times"][mode][name]["median_s"]
                           / r["allocators"][alloc]["times"][mode][base]["median_s"] for r in runs]
                out.setdefault(alloc, {}).setdefault(mode, {})[name] = spread(per_run)
    return out


def peak_memory(case: Case, *, env: dict[str, str] | None = None, timeout: float = 600) -> int:
    """Peak memory above the baseline for one call of ``case``, in bytes, from a fresh subprocess:
    resident set size on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU."""
    cmd = [sys.executable, "-m", "linattn.bench.harness", "memory", json.dumps(case.to_dict())]
    proc = run_process(cmd, timeout=timeout, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"memory measurement of {case} failed:\n{proc.stderr[-2000:]}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"])


class OtherLoad:
    """How much of the machine's CPU other processes used while a benchmark ran.

    Timings on a shared machine are only as good as the machine was quiet, so every benchmark
    records this beside its numbers instead of trusting that it was. Created at the start of a
    run; :meth:`finish` returns ``{"other_cpu_share": f, ...}`` where f is the fraction of all
    CPUs' time spent busy on processes other than this one and its waited-for children (memory
    measurement subprocesses), from ``/proc/stat`` and ``getrusage``; ``None`` off Linux.
    """

    # Above this share of all CPUs' time taken by other processes a run counts as busy
    # (busy_reasons): the benchmarks run 2 threads, as many as this project's reference machine
    # has cores, so every other process's CPU second is one taken from the timed code; at 10% the
    # timings are already inflated by about as much as the run-to-run noise of a quiet machine.
    QUIET = 0.10

    def __init__(self, *, reference: bool = False) -> None:
        # This VM's own speed drifts by up to 2x with no other process running (the host's load is
        # invisible from inside): with ``reference`` a fixed matmul is timed at the start and at
        # :meth:`finish`, so that runs can be compared by the speed the machine had.
        self._reference = reference_gflops() if reference else None
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest is in user)
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / hz  # all but idle and iowait
        own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        return busy, sum(fields) / hz, own, time.perf_counter()

    def finish(self) -> dict:
        end = self._read()
        if self._start is None or end is None:
            return {"other_cpu_share": None}
        busy, total, own, wall = (e - s for e, s in zip(end, self._start))
        other = max(0.0, busy - own)
        out = {"other_cpu_share": other / total if total > 0 else None, "other_cpu_seconds": other,
               "own_cpu_seconds": own, "wall_seconds": wall, "cpus": os.cpu_count()}
        if self._reference is not None:
            out["reference_gflops"] = {"start": self._reference, "end": reference_gflops()}
        return out


def reference_gflops(seconds: float = 0.3) -> float:
    """GFLOP/s of a 512 x 512 float32 matmul (median over about ``seconds``): a fixed yardstick of
    how fast this machine is right now, recorded beside timings taken on a drifting machine."""
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    out = torch.empty(512, 512)
    torch.mm(a, a, out=out)  # warm-up
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        torch.mm(a, a, out=out)
        times.append(time.perf_counter() - t0)
    return 2 * 512**3 / statistics.median(times) / 1e9


# A run counts as busy (busy_reasons) when the reference matmul at one end ran below this fraction
# of its speed at the other end. Runs with almost no other load still see the two ends differ by up
# to about a fifth (the VM's own drift, not worth a warning); a larger change is a slow spell of
# the host that stretches the timings taken in between unevenly, contender by contender.
REFERENCE_DRIFT = 0.75


def busy_reasons(load: dict | None) -> list[str]:
    """Why the machine counts as busy during a run measured by :class:`OtherLoad` (``[]``: it does
    not, or nothing was recorded): other processes took over ``OtherLoad.QUIET`` of the CPU time,
    or the reference matmul's speed changed between start and end beyond ``REFERENCE_DRIFT``."""
    load = load or {}
    reasons = []
    share = load.get("other_cpu_share")
    if share is not None and share > OtherLoad.QUIET:
        reasons.append(f"other processes used {share:.0%} of the CPU time, more than {OtherLoad.QUIET:.0%}")
    ref = load.get("reference_gflops")
    if ref and min(ref["start"], ref["end"]) < REFERENCE_DRIFT * max(ref["start"], ref["end"]):
        reasons.append(f"the reference matmul ran at {ref['start']:.0f} GFLOP/s at the start and {ref['end']:.0f} "
                       f"at the end, a change of more than {1 - REFERENCE_DRIFT:.0%}")
    return reasons


def describe_load(load: dict | None) -> str:
    """A few sentences for a results document: how busy the machine was (see :class:`OtherLoad`)."""
    share = (load or {}).get("other_cpu_share")
    if share is None:
        return "Load from other processes during the run: not recorded."
    text = f"Other processes used {share:.0%} of the machine's CPU time during the run."
    ref = load.get("reference_gflops")
    if ref:
        text += (f" A reference 512 x 512 float32 matmul ran at {ref['start']:.0f} GFLOP/s at the start and "
                 f"{ref['end']:.0f} at the end (the machine's own speed; compare runs by it).")
    reasons = busy_reasons(load)
    if reasons:
        text += (f" The machine was busy: {'; '.join(reasons)}. These timings are inflated and noisy; "
                 "rerun on a quiet machine.")
    else:
        text += " A quiet machine."
    return text


def spread(values: list[float]) -> dict:
    """One quantity measured in several runs: ``{"median", "min", "max", "runs"}``. A claim is
    stated by the median, never the best run, with min and max as its spread."""
    if not values:
        raise ValueError("spread: no values (at least one run is needed)")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def format_spread(s: dict) -> str:
    """A ratio's :func:`spread` in words, the median first: ``4.05x, the median of 3 runs (min 3.90x,
    max 4.20x)``."""
    n = len(s["runs"])
    return (f"{s['median']:.2f}x, the median of {n} run{'s' if n != 1 else ''} "
            f"(min {s['min']:.2f}x, max {s['max']:.2f}x)")


def format_spread_cells(s: dict) -> str:
    """A ratio's :func:`spread` as Markdown table cells: ``median | min | max | every run``."""
    return f"{s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x | " + ", ".join(f"{x:.2f}x" for x in s["runs"])


def ratio_claim(setting: str, ours: str, theirs: str, s: dict) -> str:
    """One claim from the spread of ``theirs`` time / ``ours`` time, stated by its median."""
    if s["median"] >= 1:
        return f"{setting}: {ours} is faster than {theirs} by {format_spread(s)}"
    return f"{setting}: {theirs} / {ours} time {format_spread(s)}: {ours} is slower"


def format_run_loads(loads: list[dict]) -> list[str]:
    """Markdown table lines: each run's load from other processes and reference matmul speed."""
    lines = ["| run | other processes' CPU share | reference matmul GFLOP/s (start → end) | busy |",
             "| --- | --- | --- | --- |"]
    for i, load in enumerate(loads, 1):
        share, ref = load.get("other_cpu_share"), load.get("reference_gflops")
        share_s = "-" if share is None else f"{share:.0%}"
        ref_s = "-" if not ref else f"{ref['start']:.0f} → {ref['end']:.0f}"
        busy = "; ".join(busy_reasons(load)) or "no"
        lines.append(f"| {i} | {share_s} | {ref_s} | {busy} |")
    return lines


def format_allocator_times(runs: list[dict], peak_memory_bytes: dict[str, int]) -> list[str]:
    """Markdown table lines: each contender's time per allocator and mode, the median over the
    runs and every run's, and its peak memory (measured under the default allocator only).
    ``runs``: results of :func:`run_repeated` whose allocators hold ``times[mode][contender]``
    with a ``median_s``; ``peak_memory_bytes``: ``{"mode/contender": bytes}``."""
    lines = ["| allocator | mode | contender | time: median over runs | per run | peak memory |",
             "| --- | --- | --- | --- | --- | --- |"]
    for alloc, res in runs[0]["allocators"].items():
        for mode, contenders in res["times"].items():
            for name in contenders:
                per_run = [r["allocators"][alloc]["times"][mode][name]["median_s"] for r in runs]
                mem = peak_memory_bytes.get(f"{mode}/{name}") if alloc == "default" else None
                mem_s = "-" if mem is None else f"{mem / 2**20:.0f} MiB"
                lines.append(f"| {alloc} | {mode} | {name} | {median(per_run) * 1e3:.0f} ms | "
                             + ", ".join(f"{x * 1e3:.0f} ms" for x in per_run) + f" | {mem_s} |")
    return lines


def _cpu_caches() -> dict[str, int]:
    """CPU 0's data caches as {"L1": bytes, "L2": bytes, "L3": bytes} from Linux sysfs ({} elsewhere).
    Whether a model's weights fit in the last level decides what decoding speed is bound by."""
    caches = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            level = (index / "level").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction" and size.endswith("K"):
            caches[f"L{level}"] = int(size[:-1]) * 1024
    return caches


def machine_info() -> dict:
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "linattn": linattn.__version__,
        "malloc_env": {k: os.environ[k] for k in TUNED_MALLOC_ENV if k in os.environ},
        "cpu_caches": _cpu_caches(),
    }
    try:
        import fast_transformers  # noqa: F401
        from importlib.metadata import version

        info["fast_transformers"] = version("pytorch-fast-transformers")
    except Exception:
        pass
    return info


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "memory":
        torch.set_num_threads(int(os.environ.get("LINATTN_BENCH_THREADS", "2")))
        _memory_child(sys.argv[2])
    else:
        raise SystemExit("usage: python -m linattn.bench.harness memory CASE_JSON")


def git_state() -> dict:
    """The commit this code runs at (``git rev-parse HEAD`` of the checkout holding this file) and the
    files under src/ that differ from it, for a result file to name what measured it: None for both
    outside a git checkout."""
    root = Path(__file__).resolve().parents[3]  # src/linattn/bench/harness.py -> the checkout
    head = run_process(["git", "-C", str(root), "rev-parse", "HEAD"], timeout=60)
    if head.returncode != 0:
        return {"head": None, "uncommitted": None}
    status = run_process(["git", "-C", str(root), "status", "--porcelain", "--", "src"], timeout=60)
    return {"head": head.stdout.strip(),
            "uncommitted": [line[3:] for line in status.stdout.splitlines()] if status.returncode == 0 else None}


def commit_text(commit: dict) -> str:
    """A :func:`git_state` for a result's prose: the commit's first 12 digits (unknown outside a git
    checkout) and the files under src/ that differed from it."""
    head = commit["head"][:12] if commit["head"] else "unknown (not a git checkout)"
    dirty = commit.get("uncommitted")
    return head + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else "")


def moved_lines(end: dict | None, consequence: str) -> list[str]:
    """The warning of a run during which the checkout changed (``end``: :func:`git_state` at its
    end, None when it did not change), ending with ``consequence``; none when it did not."""
    if end is None:
        return []
    return [f"**The code changed during the run**: at its end the checkout was at {commit_text(end)}; "
            f"{consequence}.", ""]
