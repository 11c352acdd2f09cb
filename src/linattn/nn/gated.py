"""Gated and delta-rule mechanisms: RetNet, GLA, DeltaNet and Gated DeltaNet, each with its config.

Each is the layer recipe of its paper around one call of :func:`linattn.functional.gated.gated_linear_attention`
(RetNet, GLA) or :func:`linattn.functional.delta.delta_rule_attention` (DeltaNet, Gated DeltaNet):
the gates (decays, writing strengths), the feature maps of q and k, the per-head output norm and
the output gate. The q/k/v and output projections stay in :class:`linattn.nn.MultiHeadAttention`.

Their gates are functions of the layer input, so these mechanisms set ``needs_input`` and take it:
``forward(q, k, v, *, x, causal, key_padding_mask, return_state)`` and ``step(q, k, v, state, *, x)``,
where ``x`` is what the q/k/v projections read (after the layer's short convolution, if any).

They are recurrences in time: a causal and a recurrent form, no bidirectional one (a request for
one raises, naming the mechanism). Their decoding state is :class:`DecayedState`, one
``(B, H, D, D)`` matrix per layer whatever the position.

Dimension legend: B batch, N positions, H heads, D head width (of q, k and v: the layer splits
its width evenly), C = H * D the layer width, R the rank of GLA's gate.

Where these layers differ from the papers' recipes, and why:

- Value width. The papers widen the values (RetNet, GLA and Gated DeltaNet use ``Dv = 2 D``);
  here q, k and v share the head width D, because :class:`~linattn.nn.MultiHeadAttention` owns
  the projections and splits one width into heads for every mechanism. The functional forms take
  any ``Dv``.
- Short convolution. DeltaNet and Gated DeltaNet convolve q, k and v after their projections;
  here it is the model's ``TransformerConfig.short_conv``, one causal convolution of the layer
  input before the projections (so the gates read the convolved input too), whose decoding state
  the layer already keeps.
- Output norm. The papers normalise each head's output with a gain per channel and head (RetNet
  a GroupNorm, GLA and the delta nets an RMSNorm); here one RMSNorm gain of D is shared by the
  heads (see :class:`GatedMechanism`).
- Positions. RetNet's xPos rotation is the model's ``positional="rotary"`` (no length
  extrapolation factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Config
from ..functional.decayed_state import DecayedState
from ..functional.delta import delta_rule_attention
from ..functional.gated import gated_linear_attention
from ..functional import delta as _delta, gated as _gated
from .mechanisms import Mechanism

__all__ = [
    "DeltaNetConfig",
    "DeltaNetMechanism",
    "GLAConfig",
    "GLAMechanism",
    "GatedDeltaNetConfig",
    "GatedDeltaNetMechanism",
    "GatedMechanism",
    "KDAConfig",
    "KDAMechanism",
    "RetNetConfig",
    "RetNetMechanism",
]


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def _check_bools(owner: str, config, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"{owner}: {name} must be a bool, got {getattr(config, name)!r}")


def _check_positive(owner: str, name: str, value, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be {'an int' if integer else 'a number'} > 0, got {value!r}")


@dataclass(frozen=True)
class RetNetConfig(Config):
    """Retention (RetNet, arXiv 2307.08621): a fixed decay per head, gamma_h = 1 - 2^(-5 - h) for
    heads h = 0 .. H - 1, so that heads see from about 32 to about 2^(4 + H) positions back.

    ``S_t = gamma_h S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``; q and k as projected (the
    paper's rotation of q and k by position is the model's ``positional="rotary"``).

    Attributes:
        output_gate: multiply each head's output by swish(x W_G), the paper's gate (W_G: C -> C,
            no bias, owned by the mechanism).
        output_norm: normalise each head's output over its D channels (RMSNorm with a gain of D
            shared by the heads) before the gate; the paper's GroupNorm with one group per head.
    """

    output_gate: bool = True
    output_norm: bool = True

    def __post_init__(self) -> None:
        _check_bools("RetNetConfig", self, ("output_gate", "output_norm"))


@dataclass(frozen=True)
class GLAConfig(Config):
    """Gated linear attention (GLA, arXiv 2312.06635): a data-dependent decay per head, position and
    key channel, alpha_t = sigmoid(x_t W_1 W_2 + b)^(1 / temperature), from a low-rank projection
    of the layer input (W_1: C -> R, W_2: R -> C, bias b).

    ``S_t = diag(alpha_t) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``; q and k as projected.

    Attributes:
        gate_rank: R, the rank of the decay's projection (the paper's 16).
        gate_temperature: the decay's log is logsigmoid(x W_1 W_2 + b) / temperature; a larger
            temperature keeps the decays closer to 1 (the paper's 16: about 0.96 at initialisation).
        output_gate: multiply each head's output by swish(x W_r + b_r) (W_r: C -> C).
        output_norm: normalise each head's output over its D channels (RMSNorm, gain shared by the
            heads) before the gate; the paper's LayerNorm without the mean subtraction.
    """

    gate_rank: int = 16
    gate_temperature: float = 16.0
    output_gate: bool = True
    output_norm: bool = True

    def __post_init__(self) -> None:
        _check_positive("GLAConfig", "gate_rank", self.gate_rank, integer=True)
        _check_positive("GLAConfig", "gate_temperature", self.gate_temperature)
        _check_bools("GLAConfig", self, ("output_gate", "output_norm"))


@dataclass(frozen=True)
class DeltaNetConfig(Config):
    """DeltaNet (arXiv 2406.06484): the delta rule, with keys and queries through SiLU then L2
    normalisation, values through SiLU, and a writing strength beta_t = sigmoid(x_t W_beta) per head
    (W_beta: C -> H).

    ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    The paper's short convolutions (after the q, k, v projections) are the model's
    ``TransformerConfig.short_conv`` (a convolution of the layer input before the projections, which
    the gates then read too): the mechanism carries none of its own, because its state is the one
    matrix :class:`DecayedState` and the layer already keeps a convolution's decoding state. A
    DeltaNet model should set ``short_conv=4`` (the paper's kernel size).

    Attributes:
        output_gate: multiply each head's output by swish(x W_g) (W_g: C -> C); off in the paper's
            DeltaNet, on in Gated DeltaNet.
        output_norm: normalise each head's output over its D channels (RMSNorm, gain shared by the
            heads), as the paper does before the output projection.
        n_key_heads: Hk, the heads of q and k (grouped value heads, as Qwen3-Next and Qwen3.5
            have them): None = the layer's n_heads H; else it must divide H, and value head h
            reads query/key head h // (H / Hk). The q and k projections shrink to Hk heads; the
            state stays one (D, D) matrix per value head.
    """

    output_gate: bool = False
    output_norm: bool = True
    n_key_heads: int | None = None

    def __post_init__(self) -> None:
        _check_bools("DeltaNetConfig", self, ("output_gate", "output_norm"))
        _check_key_heads("DeltaNetConfig", self.n_key_heads)


def _check_key_heads(owner: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: n_key_heads must be an int >= 1 or None, got {value!r}")


def _key_heads(config, n_heads: int) -> int:
    """Hk from ``config.n_key_heads``: None is ``n_heads``; else it must divide ``n_heads``."""
    hk = config.n_key_heads
    if hk is None:
        return n_heads
    if n_heads % hk:
        raise ValueError(f"{type(config).__name__}: n_key_heads = {hk} must divide the layer's n_heads = {n_heads} "
                         "(each query/key head serves n_heads / n_key_heads value heads)")
    return hk


def _check_mamba_decay(owner: str, config) -> None:
    """The Mamba-2 decay options of ``config``: a_min <= a_max and dt_min <= dt_max, all > 0, and
    an int seed."""
    for name in ("a_min", "a_max", "dt_min", "dt_max"):
        _check_positive(owner, name, getattr(config, name))
    if config.a_min > config.a_max or config.dt_min > config.dt_max:
        raise ValueError(f"{owner}: need a_min <= a_max and dt_min <= dt_max, got a = [{config.a_min}, "
                         f"{config.a_max}], dt = [{config.dt_min}, {config.dt_max}]")
    if isinstance(config.seed, bool) or not isinstance(config.seed, int):
        raise TypeError(f"{owner}: seed must be an int, got {config.seed!r}")


@dataclass(frozen=True)
class _MambaDecayConfig(Config):
    """The options Gated DeltaNet and KDA share: Mamba-2's decay initialisation and grouped value
    heads (each subclass's docstring describes them for its layer).

    Attributes:
        a_min: A = exp(A_log) starts uniform in [a_min, a_max] per head.
        a_max: see a_min.
        dt_min: softplus(dt_bias) starts log-uniform in [dt_min, dt_max].
        dt_max: see dt_min.
        seed: seeds the generator that draws the initial A_log and dt_bias.
        n_key_heads: Hk, the heads of q and k; None = the layer's n_heads.
    """

    a_min: float = 1.0
    a_max: float = 16.0
    dt_min: float = 0.001
    dt_max: float = 0.1
    seed: int = 0
    n_key_heads: int | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_mamba_decay(owner, self)
        _check_key_heads(owner, self.n_key_heads)


@dataclass(frozen=True)
class GatedDeltaNetConfig(_MambaDecayConfig):
    """Gated DeltaNet (arXiv 2412.06464): the delta rule with a Mamba-2 decay per head and position,
    g_t = -exp(A_log) * softplus(x_t W_a + dt_bias) (W_a: C -> H; A_log, dt_bias: one per head),
    beta_t = sigmoid(x_t W_beta), q and k through SiLU then L2 normalisation, v through SiLU, and an
    output gate swish(x W_g).

    ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    As for :class:`DeltaNetConfig`, the short convolution is the model's ``short_conv`` (set 4).

    Attributes:
        output_gate: multiply each head's output by swish(x W_g) (W_g: C -> C), as the paper does.
        output_norm: normalise each head's output over its D channels (RMSNorm, gain shared by the
            heads) before the gate, as the paper does.
        a_min: A = exp(A_log) starts uniform in [a_min, a_max] per head (Mamba-2's 1).
        a_max: see a_min (Mamba-2's 16).
        dt_min: softplus(dt_bias) starts log-uniform in [dt_min, dt_max] per head (Mamba-2's 0.001),
            so that the decay exp(-A softplus(dt_bias)) of a zero input spans short and long memories.
        dt_max: see dt_min (Mamba-2's 0.1).
        seed: seeds the generator that draws the initial A_log and dt_bias.
        n_key_heads: Hk, the heads of q and k (grouped value heads, as Qwen3-Next and Qwen3.5
            have them): None = the layer's n_heads H; else it must divide H, and value head h
            reads query/key head h // (H / Hk). The q and k projections shrink to Hk heads; the
            state stays one (D, D) matrix per value head.
    """

    output_gate: bool = True
    output_norm: bool = True

    def __post_init__(self) -> None:
        _check_bools("GatedDeltaNetConfig", self, ("output_gate", "output_norm"))
        super().__post_init__()


@dataclass(frozen=True)
class KDAConfig(_MambaDecayConfig):
    """Kimi Delta Attention (arXiv 2510.26692, sections 3-4; Kimi Linear's layer): the delta rule
    with one decay per key channel, g_t = -exp(A_log) * softplus(x_t W_down W_up + dt_bias)
    (W_down: C -> R, W_up: R -> C, dt_bias one per channel, A_log one per head), beta_t =
    sigmoid(x_t W_beta) per head, q and k through SiLU then L2 normalisation, v through SiLU, and the
    output RMSNorm-ed per head then gated by sigmoid(x W_gdown W_gup) (a low-rank gate, rank R).

    ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    As for :class:`DeltaNetConfig`, the paper's short convolutions are the model's ``short_conv``
    (one convolution of the layer input before the projections; set 4).

    Attributes:
        gate_rank: R, the rank of the decay's and of the output gate's projections; None is the
            head width D (the paper's choice).
        output_norm: normalise each head's output over its D channels (RMSNorm) before the gate.
        a_min, a_max: A = exp(A_log) starts uniform in [a_min, a_max] per head.
        dt_min, dt_max: softplus(dt_bias) starts log-uniform in [dt_min, dt_max] per channel.
        seed: seeds the generator that draws the initial A_log and dt_bias.
        n_key_heads: Hk, the heads of q and k (grouped value heads, as Qwen3-Next and Qwen3.5
            have them): None = the layer's n_heads H; else it must divide H, and value head h
            reads query/key head h // (H / Hk). The q and k projections shrink to Hk heads; the
            state stays one (D, D) matrix per value head.
    """

    gate_rank: int | None = None
    output_norm: bool = True

    def __post_init__(self) -> None:
        owner = "KDAConfig"
        _check_bools(owner, self, ("output_norm",))
        if self.gate_rank is not None and (isinstance(self.gate_rank, bool) or not isinstance(self.gate_rank, int)
                                           or self.gate_rank < 1):
            raise ValueError(f"{owner}: gate_rank must be an int >= 1 or None, got {self.gate_rank!r}")
        super().__post_init__()


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


def _heads(t: Tensor, n_heads: int) -> Tensor:
    """``(B, N, H * E) -> (B, H, N, E)``."""
    B, N, _ = t.shape
    return t.view(B, N, n_heads, t.shape[-1] // n_heads).transpose(1, 2)  # no -1: N may be 0


def _silu_l2(t: Tensor) -> Tensor:
    """SiLU then L2 normalisation over the last dimension: the delta rule's keys (and queries).
    Unit keys keep the transition I - beta k k^T's eigenvalues in [-1, 1] for beta in [0, 2], so
    the state cannot grow (arXiv 2406.06484); eps guards a key whose every channel SiLU zeroed."""
    return F.normalize(F.silu(t), dim=-1, eps=1e-6)


def _mamba_decay_parameters(config, n_heads: int, n_gates: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba-2's decay parameters, drawn from ``config.seed``: ``A_log (n_heads,)`` with
    A = exp(A_log) uniform in [a_min, a_max], and ``dt_bias (n_gates,)`` (one per head, or per key
    channel) with softplus(dt_bias) log-uniform in [dt_min, dt_max], so that the decay
    exp(-A softplus(dt_bias)) of a zero input spans short and long memories."""
    g = torch.Generator().manual_seed(config.seed)
    a = torch.empty(n_heads, dtype=torch.float64).uniform_(config.a_min, config.a_max, generator=g)
    lo, hi = math.log(config.dt_min), math.log(config.dt_max)
    dt = torch.exp(torch.empty(n_gates, dtype=torch.float64).uniform_(lo, hi, generator=g))
    # the inverse of softplus, so that softplus(dt_bias) = dt: log(exp(dt) - 1) = dt + log(1 - exp(-dt))
    return nn.Parameter(torch.log(a).float()), nn.Parameter((dt + torch.log(-torch.expm1(-dt))).float())


class GatedMechanism(Mechanism):
    """Base of the gated and delta-rule mechanisms: checks, the decoding state, and the output
    (per-head RMSNorm ``self.out_norm``, gate ``swish(self.gate_proj(x))``) around :meth:`attend`.

    Subclasses implement :meth:`attend`, their recurrence for q, k ``(B, Hk, N, D)`` (Hk =
    ``n_key_heads``, H unless the delta-rule configs group the value heads), v ``(B, H, N, D)`` and the
    layer input ``x (B, N, C)``.
    """

    needs_input: ClassVar[bool] = True
    packed: ClassVar[bool] = True

    def __init__(self, config, *, n_heads: int, head_dim: int, output_gate: bool, output_norm: bool,
                 gate_bias: bool = False, n_key_heads: int | None = None) -> None:
        super().__init__(n_heads=n_heads, head_dim=head_dim, n_key_heads=n_key_heads)
        self.config = config
        self.d_model = n_heads * head_dim  # C: the width of x
        # one gain of D shared by the heads: the heads are interchangeable, a per-head gain would
        # only duplicate what the output projection can do
        # eps fixed (Qwen3-Next's rms_norm_eps), not the dtype's: nn.RMSNorm's default eps is
        # finfo(dtype).eps (2e-16 in float64, 1e-7 in float32, 8e-3 in bfloat16), so the same
        # module would compute a different function in each dtype where a head's output is small
        self.out_norm = nn.RMSNorm(head_dim, eps=1e-6) if output_norm else None
        self.gate_proj = nn.Linear(self.d_model, self.d_model, bias=gate_bias) if output_gate else None

    def recur(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, key_padding_mask: Tensor | None,
              initial_state: DecayedState | None, return_state: bool, cu_seqlens: Tensor | None = None):
        """The recurrence: ``(B, H, N, D)`` (and the state after position N - 1 with return_state);
        ``cu_seqlens``: documents packed along N (batch size 1), the state reset at each."""
        raise NotImplementedError

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Per-head norm and output gate: ``o (B, H, N, D), x (B, N, C) -> (B, H, N, D)``."""
        if self.out_norm is not None:
            o = self.out_norm(o)
        if self.gate_proj is not None:
            o = o * _heads(F.silu(self.gate_proj(x)), self.n_heads)  # (B, H, N, D)
        return o

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, x: Tensor, causal: bool,
               key_padding_mask: Tensor | None, return_state: bool, cu_seqlens: Tensor | None):
        """``q, k (B, Hk, N, D)``, ``v (B, H, N, D)``, ``x (B, N, C)`` -> ``(B, H, N, D)``; with ``return_state`` also
        the :class:`DecayedState` after position N - 1 (one per document with ``cu_seqlens``).
        Causal only. ``key_padding_mask`` bool ``(B, N)``, True = a real position; a padded one
        leaves the state as it is and outputs zeros. ``cu_seqlens``: integer (int32 or int64) offsets of documents
        packed along N (batch size 1), the state reset at each (linattn.functional.varlen)."""
        self._causal_only(causal)
        res = self.recur(q, k, v, x, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, initial_state=None,
                         return_state=return_state)
        if return_state:
            o, state = res
            return self._output(o, x), state
        return self._output(res, x)

    def functional_output(self, o: Tensor, x: Tensor) -> Tensor:
        return self._output(o, x)

    def _causal_only(self, causal: bool) -> None:
        if not causal:
            raise ValueError(f"{type(self).__name__}: {self.name!r} attention has no bidirectional form (it is a "
                             "recurrence in time); call it with causal=True")

    def initial_state(self, batch_size: int, *, device=None, dtype=None) -> DecayedState:
        """The empty memory: s ``(B, H, D, D)`` zeros, float32 for half dtypes (as the functions
        keep their state)."""
        dtype = dtype or torch.get_default_dtype()
        dt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        D = self.head_dim
        return DecayedState(torch.zeros(batch_size, self.n_heads, D, D, device=device, dtype=dt))

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: DecayedState, *, x: Tensor):
        """One position: ``q, k, v (B, H, 1, D)``, ``x (B, 1, C)`` -> ``(B, H, 1, D)`` and the next
        state; O(H D^2) whatever the position. Equals the matching row of the causal forward."""
        if not isinstance(state, DecayedState):
            raise TypeError(f"{type(self).__name__}.step: state must be a DecayedState (from initial_state() or a "
                            f"forward with return_state=True), got {type(state).__name__}")
        self._check_input("step", q, x)
        o, state = self.recur(q, k, v, x, key_padding_mask=None, initial_state=state, return_state=True)
        return self._output(o, x), state

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, output_norm={self.out_norm is not None}, "
                f"output_gate={self.gate_proj is not None}")


class RetNetMechanism(GatedMechanism):
    """Retention with the fixed per-head decays of :class:`RetNetConfig` (buffer ``log_decay (H,)``,
    float64, not saved: it is a function of H)."""

    name = "retnet"
    sharding = _gated.SHARDING

    def __init__(self, config: RetNetConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(config, n_heads=n_heads, head_dim=head_dim, output_gate=config.output_gate,
                         output_norm=config.output_norm)
        h = torch.arange(n_heads, dtype=torch.float64)
        # log1p: log(1 - 2^(-5-h)) without the cancellation of 1 - tiny for many heads. Kept in
        # float64 (H numbers) and cast per call, so that a float64 model gets the exact decays
        # rather than float32's rounding of them.
        self.register_buffer("log_decay", torch.log1p(-torch.exp2(-5.0 - h)), persistent=False)

    def _decays(self, q: Tensor) -> Tensor:
        B, H, N, _ = q.shape
        return self.log_decay.to(q.dtype).view(1, H, 1).expand(B, H, N)  # (B, H, N)

    def functional_inputs(self, q, k, v, x, *, causal):
        self._causal_only(causal)
        return (q, k, v, self._decays(q)), {}

    def recur(self, q, k, v, x, *, key_padding_mask, initial_state, return_state, cu_seqlens=None):
        return gated_linear_attention(q, k, v, self._decays(q), key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
                                      initial_state=initial_state, return_state=return_state)


class GLAMechanism(GatedMechanism):
    """GLA with its low-rank decay projection (``decay_down`` C -> R, ``decay_up`` R -> C with bias)
    and output gate (``gate_proj`` C -> C with bias)."""

    name = "gla"
    sharding = _gated.SHARDING

    def __init__(self, config: GLAConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(config, n_heads=n_heads, head_dim=head_dim, output_gate=config.output_gate,
                         output_norm=config.output_norm, gate_bias=True)
        self.decay_down = nn.Linear(self.d_model, config.gate_rank, bias=False)
        self.decay_up = nn.Linear(config.gate_rank, self.d_model, bias=True)

    def log_decay(self, x: Tensor) -> Tensor:
        """``x (B, N, C)`` -> the log decays ``(B, H, N, D)``, each in (-inf, 0)."""
        g = F.logsigmoid(self.decay_up(self.decay_down(x))) / self.config.gate_temperature  # (B, N, C)
        return _heads(g, self.n_heads)  # (B, H, N, D)

    def functional_inputs(self, q, k, v, x, *, causal):
        self._causal_only(causal)
        return (q, k, v, self.log_decay(x)), {}

    def recur(self, q, k, v, x, *, key_padding_mask, initial_state, return_state, cu_seqlens=None):
        return gated_linear_attention(q, k, v, self.log_decay(x), key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens,
                                      initial_state=initial_state, return_state=return_state)

    def extra_repr(self) -> str:
        c = self.config
        return f"{super().extra_repr()}, gate_rank={c.gate_rank}, gate_temperature={c.gate_temperature}"


class DeltaNetMechanism(GatedMechanism):
    """DeltaNet with its writing strength projection ``beta_proj`` (C -> H)."""

    name = "deltanet"
    sharding = _delta.SHARDING

    def __init__(self, config: DeltaNetConfig | GatedDeltaNetConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(config, n_heads=n_heads, head_dim=head_dim, output_gate=config.output_gate,
                         output_norm=config.output_norm, n_key_heads=_key_heads(config, n_heads))
        self.beta_proj = nn.Linear(self.d_model, n_heads, bias=False)

    def beta(self, x: Tensor) -> Tensor:
        """``x (B, N, C)`` -> beta ``(B, H, N)`` in (0, 1)."""
        return torch.sigmoid(self.beta_proj(x)).transpose(1, 2)

    def functional_inputs(self, q, k, v, x, *, causal):
        self._causal_only(causal)
        return (_silu_l2(q), _silu_l2(k), F.silu(v), self.beta(x)), {}

    def recur(self, q, k, v, x, *, key_padding_mask, initial_state, return_state, cu_seqlens=None):
        return delta_rule_attention(_silu_l2(q), _silu_l2(k), F.silu(v), self.beta(x),
                                    key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                    return_state=return_state)


class GatedDeltaNetMechanism(DeltaNetMechanism):
    """Gated DeltaNet: DeltaNet's ``beta_proj`` plus the decay's projection ``decay_proj`` (C -> H)
    and its per-head parameters ``A_log``, ``dt_bias`` ``(H,)``."""

    name = "gated_deltanet"
    sharding = _delta.SHARDING

    def __init__(self, config: GatedDeltaNetConfig, *, n_heads: int, head_dim: int) -> None:
        super().__init__(config, n_heads=n_heads, head_dim=head_dim)  # norm, gate and beta_proj as DeltaNet's
        self.decay_proj = nn.Linear(self.d_model, n_heads, bias=False)
        self.A_log, self.dt_bias = _mamba_decay_parameters(config, n_heads, n_heads)

    def log_decay(self, x: Tensor) -> Tensor:
        """``x (B, N, C)`` -> g ``(B, H, N)``, each <= 0 (Mamba-2's discretised decay)."""
        g = -torch.exp(self.A_log) * F.softplus(self.decay_proj(x) + self.dt_bias)  # (B, N, H)
        return g.transpose(1, 2)

    def functional_inputs(self, q, k, v, x, *, causal):
        self._causal_only(causal)
        return (_silu_l2(q), _silu_l2(k), F.silu(v), self.beta(x)), {"log_decay": self.log_decay(x)}

    def recur(self, q, k, v, x, *, key_padding_mask, initial_state, return_state, cu_seqlens=None):
        return delta_rule_attention(_silu_l2(q), _silu_l2(k), F.silu(v), self.beta(x), log_decay=self.log_decay(x),
                                    key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                    return_state=return_state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, seed={self.config.seed}"


class KDAMechanism(GatedDeltaNetMechanism):
    """Kimi Delta Attention: DeltaNet's ``beta_proj`` plus the per-channel decay's low-rank
    projection (``decay_down`` C -> R, ``decay_up`` R -> C), ``dt_bias (C,)`` and ``A_log (H,)``,
    and the low-rank sigmoid output gate (``gate_down`` C -> R, ``gate_up`` R -> C)."""

    name = "kda"
    sharding = _delta.SHARDING

    def __init__(self, config: KDAConfig, *, n_heads: int, head_dim: int) -> None:
        GatedMechanism.__init__(self, config, n_heads=n_heads, head_dim=head_dim, output_gate=False,
                                output_norm=config.output_norm, n_key_heads=_key_heads(config, n_heads))
        C, R = self.d_model, config.gate_rank or head_dim
        self.beta_proj = nn.Linear(C, n_heads, bias=False)
        self.decay_down = nn.Linear(C, R, bias=False)
        self.decay_up = nn.Linear(R, C, bias=False)
        self.gate_down = nn.Linear(C, R, bias=False)
        self.gate_up = nn.Linear(R, C, bias=False)
        self.A_log, self.dt_bias = _mamba_decay_parameters(config, n_heads, C)

    def log_decay(self, x: Tensor) -> Tensor:
        """``x (B, N, C)`` -> g ``(B, H, N, D)``, each <= 0: one decay per key channel."""
        f = F.softplus(self.decay_up(self.decay_down(x)) + self.dt_bias)  # (B, N, C)
        return _heads(f, self.n_heads) * -torch.exp(self.A_log)[:, None, None]  # (B, H, N, D)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Per-head RMSNorm, then the low-rank sigmoid gate: ``(B, H, N, D)``."""
        if self.out_norm is not None:
            o = self.out_norm(o)
        return o * _heads(torch.sigmoid(self.gate_up(self.gate_down(x))), self.n_heads)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate_rank={self.decay_down.out_features}"
