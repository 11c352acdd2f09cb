"""A whole TransformerLM under context parallelism against the same model on the whole sequence.

One launch of 2 and one of 4 gloo processes. Every rank builds the same float64 models (every
causal mechanism but LSH, a hybrid stack of softmax, local, gated_deltanet and linear layers and
one of softmax, local, gla and linear layers; rotary and learned positions; with and without a
short convolution), runs its shard of the same token sequences (equal shards, and unequal ones: a
shard of one position, an empty shard, shards shorter than the local window and the convolution's
halo) with ``context_parallel=ContextParallel(None, offset)``, and saves its logits and the
parameter gradients of its part of a loss summed over all positions (fixed random cotangents).
The test process compares the ranks' logits, in order, with the whole model's, and the SUM over
ranks of the parameter gradients with the whole model's, within 1e-10 of their scale. The 2-rank
launch also checks that LSH, bad offsets, too long a sequence and context_parallel with
cu_seqlens, return_state, key_padding_mask or causal=False raise on every rank, and that the group
still works afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from linattn.distributed import ContextParallel
from linattn.models import TransformerConfig, TransformerLM
from linattn.nn import (
    DeltaNetConfig,
    FavorConfig,
    GatedDeltaNetConfig,
    GLAConfig,
    KDAConfig,
    LinearConfig,
    LocalConfig,
    LSHConfig,
    RetNetConfig,
    SoftmaxConfig,
)
from ranks import gloo_ranks

B, N, V = 2, 20, 13
WINDOW = 5  # above some shard lengths below, so a halo reaches back over several ranks
# (name, attention, layer overrides, positional, short_conv)
MODELS = [
    ("softmax", SoftmaxConfig(), {}, "learned", 0),
    ("linear", LinearConfig(), {}, "rotary", 3),
    ("favor", FavorConfig(num_features=6), {}, "learned", 0),
    ("local", LocalConfig(window=WINDOW), {}, "rotary", 4),
    ("retnet", RetNetConfig(), {}, "rotary", 0),
    ("gla", GLAConfig(gate_rank=3), {}, "learned", 2),
    ("deltanet", DeltaNetConfig(), {}, "learned", 4),
    ("gated_deltanet", GatedDeltaNetConfig(), {}, "learned", 0),
    # grouped value heads: q and k of one head serve both value heads
    ("gated_deltanet-grouped", GatedDeltaNetConfig(n_key_heads=1), {}, "learned", 2),
    ("kda-grouped", KDAConfig(n_key_heads=1), {}, "learned", 3),
    ("hybrid-conv", LinearConfig(), {0: SoftmaxConfig(), 1: LocalConfig(window=WINDOW), 2: GatedDeltaNetConfig()},
     "learned", 3),
    ("hybrid-rotary", LinearConfig(), {0: SoftmaxConfig(), 1: LocalConfig(window=WINDOW), 2: GLAConfig(gate_rank=3)},
     "rotary", 0),
]
# world size -> shard lengths, each summing to N: equal shards (what training uses), then unequal
SPLITS = {2: [[10, 10], [13, 7]], 4: [[5, 5, 5, 5], [3, 1, 0, 16]]}


def _model(name: str) -> TransformerLM:
    _, attention, layers, positional, conv = next(m for m in MODELS if m[0] == name)
    config = TransformerConfig(vocab_size=V, max_len=32, d_model=8, n_layers=4 if layers else 2, n_heads=2,
                               d_ff=12, attention=attention, layer_attention=layers, positional=positional,
                               short_conv=conv, init_std=0.3)
    torch.manual_seed(0)
    model = TransformerLM(config).double()
    if conv:  # away from the identity it starts at, so that the taps reaching back matter
        with torch.no_grad():
            for block in model.blocks:
                block.attn.conv.weight.normal_(0.0, 0.5)
    return model


def _problem():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, N), generator=g)
    cot = torch.randn(B, N, V, generator=g, dtype=torch.float64)  # d loss / d logits
    return ids, cot


def _run(name: str, lo: int, hi: int, context_parallel) -> dict:
    """Logits of positions lo:hi and the parameter gradients of sum(logits * cot[lo:hi])."""
    model = _model(name)
    ids, cot = _problem()
    logits = model(ids[:, lo:hi], context_parallel=context_parallel)
    (logits * cot[:, lo:hi]).sum().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "grads": grads}


def _catch(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors(rank: int) -> dict:
    ids, _ = _problem()
    lo, hi = (0, 10) if rank == 0 else (10, 20)
    shard = ids[:, lo:hi]
    here = ContextParallel(None, lo)
    lsh = TransformerLM(TransformerConfig(vocab_size=V, max_len=32, d_model=8, n_layers=2, n_heads=2, d_ff=12,
                                          attention=LinearConfig(), layer_attention={1: LSHConfig(bucket_size=5)}))
    model = _model("hybrid-conv")
    out = {
        "lsh": _catch(lambda: lsh(shard, context_parallel=here)),
        "offset": _catch(lambda: model(shard, context_parallel=ContextParallel(None, 3 if rank == 1 else 0))),
        "max_len": _catch(lambda: model(ids[:, :15] if rank == 0 else ids, context_parallel=ContextParallel(
            None, 0 if rank == 0 else 15))),
        "return_state": _catch(lambda: model(shard, context_parallel=here, return_state=True)),
        "mask": _catch(lambda: model(shard, context_parallel=here,
                                     key_padding_mask=torch.ones(shard.shape, dtype=torch.bool))),
        "cu_seqlens": _catch(lambda: model(ids[:1, lo:hi], context_parallel=here,
                                           cu_seqlens=torch.tensor([0, 4, hi - lo]))),
        "bidirectional": _catch(lambda: model.blocks[0].attn(torch.zeros(B, hi - lo, 8, dtype=torch.float64),
                                                             causal=False, context_parallel=here)),
        "type": _catch(lambda: model(shard, context_parallel=(None, lo))),
    }
    flag = torch.ones(1)
    dist.all_reduce(flag)  # the group still works after the errors
    out["after"] = flag.item() == 2
    return out


def _results(rank: int, P: int) -> dict:
    """This rank's results on every case (run on each of P gloo processes)."""
    results = {}
    for si, lengths in enumerate(SPLITS[P]):
        lo = sum(lengths[:rank])
        hi = lo + lengths[rank]
        for name, *_ in MODELS:
            results[(name, si)] = _run(name, lo, hi, ContextParallel(None, lo))
    if P == 2:
        results["errors"] = _errors(rank)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def launched(request, tmp_path_factory):
    """One launch of P gloo processes; every rank's results."""
    return request.param, gloo_ranks(_results, request.param, tmp_path_factory.mktemp(f"cpm{request.param}"))


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(got, want, atol=1e-10 * scale, rtol=1e-10, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", [m[0] for m in MODELS])
def test_sharded_model_equals_whole_model(launched, name):
    P, results = launched
    want = _run(name, 0, N, None)
    assert any(g.abs().max() > 0 for g in want["grads"].values())
    for si, lengths in enumerate(SPLITS[P]):
        per_rank = [r[(name, si)] for r in results]
        where = f"{name} P={P} shards {lengths}"
        _close(torch.cat([r["logits"] for r in per_rank], dim=1), want["logits"], f"{where}: logits")
        for pname, g in want["grads"].items():
            _close(sum(r["grads"][pname] for r in per_rank), g, f"{where}: grad of {pname}")


@pytest.mark.parametrize("launched", [2], indirect=True, ids=["P2"])
def test_refused_combinations_raise_on_every_rank(launched):
    _, results = launched
    for rank, r in enumerate(results):
        e = r["errors"]
        assert e["lsh"].startswith("ValueError") and "layer 1 uses 'lsh'" in e["lsh"], e["lsh"]
        assert e["offset"].startswith("ValueError") and "running sums" in e["offset"], e["offset"]
        assert "rank 1: offset 3, 10 positions" in e["offset"], e["offset"]
        assert e["max_len"].startswith("ValueError") and "35 positions" in e["max_len"], e["max_len"]
        for key in ("return_state", "mask", "cu_seqlens"):
            assert e[key].startswith("ValueError") and "context_parallel is not supported together" in e[key], e[key]
        assert e["bidirectional"].startswith("ValueError") and "causal=True" in e["bidirectional"], e["bidirectional"]
        assert e["type"].startswith("TypeError") and "ContextParallel" in e["type"], e["type"]
        assert e["after"] is True, rank


def test_no_process_group_is_the_plain_forward():
    assert not dist.is_initialized()
    model = _model("hybrid-conv")
    ids, _ = _problem()
    torch.testing.assert_close(model(ids, context_parallel=ContextParallel()), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="offset = 3 but there is no group of several ranks"):
        model(ids[:, 3:], context_parallel=ContextParallel(None, 3))
