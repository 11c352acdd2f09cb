"""Transformer encoder and causal language model over any registered attention mechanism.

Dimension legend: B batch, N positions, C = d_model, V vocabulary, P prompt length, T new tokens.

Decoding: every attention layer carries its own state (:class:`linattn.nn.AttentionState`): a KV
cache for softmax layers (O(position) per token), the sums (S, z) for linear and FAVOR layers, a
ring buffer of the last ``window`` keys for local layers and one (H, D, D) matrix for the gated and
delta-rule layers (retnet, gla, deltanet, gated_deltanet): O(1) per token whatever the position.
A prompt is prefilled by one causal forward that returns every layer's state.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import ContextParallel, check_context_parallel
from ..functional.checks import check_values
from ..functional.recurrence import prefix_sums
from ..functional.varlen import check_cu_seqlens
from ..nn.attention import AttentionState, MultiHeadAttention, check_context_parallel_call
from ..nn.positional import document_positions, sinusoidal_table
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TransformerConfig

__all__ = ["Block", "LMState", "TransformerEncoder", "TransformerLM"]


class LMState(NamedTuple):
    """Decoding state of a :class:`TransformerLM`.

    Attributes:
        layers: one :class:`linattn.nn.AttentionState` per layer.
        position: the position of the next token.
    """

    layers: tuple[AttentionState, ...]
    position: int


def _norm(kind: str, d: int) -> nn.Module:
    return nn.LayerNorm(d) if kind == "layernorm" else nn.RMSNorm(d)


class Block(nn.Module):
    """Attention then MLP (Linear C->d_ff, GELU, Linear d_ff->C), each with a residual connection,
    pre-norm ``x + f(norm(x))`` or post-norm ``norm(x + f(x))``. ``d_ff = 0``: attention only, no
    MLP and no second norm (Zoology's MQAR models)."""

    def __init__(self, config: TransformerConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.pre_norm = c.pre_norm
        self.attn = MultiHeadAttention(c.d_model, c.n_heads, attention=c.attention_for(layer),
                                       rotary=c.positional == "rotary", max_len=c.max_len,
                                       short_conv=c.short_conv)
        self.norm1 = _norm(c.norm, c.d_model)
        self.norm2 = _norm(c.norm, c.d_model) if c.d_ff else None
        self.ff = nn.Sequential(nn.Linear(c.d_model, c.d_ff), nn.GELU(), nn.Linear(c.d_ff, c.d_model)) if c.d_ff else None
        self.drop = nn.Dropout(c.dropout)

    def _drop(self, x: Tensor) -> Tensor:
        # an inactive dropout is skipped rather than called: a decoding step is made of small
        # calls, and each costs more than its arithmetic
        return self.drop(x) if self.drop.training and self.drop.p > 0 else x

    def _mlp(self, x: Tensor) -> Tensor:
        if self.ff is None:
            return x
        if self.pre_norm:
            return x + self._drop(self.ff(self.norm2(x)))
        return self.norm2(x + self._drop(self.ff(x)))

    def _attend(self, x: Tensor, run) -> tuple[Tensor, object]:
        """``run(h) -> (attention output, state)`` on the (pre-normed) input; residual and norm."""
        if self.pre_norm:
            a, state = run(self.norm1(x))
            return x + self._drop(a), state
        a, state = run(x)
        return self.norm1(x + self._drop(a)), state

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
                return_state: bool = False, cu_seqlens: Tensor | None = None,
                context_parallel: ContextParallel | None = None):
        """``x (B, N, C) -> (B, N, C)``, with ``return_state`` also the layer's AttentionState;
        ``cu_seqlens``: documents packed along N; ``context_parallel``: ``x`` is this rank's shard
        of sequences sharded along N (see MultiHeadAttention.forward). The norms and the MLP act
        per position, so only the attention layer exchanges anything with the other ranks."""

        def run(h):
            r = self.attn(h, causal=causal, key_padding_mask=key_padding_mask, return_state=return_state,
                          cu_seqlens=cu_seqlens, context_parallel=context_parallel)
            return r if return_state else (r, None)

        x, state = self._attend(x, run)
        x = self._mlp(x)
        return (x, state) if return_state else x

    def step(self, x_t: Tensor, state: AttentionState) -> tuple[Tensor, AttentionState]:
        """``x_t (B, 1, C)`` -> ``(B, 1, C)`` and the next state (see MultiHeadAttention.step)."""
        x_t, state = self._attend(x_t, lambda h: self.attn.step(h, state))
        return self._mlp(x_t), state


class _Transformer(nn.Module):
    """Embeddings, blocks and the final norm shared by the encoder and the language model."""

    _kind: str

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"{type(self).__name__}: config must be a TransformerConfig, got {type(config).__name__}")
        self.config = c = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        if c.positional == "learned":
            self.pos_emb = nn.Embedding(c.max_len, c.d_model)
        elif c.positional == "sinusoidal":
            # fixed: not a parameter, and not saved (persistent=False): rebuilt from the config
            self.register_buffer("pos_table", sinusoidal_table(c.max_len, c.d_model), persistent=False)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        # post-norm blocks end in a norm already; pre-norm stacks need one at the end
        self.norm_f = _norm(c.norm, c.d_model) if c.pre_norm else nn.Identity()

    def _init_weights(self) -> None:
        """Normal(0, init_std) linear and embedding weights, zero biases, the gate projections of
        the gated mechanisms (``nn.Linear``) included. Other mechanism parameters and buffers
        (Linformer's E and F, FAVOR's projection, Gated DeltaNet's A_log and dt_bias, norm gains)
        keep their own initialisation."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def _check_ids(self, ids: Tensor, start: int, what: str) -> None:
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
            raise TypeError(f"{type(self).__name__}.{what}: ids must be an integer tensor (B, N), got {got}")
        end = start + ids.shape[1]
        if end > self.config.max_len:
            raise ValueError(
                f"{type(self).__name__}.{what}: positions {start}..{end - 1} exceed max_len = "
                f"{self.config.max_len} (ids {tuple(ids.shape)})"
            )

    def _embed(self, ids: Tensor, start: int, positions: Tensor | None = None) -> Tensor:
        """Token (+ absolute position) embeddings of ``ids (B, N)`` at positions start.. (or at
        ``positions (N,)``) -> (B, N, C)."""
        x = self.tok_emb(ids)
        n = ids.shape[1]
        if positions is None and self.config.positional in ("learned", "sinusoidal"):
            positions = torch.arange(start, start + n, device=ids.device)
        if self.config.positional == "learned":
            x = x + self.pos_emb(positions)
        elif self.config.positional == "sinusoidal":
            x = x + self.pos_table[positions].to(x.dtype)
        return self.drop(x)

    # -- checkpoints ---------------------------------------------------------------------------

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``path/model.safetensors`` and ``path/config.json`` atomically (see
        :mod:`linattn.models.checkpoint`)."""
        return save_checkpoint(self, path)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu"):
        """Build the model from ``path/config.json`` and load its weights, after checking the
        weights file against the sha256 stored with the config. Raises ValueError for a missing,
        truncated or corrupted checkpoint, or one saved from another model class."""
        return load_checkpoint(cls, path, device=device)


class TransformerEncoder(_Transformer):
    """Bidirectional encoder: ``ids (B, N) -> hidden states (B, N, C)``. Any mechanism with a
    bidirectional form (not the causal-only retnet, gla, deltanet, gated_deltanet)."""

    _kind = "TransformerEncoder"

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        config.check_form("bidirectional", owner="TransformerEncoder", user="an encoder")
        self._init_weights()

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None) -> Tensor:
        """``ids (B, N)`` integer tokens -> ``(B, N, C)``.

        ``key_padding_mask``: bool ``(B, N)``, True = a real token, False = padding. Padding is
        attended by no position; outputs at padded positions are computed but meaningless.
        """
        self._check_ids(ids, 0, "forward")
        x = self._embed(ids, 0)
        for block in self.blocks:
            x = block(x, key_padding_mask=key_padding_mask)
        return self.norm_f(x)


class TransformerLM(_Transformer):
    """Causal language model: ``ids (B, N) -> logits (B, N, V)``, with recurrent decoding.

    Every layer's mechanism must have a causal form (not efficient, linformer, hedgehog). Decoding
    (:meth:`step`, :meth:`generate`) needs a recurrent form in every layer (softmax, linear, favor,
    local, retnet, gla, deltanet, gated_deltanet; LSH layers can be trained and evaluated but not
    decoded).
    """

    _kind = "TransformerLM"

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        config.check_form("causal", owner="TransformerLM", user="a language model")
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, ids: Tensor, *, key_padding_mask: Tensor | None = None, return_state: bool = False,
                last_only: bool = False, cu_seqlens: Tensor | None = None,
                context_parallel: ContextParallel | None = None):
        """``ids (B, N)`` -> logits ``(B, N, V)``; with ``return_state`` also the :class:`LMState`
        after position N - 1, to continue with :meth:`step` (prefill).

        ``last_only``: logits of the last position only, ``(B, 1, V)`` (a prefill of a long prompt
        need not build N x V logits: 2 GB at N = 16000, V = 32000 in float32).

        ``key_padding_mask``: bool ``(B, N)``, True = a real token, False = padding (not with
        ``return_state`` when a layer is softmax: the KV cache has no padding slots).

        ``cu_seqlens``: integer (int32 or int64) ``(n + 1,)`` offsets ``[0, c_1, ..., N]`` of n documents packed into
        ``ids (1, N)`` (no padding): every layer keeps the documents apart and positions restart at
        0 in each, so each document's logits are those it would get alone (up to rounding). Each
        document, not N, must fit in ``max_len``. Not with ``return_state``.

        ``context_parallel``: a :class:`linattn.distributed.ContextParallel` ``(group, offset)``
        for context parallelism: ``ids (B, n)`` is this rank's shard of B sequences sharded along
        N over the ranks of ``group`` (contiguous shards in rank order, the same B sequences on
        every rank), starting at global position ``offset``; returns this rank's logits
        ``(B, n, V)``, those of the whole sequences at positions ``offset .. offset + n - 1``
        (up to rounding). Learned, sinusoidal and rotary positions are ``offset + i``; the whole
        sequence must fit in ``max_len``. Every attention layer exchanges what it needs with the
        other ranks (a state summary, a halo, or for softmax layers every rank's keys and values;
        docs/context_parallel.md), so the call is collective: every rank of the group calls it,
        and when one runs backward every rank must. The ranks' losses add up: the sum over ranks
        of the parameter gradients of their losses is the gradient of the summed loss (all-reduce
        them as data parallelism does). Offsets are checked (one small all-gather): they must be
        the running sums of the shard lengths. Not with ``cu_seqlens``, ``return_state`` or
        ``key_padding_mask``; ValueError for a model with an LSH layer (no context-parallel form).
        """
        if context_parallel is not None:
            return self._forward_sharded(ids, context_parallel, key_padding_mask=key_padding_mask,
                                         return_state=return_state, last_only=last_only, cu_seqlens=cu_seqlens)
        positions = None
        if cu_seqlens is None:
            self._check_ids(ids, 0, "forward")
        else:
            self._check_ids(ids[:, :0], 0, "forward")  # the type and rank; lengths are the documents'
            # ids as (1, 1, N, 1); int64 from here on, one copy for every layer (int32 offsets too)
            cu_seqlens = check_cu_seqlens("TransformerLM.forward", cu_seqlens, ids[:, None, :, None])
            positions = document_positions(cu_seqlens, ids.shape[1])  # (N,)
            # a document's positions run 0..length-1: checked on the device, no host read
            check_values(positions < self.config.max_len,
                         lambda: f"TransformerLM.forward: a document of "
                                 f"{int((cu_seqlens[1:] - cu_seqlens[:-1]).max())} tokens exceeds max_len = "
                                 f"{self.config.max_len} (cu_seqlens {cu_seqlens.tolist()[:8]}...)")
            if return_state:
                raise ValueError("TransformerLM.forward: return_state with cu_seqlens is not supported (a decoding "
                                 "state is one sequence's)")
        if return_state:
            self._check_recurrent("forward(return_state=True)")
        x = self._embed(ids, 0, positions)
        states = []
        for block in self.blocks:
            if return_state:
                x, s = block(x, causal=True, key_padding_mask=key_padding_mask, return_state=True)
                states.append(s)
            else:
                x = block(x, causal=True, key_padding_mask=key_padding_mask, cu_seqlens=cu_seqlens)
        if last_only:
            x = x[:, -1:]
        logits = self.head(self.norm_f(x))
        if return_state:
            return logits, LMState(tuple(states), ids.shape[1])
        return logits

    def _forward_sharded(self, ids: Tensor, context_parallel: ContextParallel, *, key_padding_mask, return_state,
                         last_only, cu_seqlens) -> Tensor:
        """:meth:`forward` with ``context_parallel`` (see there)."""
        fn = "TransformerLM.forward"
        check_context_parallel_call(fn, causal=True, key_padding_mask=key_padding_mask, return_state=return_state,
                                    cu_seqlens=cu_seqlens)
        # refused here, before any collective, the same way on every rank
        self.config.check_form("sharded", owner=fn, user="context_parallel (see docs/context_parallel.md)")
        self._check_ids(ids[:, :0], 0, "forward")  # the type and rank; the length against the whole sequence's
        lengths = check_context_parallel(fn, context_parallel, ids.shape[1], device=ids.device)
        total = sum(lengths)  # the same on every rank: all raise together
        if total > self.config.max_len:
            raise ValueError(f"{fn}: the sharded sequence has {total} positions (shards {lengths}), more than "
                             f"max_len = {self.config.max_len}")
        x = self._embed(ids, context_parallel.offset)
        for block in self.blocks:
            x = block(x, causal=True, context_parallel=context_parallel)
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm_f(x))

    def _check_recurrent(self, what: str) -> None:
        self.config.check_form("recurrent", owner=f"TransformerLM.{what}", user="decoding in every layer")

    def initial_state(self, batch_size: int) -> LMState:
        """The state before the first token (empty caches, zero sums), on the model's device and
        in its dtype."""
        self._check_recurrent("initial_state")
        return LMState(tuple(b.attn.initial_state(batch_size) for b in self.blocks), 0)

    def step(self, ids_t: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """One token per sequence, ``ids_t (B, 1)`` at position ``state.position`` -> logits
        ``(B, V)`` and the next state. Equals row ``state.position`` of the teacher-forced forward."""
        if not isinstance(state, LMState):
            raise TypeError(f"TransformerLM.step: state must be an LMState, got {type(state).__name__}")
        self._check_ids(ids_t, state.position, "step")
        if ids_t.shape[1] != 1:
            raise ValueError(f"TransformerLM.step: ids_t must be (B, 1), got {tuple(ids_t.shape)}")
        x = self._embed(ids_t, state.position)
        layers = []
        for block, s in zip(self.blocks, state.layers, strict=True):
            x, s = block.step(x, s)
            layers.append(s)
        return self.head(self.norm_f(x))[:, 0], LMState(tuple(layers), state.position + 1)

    def compiled_step(self):
        """:meth:`step` through ``torch.compile`` (inductor): same arguments, same results up to
        float rounding.

        At batch 1 a decoding step is a few hundred small operations around matrix-vector
        products, and on a CPU their per-call overhead can cost more than their arithmetic; the
        compiled step fuses the elementwise work into a few generated kernels. It helps the
        linear and FAVOR+ steps most, softmax at long positions little (it is bound by reading its
        KV cache) and local attention's step not at all (figures: ``linattn bench generate
        --compile``, docs/benchmarks/generate*.md). Compiling takes tens of seconds during the
        first calls (one specialised compile, then one with the position and cache length
        symbolic) and needs a C++ compiler on CPU; compiled code is kept for the rest of the
        process. The eager :meth:`step` stays the reference.
        """
        self._check_recurrent("compiled_step")
        return torch.compile(self.step)

    def forward_steps(self, ids: Tensor, state: LMState | None = None) -> tuple[Tensor, LMState]:
        """Run :meth:`step` over every position of ``ids (B, N)`` from ``state`` (default: the
        initial state): logits ``(B, N, V)`` and the final state. The recurrent counterpart of
        ``forward(ids)``, one token at a time."""
        state = self.initial_state(ids.shape[0]) if state is None else state
        out = []
        for i in range(ids.shape[1]):
            logits, state = self.step(ids[:, i : i + 1], state)
            out.append(logits)
        return torch.stack(out, dim=1), state

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        compile: bool = False,
    ) -> Tensor:
        """Sample ``max_new_tokens`` continuations of ``prompt_ids (B, P)`` -> ``(B, P + T)``.

        The prompt is prefilled by one causal forward that returns every layer's state, then each
        new token costs one :meth:`step`. Dropout follows the module's mode: call ``eval()`` first.

        Args:
            temperature: a finite float >= 0; logits are divided by it; 0 means greedy (argmax).
                A tiny positive temperature is the greedy limit: every token below the most
                likely gets probability 0 (tokens tied at the maximum share the draw).
            top_k: None or an int >= 1: sample among the k most likely tokens only.
            top_p: None or a float in (0, 1]: sample from the smallest set of most likely tokens
                whose probability reaches top_p (nucleus sampling, Holtzman et al., arXiv 1904.09751).
            generator: for the sampling draws (explicit randomness).
            compile: run :meth:`step` through :meth:`compiled_step` (torch.compile): faster per
                token where eager per-operation overhead dominates (batch 1 on a CPU), after
                compiling during the first steps.
        """
        self._check_ids(prompt_ids, 0, "generate")
        if prompt_ids.shape[1] < 1:
            raise ValueError("TransformerLM.generate: prompt_ids needs at least one token per sequence")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"TransformerLM.generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if prompt_ids.shape[1] + max_new_tokens > self.config.max_len:
            raise ValueError(
                f"TransformerLM.generate: prompt length {prompt_ids.shape[1]} + max_new_tokens "
                f"{max_new_tokens} exceeds max_len = {self.config.max_len}"
            )
        _check_sampling("TransformerLM.generate", temperature, top_k, top_p)
        self._check_recurrent("generate")
        if max_new_tokens == 0:
            return prompt_ids
        logits, state = self(prompt_ids, return_state=True, last_only=True)
        logits = logits[:, -1]  # (B, V)
        step = self.compiled_step() if compile else self.step
        out = [prompt_ids]
        for t in range(max_new_tokens):
            nxt = _sample(logits, temperature, top_k, top_p, generator)  # (B, 1)
            out.append(nxt)
            if t + 1 < max_new_tokens:
                logits, state = step(nxt, state)
        return torch.cat(out, dim=1)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_sampling(fn: str, temperature, top_k, top_p) -> None:
    """Reject sampling arguments that would only fail (or give NaN) inside torch.multinomial."""
    if not _is_number(temperature):
        raise TypeError(f"{fn}: temperature must be a float >= 0, got {type(temperature).__name__}")
    try:
        finite = math.isfinite(temperature)
    except OverflowError:  # an int beyond float range
        finite = False
    if not (finite and temperature >= 0):  # NaN fails both
        raise ValueError(f"{fn}: temperature must be a float >= 0 and finite (0 means greedy), got {temperature!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"{fn}: top_k must be None or an int >= 1, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"{fn}: top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None:
        if not _is_number(top_p):
            raise TypeError(f"{fn}: top_p must be None or a float in (0, 1], got {type(top_p).__name__}")
        if not 0 < top_p <= 1:  # NaN fails too
            raise ValueError(f"{fn}: top_p must be None or a float in (0, 1], got {top_p!r}")


def _sample(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None) -> Tensor:
    """One token id per row of ``logits (B, V)`` -> ``(B, 1)``."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    # Divide after subtracting each row's maximum: the scaled logits are <= 0 with the maximum at
    # exactly 0, so a tiny temperature sends the others to -inf (probability 0), where dividing
    # first overflows every logit to +inf and the softmax gives inf - inf = NaN. A temperature
    # below float32's smallest subnormal rounds to 0 in the division: 0 / 0 at the maxima is
    # then set to 0, the same limit (tied maxima share the draw).
    logits = logits.float()
    shifted = logits - logits.amax(-1, keepdim=True)  # (B, V), <= 0
    logits = torch.where(shifted == 0, 0.0, shifted / temperature)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        drop = prefix_sums(probs, -1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)
