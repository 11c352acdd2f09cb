"""Grouped value heads in the models (issue 31): ``n_key_heads`` on the deltanet, gated_deltanet and
kda configs gives the layer q and k projections of Hk heads, value head h reading query/key head
h // (H / Hk). A grouped layer equals the ungrouped layer whose q and k projection rows are those of
its group (forward, padded, packed; its q/k weight gradients the sums over each group); models decode
step by step as teacher-forced, save and load, train from the command line; bad values are refused
naming the option."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_close, assert_decodes_as_teacher_forced
from linattn import TransformerConfig, TransformerLM
from linattn.cli import main
from linattn.nn import DeltaNetConfig, GatedDeltaNetConfig, KDAConfig, MultiHeadAttention

CONFIGS = {"deltanet": DeltaNetConfig, "gated_deltanet": GatedDeltaNetConfig, "kda": KDAConfig}
C, H, D = 24, 4, 6


def _pair(name: str, hk: int):
    """A grouped float64 layer (away from its initialisation) and the ungrouped layer with the same
    parameters, its q and k rows for value head h copied from the grouped layer's head h // (H / hk)."""
    torch.manual_seed(0)
    grouped = MultiHeadAttention(C, H, attention=CONFIGS[name](n_key_heads=hk), short_conv=3).double()
    for p in grouped.parameters():
        p.data.add_(0.3 * torch.randn_like(p))
    plain = MultiHeadAttention(C, H, attention=CONFIGS[name](), short_conv=3).double()
    assert grouped.in_proj.weight.shape == (2 * hk * D + C, C) and plain.in_proj.weight.shape == (3 * C, C)
    state = dict(grouped.state_dict())
    heads = torch.arange(H) // (H // hk)  # the query/key head of each value head
    for key in ("in_proj.weight", "in_proj.bias"):
        w = state[key]
        q, k, v = w[: hk * D], w[hk * D : 2 * hk * D], w[2 * hk * D :]
        expand = lambda t: t.view(hk, D, *t.shape[1:])[heads].reshape(H * D, *t.shape[1:])  # noqa: E731
        state[key] = torch.cat([expand(q), expand(k), v])
    plain.load_state_dict(state)
    return grouped, plain, heads


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("hk", [1, 2])
def test_grouped_layer_equals_the_ungrouped_layer_with_its_group_rows(name, hk):
    grouped, plain, heads = _pair(name, hk)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, C, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, 4:6] = False  # padding in the middle
    mask[1, :2] = False  # and at the start
    cot = torch.randn(2, 11, C, generator=g, dtype=torch.float64)
    a = grouped(x, causal=True, key_padding_mask=mask)
    b = plain(x, causal=True, key_padding_mask=mask)
    assert_close(a, b, msg=f"{name} Hk={hk} padded")
    (a * cot).sum().backward()
    (b * cot).sum().backward()
    # the grouped layer's q and k rows read by several value heads: their gradients sum over the group
    for key in ("weight", "bias"):
        ga, gb = getattr(grouped.in_proj, key).grad, getattr(plain.in_proj, key).grad
        tail = ga.shape[1:]
        for part in range(2):  # q, then k
            got = ga[part * hk * D : (part + 1) * hk * D].view(hk, D, *tail)
            per_head = gb[part * C : (part + 1) * C].view(H, D, *tail)
            want = torch.zeros_like(got).index_add_(0, heads, per_head)
            assert_close(got, want, msg=f"{name} Hk={hk} grad {key} part {part}")
        assert_close(ga[2 * hk * D :], gb[2 * C :], msg=f"{name} Hk={hk} v grad {key}")
    for (ka, pa), (kb, pb) in zip(grouped.named_parameters(), plain.named_parameters()):
        if not ka.startswith("in_proj"):
            assert_close(pa.grad, pb.grad, msg=f"{name} Hk={hk} {ka}")
    # packed documents, an empty and a one-token one among them
    xp = x[:1]
    cu = torch.tensor([0, 5, 5, 6, 11])
    with torch.no_grad():
        assert_close(grouped(xp, causal=True, cu_seqlens=cu), plain(xp, causal=True, cu_seqlens=cu),
                     msg=f"{name} Hk={hk} packed")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_model_decodes_step_by_step_as_teacher_forced_and_round_trips(tmp_path, name):
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=23, max_len=24, d_model=16, n_layers=2, n_heads=4, d_ff=32,
                            attention=CONFIGS[name](n_key_heads=2), short_conv=4)
    lm = TransformerLM(cfg).double().eval()
    for p in lm.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 23, (2, 15), generator=torch.Generator().manual_seed(2))
    state, _ = assert_decodes_as_teacher_forced(lm, ids, 9, msg=name)
    with torch.no_grad():
        full = lm(ids)
    # the state is per value head: H (D, D) matrices whatever Hk
    assert all(s.mechanism.s.shape == (2, 4, 4, 4) for s in state.layers)
    lm.save_pretrained(tmp_path / "ckpt")
    back = TransformerLM.from_pretrained(tmp_path / "ckpt").double().eval()
    assert back.config == cfg and back.config.attention.n_key_heads == 2
    with torch.no_grad():
        assert torch.equal(back(ids), full)


def test_bad_n_key_heads_is_refused_naming_it():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n_key_heads"):
            KDAConfig(n_key_heads=bad)
    with pytest.raises(ValueError, match=r"n_key_heads = 3 must divide the layer's n_heads = 4"):
        MultiHeadAttention(C, H, attention=GatedDeltaNetConfig(n_key_heads=3))
    with pytest.raises(ValueError, match=r"n_key_heads = 8 must divide"):
        MultiHeadAttention(C, H, attention=DeltaNetConfig(n_key_heads=8))


def test_cli_trains_a_grouped_kda_model(tmp_path):
    from test_gated_models import TINY_FLAGS

    out = tmp_path / "kda"
    flags = [f if f != "2" or TINY_FLAGS[i - 1] != "--n-heads" else "4" for i, f in enumerate(TINY_FLAGS)]
    assert main(["train", "--attention", "kda", "--attention-n-key-heads", "2", "--max-steps", "2",
                 "--out", str(out), *flags]) == 0
    saved = json.loads((out / "train_config.json").read_text())["model"]
    assert saved["n_heads"] == 4 and saved["attention"]["n_key_heads"] == 2
    back = TransformerLM.from_pretrained(out / "checkpoints" / "step_00000002")
    assert back.blocks[0].attn.in_proj.weight.shape == (2 * 2 * 4 + 16, 16)
