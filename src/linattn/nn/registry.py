"""The registry of attention mechanisms: name -> :class:`MechanismSpec`.

A spec says what a mechanism can do (causal use, recurrent decoding, rotary positions, shared
query-key projection), which frozen config dataclass holds its options, and how to build its
module (:mod:`linattn.nn.mechanisms`). Models pick a mechanism by passing its config
(``LinearConfig(feature_map="relu")``); configs serialise as ``{"name": ..., **options}``.

Rotary positions are applied to q and k before the mechanism (before any feature map):
- softmax, local, lsh: attention is softmax of q.k, so scores depend on relative position only;
- favor: its features estimate exp(q.k), so that holds in expectation;
- linear: allowed, but phi(R_i q) . phi(R_j k) is not a function of i - j: the positions act
  absolutely through the feature map;
- efficient, linformer: rejected. Efficient Attention takes a softmax over q's features and
  Linformer mixes keys of all positions before any dot product, so a rotation of q and k has no
  positional meaning there.
- hedgehog: rejected. Its feature maps are learned for q and k as the pretrained model produced
  them (conversion of BERT-family encoders, which have absolute positions, not rotary ones).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Union

from .mechanisms import (
    EfficientConfig,
    EfficientMechanism,
    FavorConfig,
    FavorMechanism,
    HedgehogConfig,
    HedgehogMechanism,
    KVCache,
    LinearConfig,
    LinearMechanism,
    LinformerConfig,
    LinformerMechanism,
    LocalConfig,
    LocalMechanism,
    LSHConfig,
    LSHMechanism,
    Mechanism,
    SoftmaxConfig,
    SoftmaxMechanism,
)
from ..functional.linear import LinearAttentionState
from ..functional.local import LocalAttentionState

__all__ = [
    "AttentionConfig",
    "MECHANISMS",
    "MechanismSpec",
    "attention_config",
    "attention_config_from_dict",
    "attention_config_to_dict",
    "build_mechanism",
    "get_mechanism",
    "spec_for",
]

AttentionConfig = Union[
    SoftmaxConfig, LinearConfig, EfficientConfig, FavorConfig, LocalConfig, LinformerConfig, LSHConfig, HedgehogConfig
]


@dataclass(frozen=True)
class MechanismSpec:
    """What a registered mechanism is and can do.

    Attributes:
        name: registry key, also the ``"name"`` of its serialised config.
        config_type: the frozen dataclass of its options.
        causal: has a causal form (usable in a language model).
        recurrent: has a recurrent form: ``step()`` and decoding with a state.
        rotary: accepts rotary positions on q and k (see the module docstring for why or why not).
        shared_qk: queries and keys come from one projection (LSH).
        state_type: the type of its decoding state, or None.
        build: ``(config, n_heads=, head_dim=, max_len=) -> Mechanism``.
        summary: one line for listings.
    """

    name: str
    config_type: type
    causal: bool
    recurrent: bool
    rotary: bool
    shared_qk: bool
    state_type: type | None
    build: Callable[..., Mechanism]
    summary: str


def _plain(cls):
    return lambda config, *, n_heads, head_dim, max_len: cls(config, n_heads=n_heads, head_dim=head_dim)


MECHANISMS: dict[str, MechanismSpec] = {
    s.name: s
    for s in (
        MechanismSpec("softmax", SoftmaxConfig, causal=True, recurrent=True, rotary=True, shared_qk=False,
                      state_type=KVCache, build=_plain(SoftmaxMechanism),
                      summary="exact softmax attention; decodes with a KV cache"),
        MechanismSpec("linear", LinearConfig, causal=True, recurrent=True, rotary=True, shared_qk=False,
                      state_type=LinearAttentionState, build=_plain(LinearMechanism),
                      summary="kernel attention phi(q).phi(k); O(1) state per token"),
        MechanismSpec("efficient", EfficientConfig, causal=False, recurrent=False, rotary=False, shared_qk=False,
                      state_type=None, build=_plain(EfficientMechanism),
                      summary="Efficient Attention (softmax over features x softmax over keys); bidirectional"),
        MechanismSpec("favor", FavorConfig, causal=True, recurrent=True, rotary=True, shared_qk=False,
                      state_type=LinearAttentionState, build=_plain(FavorMechanism),
                      summary="Performer FAVOR+ random features; O(1) state per token"),
        MechanismSpec("local", LocalConfig, causal=True, recurrent=True, rotary=True, shared_qk=False,
                      state_type=LocalAttentionState, build=_plain(LocalMechanism),
                      summary="sliding-window softmax; ring buffer of the last window keys"),
        MechanismSpec("linformer", LinformerConfig, causal=False, recurrent=False, rotary=False, shared_qk=False,
                      state_type=None,
                      build=lambda config, *, n_heads, head_dim, max_len: LinformerMechanism(
                          config, n_heads=n_heads, head_dim=head_dim, max_len=max_len),
                      summary="Linformer sequence projections E, F; bidirectional"),
        MechanismSpec("lsh", LSHConfig, causal=True, recurrent=False, rotary=True, shared_qk=True,
                      state_type=None, build=_plain(LSHMechanism),
                      summary="Reformer LSH attention with shared query-key projection"),
        MechanismSpec("hedgehog", HedgehogConfig, causal=False, recurrent=False, rotary=False, shared_qk=False,
                      state_type=None, build=_plain(HedgehogMechanism),
                      summary="Hedgehog learnable softmax feature maps (+ optional softmax window); bidirectional"),
    )
}

_BY_TYPE: dict[type, MechanismSpec] = {s.config_type: s for s in MECHANISMS.values()}


def get_mechanism(name: str) -> MechanismSpec:
    """The spec registered as ``name``; raises ValueError listing the registered names."""
    if not isinstance(name, str):
        raise TypeError(f"get_mechanism: name must be a str, got {type(name).__name__}")
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"unknown attention mechanism {name!r}; registered: {sorted(MECHANISMS)}") from None


def spec_for(config) -> MechanismSpec:
    """The spec whose config type ``config`` is; TypeError naming the accepted types otherwise."""
    spec = _BY_TYPE.get(type(config))
    if spec is None:
        names = ", ".join(s.config_type.__name__ for s in MECHANISMS.values())
        raise TypeError(f"attention must be a mechanism config ({names}), got {type(config).__name__}")
    return spec


def attention_config(name: str, **options: Any) -> AttentionConfig:
    """The config of mechanism ``name`` with ``options``, e.g. ``attention_config("local", window=64)``.

    Unknown names and unknown options raise ValueError listing what exists.
    """
    spec = get_mechanism(name)
    known = {f.name for f in dataclasses.fields(spec.config_type)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{name!r} attention has no option(s) {unknown}; its options: {sorted(known)}")
    return spec.config_type(**options)


def attention_config_to_dict(config) -> dict[str, Any]:
    """``{"name": <mechanism>, **options}``, JSON-serialisable."""
    return {"name": spec_for(config).name, **dataclasses.asdict(config)}


def attention_config_from_dict(d: dict[str, Any]) -> AttentionConfig:
    """Inverse of :func:`attention_config_to_dict`."""
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"an attention config dict needs a 'name' key (one of {sorted(MECHANISMS)}), got {d!r}")
    options = dict(d)
    return attention_config(options.pop("name"), **options)


def build_mechanism(config, *, n_heads: int, head_dim: int, max_len: int | None = None) -> Mechanism:
    """The mechanism module for ``config`` with ``n_heads`` heads of width ``head_dim``."""
    return spec_for(config).build(config, n_heads=n_heads, head_dim=head_dim, max_len=max_len)
