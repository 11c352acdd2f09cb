"""`linattn bench tensor-cores` (issue 44): the FLOP counter on products of known operand kinds, the
command's files with a row per form, and FLA's recorded figure read from the H200 run's file."""

from __future__ import annotations

import json

import pytest
import torch

from linattn.bench import tensor_cores as bench
from linattn.bench.tensor_cores import product_flops
from linattn.cli import main
from linattn.functional.strategy import mixed_bmm

# ---------------------------------------------------------------------------------------------
# The counter
# ---------------------------------------------------------------------------------------------

M, X, Y, Z = 3, 8, 16, 4
BMM_FLOPS = 2 * M * X * Y * Z


def _operands(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(M, X, Y, generator=g).to(dtype), torch.randn(M, Y, Z, generator=g).to(dtype)


def test_a_float32_bmm_is_all_full():
    a, b = _operands()
    assert product_flops(lambda: torch.bmm(a, b)) == (0, BMM_FLOPS)


def test_a_bf16_bmm_is_all_half():
    a, b = _operands(torch.bfloat16)
    flops = product_flops(lambda: torch.bmm(a, b))
    assert flops == (BMM_FLOPS, 0) and flops.half_share == 1.0


def test_mixed_bmm_on_a_cpu_is_all_half():
    """On a CPU mixed_bmm multiplies the rounded operands in float32: a float32 bmm, counted as half
    by its label."""
    a, b = _operands()
    flops = product_flops(lambda: mixed_bmm(a, b, torch.bfloat16))
    assert flops == (BMM_FLOPS, 0)
    assert product_flops(lambda: mixed_bmm(a, b, None)) == (0, BMM_FLOPS)  # no operand dtype: full


def test_in_place_products_count_as_their_out_of_place_forms():
    """torch.profiler gives ``baddbmm_`` and ``addmm_`` no FLOPs: the engines' in-place products (the
    CPU loop's state updates, the accelerator's scan) would vanish from the shares."""
    a, b = _operands()
    c = torch.zeros(M, X, Z)
    assert product_flops(lambda: c.baddbmm_(a, b)) == (0, BMM_FLOPS)
    assert product_flops(lambda: c[0].addmm_(a[0], b[0])) == (0, BMM_FLOPS // M)
    assert product_flops(lambda: c.baddbmm_(a.bfloat16().float(), b)) == (0, BMM_FLOPS)
    h = c.bfloat16()
    assert product_flops(lambda: h.baddbmm_(a.bfloat16(), b.bfloat16())) == (BMM_FLOPS, 0)


def test_a_call_without_products_has_no_share():
    x = torch.randn(8)
    assert product_flops(lambda: x + 1).half_share == 0.0


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def test_bench_tensor_cores_quick_writes_both_files(tmp_path):
    out = tmp_path / "tc"
    argv = ["bench", "tensor-cores", "--quick", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "tensor_cores.json").read_text())
    md = (out / "tensor_cores.md").read_text()
    assert result["complete"] and result["command"] == "linattn " + " ".join(argv)
    assert result["config"]["n"] == bench.QUICK_N and result["commit"]["head"] is not None
    assert [r["form"] for r in result["rows"]] == list(bench.FORMS)
    for row in result["rows"]:
        assert "error" not in row, row
        assert (row["heads"], row["head_dim"]) == (2, 16)
        assert row["accelerator"]["half_share"] > 0, row
        assert row["cpu"]["half_share"] == 0 and row["cpu"]["full_flops"] > 0, row
        # every error is a bf16 rounding's order or below; float32 products lose nearly nothing
        for side in ("accelerator", "cpu"):
            assert 0 < row[side]["error"] < 2e-2, row
        assert row["float32"]["error"] < 1e-5 < row["float32"]["cast_error"], row
        assert f"| `{row['form']}` | 2 x 16 |" in md
    assert "not these inputs" in md  # FLA's figure is said to come from other inputs


def test_fla_figure_is_read_from_the_h200_run(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (
        {"section": "A", "name": "env"},
        {"section": "F", "name": "gdn_prefill_bf16_B1_N16384_H16_D128", "fla_err_vs_fp64": 7e-3,
         "linattn_err_vs_fp64": 3e-3},
        {"section": "F", "name": "gdn_prefill_bf16_B1_N4096_H16_D128", "fla_err_vs_fp64": 6e-3,
         "linattn_err_vs_fp64": 2e-3},
        {"section": "F", "name": "N65536", "skipped": "budget"},
    )) + "\nnot json\n")
    rows = bench.fla_recorded(path)
    assert [(r["n"], r["heads"], r["head_dim"], r["fla_error"]) for r in rows] == [(4096, 16, 128, 6e-3),
                                                                                    (16384, 16, 128, 7e-3)]
    assert bench.fla_recorded(tmp_path / "missing.jsonl") is None


def test_a_missing_fla_figure_is_said():
    row = {"form": "gated_delta", "n": 4096, "heads": 16, "head_dim": 128,
           "accelerator": {"half_flops": 8, "full_flops": 2, "half_share": 0.8, "error": 4e-3},
           "cpu": {"half_flops": 0, "full_flops": 5, "half_share": 0.0, "error": 2e-3},
           "float32": {"error": 1e-7, "cast_error": 2e-3}}
    result = {"command": "c", "complete": True, "commit": {"head": None}, "fla": {"rows": None}, "rows": [row],
              "machine": {"processor": "p", "cpu_count": 2, "torch": "t"},
              "config": {"n": 4096, "favor_features": 256, "half_share_target": 0.5}}
    md = bench.format_tensor_cores(result)
    assert "not available" in md and "| `gated_delta` | 16 x 128 | 0.800 | 0.000 |" in md


def test_a_bad_n_is_refused(tmp_path):
    with pytest.raises(ValueError, match="n must be a sequence length"):
        bench.run_tensor_cores(tmp_path / "x", n=0)
    assert not (tmp_path / "x").exists()  # refused before any work
