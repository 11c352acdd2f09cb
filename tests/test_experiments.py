"""`linattn experiment`: quick runs train (the loss falls) and write their files; overrides are checked."""

import json

import pytest
import torch

from linattn.cli import main
from linattn.experiments.common import parse_overrides
from linattn.experiments.copy import CopyConfig, copy_batch


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def _trained(rec):
    assert rec["steps_done"] > 0 and not rec["diverged"]
    assert rec["final_train_loss"] < rec["first_loss"], rec
    assert rec["parameters"] > 0 and rec["tokens_per_second"] > 0 and rec["peak_rss_bytes"] >= 0
    assert "other_cpu_share" in rec["load"]


def test_overrides_are_typed_and_checked():
    base = CopyConfig.preset(quick=True)
    c = parse_overrides(base, ["steps=7", "lr=0.01", "contenders=softmax,linear", "out=x"])
    assert (c.steps, c.lr, c.contenders, c.out) == (7, 0.01, ("softmax", "linear"), "x")
    with pytest.raises(ValueError, match="unknown key 'stepz'.*known: .*'steps'"):
        parse_overrides(base, ["stepz=3"])
    with pytest.raises(ValueError, match="steps must be an int"):
        parse_overrides(base, ["steps=many"])
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(base, ["steps"])
    with pytest.raises(ValueError, match="unknown contender 'sofmax'"):
        parse_overrides(base, ["contenders=sofmax"])
    with pytest.raises(ValueError, match="warmup_steps"):
        parse_overrides(base, ["steps=3", "warmup_steps=5"])


def test_cli_rejects_bad_overrides(capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "copy", "--quick", "stepz=3"])
    assert "unknown key 'stepz'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["experiment", "copy", "--quick", "--bogus"])


def test_copy_batches_copy_the_first_half():
    c = CopyConfig.preset(quick=True)
    ids, targets, mask = copy_batch(c, 3)
    L = c.length
    assert ids.shape == targets.shape == mask.shape == (c.batch_size, 2 * L)
    assert (ids[:, L] == c.symbols).all() and torch.equal(targets[:, L:], ids[:, :L])
    assert mask[:, L:].all() and not mask[:, :L].any()
    assert torch.equal(copy_batch(c, 3)[0], ids) and not torch.equal(copy_batch(c, 4)[0], ids)


def test_copy_quick(tmp_path):
    out = tmp_path / "copy"
    assert main(["experiment", "copy", "--quick", "steps=30", "contenders=softmax,linear,lsh", f"out={out}"]) == 0
    s = _summary(out)
    assert s["experiment"] == "copy" and s["quick"] and s["config"]["steps"] == 30
    for name in ("softmax", "linear", "lsh"):
        _trained(s["contenders"][name])
        assert 0 <= s["contenders"][name]["eval"]["copy_accuracy"] <= 1
        assert (out / f"metrics_{name}.jsonl").read_text().count("\n") >= 6
    assert (out / "loss.png").stat().st_size > 1000 and (out / "config.json").exists()
    assert "linear reaches the softmax final loss" in s["targets"]
    # the report is written from these files, and says which experiments have no run
    doc = tmp_path / "results.md"
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc),
                 "--convert-runs", str(tmp_path / "no-conversion-runs")]) == 0
    text = doc.read_text()
    acc = s["contenders"]["lsh"]["eval"]["copy_accuracy"]
    assert "## Copy task" in text and f"| lsh | " in text and f"{acc:.4f}" in text and "--quick settings" in text
    assert "No run found" in text and "(copy/loss.png)" in text
    assert text.rstrip().endswith("See also docs/convert.md for the pretrained-model conversion results.")
    with pytest.raises(SystemExit):
        main(["experiment", "report", "--runs", str(tmp_path / "none"), "--out", str(doc)])


def test_mnist_quick_on_digits(tmp_path):
    out = tmp_path / "mnist"
    assert main(["experiment", "mnist", "--quick", "steps=30", f"out={out}"]) == 0
    s = _summary(out)
    assert s["dataset"] == "digits"
    for name in ("softmax", "linear"):
        _trained(s["contenders"][name])
        assert 1 < s["contenders"][name]["eval"]["bits_per_dim"] < 5  # log2(17) = 4.09 is uniform
    ips = s["generation"]["images_per_second"]
    assert set(ips) == {"softmax (KV cache)", "linear (recurrent)", "softmax (recompute prefix)"}
    assert all(v > 0 for v in ips.values())
    for name in ("samples.png", "completions.png", "loss.png"):
        assert (out / name).stat().st_size > 1000


def test_shakespeare_and_proteins_quick(tmp_path):
    sh, pr = tmp_path / "shakespeare", tmp_path / "proteins"
    assert main(["experiment", "shakespeare", "--quick", "steps=20", "contenders=softmax,hybrid",
                 "eval_tokens=1024", f"out={sh}"]) == 0
    s = _summary(sh)
    for name in ("softmax", "hybrid"):
        _trained(s["contenders"][name])
        assert s["contenders"][name]["eval"]["bits_per_token"] < 7
        assert set(s["speed"][name]) == {"64", "256"}
    assert s["contenders"]["hybrid"]["layer_attention"] == {"1": {"name": "softmax"}}
    # the same experiment with a short convolution, beside it: the report tables it as a variant
    conv = tmp_path / "shakespeare_conv"
    assert main(["experiment", "shakespeare", "--quick", "steps=10", "contenders=softmax,linear", "short_conv=3",
                 "eval_tokens=1024", "speed_contexts=", f"out={conv}"]) == 0
    v = _summary(conv)
    c = s["config"]
    extra = v["contenders"]["softmax"]["parameters"] - s["contenders"]["softmax"]["parameters"]
    assert extra == c["n_layers"] * c["d_model"] * 3 and not v["speed"]
    doc = tmp_path / "results.md"
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc), "--convert-runs", str(tmp_path / "none")]) == 0
    text = doc.read_text()
    assert "kernel 3 in front of every attention layer" not in text.split("## Shakespeare")[1].split("Other settings")[0]
    row = next(line for line in text.splitlines() if line.startswith("| shakespeare_conv |"))
    assert "short_conv 3" in row and "steps 10" in row
    gap = v["contenders"]["linear"]["eval"]["bits_per_token"] - v["contenders"]["softmax"]["eval"]["bits_per_token"]
    assert row.endswith(f"| {gap:+.4f} |")
    assert main(["experiment", "proteins", "--quick", "steps=20", "contenders=favor-relu,softmax",
                 "eval_tokens=1024", "speed_contexts=64,128,256", "step_time_budget_s=1e-9", f"out={pr}"]) == 0
    s = _summary(pr)
    for name in ("favor-relu", "softmax"):
        _trained(s["contenders"][name])
        assert 1 < s["contenders"][name]["eval"]["perplexity"] < 22
    # with a tiny time budget every context after the first is skipped with its reason, not dropped
    assert "seconds" in s["speed"]["softmax"]["64"]
    assert "budget" in s["speed"]["softmax"]["128"]["skipped"] and "skipped" in s["speed"]["softmax"]["256"]


def test_step_measurement_in_a_child_process():
    from linattn.models import TransformerConfig
    from linattn.experiments.stream import measure_steps

    cfg = lambda n: TransformerConfig(vocab_size=11, max_len=n, d_model=16, n_layers=1, n_heads=2, d_ff=32)  # noqa: E731
    out = measure_steps(cfg, (16,), tokens_per_step=32, quadratic=True, repeats=1, in_child=True, say=lambda *a: None)
    m = out["16"]
    assert m["batch"] == 2 and m["seconds"] > 0 and m["peak_rss_bytes"] >= 0 and m["tokens_per_second"] > 0
