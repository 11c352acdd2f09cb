"""The configuration of a transformer encoder or language model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..config import Config
from ..nn.mechanisms import SoftmaxConfig
from ..nn.registry import MECHANISMS, AttentionConfig, attention_config_from_dict, attention_config_to_dict, spec_for

__all__ = ["NORMS", "POSITIONAL", "TransformerConfig"]

NORMS = ("layernorm", "rmsnorm")
POSITIONAL = ("learned", "sinusoidal", "rotary", "none")


@dataclass(frozen=True)
class TransformerConfig(Config):
    """A stack of ``n_layers`` blocks (attention + MLP with GELU), with embeddings.

    Attributes:
        vocab_size: number of token ids.
        max_len: longest sequence (positions 0 .. max_len - 1).
        d_model: width C.
        n_layers: number of blocks.
        n_heads: attention heads; must divide d_model.
        d_ff: hidden width of the MLP; 0 leaves the MLP (and its norm) out of every block.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        pre_norm: normalise before each sub-layer (and once after the stack); False is the
            original post-norm ``x = norm(x + f(x))``.
        positional: ``"learned"`` (an embedding table added to the tokens), ``"sinusoidal"`` (the
            fixed table of arXiv 1706.03762, added) or ``"rotary"`` (q and k rotated inside every
            attention layer, arXiv 2104.09864; rejected for efficient, linformer, hedgehog,
            deltanet and gated_deltanet attention, see ``linattn.nn.registry``) or ``"none"`` (no
            position encoding: the order comes from the causal mask, the decays of the gated and
            delta-rule mechanisms and the short convolution, as in their papers; and no table of
            ``max_len`` rows, which at a long ``max_len`` is memory of its own).
        dropout: on embeddings and on each sub-layer's output.
        attention: the mechanism config of every layer not in ``layer_attention``.
        layer_attention: per-layer overrides, ``{layer_index: config}`` (stored as sorted
            ``(index, config)`` pairs). ``{i: SoftmaxConfig() for i in range(0, 12, 4)}`` with
            ``attention=LinearConfig()`` is softmax in every fourth layer and linear elsewhere.
        short_conv: K > 0 gives every attention layer a causal depthwise convolution of kernel
            size K over its input, in front of the q/k/v projections (:class:`linattn.nn.ShortConv`,
            identity at initialisation; decoding keeps the last K - 1 inputs per layer). The local
            view linear attention lacks, and the short convolution of the DeltaNet and Gated
            DeltaNet recipes (their papers use K = 4; the gates read the convolved input too);
            0 (the default) = none.
        tie_embeddings: language models share the token embedding with the output layer.
        init_std: standard deviation of the normal initialisation of linear and embedding weights.
    """

    vocab_size: int
    max_len: int
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    norm: str = field(default="layernorm", metadata={"choices": NORMS})
    pre_norm: bool = True
    positional: str = field(default="learned", metadata={"choices": POSITIONAL})
    dropout: float = 0.0
    attention: AttentionConfig = field(default_factory=SoftmaxConfig)
    layer_attention: Any = ()
    short_conv: int = 0
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff"):
            val, lo = getattr(self, name), 0 if name == "d_ff" else 1
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"TransformerConfig: {name} must be an int >= {lo}"
                                 f"{' (0: no MLP)' if lo == 0 else ''}, got {val!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TransformerConfig: n_heads = {self.n_heads} must divide d_model = {self.d_model}"
            )
        if isinstance(self.short_conv, bool) or not isinstance(self.short_conv, int) or self.short_conv < 0:
            raise ValueError(f"TransformerConfig: short_conv must be an int >= 0 (0 = none), got {self.short_conv!r}")
        if self.norm not in NORMS:
            raise ValueError(f"TransformerConfig: unknown norm {self.norm!r}; known: {list(NORMS)}")
        if self.positional not in POSITIONAL:
            raise ValueError(f"TransformerConfig: unknown positional {self.positional!r}; known: {list(POSITIONAL)}")
        for name in ("pre_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TransformerConfig: {name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"TransformerConfig: dropout must be a float in [0, 1), got {self.dropout!r}")
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float)) or not self.init_std > 0:
            raise ValueError(f"TransformerConfig: init_std must be a float > 0, got {self.init_std!r}")
        try:
            spec_for(self.attention)
        except TypeError as e:
            raise TypeError(f"TransformerConfig: attention: {e}") from None
        object.__setattr__(self, "layer_attention", self._normalise_overrides(self.layer_attention))
        if self.positional == "rotary":
            if (self.d_model // self.n_heads) % 2:
                raise ValueError(
                    f"TransformerConfig: rotary positions need an even head width, got d_model / n_heads "
                    f"= {self.d_model // self.n_heads}"
                )
            for i in range(self.n_layers):
                spec = spec_for(self.attention_for(i))
                if not spec.rotary:
                    raise ValueError(
                        f"TransformerConfig: positional='rotary' is not supported by {spec.name!r} attention "
                        f"(layer {i}); use 'learned' or 'sinusoidal' positions, or another mechanism"
                    )

    def _normalise_overrides(self, overrides) -> tuple:
        if isinstance(overrides, Mapping):
            pairs = list(overrides.items())
        elif isinstance(overrides, (tuple, list)):
            pairs = list(overrides)
            if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs):
                raise TypeError("TransformerConfig: layer_attention must be a dict {layer_index: config} "
                                "or a sequence of (layer_index, config) pairs")
        else:
            raise TypeError(
                f"TransformerConfig: layer_attention must be a dict {{layer_index: config}}, got {type(overrides).__name__}"
            )
        seen = set()
        out = []
        for i, cfg in pairs:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
                raise ValueError(
                    f"TransformerConfig: layer_attention index {i!r} is not a layer index in [0, {self.n_layers})"
                )
            if i in seen:
                raise ValueError(f"TransformerConfig: layer_attention gives layer {i} twice")
            seen.add(i)
            try:
                spec_for(cfg)
            except TypeError as e:
                raise TypeError(f"TransformerConfig: layer_attention[{i}]: {e}") from None
            out.append((i, cfg))
        return tuple(sorted(out, key=lambda p: p[0]))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def attention_for(self, layer: int) -> AttentionConfig:
        """The mechanism config of layer ``layer``."""
        return dict(self.layer_attention).get(layer, self.attention)

    def check_form(self, form: str, *, owner: str, user: str) -> None:
        """Raise ValueError unless every layer's mechanism has ``form`` (``"causal"``,
        ``"bidirectional"``); the message names ``owner``, the first layer without it and the
        mechanisms ``user`` (e.g. "a language model") could use instead."""
        for i in range(self.n_layers):
            spec = spec_for(self.attention_for(i))
            if form not in spec.forms:
                having = sorted(n for n, s in MECHANISMS.items() if form in s.forms)
                raise ValueError(f"{owner}: layer {i} uses {spec.name!r} attention, which has no {form} form; "
                                 f"{user} needs one of {having}")

    def layer_mechanisms(self) -> list[str]:
        """The registered mechanism name of every layer, in order."""
        return [spec_for(self.attention_for(i)).name for i in range(self.n_layers)]

    def encode_field(self, name: str, value: Any) -> Any:
        """``attention`` as ``{"name": ..., **options}``; ``layer_attention`` as
        ``{"<index>": {"name": ..., ...}}``."""
        if name == "attention":
            return attention_config_to_dict(value)
        if name == "layer_attention":
            return {str(i): attention_config_to_dict(c) for i, c in value}
        return super().encode_field(name, value)

    @classmethod
    def decode_field(cls, name: str, value: Any) -> Any:
        if name == "attention" and isinstance(value, Mapping):
            return attention_config_from_dict(dict(value))
        if name == "layer_attention" and not isinstance(value, (tuple, list)):
            if not isinstance(value, Mapping):
                raise TypeError(f"TransformerConfig: layer_attention must be a dict, got {type(value).__name__}")
            try:
                return {int(i): attention_config_from_dict(dict(c)) for i, c in value.items()}
            except ValueError as e:
                raise ValueError(f"TransformerConfig: layer_attention: {e}") from None
        return super().decode_field(name, value)
