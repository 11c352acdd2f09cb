"""The demo and benchmark code run end to end on a tiny grid (benchmarks are not tests: this only
checks that the harness works and writes what it promises)."""

import json

import pytest
import torch

import linattn
from linattn.bench.demo import fast_vs_reference_errors, run_demo
from linattn.bench.harness import Case, attention_fn, call, make_inputs, time_calls
from linattn.cli import main
from linattn.nn.registry import MECHANISMS, attention_config_to_dict, config_label


def _defaults(*names):
    """The registry's default configs of ``names``."""
    return tuple(MECHANISMS[name].default_config() for name in names)


TINY_LM = {"d_model": 16, "n_layers": 2, "n_heads": 2, "vocab_size": 50}


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    """One real tiny demo: its result, folder and printed text, and what its three measured parts
    (sweep, errors, generation) returned, for the tests that vary only what the demo says about the
    machine's load (a real demo is 10 s or more)."""
    import contextlib
    import io

    import linattn.bench.demo as demo
    import linattn.bench.generate as generate
    import linattn.bench.sweep as sweep

    parts = {}

    def kept(name, fn):
        def call(*args, **kwargs):
            parts[name] = fn(*args, **kwargs)
            return parts[name]
        return call

    out, printed = tmp_path_factory.mktemp("demo"), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        for module, name in ((sweep, "run_sweep"), (generate, "run_generate"), (demo, "fast_vs_reference_errors")):
            mp.setattr(module, name, kept(name, getattr(module, name)))
        result = run_demo((64, 128), out=out, generate_positions=(4, 8), generate_model=TINY_LM,
                          measure_memory=False, transformers_model=dict(n=64, hidden_size=32, heads=2, head_dim=16))
    return {"result": result, "out": out, "printed": printed.getvalue(), "parts": parts}


def test_demo_tiny(tiny_demo):
    result, tmp_path = tiny_demo["result"], tiny_demo["out"]
    saved = json.loads((tmp_path / "demo.json").read_text())
    # the load and the machine's speed it measured are in the JSON, demo.md and the printed summary
    share, ref = saved["load"]["other_cpu_share"], saved["load"]["reference_gflops"]
    assert 0 <= share <= 1 and ref["start"] > 0 and ref["end"] > 0
    line = (f"other processes used {share:.0%} of the CPU time; a reference 512 x 512 float32 matmul ran at "
            f"{ref['start']:.0f} GFLOP/s at the start, {ref['end']:.0f} at the end")
    assert line in (tmp_path / "demo.md").read_text() and line in tiny_demo["printed"]
    assert saved["command"] == f"linattn demo --ns 64,128 --out {tmp_path}"
    for name in saved["files"]:  # the parts' own files are there too
        assert (tmp_path / name).exists(), name
    big = saved["sweep"]["largest_n"]
    assert big["n"] == 128 and big["causal"]["linear"]["status"] == "ok"
    assert big["causal"]["efficient"]["status"] == "unsupported"
    md = (tmp_path / "demo.md").read_text()
    assert "| linear |" in md and "overtakes softmax" in md and "favor causal" in md
    errors = result["max_error_vs_reference"]["errors"]
    expected = {f"{n} {form}" for n, spec in MECHANISMS.items() for form in ("bidirectional", "causal")
                if form in spec.forms} | {f"{n} recurrent (step by step)" for n, spec in MECHANISMS.items()
                                         if spec.recurrent}
    assert set(errors) == expected and all(e < 1e-4 for e in errors.values()), errors
    assert set(saved["generate"]["seconds_per_token"]) == {"linear@4", "linear@8", "softmax@4", "softmax@8",
                                                           "softmax-recompute@4", "softmax-recompute@8"}
    # a verdict of False comes with its one-line reason (the tiny model reads its weights each step too)
    faster = next(v for k, v in saved["generate"]["claim"].items() if "faster than" in k)
    assert ("- why not: at batch 1 every decoding step reads all" in md) is (not faster)
    # part 4: transformers' models on linattn; packed documents, which transformers' own path gets wrong
    part = saved["transformers"]
    assert part["prefill"]["n"] == 64 and part["prefill"]["linattn_s"] > 0 and part["prefill"]["transformers_s"] > 0
    assert part["ssd_prefill"]["linattn_s"] > 0 and part["ssd_prefill"]["transformers_s"] > 0
    for family in ("qwen3_5", "kimi_linear", "bamba"):
        assert part["packed"][family]["linattn"]["rel_err"] < 1e-6
    assert "flash-linear-attention" in part["packed"]["qwen3_5"]["transformers"]["refused"]
    assert part["packed"]["kimi_linear"]["transformers"]["rel_err"] > 1e-3
    assert part["packed"]["bamba"]["transformers"]["rel_err"] > 1e-4  # its mixers mix the documents
    assert "A small Mamba-2" in md and "bamba: linattn: " in md
    assert "## transformers' models on linattn" in md and "kimi_linear: linattn: " in md


def test_demo_says_why_linear_is_not_5x_faster_at_its_positions():
    from linattn.bench.demo import _why_not_faster

    claim = "linear at least 5x faster than softmax (KV cache) at 4096"
    gen = {"config": {"positions": [100, 4096]}, "weight_bytes": {"linear": 164e6, "softmax": 164e6},
           "bytes_ratio": {"softmax@100 / linear@100": 1.01, "softmax@4096 / linear@4096": 1.80},
           "claim": {"softmax@4096 / linear@4096": 1.31, claim: False}}
    why = _why_not_faster(gen)
    assert "reads all 164 MB of weights" in why and "near 1.8x, not 5x" in why
    assert _why_not_faster({**gen, "claim": {claim: True}}) is None


class _Load:
    """A stand-in load meter: what OtherLoad.finish() would have measured."""

    def __init__(self, share, start, end):
        self.measured = {"other_cpu_share": share, "reference_gflops": {"start": start, "end": end}}

    def finish(self):
        return self.measured


@pytest.mark.parametrize("share, start, end, busy", [(0.02, 200.0, 195.0, False), (0.60, 200.0, 190.0, True),
                                                     (0.02, 200.0, 90.0, True)])
def test_demo_warns_when_the_machine_was_busy(tmp_path, capsys, monkeypatch, tiny_demo, share, start, end, busy):
    import linattn.bench.demo as demo
    import linattn.bench.generate as generate
    import linattn.bench.sweep as sweep
    from linattn.bench.harness import REFERENCE_DRIFT, OtherLoad

    assert OtherLoad.QUIET < 0.60 and 90.0 < REFERENCE_DRIFT * 200.0 < 195.0  # the cases straddle the thresholds
    for module, name in ((sweep, "run_sweep"), (generate, "run_generate"), (demo, "fast_vs_reference_errors")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: tiny_demo["parts"][_name])
    result = run_demo((32,), out=tmp_path, generate_positions=(4,), generate_model=TINY_LM,
                      measure_memory=False, load=_Load(share, start, end), transformers_part=False)
    printed, md = capsys.readouterr().out, (tmp_path / "demo.md").read_text()
    assert f"other processes used {share:.0%} of the CPU time" in md
    assert f"matmul ran at {start:.0f} GFLOP/s at the start, {end:.0f} at the end" in md
    assert ("WARNING: the machine was busy" in md) is busy
    assert ("WARNING: the machine was busy" in printed.splitlines()[-1]) is busy  # the last line printed
    assert bool(json.loads((tmp_path / "demo.json").read_text())["busy"]) is busy and bool(result["busy"]) is busy
    if busy:
        reason = "other processes used 60%" if share > 0.5 else f"ran at {start:.0f} GFLOP/s at the start and {end:.0f}"
        assert reason in md


def test_errors_detect_a_wrong_fast_form(monkeypatch):
    """The error column would show a broken fast form (it is not a constant), and it reads the
    fast forms from the registry (a broken registered function shows in its rows only)."""
    import dataclasses

    spec = MECHANISMS["linear"]

    def broken(*args, **kw):
        out = spec.function(*args, **kw)
        return (out[0] * 1.01, out[1]) if isinstance(out, tuple) else out * 1.01

    monkeypatch.setitem(MECHANISMS, "linear", dataclasses.replace(spec, function=broken))
    errors = fast_vs_reference_errors(n=64)
    assert errors["linear causal"] > 1e-3 and errors["linear bidirectional"] > 1e-3
    assert errors["softmax bidirectional"] < 1e-4 and errors["linear recurrent (step by step)"] < 1e-4


def test_cli_demo_passes_its_options(monkeypatch, tmp_path):
    import linattn.bench.demo as demo

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda ns, **kw: seen.update(ns=ns, **kw))
    assert main(["demo", "--ns", "8,16", "--out", str(tmp_path)]) == 0
    assert seen == {"ns": (8, 16), "out": str(tmp_path)}
    monkeypatch.chdir(tmp_path)  # the default --out, report/, is created before any work
    assert main(["demo"]) == 0 and seen["ns"] == demo.DEFAULT_NS and seen["out"] == "report"


def test_harness_times_and_resets_grads():
    case = Case("linear", True, 33, n_heads=2, head_dim=8)
    x = make_inputs(case)
    fn = attention_fn(case)
    times = time_calls({"a": lambda: call(case, x, fn)}, repeats=2, warmup=1)
    assert len(times["a"]) == 2
    g1 = x[0].grad.clone()
    call(case, x, fn)
    torch.testing.assert_close(x[0].grad, g1)  # reset, not accumulated


def test_favor_approximation_benchmark_tiny(tmp_path):
    main(["bench", "favor", "--what", "approx", "--num-features", "8,64", "--seeds", "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "favor_approx.json").read_text())
    assert saved["command"] == f"linattn bench favor --what approx --num-features 8,64 --seeds 3 --out {tmp_path}"
    assert set(saved["summary"]) == {"positive-orthogonal", "positive-iid", "trig-orthogonal", "trig-iid"}
    for per_m in saved["errors"].values():
        assert [len(per_m[m]) for m in ("8", "64")] == [3, 3]
        assert all(0 < e < 10 for e in per_m["8"] + per_m["64"])
    assert (tmp_path / "favor_approx.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "positive-orthogonal" in (tmp_path / "favor_approx.md").read_text()
def test_family_tiny(tmp_path):
    """A tiny `bench family`: every run in its own process with its own load; the claim's verdicts
    and the ratios' spreads come from the runs' own times."""
    from linattn.bench.family import run_family

    result = run_family(out=tmp_path, n_local=300, n_softmax=40, repeats=1, runs=2, quiet=True)
    saved = json.loads((tmp_path / "family.json").read_text())
    assert saved["command"] == (f"linattn bench family --n-local 300 --n-softmax 40 --attention-window 256 --repeats 1 "
                                f"--runs 2 --out {tmp_path}")
    # the window the claim is about is the benchmark's own parameter, recorded as an attention config
    assert saved["config"]["attention"] == {"name": "local", "window": 256} and saved["config"]["window"] == 256
    assert saved["config"]["runs"] == 2 and len(saved["runs"]) == 2
    labels = {"local causal", "local bidirectional", "softmax bidirectional", "softmax causal"}
    assert set(saved["seconds"]) == labels and all(t > 0 for t in saved["seconds"].values())
    assert set(saved["ratios"]) == labels - {"softmax bidirectional"}
    assert saved["cases"]["local causal"]["n"] == 300 and saved["cases"]["softmax causal"]["n"] == 40
    md = (tmp_path / "family.md").read_text()
    for run in saved["runs"]:
        child = run["allocators"]["inherited"]
        assert set(child["seconds"]) == labels and all(len(v) == 1 for v in child["all_seconds"].values())
        ref = run["load"]["reference_gflops"]
        assert f"| {ref['start']:.0f} → {ref['end']:.0f} |" in md  # each run's machine speed
    for key, holds in saved["claim"].items():
        if key != "text":  # the markdown states each verdict the JSON holds
            assert f"- {key}: {'holds' if holds else 'does NOT hold'}" in md
            label = key.split(" < ")[0]
            assert holds is (saved["ratios"][label]["median"] < 1)
    assert result["claim"] == saved["claim"]


def test_family_decides_its_claim_on_the_median_run_not_the_best(monkeypatch, tmp_path):
    """`bench family` with each run's timings injected: the verdicts follow the median ratio over
    the runs, and in this case the best run would have said the opposite."""
    import linattn.bench.harness as harness
    from linattn.bench.family import run_family

    # local / softmax bidirectional in runs 1, 2, 3: causal's best run (0.8) would hold, its median
    # (1.1) does not; bidirectional's worst run (1.2) would not hold, its median (0.9) does
    ratios = {"local causal": [0.8, 1.3, 1.1], "local bidirectional": [1.2, 0.7, 0.9], "softmax causal": [0.5] * 3}
    calls = []

    def child(module, args, env):
        calls.append((module, args, env))
        run = len(calls) - 1
        seconds = {"softmax bidirectional": 2.0, **{k: 2.0 * v[run] for k, v in ratios.items()}}
        return {"seconds": seconds, "all_seconds": {k: [v] for k, v in seconds.items()}}

    monkeypatch.setattr(harness, "run_child", child)
    result = run_family(out=tmp_path, n_local=300, n_softmax=40, repeats=1, runs=3, quiet=True)
    window = json.dumps({"name": "local", "window": 256})  # the claim's window, not the registry default
    assert calls == [("linattn.bench.family", ["child", "300", "40", "1", window], {})] * 3  # a fresh child per run
    saved = json.loads((tmp_path / "family.json").read_text())
    md = (tmp_path / "family.md").read_text()
    for label, per_run in ratios.items():
        s = saved["ratios"][label]
        assert s["runs"] == pytest.approx(per_run)
        assert {k: s[k] for k in ("min", "median", "max")} == pytest.approx(_spread_of(per_run))
        assert f"| {s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x |" in md
    assert saved["claim"]["local causal < softmax bidirectional"] is False
    assert saved["claim"]["local bidirectional < softmax bidirectional"] is True
    assert ("- local causal < softmax bidirectional: does NOT hold (local causal time / softmax bidirectional time "
            "1.10x, the median of 3 runs (min 0.80x, max 1.30x))") in md
    assert "- local bidirectional < softmax bidirectional: holds (" in md
    assert saved["seconds"]["local causal"] == pytest.approx(2.2)  # the median of the runs' times
    assert "| local causal | 300 | 2.20 s | 1.60 s, 2.60 s, 2.20 s | 1.10x | 0.80x | 1.30x |" in md
    assert result["claim"] == saved["claim"]


def test_cli_bench_family(tmp_path, capsys):
    assert main(["bench", "family", "--n-local", "64", "--n-softmax", "16", "--repeats", "1", "--runs", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "local causal" in out and "run 1/1" in out
    assert json.loads((tmp_path / "family.json").read_text())["config"]["runs"] == 1


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_every_mechanism_runs_forward_and_backward_with_frozen_parameters(name):
    """Each registered mechanism, built from its spec, runs in the forms the registry gives it and
    refuses the others; its own parameters (Linformer's E, F, Hedgehog's maps) get no gradients, so
    a backward timing measures attention alone."""
    from linattn.bench.harness import build_module, supports

    for causal in (False, True):
        case = Case(name, causal, 128, n_heads=2, head_dim=8)
        assert supports(case) is (("causal" if causal else "bidirectional") in MECHANISMS[name].forms)
        if not supports(case):
            with pytest.raises(ValueError, match=f"no {'causal' if causal else 'bidirectional'} form"):
                attention_fn(case)
            continue
        module = build_module(case)
        x = make_inputs(case)
        q, k, v = x[:3]
        layer_input = {"x": x[3]} if MECHANISMS[name].needs_input else {}  # the gates' input (B, N, H * D)
        assert len(x) == 3 + len(layer_input)
        out = (module(q, q, v, causal=causal) if MECHANISMS[name].shared_qk
               else module(q, k, v, causal=causal, **layer_input))
        out.sum().backward()
        assert x[0].grad is not None and torch.isfinite(x[0].grad).all()
        assert all(p.grad is None and not p.requires_grad for p in module.parameters())
        call(case, make_inputs(case), attention_fn(case))  # what the benchmarks time


def test_sweep_tiny_reports_skips_unsupported_and_crossovers(tmp_path):
    from linattn.bench.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(mechanisms=_defaults("softmax", "linear", "efficient"), peers=(), ns=(64, 128, 256), repeats=1,
                      n_heads=2, head_dim=8, time_budget_s=1e-9, measure_memory=False)
    result = run_sweep(cfg, out=tmp_path, command="test", quiet=True)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["rows"] == result["rows"] and saved["command"] == "test"
    assert {"machine", "config", "contenders", "rows", "crossover", "seconds"} <= set(saved)
    by = {(r["impl"], r["mode"], r["pass"], r["n"]): r for r in saved["rows"]}
    assert len(by) == 3 * 2 * 2 * 3  # every (contender, mode, pass, N) has a row, none dropped
    # the first N runs; with a budget of 1 ns the next one is predicted over budget and skipped
    first = by[("linear", "causal", "forward", 64)]
    assert first["status"] == "ok" and first["median_s"] > 0
    skipped = by[("linear", "causal", "forward", 128)]
    assert skipped["status"] == "skipped" and "budget" in skipped["reason"]
    assert by[("efficient", "causal", "forward", 64)]["status"] == "unsupported"
    md = (tmp_path / "sweep.md").read_text()
    assert "skip" in md and "overtakes softmax" in md
    for name in ("sweep_time.png", "sweep_memory.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_sweep_measures_memory_and_crossover_logic(tmp_path):
    from linattn.bench.sweep import SweepConfig, crossovers, run_sweep

    cfg = SweepConfig(mechanisms=_defaults("softmax", "linear"), peers=(), ns=(64,), repeats=1, n_heads=2, head_dim=8,
                      modes=("bidirectional",), passes=("forward",))
    row = run_sweep(cfg, out=tmp_path, quiet=True)["rows"][0]
    assert row["status"] == "ok" and isinstance(row["peak_memory_bytes"], int)
    rows = [{"impl": i, "mode": "m", "pass": "p", "n": n, "status": "ok", "median_s": t}
            for i, n, t in [("softmax", 1, 1.0), ("softmax", 2, 2.0), ("softmax", 4, 8.0),
                            ("a", 1, 2.0), ("a", 2, 1.0), ("a", 4, 3.0), ("b", 1, 3.0), ("b", 2, 3.0), ("b", 4, 9.0),
                            ("c", 1, 0.5), ("c", 2, 0.5), ("c", 4, 0.5)]]
    assert crossovers(rows) == {"m p": {"a": 2, "b": "never", "c": "always"}}


def test_cli_bench_without_suite_is_the_sweep(monkeypatch, tmp_path):
    import linattn.bench.sweep as sweep

    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda config, **kw: seen.update(config=config, **kw))
    monkeypatch.chdir(tmp_path)  # the default --out, report/, is created before any work
    assert main(["bench"]) == 0
    assert seen["config"] == sweep.SweepConfig() and seen["out"] == "report"


def test_cli_sweep_flags_reach_the_config(monkeypatch, tmp_path):
    import linattn.bench.sweep as sweep
    from linattn.nn import LocalConfig

    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda config, **kw: seen.update(config=config, **kw))
    argv = ["bench", "sweep", "--mechanisms", '["linear", {"name": "local", "window": 64}]', "--peers", "none",
            "--ns", "32,64", "--passes", "forward", "--modes", "causal", "--n-heads", "2", "--head-dim", "8",
            "--time-budget-s", "3", "--memory-budget-gib", "0.5", "--out", str(tmp_path / "x")]
    assert main(argv) == 0
    config = seen["config"]
    assert config.mechanisms == (MECHANISMS["linear"].default_config(), LocalConfig(window=64))
    assert list(config.contenders()) == ["linear", "local window=64"]  # no peers
    assert (config.ns, config.passes, config.modes, config.n_heads, config.head_dim) == ((32, 64), ("forward",),
                                                                                       ("causal",), 2, 8)
    assert config.time_budget_s == 3 and config.memory_budget_bytes == 2**29 and config.measure_memory is True
    assert seen["out"] == str(tmp_path / "x") and seen["command"].startswith("linattn bench sweep --mechanisms")
    assert sweep.SweepConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config  # what sweep.json holds
    assert main(["bench", "sweep", "--no-measure-memory", "--out", str(tmp_path / "x")]) == 0
    assert seen["config"].measure_memory is False


@pytest.mark.parametrize("argv, flag, hint", [
    (["bench", "sweep", "--mechanisms", "locl"], "--mechanisms", "did you mean 'local'"),
    (["bench", "sweep", "--passes", "forwrd"], "--passes", "did you mean 'forward'"),
    (["bench", "sweep", "--peers", "fast_transformer"], "--peers", "did you mean 'fast_transformers'"),
    (["bench", "generate", "--mechanisms", "linaer,softmax"], "--mechanisms", "did you mean 'linear'"),
    (["bench", "favor", "--what", "aprox"], "--what", "did you mean 'approx'"),
])
def test_cli_bench_names_the_flag_and_the_closest_name(capsys, argv, flag, hint):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert info.value.code == 2 and len(errors) == 1  # one line says what is wrong
    assert flag in errors[0] and hint in errors[0], err


def test_cli_generate_validation_errors_are_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "generate", "--mechanisms", "efficient,linear,softmax"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1  # no usage, no traceback
    assert err.startswith("linattn bench generate: error: --mechanisms: efficient has no recurrent form")


def test_every_registered_mechanism_is_a_sweep_contender_in_its_registry_forms(monkeypatch, tmp_path):
    """The sweep reads its mechanisms from the registry: a new entry (here a bidirectional-only
    copy of local attention with its own config type) is swept in the forms its spec gives it,
    with its registry defaults recorded, without a change to the benchmark code."""
    import dataclasses

    import linattn.nn.registry as registry
    from linattn.bench.sweep import SweepConfig, run_sweep
    from linattn.nn import LocalConfig

    @dataclasses.dataclass(frozen=True)
    class NarrowLocalConfig(LocalConfig):
        window: int = 8

    spec = dataclasses.replace(registry.MECHANISMS["local"], name="narrow_local", config_type=NarrowLocalConfig,
                               forms=frozenset({"bidirectional"}), state_type=None)
    monkeypatch.setitem(registry.MECHANISMS, "narrow_local", spec)
    config = SweepConfig(peers=(), ns=(64,), passes=("forward",), repeats=1, n_heads=2, head_dim=8,
                         measure_memory=False)
    assert list(config.contenders()) == list(registry.MECHANISMS)  # every one, each by its name
    result = run_sweep(config, out=tmp_path, command="test", quiet=True)
    saved = json.loads((tmp_path / "sweep.json").read_text())
    for name, s in registry.MECHANISMS.items():
        for mode in ("causal", "bidirectional"):
            (row,) = [r for r in result["rows"] if (r["impl"], r["mode"]) == (name, mode)]
            assert row["status"] == ("ok" if mode in s.forms else "unsupported"), row
        # the recorded config is the registry default: the sweep states no other
        assert saved["attention"][name] == attention_config_to_dict(s.default_config())
    assert saved["attention"]["narrow_local"] == {"name": "narrow_local", "window": 8}


def test_sweep_shows_progress_on_a_terminal_only(monkeypatch, tmp_path, capsys):
    import sys

    from linattn.bench.sweep import SweepConfig, run_sweep

    config = SweepConfig(mechanisms=_defaults("linear"), peers=(), ns=(32, 64), passes=("forward",),
                         modes=("causal",), repeats=1, n_heads=2, head_dim=8, measure_memory=False)
    run_sweep(config, out=tmp_path, command="test")
    captured = capsys.readouterr()
    assert captured.err == "" and "| linear |" in captured.out  # no terminal: no bar, the tables still printed
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    run_sweep(config, out=tmp_path, command="test", print_tables=False)
    captured = capsys.readouterr()
    assert "sweep" in captured.err and "2/2" in captured.err and "causal forward N=64: linear" in captured.err
    assert captured.out == ""


def test_generate_benchmark_tiny(tmp_path):
    """A tiny `bench generate`, twice in fresh processes: every run's data is kept, the summary is
    the median over the runs, and the Markdown has a row per run for the machine."""
    main(["bench", "generate", "--positions", "5,40", "--steps", "3", "--d-model", "16", "--n-layers", "2",
          "--n-heads", "2", "--vocab-size", "50", "--image-batch", "2", "--image-d-model", "16", "--image-n-layers", "1",
          "--runs", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "generate.json").read_text())
    assert saved["command"].startswith("linattn bench generate --positions 5,40 --steps 3")
    assert saved["command"].endswith(f"--runs 2 --out {tmp_path}") and saved["config"]["runs"] == 2
    recurrent = [s for s in MECHANISMS.values() if s.recurrent]  # every registered decoder, by default
    decoders = {f"{m}@{p}" for m in [s.name for s in recurrent] + ["softmax-recompute"] for p in (5, 40)}
    assert set(saved["seconds_per_token"]) == decoders
    # each decoder's config as recorded is the registry's default: generate states no other
    assert saved["config"]["mechanisms"] == {s.name: attention_config_to_dict(s.default_config()) for s in recurrent}
    runs = [r["allocators"]["inherited"] for r in saved["runs"]]
    assert len(runs) == 2
    for key in decoders:
        assert saved["seconds_per_token"][key] == pytest.approx(_median([r["seconds_per_token"][key] for r in runs]))
    for r in runs:
        assert all(len(v) == 3 for k, v in r["all_seconds"].items() if "recompute" not in k)
        sizes = r["state_bytes_after_prefill"]
        assert sizes["softmax@40"] == 8 * sizes["softmax@5"]  # the KV cache grows with position
        assert sizes["favor@40"] == sizes["favor@5"]  # a recurrent state does not
        assert r["read_rates"]["weights, matrix-vector products alone (GB/s)"] > 0
        assert set(r["images"]["seconds"]) == {"linear (recurrent)", "favor (recurrent)", "softmax (KV cache)",
                                               "softmax (recompute prefix)"}
    assert saved["claim"]["linear state size independent of position"] is True
    ratio = saved["ratios"]["softmax@40 / linear@40"]
    assert ratio["runs"] == pytest.approx([r["seconds_per_token"]["softmax@40"] / r["seconds_per_token"]["linear@40"]
                                           for r in runs])
    assert saved["claim"]["softmax@40 / linear@40"] == ratio["median"]
    images = saved["images"]
    assert set(images["images_per_second"]) == {"linear (recurrent)", "favor (recurrent)", "softmax (KV cache)",
                                                "softmax (recompute prefix)"}
    assert images["config"]["pixels"] == 784 and images["config"]["batch"] == 2
    md = (tmp_path / "generate.md").read_text()
    assert "| linear | 40 |" in md and "| softmax-recompute | 40 |" in md and "softmax (recompute prefix)" in md
    assert "The whole measurement ran 2 times" in md and "| 2 | " in md  # the second run's machine


def test_generate_benchmark_times_compiled_steps(tmp_path):
    main(["bench", "generate", "--positions", "5,40", "--steps", "2", "--d-model", "16", "--n-layers", "1",
          "--n-heads", "2", "--vocab-size", "50", "--mechanisms", "linear,softmax", "--no-recompute", "--image-batch", "0",
          "--compile", "--runs", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "generate.json").read_text())
    assert saved["command"].endswith(f"--compile --runs 1 --out {tmp_path}") and saved["config"]["compile"] is True
    assert set(saved["seconds_per_token"]) == {f"{m}{c}@{p}" for m in ("linear", "softmax")
                                               for c in ("", "+compile") for p in (5, 40)}
    # each decoder stepped from its own copy of the prefilled state: the same positions reached
    sizes = saved["runs"][0]["allocators"]["inherited"]["state_bytes_after_steps"]
    assert sizes["softmax+compile@40"] == sizes["softmax@40"] and sizes["linear+compile@5"] == sizes["linear@5"]
    assert "softmax+compile@40 / linear+compile@40" in saved["claim"]
    assert "| linear+compile | 40 |" in (tmp_path / "generate.md").read_text()


def _generate_mechanisms(*names):
    """What bench generate hands its child: ``{label: attention config dict}``."""
    return {config_label(c): attention_config_to_dict(c) for c in _defaults(*names)}


def _median(xs):
    import statistics

    return statistics.median(xs)


def test_generate_decides_its_claims_on_the_median_run_not_the_best(monkeypatch, tmp_path):
    """`bench generate --compile` with each run's child injected (one real tiny run as the template,
    its times replaced): every ratio's min / median / max come from the runs' own ratios, and each
    verdict follows the median, which here is never the best run."""
    import copy

    import linattn.bench.generate as generate
    import linattn.bench.harness as harness

    template = generate._measure(positions=[5, 40], steps=2, warmup=1, d_model=16, n_layers=1, n_heads=2,
                                 vocab_size=50, mechanisms=_generate_mechanisms("linear", "softmax"),
                                 recompute=False, recompute_budget_s=1.0, image_batch=1, image_d_model=16, image_n_layers=1,
                                 compile=False)
    # per run 1, 2, 3; the best run is never the median, and each verdict differs from the best run's
    flat = [1.0, 1.5, 1.4]  # linear@40 / linear@5: median 1.4 > 1.3 (best 1.0 would hold)
    faster = [6.0, 3.0, 4.0]  # softmax@40 / linear@40: median 4.0 < 5 (best 6.0 would hold)
    faster_compiled = [4.0, 7.0, 5.5]  # median 5.5 >= 5 (the worst run, 4.0, would not hold)
    kv_over_linear = [2.0, 1.0, 1.5]  # images: softmax (KV cache) time / linear's
    calls = []

    def child(module, args, env):
        calls.append((module, args, env))
        i = len(calls) - 1
        run = copy.deepcopy(template)
        for table in ("seconds_per_token", "prefill_seconds", "state_bytes_after_prefill", "state_bytes_after_steps"):
            run[table].update({k.replace("@", "+compile@"): v for k, v in run[table].items()})
        lin40, clin40 = 0.010 * flat[i], 0.008 * 1.2
        run["seconds_per_token"].update({
            "linear@5": 0.010, "linear@40": lin40, "softmax@5": 0.010, "softmax@40": lin40 * faster[i],
            "linear+compile@5": 0.008, "linear+compile@40": clin40, "softmax+compile@40": clin40 * faster_compiled[i]})
        run["images"]["seconds"].update({"linear (recurrent)": 0.5, "softmax (KV cache)": 0.5 * kv_over_linear[i]})
        return run

    monkeypatch.setattr(harness, "run_child", child)
    result = generate.run_generate(out=tmp_path, positions=(5, 40), steps=2, d_model=16, n_layers=1, n_heads=2,
                                   vocab_size=50, mechanisms=_defaults("linear", "softmax"), recompute=False, image_batch=1,
                                   image_d_model=16, image_n_layers=1, compile=True, runs=3, quiet=True)
    assert [(m, a[0], e) for m, a, e in calls] == [("linattn.bench.generate", "child", {})] * 3  # a fresh child each
    spec = json.loads(calls[0][1][1])
    assert spec["compile"] is True and spec["positions"] == [5, 40] and spec["image_batch"] == 1
    saved = json.loads((tmp_path / "generate.json").read_text())
    md = (tmp_path / "generate.md").read_text()
    assert result["claim"] == saved["claim"] and len(saved["runs"]) == 3
    for key, per_run in {"linear@40 / linear@5": flat, "softmax@40 / linear@40": faster,
                         "softmax+compile@40 / linear+compile@40": faster_compiled}.items():
        s = saved["ratios"][key]
        assert s["runs"] == pytest.approx(per_run)
        assert {k: s[k] for k in ("min", "median", "max")} == pytest.approx(_spread_of(per_run))
        assert saved["claim"][key] == pytest.approx(_spread_of(per_run)["median"])  # the median, not the best
        assert (f"| {key} | {s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x | "
                + ", ".join(f"{x:.2f}x" for x in per_run) + " |") in md
    verdicts = {"linear@40 within 1.3x of linear@5": False,
                "linear at least 5x faster than softmax (KV cache) at 40": False,
                "linear+compile@40 within 1.3x of linear+compile@5": True,
                "linear+compile at least 5x faster than softmax+compile (KV cache) at 40": True}
    for key, holds in verdicts.items():
        assert saved["claim"][key] is holds
        assert f"| {key} | {'holds' if holds else 'does NOT hold'} |" in md
    assert saved["seconds_per_token"]["softmax@40"] == pytest.approx(0.056)  # median of 0.060, 0.045, 0.056
    assert "| softmax | 40 | 56.00 | 60.00, 45.00, 56.00 |" in md
    speed_up = saved["images"]["linear speed-up"]["softmax (KV cache)"]
    assert speed_up["runs"] == pytest.approx(kv_over_linear) and speed_up["median"] == pytest.approx(1.5)
    assert "| softmax (KV cache) | 0.75 | 1.00, 0.50, 0.75 |" in md and "| 1.5x | 1.0x | 2.0x |" in md
    for i, run in enumerate(saved["runs"], 1):  # each run's load and reference matmul speed, start → end
        ref = run["load"]["reference_gflops"]
        assert f"| {i} | " in md and f" | {ref['start']:.0f} → {ref['end']:.0f} |" in md
        assert run["allocators"]["inherited"]["read_rates"] == template["read_rates"]  # every run's data kept


def test_generate_state_size_claim_must_hold_in_every_run(monkeypatch, tmp_path):
    import copy

    import linattn.bench.generate as generate
    import linattn.bench.harness as harness

    template = generate._measure(positions=[3, 6], steps=1, warmup=0, d_model=8, n_layers=1, n_heads=2,
                                 vocab_size=20, mechanisms=_generate_mechanisms("linear", "softmax"),
                                 recompute=False, recompute_budget_s=1.0, image_batch=0, image_d_model=8, image_n_layers=1,
                                 compile=False)
    calls = []

    def child(module, args, env):
        calls.append(module)
        run = copy.deepcopy(template)
        if len(calls) == 2:  # one run out of three grew the linear state
            run["state_bytes_after_steps"]["linear@6"] += 4
        return run

    monkeypatch.setattr(harness, "run_child", child)
    result = generate.run_generate(out=tmp_path, positions=(3, 6), steps=1, d_model=8, n_layers=1, n_heads=2,
                                   vocab_size=20, mechanisms=_defaults("linear", "softmax"), recompute=False, runs=3,
                                   quiet=True)
    assert result["claim"]["linear state size independent of position"] is False


def test_generate_recompute_matches_generate():
    """The recompute-prefix baseline samples the same tokens as cached decoding (same draws)."""
    from linattn.bench.generate import generate_recompute
    from linattn.models import TransformerConfig, TransformerLM
    from linattn.nn import SoftmaxConfig

    torch.manual_seed(0)
    lm = TransformerLM(TransformerConfig(vocab_size=20, max_len=40, d_model=16, n_layers=2, n_heads=2,
                                         attention=SoftmaxConfig(), positional="sinusoidal")).eval()
    prompt = torch.randint(0, 20, (3, 4))
    a = lm.generate(prompt, 12, generator=torch.Generator().manual_seed(1))
    b = generate_recompute(lm, prompt, 12, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_generate_benchmark_rejects_bad_mechanisms(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--mechanisms", "favor,softmax", "--positions", "5", "--steps", "1"])
    assert "must include 'linear'" in capsys.readouterr().err


def test_full_writes_the_document_from_its_own_files(tmp_path):
    """`linattn bench full` on a tiny grid: sweep and generation files, then the document built
    from them; `--doc-only` rebuilds the same document without measuring."""
    from linattn.bench.full import run_full
    from linattn.bench.sweep import SweepConfig

    out, doc = tmp_path / "full", tmp_path / "benchmarks.md"
    config = SweepConfig(mechanisms=_defaults("softmax", "linear", "efficient"), peers=(), ns=(32, 64), repeats=1,
                         measure_memory=False)
    text = run_full(out=out, doc=doc, sweep_config=config, quiet=True,
                    generate_kwargs={"positions": (3, 6), "steps": 2, "d_model": 16, "n_layers": 1, "n_heads": 2,
                                     "vocab_size": 30, "image_batch": 1, "image_d_model": 16, "image_n_layers": 1,
                                     "compile": False, "runs": 2})
    assert doc.read_text() == text
    for name in ("sweep.json", "sweep.md", "sweep_time.png", "generate.json", "generate.md"):
        assert (out / name).exists(), name
    sweep = json.loads((out / "sweep.json").read_text())
    linear64 = next(r for r in sweep["rows"] if (r["impl"], r["mode"], r["pass"], r["n"]) ==
                    ("linear", "causal", "forward", 64))
    assert f"{linear64['median_s'] * 1e3:.1f} ms" in text  # the tables come from the files
    assert "![time against N](full/sweep_time.png)" in text
    assert "| efficient | - | - |" in text  # no causal form: shown, not dropped
    assert "### Images per second" in text and "Where linear attention loses" in text
    assert "Generation: 2 runs" in text and "The whole measurement ran 2 times" in text
    assert run_full(out=out, doc=doc, doc_only=True, quiet=True) == text
    # a generate.json as written before the runs were repeated: one run's fields at the top level
    gen = json.loads((out / "generate.json").read_text())
    first = gen["runs"][0]
    single = {**first["allocators"]["inherited"], "command": gen["command"], "machine": gen["machine"],
              "config": {k: v for k, v in gen["config"].items() if k != "runs"}, "load": first["load"]}
    del single["env"]
    (out / "generate.json").write_text(json.dumps(single))
    old_text = run_full(out=out, doc=doc, doc_only=True, quiet=True)
    assert "Generation: 1 run" in old_text and "it holds one run" in old_text
    ratio = single["seconds_per_token"]["softmax@6"] / single["seconds_per_token"]["linear@6"]
    assert f"| softmax@6 / linear@6 | {ratio:.2f}x | {ratio:.2f}x | {ratio:.2f}x | {ratio:.2f}x |" in old_text
    with pytest.raises(FileNotFoundError, match="sweep.json"):
        run_full(out=tmp_path / "empty", doc=doc, doc_only=True, quiet=True)


def test_full_doc_only_reads_a_generate_file_from_before_the_runs(tmp_path):
    """The committed full/generate.json is a single-run file (no `runs`): `--doc-only` reads it as
    one run and says so; a file that is no generate result at all is refused by name."""
    import shutil
    from pathlib import Path

    from linattn.bench.full import run_full

    committed = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "full"
    old = json.loads((committed / "generate.json").read_text())
    if "runs" in old:
        pytest.skip("docs/benchmarks/full/generate.json has been rewritten in the repeated form")
    out, doc = tmp_path / "full", tmp_path / "benchmarks.md"
    out.mkdir()
    for name in ("sweep.json", "generate.json"):
        shutil.copy(committed / name, out / name)
    text = run_full(out=out, doc=doc, doc_only=True, quiet=True)
    assert "Generation: 1 run, " in text and "it holds one run" in text
    key = next(k for k in old["claim"] if k.startswith("softmax@") and "compile" not in k)
    v = old["claim"][key]
    assert f"| {key} | {v:.2f}x | {v:.2f}x | {v:.2f}x | {v:.2f}x |" in text  # the one run's ratio, as written
    (out / "generate.json").write_text(json.dumps({"command": "something else"}))
    with pytest.raises(ValueError, match="generate.json is not a result of linattn bench generate"):
        run_full(out=out, doc=doc, doc_only=True, quiet=True)


def test_other_load_separates_our_cpu_time_from_other_processes():
    import os
    import subprocess
    import sys
    import time

    from linattn.bench.harness import OtherLoad, describe_load

    load = OtherLoad()
    # A process we do not reap before finish() is "other"; our own busy loop is not. Both spin for
    # CPU time, not wall time, so that a busy machine cannot shorten them.
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    t0 = time.process_time()
    while time.process_time() - t0 < 0.5:
        pass
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, but not reaped: not our child time yet
    r = load.finish()
    child.wait()
    assert r["own_cpu_seconds"] >= 0.4
    assert r["other_cpu_seconds"] >= 0.8  # the child's busy second (plus whatever else ran)
    assert 0 < r["other_cpu_share"] <= 1
    assert "busy" in describe_load({"other_cpu_share": 0.5})
    assert "quiet" in describe_load({"other_cpu_share": 0.01})
    assert "not recorded" in describe_load(None)


def _spread_of(xs):
    xs = sorted(xs)
    return {"min": xs[0], "median": xs[len(xs) // 2], "max": xs[-1]}


def test_core_runs_three_times_and_states_the_median_ratio(tmp_path):
    """A tiny `bench core` (no peers): every run in its own processes with its own load; each
    ratio's min / median / max come from the runs' own ratios, and the claims name the median."""
    from linattn.bench.core import run_core

    result = run_core(out=tmp_path, n=32, repeats=1, runs=3, quiet=True)
    saved = json.loads((tmp_path / "core.json").read_text())
    assert saved["command"] == f"linattn bench core --n 32 --repeats 1 --out {tmp_path}"  # 3 = the default
    assert saved["config"]["runs"] == 3 and len(saved["runs"]) == 3
    md = (tmp_path / "core.md").read_text()
    for run in saved["runs"]:
        assert set(run["allocators"]) == {"default", "tuned"}
        ref = run["load"]["reference_gflops"]
        assert ref["start"] > 0 and ref["end"] > 0 and 0 <= run["load"]["other_cpu_share"] <= 1
        assert f"| {ref['start']:.0f} → {ref['end']:.0f} |" in md  # each run's machine speed
    for alloc in ("default", "tuned"):
        per_run = [r["allocators"][alloc]["times"]["causal"]["softmax_sdpa"]["median_s"]
                   / r["allocators"][alloc]["times"]["causal"]["linattn"]["median_s"] for r in saved["runs"]]
        s = saved["ratios"][alloc]["causal"]["softmax_sdpa"]
        assert s["runs"] == pytest.approx(per_run)
        assert {k: s[k] for k in ("min", "median", "max")} == pytest.approx(_spread_of(per_run))
        claim = saved["claims"][f"{alloc} causal softmax_sdpa"]
        assert f"{s['median']:.2f}x, the median of 3 runs (min {s['min']:.2f}x, max {s['max']:.2f}x)" in claim
        assert f"- {claim}" in md
        assert (f"| {alloc} | causal | softmax_sdpa | {s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x | "
                + ", ".join(f"{x:.2f}x" for x in per_run) + " |") in md
    assert saved["step_s"]["default"]["100"]["median"] > 0 and len(saved["step_s"]["tuned"]["60000"]["runs"]) == 3
    assert result["ratios"] == saved["ratios"]


def test_favor_speed_runs_three_times_and_states_the_median_ratio(monkeypatch, tmp_path):
    """`bench favor --what speed` with each child's timings injected (performer-pytorch is a peer the
    tests do not need): one child per run and allocator, the claim by the median run, not the best."""
    import dataclasses

    import linattn.bench.favor as favor
    import linattn.bench.harness as harness

    # performer-pytorch / linattn in runs 1, 2, 3: the best run (5x) is not the median (4x)
    ratios = {("default", "causal"): [5.0, 2.0, 4.0], ("default", "bidirectional"): [1.5, 1.2, 1.4],
              ("tuned", "causal"): [3.0, 3.5, 2.5], ("tuned", "bidirectional"): [0.5, 0.6, 0.4]}
    calls = []

    def child(module, args, env):
        alloc = "tuned" if env else "default"
        run = sum(1 for c in calls if c == alloc)
        calls.append(alloc)
        assert module == "linattn.bench.favor" and args[:5] == ["child", "64", "1", "8", "64"]
        assert json.loads(args[5]) == attention_config_to_dict(linattn.nn.FavorConfig(num_features=256))
        return {"times": {mode: {"linattn": {"median_s": 0.1, "all_s": [0.1]},
                                 "performer_pytorch": {"median_s": 0.1 * ratios[alloc, mode][run], "all_s": [0.0]}}
                          for mode in ("causal", "bidirectional")}}

    monkeypatch.setattr(harness, "run_child", child)
    monkeypatch.setattr(favor, "peak_memory", lambda case: 2**20)
    monkeypatch.setitem(harness.PEERS, "performer_pytorch",
                        dataclasses.replace(harness.PEERS["performer_pytorch"], available=lambda: True))
    favor.run_favor(out=tmp_path, what=("speed",), n=64, repeats=1, runs=3, quiet=True)
    assert calls == ["default", "tuned"] * 3  # allocators interleaved run by run
    saved = json.loads((tmp_path / "favor_speed.json").read_text())
    md = (tmp_path / "favor_speed.md").read_text()
    assert saved["config"]["runs"] == 3 and len(saved["runs"]) == 3
    for (alloc, mode), per_run in ratios.items():
        s = saved["ratios"][alloc][mode]["performer_pytorch"]
        assert s["runs"] == pytest.approx(per_run)
        assert {k: s[k] for k in ("min", "median", "max")} == pytest.approx(_spread_of(per_run))
        assert (f"| {alloc} | {mode} | {s['median']:.2f}x | {s['min']:.2f}x | {s['max']:.2f}x | "
                + ", ".join(f"{x:.2f}x" for x in per_run) + " |") in md
    claim = saved["claims"]["default causal"]
    assert claim == ("causal, default malloc: linattn is faster than performer-pytorch by 4.00x, the median of 3 "
                     "runs (min 2.00x, max 5.00x)") and f"- {claim}" in md
    assert saved["claims"]["tuned bidirectional"] == ("bidirectional, tuned malloc: performer-pytorch / linattn time "
                                                      "0.50x, the median of 3 runs (min 0.40x, max 0.60x): linattn is slower")
    assert "| default | causal | linattn | 100 ms | 100 ms, 100 ms, 100 ms | 1 MiB |" in md
    assert "| tuned | causal | performer_pytorch | 300 ms | 300 ms, 350 ms, 250 ms | - |" in md
    for i, run in enumerate(saved["runs"], 1):  # each run's load and reference matmul speed, start → end
        ref = run["load"]["reference_gflops"]
        assert f"| {i} | " in md and f" | {ref['start']:.0f} → {ref['end']:.0f} |" in md


def test_favor_speed_without_performer_fails_before_any_part(monkeypatch, tmp_path):
    import linattn.bench.favor as favor

    monkeypatch.setattr(favor, "approximation_errors", lambda *a, **k: pytest.fail("the approximation part ran"))
    if not favor.PEERS["performer_pytorch"].available():
        with pytest.raises(RuntimeError, match="needs performer-pytorch"):
            favor.run_favor(out=tmp_path, what=("approx", "speed"), quiet=True)
    with pytest.raises(ValueError, match="runs must be >= 1"):
        favor.run_favor(out=tmp_path, what=("approx", "speed"), runs=0, quiet=True)


@pytest.mark.parametrize("suite", ["core", "sweep", "full"])
def test_a_missing_peer_does_not_replace_its_committed_comparison(monkeypatch, tmp_path, suite):
    """`bench core`, `bench sweep` and `bench full` (whose sweep part it is) refuse, before any
    work, to replace a result that compared with a peer that is not installed here; a result
    without that peer, or a peer installed (left out on purpose or not), lets the run go on."""
    import dataclasses

    import linattn.bench.core as core
    import linattn.bench.full as full
    import linattn.bench.harness as harness
    import linattn.bench.sweep as sweep

    name = "core.json" if suite == "core" else "sweep.json"
    old = ({"runs": [{"allocators": {"default": {"times": {"causal": {"linattn": {}, "fast_transformers": {}}}}}}]}
           if suite == "core" else {"contenders": {"linear": "linattn linear", "fast_transformers": "a peer"}})
    (tmp_path / name).write_text(json.dumps(old))
    monkeypatch.setitem(harness.PEERS, "fast_transformers",
                        dataclasses.replace(harness.PEERS["fast_transformers"], available=lambda: False))

    def start():
        if suite == "core":
            return core.run_core(out=tmp_path, n=32, repeats=1, runs=1, quiet=True)
        config = sweep.SweepConfig(mechanisms=(), ns=(8,), measure_memory=False)
        if suite == "sweep":
            return sweep.run_sweep(config, out=tmp_path, quiet=True)
        return full.run_full(out=tmp_path, doc=tmp_path / "doc.md", sweep_config=config, quiet=True)

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(core, "run_repeated", started)
    monkeypatch.setattr(sweep, "OtherLoad", started)  # the sweep's first step of work
    with pytest.raises(RuntimeError, match=rf"{tmp_path / name} compares with fast_transformers, which is not "
                                           r"installed here.*--out"):
        start()
    assert json.loads((tmp_path / name).read_text()) == old and sorted(p.name for p in tmp_path.iterdir()) == [name]
    # the same file without the peer: the run starts
    (tmp_path / name).write_text(json.dumps({"contenders": {"linear": "x"}} if suite != "core" else {"runs": []}))
    with pytest.raises(Started):
        start()
    # the peer installed: the run starts over its comparison
    (tmp_path / name).write_text(json.dumps(old))
    monkeypatch.setitem(harness.PEERS, "fast_transformers",
                        dataclasses.replace(harness.PEERS["fast_transformers"], available=lambda: True))
    with pytest.raises(Started):
        start()
    (tmp_path / name).write_text("{not json")
    with pytest.raises(RuntimeError, match="cannot read .* move it away or write elsewhere with --out"):
        start()


def test_busy_reasons_from_the_load_and_the_reference_drift():
    from linattn.bench.harness import REFERENCE_DRIFT, OtherLoad, busy_reasons, describe_load

    quiet = {"other_cpu_share": OtherLoad.QUIET / 2, "reference_gflops": {"start": 200.0, "end": 200.0 * 0.9}}
    assert busy_reasons(quiet) == [] and busy_reasons(None) == [] and "A quiet machine." in describe_load(quiet)
    loaded = {**quiet, "other_cpu_share": OtherLoad.QUIET * 2}
    assert len(busy_reasons(loaded)) == 1 and "more than 10%" in busy_reasons(loaded)[0]
    for start, end in ((200.0, 200.0 * REFERENCE_DRIFT * 0.95), (200.0 * REFERENCE_DRIFT * 0.95, 200.0)):
        drift = {**quiet, "reference_gflops": {"start": start, "end": end}}  # a slow spell at either end
        assert len(busy_reasons(drift)) == 1 and "The machine was busy" in describe_load(drift)


def test_other_load_records_the_machine_speed_when_asked():
    from linattn.bench.harness import OtherLoad, describe_load, reference_gflops

    assert "reference_gflops" not in OtherLoad().finish()
    r = OtherLoad(reference=True).finish()
    assert r["reference_gflops"]["start"] > 0 and r["reference_gflops"]["end"] > 0
    # 512^3 * 2 flops in well under a second on any machine this runs on, and not absurdly fast
    assert 0.5 < reference_gflops(0.05) < 1e5
    text = describe_load({"other_cpu_share": 0.01, "reference_gflops": {"start": 150.0, "end": 75.0}})
    assert "150 GFLOP/s at the start and 75 at the end" in text


@pytest.mark.parametrize("suite,target", [("core", "linattn.bench.core.run_core"), ("favor", "linattn.bench.favor.run_favor"),
                                          ("family", "linattn.bench.family.run_family"),
                                          ("generate", "linattn.bench.generate.run_generate")])
def test_cli_runs_flag_reaches_the_benchmark(monkeypatch, tmp_path, capsys, suite, target):
    """--runs sets the number of separate runs; without it the benchmark's own default (3) holds;
    0 is refused as a usage error."""
    import importlib

    from linattn.bench.harness import RUNS

    module_name, attr = target.rsplit(".", 1)
    seen = []
    monkeypatch.setattr(importlib.import_module(module_name), attr, lambda **kw: seen.append(kw))
    main(["bench", suite, "--out", str(tmp_path), "--runs", "5"])
    main(["bench", suite, "--out", str(tmp_path)])
    assert seen[0]["runs"] == 5 and seen[1].get("runs", RUNS) == RUNS == 3
    with pytest.raises(SystemExit) as info:
        main(["bench", suite, "--runs", "0"])
    assert info.value.code == 2 and "--runs" in capsys.readouterr().err
