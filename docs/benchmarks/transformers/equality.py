"""Per-family agreement of linattn.integrations.transformers with transformers' own path and with
linattn's float64 reference recurrence, on the small random models of the tests
(tests/test_transformers_integration.py asserts the bounds; this writes the measured figures).

    .venv/bin/python docs/benchmarks/transformers/equality.py

writes equality.json and equality.md beside this file. Per family:
- float32, the same weights on both paths, B = 2, N = 37: the largest difference of the logits
  relative to their largest magnitude, and of every parameter's gradient (loss: the LM's
  cross-entropy) relative to the model's largest gradient;
- float64, linattn's chunked engine against its reference recurrence plugged in the same way,
  B = 2, N = 21: the same two figures, gradients relative to their own scale (or 1e-4 of the largest
  gradient below that);
- packed documents (lengths 5, 1, 9, 4, 7 in one row, float64): linattn's largest difference from
  the documents run one by one, and what transformers' own path does with the same batch (Mamba-2's
  through its backbone, which passes the offsets on as its causal LM does not);
- greedy generation (12 tokens after 11, B = 2, float32) on linattn with transformers' cache and
  without a cache: whether the tokens are the same, and whether they are transformers' own path's.
"""

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tests"))

import test_transformers_integration as T  # noqa: E402  (the tests' own model builders)

from linattn.integrations import transformers as lt  # noqa: E402


def _figures(a_logits, a_grads, b_logits, b_grads, own: bool) -> dict:
    top = max(g.abs().max() for g in a_grads.values())
    if own:
        worst = max((T._rel(a_grads[n], b_grads[n], max(a_grads[n].abs().max(), 1e-4 * top)), n) for n in a_grads)
    else:
        worst = max((T._rel(a_grads[n], b_grads[n], top), n) for n in a_grads)
    return {"logits": T._rel(a_logits, b_logits), "worst_gradient": worst[0], "worst_parameter": worst[1]}


def family_row(name: str) -> dict:
    theirs, ours = T._pair(name)
    ids = torch.randint(3, 99, (2, 37), generator=torch.Generator().manual_seed(1))
    row = {"float32_vs_transformers": _figures(*T._loss_and_grads(theirs, ids), *T._loss_and_grads(ours, ids), False)}
    _, chunked = T._pair(name, **T.F64)
    _, reference = T._pair(name, form="reference", **T.F64)
    ids = torch.randint(3, 99, (2, 21), generator=torch.Generator().manual_seed(2))
    row["float64_vs_reference"] = _figures(*T._loss_and_grads(reference, ids), *T._loss_and_grads(chunked, ids),
                                           True)
    layers = T.LINEAR_ONLY.get(name, lt.SMALL_LAYER_TYPES)
    theirs, ours = T._pair(name, config=lt.small_config(name, layer_types=layers), **T.F64)
    docs, packed = T._packed_batch(T.PACKED_LENGTHS, torch.Generator().manual_seed(4))
    with torch.no_grad():
        alone = torch.cat([T._logits(ours, d, use_cache=False)[0] for d in docs])
        row["packed_linattn"] = T._rel(alone, T._logits(ours, torch.cat(docs, 1), **packed)[0])
        try:
            row["packed_transformers"] = T._rel(alone, T._logits(theirs, torch.cat(docs, 1), **packed)[0])
        except ValueError as err:
            row["packed_transformers"] = "refused: " + str(err).split(".")[0]
    row["packed_layers"] = list(layers)
    theirs, ours = T._pair(name)
    prompt = torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    with torch.no_grad():
        cached, uncached, want = ours.generate(prompt, **kw), ours.generate(prompt, use_cache=False, **kw), \
            theirs.generate(prompt, **kw)
    row["greedy_cached_equals_uncached"] = bool(torch.equal(cached, uncached))
    row["greedy_equals_transformers"] = bool(torch.equal(cached, want))
    return row


def main() -> None:
    torch.set_num_threads(2)
    import transformers

    rows = {name: family_row(name) for name in lt.FAMILIES}
    result = {"command": "python docs/benchmarks/transformers/equality.py", "transformers": transformers.__version__,
              "torch": torch.__version__, "families": rows}
    (HERE / "equality.json").write_text(json.dumps(result, indent=2))
    lines = ["# linattn.integrations.transformers: agreement per family", "",
             f"Written by `{result['command']}` (transformers {result['transformers']}, torch {result['torch']}); "
             "see its docstring for the settings.", "",
             "| family | f32 logits vs transformers | f32 worst gradient / largest | f64 logits vs reference | "
             "f64 worst gradient / own scale | packed, linattn | packed, transformers' path | greedy: cached = "
             "uncached | greedy = transformers' |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for name, r in rows.items():
        a, b = r["float32_vs_transformers"], r["float64_vs_reference"]
        t = r["packed_transformers"]
        lines.append(f"| {name} | {a['logits']:.1e} | {a['worst_gradient']:.1e} ({a['worst_parameter']}) | "
                     f"{b['logits']:.1e} | {b['worst_gradient']:.1e} ({b['worst_parameter']}) | "
                     f"{r['packed_linattn']:.1e} | {t if isinstance(t, str) else f'{t:.1e} (documents mixed)'} | "
                     f"{'yes' if r['greedy_cached_equals_uncached'] else 'no'} | "
                     f"{'yes' if r['greedy_equals_transformers'] else 'no'} |")
    lines += ["", "GLM5-Next's and GraniteMoeHybrid's packed rows run linear-attention layers only: their "
              "full-attention layers (GLM5's sparse 'indexed' attention, Granite's attention) do not keep packed "
              "documents apart in transformers itself. GLM5-Next's greedy tokens change with the cache in "
              "transformers itself (tests/test_transformers_integration.py, CACHE_CHANGES_TOKENS).", ""]
    (HERE / "equality.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
