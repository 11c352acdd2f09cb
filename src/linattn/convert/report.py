"""``linattn convert report``: docs/convert.md from the run files, never typed by hand.

Reads ``fidelity.json`` (:mod:`.fidelity`), every ``distill_*.json`` (:mod:`.distill`) and
``long.json`` (:mod:`.long`) from the runs folder and writes the tables, the exact commands that
made them and what they mean, including which targets are met and which are not.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..bench.harness import describe_load, format_seconds

__all__ = ["TARGET_COSINE", "TARGET_MINUTES", "results_section", "write_report"]

TARGET_COSINE = 0.97
TARGET_MINUTES = 15.0


def _window(attention: dict) -> int | None:
    w = attention.get("window")
    return w if attention["name"] in ("local", "hedgehog") and w else None


def _covers(attention: dict, stats: dict) -> bool:
    """Whether the softmax window reaches every key of every input of an evaluation set: then the
    mechanism is exact softmax there, not linear attention."""
    w = _window(attention)
    return w is not None and w >= stats["max_tokens"] - 1


def _shorter(attention: dict, stats: dict) -> bool:
    """Whether the window is shorter than every input of the set (so no input is all softmax)."""
    w = _window(attention)
    return w is None or w < stats["min_tokens"] - 1


def _flag(attention: dict, stats: dict) -> str:
    if _covers(attention, stats):
        return " [window covers input]"
    if not _shorter(attention, stats):
        return " [window covers the shorter inputs]"
    return ""


def _cell(summary: dict | None, flag: str) -> str:
    if summary is None:
        return "-"
    return f"{summary['mean_cosine']:.4f} ({summary['p10_cosine']:.3f})" + flag


def _bytes(b: int | None) -> str:
    if b is None:
        return "-"
    return f"{b / 2**20:.0f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _fidelity_section(fid: dict) -> list[str]:
    sets = fid["eval_sets"]
    lines = [
        "## Fidelity without training",
        "",
        "Mean cosine similarity between the converted and the original sentence embeddings (mean pooling over "
        "real tokens, L2-normalised), with the 10th percentile in brackets; 1 means identical. Same held-out "
        "texts for every row: "
        + "; ".join(f"{name}: {s['count']} texts of {s['min_tokens']}-{s['max_tokens']} tokens "
                    f"(mean {s['mean_tokens']:.0f})" for name, s in sets.items()) + ".",
        "",
        "| mechanism | " + " | ".join(sets) + " |",
        "|---|" + "---|" * len(sets),
    ]
    for r in fid["results"]:
        lines.append(f"| {r['label']} | " + " | ".join(_cell(r.get(n), _flag(r["attention"], sets[n])) for n in sets) + " |")
    for n in sets:
        fair = [r for r in fid["results"] if n in r and r["attention"]["name"] != "softmax"
                and _shorter(r["attention"], sets[n])]
        if fair:
            best = max(fair, key=lambda r: r[n]["mean_cosine"])
            lines.append(f"\nBest on {n} without training, counting only mechanisms with no window or a window "
                         f"shorter than every input: {best['label']}, {best[n]['mean_cosine']:.4f}.")
    lines += [
        "",
        "FAVOR+ uses one draw of its random features per layer (seed 0 + layer index), softmax kernel, positive "
        "features. `[window covers input]`: the softmax window reaches every key of every text in that set, so "
        "the number is exact softmax attention (up to rounding), not a linear-attention result; `[window covers "
        "the shorter inputs]`: it does so for the shorter texts of the set, so the number is partly exact softmax. `hedgehog` rows "
        "here are untrained (identity feature maps): Hedgehog is meant to be distilled (next section). "
        "`softmax` is linattn's exact softmax through the same conversion path: a check that the conversion "
        "itself loses nothing. " + describe_load(fid.get("load")),
        "",
        f"Command: `{fid['command']}`",
        "",
    ]
    return lines


def _first_command(run: dict) -> str:
    return run["command"].replace(" --resume", "")


def _distill_section(runs: list[dict]) -> tuple[list[str], list[str]]:
    lines = [
        "## Recovery by distillation",
        "",
        "The converted model (student) is distilled toward the original (teacher) on lines and ~1,500-character "
        "passages of the training plays (never the held-out ones): first attention transfer (only the "
        "mechanism's parameters, matching each layer's softmax weights; mechanisms that can form their weights, "
        "Hedgehog), then end to end (all parameters; hidden-state MSE per layer + 1 - cosine of the pooled "
        "embedding). Minutes count training steps only, on one thread of a shared machine; fidelity is measured "
        "on the same held-out texts as above, before and after.",
        "",
        "| student | training minutes | steps (attention transfer) | sentences before -> after | passages before -> after |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for r in runs:
        stats = r.get("eval_sets", {})
        cells = []
        for name in ("sentences", "passages"):
            if name not in r["before"]:
                cells.append("-")
                continue
            after = r.get("after", {}).get(name)
            flag = _flag(r["config"]["attention"], stats[name]) if name in stats else ""
            text = f"{r['before'][name]['mean_cosine']:.4f} -> " + (f"**{after['mean_cosine']:.4f}**" if after else "(stopped)")
            cells.append(text + flag)
            if after and name in stats and _shorter(r["config"]["attention"], stats[name]):
                met = after["mean_cosine"] >= TARGET_COSINE and r["training_minutes"] <= TARGET_MINUTES + 0.1
                w = _window(r["config"]["attention"])
                how = ("no softmax window: linear attention throughout" if w is None else
                       f"softmax window {w} < the {stats[name]['min_tokens']}+ tokens of every input")
                verdicts.append(f"- {r['label']} on held-out {name} ({how}): {after['mean_cosine']:.4f} after "
                                f"{r['training_minutes']:.1f} min: " + ("**target met**." if met else "target not met."))
        lines.append(f"| {r['label']} | {r['training_minutes']:.1f} | {r['steps']} ({r['stage1_steps']}) | "
                     + " | ".join(cells) + " |")
    lines.append("")
    for r in runs:
        resumed = (f" Interrupted and continued {r['resumed']} time(s) with the same command plus `--resume` "
                   "(from the latest checkpoint; the training after it was lost and is not counted in the minutes)." if r.get("resumed") else "")
        lines.append(f"- {r['label']}: `{_first_command(r)}`.{resumed} {describe_load(r.get('load'))}")
    lines.append("")
    return lines, verdicts


def _long_section(long: dict) -> list[str]:
    rows = long["rows"]
    ns = sorted({r["n"] for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r["n"]): r for r in rows}
    lines = [
        "## Long inputs",
        "",
        f"MiniLM has 512 learned positions. For N > 512 every model here, the original included, gets its table "
        f"extended by `linattn.convert.extend_positions(model, N, method={long['position_method']!r})`: row p is "
        "pretrained row p mod 512 (the table repeated, Longformer's initialisation, arXiv 2004.05150), so each "
        "position keeps the local structure it was trained with and rows 0-511 are unchanged; "
        "`method='interpolate'` squeezes the table instead. Inputs: held-out text cut to N tokens, batch 1, "
        f"forward only (no grad), {long['threads']} thread(s); time is the median of the timed forwards after a "
        "warm-up, memory the peak resident set above the level before the forward, each in a fresh subprocess. "
        "`cos` is the cosine between the model's embedding and the original's (eager) at the same N; beyond 512 "
        "tokens neither was trained, so it says how alike they are, not which is right.",
        "",
        "| model | " + " | ".join(f"N = {n}" for n in ns) + " |",
        "|---|" + "---|" * len(ns),
    ]
    for m in models:
        cells = []
        for n in ns:
            r = by.get((m, n))
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append("failed: " + " ".join(r["error"])[:80])
            else:
                cos = f", cos {r['cosine_to_original']:.3f}" if r.get("cosine_to_original") is not None else ""
                cells.append(f"{format_seconds(r['seconds'])}, {_bytes(r['peak_bytes'])}{cos}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    top = max(ns)
    ok = {m: by[(m, top)] for m in models if (m, top) in by and "error" not in by[(m, top)]}
    converted = [m for m in ok if not m.startswith("original")]
    if converted and "original (eager)" in ok:
        fast = min(converted, key=lambda m: ok[m]["seconds"])
        text = (f"\nAt N = {top} the fastest converted model ({fast}) takes {format_seconds(ok[fast]['seconds'])}: "
                f"{ok['original (eager)']['seconds'] / ok[fast]['seconds']:.1f}x faster than the original with "
                f"transformers' eager attention, which materialises the N x N weights "
                f"({_bytes(ok['original (eager)']['peak_bytes'])} peak)")
        if "original (sdpa)" in ok:
            text += (f", and {ok['original (sdpa)']['seconds'] / ok[fast]['seconds']:.1f}x faster than the original "
                     "with PyTorch's fused SDPA, whose memory is already linear in N (it never stores the weights)")
        lines.append(text + ". Peak memory of the linear models and SDPA is then dominated by the rest of the "
                     "network (feed-forward activations grow as N too).")
    lines += ["", describe_load(long.get("load")), "", f"Command: `{long['command']}`", ""]
    return lines


def _target_lines() -> list[str]:
    return [f"Target: mean cosine >= {TARGET_COSINE} on held-out sentences after at most {TARGET_MINUTES:.0f} "
            "minutes of CPU distillation, for at least one linear-time mechanism. A softmax window that covers "
            "the input is not counted (it is exact softmax there); windowed mechanisms are judged on the "
            "passages, which are longer than their window.", ""]


def _load_runs(runs_dir: Path) -> tuple[dict, list[dict]]:
    fid_path = runs_dir / "fidelity.json"
    if not fid_path.is_file():
        raise FileNotFoundError(f"{fid_path} is missing: run `linattn convert fidelity --out {runs_dir}` first")
    distills = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("distill_*.json"))]
    return json.loads(fid_path.read_text()), distills


def results_section(runs_dir: str | Path, *, convert_doc: str = "convert.md") -> list[str]:
    """Markdown lines for docs/results.md: the fidelity and recovery tables, the targets and the
    commands, from the same run files as :func:`write_report` (whose document, ``convert_doc``
    relative to results.md, has the long-input timings and the notes). Its headings sit one level
    below a ``## `` section.

    Raises:
        FileNotFoundError: ``runs_dir`` has no fidelity.json.
    """
    fid, distills = _load_runs(Path(runs_dir))
    body = _fidelity_section(fid)
    verdicts: list[str] = []
    if distills:
        d_lines, verdicts = _distill_section(distills)
        body += d_lines
    body += ["## Targets", "", *_target_lines(), *(verdicts or ["- No distillation run recorded."]), ""]
    lines = ["## Converting pretrained MiniLM to linear attention", "",
             f"{fid['model']} converted by `linattn.convert.linearize`; long-input time and memory, notes and "
             f"limits are in [{convert_doc}]({convert_doc}), written by `linattn convert report` from the same "
             "files.", ""]
    lines += ["#" + x if x.startswith("## ") else x for x in body]
    lines += ["Commands:", "", "```sh", fid["command"], *[_first_command(d) for d in distills], "```", ""]
    return lines


def write_report(runs_dir: str | Path, out: str | Path) -> Path:
    """Write the document ``out`` (docs/convert.md) from the run files in ``runs_dir``; returns its path.

    Raises:
        FileNotFoundError: ``runs_dir`` has no fidelity.json.
    """
    runs_dir, doc = Path(runs_dir), Path(out)
    fid, distills = _load_runs(runs_dir)
    long_path = runs_dir / "long.json"
    lines = [
        "# Converting pretrained transformers to linear attention",
        "",
        "<!-- written by `linattn convert report`; edit the code in src/linattn/convert/, not this file -->",
        "",
        "`linattn.convert.linearize(model, attention=<config>)` replaces every self-attention of a Hugging Face "
        "BERT-family model by a linattn mechanism (FAVOR+ by default; any registered one), reusing the "
        "pretrained query/key/value/output weights; the result is still a transformers model with the same "
        "forward signature and outputs. Padding is passed to the mechanism as a key padding mask, so padded "
        "tokens are left out of numerator and normaliser alike. The model here is "
        f"{fid['model']}: 6 layers, hidden 384, 12 heads of 32, 22.7 M parameters. Texts are Shakespeare "
        "(`linattn.datasets`): held-out plays for every measurement, training plays for distillation.",
        "",
        "```python",
        "from linattn.convert import linearize",
        "from linattn.nn import FavorConfig, HedgehogConfig",
        "linear_model = linearize(model, FavorConfig(num_features=256))  # model: a transformers BertModel",
        "```",
        "",
    ]
    lines += _fidelity_section(fid)
    verdicts: list[str] = []
    if distills:
        d_lines, verdicts = _distill_section(distills)
        lines += d_lines
    if long_path.is_file():
        lines += _long_section(json.loads(long_path.read_text()))
    lines += ["## Targets", "", *_target_lines()]
    lines += verdicts or ["- No distillation run recorded."]
    lines += [
        "",
        "## Notes and limits",
        "",
        "- sentence-transformers truncates this model's inputs at 256 tokens; here the passages (over 320 tokens) "
        "are embedded whole by the original and the converted models alike (BERT has 512 positions), so the "
        "comparison is like for like, but it is beyond the length the sentence model was tuned on.",
        "- FAVOR+ rows are one random draw each (seed 0 + layer index); no other draws were measured, so "
        "differences of a few hundredths between neighbouring rows (m, orthogonal against i.i.d.) may be the draw "
        "rather than the setting.",
        "- Linformer and Hedgehog have parameters that only mean something after training (random E/F, identity "
        "feature maps); their rows without training are lower bounds, not the mechanisms' quality.",
        "- The attention-probability dropout of BERT is not applied by converted layers (linear attention never "
        "forms the weights it would drop); converted models are meant for inference and distillation in eval mode.",
        "- Hedgehog with a window computes the window in blocks of max(W, 32) queries against the 3 blocks of keys "
        "around them, beside the linear part: linear in N but several times the work of plain Hedgehog at W = 64 "
        "(see the long-input table); that block form is not tuned.",
        "- Only self-attention over a padding mask is converted: causal/packed/sliding masks and cross-attention "
        "raise instead of being approximated; LSH (shared query-key projection) is rejected for BERT weights.",
        "",
        "## Reproduce", "", "```sh"]
    lines.append(fid["command"])
    lines += [_first_command(d) for d in distills]
    if long_path.is_file():
        lines.append(json.loads(long_path.read_text())["command"])
    lines += [f"linattn convert report --runs {runs_dir} --out {doc}", "```", ""]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))
    return doc
