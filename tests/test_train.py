"""Training: exact resume after a signal or a crash, DDP = single process, configs, data, CLI."""

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from linattn import TransformerLM
from linattn.cli import main
from linattn.train import (
    CosineSchedule,
    DataConfig,
    MetricsLog,
    TrainConfig,
    WindowSampler,
    apply_overrides,
    launch_local,
    load_config,
    load_token_file,
    load_train_checkpoint,
    lr_at,
    recall_tokens,
    train,
    TrainingLoop,
)

from conftest import sigint_default

TINY_MODEL = dict(vocab_size=20, max_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                  attention={"name": "linear", "feature_map": "elu"})


def _config(tmp_path, name="run", **kw):
    d = dict(model=dict(TINY_MODEL, dropout=0.1), data=dict(recall_pairs=4, recall_queries=2, recall_tokens=4000,
                                                            recall_val_tokens=400),
             batch_size=4, seq_len=16, max_steps=8, warmup_steps=2, lr=3e-3, log_every=1, eval_every=4,
             eval_batches=1, ckpt_every=0, out=str(tmp_path / name))
    d.update(kw)
    return TrainConfig.from_dict(d)


def _records(cfg, kind="train"):
    with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [(r["step"], r.get("loss", r.get("val_loss"))) for r in recs if r["kind"] == kind]


def _final(cfg, step):
    """The state dict of checkpoint ``step``, with the modules' extra state (FAVOR redraw state)."""
    folder = os.path.join(cfg.out, "checkpoints", f"step_{step:08d}")
    full = load_train_checkpoint(folder)["model"].state_dict()
    opened = TransformerLM.from_pretrained(folder).state_dict()  # what users open: the same tensors
    for k, v in full.items():
        if torch.is_tensor(v):
            assert torch.equal(v, opened[k]), k
    return full


def _assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:  # extra state: a dict of tensors and plain values
            assert a[k].keys() == b[k].keys(), k
            for j in a[k]:
                same = torch.equal(a[k][j], b[k][j]) if torch.is_tensor(a[k][j]) else a[k][j] == b[k][j]
                assert same, (k, j)


# FAVOR with redraw_every = 3: redraws at steps 4 and 7 (one forward per layer per step), so an
# interruption at step 3 leaves its generator advanced and its counter mid-way; both must resume.
FAVOR_REDRAW = {"name": "favor", "num_features": 8, "redraw_every": 3}


@pytest.mark.parametrize("attention", [TINY_MODEL["attention"], FAVOR_REDRAW], ids=["linear", "favor_redraw"])
def test_signal_then_resume_is_bitwise_identical(tmp_path, attention, default_sigint_handler):
    model = dict(TINY_MODEL, dropout=0.1, attention=attention)
    straight = _config(tmp_path, "straight", model=model)
    train(straight, quiet=True)

    cut = _config(tmp_path, "cut", model=model)

    def interrupt(step, rec):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the real handler: stop at the next step boundary

    r = train(cut, quiet=True, on_step=interrupt)
    assert r.stopped_by_signal and r.stop_signal == signal.SIGINT and r.step == 3
    assert r.checkpoint.name == "step_00000003"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    r = train(cut, resume=True, quiet=True)
    assert r.step == 8 and not r.stopped_by_signal
    assert _records(cut) == _records(straight)
    assert [s for s, _ in _records(cut)] == list(range(1, 9))
    assert _records(cut, "eval") == _records(straight, "eval")
    _assert_bitwise(_final(cut, 8), _final(straight, 8))


def test_crash_then_resume_drops_unsaved_records(tmp_path):
    straight = _config(tmp_path, "straight", ckpt_every=2, max_steps=7)
    train(straight, quiet=True)
    crash = _config(tmp_path, "crash", ckpt_every=2, max_steps=7)

    def boom(step, rec):
        if step == 6:  # after the step-4 checkpoint and step 5's metrics record; before step 6's
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(crash, quiet=True, on_step=boom)
    assert [s for s, _ in _records(crash)] == [1, 2, 3, 4, 5]
    # keep_last = 2: step_2 was deleted when step_4 was written
    assert sorted(p.name for p in (tmp_path / "crash" / "checkpoints").iterdir()) == [
        "latest.json", "step_00000002", "step_00000004"]
    train(crash, resume=True, quiet=True)  # from step 4: records 5.. are rewritten
    assert _records(crash) == _records(straight)
    _assert_bitwise(_final(crash, 7), _final(straight, 7))


def test_extending_max_steps_with_fixed_decay_steps_continues_exactly(tmp_path):
    full = _config(tmp_path, "full", max_steps=6, decay_steps=6)
    train(full, quiet=True)
    part = _config(tmp_path, "part", max_steps=3, decay_steps=6)
    train(part, quiet=True)
    train(_config(tmp_path, "part", max_steps=6, decay_steps=6), resume=True, quiet=True)
    assert _records(part) == _records(full)
    _assert_bitwise(_final(part, 6), _final(full, 6))


def test_resume_refusals(tmp_path):
    cfg = _config(tmp_path, max_steps=2, eval_every=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg, resume=True, quiet=True)
    train(cfg, quiet=True)
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, quiet=True)
    with pytest.raises(ValueError, match=r"\['lr'\].*only \['max_steps'"):
        train(_config(tmp_path, max_steps=2, eval_every=0, lr=1e-2), resume=True, quiet=True)
    # a damaged optimiser file is reported, not loaded
    blob = tmp_path / "run" / "checkpoints" / "step_00000002" / "trainer.pt"
    blob.write_bytes(blob.read_bytes()[:-10])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        train(_config(tmp_path, max_steps=4, eval_every=0), resume=True, quiet=True)


def test_grad_accum_matches_one_big_batch(tmp_path):
    kw = dict(model=TINY_MODEL, dtype="float64", max_steps=3, eval_every=0)
    a = _config(tmp_path, "a", **kw)
    b = _config(tmp_path, "b", grad_accum=2, **kw)
    train(a, quiet=True)
    train(b, quiet=True)
    for (sa, la), (sb, lb) in zip(_records(a), _records(b)):
        assert sa == sb and la == pytest.approx(lb, rel=1e-12)
    wa, wb = _final(a, 3), _final(b, 3)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-10, atol=1e-12)


# A fresh interpreter (this one imported torch._dynamo long ago): a one-rank gloo group made by
# torch's init_process_group or by linattn's join_group, then torch._dynamo imported (as torch.optim's
# first step and a custom op's first call do), then the group destroyed: is it still held?
_GROUP_PROBE = """
import gc, sys, weakref
import torch.distributed as dist
from linattn.train.dist import join_group
assert "torch._dynamo" not in sys.modules and "torch.distributed.nn" not in sys.modules
make = dist.init_process_group if sys.argv[1] == "torch" else join_group
make("gloo", rank=0, world_size=1, store=dist.FileStore(sys.argv[2], 1))
group = weakref.ref(dist.group.WORLD)
import torch._dynamo
dist.destroy_process_group()
gc.collect()
print("held" if group() is not None else "freed")
"""


@pytest.mark.parametrize("make, want", [("torch", "held"), ("join_group", "freed")])
def test_torch_distributed_nn_imported_after_a_group_still_holds_it(tmp_path, make, want):
    """torch.distributed.nn.functional's ``group=group.WORLD`` defaults hold the default group when
    that module is first imported after it exists (through torch._dynamo): destroy_process_group
    then frees nothing and gloo's threads outlive the interpreter's shutdown, where a two-rank run
    aborted (SIGABRT) in 3-5 of 20-40 runs. join_group imports the module first. The torch row
    fails the day torch stops holding it (join_group's import can go then)."""
    out = subprocess.run([sys.executable, "-c", _GROUP_PROBE, make, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == want


def test_ddp_two_processes_equal_one_process(tmp_path):
    kw = dict(model=TINY_MODEL, dtype="float64", max_steps=3, eval_every=3, device="cpu")
    single = _config(tmp_path, "single", **kw)
    train(single, quiet=True)
    ddp = _config(tmp_path, "ddp", **kw)
    launch_local(ddp, 2)
    w1, w2 = _final(single, 3), _final(ddp, 3)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-10, atol=1e-12)
    torch.manual_seed(single.seed)  # sanity: training moved the weights
    init = TransformerLM(single.model).to(torch.float64).state_dict()
    changed = any(not torch.allclose(init[k], w1[k]) for k in w1)
    assert changed
    for kind in ("train", "eval"):
        (r1, r2) = _records(single, kind), _records(ddp, kind)
        assert [s for s, _ in r1] == [s for s, _ in r2]
        np.testing.assert_allclose([v for _, v in r2], [v for _, v in r1], rtol=1e-10)


def test_loss_goes_down_on_recall_data(tmp_path):
    cfg = TrainConfig.from_dict(dict(
        model=dict(vocab_size=20, max_len=32, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                   attention={"name": "linear"}),
        data=dict(recall_pairs=4, recall_queries=4, recall_tokens=20000, recall_val_tokens=2000),
        batch_size=16, seq_len=32, max_steps=60, warmup_steps=5, lr=1e-2, eval_every=60, eval_batches=2,
        log_every=10, out=str(tmp_path / "run")))
    r = train(cfg, quiet=True)
    first = _records(cfg)[0][1]
    assert r.last_val_loss < np.log(20) - 0.5 and r.last_loss < first - 0.5


def test_bf16_autocast_runs(tmp_path):
    r = train(_config(tmp_path, bf16=True, max_steps=2, eval_every=2), quiet=True)
    assert np.isfinite(r.last_loss) and np.isfinite(r.last_val_loss)


def test_lr_schedule():
    c = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(c, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(c, 9) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_at(c, 14) == pytest.approx(0.1) and lr_at(c, 100) == pytest.approx(0.1)


def test_config_round_trip_files_and_overrides(tmp_path):
    cfg = _config(tmp_path, betas=[0.8, 0.9], grad_clip=None)
    assert cfg.betas == (0.8, 0.9)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    (tmp_path / "c.toml").write_text(
        'lr = 3e-4\nmax_steps = 5\nseq_len = 64\n[model]\nvocab_size = 50\nmax_len = 64\n'
        '[model.attention]\nname = "local"\nwindow = 8\n[data]\nrecall_pairs = 3\n')
    c = load_config(tmp_path / "c.toml", ["model.d_model=64", "data.recall_queries=5", "betas=[0.9, 0.99]"])
    assert (c.lr, c.max_steps, c.model.vocab_size, c.model.d_model, c.model.attention.window) == (3e-4, 5, 50, 64, 8)
    assert (c.data.recall_pairs, c.data.recall_queries, c.betas) == (3, 5, (0.9, 0.99))
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    assert load_config(tmp_path / "c.json") == c
    with pytest.raises(ValueError, match="seq_len = 128 exceeds model.max_len = 64"):
        load_config(tmp_path / "c.toml", ["seq_len=128"])
    assert load_config(tmp_path / "c.toml", ["model.max_len=128", "seq_len=128"]).seq_len == 128
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x y", "d=null"]) == {"a": {"b": 1, "c": "x y"}, "d": None}


@pytest.mark.parametrize("d, match", [
    ({"lr": 1e-3, "learning_rate": 1, "bogus": 2}, r"TrainConfig: unknown field\(s\) 'bogus', 'learning_rate'"),
    ({"data": {"sorce": "file"}}, r"DataConfig: unknown field\(s\) 'sorce' \(did you mean 'source'\?\)"),
    ({"out_dir": "runs/x"}, r"'out_dir' was renamed to 'out'"),
    ({"model": {"vocab_size": 20, "max_len": 16, "attention": {"name": "efficient"}}}, "no causal form"),
    ({"model": {"vocab_size": 20, "max_len": 16, "d_mdoel": 8}}, r"unknown field\(s\) 'd_mdoel' \(did you mean 'd_model'\?\)"),
    ({"seq_len": 200}, "exceeds model.max_len"),
    ({"batch_size": 6, "grad_accum": 4}, "must divide batch_size"),
    ({"bf16": True, "dtype": "float64"}, "bf16 autocast needs"),
    ({"data": {"source": "file"}}, "needs path"),
    ({"betas": [0.9, 1.0]}, r"betas\[1\] must be < 1"),
    ({"model": {"vocab_size": 8, "max_len": 128}}, "recall_pairs = 8 needs model.vocab_size >= 18"),
])
def test_bad_configs_raise_clearly(d, match):
    with pytest.raises((ValueError, TypeError), match=match):
        TrainConfig.from_dict(d)


def test_recall_stream_is_fixed_and_well_formed():
    t = recall_tokens(30, vocab_size=20, pairs=3, queries=2)
    # golden values: the stream is a pure function of its arguments on every machine
    assert t[:15].tolist() == _GOLDEN
    ep = t[:12]  # [0, k, v, k, v, k, v, 1, q, w, q, w]
    assert ep[0] == 0 and ep[7] == 1
    keys, vals = ep[1:7:2], ep[2:7:2]
    assert len(set(keys.tolist())) == 3 and all(2 <= k < 11 for k in keys) and all(11 <= v < 20 for v in vals)
    pairs = dict(zip(keys.tolist(), vals.tolist()))
    for q, w in zip(ep[8::2], ep[9::2]):
        assert pairs[int(q)] == w
    assert not np.array_equal(recall_tokens(30, vocab_size=20, pairs=3, queries=2, stream=1), t)


_GOLDEN = [0, 6, 18, 8, 15, 3, 15, 1, 8, 15, 6, 18, 0, 9, 17]


def test_sampler_visits_every_window_once_per_epoch_and_resumes():
    s = WindowSampler(10, seed=3)
    first = s.take(7) + s.take(3)
    assert sorted(first) == list(range(10)) and s.state_dict()["epoch"] == 1
    a = WindowSampler(10, seed=3)
    a.take(13)
    b = WindowSampler(10, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.take(9) == b.take(9)
    with pytest.raises(ValueError, match="11 windows"):
        WindowSampler(11, seed=3).load_state_dict(a.state_dict())


def test_token_files(tmp_path):
    toks = (np.arange(1000) % 20).astype(np.uint16)
    np.save(tmp_path / "t.npy", toks)
    toks.tofile(tmp_path / "t.bin")
    assert np.array_equal(load_token_file(tmp_path / "t.npy"), toks)
    assert np.array_equal(load_token_file(tmp_path / "t.bin", "uint16"), toks)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="3 bytes is not a whole number of uint16"):
        load_token_file(tmp_path / "odd.bin", "uint16")
    cfg = _config(tmp_path, data={"source": "file", "path": str(tmp_path / "t.bin")}, max_steps=2, eval_every=2)
    r = train(cfg, quiet=True)
    assert np.isfinite(r.last_val_loss)
    bad = (np.arange(1000) % 30).astype(np.uint16)
    np.save(tmp_path / "bad.npy", bad)
    with pytest.raises(ValueError, match=r"outside \[0, model.vocab_size = 20\)"):
        train(_config(tmp_path, "bad", data={"source": "file", "path": str(tmp_path / "bad.npy")}), quiet=True)


def test_cli_train_and_resume(tmp_path, capsys):
    cfg = _config(tmp_path, max_steps=4, eval_every=2)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert main(["train", "--config", str(path), "--max-steps", "2", "--set", "log_every=1"]) == 0
    out = capsys.readouterr().out
    # a header, then (progress only on a terminal) where the final checkpoint is
    assert re.search(r"\[linattn train\] [\d,]+ parameters, device cpu, 1 process, output ", out), out
    assert re.search(r"finished at step 2/2, loss \d\.\d+, val_loss \d\.\d+; final checkpoint .*step_00000002", out), out
    # resume without --config reads the run's own train_config.json; max_steps may change
    assert main(["train", "--resume", "--out", cfg.out, "--max-steps", "3", "--quiet"]) == 0
    assert [s for s, _ in _records(cfg)] == [1, 2, 3]
    assert main(["train", "--config", str(path), "--out", "2024", "--data-dtype", "uint8", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["out"], printed["data"]["dtype"], printed["max_steps"]) == ("2024", "uint8", 4)
    with pytest.raises(SystemExit):
        main(["train", "--config", str(path), "--set", "model.bogus=1"])
    assert "TransformerConfig: unknown field(s) 'bogus'" in capsys.readouterr().err


def test_unusable_device_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so the test means the same on a GPU machine
    cfg = _config(tmp_path, device="cuda")
    with pytest.raises(ValueError, match=r"TrainConfig.device \(--device\) = 'cuda'.*is_available\(\) is False"):
        train(cfg, quiet=True)
    with pytest.raises(SystemExit) as e:
        main(["train", "--device", "cuda", "--out", cfg.out, "--max-steps", "1", "--quiet"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "linattn train: error: TrainConfig.device (--device) = 'cuda'" in err and "Traceback" not in err
    assert not os.path.exists(cfg.out)  # nothing written


def test_resume_drops_a_torn_last_metrics_line_and_refuses_real_damage(tmp_path, capsys):
    straight = _config(tmp_path, "straight", max_steps=6, eval_every=0)
    train(straight, quiet=True)
    cut = _config(tmp_path, "cut", max_steps=3, eval_every=0)
    train(cut, quiet=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    with open(metrics, "a") as f:  # power lost while step 4's record was being written
        f.write('{"kind": "train", "step": 4, "loss": 2.9')
    capsys.readouterr()
    train(_config(tmp_path, "cut", max_steps=6, eval_every=0), resume=True, quiet=True)
    err = capsys.readouterr().err
    assert f"{metrics}: dropped a torn last line (line 4" in err
    assert _records(cut) == _records(straight)
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:20]  # damage that is not a torn tail
    metrics.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError, match=re.escape(f"{metrics}: line 2 is not a metrics record")):
        train(_config(tmp_path, "cut", max_steps=7, eval_every=0), resume=True, quiet=True)


def _start_cli_run(tmp_path, name, **kw):
    """A real ``python -m linattn train`` process, returned once it has logged its first step."""
    cfg = _config(tmp_path, name, max_steps=100_000, eval_every=0, **kw)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "linattn", "train", "--config", str(path), "--quiet"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)  # the tests send it SIGINT
    metrics = tmp_path / name / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.stat().st_size):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the training process did not start: {proc.communicate()}")
        time.sleep(0.1)
    return cfg, proc


def test_a_second_run_on_a_busy_out_dir_fails_at_once(tmp_path, capsys):
    cfg, proc = _start_cli_run(tmp_path, "run")
    try:
        with pytest.raises(SystemExit) as e:  # the CLI, in this process, on the same out_dir
            main(["train", "--config", str(tmp_path / "run.json"), "--max-steps", "2", "--quiet"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert re.search(rf"linattn train: error: {re.escape(cfg.out)} is in use by another training run "
                         rf"\(pid {proc.pid} on {re.escape(socket.gethostname())}, started 20", err), err
        with pytest.raises(Exception, match=f"in use by another training run \\(pid {proc.pid}"):
            launch_local(_config(tmp_path, "run", max_steps=3), 2)  # under DDP every rank refuses, none hangs
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    # the lock went with the process: the run continues from its checkpoint
    stopped = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"]
    r = train(_config(tmp_path, "run", max_steps=stopped + 1, eval_every=0), resume=True, quiet=True)
    assert r.step == stopped + 1


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_cli_exits_128_plus_the_signal_after_checkpointing(tmp_path, sig, code):
    cfg, proc = _start_cli_run(tmp_path, "run")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err  # so `linattn train ... && next_step` stops here
    folder = load_train_checkpoint(os.path.join(cfg.out, "checkpoints",
                                                json.loads((tmp_path / "run" / "checkpoints" / "latest.json")
                                                           .read_text())["dir"]))
    step = folder["meta"]["step"]
    assert step >= 1 and f"stopped by {sig.name} at step {step}; continue with: linattn train --resume" in err


# ---------------------------------------------------------------------------------------------
# linattn train: --attention, generated flags, one-line errors
# ---------------------------------------------------------------------------------------------

TINY_FLAGS = ["--vocab-size", "20", "--max-len", "16", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
              "--d-ff", "32", "--seq-len", "16", "--batch-size", "4", "--eval-every", "0", "--warmup-steps", "1",
              "--data-recall-pairs", "4", "--data-recall-queries", "2", "--data-recall-tokens", "4000",
              "--data-recall-val-tokens", "400", "--quiet"]


def _saved_attention(out):
    return json.loads((out / "train_config.json").read_text())["model"]["attention"]


def test_cli_attention_by_name_and_as_json(tmp_path):
    from linattn import LocalConfig

    out = tmp_path / "local"
    assert main(["train", "--attention", "local", "--max-steps", "2", "--out", str(out), *TINY_FLAGS]) == 0
    assert _saved_attention(out) == {"name": "local", "window": LocalConfig().window}
    assert [s for s, _ in _records(TrainConfig.from_dict(json.loads((out / "train_config.json").read_text())))] == [2]
    out = tmp_path / "json"
    assert main(["train", "--attention", '{"name": "local", "window": 4}', "--max-steps", "1", "--out", str(out),
                 *TINY_FLAGS]) == 0
    assert _saved_attention(out) == {"name": "local", "window": 4}


def test_cli_attention_option_and_set_reach_the_config(tmp_path, capsys):
    for extra in (["--attention-window", "6"], ["--set", "model.attention.window=6"]):
        assert main(["train", "--attention", "local", *extra, "--print-config"]) == 0
        assert json.loads(capsys.readouterr().out)["model"]["attention"] == {"name": "local", "window": 6}
    assert main(["train", "--d-model", "64", "--data-dtype", "uint8", "--out", "7", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["model"]["d_model"], printed["data"]["dtype"], printed["out"]) == (64, "uint8", "7")


@pytest.mark.parametrize("argv, message", [
    (["--attention-window", "64"], "linattn train: error: --attention-window: 'linear' attention has no option 'window'"),
    (["--lr", "-1"], "linattn train: error: --lr: TrainConfig: lr must be a number in (0.0, inf), got -1"),
    (["--n-heads", "3"], "linattn train: error: --n-heads: TransformerConfig: n_heads = 3 must divide d_model = 128"),
    (["--data-recall-pairs", "0"], "linattn train: error: --data-recall-pairs: DataConfig: recall_pairs must be"),
])
def test_cli_validation_errors_are_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv, "--print-config"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_cli_misspelt_flag_and_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--max-step", "5"])
    assert e.value.code == 2
    assert "did you mean '--max-steps'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--dtype", "float16"])
    assert "invalid choice: 'float16' (choose from 'float32', 'float64')" in capsys.readouterr().err


def test_cli_flags_do_not_collide_and_cover_every_field():
    from linattn.cli.train import build_parser
    from linattn.models import TransformerConfig

    flags = {s for a in build_parser("linattn train")._actions for s in a.option_strings}
    for cls, prefix in ((TrainConfig, ""), (TransformerConfig, ""), (DataConfig, "data-")):
        for f in dataclasses.fields(cls):
            if f.name not in ("model", "data", "attention", "layer_attention"):
                assert "--" + (prefix + f.name).replace("_", "-") in flags, f.name
    assert {"--out", "--attention", "--set", "--config", "--resume", "--print-config", "--quiet"} <= flags


# ---------------------------------------------------------------------------------------------
# The training loop itself
# ---------------------------------------------------------------------------------------------


def _regression(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    model = torch.nn.Linear(3, 1).double()
    torch.manual_seed(seed)
    model.reset_parameters()
    return model, x, y


def _loop(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("handle_signals", False)
    kw.setdefault("quiet", True)
    return TrainingLoop(opt, params=list(model.parameters()), **kw)


def test_loop_grad_accum_equals_one_batch_of_twice_the_size():
    m1, x, y = _regression()
    m2, _, _ = _regression()
    loss = torch.nn.functional.mse_loss
    r1 = _loop(m1, max_steps=3, grad_clip=1.0, log_every=1).run(lambda step, a: loss(m1(x), y))
    r2 = _loop(m2, max_steps=3, grad_clip=1.0, log_every=1, grad_accum=2).run(
        lambda step, a: loss(m2(x[a * 4:(a + 1) * 4]), y[a * 4:(a + 1) * 4]))
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-12, atol=1e-14)
    assert [r["loss"] for r in r1.history] == pytest.approx([r["loss"] for r in r2.history], rel=1e-12)
    assert r1.step == r2.step == 3 and not r1.diverged


def test_loop_schedule_window_loss_saves_and_evaluations():
    model, x, y = _regression()
    saved, evaluated, lrs = [], [], []
    sched = CosineSchedule(lr=1.0, warmup_steps=2, decay_steps=7, min_lr_ratio=0.1)
    loop = _loop(model, max_steps=7, log_every=3, window_loss=True, schedule=sched, ckpt_every=2,
                 save=lambda step: saved.append(step) or Path(f"ck{step}"),
                 eval_every=5, evaluate=lambda step: evaluated.append(step) or {"score": float(step)},
                 on_step=lambda step, rec: lrs.append(rec["lr"]))
    # the loss of step s is s (plus 0 * the model, so that backward has a graph)
    r = loop.run(lambda step, a: (model.weight * 0).sum() + step)
    assert lrs == [sched(s) for s in range(7)] and lrs[:2] == [0.5, 1.0]
    train_recs = [(rec["step"], rec["loss"]) for rec in r.history if rec["kind"] == "train"]
    assert train_recs == [(3, 1.0), (6, 4.0), (7, 5.0)]  # the mean over the last log_every steps
    assert [(rec["step"], rec["score"]) for rec in r.history if rec["kind"] == "eval"] == [(5, 5.0), (7, 7.0)]
    assert evaluated == [5, 7] and saved == [2, 4, 6, 7] and r.checkpoint == Path("ck7")
    assert r.last_loss == 5.0 and r.last_eval == {"score": 7.0}


def test_loop_stops_at_its_time_budget_and_resumes_the_clock(tmp_path):
    model, x, y = _regression()
    saved = []

    def slow(step, a):
        time.sleep(0.02)
        return torch.nn.functional.mse_loss(model(x), y)

    with MetricsLog(tmp_path / "m.jsonl", fresh=True) as log:
        r = _loop(model, budget_s=0.1, log_every=1000, metrics=log, save=saved.append).run(slow)
    assert 0.1 <= r.elapsed_s < 0.3 and 3 <= r.step <= 8
    assert saved == [r.step]  # at the end
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in recs] == [r.step]  # the record at the end
    # resumed with most of the budget spent: one step, then the budget stops it
    r2 = _loop(model, budget_s=1.0, log_every=1000).run(slow, start_step=r.step, start_elapsed_s=0.99)
    assert r2.step == r.step + 1 and r2.elapsed_s >= 1.0


def test_loop_stops_on_a_non_finite_loss():
    model, x, y = _regression()
    saved = []

    def micro_loss(step, a):
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * float("nan") if step == 2 else loss

    r = _loop(model, max_steps=10, log_every=1, stop_on_nonfinite=True, save=saved.append).run(micro_loss)
    assert r.diverged and r.step == 3 and not r.stopped_by_signal
    assert [rec["step"] for rec in r.history] == [1, 2] and saved == []
    with pytest.raises(ValueError, match="max_steps, budget_s or both"):
        _loop(model)
