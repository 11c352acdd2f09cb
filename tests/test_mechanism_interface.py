"""One mechanism interface (issue 30): every mechanism module has the same forward, names its
functional form's inputs (``functional_inputs``) faithfully, refuses what it cannot do, and neither
branches on context parallelism nor imports ``linattn.distributed``; a new mechanism registered
once appears in every command, benchmark, the demo's error table and context parallelism."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import linattn
import toy_mechanism
from linattn.bench.demo import fast_vs_reference_errors
from linattn.cli import main
from linattn.distributed import ContextParallel
from linattn.models import TransformerConfig, TransformerLM
from linattn.nn.mechanisms import Mechanism
from linattn.nn.registry import MECHANISMS, parse_mechanisms
from ranks import gloo_ranks

NN = Path(linattn.__file__).parent / "nn"
H, D = 2, 8


def test_nn_does_not_import_distributed():
    for path in sorted(NN.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = ("." * node.level) + (node.module or "")
                assert "distributed" not in target, f"{path.name} imports {target}"
            elif isinstance(node, ast.Import):
                assert not any("linattn.distributed" in a.name for a in node.names), path.name


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_one_forward_and_no_context_parallel_branch(name):
    cls = MECHANISMS[name].module_type
    assert cls.forward is Mechanism.forward, f"{cls.__name__} overrides forward"
    for klass in cls.__mro__:
        if klass is Mechanism or not issubclass(klass, Mechanism):
            continue
        assert "context_parallel" not in inspect.getsource(klass), f"{klass.__name__} names context_parallel"
    # a sharded form in the registry is exactly a module with a sharding
    assert MECHANISMS[name].sharded == (cls.sharding is not None)


def _inputs(name, n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, n, D, generator=g) for _ in range(3))
    if MECHANISMS[name].shared_qk:
        k = q
    return q, k, v, torch.randn(1, n, H * D, generator=g)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_functional_inputs_are_what_the_module_computes(name):
    """forward = functional_output(function(*functional_inputs)), exactly, in every form: what
    the demo, the benchmarks and context parallelism run is the module's own computation."""
    spec = MECHANISMS[name]
    torch.manual_seed(0)
    module = spec.build(n_heads=H, head_dim=D, max_len=64).eval()  # eval: FAVOR's redraw policy idle
    q, k, v, x = _inputs(name)
    for form in ("bidirectional", "causal"):
        if form not in spec.forms:
            continue
        causal = form == "causal"
        want = module(q, k, v, x=x, causal=causal)
        tensors, options = module.functional_inputs(q, k, v, x, causal=causal)
        got = module.functional_output(spec.function(*tensors, **options), x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name} {form}")


@pytest.mark.parametrize("name", sorted(n for n, s in MECHANISMS.items() if not s.module_type.packed))
def test_a_mechanism_without_a_packed_form_refuses_cu_seqlens(name):
    spec = MECHANISMS[name]
    module = spec.build(n_heads=H, head_dim=D, max_len=64)
    q, k, v, x = _inputs(name)
    with pytest.raises(ValueError, match=f"'{name}' attention has no packed form \\(cu_seqlens\\)"):
        module(q, k, v, x=x, causal=False, cu_seqlens=torch.tensor([0, 5, 64]))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(MECHANISMS, "toy", toy_mechanism.SPEC)
    return toy_mechanism.SPEC


def test_toy_reference_is_the_fast_form():
    q, k, v, _ = _inputs("linear", n=9)
    s0 = torch.randn(1, H, D, D)
    got = toy_mechanism.toy_attention(q.double(), k.double(), v.double(), initial_state=s0.double(),
                                      return_state=True)
    want = toy_mechanism.toy_attention_reference(q.double(), k.double(), v.double(), initial_state=s0.double(),
                                                 return_state=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_registered_mechanism_appears_in_commands_benchmarks_and_the_demo(toy, capsys):
    # the commands: parsed by name, listed in the help of every command that takes mechanisms
    assert parse_mechanisms("toy,linear")[0] == toy.config_type()
    for argv in (["bench", "sweep", "--help"], ["bench", "generate", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "toy" in capsys.readouterr().out, argv
    # the demo's error table: its causal form and its step-by-step decoding against its reference
    errors = fast_vs_reference_errors(n=32)
    assert errors["toy causal"] < 1e-4 and errors["toy recurrent (step by step)"] < 1e-4
    # a model, and the benchmarks' harness (which builds modules from the registry)
    from linattn.bench.harness import Case, attention_fn, call, make_inputs

    case = Case("toy", causal=True, n=16, n_heads=H, head_dim=D)
    inputs, fn = make_inputs(case), attention_fn(case)
    call(case, inputs, fn)  # a timed call: forward and backward
    out = fn(*inputs)
    assert out.shape == (1, H, 16, D) and torch.isfinite(out).all()
    lm = TransformerLM(TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=2, max_len=32,
                                         attention=toy.config_type()))
    ids = torch.randint(0, 11, (1, 12))
    logits, state = lm(ids[:, :-1], return_state=True)
    step, _ = lm.step(ids[:, -1:], state)  # decoding through the toy's recurrent form
    last = lm(ids)[:, -1]  # (1, V)
    torch.testing.assert_close(step.reshape(last.shape), last)


def test_a_registered_mechanism_runs_sharded_with_a_group_of_one(toy):
    lm = TransformerLM(TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=2, max_len=32,
                                         attention=toy.config_type()))
    ids = torch.randint(0, 11, (1, 12))
    torch.testing.assert_close(lm(ids, context_parallel=ContextParallel()), lm(ids), rtol=0, atol=0)


def _toy_sharded(rank: int, P: int) -> dict:
    """On each of 2 gloo ranks: the toy model on this rank's shard, and its parameter gradients."""
    toy_mechanism.register()
    torch.manual_seed(0)
    lm = TransformerLM(TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=2, max_len=32,
                                         attention=toy_mechanism.ToyConfig())).double()
    ids = torch.randint(0, 11, (1, 20), generator=torch.Generator().manual_seed(1))
    lo, hi = (0, 7) if rank == 0 else (7, 20)
    logits = lm(ids[:, lo:hi], context_parallel=ContextParallel(None, lo))
    logits.square().sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in lm.named_parameters()}}


def test_a_registered_mechanism_runs_sharded_over_two_ranks(toy, tmp_path):
    """Context parallelism with nothing but the toy's SHARDING: 2 gloo ranks equal the whole."""
    results = gloo_ranks(_toy_sharded, 2, tmp_path)
    torch.manual_seed(0)
    lm = TransformerLM(TransformerConfig(vocab_size=11, d_model=H * D, n_heads=H, n_layers=2, max_len=32,
                                         attention=toy.config_type())).double()
    ids = torch.randint(0, 11, (1, 20), generator=torch.Generator().manual_seed(1))
    logits = lm(ids)
    logits.square().sum().backward()
    torch.testing.assert_close(torch.cat([r["logits"] for r in results], 1), logits.detach())
    for n, p in lm.named_parameters():
        torch.testing.assert_close(results[0]["grads"][n] + results[1]["grads"][n], p.grad, msg=n)
