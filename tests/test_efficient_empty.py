"""efficient_attention on empty inputs: no key (Nk = 0) or no query (Nq = 0).

The contract is softmax_attention's: a query with no key gets zeros, the output keeps the
(B, H, Nq, Dv) shape, and gradients reach q, k and v (zeros, or empty where the input is empty).
"""

import pytest
import torch

import linattn
from linattn.functional import efficient_attention_reference

from conftest import make_qkv


@pytest.mark.parametrize("fn", [linattn.efficient_attention, efficient_attention_reference],
                         ids=["fast", "reference"])
@pytest.mark.parametrize("nq, nk", [(3, 0), (1, 0), (0, 0), (0, 4)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_efficient_empty_inputs_give_zeros_like_softmax(fn, nq, nk, masked, dtype):
    q, k, v = make_qkv(2, 3, nq, nk, 8, 5, dtype=dtype)
    mask = torch.ones(2, nk, dtype=torch.bool) if masked else None
    out = fn(q, k, v, key_padding_mask=mask)
    expected = linattn.softmax_attention(q, k, v, key_padding_mask=mask)
    assert out.shape == expected.shape == (2, 3, nq, 5) and out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(out))
    cot = torch.ones_like(out)
    for name, t, g in zip("qkv", (q, k, v), torch.autograd.grad(out, (q, k, v), cot)):
        assert g.shape == t.shape and g.dtype == dtype, name
        assert torch.equal(g, torch.zeros_like(g)), name
