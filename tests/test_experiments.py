"""`linattn experiment`: quick runs train (the loss falls) and write their files; mechanisms come from the
registry; overrides are checked in one line."""

import json

import pytest
import torch

from linattn.cli import main
from linattn.experiments.common import mechanism_labels
from linattn.experiments.copy import CopyConfig, copy_batch
from linattn.experiments.proteins import ProteinsConfig
from linattn.experiments.shakespeare import ShakespeareConfig
from linattn.nn import FavorConfig, LinearConfig, LSHConfig, SoftmaxConfig
from linattn.nn.registry import attention_config, attention_config_to_dict


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
    c = CopyConfig.resolve(quick=True, overrides=["steps=7", "lr=0.01", "mechanisms=softmax,linear", "out=2024"])
    assert (c.steps, c.lr, c.labels, c.out) == (7, 0.01, ["softmax", "linear"], "2024")
    assert c.mechanisms == (SoftmaxConfig(), LinearConfig())
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'stepz' \(did you mean 'steps'\?\)"):
        CopyConfig.resolve(overrides=["stepz=3"])
    with pytest.raises(TypeError, match="steps must be an int, got 'many'"):
        CopyConfig.resolve(overrides=["steps=many"])
    with pytest.raises(ValueError, match="dotted.key=value"):
        CopyConfig.resolve(overrides=["steps"])
    with pytest.raises(ValueError, match="mechanisms: unknown attention mechanism 'sofmax' \\(did you mean 'softmax'"):
        CopyConfig.resolve(overrides=["mechanisms=sofmax"])
    with pytest.raises(ValueError, match="warmup_steps"):
        CopyConfig.resolve(overrides=["steps=3", "warmup_steps=5"])
    with pytest.raises(ValueError, match="'efficient' attention has no causal form"):
        CopyConfig.resolve(mechanisms=[attention_config("efficient")])
    with pytest.raises(ValueError, match="'contenders' was renamed to 'mechanisms'"):
        CopyConfig.resolve(overrides=["contenders=softmax"])
    with pytest.raises(ValueError, match=r"give \['linear'\] twice"):
        CopyConfig.resolve(overrides=["mechanisms=linear,softmax,linear"])


def test_presets_declare_their_mechanisms_with_registry_configs():
    # the full runs' mechanisms and labels (labels name the runs' metrics files and table rows)
    assert CopyConfig.preset().mechanisms == (SoftmaxConfig(), LinearConfig(), FavorConfig(num_features=64),
                                              LSHConfig(n_hashes=4, bucket_size=32))
    assert CopyConfig.preset(quick=True).mechanisms[2] == FavorConfig(num_features=16)
    assert ProteinsConfig.preset().labels == ["softmax", "linear", "favor", "favor kernel=relu"]
    assert ProteinsConfig.preset().mechanisms[3] == FavorConfig(num_features=64, kernel="relu")
    s = ShakespeareConfig.preset()
    assert s.labels == ["softmax", "linear", "favor", "linear+softmax@-1"]
    hybrid = s.model_config("linear+softmax@-1", vocab_size=5, max_len=8)
    assert hybrid.layer_mechanisms() == ["linear", "linear", "softmax"]
    # a config round-trips through its dict form, mechanisms as registry dicts
    d = s.to_dict()
    assert d["hybrids"] == [{"name": "linear", "feature_map": "elu"}]
    assert ShakespeareConfig.from_dict(json.loads(json.dumps(d))) == s
    assert mechanism_labels([attention_config("local"), attention_config("local", window=64)]) == [
        "local", "local window=64"]


def _error(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_cli_rejects_bad_overrides_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["experiment", "copy", "--quick", "--mechanisms", "locl"])
    assert info.value.code == 2
    err = _error(capsys)
    assert err[0].startswith("usage: linattn experiment copy ") and len(err) == 2  # its own usage, one error line
    assert err[1].startswith("linattn experiment copy: error: argument --mechanisms") and "did you mean 'local'" in err[1]
    with pytest.raises(SystemExit) as info:
        main(["experiment", "copy", "--quick", "--set", "stepz=3"])
    assert info.value.code == 2
    (line,) = _error(capsys)
    assert line.startswith("linattn experiment copy: error:") and "'stepz'" in line and "did you mean 'steps'" in line
    with pytest.raises(SystemExit):
        main(["experiment", "copy", "--quick", "--steps", "3", "--warmup-steps", "5"])
    (line,) = _error(capsys)
    assert "warmup_steps must be in [0, steps = 3)" in line
    with pytest.raises(SystemExit):
        main(["experiment", "copy", "--quick", "steps=3"])  # one override syntax: no positional key=value
    assert "unrecognized arguments: steps=3" in _error(capsys)[-1]
    with pytest.raises(SystemExit):
        main(["experiment", "cpy"])
    assert "did you mean 'copy'" in _error(capsys)[-1]


def test_print_config_shows_mechanisms_given_as_json(capsys):
    assert main(["experiment", "copy", "--mechanisms", '["linear", {"name": "favor", "kernel": "relu"}]',
                 "--steps", "500", "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["steps"] == 500
    assert config["mechanisms"] == [attention_config_to_dict(LinearConfig()),
                                    attention_config_to_dict(FavorConfig(kernel="relu"))]
    assert config["mechanisms"][1]["name"] == "favor" and config["mechanisms"][1]["kernel"] == "relu"


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
    assert main(["experiment", "copy", "--quick", "--steps", "30", "--mechanisms", "softmax,linear,lsh",
                 "--out", str(out)]) == 0
    s = _summary(out)
    assert s["experiment"] == "copy" and s["quick"] and s["config"]["steps"] == 30
    # the run records its mechanisms as registry dicts, in config.json and summary.json
    registry_dicts = [attention_config_to_dict(c) for c in (SoftmaxConfig(), LinearConfig(), LSHConfig())]
    assert s["config"]["mechanisms"] == registry_dicts and s["config"]["hybrids"] == []
    assert json.loads((out / "config.json").read_text())["config"]["mechanisms"] == registry_dicts
    assert s["command"].startswith("linattn experiment copy --quick --steps 30")
    for name in ("softmax", "linear", "lsh"):
        _trained(s["mechanisms"][name])
        assert s["mechanisms"][name]["attention"]["name"] == name
        assert 0 <= s["mechanisms"][name]["eval"]["copy_accuracy"] <= 1
        records = [json.loads(line) for line in (out / f"metrics_{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20, 25, 30]
        assert records[-1]["step"] == 30 and "copy_loss" in records[-1]  # the final evaluation
    assert (out / "loss.png").stat().st_size > 1000 and (out / "config.json").exists()
    assert "linear reaches the softmax final loss" in s["targets"]
    # the report is written from these files, and says which experiments have no run
    doc = tmp_path / "results.md"
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc),
                 "--convert-runs", str(tmp_path / "no-conversion-runs")]) == 0
    text = doc.read_text()
    acc = s["mechanisms"]["lsh"]["eval"]["copy_accuracy"]
    assert "## Copy task" in text and f"| lsh | " in text and f"{acc:.4f}" in text and "--quick settings" in text
    assert "No run found" in text and "(copy/loss.png)" in text
    assert text.rstrip().endswith("See also docs/convert.md for the pretrained-model conversion results.")
    with pytest.raises(SystemExit):
        main(["experiment", "report", "--runs", str(tmp_path / "none"), "--out", str(doc)])
    # a run beside it with another mechanism: its rows join the copy table, and the gated section
    # compares its steps to loss < 0.01 with softmax's, read from the two folders' metrics files
    gated = tmp_path / "copy_gated"
    assert main(["experiment", "copy", "--quick", "--steps", "30", "--mechanisms", "deltanet", "--out", str(gated)]) == 0
    for folder, name, below in ((out, "softmax", 10), (gated, "deltanet", 25)):
        (folder / f"metrics_{name}.jsonl").write_text("".join(
            json.dumps({"step": k, "loss": 0.005 if k >= below else 1.0}) + "\n" for k in (5, 10, 15, 20, 25, 30)))
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc),
                 "--convert-runs", str(tmp_path / "none")]) == 0
    text = doc.read_text()
    assert "| copy_gated | deltanet | " in text and "| copy | softmax | " in text
    assert ("- copy (the first table's settings): deltanet 25 steps (2.50x softmax's 10): **does not close the gap**"
            in text.split("## Gated and delta-rule mechanisms against softmax")[1])


def test_mnist_quick_on_digits(tmp_path):
    out = tmp_path / "mnist"
    assert main(["experiment", "mnist", "--quick", "--steps", "30", "--out", str(out)]) == 0
    s = _summary(out)
    assert s["dataset"] == "digits"
    for name in ("softmax", "linear"):
        _trained(s["mechanisms"][name])
        assert 1 < s["mechanisms"][name]["eval"]["bits_per_dim"] < 5  # log2(17) = 4.09 is uniform
    ips = s["generation"]["images_per_second"]
    assert set(ips) == {"softmax (KV cache)", "linear (recurrent)", "softmax (recompute prefix)"}
    assert all(v > 0 for v in ips.values())
    for name in ("samples.png", "completions.png", "loss.png"):
        assert (out / name).stat().st_size > 1000


def test_shakespeare_and_proteins_quick(tmp_path):
    sh, pr = tmp_path / "shakespeare", tmp_path / "proteins"
    assert main(["experiment", "shakespeare", "--quick", "--steps", "20", "--mechanisms", "softmax",
                 "--hybrids", "linear", "--eval-tokens", "1024", "--out", str(sh)]) == 0
    s = _summary(sh)
    hybrid = "linear+softmax@-1"
    for name in ("softmax", hybrid):
        _trained(s["mechanisms"][name])
        assert s["mechanisms"][name]["eval"]["bits_per_token"] < 7
        assert set(s["speed"][name]) == {"64", "256"}
    assert s["mechanisms"][hybrid]["attention"]["name"] == "linear"
    assert s["mechanisms"][hybrid]["layer_attention"] == {"1": {"name": "softmax"}}
    assert (sh / "metrics_linear+softmax@-1.jsonl").is_file()
    # the same experiment with a short convolution, beside it: the report tables it as a variant
    conv = tmp_path / "shakespeare_conv"
    assert main(["experiment", "shakespeare", "--quick", "--steps", "10", "--mechanisms", "softmax,linear",
                 "--hybrids", "", "--short-conv", "3", "--eval-tokens", "1024", "--speed-contexts", "",
                 "--out", str(conv)]) == 0
    v = _summary(conv)
    c = s["config"]
    extra = v["mechanisms"]["softmax"]["parameters"] - s["mechanisms"]["softmax"]["parameters"]
    assert extra == c["n_layers"] * c["d_model"] * 3 and not v["speed"]
    doc = tmp_path / "results.md"
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc), "--convert-runs", str(tmp_path / "none")]) == 0
    text = doc.read_text()
    assert "kernel 3 in front of every attention layer" not in text.split("## Shakespeare")[1].split("Other settings")[0]
    row = next(line for line in text.splitlines() if line.startswith("| shakespeare_conv |"))
    assert "short_conv 3" in row and "steps 10" in row
    gap = v["mechanisms"]["linear"]["eval"]["bits_per_token"] - v["mechanisms"]["softmax"]["eval"]["bits_per_token"]
    assert row.endswith(f"| {gap:+.4f} |")
    assert main(["experiment", "proteins", "--quick", "--steps", "20", "--mechanisms",
                 '[{"name": "favor", "num_features": 16, "kernel": "relu"}, "softmax"]', "--eval-tokens", "1024",
                 "--speed-contexts", "64,128,256", "--set", "step_time_budget_s=1e-9", "--out", str(pr)]) == 0
    s = _summary(pr)
    assert list(s["mechanisms"]) == ["favor", "softmax"]  # one FAVOR: its shared options leave the label
    assert s["mechanisms"]["favor"]["attention"]["kernel"] == "relu"
    for name in ("favor", "softmax"):
        _trained(s["mechanisms"][name])
        assert 1 < s["mechanisms"][name]["eval"]["perplexity"] < 22
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
