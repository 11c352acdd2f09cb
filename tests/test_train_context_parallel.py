"""`linattn train --context-parallel P`: training with each sequence sharded across P ranks (and
data parallelism over the groups of P) gives the weights and losses of one process."""

import json
import os

import numpy as np
import pytest
import torch

from linattn.train import TrainConfig, launch_local, load_train_checkpoint, train

HYBRID = dict(vocab_size=20, max_len=16, d_model=16, n_layers=3, n_heads=2, d_ff=32, short_conv=2,
              positional="learned", attention={"name": "gated_deltanet"},
              layer_attention={"1": {"name": "softmax"}, "2": {"name": "local", "window": 3}})


def _config(tmp_path, name, model, **kw):
    d = dict(model=model, data=dict(recall_pairs=4, recall_queries=2, recall_tokens=4000, recall_val_tokens=400),
             batch_size=4, seq_len=16, max_steps=3, warmup_steps=1, lr=3e-3, log_every=1, eval_every=3,
             eval_batches=1, ckpt_every=0, dtype="float64", device="cpu", out=str(tmp_path / name))
    d.update(kw)
    return TrainConfig.from_dict(d)


def _records(cfg, kind):
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        return [(r["step"], r.get("loss", r.get("val_loss"))) for r in map(json.loads, f) if r["kind"] == kind]


def _weights(cfg, step):
    return load_train_checkpoint(os.path.join(cfg.out, "checkpoints", f"step_{step:08d}"))["model"].state_dict()


def _assert_same_run(a, b):
    wa, wb = _weights(a, 3), _weights(b, 3)
    for k in wa:
        if torch.is_tensor(wa[k]):
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-9, atol=1e-11, msg=k)
    for kind in ("train", "eval"):
        ra, rb = _records(a, kind), _records(b, kind)
        assert [s for s, _ in ra] == [s for s, _ in rb] and ra
        np.testing.assert_allclose([v for _, v in rb], [v for _, v in ra], rtol=1e-9)


@pytest.mark.parametrize("model,procs", [
    (dict(HYBRID), 2),  # one group of two ranks sharing every sequence
    (dict(HYBRID, attention={"name": "linear"}, layer_attention={"1": {"name": "favor"}}), 4),  # 2 x 2
])
def test_context_parallel_training_equals_one_process(tmp_path, model, procs):
    single = _config(tmp_path, "single", model)
    train(single, quiet=True, handle_signals=False)
    sharded = _config(tmp_path, "sharded", model, context_parallel=2)
    launch_local(sharded, procs)
    _assert_same_run(single, sharded)


def test_config_errors():
    base = dict(model=dict(HYBRID), seq_len=16)
    with pytest.raises(ValueError, match="layer 0 uses 'lsh' attention, which has no sharded form"):
        TrainConfig.from_dict(dict(base, model=dict(HYBRID, attention={"name": "lsh", "bucket_size": 4}),
                                   context_parallel=2))
    with pytest.raises(ValueError, match="context_parallel = 3 must divide seq_len = 16"):
        TrainConfig.from_dict(dict(base, context_parallel=3))
    with pytest.raises(ValueError, match="packed documents are not sharded"):
        TrainConfig.from_dict(dict(base, context_parallel=2, data={"document_separator": 0}))
    with pytest.raises(ValueError, match="context_parallel must be an int >= 1"):
        TrainConfig.from_dict(dict(base, context_parallel=0))
