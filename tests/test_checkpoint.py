"""Checkpoints: bitwise round trip, and damaged files raise instead of loading garbage."""

import json
import re

import pytest
import torch

from linattn import (
    FavorConfig,
    LinearConfig,
    LinformerConfig,
    LocalConfig,
    SoftmaxConfig,
    TransformerConfig,
    TransformerEncoder,
    TransformerLM,
)
from linattn.models.checkpoint import CONFIG_FILE, WEIGHTS_FILE, config_digest, load_checkpoint

SMALL = dict(vocab_size=31, max_len=16, d_model=16, n_layers=3, n_heads=2, d_ff=32)


def _lm(**kw):
    torch.manual_seed(0)
    cfg = TransformerConfig(**SMALL, attention=LinearConfig(), positional="rotary",
                            layer_attention={0: SoftmaxConfig(), 1: FavorConfig(num_features=8, seed=3)}, **kw)
    return TransformerLM(cfg).eval()


def _write_sealed(folder, meta):
    """Write ``meta`` as the folder's config.json with a matching config_sha256: for tests that
    build a checkpoint whose config is consistent with itself but wrong about the weights."""
    meta["config_sha256"] = config_digest(meta)
    (folder / CONFIG_FILE).write_text(json.dumps(meta))


def _ids():
    return torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie", [True, False])
def test_lm_round_trip_is_bitwise(tmp_path, tie):
    lm = _lm(tie_embeddings=tie)
    lm.save_pretrained(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]  # no .tmp left
    loaded = TransformerLM.from_pretrained(tmp_path / "ck").eval()
    assert loaded.config == lm.config
    assert (loaded.head.weight is loaded.tok_emb.weight) == tie
    # the FAVOR projection is a buffer, saved too
    assert torch.equal(loaded.blocks[1].attn.mechanism.favor.projection, lm.blocks[1].attn.mechanism.favor.projection)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids), lm(ids))
    assert torch.equal(loaded.generate(ids[:, :3], 5, temperature=0), lm.generate(ids[:, :3], 5, temperature=0))


def test_encoder_round_trip_float64_with_linformer(tmp_path):
    torch.manual_seed(0)
    enc = TransformerEncoder(TransformerConfig(**SMALL, attention=LinformerConfig(proj_len=4, seed=7),
                                               layer_attention={2: LocalConfig(window=2)},
                                               positional="sinusoidal")).double()
    enc.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert meta["model"] == "TransformerEncoder" and meta["dtype"] == "float64"
    loaded = TransformerEncoder.from_pretrained(tmp_path)
    assert next(loaded.parameters()).dtype == torch.float64
    with torch.no_grad():
        assert torch.equal(loaded(_ids()), enc(_ids()))
    with pytest.raises(ValueError, match="holds a TransformerEncoder checkpoint, not a TransformerLM"):
        TransformerLM.from_pretrained(tmp_path)


def test_truncated_weights_raise(tmp_path):
    _lm().save_pretrained(tmp_path)
    w = tmp_path / WEIGHTS_FILE
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupted or truncated checkpoint: sha256"):
        TransformerLM.from_pretrained(tmp_path)


def test_flipped_byte_raises(tmp_path):
    _lm().save_pretrained(tmp_path)
    w = tmp_path / WEIGHTS_FILE
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x01  # inside some weight: a silent change of a value without the hash
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted or truncated checkpoint"):
        TransformerLM.from_pretrained(tmp_path)


def test_unreadable_safetensors_with_matching_hash_raises(tmp_path):
    import hashlib

    _lm().save_pretrained(tmp_path)
    junk = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"
    (tmp_path / WEIGHTS_FILE).write_bytes(junk)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    meta["weights_sha256"] = hashlib.sha256(junk).hexdigest()
    _write_sealed(tmp_path, meta)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TransformerLM.from_pretrained(tmp_path)


def test_damaged_or_missing_config_raises(tmp_path):
    with pytest.raises(ValueError, match="not a linattn checkpoint"):
        TransformerLM.from_pretrained(tmp_path)
    _lm().save_pretrained(tmp_path)
    cfg = tmp_path / CONFIG_FILE
    text = cfg.read_text()
    cfg.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="is not valid JSON"):
        TransformerLM.from_pretrained(tmp_path)
    (tmp_path / WEIGHTS_FILE).unlink()
    cfg.write_text(text)
    with pytest.raises(ValueError, match="weights file .* does not exist"):
        TransformerLM.from_pretrained(tmp_path)


def test_config_that_does_not_match_the_weights_raises(tmp_path):
    _lm().save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    meta["config"]["n_layers"] = 4
    _write_sealed(tmp_path, meta)  # past the config digest: the weights themselves disagree
    with pytest.raises(ValueError, match=r"does not match its config: missing tensors \['blocks.3"):
        TransformerLM.from_pretrained(tmp_path)


def test_save_overwrites_atomically(tmp_path):
    a, b = _lm(), _lm(init_std=0.05)
    a.save_pretrained(tmp_path)
    b.save_pretrained(tmp_path)
    loaded = TransformerLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.tok_emb.weight, b.tok_emb.weight)


def _legacy(state: dict, d_model: int) -> dict:
    """``state`` as saved before the fused q/k/v projection: ``in_proj`` split back into
    ``q_proj``/``k_proj``/``v_proj`` (``qk_proj``/``v_proj`` for a 2C-row LSH projection)."""
    out = {}
    for key, t in state.items():
        if ".in_proj." not in key:
            out[key] = t
            continue
        layer, kind = key.split("in_proj.")
        names = ("q_proj", "k_proj", "v_proj") if t.shape[0] == 3 * d_model else ("qk_proj", "v_proj")
        for name, part in zip(names, t.split(d_model), strict=True):
            out[f"{layer}{name}.{kind}"] = part.clone()
    return out


def test_state_dicts_from_before_the_fused_projection_are_refused_with_a_way_out(tmp_path):
    """linattn 0.2 merged the separate q/k/v projections of older state dicts on load; 0.3 does
    not (issue 29): a strict load fails naming the keys, and a checkpoint folder says what to do."""
    import hashlib

    from safetensors.torch import save_file

    lm = _lm()
    old = _legacy(lm.state_dict(), SMALL["d_model"])
    assert "blocks.0.attn.q_proj.weight" in old and not any("in_proj" in k for k in old)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .*q_proj\.weight"):
        _lm().load_state_dict(old)
    lm.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_FILE).read_text())
    tensors = {k: v for k, v in old.items() if k not in meta["aliases"] and isinstance(v, torch.Tensor)}
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    meta["weights_sha256"] = hashlib.sha256((tmp_path / WEIGHTS_FILE).read_bytes()).hexdigest()
    _write_sealed(tmp_path, meta)
    with pytest.raises(ValueError, match=r"from linattn before 0\.2: load it and save it once with linattn 0\.2"):
        TransformerLM.from_pretrained(tmp_path)


def test_the_version_is_one_number():
    import tomllib
    from pathlib import Path

    import linattn

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert linattn.__version__ == pyproject["project"]["version"]


@pytest.mark.parametrize("edit", ["feature_map", "attention_name", "layer_attention", "dtype", "aliases",
                                  "drop_key"])
def test_edited_config_raises_naming_the_file(tmp_path, edit):
    """An edit to config.json that the weights cannot reveal (elu -> relu loads the same tensors)
    fails the stored config digest instead of loading a different model."""
    _lm().save_pretrained(tmp_path)
    cfg = tmp_path / CONFIG_FILE
    meta = json.loads(cfg.read_text())
    if edit == "feature_map":
        meta["config"]["attention"]["feature_map"] = "relu"
    elif edit == "attention_name":
        meta["config"]["attention"] = {"name": "softmax"}
    elif edit == "layer_attention":
        del meta["config"]["layer_attention"]["0"]
    elif edit == "dtype":
        meta["dtype"] = "float64"
    elif edit == "aliases":
        meta["aliases"] = {}
    else:
        del meta["config"]["init_std"]
    cfg.write_text(json.dumps(meta, indent=2))
    with pytest.raises(ValueError, match=rf"{re.escape(str(cfg))}.*config_sha256"):
        TransformerLM.from_pretrained(tmp_path)


def test_reformatted_config_still_loads(tmp_path):
    """The digest is of the JSON's content, not its bytes: re-indenting or re-ordering keys is no edit."""
    lm = _lm()
    lm.save_pretrained(tmp_path)
    cfg = tmp_path / CONFIG_FILE
    cfg.write_text(json.dumps(json.loads(cfg.read_text()), indent=4, sort_keys=True))
    loaded = TransformerLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids()), lm(_ids()))


def test_config_without_digest_is_refused_unless_trusted(tmp_path):
    """A config.json without config_sha256 (written before configs were digested, or with the field
    deleted) is refused with a message saying how to re-save; trusted explicitly, it loads, and
    saving it again adds the digest."""
    lm = _lm()
    lm.save_pretrained(tmp_path)
    cfg = tmp_path / CONFIG_FILE
    meta = json.loads(cfg.read_text())
    del meta["config_sha256"]
    cfg.write_text(json.dumps(meta, indent=2))
    with pytest.raises(ValueError, match=rf"{re.escape(str(cfg))} has no config_sha256.*trust_legacy_config=True.*save_pretrained"):
        TransformerLM.from_pretrained(tmp_path)
    loaded = load_checkpoint(TransformerLM, tmp_path, trust_legacy_config=True).eval()
    loaded.save_pretrained(tmp_path)
    assert "config_sha256" in json.loads(cfg.read_text())
    with torch.no_grad():
        assert torch.equal(TransformerLM.from_pretrained(tmp_path).eval()(_ids()), lm(_ids()))
    # trusting the legacy format never excuses a digest that is present and wrong
    meta = json.loads(cfg.read_text())
    meta["config"]["attention"]["feature_map"] = "relu"
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="config_sha256"):
        load_checkpoint(TransformerLM, tmp_path, trust_legacy_config=True)
