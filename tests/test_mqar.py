"""`linattn experiment mqar`: the MQAR generator (deterministic, Zoology's layout), the state-size
formula against the models' own decoding states, the --quick grid's files, the CLI and the errors."""

import hashlib
import json

import numpy as np
import pytest
import torch

from linattn.cli import main
from linattn.experiments.mqar import MqarConfig, mqar_batch, state_bytes
from linattn.models import TransformerConfig, TransformerLM
from linattn.nn.registry import MECHANISMS, attention_config


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# sha256 of batch _batch() as little-endian int64 (ids, targets, mask): changes only if the data does
PINNED = "86c4c2c332d7d5ee"


def _batch(**kw):
    args = dict(batch_size=6, seq_len=40, num_kv_pairs=5, vocab_size=30, random_non_queries=True, seed=3, stream=0,
                index=7)
    return mqar_batch(**{**args, **kw})


def test_batches_are_pure_functions_of_their_counters():
    a, b = _batch(), _batch()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for change in (dict(index=8), dict(stream=1), dict(seed=4)):
        assert not torch.equal(_batch(**change)[0], a[0]), change
    # pinned: the same bytes on every machine and numpy version (splitmix64 counters, not a global RNG)
    digest = hashlib.sha256(b"".join(t.numpy().astype("<i8").tobytes() for t in a)).hexdigest()[:16]
    assert digest == PINNED, digest


def test_filler_is_id_0_unless_random_non_queries():
    quiet, noisy = _batch(random_non_queries=False), _batch()
    # the same pairs, queries and answers; only the unscored filler differs
    assert torch.equal(quiet[1], noisy[1]) and torch.equal(quiet[2], noisy[2])
    scored_or_pair = quiet[2].clone()
    scored_or_pair[:, : 2 * 5] = True
    assert torch.equal(quiet[0][scored_or_pair], noisy[0][scored_or_pair])
    assert (quiet[0][~scored_or_pair] == 0).all() and (noisy[0][~scored_or_pair] != 0).any()


@pytest.mark.parametrize("N, P, V", [(40, 5, 30), (16, 4, 10), (33, 3, 9), (64, 16, 64), (8, 1, 4)])
@pytest.mark.parametrize("random_non_queries", [False, True])
def test_batch_structure(N, P, V, random_non_queries):
    ids, targets, mask = mqar_batch(batch_size=16, seq_len=N, num_kv_pairs=P, vocab_size=V, index=1,
                                    random_non_queries=random_non_queries)
    assert ids.shape == targets.shape == mask.shape == (16, N) and mask.dtype == torch.bool
    assert int(ids.min()) >= 0 and int(ids.max()) < V
    for row in range(16):
        x, t, m = ids[row].numpy(), targets[row].numpy(), mask[row].numpy()
        keys, vals = x[0 : 2 * P : 2], x[1 : 2 * P : 2]
        assert len(set(keys)) == P and len(set(vals)) == P  # distinct within the example
        assert ((1 <= keys) & (keys < V // 2)).all() and ((V // 2 <= vals) & (vals < V)).all()
        pos = np.flatnonzero(m)
        assert len(pos) == P  # every key queried once, nothing else scored
        assert (pos >= 2 * P).all() and ((pos - 2 * P) % 2 == 0).all() and (pos + 1 < N + 1).all()
        assert sorted(x[pos]) == sorted(keys)  # the queries are the pairs' keys
        pair = dict(zip(keys, vals))
        assert all(t[p] == pair[x[p]] for p in pos)  # each answer is its key's value
        assert (t[~m] == 0).all()


def test_queries_follow_the_power_law():
    # Zoology's power_a = 0.01: slot s has weight (s + 1)^-0.99, so early slots are queried far more
    _, _, mask = mqar_batch(batch_size=400, seq_len=128, num_kv_pairs=4, vocab_size=20)
    slots = (torch.nonzero(mask)[:, 1] - 8) // 2  # (400 * 4,)
    counts = torch.bincount(slots, minlength=60)
    assert counts[:5].sum() > 2 * counts[-30:].sum()
    _, _, flat = mqar_batch(batch_size=400, seq_len=128, num_kv_pairs=4, vocab_size=20, power_a=1.0)
    flat_counts = torch.bincount((torch.nonzero(flat)[:, 1] - 8) // 2, minlength=60)
    assert flat_counts[-30:].sum() > counts[-30:].sum()  # a = 1 is uniform: late slots get their share


def test_impossible_settings_are_refused():
    with pytest.raises(ValueError, match=r"5 pairs need seq_len >= 4 \* 5 = 20.*got seq_len = 19"):
        mqar_batch(batch_size=1, seq_len=19, num_kv_pairs=5, vocab_size=64)
    with pytest.raises(ValueError, match=r"9 distinct keys need vocab_size >= 20.*got vocab_size = 19"):
        mqar_batch(batch_size=1, seq_len=64, num_kv_pairs=9, vocab_size=19)
    with pytest.raises(ValueError, match="MqarConfig: 64 pairs need seq_len >= 4 \\* 64"):
        MqarConfig.resolve(overrides=["num_kv_pairs=[4,64]", "seq_lens=[64,128]", "vocab_size=256"])
    with pytest.raises(ValueError, match="one entry each"):
        MqarConfig.resolve(overrides=["seq_lens=[64,128]"])
    with pytest.raises(ValueError, match="n_heads = 3 must divide every width"):
        MqarConfig.resolve(overrides=["n_heads=3"])
    with pytest.raises(ValueError, match=r"widths must be a non-empty list such as \[32, 64\].*got '16,32'"):
        MqarConfig.resolve(overrides=["widths=16,32"])
    with pytest.raises(ValueError, match="lrs has an entry twice"):
        MqarConfig.resolve(overrides=["lrs=[0.01,0.01]"])


def _measured_state_bytes(attention, *, C=32, H=2, N=24):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=20, max_len=N, d_model=C, n_layers=1, n_heads=H, d_ff=32,
                            attention=attention, short_conv=4)
    with torch.no_grad():
        _, state = TransformerLM(cfg)(torch.randint(0, 20, (1, N)), return_state=True)
    s = state.layers[0].mechanism
    if hasattr(s, "length"):  # a KV cache: only its filled slots are the state
        return (s.keys().numel() + s.v[:, :, : s.length].numel()) * 4
    return sum(t.numel() * t.element_size() for t in s if isinstance(t, torch.Tensor))


# every recurrent mechanism of the registry (a new one without a formula fails here, not after a
# grid has trained), small options where the defaults are large, and grouped value heads
_SMALL = {"favor": {"num_features": 16}, "local": {"window": 8}}


@pytest.mark.parametrize("attention", [
    *(attention_config(name, **_SMALL.get(name, {})) for name, spec in MECHANISMS.items() if spec.recurrent),
    attention_config("kda", n_key_heads=1)], ids=lambda a: type(a).__name__)
def test_state_bytes_is_the_models_own_state(attention):
    assert state_bytes(attention, d_model=32, n_heads=2, seq_len=24) == _measured_state_bytes(attention)


def test_state_bytes_formulas():
    # softmax: K and V of every position; deltanet: one D x D matrix per head; both float32
    assert state_bytes(attention_config("softmax"), d_model=64, n_heads=1, seq_len=512) == 2 * 512 * 64 * 4
    assert state_bytes(attention_config("deltanet"), d_model=64, n_heads=4, seq_len=512) == 4 * 16 * 16 * 4
    assert state_bytes(attention_config("linear"), d_model=64, n_heads=1, seq_len=512) == (64 * 64 + 64) * 4
    assert state_bytes(attention_config("lsh"), d_model=64, n_heads=1, seq_len=512) is None


def test_print_config(capsys):
    assert main(["experiment", "mqar", "--quick", "--set", "widths=[8,16,24]", "--print-config"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["widths"] == [8, 16, 24] and c["num_kv_pairs"] == [2, 4] and len(c["lrs"]) == 2
    assert [m["name"] for m in c["mechanisms"]] == ["softmax", "linear", "deltanet"]
    full = MqarConfig.preset()
    assert {"softmax", "linear", "favor", "local", "retnet", "gla", "deltanet", "gated_deltanet"} <= set(full.labels)
    assert any(x.endswith("+softmax@-1") for x in full.labels)
    assert len(full.widths) >= 3 and len(full.num_kv_pairs) >= 3 and len(full.lrs) >= 2


def test_quick_grid_writes_every_cell_and_the_report(tmp_path):
    out = tmp_path / "mqar"
    assert main(["experiment", "mqar", "--quick", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    c = MqarConfig.preset(quick=True)
    cells = {(x["mechanism"], x["num_kv_pairs"], x["seq_len"], x["d_model"]): x for x in s["cells"]}
    expected = {(m, P, N, w) for m in c.labels for P, N in c.tasks for w in c.widths}
    assert set(cells) == expected and len(s["cells"]) == len(expected)
    lrs = [f"{lr:g}" for lr in c.lrs]
    for key, x in cells.items():
        assert list(x["accuracy_by_lr"]) == lrs and 0 <= x["best_accuracy"] <= 1
        assert x["best_accuracy"] == max(x["accuracy_by_lr"].values()) == x["accuracy_by_lr"][f"{x['best_lr']:g}"]
        assert x["train_seconds"] > 0 and x["parameters"] > 0
        m, P, N, w = key
        assert len(x["state_bytes_layers"]) == c.n_layers
        if m == "softmax":
            assert x["state_bytes"] == 2 * N * w * 4
        if m.endswith("+softmax@-1"):  # the hybrid's last layer holds a KV cache
            assert x["state_bytes_layers"][-1] == 2 * N * w * 4 != x["state_bytes_layers"][0]
    # the training loss falls on the easiest cell (softmax, 2 pairs): the runs do train
    rec = [json.loads(line) for line in
           (out / "metrics" / f"metrics_softmax_P2_N16_d32_lr{lrs[-1]}.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rec if "loss" in r]
    assert len(losses) >= c.steps // c.log_every and losses[-1] < losses[0]
    assert len(list((out / "metrics").glob("metrics_*.jsonl"))) == len(expected) * len(c.lrs)
    for name in s["plots"]:
        assert (out / name).stat().st_size > 1000
    assert len(s["plots"]) == len(c.tasks)
    assert set(s["targets"]) == {"softmax >= 99% accuracy at every width",
                                 "deltanet >= 90% at the smallest width where linear < 50%",
                                 "gated_deltanet >= 90% at the smallest width where linear < 50%"}
    assert s["targets"]["gated_deltanet >= 90% at the smallest width where linear < 50%"]["holds"] is None
    assert s["wall_seconds"] > 0 and "| softmax |" in (out / "results.md").read_text()
    doc = tmp_path / "results.md"
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc),
                 "--convert-runs", str(tmp_path / "none")]) == 0
    text = doc.read_text()
    assert "## Multi-query associative recall (MQAR)" in text and "(mqar/accuracy_P2_N16.png)" in text
    first = cells[("softmax", 2, 16, 16)]
    assert f"{first['best_accuracy']:.3f} ({first['best_lr']:g})" in text
    assert "No run found at" in text  # the other experiments have none here
    # a run beside it with other settings gets its own tables, its differing settings named
    assert main(["experiment", "mqar", "--quick", "--mechanisms", "deltanet", "--hybrids", "", "--steps", "8",
                 "--widths", "[16]", "--out", str(tmp_path / "mqar_short")]) == 0
    assert main(["experiment", "report", "--runs", str(tmp_path), "--out", str(doc),
                 "--convert-runs", str(tmp_path / "none")]) == 0
    after = doc.read_text().split("Run `mqar_short/` beside it (settings that differ: ")[1]
    assert after.startswith("steps 8, widths [16]") and "| deltanet | " in after.split("Paper (Zoology")[0]
    # and the generated comparison reads both runs: deltanet in each, the second named by its folder
    gated = doc.read_text().split("## Gated and delta-rule mechanisms against softmax")[1]
    assert "- MQAR, 2 pairs in 16 tokens" in gated and "- MQAR (`mqar_short/`: steps 8, widths [16]), 2 pairs" in gated


def test_workers_give_the_same_grid_as_one_process(tmp_path):
    # every run is a function of its settings, so two spawned workers must reproduce one process's
    # numbers exactly (and the attention-only blocks of ff_ratio 0 train there too)
    common = ["experiment", "mqar", "--quick", "--set", "widths=[16]", "--set", "num_kv_pairs=[2]", "--set",
              "seq_lens=[16]", "--set", "hybrids=[]", "--set", "steps=8"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--workers", "2", "--out", str(tmp_path / "two")]) == 0
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert one["config"]["workers"] == 1 and two["config"]["workers"] == 2 and one["config"]["ff_ratio"] == 0
    key = lambda c: (c["mechanism"], c["d_model"])  # noqa: E731
    for a, b in zip(sorted(one["cells"], key=key), sorted(two["cells"], key=key), strict=True):
        assert a["accuracy_by_lr"] == b["accuracy_by_lr"] and a["loss_by_lr"] == b["loss_by_lr"]
