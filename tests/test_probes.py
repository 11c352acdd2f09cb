"""The dispatch probe (tests/probes.py) that the portability work measures with, and the fast forms
that are already portable: no float64 op and no host read in a float32 forward+backward. A form
that starts using either fails here (issue 29 extends the list as the others are made portable)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import linattn
from probes import OpProbe, deterministic_algorithms


def test_the_probe_sees_host_reads_and_float64():
    x = torch.randn(4, 4)
    with OpProbe() as p:
        y = (x @ x).sum()
        assert p.n_host_reads == 0 and not p.float64_ops
        float(y)  # a host read
        bool((x > 0).any())  # another
        x[0].tolist()  # a third, with no ATen op on a CPU tensor
        x[x > 0]  # a bool index: the host reads how many
        x.double().sum()  # float64 ops
    assert p.n_host_reads == 4, p.host_reads
    assert sum(p.float64_ops.values()) >= 2 and p.ops["aten.mm.default"] == 1


def test_the_probe_sees_scans_that_cuda_runs_on_copies():
    x = torch.randn(4, 6)
    with OpProbe() as p:
        x.cumsum(0)  # contiguous: summed as it is
        x.t().contiguous().cumsum_(1)
        x[:, :5].cumsum(1)  # a strided input: copied first on CUDA
        torch.cumsum(x, 1, out=torch.empty(6, 4).t())  # a strided result: summed elsewhere, copied back
    assert sum(p.cuda_scan_copies.values()) == 2, p.cuda_scan_copies


def _probe(fn, *inputs):
    with OpProbe() as p:
        fn(*inputs).sum().backward()
    return p


def test_causal_linear_attention_is_portable():
    q, k, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(3))
    p = _probe(lambda q, k, v: linattn.linear_attention(q, k, v, causal=True), q, k, v)
    assert not p.float64_ops and p.n_host_reads == 0, (p.float64_ops, p.host_reads)
    assert all(t.grad is not None for t in (q, k, v))


def test_delta_rule_without_decay_computes_in_float32():
    q, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(2))
    k = F.normalize(torch.randn(1, 2, 300, 16), dim=-1).requires_grad_()
    beta = torch.rand(1, 2, 300).requires_grad_()
    p = _probe(lambda q, k, v, b: linattn.delta_rule_attention(q, k, v, b), q, k, v, beta)
    assert not p.float64_ops, p.float64_ops


def test_gate_value_checks_read_nothing_from_the_host():
    """log_decay <= 0 and beta in [0, 2] are checked on every call without a host read (a device-side
    assertion; on the CPU it raises at once, as the ValueError naming the value)."""
    q, v = (torch.randn(1, 2, 300, 16, requires_grad=True) for _ in range(2))
    k = F.normalize(torch.randn(1, 2, 300, 16), dim=-1).requires_grad_()
    beta = torch.rand(1, 2, 300).requires_grad_()
    head = F.logsigmoid(torch.randn(1, 2, 300) + 3).requires_grad_()
    channel = F.logsigmoid(torch.randn(1, 2, 300, 16) + 3).requires_grad_()
    for name, fn in (("gated per head", lambda: linattn.gated_linear_attention(q, k, v, head)),
                     ("gated per channel", lambda: linattn.gated_linear_attention(q, k, v, channel)),
                     ("gated delta rule", lambda: linattn.delta_rule_attention(q, k, v, beta, log_decay=head))):
        p = _probe(fn)
        assert p.n_host_reads == 0, (name, p.host_reads)
    bad = head.detach().clone()
    bad[0, 1, 7] = 0.5
    with pytest.raises(ValueError, match=r"log_decay must be <= 0 .* got 0\.5"):
        linattn.gated_linear_attention(q, k, v, bad)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\] .* got nan"):
        linattn.delta_rule_attention(q, k, v, torch.full_like(beta, float("nan")))


def test_linear_attention_passes_tile_positions_on_with_packed_documents(monkeypatch):
    """The packed form runs on the decayed engine's log-decay path, which has tiles too: the knob
    reaches it (not accepted and ignored), and any value gives the same result."""
    from linattn.functional import gated

    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    cu = torch.tensor([0, 10, 40])
    seen = []
    engine = gated.decayed_product

    def spy(*args, **kwargs):
        seen.append(kwargs["tile_positions"])
        return engine(*args, **kwargs)

    monkeypatch.setattr(gated, "decayed_product", spy)
    packed = linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu, tile_positions=16, chunk_size=4)
    assert seen == [16]
    default = linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu)
    assert seen == [16, 4096]
    tiled = linattn.linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], causal=True, tile_positions=16,
                                     chunk_size=4)
    torch.testing.assert_close(packed[:, :, 10:], tiled)
    torch.testing.assert_close(default, packed)
    with pytest.raises(ValueError, match="tile_positions"):
        linattn.linear_attention(q, k, v, causal=True, cu_seqlens=cu, tile_positions=0)


from linattn.models import TransformerConfig, TransformerLM  # noqa: E402
from linattn.nn.registry import MECHANISMS  # noqa: E402

# LSH cuts its buckets over the whole call. Softmax's packed form is one SDPA call per document: it
# reads the lengths once per cu_seqlens tensor (varlen.document_lengths), so once per model forward.
PACKABLE = [name for name, spec in MECHANISMS.items() if spec.causal and name != "lsh"]


def test_document_lengths_are_read_once_per_tensor_and_again_after_an_in_place_change():
    """The lengths kept on the tensor follow its version counter (a torch internal: this fails the
    day it stops counting in-place changes)."""
    from linattn.functional.varlen import document_lengths

    cu = torch.tensor([0, 3, 3, 10])
    with OpProbe() as p:
        assert document_lengths(cu) == [3, 0, 7]
        assert document_lengths(cu) == [3, 0, 7]
    assert p.n_host_reads == 1, p.host_reads
    cu[1] = 5  # in place: the kept lengths are stale
    assert document_lengths(cu) == [5, -2, 7]
    assert document_lengths(torch.tensor([0, 10])) == [10]  # another tensor, its own lengths


@pytest.mark.parametrize("name", PACKABLE)
@pytest.mark.parametrize("positional,short_conv", [("rotary", 3), ("learned", 0)])
def test_a_packed_model_reads_the_host_at_most_once(name, positional, short_conv):
    """cu_seqlens checked and laid out without a host read in any layer or engine (issue 29: at most
    one per model forward, and no value-shaped op such as a bool index or nonzero either)."""
    spec = MECHANISMS[name]
    if positional == "rotary" and not spec.rotary:
        positional = "learned"
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=19, d_model=32, n_heads=2, n_layers=4, max_len=64,
                            attention=spec.default_config(), positional=positional, short_conv=short_conv)
    model = TransformerLM(cfg)
    cu = torch.tensor([0, 5, 6, 6, 60, 90], dtype=torch.int64)
    ids = torch.randint(0, 19, (1, 90))
    with OpProbe() as p:
        model(ids, cu_seqlens=cu).square().mean().backward()
    assert p.n_host_reads <= 1, p.host_reads
    # bad offsets are still refused, naming the argument
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        model(ids, cu_seqlens=torch.tensor([0, 50, 40, 90]))
    with pytest.raises(ValueError, match="cu_seqlens must end at T = 90"):
        model(ids, cu_seqlens=torch.tensor([0, 50, 89]))
    with pytest.raises(ValueError, match="exceeds max_len = 64"):
        model(ids, cu_seqlens=torch.tensor([0, 5, 90]))


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_the_engines_read_nothing_from_the_host_inside(strategy):
    """Inside the engines (the probe entering their operators), every chunked form of bench gpu, in
    float32, prefill and forward+backward, at an awkward length (a chunk count that is no power of
    two, a last chunk cut short): no host read and no float64 op. A host read would stall a GPU's
    queue and make the call impossible to capture in a CUDA graph (bench gpu --cuda-graphs). On the
    accelerator strategy, no running sum over a strided tensor either: CUDA would sum a contiguous
    copy and copy the result back (causal linear attention's chunk sums did, 6 a training call,
    where the CPU strategy's cache-friendly layout leaked into the accelerator's)."""
    from linattn.bench.gpu import KERNEL_FORMS, form_function, form_projection, make_inputs, widths

    for name, form in KERNEL_FORMS.items():
        heads, head_dim, state = widths(form, True)
        tensors = make_inputs(form, 211, heads, head_dim, dtype=torch.float32, device=torch.device("cpu"),
                              state=state)
        fn = form_function(form, strategy=strategy, projection=form_projection(form, head_dim), chunk_size=32)
        with OpProbe() as outside, torch.no_grad():
            fn(*tensors)
        with OpProbe(engines=True) as p, torch.no_grad():
            fn(*tensors)
        if any(op.startswith("linattn.") for op in outside.ops):  # an engine's operator: the probe went in
            assert sum(p.ops.values()) > sum(outside.ops.values()) + 20, name
        assert p.n_host_reads == 0 and not p.float64_ops, (name, p.host_reads, p.float64_ops)
        for t in tensors:
            t.requires_grad_(t.is_floating_point())
        with OpProbe(engines=True) as p:
            fn(*tensors).sum().backward()
        assert p.n_host_reads == 0 and not p.float64_ops, (name, p.host_reads, p.float64_ops)
        if strategy == "accelerator":
            assert not p.cuda_scan_copies, (name, dict(p.cuda_scan_copies))


@pytest.mark.parametrize("strategy", ["cpu", "accelerator"])
def test_every_form_of_bench_gpu_runs_under_deterministic_algorithms(strategy):
    """transformers' full_determinism (torch.use_deterministic_algorithms(True)) on a GPU: every
    chunked form of bench gpu (KDA and Mamba-2's SSD route included), forward+backward at 211
    positions, calls no op that CUDA refuses then (a floating cumsum raised there), inside the
    engines too; with every uninitialised float NaN, its output and gradients are finite and those
    of the same call without deterministic algorithms."""
    from linattn.bench.gpu import KERNEL_FORMS, form_function, form_projection, make_inputs, widths

    for name, form in KERNEL_FORMS.items():
        heads, head_dim, state = widths(form, True)
        tensors = make_inputs(form, 211, heads, head_dim, dtype=torch.float32, device=torch.device("cpu"),
                              state=state)
        fn = form_function(form, strategy=strategy, projection=form_projection(form, head_dim), chunk_size=32)
        leaves = [t.requires_grad_() for t in tensors if t.is_floating_point()]
        runs = []
        for deterministic in (False, True):
            with deterministic_algorithms() if deterministic else contextlib.nullcontext(), \
                    OpProbe(engines=True) as p:
                out = fn(*tensors)
                grads = torch.autograd.grad(out.sum(), leaves)
            runs.append([out, *grads])
        assert not p.cuda_refusals, (name, dict(p.cuda_refusals))
        for got, want in zip(*runs[::-1]):
            assert torch.isfinite(got).all(), name
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
