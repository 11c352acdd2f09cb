"""Attention mechanisms behind one interface, each with its frozen config dataclass.

A mechanism module takes per-head queries, keys and values and owns whatever the mechanism itself
needs (FAVOR's projection, Linformer's E and F, LSH's rotation seed) but never the q/k/v/output
projections: those belong to :class:`linattn.nn.MultiHeadAttention`, which calls any mechanism.

Dimension legend: B batch, H heads, N positions, D head width (of q, k and v), F feature width,
W local window, L cached positions, Lmax KV-cache capacity.

Every mechanism module has one interface (:class:`Mechanism`):

- ``forward(q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens)``:
  ``q, k, v (B, H, N, D)`` -> ``(B, H, N, D)`` (q and k with ``n_key_heads`` Hk heads where the
  mechanism groups its value heads), and with ``return_state`` (causal only) also the
  state after position N - 1. ``x (B, N, C)`` is the layer input the q/k/v projections read;
  mechanisms whose class sets ``needs_input`` (the gated and delta-rule ones of
  :mod:`linattn.nn.gated`, whose gates are functions of it) require it, the others do not read it.
  ``key_padding_mask`` is bool ``(B, N)``, True = a real key that may be attended, False =
  padding. ``cu_seqlens``: documents packed along N (int32 or int64 offsets, batch size 1); a mechanism
  without a packed form (``packed = False``) raises instead of ignoring it;
- ``initial_state(batch_size, *, device, dtype)``: the state before any position (recurrent ones);
- ``step(q, k, v, state, *, x)``: one position, ``(B, H, 1, D)`` each -> ``(B, H, 1, D)`` and the
  next state. Equal to the matching row of the causal forward;
- ``functional_inputs(q, k, v, x, *, causal)`` and ``functional_output(o, x)``: the inputs and
  options of its registered functional form (``MECHANISMS[name].function``, and its reference)
  for these q, k, v, and what the module does to that form's output. The demo's error table and
  the benchmarks call the functional forms through them; context parallelism too, which is the
  engine's, not the module's: a layer hands them and the mechanism's ``sharding`` (the
  ``SHARDING`` of its functional file, :mod:`linattn.functional.sharding`) to the
  ``ContextParallel`` it was given, whose one driver does the exchange. No mechanism branches on
  it, and this tier does not import :mod:`linattn.distributed`.

Subclasses implement ``attend`` (the forward's work, with the same keywords) and, as they have
them, ``initial_state``, ``step`` and ``functional_inputs``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ..config import Config
from ..functional import linear as _linear, local as _local, softmax as _softmax
from ..functional import favor as _favor
from ..functional.efficient import efficient_attention
from ..functional.feature_maps import FEATURE_MAPS, resolve_feature_map
from ..functional.hedgehog import HedgehogMaps, hedgehog_attention, hedgehog_attention_weights
from ..functional.linear import LinearAttentionState, linear_attention
from ..functional.local import LocalAttentionState, local_attention
from ..functional.lsh import lsh_attention
from ..functional.softmax import softmax_attention
from .favor import FavorAttention, FavorConfig
from .linformer import LinformerAttention

__all__ = [
    "EfficientConfig",
    "EfficientMechanism",
    "FavorConfig",
    "FavorMechanism",
    "HedgehogConfig",
    "HedgehogMechanism",
    "KVCache",
    "LSHConfig",
    "LSHMechanism",
    "LinearConfig",
    "LinearMechanism",
    "LinformerConfig",
    "LinformerMechanism",
    "LocalConfig",
    "LocalMechanism",
    "Mechanism",
    "SoftmaxConfig",
    "SoftmaxMechanism",
]


# ---------------------------------------------------------------------------------------------
# Configs: one frozen dataclass per mechanism. FavorConfig is linattn.nn.FavorConfig itself.
# ---------------------------------------------------------------------------------------------


def _positive_int(owner: str, name: str, value, *, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{owner}: {name} must be an int >= 1{extra}, got {value!r}")


@dataclass(frozen=True)
class SoftmaxConfig(Config):
    """Exact softmax attention (:func:`linattn.softmax_attention`); no options."""


@dataclass(frozen=True)
class LinearConfig(Config):
    """Kernel attention (:func:`linattn.linear_attention`).

    Attributes:
        feature_map: a name in ``linattn.FEATURE_MAPS`` (``"elu"``, ``"relu"``, ``"cos"``,
            ``"softmax"``). Callables are not accepted here: a config must serialise.
    """

    feature_map: str = "elu"

    def __post_init__(self) -> None:
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"LinearConfig: unknown feature_map {self.feature_map!r}; known: {sorted(FEATURE_MAPS)}"
            )


@dataclass(frozen=True)
class EfficientConfig(Config):
    """Efficient Attention (:func:`linattn.efficient_attention`); no options, no causal form."""


@dataclass(frozen=True)
class LocalConfig(Config):
    """Sliding-window softmax attention (:func:`linattn.local_attention`).

    Attributes:
        window: the largest distance |i - j| attended (causal: i - window <= j <= i).
    """

    window: int = 128

    def __post_init__(self) -> None:
        _positive_int("LocalConfig", "window", self.window)


@dataclass(frozen=True)
class LinformerConfig(Config):
    """Linformer attention (:class:`linattn.LinformerAttention`); bidirectional only.

    Attributes:
        proj_len: P, the projected length.
        max_len: the largest number of keys (columns of E and F); None means the model's max_len.
        share_kv: one matrix for E and F.
        seed: seeds the generator that draws the initial E and F.
    """

    proj_len: int = 64
    max_len: int | None = None
    share_kv: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int("LinformerConfig", "proj_len", self.proj_len)
        _positive_int("LinformerConfig", "max_len", self.max_len, allow_none=True)


@dataclass(frozen=True)
class HedgehogConfig(Config):
    """Hedgehog attention (:func:`linattn.functional.hedgehog.hedgehog_attention`): learnable
    softmax feature maps (arXiv 2402.04347), optionally beside a sliding softmax window (LoLCATs,
    arXiv 2410.10254). Bidirectional only. Meant to be trained: distilled toward softmax attention.

    Attributes:
        feature_dim: F, features per half (phi has 2F); None means the head width D, and then the
            maps start as the identity (phi(x) = [softmax(x), softmax(-x)]), as in the paper.
        window: the largest distance |i - j| weighed by exact softmax; 0 (default) for none, plain
            Hedgehog. A window at least as long as the inputs is exact softmax, not linear attention.
        seed: seeds the initial maps when F != D (random projections then).
    """

    feature_dim: int | None = None
    window: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int("HedgehogConfig", "feature_dim", self.feature_dim, allow_none=True)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"HedgehogConfig: window must be an int >= 0 (0: no window), got {self.window!r}")


@dataclass(frozen=True)
class LSHConfig(Config):
    """Reformer LSH attention (:func:`linattn.lsh_attention`), shared query-key projection.

    Attributes:
        n_hashes: hash rounds.
        bucket_size: chunk length; must divide every sequence length the layer sees.
        seed: seeds the rotations. Every forward draws them from a generator seeded with this, so
            the buckets are a fixed function of the inputs (repeatable, no hidden counter).
    """

    n_hashes: int = 4
    bucket_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int("LSHConfig", "n_hashes", self.n_hashes)
        _positive_int("LSHConfig", "bucket_size", self.bucket_size)


# ---------------------------------------------------------------------------------------------
# States
# ---------------------------------------------------------------------------------------------


class KVCache(NamedTuple):
    """Decoding state of softmax attention: the keys and values of every position so far.

    Attributes:
        k: ``(B, H, Lmax, D)`` keys; positions ``0 .. length - 1`` are filled, the rest is spare
            capacity (grown by doubling, so appending costs amortised O(1) copies per position).
        v: ``(B, H, Lmax, D)`` values, same slots.
        length: L, the number of positions cached.

    Without autograd, :meth:`SoftmaxMechanism.step` writes the new position into spare capacity in
    place: the returned cache may share storage with the one passed in. The old cache still reads
    correctly (it ignores slots at and after its ``length``), but two branches decoded from the
    same cache would overwrite each other's slot: ``clone()`` a cache before branching.
    """

    k: Tensor
    v: Tensor
    length: int

    def keys(self) -> Tensor:
        """``(B, H, L, D)``: the cached keys."""
        return self.k[:, :, : self.length]

    def values(self) -> Tensor:
        """``(B, H, L, D)``: the cached values."""
        return self.v[:, :, : self.length]

    def clone(self) -> "KVCache":
        return KVCache(self.k.clone(), self.v.clone(), self.length)


def _check_state_type(name: str, state, expected: type) -> None:
    if not isinstance(state, expected):
        raise TypeError(
            f"{name}.step: state must be a {expected.__name__} (from initial_state() or a forward "
            f"with return_state=True), got {type(state).__name__}"
        )


# ---------------------------------------------------------------------------------------------
# Mechanism modules
# ---------------------------------------------------------------------------------------------


class Mechanism(nn.Module):
    """Base class: one attention mechanism for ``n_heads`` heads of width ``head_dim``, behind the
    one interface of the module docstring.

    Subclasses implement :meth:`attend`; recurrent ones also :meth:`initial_state`, :meth:`step`;
    those with a sharded form :meth:`functional_inputs` (and :meth:`functional_output` when the module does
    more than its functional form).
    """

    name: ClassVar[str]
    # True when the constructor takes ``max_len`` (parameters sized by the longest input)
    needs_max_len: ClassVar[bool] = False
    # True when forward and step read ``x``, the layer input ``(B, N, C)`` the q/k/v projections
    # read: mechanisms whose gates are functions of it (linattn.nn.gated)
    needs_input: ClassVar[bool] = False
    # True when its causal forward takes ``cu_seqlens`` (integer ``(n + 1,)`` offsets of n documents
    # packed along N, batch size 1; see linattn.functional.varlen): no position attends another
    # document. Without a packed form, cu_seqlens raises.
    packed: ClassVar[bool] = False
    # Its functional form's sharded form (linattn.functional.sharding), None without one
    sharding: ClassVar[Any] = None

    def __init__(self, *, n_heads: int, head_dim: int, n_key_heads: int | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        # Hk, the heads of q and k: H unless the mechanism groups its value heads (the delta rule's
        # n_key_heads), where value head h reads query/key head h // (H / Hk)
        self.n_key_heads = n_heads if n_key_heads is None else n_key_heads

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, x: Tensor | None = None, causal: bool = False,
                key_padding_mask: Tensor | None = None, return_state: bool = False,
                cu_seqlens: Tensor | None = None):
        """``q, k, v (B, H, N, D)`` -> ``(B, H, N, D)`` (and the state after position N - 1 with
        ``return_state``); the keywords are the module docstring's, the same for every mechanism."""
        if cu_seqlens is not None and not self.packed:
            raise ValueError(f"{type(self).__name__}: {self.name!r} attention has no packed form (cu_seqlens); "
                             "the mechanisms with one: linattn.nn.MECHANISMS entries whose module sets packed")
        if self.needs_input:
            self._check_input("forward", q, x)
        return self.attend(q, k, v, x=x, causal=causal, key_padding_mask=key_padding_mask, return_state=return_state,
                           cu_seqlens=cu_seqlens)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, x: Tensor | None, causal: bool,
               key_padding_mask: Tensor | None, return_state: bool, cu_seqlens: Tensor | None):
        """The forward's work, with its keywords (``cu_seqlens`` only when ``packed``)."""
        raise NotImplementedError

    def _check_input(self, what: str, q: Tensor, x) -> None:
        """``x`` must be the layer input ``(B, N, C)`` matching ``q (B, H, N, D)``."""
        C = self.n_heads * self.head_dim
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__}.{what}: x (the layer input the gates read) must be a tensor "
                            f"(B, N, C = {C}), got {type(x).__name__}")
        B, _, N, _ = q.shape
        if tuple(x.shape) != (B, N, C):
            raise ValueError(f"{type(self).__name__}.{what}: x must have shape (B, N, C) = ({B}, {N}, {C}) "
                             f"to match q {tuple(q.shape)}, got {tuple(x.shape)}")

    def functional_inputs(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None, *,
                          causal: bool) -> tuple[tuple, dict]:
        """Its registered functional form's positional inputs and keyword options (``causal``
        among them where the form takes it) for ``q, k, v (B, H, N, D)`` and the layer input
        ``x``: the module's computation, short of :meth:`functional_output`, is
        ``function(*inputs, **options)`` (and its reference's the same)."""
        raise NotImplementedError

    def functional_output(self, o: Tensor, x: Tensor | None) -> Tensor:
        """The module's output from its functional form's output ``o (B, H, N, D)``."""
        return o

    def _no_recurrent(self, what: str):
        return ValueError(
            f"{type(self).__name__}: {self.name!r} attention has no recurrent form, so it has no "
            f"{what}; the mechanisms with one have 'recurrent' among their forms in linattn.nn.MECHANISMS"
        )

    def initial_state(self, batch_size: int, *, device=None, dtype=None):
        raise self._no_recurrent("decoding state")

    def step(self, q: Tensor, k: Tensor, v: Tensor, state, *, x: Tensor | None = None):
        raise self._no_recurrent("step()")

    def extra_repr(self) -> str:
        keys = f", n_key_heads={self.n_key_heads}" if self.n_key_heads != self.n_heads else ""
        return f"n_heads={self.n_heads}{keys}, head_dim={self.head_dim}"


class SoftmaxMechanism(Mechanism):
    name = "softmax"
    packed = True
    # no summary of the past exists: every rank's keys and values are gathered (O(N) per rank)
    sharding = _softmax.SHARDING

    def __init__(self, config: SoftmaxConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config


    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        out = softmax_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        if not return_state:
            return out
        if not causal:
            raise ValueError("SoftmaxMechanism: return_state needs causal=True (a decoding state)")
        if key_padding_mask is not None:
            raise ValueError(
                "SoftmaxMechanism: return_state with a key_padding_mask is not supported (the KV "
                "cache has no padding slots); decode unpadded prompts"
            )
        return out, KVCache(k, v, k.shape[2])

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v), {"causal": causal}

    def initial_state(self, batch_size: int, *, device=None, dtype=None, capacity: int = 16) -> KVCache:
        """An empty cache with room for ``capacity`` positions: k, v ``(B, H, capacity, D)``."""
        shape = (batch_size, self.n_heads, capacity, self.head_dim)
        return KVCache(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype), 0)

    def step(self, q, k, v, state, *, x=None):
        _check_state_type(type(self).__name__, state, KVCache)
        L = state.length
        ck, cv = state.k, state.v
        if torch.is_grad_enabled() and (ck.requires_grad or k.requires_grad or v.requires_grad):
            # functional append: keeps every earlier graph intact
            ck = torch.cat([state.keys(), k], dim=2)  # (B, H, L + 1, D)
            cv = torch.cat([state.values(), v], dim=2)
        else:
            if L == ck.shape[2]:  # full: double the capacity
                grow = max(L, 16)
                ck = torch.cat([ck, ck.new_zeros(*ck.shape[:2], grow, ck.shape[3])], dim=2)
                cv = torch.cat([cv, cv.new_zeros(*cv.shape[:2], grow, cv.shape[3])], dim=2)
            ck[:, :, L : L + 1] = k
            cv[:, :, L : L + 1] = v
        new = KVCache(ck, cv, L + 1)
        # the newest position sees every cached one: no mask needed
        return softmax_attention(q, new.keys(), new.values()), new


class LinearMechanism(Mechanism):
    name = "linear"
    packed = True
    sharding = _linear.SHARDING

    def __init__(self, config: LinearConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config
        phi = resolve_feature_map("LinearMechanism", config.feature_map)
        self.feature_dim = phi(torch.zeros(1, head_dim)).shape[-1]  # F ("cos" adds one)


    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        return linear_attention(q, k, v, feature_map=self.config.feature_map, causal=causal,
                                key_padding_mask=key_padding_mask, return_state=return_state, cu_seqlens=cu_seqlens)

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v), {"feature_map": self.config.feature_map, "causal": causal}

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> LinearAttentionState:
        """Zero sums: S ``(B, H, F, D)``, z ``(B, H, F)`` (what no key at all contributes)."""
        B, H, F, D = batch_size, self.n_heads, self.feature_dim, self.head_dim
        return LinearAttentionState(torch.zeros(B, H, F, D, device=device, dtype=dtype),
                                    torch.zeros(B, H, F, device=device, dtype=dtype))

    def step(self, q, k, v, state, *, x=None):
        _check_state_type(type(self).__name__, state, LinearAttentionState)
        return linear_attention(q, k, v, feature_map=self.config.feature_map, causal=True,
                                initial_state=state, return_state=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.config.feature_map!r}"


class EfficientMechanism(Mechanism):
    name = "efficient"

    def __init__(self, config: EfficientConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config

    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        if return_state:
            raise self._no_recurrent("state to return")
        return efficient_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask)

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v), {"causal": causal}


class FavorMechanism(Mechanism):
    """FAVOR+ through :class:`linattn.nn.FavorAttention` (``self.favor``), which owns the
    projection buffer ``(m, D)``."""

    name = "favor"
    packed = True
    sharding = _favor.SHARDING

    def __init__(self, config: FavorConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        if config.head_dim is None:
            config = dataclasses.replace(config, head_dim=head_dim)
        elif config.head_dim != head_dim:
            raise ValueError(
                f"FavorMechanism: FavorConfig.head_dim = {config.head_dim} but the layer's head width "
                f"is {head_dim} (d_model / n_heads); leave head_dim None to take the layer's"
            )
        self.config = config
        self.favor = FavorAttention(config)
        m = config.num_features
        self.feature_dim = 2 * m if config.features == "trig" else m


    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        return self.favor(q, k, v, causal=causal, key_padding_mask=key_padding_mask, return_state=return_state,
                          cu_seqlens=cu_seqlens)

    def functional_inputs(self, q, k, v, x, *, causal):
        tensors, options = self.favor.inputs(q, k, v)
        return tensors, {**options, "causal": causal}

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> LinearAttentionState:
        """Zero sums at the lowest finite scale (below every key's log-magnitude, so the first key
        sets the scale exactly as without a state). Float32 for half dtypes, as the sums are."""
        dtype = dtype or torch.get_default_dtype()
        dt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        B, H, F, D = batch_size, self.n_heads, self.feature_dim, self.head_dim
        return LinearAttentionState(
            torch.zeros(B, H, F, D, device=device, dtype=dt),
            torch.zeros(B, H, F, device=device, dtype=dt),
            torch.full((B, H), torch.finfo(dt).min, device=device, dtype=dt),
        )

    def step(self, q, k, v, state, *, x=None):
        _check_state_type(type(self).__name__, state, LinearAttentionState)
        return self.favor(q, k, v, causal=True, initial_state=state, return_state=True)


class LocalMechanism(Mechanism):
    name = "local"
    packed = True
    # a halo: the W keys and values before the shard, from the previous rank(s)
    sharding = _local.SHARDING

    def __init__(self, config: LocalConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config


    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        return local_attention(q, k, v, window=self.config.window, causal=causal,
                               key_padding_mask=key_padding_mask, return_state=return_state, cu_seqlens=cu_seqlens)

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> LocalAttentionState:
        """An empty ring buffer: k, v ``(B, H, W, D)`` zeros, valid ``(B, W)`` all False, pos 0."""
        shape = (batch_size, self.n_heads, self.config.window, self.head_dim)
        return LocalAttentionState(
            torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(batch_size, self.config.window, device=device, dtype=torch.bool), 0,
        )

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v), {"window": self.config.window, "causal": causal}

    def step(self, q, k, v, state, *, x=None):
        _check_state_type(type(self).__name__, state, LocalAttentionState)
        return local_attention(q, k, v, window=self.config.window, causal=True, initial_state=state,
                               return_state=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.config.window}"


class LinformerMechanism(Mechanism):
    """Linformer through :class:`linattn.LinformerAttention` (``self.linformer``, owns E, F)."""

    name = "linformer"

    needs_max_len = True

    def __init__(self, config: LinformerConfig, *, n_heads: int, head_dim: int, max_len: int | None) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        n = config.max_len if config.max_len is not None else max_len
        if n is None:
            raise ValueError(
                "LinformerMechanism: the number of columns of E and F is unknown: set "
                "LinformerConfig.max_len or pass max_len to MultiHeadAttention"
            )
        if max_len is not None and n < max_len:
            raise ValueError(
                f"LinformerMechanism: LinformerConfig.max_len = {n} is below the model's max_len = "
                f"{max_len}; longer inputs would have no columns of E and F"
            )
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        self.linformer = LinformerAttention(n, config.proj_len, share_kv=config.share_kv, generator=g)

    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        if causal or return_state:
            raise ValueError(
                "LinformerMechanism: Linformer has no causal (or recurrent) form: E and F mix all "
                "positions into each projected key"
            )
        return self.linformer(q, k, v, key_padding_mask=key_padding_mask)

    def functional_inputs(self, q, k, v, x, *, causal):
        return (q, k, v, *self.linformer.projections(q, k.shape[2])), {"causal": causal}


class LSHMechanism(Mechanism):
    """Reformer LSH attention. Called with ``q is k`` (the shared query-key projection)."""

    name = "lsh"
    packed = True

    def __init__(self, config: LSHConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config

    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        if return_state:
            raise self._no_recurrent("state to return")
        if q is not k:
            raise ValueError("LSHMechanism: LSH attention shares queries and keys; pass the same tensor as q and k")
        c = self.config
        g = torch.Generator().manual_seed(c.seed)
        return lsh_attention(q, v, n_hashes=c.n_hashes, bucket_size=c.bucket_size, causal=causal,
                             key_padding_mask=key_padding_mask, generator=g, cu_seqlens=cu_seqlens)

    def functional_inputs(self, q, k, v, x, *, causal):
        c = self.config
        return (q, v), {"n_hashes": c.n_hashes, "bucket_size": c.bucket_size, "causal": causal,
                        "generator": torch.Generator(device=q.device).manual_seed(c.seed)}

    def extra_repr(self) -> str:
        c = self.config
        return f"{super().extra_repr()}, n_hashes={c.n_hashes}, bucket_size={c.bucket_size}"


class HedgehogMechanism(Mechanism):
    """Hedgehog attention with trainable per-head feature maps (parameters ``q_weight``,
    ``k_weight`` ``(H, D, F)``, ``q_bias``, ``k_bias`` ``(H, F)``, ``log_gain`` ``(H,)``)."""

    name = "hedgehog"

    def __init__(self, config: HedgehogConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim)
        self.config = config
        H, D = n_heads, head_dim
        Fdim = config.feature_dim or D
        if Fdim == D:
            # identity start: phi(q).phi(k) is then already large where q and k align
            w = torch.eye(D).expand(H, D, D).clone()
        else:
            g = torch.Generator().manual_seed(config.seed)
            w = torch.randn(H, D, Fdim, generator=g) / math.sqrt(D)
        self.q_weight = nn.Parameter(w.clone())
        self.k_weight = nn.Parameter(w.clone())
        self.q_bias = nn.Parameter(torch.zeros(H, Fdim))
        self.k_bias = nn.Parameter(torch.zeros(H, Fdim))
        self.log_gain = nn.Parameter(torch.zeros(H))

    def maps(self) -> HedgehogMaps:
        return HedgehogMaps(self.q_weight, self.q_bias, self.k_weight, self.k_bias, self.log_gain)

    def attend(self, q, k, v, *, x, causal, key_padding_mask, return_state, cu_seqlens):
        if causal or return_state:
            raise ValueError("HedgehogMechanism: hedgehog attention is bidirectional only (no causal or recurrent form)")
        return hedgehog_attention(q, k, v, self.maps(), window=self.config.window, key_padding_mask=key_padding_mask)

    def functional_inputs(self, q, k, v, x, *, causal):
        if causal:
            raise ValueError("HedgehogMechanism: hedgehog attention is bidirectional only (no causal form)")
        return (q, k, v, self.maps()), {"window": self.config.window}

    def attention_weights(self, q: Tensor, k: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """The explicit ``(B, H, N, N)`` weights (O(N^2)), for distilling toward softmax weights."""
        return hedgehog_attention_weights(q, k, self.maps(), window=self.config.window,
                                          key_padding_mask=key_padding_mask)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_dim={self.q_weight.shape[2]}, window={self.config.window}"
