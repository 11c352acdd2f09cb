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
    argv = ["bench", "gpu", "--device", "cpu", "--quick", "--n", "48", "--runs", "1", "--repeats", "1", "--no-fla",
            "--forms", "kda,linear", "--dtype", "float32", "--chunk-sizes", "8", "--sub-chunk-sizes", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["command"] == "linattn " + " ".join(argv)
    assert result["config"]["chunk_sizes"] == [8] and result["config"]["sub_chunk_sizes"] == [2]
    rows = {(r["form"], r["pass"], r["contender"]): r for r in result["rows"]}
    for form, names in (("kda", bench.tunings("kda", (8,), (2,))), ("linear", {"linattn chunk_size=8": {}})):
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
        bench.form_function(spec, chunk_size=4, sub_chunk_size=2)(*x)
    finally:
        bench.delta_rule_attention = real
    assert calls[0]["chunk_size"] == 4 and calls[0]["sub_chunk_size"] == 2
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
