"""linattn.distributed (context parallelism) against the functional form on the whole sequence.

One launch of 2 and one of 4 gloo processes on this machine: each rank runs every mechanism on its
shard of a sequence (unequal shards, one of length 1, one launch also with an empty one), takes the
gradients of a loss with fixed random cotangents (its slice of the output's, and its own for the
returned final state, so that state gradients from every rank count) and saves what it got. The
test process computes the single-process reference from the same inputs and compares outputs,
every input gradient (q, k, v, log_decay, beta, rank 0's initial state) and the final state of
every rank: float64 within 1e-10, float32 within 1e-5 of the values' scale, bfloat16 inputs'
outputs and gradients within 2e-2 and their float32 states within 1e-5. The 2-rank launch
also checks the errors a bad shard raises (on every rank, without a hang) and the group of one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import linattn.distributed as cp
import linattn.functional as fx
from linattn.functional import DecayedState, LinearAttentionState
from ranks import gloo_ranks

B, H, D, DV, M = 2, 2, 5, 3, 7  # M: FAVOR's random features
N = 37
CHUNK = 8  # below the shard lengths, so the functional forms run several chunks

# (name, mechanism, options); every case runs in float64 and float32
CASES = [
    ("linear-elu-init", "linear", dict(feature_map="elu", init=True)),
    ("favor-positive-init", "favor", dict(kernel="softmax", features="positive", init=True)),
    ("favor-relu", "favor", dict(kernel="relu", features="positive", init=False)),
    ("gated-head-init", "gated", dict(per_channel=False, init=True)),
    ("gated-channel", "gated", dict(per_channel=True, init=False)),
    ("delta-init", "delta", dict(decay=False, init=True)),
    ("delta-decay-init", "delta", dict(decay=True, init=True)),
    ("delta-decay", "delta", dict(decay=True, init=False)),
]
# world size -> shard lengths (each sums to N); float64 runs them all, the other dtypes the first
SPLITS = {2: [[20, 17]], 4: [[11, 1, 16, 9], [0, 13, 1, 23]]}
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
# relative tolerance by the dtype of the tensor compared: bfloat16 outputs and gradients are
# rounded to 8 bits from float32 sums that the two computations add in different orders; their
# states are float32 (summaries travel in float32), held to float32's tolerance
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(mech: str, opts: dict, dtype: torch.dtype, P: int, seed: int = 0) -> dict:
    """The whole sequence's inputs (float64 drawn, then cast), the initial state or None, the
    output's cotangent and one final-state cotangent per rank."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = rnd(B, H, N, D), rnd(B, H, N, D), rnd(B, H, N, DV)
    extra, init, fields = {}, None, ["S", "z"]
    if mech == "linear":
        if opts["init"]:
            kp, vp = rnd(B, H, 6, D), rnd(B, H, 6, DV)
            _, st = fx.linear_attention(kp, kp, vp, causal=True, return_state=True, feature_map=opts["feature_map"])
            init = LinearAttentionState(st.S, st.z)
    elif mech == "favor":
        extra["projection"] = fx.favor_projection(M, D, generator=torch.Generator().manual_seed(seed + 1),
                                                  dtype=torch.float64)
        if opts["init"]:
            kp, vp = rnd(B, H, 6, D), rnd(B, H, 6, DV)
            _, init = fx.favor_attention(kp, kp, vp, extra["projection"], causal=True, return_state=True,
                                         kernel=opts["kernel"], features=opts["features"])
    elif mech == "gated":
        shape = (B, H, N, D) if opts["per_channel"] else (B, H, N)
        extra["log_decay"] = F.logsigmoid(rnd(*shape) + 2)
        fields = ["s"]
        if opts["init"]:
            init = DecayedState(rnd(B, H, D, DV))
    else:
        k = F.normalize(k, dim=-1)
        extra["beta"] = torch.sigmoid(rnd(B, H, N)) * 1.5
        if opts["decay"]:
            extra["log_decay"] = F.logsigmoid(rnd(B, H, N) + 2)
        fields = ["s"]
        if opts["init"]:
            init = DecayedState(rnd(B, H, D, DV) * 0.5)
    cot = rnd(B, H, N, DV)
    Fd = M if mech == "favor" else D
    state_cots = [{"S": rnd(B, H, Fd, DV), "z": rnd(B, H, Fd), "s": rnd(B, H, D, DV)} for _ in range(P)]

    def cast(t):
        return None if t is None else t.to(dtype)

    if init is not None:
        init = type(init)(*(cast(t) for t in init))
    return dict(q=cast(q), k=cast(k), v=cast(v), extra={n: cast(t) for n, t in extra.items()}, init=init,
                fields=fields, cot=cast(cot), state_cots=[{n: cast(t) for n, t in c.items()} for c in state_cots])


def _call(where, mech: str, opts: dict, q, k, v, extra: dict, init, **kw):
    """The mechanism from ``where`` (``fx``: functional, causal, whole sequence; ``cp``: sharded)."""
    causal = dict(causal=True) if where is fx else {}
    if mech == "linear":
        return where.linear_attention(q, k, v, feature_map=opts["feature_map"], initial_state=init,
                                      chunk_size=CHUNK, **causal, **kw)
    if mech == "favor":
        return where.favor_attention(q, k, v, extra["projection"], kernel=opts["kernel"], features=opts["features"],
                                     initial_state=init, chunk_size=CHUNK, **causal, **kw)
    if mech == "gated":
        return where.gated_linear_attention(q, k, v, extra["log_decay"], initial_state=init, chunk_size=CHUNK, **kw)
    return where.delta_rule_attention(q, k, v, extra["beta"], log_decay=extra.get("log_decay"), initial_state=init,
                                      chunk_size=CHUNK, **kw)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _run_and_grad(where, mech, opts, prob, lo: int, hi: int, state_cots: list[dict], kw: dict) -> dict:
    """Positions [lo, hi) through ``where``: output, final state and the gradients of
    <out, cot[lo:hi]> + sum of <state field, cotangent> over ``state_cots``."""
    q, k, v = (_leaf(prob[n][:, :, lo:hi]) for n in ("q", "k", "v"))
    extra = {n: t if n == "projection" else _leaf(t[:, :, lo:hi]) for n, t in prob["extra"].items()}
    init = None if prob["init"] is None else type(prob["init"])(
        *(None if t is None else (_leaf(t) if i < 2 else t.clone()) for i, t in enumerate(prob["init"])))
    out, st = _call(where, mech, opts, q, k, v, extra, init, return_state=True, **kw)
    loss = (out * prob["cot"][:, :, lo:hi]).sum()
    for c in state_cots:
        for f in prob["fields"]:
            loss = loss + (getattr(st, f) * c[f]).sum()
    wrt = {"q": q, "k": k, "v": v, **{n: t for n, t in extra.items() if n != "projection"}}
    if init is not None:
        wrt.update({f"init.{f}": getattr(init, f) for f in prob["fields"]})
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    result = {"out": out.detach(), **{f"state.{f}": t.detach() for f, t in zip(st._fields, st) if t is not None}}
    for (n, t), g in zip(wrt.items(), grads):
        if g is None and hi == lo and not n.startswith("init."):
            g = torch.zeros_like(t)  # an empty shard's inputs may be left out of the graph
        result[f"grad.{n}"] = g
    return result


def _catch(fn) -> str:
    """The message of the exception ``fn()`` raises, or 'no error'."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors(rank: int) -> dict:
    """Bad shards on a 2-rank group: what each rank hears."""
    prob = _problem("gated", dict(per_channel=False, init=False), torch.float64, 2)
    q, k, v, g = prob["q"][:, :, :9], prob["k"][:, :, :9], prob["v"][:, :, :9], prob["extra"]["log_decay"][:, :, :9]
    beta = torch.full((B, H, 9), 0.5, dtype=torch.float64)
    found = {}
    # one rank's D differs (its q and k agree with each other, so its local call succeeds)
    qd, kd = (torch.randn(B, H, 9, D + 1, dtype=torch.float64) if rank == 1 else t for t in (q, k))
    found["D"] = _catch(lambda: cp.gated_linear_attention(qd, kd, v, g))
    # one rank's dtype differs
    cast = (lambda t: t.float()) if rank == 1 else (lambda t: t)
    found["dtype"] = _catch(lambda: cp.gated_linear_attention(cast(q), cast(k), cast(v), cast(g)))
    # one rank's local call fails (beta out of [0, 2]): its own error there, the others name it
    bad_beta = beta * 5 if rank == 1 else beta
    found["local"] = _catch(lambda: cp.delta_rule_attention(q, F.normalize(k, dim=-1), v, bad_beta))
    # one rank builds a graph, the other does not
    qg = q.clone().requires_grad_(rank == 0)
    found["grad"] = _catch(lambda: cp.gated_linear_attention(qg, k, v, g))
    found["mask"] = _catch(lambda: cp.linear_attention(q, k, v, key_padding_mask=torch.ones(B, 9, dtype=torch.bool)))
    # the group is still in step after all that: a good call gives what it gave before
    found["after"] = torch.equal(cp.gated_linear_attention(q, k, v, g), cp.gated_linear_attention(q, k, v, g))
    # a group of one rank is the functional call itself
    singles = [dist.new_group([0]), dist.new_group([1])]
    got = cp.gated_linear_attention(q, k, v, g, group=singles[rank], return_state=True)
    want = fx.gated_linear_attention(q, k, v, g, return_state=True)
    found["single"] = torch.equal(got[0], want[0]) and torch.equal(got[1].s, want[1].s)
    return found


def _results(rank: int, P: int) -> dict:
    """This rank's results on every case (run on each of P gloo processes)."""
    results = {}
    for dtype in DTYPES:
        splits = SPLITS[P] if dtype == torch.float64 else SPLITS[P][:1]
        for si, lengths in enumerate(splits):
            lo = sum(lengths[:rank])
            hi = lo + lengths[rank]
            for name, mech, opts in CASES:
                prob = _problem(mech, opts, dtype, P)
                results[(name, str(dtype), si)] = _run_and_grad(cp, mech, opts, prob, lo, hi,
                                                                [prob["state_cots"][rank]], {})
    if P == 2:
        results["errors"] = _errors(rank)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"P{p}")
def launched(request, tmp_path_factory):
    """One launch of P gloo processes; every rank's results."""
    return request.param, gloo_ranks(_results, request.param, tmp_path_factory.mktemp(f"cp{request.param}"))


def _close(got, want, what):
    tol = TOLERANCE[want.dtype]
    assert got is not None, f"{what}: no gradient"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name,mech,opts", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32", "bf16"])
def test_sharded_equals_whole_sequence(launched, name, mech, opts, dtype):
    P, results = launched
    splits = SPLITS[P] if dtype == torch.float64 else SPLITS[P][:1]
    prob = _problem(mech, opts, dtype, P)
    ref = _run_and_grad(fx, mech, opts, prob, 0, N, prob["state_cots"], {})
    for si, lengths in enumerate(splits):
        per_rank = [r[(name, str(dtype), si)] for r in results]
        where = f"{name} {dtype} P={P} shards {lengths}"
        for key, want in ref.items():
            if key.startswith("state."):  # every rank returns the state after the whole sequence
                for r, res in enumerate(per_rank):
                    _close(res[key], want, f"{where}: rank {r} {key}")
            elif key.startswith("grad.init."):  # only rank 0's initial state is read
                _close(per_rank[0][key], want, f"{where}: {key}")
                for r, res in enumerate(per_rank[1:], 1):
                    assert res[key] is None, f"{where}: rank {r} {key} should be unused"
            else:  # per position: the ranks' pieces in order are the whole
                _close(torch.cat([res[key] for res in per_rank], dim=2), want, f"{where}: {key}")


@pytest.mark.parametrize("launched", [2], indirect=True, ids=["P2"])
def test_bad_shards_raise_on_every_rank(launched):
    P, results = launched
    assert P == 2
    e0, e1 = results[0]["errors"], results[1]["errors"]
    for e in (e0, e1):
        assert e["D"].startswith("ValueError") and "differ in D (rank 0: 5, rank 1: 6)" in e["D"], e["D"]
        assert "dtype (rank 0: torch.float64, rank 1: torch.float32)" in e["dtype"], e["dtype"]
        assert "build a graph" in e["grad"] and "rank 0: yes, rank 1: no" in e["grad"], e["grad"]
        assert e["mask"].startswith("ValueError") and "key_padding_mask is not supported" in e["mask"]
        assert e["after"] is True and e["single"] is True
    assert "beta" in e1["local"] and e1["local"].startswith("ValueError"), e1["local"]
    assert "rank(s) [1] of the group rejected their shard" in e0["local"], e0["local"]


def test_no_process_group_is_the_functional_call():
    assert not dist.is_initialized()
    prob = _problem("delta", dict(decay=True, init=True), torch.float64, 1)
    args = (prob["q"], prob["k"], prob["v"], prob["extra"]["beta"])
    got = cp.delta_rule_attention(*args, log_decay=prob["extra"]["log_decay"], initial_state=prob["init"],
                                  return_state=True)
    want = fx.delta_rule_attention(*args, log_decay=prob["extra"]["log_decay"], initial_state=prob["init"],
                                   return_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].s, want[1].s)
    with pytest.raises(ValueError, match="group was given but torch.distributed has no initialised process group"):
        cp.linear_attention(prob["q"], prob["k"], prob["v"], group=object())
