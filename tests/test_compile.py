"""torch.compile(fullgraph=True) of every public causal fast form and of a TransformerLM
forward+backward traces without a graph break and matches eager (issue 29). The chunked engines
are torch.library custom ops with fake shapes and registered autograd, so the compiler sees one op
per call instead of unrolling the chunk loop; the value checks are device-side assertions and
packed documents are laid out without a host read, so nothing forces a break.

Small sizes: the point is that it traces whole and agrees, not its speed here.
"""

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.models import TransformerConfig, TransformerLM
from linattn.nn.registry import MECHANISMS

N = 70  # two chunks and a partial one at every default chunk length
CU = torch.tensor([0, 20, 21, 21, N], dtype=torch.int64)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, N, 8, generator=g) for _ in range(3))
    return {
        "q": q, "k": k, "v": v,
        "kn": F.normalize(torch.randn(1, 2, N, 8, generator=g), dim=-1),
        "head": F.logsigmoid(torch.randn(1, 2, N, generator=g) + 2),
        "channel": F.logsigmoid(torch.randn(1, 2, N, 8, generator=g) + 2),
        "beta": torch.rand(1, 2, N, generator=g),
        "W": linattn.favor_projection(16, 8, generator=g),
    }


FORMS = {
    "linear": (("q", "k", "v"), lambda q, k, v: linattn.linear_attention(q, k, v, causal=True)),
    "linear packed": (("q", "k", "v"), lambda q, k, v: linattn.linear_attention(q, k, v, causal=True,
                                                                                cu_seqlens=CU)),
    "gla per head": (("q", "k", "v", "head"), lambda q, k, v, g: linattn.gated_linear_attention(q, k, v, g)),
    "gla per channel": (("q", "k", "v", "channel"),
                        lambda q, k, v, g: linattn.gated_linear_attention(q, k, v, g)),
    "gla packed": (("q", "k", "v", "head"),
                   lambda q, k, v, g: linattn.gated_linear_attention(q, k, v, g, cu_seqlens=CU)),
    "deltanet": (("q", "kn", "v", "beta"), lambda q, k, v, b: linattn.delta_rule_attention(q, k, v, b)),
    "gated deltanet": (("q", "kn", "v", "beta", "head"),
                       lambda q, k, v, b, g: linattn.delta_rule_attention(q, k, v, b, log_decay=g)),
    "gated deltanet packed": (("q", "kn", "v", "beta", "head"),
                              lambda q, k, v, b, g: linattn.delta_rule_attention(q, k, v, b, log_decay=g,
                                                                                 cu_seqlens=CU)),
    "kda": (("q", "kn", "v", "beta", "channel"),
            lambda q, k, v, b, g: linattn.delta_rule_attention(q, k, v, b, log_decay=g)),
    "kda grouped packed": (("q", "kn", "v", "beta", "channel"),
                           lambda q, k, v, b, g: linattn.delta_rule_attention(q[:, :1], k[:, :1], v, b, log_decay=g,
                                                                              cu_seqlens=CU)),
}


def _forms(W):
    return {
        **FORMS,
        "favor": (("q", "k", "v"), lambda q, k, v: linattn.favor_attention(q, k, v, W, causal=True)),
        "favor packed": (("q", "k", "v"), lambda q, k, v: linattn.favor_attention(q, k, v, W, causal=True,
                                                                                  cu_seqlens=CU)),
    }


def _run(fn, tensors):
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("name", list(FORMS) + ["favor", "favor packed"])
def test_fast_forms_compile_whole_and_match_eager(name):
    x = _inputs()
    keys, fn = _forms(x["W"])[name]
    tensors = [x[key] for key in keys]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)  # a graph break raises
    got, got_grads = _run(compiled, tensors)
    want, want_grads = _run(fn, tensors)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "favor", "gla", "gated_deltanet", "kda"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_model_compiles_whole_and_matches_eager(name, packed):
    """The whole model's forward and backward in one graph (dynamo raises at a break), through
    AOTAutograd (the engine ops' fake shapes and registered backward), equal to eager. Inductor
    compiles one of them, KDA packed: every engine op is compiled by inductor in
    test_fast_forms_compile_whole_and_match_eager already, and inductor's code generation for the
    model's own layers (10 s a model here) is torch's to test, not ours."""
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=23, d_model=32, n_heads=2, n_layers=2, max_len=N,
                            attention=MECHANISMS[name].default_config(), short_conv=3 if name != "favor" else 0)
    model = TransformerLM(cfg)
    ids = torch.randint(0, 23, (1, N))
    cu = CU if packed else None

    def step(m):
        m.zero_grad()
        loss = F.cross_entropy(m(ids, cu_seqlens=cu)[0, :-1], ids[0, 1:])
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if (name, packed) == ("kda", True) else "aot_eager")
    got, got_grads = step(compiled)
    want, want_grads = step(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


_FIRST_CALLS = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from test_compile import _forms, _inputs, _run
x = _inputs()
for name, (args, fn) in _forms(x["W"]).items():
    _run(fn, [x[a] for a in args])
print("torch._dynamo" in sys.modules)
"""


def test_the_engines_first_calls_do_not_import_dynamo():
    """The engine operators are defined through torch.library's define/impl (checks.EngineOp), not
    custom_op, whose kernel wrapper imports torch._dynamo on an operator's first call (0.6 s of a
    process's first call, and the import that made torch hold a process group): every fast form's
    forward and backward in a fresh process leaves it unimported."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _FIRST_CALLS, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


@pytest.mark.parametrize("name", list(FORMS) + ["favor"])
def test_a_second_backward_is_refused(name):
    """Differentiable once: a gradient taken with create_graph=True cannot be differentiated again
    (the engines' backward operators refuse, rather than leave the second-order terms out)."""
    x = _inputs()
    args, fn = _forms(x["W"])[name]
    leaves = [x[a].clone().requires_grad_() for a in args]
    (dq,) = torch.autograd.grad(fn(*leaves).square().sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once|differentiate twice"):
        dq.sum().backward()
