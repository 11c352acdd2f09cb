"""Swap the self-attention of a pretrained Hugging Face BERT-family model for a linattn mechanism.

Performers are "backward compatible" (Choromanski et al., arXiv 2009.14794, section 4.2): a
softmax model's q/k/v/output weights can run under FAVOR+ (or another kernel) as they are, losing
some accuracy that a short fine-tuning recovers. :func:`linearize` does the swap without touching
those weights:

- each ``BertSelfAttention``-like module (it has ``query``, ``key``, ``value`` and a ``config``) gets
  a :class:`LinearizedAttention` child, ``.linattn``, holding the mechanism built for its heads;
  anything the mechanism owns (FAVOR's projection buffer, Hedgehog's maps) is therefore in the
  model's ``state_dict`` and saved with it;
- ``config._attn_implementation`` becomes ``"linattn"``, a function registered in transformers'
  ``AttentionInterface`` that calls the layer's ``.linattn`` with the projected q, k, v, and a mask
  builder of the same name registered in ``AttentionMaskInterface`` that hands the 2-D padding mask
  through as ``(B, 1, 1, Nk)`` instead of materialising a ``(B, 1, N, N)`` one.

Everything else (embeddings, output projections, layer norms, feed-forwards, pooler, the forward
signature and output classes) is the original model's code. transformers is imported here only;
this tier is never imported by ``import linattn``.

Dimension legend: B batch, H heads, N positions, D head width, E hidden width (H * D).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.registry import MECHANISMS, attention_config_to_dict, build_mechanism, spec_for
from ..nn.favor import FavorConfig

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LinearizedAttention",
    "POSITION_METHODS",
    "check_convertible",
    "convertible_mechanisms",
    "extend_positions",
    "linearize",
    "linearized_layers",
    "padding_mask_from_hf",
]

ATTN_IMPLEMENTATION = "linattn"
POSITION_METHODS = ("tile", "interpolate")  # how extend_positions grows the position table


class LinearizedAttention(nn.Module):
    """One layer's linattn mechanism, attached to a Hugging Face self-attention as ``.linattn``.

    Attributes:
        mechanism: the :class:`linattn.nn.Mechanism` (owns its own parameters and buffers).
        capture: None, or a list to which every forward appends ``(q, k, key_padding_mask)``
            (distillation reads the queries and keys of each layer from it).
    """

    def __init__(self, config, *, n_heads: int, head_dim: int, max_len: int | None, causal: bool) -> None:
        super().__init__()
        self.attention_config = config
        self.mechanism = build_mechanism(config, n_heads=n_heads, head_dim=head_dim, max_len=max_len)
        self.causal = causal
        self.capture: list | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """``q, k, v (B, H, N, D)``, ``key_padding_mask`` bool ``(B, N)`` True = real key, or None
        -> ``(B, H, N, D)``."""
        if self.capture is not None:
            self.capture.append((q, k, key_padding_mask))
        return self.mechanism(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask)


def padding_mask_from_hf(attention_mask: Tensor | None, n_keys: int) -> Tensor | None:
    """linattn's ``key_padding_mask`` (bool ``(B, Nk)``, True = real key) from what transformers
    passes to an attention function, or None when nothing is masked.

    Accepted: None; ``(B, Nk)`` 0/1 or bool; ``(B, 1, Nq, Nk)`` or ``(B, 1, 1, Nk)`` boolean (True =
    attend) or additive float (0 = attend, a large negative number = masked). A 4-D mask must mask
    keys the same way for every query, since a padding mask is all a linear-time mechanism can take:
    anything else (a causal or block pattern) raises instead of being silently approximated.
    """
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:
        if m.shape[1] != 1 or m.shape[-1] != n_keys:
            raise ValueError(f"linattn attention: a 4-D attention_mask must be (B, 1, Nq, {n_keys}), got {tuple(m.shape)}")
        keep = m if m.dtype == torch.bool else (m == 0)
        if not m.dtype == torch.bool and not bool(((m == 0) | (m <= torch.finfo(m.dtype).min / 2)).all()):
            raise ValueError("linattn attention: an additive attention_mask must hold 0 (attend) or a large "
                             "negative number (masked) only; a bias cannot go through a linear-time mechanism")
        if not bool((keep == keep[:, :, :1]).all()):
            raise ValueError("linattn attention: the 4-D attention_mask differs between queries; only key "
                             "padding masks (the same keys masked for every query) are supported")
        keep = keep[:, 0, 0]  # (B, Nk)
    elif m.dim() == 2:
        if m.shape[-1] != n_keys:
            raise ValueError(f"linattn attention: attention_mask (B, Nk) must have Nk = {n_keys}, got {tuple(m.shape)}")
        keep = m.bool()
    else:
        raise ValueError(f"linattn attention: attention_mask must be 2-D or 4-D, got shape {tuple(m.shape)}")
    return None if bool(keep.all()) else keep


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query, key, value (B, H, N, D)`` ->
    ``(B, N, H, D)`` and no attention weights (a linear-time mechanism never forms them).

    Attention-probability dropout is not applied: linear attention has no weight matrix to drop
    from. BERT scales logits by 1/sqrt(D), every linattn mechanism's default; any other scaling
    raises.
    """
    lin = getattr(module, "linattn", None)
    if not isinstance(lin, LinearizedAttention):
        raise RuntimeError(f"linattn attention: {type(module).__name__} has no .linattn mechanism; convert the "
                           "model with linattn.convert.linearize rather than setting attn_implementation by hand")
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
        raise ValueError(f"linattn attention: scaling {scaling} differs from 1/sqrt(D) = {D ** -0.5} (D = {D})")
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"linattn attention: self-attention only (Nq = Nk), got query {tuple(query.shape)} "
                         f"and key {tuple(key.shape)} (a KV cache or cross-attention)")
    kpm = padding_mask_from_hf(attention_mask, key.shape[2])
    out = lin(query, key, value, kpm)  # (B, H, N, D)
    return out.transpose(1, 2).contiguous(), None  # (B, N, H, D)


def _mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
          mask_function=None, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """transformers' mask-builder contract for ``"linattn"``: the 2-D padding mask ``(B, Nk)``
    (True = real token) as ``(B, 1, 1, Nk)``, or None without padding; O(N), never (N, N)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    if mask_function not in (None, bidirectional_mask_function, causal_mask_function):
        raise NotImplementedError("linattn attention: only plain bidirectional or causal masks with padding are "
                                  "supported (no sliding-window, packed or custom mask functions)")
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask[:, None, None, :kv_length].bool()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)


def _is_self_attention(module: nn.Module) -> bool:
    return (all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value"))
            and hasattr(module, "num_attention_heads") and hasattr(module, "attention_head_size")
            and not getattr(module, "is_cross_attention", False) and "Cross" not in type(module).__name__)


def _layer_config(config, index: int):
    # one seed per layer, so that layers draw different FAVOR projections (or maps) yet the whole
    # model is a deterministic function of the config
    if any(f.name == "seed" for f in dataclasses.fields(config)):
        return dataclasses.replace(config, seed=config.seed + index)
    return config


def _not_convertible(spec) -> str | None:
    """Why a pretrained BERT's self-attention cannot become ``spec``'s mechanism, or None."""
    if spec.shared_qk:
        return "shares one query-key projection, but a pretrained BERT has separate query and key weights"
    if not spec.bidirectional:
        return "has no bidirectional form, and a BERT encoder attends in both directions"
    if spec.needs_input:
        return ("computes its gates from the layer input, which the converted attention is not given "
                "(transformers hands it q, k and v)")
    return None


def convertible_mechanisms() -> list[str]:
    """The registered mechanisms a pretrained BERT can be converted to: bidirectional ones with separate
    query and key projections (a pretrained BERT has both weights) and no gates of their own."""
    return [spec.name for spec in MECHANISMS.values() if _not_convertible(spec) is None]


def check_convertible(attention) -> None:
    """Raise ValueError unless the mechanism config ``attention`` can replace a pretrained BERT's
    self-attention (checked by :func:`linearize`; commands call it before loading anything)."""
    spec = spec_for(attention)
    why = _not_convertible(spec)
    if why is not None:
        raise ValueError(f"linearize: {spec.name!r} attention {why}")


def linearize(model: nn.Module, attention=None, *, inplace: bool = False) -> nn.Module:
    """``model`` with every self-attention computed by the linattn mechanism ``attention``.

    Args:
        model: a transformers BERT-family model (BertModel, a BERT with a head, MiniLM, ...).
        attention: a mechanism config (``linattn.nn.FavorConfig(num_features=128)``,
            ``LinearConfig()``, ``LocalConfig(window=64)``, ``HedgehogConfig()``, or
            ``SoftmaxConfig()`` for exact softmax); default FAVOR+ with the softmax kernel and
            256 orthogonal features. A ``seed`` option is offset by the layer index.
        inplace: convert ``model`` itself; by default a deep copy is converted and returned.

    Returns:
        The converted model: same class, forward signature and outputs; the pretrained weights are
        reused as they are. ``config.linattn_attention`` records the mechanism config.
    """
    attention = FavorConfig() if attention is None else attention
    check_convertible(attention)
    spec = spec_for(attention)
    _register()
    if not inplace:
        model = copy.deepcopy(model)
    layers = [m for m in model.modules() if _is_self_attention(m)]
    if not layers:
        raise ValueError(f"linearize: found no BERT-style self-attention (query/key/value Linear layers) in "
                         f"{type(model).__name__}")
    max_len = getattr(model.config, "max_position_embeddings", None)
    for i, module in enumerate(layers):
        causal = bool(getattr(module, "is_causal", False))
        if causal and not spec.causal:
            raise ValueError(f"linearize: the model's attention is causal but {spec.name!r} has no causal form")
        ref = next(module.parameters())
        module.linattn = LinearizedAttention(
            _layer_config(attention, i), n_heads=module.num_attention_heads, head_dim=module.attention_head_size,
            max_len=max_len, causal=causal,
        ).to(device=ref.device, dtype=ref.dtype)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    model.config.linattn_attention = attention_config_to_dict(attention)
    return model


def linearized_layers(model: nn.Module) -> list[LinearizedAttention]:
    """The :class:`LinearizedAttention` of every converted layer, in order."""
    return [m for m in model.modules() if isinstance(m, LinearizedAttention)]


@torch.no_grad()
def extend_positions(model: nn.Module, max_len: int, *, method: str = "tile") -> nn.Module:
    """Grow a BERT model's learned absolute position table (in place) to ``max_len`` rows.

    BERT learns one embedding per position up to ``max_position_embeddings`` (512) and has nothing
    for later positions. Methods:

    - ``"tile"`` (default): row p is the pretrained row p mod N0, the pretrained table repeated
      (Longformer's initialisation, Beltagy et al., arXiv 2004.05150, section 5). Every position
      keeps the local structure (neighbouring rows differ as in training) that attention relies
      on; only the absolute position wraps around.
    - ``"interpolate"``: linear interpolation of the table onto max_len points, so the whole input
      is squeezed into the trained range (neighbouring positions then look closer than in training,
      and every row but the first and last changes, short inputs included).

    With ``"tile"`` rows 0 .. N0 - 1 are unchanged, so inputs of up to N0 tokens give the same outputs.
    """
    emb = getattr(getattr(model, "embeddings", None), "position_embeddings", None)
    if emb is None and hasattr(model, "base_model"):
        emb = getattr(getattr(model.base_model, "embeddings", None), "position_embeddings", None)
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"extend_positions: {type(model).__name__} has no embeddings.position_embeddings table")
    embeddings = model.embeddings if hasattr(model, "embeddings") else model.base_model.embeddings
    old = emb.weight  # (N0, E)
    n0 = old.shape[0]
    if max_len <= n0:
        raise ValueError(f"extend_positions: max_len {max_len} must exceed the current table's {n0} rows")
    if method == "tile":
        new = old[torch.arange(max_len, device=old.device) % n0]
    elif method == "interpolate":
        new = torch.nn.functional.interpolate(old.T[None], size=max_len, mode="linear", align_corners=True)[0].T
    else:
        raise ValueError(f"extend_positions: method must be one of {POSITION_METHODS}, got {method!r}")
    table = nn.Embedding(max_len, old.shape[1], device=old.device, dtype=old.dtype)
    table.weight.copy_(new)
    embeddings.position_embeddings = table
    embeddings.position_ids = torch.arange(max_len, device=old.device).expand(1, -1)
    if hasattr(embeddings, "token_type_ids"):
        embeddings.token_type_ids = torch.zeros(1, max_len, dtype=torch.long, device=old.device)
    model.config.max_position_embeddings = max_len
    return model
