"""`linattn bench gpu` checked on the CPU at its quick sizes: every form timed by linattn, SDPA beside
the kernels, FLA (not installed here) and transformers' path reported as rows, the result files
written with the device, the versions and the command; the device check before any work; the
aggregation of runs into a median and spread."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys

import pytest

from linattn.bench import gpu as bench
from linattn.cli import main

HAS_FLA = importlib.util.find_spec("fla") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_bench_gpu_quick_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gpu"
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--n", "64", "--runs", "2", "--repeats", "1", "--profile",
            "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "gpu.json").read_text())
    md = (out / "gpu.md").read_text()
    assert result["complete"] and result["command"] == "linattn " + " ".join(argv)
    assert result["device"]["type"] == "cpu" and result["versions"]["torch"]
    assert set(result["versions"]) >= {"torch", "cuda", "triton", "fla", "transformers", "linattn"}
    rows = {(r["form"], r["n"], r["pass"], r["contender"]): r for r in result["rows"]}
    assert {key[0] for key in rows} == set(bench.FORMS)
    for form in bench.FORMS:
        for pass_ in bench.PASSES:
            ours = rows[form, 64, pass_, "linattn"]
            if form == bench.MODEL_FORM and not HAS_TRANSFORMERS:
                assert ours["status"] == "not installed"
                continue
            assert ours["status"] == "ok", ours
            assert len(ours["time_s"]["runs"]) == 2 and ours["time_s"]["min"] <= ours["time_s"]["median"]
            assert ours["peak_memory_bytes"] is None  # no allocator statistics on a CPU
            if form != bench.MODEL_FORM:  # softmax at the form's heads and width, the quadratic reference
                assert rows[form, 64, pass_, "sdpa"]["status"] == "ok"
                assert rows[form, 64, pass_, "sdpa"]["ratio_to_linattn"]["median"] > 0
    for name, form in bench.KERNEL_FORMS.items():
        if form.fla is not None and not HAS_FLA:
            row = rows[name, 64, "prefill", "fla"]
            assert row["status"] == "not installed" and "fla" in row["detail"]
    if HAS_TRANSFORMERS:
        # transformers' torch path computes the same function: its prefill agrees with linattn's
        for form in ("gated_delta", "kda", "ssd", bench.MODEL_FORM):
            row = rows[form, 64, "prefill", "transformers"]
            assert row["status"] == "ok" and row["difference_to_linattn"] < 0.05, row
            assert rows[form, 64, "train", "transformers"]["status"] == "ok"
        assert "torch_chunk_gated_delta_rule" in result["transformers_kernels"]
    prof = result["profile"]
    assert prof["n"] == 64 and prof["prefill"]["kernels"] is None
    assert 0 < prof["prefill"]["computing_leaf_aten_ops"] <= prof["prefill"]["leaf_aten_ops"]
    assert prof["train"]["leaf_aten_ops"] > prof["prefill"]["leaf_aten_ops"]
    for name, form in bench.KERNEL_FORMS.items():  # bf16 against float64 from the same values: bf16's rounding
        assert 0 < rows[name, 64, "prefill", "linattn"]["error_to_float64"] < 0.02, name
        train = rows[name, 64, "train", "linattn"]  # every input's gradient, the largest error the row's
        n_inputs = 7 if form.state is not None else 3 + form.delta + (form.decay is not None)
        assert len(train["gradient_errors"]) == n_inputs and train["error_to_float64"] == max(train["gradient_errors"])
        assert 0 < train["error_to_float64"] < 0.05, name
    assert rows["ssd", 64, "train", "transformers"]["error_to_float64"] > 0  # the same inputs: compared too
    judged = {(t["form"], t["n"], t["pass"], t["target"]): t for t in result["targets"]}
    assert len(judged) == len(result["targets"])
    assert judged["gated_delta", 4096, "prefill", "linattn <= 3 ms"]["why"] == "not in this run"
    assert "## Issue 44's targets" in md and "| gated_delta | 4096 | prefill | linattn <= 3 ms |" in md
    assert "| 64 | prefill | linattn |" in md and "| 64 | train | sdpa |" in md and "## `kda`" in md
    assert "a check of the script, not a GPU measurement" in md and "## Profile" in md
    if not HAS_FLA:
        assert "not installed: ModuleNotFoundError: No module named 'fla'" in md


def test_no_fla_leaves_fla_out(tmp_path):
    result = bench.run_gpu(out=tmp_path, device="cpu", quick=True, n=(32,), forms=("delta",), runs=1, repeats=1,
                           fla=False, quiet=True)
    statuses = {(r["pass"], r["contender"]): r["status"] for r in result["rows"]}
    assert statuses == {(p, c): s for p in bench.PASSES for c, s in
                        (("linattn", "ok"), ("fla", "left out"), ("sdpa", "ok"))}
    assert "left out: --no-fla" in (tmp_path / "gpu.md").read_text()


def test_cuda_graphs_are_a_contender_left_out_off_cuda(tmp_path):
    """--cuda-graphs: linattn replayed from CUDA graphs beside it, a row of every kernel form and pass
    (SSD's own subjects too); off CUDA that row says it was left out, and the run goes on. What the
    capture needs of the engines (no host read inside them) is tests/test_probes.py's."""
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--n", "32", "--forms", "delta,ssd", "--runs", "1",
            "--repeats", "1", "--no-fla", "--cuda-graphs", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["config"]["cuda_graphs"] is True and result["command"] == "linattn " + " ".join(argv)
    graphed = {(r["form"], r["pass"]): r for r in result["rows"] if r["contender"] == bench.GRAPHED}
    assert set(graphed) == {(f, p) for f in ("delta", "ssd") for p in bench.PASSES}
    assert all(r == {**r, "status": "left out", "detail": "CUDA graphs need a CUDA device"} for r in graphed.values())
    assert {r["status"] for r in result["rows"] if r["contender"] == "linattn"} == {"ok"}
    assert "--cuda-graphs" in bench._command("o", "cuda", None, bench.FORMS, "bfloat16", 3, 5, True, False, False,
                                             (), (), True)


def test_fla_blocked_makes_fla_unimportable_and_leaves_no_trace():
    if "fla" in sys.modules:
        pytest.skip("fla is imported in this process already")
    with bench._fla_blocked(True):
        with pytest.raises(ImportError):
            importlib.import_module("fla")
    assert "fla" not in sys.modules


def test_cuda_without_cuda_is_one_line_before_any_work(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = tmp_path / "gpu"
    with pytest.raises(SystemExit) as e:
        main(["bench", "gpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("linattn bench gpu: error: --device cuda: CUDA is not available"), err
    assert not out.exists()  # nothing written


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="runs must be >= 1"):
        bench.run_gpu(device="cpu", runs=0)
    with pytest.raises(ValueError, match="forms must be some of"):
        bench.run_gpu(device="cpu", forms=("softmax",))
    with pytest.raises(ValueError, match="only cuda"):
        bench.check_device("meta")
    with pytest.raises(ValueError, match="not a device"):
        bench.check_device("gpu0")


def test_aggregate_is_the_median_of_the_runs_medians():
    s = bench.aggregate([[3.0, 1.0, 2.0], [10.0, 4.0, 5.0], [0.5, 0.7, 9.0]])
    assert s["runs"] == [2.0, 5.0, 0.7]
    assert (s["median"], s["min"], s["max"]) == (2.0, 0.7, 5.0)
    assert bench.aggregate([[1.0, 3.0]])["median"] == 2.0  # an even count: the mean of the middle two
    with pytest.raises(ValueError):
        bench.aggregate([[1.0], []])


def test_an_error_is_a_row_with_its_first_line():
    def broken():
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results\nsecond line")

    import torch

    subjects = {"linattn": bench.Subject(lambda: torch.ones(3), lambda o: o), "fla": bench.Subject(broken),
                "absent": bench.Unavailable("not installed", "ModuleNotFoundError: No module named 'x'")}
    rows = bench.measure(subjects, runs=2, repeats=2, dev=torch.device("cpu"), compare=True)
    assert rows["fla"] == {"status": "error", "detail": "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs "
                                                        "produces incorrect results"}
    assert rows["absent"]["status"] == "not installed"
    assert rows["linattn"]["status"] == "ok" and len(rows["linattn"]["time_s"]["runs"]) == 2


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "gpu", "-h"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: linattn bench gpu")
    assert "--no-fla" in out and "--quick" in out and "--profile" in out and "``" not in out


def test_other_chunk_sizes_are_contenders_beside_the_default(tmp_path):
    """--chunk-sizes / --sub-chunk-sizes: linattn with those knobs, timed beside its defaults, giving
    the same output up to rounding (a knob passed on changes the rounding: the difference is not 0), and
    the knobs reach the function; the sub-chunks
    only where the gate is per key channel; sizes no chosen form takes are refused before any work."""
    import torch

    assert bench.tunings("gated_delta", (32,), (2,)) == {"linattn chunk_size=32": {"chunk_size": 32}}
    assert set(bench.tunings("kda", (32,), (2,))) == {"linattn chunk_size=32", "linattn sub_chunk_size=2",
                                                      "linattn chunk_size=32 sub_chunk_size=2"}
    assert bench.tunings("ssd", (32,)) == {} and bench.tunings(bench.MODEL_FORM, (32,)) == {}
    # solve blocks: the delta rule's, with the default chunk and each chunk size, not crossed with sub-chunks
    assert bench.tunings("gated_delta", (32,), (), (16,)) == {
        "linattn chunk_size=32": {"chunk_size": 32}, "linattn solve_block=16": {"solve_block": 16},
        "linattn chunk_size=32 solve_block=16": {"chunk_size": 32, "solve_block": 16}}
    assert set(bench.tunings("kda", (), (2,), (16,))) == {"linattn sub_chunk_size=2", "linattn solve_block=16"}
    assert bench.tunings("gla_head", (), (), (16,)) == {} and bench.tunings("linear", (), (), (16,)) == {}
    with pytest.raises(ValueError, match=r"solve_blocks \[16\] given, but none of the forms"):
        bench.check_tunings(("linear", "gla_channel"), (), (), (16,))
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--n", "48", "--runs", "1", "--repeats", "1", "--no-fla",
            "--forms", "kda,linear", "--dtype", "float32", "--chunk-sizes", "8", "--sub-chunk-sizes", "2",
            "--solve-blocks", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["command"] == "linattn " + " ".join(argv)
    assert result["config"]["chunk_sizes"] == [8] and result["config"]["sub_chunk_sizes"] == [2]
    assert result["config"]["solve_blocks"] == [4]
    rows = {(r["form"], r["pass"], r["contender"]): r for r in result["rows"]}
    for form, names in (("kda", bench.tunings("kda", (8,), (2,), (4,))), ("linear", {"linattn chunk_size=8": {}})):
        for name in names:
            for pass_ in bench.PASSES:
                assert rows[form, pass_, name]["status"] == "ok" and rows[form, pass_, name]["ratio_to_linattn"]
            assert 0 < rows[form, "prefill", name]["difference_to_linattn"] < 1e-5  # other roundings, same function
    assert "`linattn chunk_size=...`" in (tmp_path / "gpu.md").read_text()
    # the knobs reach the function
    spec = bench.KERNEL_FORMS["kda"]
    calls = []
    real = bench.delta_rule_attention
    try:
        bench.delta_rule_attention = lambda *a, **kw: calls.append(kw) or real(*a, **kw)
        x = bench.make_inputs(spec, 8, 1, 4, dtype=torch.float32, device=torch.device("cpu"))
        bench.form_function(spec, chunk_size=4, sub_chunk_size=2, solve_block=2)(*x)
    finally:
        bench.delta_rule_attention = real
    assert calls[0]["chunk_size"] == 4 and calls[0]["sub_chunk_size"] == 2 and calls[0]["solve_block"] == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "gpu", "--device", "cpu", "--forms", "ssd,gated_delta", "--sub-chunk-sizes", "2",
              "--out", str(tmp_path / "no")])
    assert e.value.code == 2 and not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="chunk_sizes must be distinct integers >= 1"):
        bench.check_tunings(("kda",), (16, 16), ())


def test_ssd_inputs_are_one_draw_in_both_layouts():
    """``make_inputs``' SSD (the engine's layout, for bench launches and tensor-cores) is
    ``ssd_inputs``' Mamba-2 mixer draw (transformers' layout, for bench gpu and transformers): the
    engine on the one equals transformers' signature on the other."""
    import torch

    from linattn.integrations.transformers import ssd

    spec, dev = bench.KERNEL_FORMS["ssd"], torch.device("cpu")
    engine = bench.form_function(spec)(*bench.make_inputs(spec, 40, 3, 8, dtype=torch.float64, device=dev, state=6))
    m = bench.ssd_inputs(40, 3, 8, 6, dtype=torch.float64, device=dev)
    mixer, _ = ssd(m["x"], m["dt"], m["A"], m["B"], m["C"], D=m["D"], dt_bias=m["dt_bias"], dt_softplus=True)
    torch.testing.assert_close(engine.transpose(1, 2), mixer, rtol=1e-12, atol=1e-12)


def test_the_float64_reference_is_the_function_on_the_contenders_values():
    """float64_reference draws the contenders' very inputs again (float32 here, so that the only
    difference left is float32's rounding: other values would differ by O(1)) and computes the
    form's function: the float32 output of each form is within float32's rounding of it, and the
    delta rule's reference is the per-position recurrence's."""
    import torch

    from linattn.functional import delta_rule_attention_reference

    dev = torch.device("cpu")
    for name, form in bench.KERNEL_FORMS.items():
        ref, grads = bench.float64_reference(form, 40, quick=True, dtype=torch.float32, device=dev)
        assert ref.dtype == torch.float64 and all(g.dtype == torch.float64 for g in grads)
        if form.state is not None:
            m = bench.ssd_inputs(40, 2, 16, 16, dtype=torch.float32, device=dev)
            out = bench._ssd(*(m[k] for k in bench.SSD_KEYS))
        else:
            tensors = bench.make_inputs(form, 40, 2, 16, dtype=torch.float32, device=dev)
            out = bench._linattn_fn(form, 16, torch.float32, dev)(*tensors)
        assert bench.relative_error(out, ref) < 1e-5, name
    form = bench.KERNEL_FORMS["gated_delta"]
    q, k, v, beta, g = (t.double() for t in bench.make_inputs(form, 40, 2, 16, dtype=torch.bfloat16, device=dev))
    plain = delta_rule_attention_reference(q, k, v, beta, log_decay=g)
    ref, _ = bench.float64_reference(form, 40, quick=True, dtype=torch.bfloat16, device=dev)
    torch.testing.assert_close(ref, plain, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"out \(2, 3\) and reference \(3,\) differ in shape"):
        bench.relative_error(torch.ones(2, 3), torch.ones(3))


def _timed(median: float, status: str = "ok", **extra) -> dict:
    return {"status": status, "time_s": {"median": median, "min": median, "max": median, "runs": [median] * 3},
            **extra}


def test_targets_are_judged_from_the_rows():
    """Each kind of target from synthetic rows: a time under and over its limit, a ratio taken run by
    run, errors against float64 compared with FLA's, linattn failing (a miss) against another
    contender missing (no verdict), the model against transformers' path without FLA (no verdict),
    settings outside the run (not in this run)."""
    def row(form, n, pass_, contender, **r):
        return {"form": form, "n": n, "pass": pass_, "contender": contender, **r}

    fla_ratio = {"ratio_to_linattn": {"runs": [0.5, 0.25, 0.2]}}  # linattn 2x, 4x, 5x FLA's time: median 4x
    result = {
        "config": {"forms": ["gated_delta", "gla_channel", "kda", "linear", bench.MODEL_FORM], "n": [4096, 16384]},
        "transformers_kernels": {"torch_chunk_gated_delta_rule": "transformers.models.qwen3_5.modeling_qwen3_5.x"},
        "rows": [
            row("gated_delta", 4096, "prefill", "linattn", **_timed(2.9e-3, error_to_float64=3e-3)),
            row("gated_delta", 4096, "prefill", "fla", **_timed(1e-3, error_to_float64=6e-3)),
            row("gated_delta", 16384, "prefill", "linattn", **_timed(4.1e-3, error_to_float64=5e-3)),
            row("gated_delta", 16384, "prefill", "fla", **_timed(1e-3, error_to_float64=4e-3)),
            row("gated_delta", 4096, "train", "linattn", status="error", detail="RuntimeError: boom"),
            row("gla_channel", 4096, "prefill", "linattn", **_timed(4e-3)),
            row("gla_channel", 4096, "prefill", "fla", **_timed(1e-3, **fla_ratio)),
            row("gla_channel", 4096, "train", "linattn", **_timed(4e-3)),
            row("gla_channel", 4096, "train", "fla", status="error", detail="RuntimeError: Triton on Hopper"),
            row("gated_delta", 4096, "prefill", bench.GRAPHED, **_timed(1.5e-3)),
            row("linear", 16384, "prefill", "linattn", **_timed(1e-3)),
            row("linear", 16384, "prefill", "sdpa", **_timed(2e-3, ratio_to_linattn={"runs": [2.0, 1.5, 3.0]})),
            row("linear", 16384, "prefill", bench.GRAPHED, **_timed(5e-4, ratio_to_linattn={"runs": [0.5, 0.5, 0.5]})),
            row("kda", 4096, "train", "linattn", **_timed(0.03, error_to_float64=4e-3)),
            row("kda", 4096, "train", "fla", **_timed(0.01, error_to_float64=2e-3)),
            row(bench.MODEL_FORM, 4096, "prefill", "linattn", **_timed(0.02)),
            row(bench.MODEL_FORM, 4096, "prefill", "transformers", **_timed(0.01, ratio_to_linattn={"runs": [1.0]})),
        ]}
    judged = {(t["form"], t["n"], t["pass"], t["target"]): (t["value"], t["holds"], t["why"])
              for t in bench.targets(result)}
    assert judged["gated_delta", 4096, "prefill", "linattn <= 3 ms"] == ("2.9 ms", True, "")
    graphed = {(t["form"], t["n"], t["pass"], t["target"]): t["graphed"] for t in bench.targets(result)}
    assert graphed["gated_delta", 4096, "prefill", "linattn <= 3 ms"] == "1.5 ms"
    assert graphed["linear", 16384, "prefill", "linattn's time <= 1x that of sdpa"] == "0.25x"  # 0.5 / 2.0 run by run
    assert graphed["gated_delta", 16384, "prefill", "linattn <= 4 ms"] == "-"  # no graphed row there
    assert judged["gated_delta", 16384, "prefill", "linattn <= 4 ms"] == ("4.1 ms", False, "")
    assert judged["gated_delta", 4096, "train", "linattn <= 8 ms"] == ("-", False, "linattn: error: RuntimeError: boom")
    assert judged["gated_delta", 16384, "train", "linattn <= 15 ms"][1:] == (None, "not measured (the run stopped "
                                                                                  "before it)")
    error = "linattn's error against float64 <= that of fla"
    assert judged["gated_delta", 4096, "prefill", error] == ("3.0e-03 vs 6.0e-03", True, "")
    assert judged["gated_delta", 16384, "prefill", error] == ("5.0e-03 vs 4.0e-03", False, "")
    assert judged["kda", 4096, "train", "linattn's largest gradient error against float64 <= that of fla"] == (
        "4.0e-03 vs 2.0e-03", False, "")
    assert judged["kda", 4096, "train", "linattn <= 20 ms"] == ("30 ms", False, "")
    assert not any(k[0] == "ssd" and k[2] == "train" and "error" in k[3] for k in judged)  # FLA's SSD: other inputs
    assert judged["gla_channel", 4096, "prefill", "linattn's time <= 3x that of fla"] == ("4.00x", False, "")
    assert judged["gla_channel", 4096, "train", "linattn's time <= 3x that of fla"] == (
        "-", None, "fla: error: RuntimeError: Triton on Hopper")
    assert judged["linear", 16384, "prefill", "linattn's time <= 1x that of sdpa"] == ("0.50x", True, "")
    assert judged["linear", 65536, "prefill", "linattn's time <= 0.25x that of sdpa"][1:] == (None, "not in this run")
    value, holds, why = judged[bench.MODEL_FORM, 4096, "prefill", "linattn's time <= 2x that of transformers + FLA"]
    assert holds is None and "without FLA's kernel" in why
    result["transformers_kernels"]["torch_chunk_gated_delta_rule"] = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    judged = {(t["form"], t["n"], t["pass"], t["target"]): t["holds"] for t in bench.targets(result)}
    assert judged[bench.MODEL_FORM, 4096, "prefill", "linattn's time <= 2x that of transformers + FLA"] is True
    assert judged["delta", 4096, "prefill", "linattn's error against float64 <= that of fla"] is None  # not in the run


def test_gradient_errors_say_what_they_could_not_compare():
    """A training step's gradients against float64, input by input; an input left without a gradient
    is the row's comparison note, not an error of the run."""
    import torch

    ref = [torch.ones(2, 3, dtype=torch.float64), torch.full((2,), 2.0, dtype=torch.float64)]
    a, b = torch.ones(2, 3, requires_grad=True), torch.ones(2, requires_grad=True)
    (a.sum() * 1.01 + (b * 2).sum()).backward()
    row: dict = {}
    bench._gradient_errors(row, bench.Subject(lambda: None, lambda t: t, [a, b]), ref)
    assert row["gradient_errors"] == pytest.approx([0.01, 0.0], abs=1e-6) and row["error_to_float64"] == max(row["gradient_errors"])
    c = torch.ones(2, requires_grad=True)
    row = {}
    bench._gradient_errors(row, bench.Subject(lambda: None, lambda t: t, [a, c]), ref)
    assert row == {"comparison": "gradients of 1 of 2 inputs, against 2 in the reference"}
