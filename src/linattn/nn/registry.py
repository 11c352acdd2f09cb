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
- retnet: accepted, and its paper's recipe: retention rotates q and k by position (arXiv
  2307.08621, the e^{i n theta} of its parallel form), so that with the decay gamma^(n - m) a score
  depends on n - m only.
- gla: accepted, as for linear: a rotation of q and k is well defined there and lets a hybrid with
  rotary softmax layers use one positional scheme, but a score is not a function of position
  differences alone (the decays differ between the two channels of a rotated pair), and the paper
  uses no positions beyond its decays.
- deltanet, gated_deltanet, kda: rejected. The delta rule overwrites what the state holds under a key:
  k_t's write first erases the value stored along k_t. Rotating keys by position would store the
  same key at two positions along two different directions, so a later write no longer corrects
  an earlier one, which is the point of the rule; the papers use no positional encoding (the
  decays and the short convolution give order).

Bidirectional forms: retnet, gla, deltanet, gated_deltanet and kda have none. They are recurrences in
time (each position's state is the previous one decayed, corrected and written to), so "every
position sees every other" is no form of theirs; a request for one (an encoder layer, the sweep's
bidirectional mode) raises, naming the mechanism. Their gates are functions of the layer input,
so their modules set ``needs_input`` (see :mod:`linattn.nn.mechanisms`).

Sharded forms (context parallelism, :mod:`linattn.distributed`): every causal mechanism but LSH.
The form is the module's ``sharding``, the ``SHARDING`` of its functional file
(:mod:`linattn.functional.sharding`): the recurrent ones pass a state summary between ranks, all
through one driver; local attention a halo of the last ``window`` keys; softmax gathers the keys
and values of the ranks before it. LSH has none: its buckets are cut over the whole sequence.
"""

from __future__ import annotations

import dataclasses
import json
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
from .gated import (
    DeltaNetConfig,
    DeltaNetMechanism,
    GatedDeltaNetConfig,
    GatedDeltaNetMechanism,
    GLAConfig,
    GLAMechanism,
    KDAConfig,
    KDAMechanism,
    RetNetConfig,
    RetNetMechanism,
)
from ..functional import (
    DecayedState,
    LinearAttentionState,
    LocalAttentionState,
    efficient_attention,
    efficient_attention_reference,
    favor_attention,
    favor_attention_reference,
    delta_rule_attention,
    delta_rule_attention_reference,
    gated_linear_attention,
    gated_linear_attention_reference,
    hedgehog_attention,
    hedgehog_attention_reference,
    linear_attention,
    linear_attention_reference,
    linformer_attention,
    linformer_attention_reference,
    local_attention,
    local_attention_reference,
    lsh_attention,
    lsh_attention_reference,
    softmax_attention,
    softmax_attention_reference,
)
from ..config import did_you_mean

__all__ = [
    "AttentionConfig",
    "MECHANISMS",
    "MechanismSpec",
    "attention_config",
    "attention_config_from_dict",
    "attention_config_to_dict",
    "FORMS",
    "build_mechanism",
    "config_label",
    "get_mechanism",
    "parse_attention",
    "parse_mechanisms",
    "spec_for",
]

AttentionConfig = Union[
    SoftmaxConfig, LinearConfig, EfficientConfig, FavorConfig, LocalConfig, LinformerConfig, LSHConfig, HedgehogConfig,
    RetNetConfig, GLAConfig, DeltaNetConfig, GatedDeltaNetConfig, KDAConfig,
]


# "sharded": the causal form over one sequence sharded along N across the ranks of a process group
# (context parallelism, linattn.distributed): what TransformerLM.forward(context_parallel=...) and
# `linattn train --context-parallel P` need in every layer
FORMS = ("bidirectional", "causal", "recurrent", "sharded")


@dataclass(frozen=True)
class MechanismSpec:
    """What a registered mechanism is and can do: the one place a mechanism is declared.

    Benchmarks, experiments, conversion, training, the demo's error table and the command line list
    and build mechanisms from these specs. Adding a mechanism is a functional file (its fast forms,
    reference, and for a recurrent one its ``SHARDING``, :mod:`linattn.functional.sharding`), one
    :class:`~linattn.nn.mechanisms.Mechanism` module (``attend``, ``functional_inputs``, and as it
    has them ``initial_state``, ``step``, ``sharding``) and one entry in :data:`MECHANISMS`; it then
    appears in every command, benchmark, the demo's error table and context parallelism
    (tests/toy_mechanism.py is one, and tests/test_mechanism_interface.py checks each place).

    Attributes:
        name: registry key, also the ``"name"`` of its serialised config and its CLI name.
        config_type: the frozen :class:`linattn.config.Config` dataclass of its options; its
            defaults (``config_type()``, :meth:`default_config`) are the mechanism's defaults
            everywhere.
        module_type: its :class:`Mechanism` module: ``forward(q, k, v, *, causal, ...)`` and, for
            recurrent ones, ``initial_state`` and ``step`` (:meth:`build` makes one); with
            ``module_type.needs_input`` both also take the layer input ``x`` (see :attr:`needs_input`).
        function: its functional fast form, ``function(q, k, v, ...)`` (SDPA conventions).
        reference: its plain reference form, same signature; what tests trust.
        forms: the forms it has, a subset of :data:`FORMS`.
        rotary: accepts rotary positions on q and k (see the module docstring for why or why not).
        shared_qk: queries and keys come from one projection (LSH).
        state_type: the type of its decoding state, or None.
        summary: one line for listings.
    """

    name: str
    config_type: type
    module_type: type
    function: Callable[..., Any]
    reference: Callable[..., Any]
    forms: frozenset[str]
    rotary: bool
    shared_qk: bool
    state_type: type | None
    summary: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.forms) - set(FORMS))
        if unknown or not self.forms:
            raise ValueError(f"MechanismSpec {self.name!r}: forms must be a non-empty subset of {FORMS}, got {unknown}")
        for form in ("recurrent", "sharded"):
            if form in self.forms and "causal" not in self.forms:
                raise ValueError(f"MechanismSpec {self.name!r}: a {form} form needs a causal one")
        if "sharded" in self.forms and getattr(self.module_type, "sharding", None) is None:
            raise ValueError(f"MechanismSpec {self.name!r}: a sharded form is its module's sharding (the SHARDING of "
                             f"its functional file), and {getattr(self.module_type, '__name__', self.module_type)} "
                             "has none")

    @property
    def bidirectional(self) -> bool:
        return "bidirectional" in self.forms

    @property
    def causal(self) -> bool:
        """Has a causal form (usable in a language model)."""
        return "causal" in self.forms

    @property
    def recurrent(self) -> bool:
        """Has a recurrent form: ``step()`` and decoding with a state."""
        return "recurrent" in self.forms

    @property
    def sharded(self) -> bool:
        """Has a context-parallel form: its causal output over a sequence sharded across ranks."""
        return "sharded" in self.forms

    @property
    def needs_input(self) -> bool:
        """Its module's forward and step also take ``x (B, N, C)``, the layer input (its gates read it)."""
        return self.module_type.needs_input

    @property
    def step(self) -> Callable[..., Any] | None:
        """The recurrent form, ``module.step(q, k, v, state, *, x) -> (out, state)``; None without one."""
        return self.module_type.step if self.recurrent else None

    def default_config(self):
        """The config with every option at its default."""
        return self.config_type()

    def build(self, config=None, *, n_heads: int, head_dim: int, max_len: int | None = None) -> Mechanism:
        """The module for ``config`` (None: the defaults) with ``n_heads`` heads of width ``head_dim``;
        ``max_len`` is the longest input, read by mechanisms whose parameters depend on it."""
        config = self.default_config() if config is None else config
        if type(config) is not self.config_type:
            raise TypeError(f"{self.name!r} attention is built from a {self.config_type.__name__}, "
                            f"got {type(config).__name__}")
        if self.module_type.needs_max_len:
            return self.module_type(config, n_heads=n_heads, head_dim=head_dim, max_len=max_len)
        return self.module_type(config, n_heads=n_heads, head_dim=head_dim)


def _spec(name, config_type, module_type, function, reference, forms, *, rotary, shared_qk=False, state_type=None,
          summary):
    return MechanismSpec(name, config_type, module_type, function, reference, frozenset(forms.split()),
                         rotary=rotary, shared_qk=shared_qk, state_type=state_type, summary=summary)


_ALL = "bidirectional causal recurrent sharded"
_CAUSAL = "causal recurrent sharded"  # recurrences in time: no bidirectional form (see the module docstring)
MECHANISMS: dict[str, MechanismSpec] = {
    s.name: s
    for s in (
        _spec("softmax", SoftmaxConfig, SoftmaxMechanism, softmax_attention, softmax_attention_reference, _ALL,
              rotary=True, state_type=KVCache, summary="exact softmax attention; decodes with a KV cache"),
        _spec("linear", LinearConfig, LinearMechanism, linear_attention, linear_attention_reference, _ALL,
              rotary=True, state_type=LinearAttentionState,
              summary="kernel attention phi(q).phi(k); O(1) state per token"),
        _spec("efficient", EfficientConfig, EfficientMechanism, efficient_attention,
              efficient_attention_reference, "bidirectional", rotary=False,
              summary="Efficient Attention (softmax over features x softmax over keys); bidirectional"),
        _spec("favor", FavorConfig, FavorMechanism, favor_attention, favor_attention_reference, _ALL,
              rotary=True, state_type=LinearAttentionState,
              summary="Performer FAVOR+ random features; O(1) state per token"),
        _spec("local", LocalConfig, LocalMechanism, local_attention, local_attention_reference, _ALL,
              rotary=True, state_type=LocalAttentionState,
              summary="sliding-window softmax; ring buffer of the last window keys"),
        _spec("linformer", LinformerConfig, LinformerMechanism, linformer_attention,
              linformer_attention_reference, "bidirectional", rotary=False,
              summary="Linformer sequence projections E, F; bidirectional"),
        _spec("lsh", LSHConfig, LSHMechanism, lsh_attention, lsh_attention_reference, "bidirectional causal",
              rotary=True, shared_qk=True, summary="Reformer LSH attention with shared query-key projection"),
        _spec("hedgehog", HedgehogConfig, HedgehogMechanism, hedgehog_attention, hedgehog_attention_reference,
              "bidirectional", rotary=False,
              summary="Hedgehog learnable softmax feature maps (+ optional softmax window); bidirectional"),
        _spec("retnet", RetNetConfig, RetNetMechanism, gated_linear_attention, gated_linear_attention_reference,
              _CAUSAL, rotary=True, state_type=DecayedState,
              summary="RetNet retention: fixed per-head decays 1 - 2^(-5-h); O(1) state per token"),
        _spec("gla", GLAConfig, GLAMechanism, gated_linear_attention, gated_linear_attention_reference, _CAUSAL,
              rotary=True, state_type=DecayedState,
              summary="gated linear attention: low-rank data-dependent per-channel decays; O(1) state per token"),
        _spec("deltanet", DeltaNetConfig, DeltaNetMechanism, delta_rule_attention, delta_rule_attention_reference,
              _CAUSAL, rotary=False, state_type=DecayedState,
              summary="DeltaNet: delta-rule updates of unit keys; O(1) state per token"),
        _spec("gated_deltanet", GatedDeltaNetConfig, GatedDeltaNetMechanism, delta_rule_attention,
              delta_rule_attention_reference, _CAUSAL, rotary=False, state_type=DecayedState,
              summary="Gated DeltaNet: delta rule with Mamba-2 decays and output gate; O(1) state per token"),
        _spec("kda", KDAConfig, KDAMechanism, delta_rule_attention, delta_rule_attention_reference, _CAUSAL,
              rotary=False, state_type=DecayedState,
              summary="Kimi Delta Attention: delta rule with low-rank per-channel decays; O(1) state per token"),
    )
}



def get_mechanism(name: str) -> MechanismSpec:
    """The spec registered as ``name``; raises ValueError listing the registered names."""
    if not isinstance(name, str):
        raise TypeError(f"get_mechanism: name must be a str, got {type(name).__name__}")
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"unknown attention mechanism {name!r}{did_you_mean(name, MECHANISMS)}; "
                         f"registered: {sorted(MECHANISMS)}") from None


def spec_for(config) -> MechanismSpec:
    """The spec whose config type ``config`` is; TypeError naming the accepted types otherwise."""
    # a scan, not a cached map: MECHANISMS stays the only table (tests may add an entry to it)
    spec = next((s for s in MECHANISMS.values() if type(config) is s.config_type), None)
    if spec is None:
        names = ", ".join(s.config_type.__name__ for s in MECHANISMS.values())
        raise TypeError(f"attention must be a mechanism config ({names}), got {type(config).__name__}")
    return spec


def attention_config(name: str, **options: Any) -> AttentionConfig:
    """The config of mechanism ``name`` with ``options``, e.g. ``attention_config("local", window=64)``.

    Unknown names and unknown options raise ValueError listing what exists.
    """
    spec = get_mechanism(name)
    known = [f.name for f in dataclasses.fields(spec.config_type)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        hints = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in unknown)
        raise ValueError(f"{name!r} attention has no option(s) {hints}; its options: {sorted(known)}")
    return spec.config_type(**options)


def attention_config_to_dict(config) -> dict[str, Any]:
    """``{"name": <mechanism>, **options}``, JSON-serialisable."""
    return {"name": spec_for(config).name, **config.to_dict()}


def attention_config_from_dict(d: dict[str, Any]) -> AttentionConfig:
    """Inverse of :func:`attention_config_to_dict`."""
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"an attention config dict needs a 'name' key (one of {sorted(MECHANISMS)}), got {d!r}")
    options = dict(d)
    return attention_config(options.pop("name"), **options)


def build_mechanism(config, *, n_heads: int, head_dim: int, max_len: int | None = None) -> Mechanism:
    """The mechanism module for ``config`` with ``n_heads`` heads of width ``head_dim``."""
    return spec_for(config).build(config, n_heads=n_heads, head_dim=head_dim, max_len=max_len)


def parse_attention(text: str) -> AttentionConfig:
    """An attention config from the command line: a registered name (``"local"``, its defaults)
    or a JSON object (``'{"name": "local", "window": 64}'``). ValueError naming what exists."""
    text = str(text).strip()
    if text.startswith("{"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"attention {text!r} is not valid JSON: {e}") from None
        return attention_config_from_dict(d)
    return attention_config(text)


def parse_mechanisms(text: str) -> tuple[AttentionConfig, ...]:
    """Attention configs from the command line: comma-separated registered names
    (``"linear,softmax"``) or a JSON list of names and config objects
    (``'["linear", {"name": "local", "window": 64}]'``)."""
    text = str(text).strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"mechanisms {text!r} is not a valid JSON list: {e}") from None
        if not isinstance(items, list):
            raise ValueError(f"mechanisms must be a JSON list, got {text!r}")
        return tuple(attention_config_from_dict(x) if isinstance(x, dict) else attention_config(x) for x in items)
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError("mechanisms: give at least one mechanism name")
    return tuple(attention_config(x) for x in names)


def config_label(config) -> str:
    """A short label: the name, then every option that differs from its default
    (``"local window=64"``, ``"favor num_features=64 orthogonal=False"``)."""
    spec = spec_for(config)
    default = spec.default_config()
    changed = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(default, f.name)]
    return " ".join([spec.name, *changed])
