"""Packed documents at the model level (cu_seqlens through TransformerLM, every layer, the short
convolution and the positions) and in training (data.document_separator): each document's logits
and gradients are those it gets alone."""

import json

import pytest
import torch

from linattn.models import TransformerConfig, TransformerLM
from linattn.nn import MultiHeadAttention, ShortConv
from linattn.nn.conv import short_conv_reference
from linattn.nn.positional import document_positions
from linattn.nn.registry import MECHANISMS
from linattn.train import TrainConfig, load_config, pack_documents, train

CAUSAL = [name for name, spec in MECHANISMS.items() if spec.causal]
# LSH's buckets are cut over the whole call (bucket_size must divide its length), so a document
# alone is a different hashing: its packed form is checked for isolation instead
EXACT = [name for name in CAUSAL if name != "lsh"]
LENGTHS = [5, 1, 13, 0, 11]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def _model(name, *, positional, short_conv, seed=0):
    spec = MECHANISMS[name]
    if positional == "rotary" and not spec.rotary:
        positional = "learned"
    attention = spec.default_config()
    if name == "lsh":  # its buckets need bucket_size | N: N = 30 below
        attention = type(attention)(bucket_size=5, n_hashes=2)
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=19, d_model=16, n_heads=2, n_layers=2, max_len=16, attention=attention,
                            positional=positional, short_conv=short_conv)
    return TransformerLM(cfg).double()


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("positional,short_conv", [("rotary", 3), ("learned", 0), ("sinusoidal", 2)])
def test_packed_logits_and_gradients_are_each_documents_alone(name, positional, short_conv):
    """N = 30 > max_len = 16: only the documents must fit, and positions restart in each."""
    model = _model(name, positional=positional, short_conv=short_conv)
    cu = _cu(LENGTHS)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 19, (1, int(cu[-1])), generator=g)
    cot = torch.randn(1, int(cu[-1]), 19, generator=g, dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    packed = model(ids, cu_seqlens=cu)
    got = torch.autograd.grad((packed * cot).sum(), params, allow_unused=True)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    alone = torch.cat([model(ids[:, a:b]) for a, b in bounds if b > a], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-11)
    want = torch.autograd.grad((alone * cot).sum(), params, allow_unused=True)
    for p, x, y in zip(params, got, want):
        if y is None:
            assert x is None or bool((x == 0).all())
        else:
            torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("name", CAUSAL)
def test_no_document_sees_another(name):
    """Every token of one document changed: every other document's logits stay the same. Up to
    rounding only: linear attention's normaliser is a difference of float64 prefix sums over the
    packed sequence (linattn.functional.varlen.segment_cumsum), whose last bits do see earlier
    documents."""
    model = _model(name, positional="rotary", short_conv=3)
    cu = _cu(LENGTHS)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 19, (1, int(cu[-1])), generator=g)
    other = ids.clone()
    other[:, 6:19] = (other[:, 6:19] + 1) % 19  # the third document
    a, b = model(ids, cu_seqlens=cu), model(other, cu_seqlens=cu)
    assert not torch.equal(a[:, 6:19], b[:, 6:19])
    for part in (slice(0, 6), slice(19, None)):
        torch.testing.assert_close(a[:, part], b[:, part], rtol=1e-13, atol=1e-14)


def test_document_positions_restart_at_every_document():
    assert document_positions(_cu([3, 0, 1, 2]), 6).tolist() == [0, 1, 2, 0, 0, 1]
    assert document_positions(_cu([0]), 0).tolist() == []


@pytest.mark.parametrize("K", [1, 2, 4])
def test_short_conv_does_not_reach_across_documents(K):
    conv = ShortConv(6, K).double()
    with torch.no_grad():
        conv.weight.normal_()
    lengths = [2, 1, 7, 3]
    cu = _cu(lengths)
    x = torch.randn(1, sum(lengths), 6, dtype=torch.float64)
    y = conv(x, positions=document_positions(cu, x.shape[1]))
    want = torch.cat([short_conv_reference(x[:, a:b], conv.weight) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())],
                     dim=1)
    torch.testing.assert_close(y, want)
    with pytest.raises(ValueError, match="positions must be"):
        conv(x, positions=document_positions(cu, x.shape[1])[:-1])


def test_layer_and_model_errors():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(1, 6, 8)
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match="needs causal=True"):
        mha(x, cu_seqlens=cu)
    with pytest.raises(ValueError, match="return_state with cu_seqlens"):
        mha(x, causal=True, cu_seqlens=cu, return_state=True)
    with pytest.raises(ValueError, match="batch size must be 1"):
        mha(x.expand(2, -1, -1), causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="end at T"):
        mha(x, causal=True, cu_seqlens=_cu([2, 3]))
    model = _model("softmax", positional="learned", short_conv=0)
    with pytest.raises(ValueError, match="exceeds max_len = 16"):
        model(torch.zeros(1, 20, dtype=torch.int64), cu_seqlens=_cu([3, 17]))


def test_pack_documents_cuts_at_row_starts_and_separators():
    ids = torch.tensor([[0, 5, 6, 0, 7], [8, 9, 0, 4, 4]])
    flat, cu = pack_documents(ids, 0)
    assert flat.tolist() == [ids.flatten().tolist()]
    assert cu.tolist() == [0, 3, 5, 7, 10]


def test_training_with_a_document_separator(tmp_path):
    """The recall stream opens every episode with token 0: packed training runs, and its loss is
    the mean over the rows of the packed model's logits (one step, checked by hand)."""
    cfg = load_config(None, ["max_steps=2", "eval_every=2", "batch_size=4", "seq_len=32", "data.document_separator=0",
                             "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
                             f"out={tmp_path / 'run'}"])
    assert isinstance(cfg, TrainConfig) and cfg.data.document_separator == 0
    result = train(cfg, handle_signals=False, quiet=True)
    assert result.step == 2 and result.last_val_loss is not None
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "eval" for r in records)
    with pytest.raises(ValueError, match="document_separator = 64 is not a token"):
        load_config(None, ["data.document_separator=64"])


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_packed_equals_one_call_per_document(causal):
    import linattn
    from linattn.functional.softmax import softmax_attention_reference

    cu = _cu([4, 1, 0, 9, 6])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 20, 5, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.ones(1, 20, dtype=torch.bool)
    mask[0, [4, 7]] = False  # a one-token document wholly padded, and a position inside another
    out = linattn.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask, cu_seqlens=cu)
    ref = softmax_attention_reference(q, k, v, causal=causal, key_padding_mask=mask, cu_seqlens=cu)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    alone = torch.cat([softmax_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=causal,
                                                   key_padding_mask=mask[:, a:b]) for a, b in bounds], dim=2)
    torch.testing.assert_close(out, alone)
    torch.testing.assert_close(ref, alone)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for x, y in zip(torch.autograd.grad((out * cot).sum(), (q, k, v)), torch.autograd.grad((alone * cot).sum(), (q, k, v))):
        torch.testing.assert_close(x, y)
    with pytest.raises(ValueError, match="same packed positions"):
        linattn.softmax_attention(q, k[:, :, :10], v[:, :, :10], cu_seqlens=cu)


def test_training_stops_at_the_first_nonfinite_loss_of_a_packed_batch(tmp_path, monkeypatch, capsys):
    """One document of a packed row turns non-finite at step 3 (its embeddings, as a poisoned input
    would): `linattn train` stops at that step with one line, exit status 1, and the checkpoint of
    step 2 is the last one, untouched."""
    from linattn.cli import main
    from linattn.train import trainer

    class Poisoned(TransformerLM):
        def __init__(self, config):
            super().__init__(config)
            self.training_calls = 0
            self.tok_emb.register_forward_hook(self._poison)

        def forward(self, ids, *args, cu_seqlens=None, **kwargs):
            self.cu = cu_seqlens
            self.training_calls += int(self.training)
            return super().forward(ids, *args, cu_seqlens=cu_seqlens, **kwargs)

        def _poison(self, module, inputs, out):
            if self.training and self.training_calls == 3:
                assert self.cu is not None and len(self.cu) > 3  # a packed row of several documents
                a, b = int(self.cu[1]), int(self.cu[2])  # the second document only
                out = out.clone()
                out[:, a:b] = float("nan")
                return out

    monkeypatch.setattr(trainer, "TransformerLM", Poisoned)
    out = tmp_path / "run"
    code = main(["train", "--max-steps", "6", "--ckpt-every", "1", "--eval-every", "0", "--batch-size", "4",
                 "--seq-len", "32", "--data-document-separator", "0", "--d-model", "32", "--n-layers", "1",
                 "--n-heads", "2", "--d-ff", "64", "--log-every", "1", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "the training loss of step 3 is not finite: stopped there" in lines[0], err
    assert "step_00000002" in lines[0] and "is kept" in lines[0]
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert "step_00000002" in json.dumps(latest)
    assert not list((out / "checkpoints").glob("step_00000003*"))
    steps = [json.loads(line).get("step") for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 2  # the non-finite step is not logged as a loss
