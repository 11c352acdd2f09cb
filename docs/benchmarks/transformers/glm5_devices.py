"""GLM5-Next's tiny model on two devices (issue 43): where the 0.12 difference of its logits comes from.

The H200 run (/work/shared/gpu/check.py, section T) built ``lt.small_config("glm5_next")`` after
``torch.manual_seed(0)`` with ``lt.causal_lm(cfg).eval()``, attached linattn, drew
``ids = torch.randint(3, 99, (2, 40))`` and compared CUDA's float32 logits with the CPU's: 0.122
(packed row: 0.132), where the five other families agree to 8.7e-7. This script rebuilds that model
on the CPU (same seed, config and inputs) and measures, on the CPU only:

1. transformers' own path, float32 against the same weights in float64 (``.double()``);
2. the same with linattn attached;
3. transformers' path against linattn's, in float32 and in float64;
4. the sparse-attention indexer of the one indexed-attention layer: its top-k input per query, the
   margin between the k-th and (k+1)-th candidate (exact ties, near ties), how much the logits move
   when only the order in which ties are broken changes (lowest index first, highest first), how
   much they move when the input embeddings are perturbed by 1e-7 (relative), and the same figures
   with the indexer made dense (``index_topk`` = 40: every pool selected, no choice left); ties
   broken lowest index first against torch's CPU top-k is set beside the H200's CUDA-vs-CPU figures
   (float32, packed row, bf16);
5. the MoE routers' top-k (the other discrete choice in this config): margins between the chosen
   experts and the next, and whether the perturbations flip any.

    .venv/bin/python docs/benchmarks/transformers/glm5_devices.py

writes glm5_devices.md beside this file (all figures are the script's own). Relative difference =
max |a - b| / max |b|, as check.py computes it. About ten seconds on one thread.
"""

from __future__ import annotations

import contextlib
import copy
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from linattn.integrations import transformers as lt

HERE = Path(__file__).resolve().parent
GPU_CUDA_VS_CPU = 0.1221482463263517  # /work/shared/gpu/results-run2.jsonl, section T, glm5_next
GPU_PACKED_CUDA_VS_CPU = 0.1324988559980711
GPU_BF16_VS_CPU = 0.12000695548489666  # bf16 on CUDA against float32 on the CPU
DENSE_TOPK = 40  # >= the 40 tokens: all ten pools of four selected


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def build():
    """The model and inputs of check.py's section T (attach there draws nothing from the RNG)."""
    torch.manual_seed(0)
    cfg = lt.small_config("glm5_next")
    model = lt.causal_lm(cfg).eval()
    ids = torch.randint(3, 99, (2, 40))
    return cfg, model, ids


def _is(module, suffix: str) -> bool:
    return type(module).__name__.endswith(suffix)


class TopkProbe:
    """Records, and optionally re-breaks the ties of, the indexer's and the routers' top-k calls.

    The indexer calls ``Tensor.topk`` on its pool scores; the router calls ``torch.topk`` on the
    experts' scores (and once on a single group, a choice of one out of one). Patching is active only
    inside those modules' forwards. ``prefer`` = None keeps torch's own top-k; "low" / "high" pick,
    among equal scores, the lowest / highest candidate index (a stable sort), which changes nothing
    but the way exact ties are broken."""

    def __init__(self, model, prefer_indexer=None, prefer_router=None):
        self.model, self.prefer = model, {"indexer": prefer_indexer, "router": prefer_router}
        self.where = None
        self.calls = {"indexer": [], "router": []}

    @staticmethod
    def _topk(x, k, dim, prefer):
        dim = dim % x.dim()
        if prefer == "high":
            flipped = x.flip(dim)
            values, idx = torch.sort(flipped, dim=dim, descending=True, stable=True)
            idx = x.shape[dim] - 1 - idx
        else:
            values, idx = torch.sort(x, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), idx.narrow(dim, 0, k)))

    @contextlib.contextmanager
    def active(self):
        probe, tensor_topk, torch_topk = self, torch.Tensor.topk, torch.topk

        def call(kind, original, x, k, dim=-1, largest=True, sorted=True, **_):
            prefer = probe.prefer[kind]
            if prefer is None or not largest:
                out = original(x, k, dim=dim, largest=largest, sorted=sorted)
            else:
                out = probe._topk(x, k, dim, prefer)
            probe.calls[kind].append((x.detach().clone(), k, out.indices.clone()))
            return out

        def method(self, k, dim=-1, largest=True, sorted=True):
            if probe.where == "indexer":
                return call("indexer", tensor_topk, self, k, dim, largest, sorted)
            return tensor_topk(self, k, dim=dim, largest=largest, sorted=sorted)

        def function(x, k, dim=-1, largest=True, sorted=True, **kw):
            if probe.where == "router" and x.shape[-1] > 1:
                return call("router", torch_topk, x, k, dim, largest, sorted)
            return torch_topk(x, k, dim=dim, largest=largest, sorted=sorted, **kw)

        handles = []
        for m in self.model.modules():
            for suffix, kind in (("TextIndexer", "indexer"), ("TopkRouter", "router")):
                if _is(m, suffix):
                    handles.append(m.register_forward_pre_hook(lambda *_, kind=kind: setattr(probe, "where", kind)))
                    handles.append(m.register_forward_hook(lambda *_: setattr(probe, "where", None)))
        torch.Tensor.topk, torch.topk = method, function
        try:
            yield self
        finally:
            torch.Tensor.topk, torch.topk = tensor_topk, torch_topk
            for h in handles:
                h.remove()


def forward(model, path: str, inputs, prefer_indexer=None, prefer_router=None, **kw):
    """Logits (float64 copy) and the probe of one forward, on transformers' path or linattn's."""
    (lt.attach if path == "linattn" else lt.detach)(model)
    probe = TopkProbe(model, prefer_indexer, prefer_router)
    with torch.no_grad(), probe.active():
        if isinstance(inputs, torch.Tensor) and inputs.dtype == torch.long:
            out = model(inputs, **kw).logits
        else:
            out = model(inputs_embeds=inputs, **kw).logits
    lt.detach(model)
    return out.double(), probe


def selections(probe, kind):
    """The chosen candidates of every top-k row, as sorted index lists (the order is irrelevant: the
    indexer scatters them into a mask, the router weights experts by their own scores). Candidates
    masked to the dtype's lowest value (pools the query cannot see) are dropped as -1, as the indexer
    drops them: which of those fills a row's unused places changes nothing."""
    out = []
    for x, _, i in probe.calls[kind]:
        floor = torch.finfo(x.dtype).min
        out.append(i.masked_fill(x.gather(-1, i) == floor, -1).sort(-1).values)
    return out


def changed_rows(p, q, kind) -> int:
    return sum(int((a != b).any(-1).sum()) for a, b in zip(selections(p, kind), selections(q, kind)))


def margins(probe, kind, choice_only=True) -> dict:
    """Per top-k row with a real choice (more valid candidates than k): the gap between the k-th and
    (k+1)-th score, relative to the largest |score| of the row."""
    rows = ties = ties_at_zero = 0
    rel = []
    zero_scores = valid_scores = 0
    for x, k, _ in probe.calls[kind]:
        x = x.double().reshape(-1, x.shape[-1])
        floor = torch.finfo(probe.calls[kind][0][0].dtype).min
        for row in x:
            valid = row[row > floor]
            valid_scores += valid.numel()
            zero_scores += int((valid == 0).sum())
            if valid.numel() <= k:
                continue
            s = valid.sort(descending=True).values
            rows += 1
            gap = float(s[k - 1] - s[k])
            scale = float(valid.abs().max())
            if gap == 0:
                ties += 1
                ties_at_zero += int(s[k] == 0)
            else:
                rel.append(gap / scale)
    rel_t = torch.tensor(rel or [float("nan")], dtype=torch.float64)
    return {"rows": rows, "ties": ties, "ties_at_zero": ties_at_zero, "below_1e-6": int((rel_t < 1e-6).sum()),
            "below_1e-4": int((rel_t < 1e-4).sum()), "min_nonzero": float(rel_t.min()),
            "zero_scores": zero_scores, "valid_scores": valid_scores}


def perturbations(model, path, ids, draws=5, eps=1e-7):
    """Input embeddings scaled by (1 + eps * N(0, 1)) elementwise: the largest logit change over the
    draws and the top-k rows whose selection changed (indexer, router)."""
    emb = model.get_input_embeddings()(ids).detach()
    base, pb = forward(model, path, emb)
    worst, flips_i, flips_r = 0.0, 0, 0
    g = torch.Generator().manual_seed(7)
    for _ in range(draws):
        noisy = emb * (1 + eps * torch.randn(emb.shape, generator=g, dtype=emb.dtype))
        out, p = forward(model, path, noisy)
        worst = max(worst, relerr(out, base))
        flips_i += changed_rows(p, pb, "indexer")
        flips_r += changed_rows(p, pb, "router")
    return {"worst": worst, "indexer_flips": flips_i, "router_flips": flips_r, "draws": draws}


def set_topk(model, topk):
    for m in model.modules():
        if _is(m, "TextIndexer"):
            m.index_topk = topk


def packed_kwargs():
    cu = torch.tensor([0, 15, 40])
    pos = torch.cat([torch.arange(15), torch.arange(25)])[None]
    return dict(position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=25, max_length_k=25,
                use_cache=False)


def study(model32, model64, ids, label) -> dict:
    r = {"label": label}
    out = {}
    for path in ("transformers", "linattn"):
        for name, m in (("f32", model32), ("f64", model64)):
            out[path, name] = forward(m, path, ids)
    r["f32_vs_f64"] = {p: relerr(out[p, "f32"][0], out[p, "f64"][0]) for p in ("transformers", "linattn")}
    r["hf_vs_linattn"] = {d: relerr(out["linattn", d][0], out["transformers", d][0]) for d in ("f32", "f64")}
    r["indexer_changed_f32_vs_f64"] = {p: changed_rows(out[p, "f32"][1], out[p, "f64"][1], "indexer")
                                       for p in ("transformers", "linattn")}
    r["router_changed_f32_vs_f64"] = {p: changed_rows(out[p, "f32"][1], out[p, "f64"][1], "router")
                                      for p in ("transformers", "linattn")}
    probe = out["linattn", "f32"][1]
    r["indexer_margins"] = margins(probe, "indexer")
    r["router_margins"] = margins(probe, "router")
    # the same scores, ties broken the other way: what a device whose top-k orders ties differently gives
    tie = {}
    for path in ("transformers", "linattn"):
        for name, m in (("f32", model32), ("f64", model64)):
            default_logits, default_probe = out[path, name]
            low, pl = forward(m, path, ids, prefer_indexer="low")
            high, ph = forward(m, path, ids, prefer_indexer="high")
            tie[path, name] = {"low_vs_default": relerr(low, default_logits),
                               "high_vs_default": relerr(high, default_logits),
                               "low_vs_high": relerr(low, high),
                               "rows_low_vs_default": changed_rows(pl, default_probe, "indexer"),
                               "rows_high_vs_default": changed_rows(ph, default_probe, "indexer"),
                               "rows_low_vs_high": changed_rows(pl, ph, "indexer")}
    r["tie_breaking"] = tie
    rl, _ = forward(model32, "linattn", ids, prefer_router="low")
    rh, _ = forward(model32, "linattn", ids, prefer_router="high")
    r["router_low_vs_high"] = relerr(rl, rh)
    kw = packed_kwargs()
    one = ids[:1]
    pd, ppd = forward(model32, "linattn", one, **kw)
    pl, ppl = forward(model32, "linattn", one, prefer_indexer="low", **kw)
    ph, pph = forward(model32, "linattn", one, prefer_indexer="high", **kw)
    r["packed"] = {"low_vs_default": relerr(pl, pd), "high_vs_default": relerr(ph, pd), "low_vs_high": relerr(pl, ph),
                   "rows_low_vs_default": changed_rows(ppl, ppd, "indexer"),
                   "rows_high_vs_default": changed_rows(pph, ppd, "indexer")}
    r["perturbed"] = {path: perturbations(model32, path, ids) for path in ("transformers", "linattn")}
    bf16 = copy.deepcopy(model32).to(torch.bfloat16)
    r["bf16_low_vs_f32_default"] = relerr(forward(bf16, "linattn", ids, prefer_indexer="low")[0],
                                          out["linattn", "f32"][0])
    r["bf16_default_vs_f32_default"] = relerr(forward(bf16, "linattn", ids)[0], out["linattn", "f32"][0])
    return r


def fmt(x) -> str:
    if isinstance(x, float):
        return "-" if x != x else f"{x:.2e}"
    return str(x)


def write_md(results, meta, seconds):
    s, d = results
    lines = [
        "# GLM5-Next's tiny model: CUDA against CPU (issue 43), taken apart on a CPU",
        "",
        f"Written by `{meta['command']}` ({meta['env']}; {seconds:.0f} s). The model and inputs are "
        "check.py's section T (seed 0, `lt.small_config(\"glm5_next\")`, ids `randint(3, 99, (2, 40))`): "
        "one indexed-attention layer (layer 1, `index_topk` = 8 with pools of `index_kpool` = 4 tokens: "
        "2 of up to 10 pools, plus the unfinished tail pool) and two MoE layers (top-2 of 4 experts). "
        "\"dense\" is the same model with `index_topk` = 40, every pool selected. Relative difference = "
        "max |a - b| / max |b|. See the script's docstring for every setting.",
        "",
        "## Logits",
        "",
        "| measurement | sparse indexer (as on the GPU) | dense indexer |",
        "| --- | ---: | ---: |",
    ]
    row = lambda name, f: lines.append(f"| {name} | {fmt(f(s))} | {fmt(f(d))} |")  # noqa: E731
    row("1. transformers' path, float32 vs float64", lambda r: r["f32_vs_f64"]["transformers"])
    row("2. linattn, float32 vs float64", lambda r: r["f32_vs_f64"]["linattn"])
    row("3. transformers' path vs linattn, float32", lambda r: r["hf_vs_linattn"]["f32"])
    row("3. transformers' path vs linattn, float64", lambda r: r["hf_vs_linattn"]["f64"])
    row("indexer rows chosen differently, float32 vs float64 (transformers / linattn)",
        lambda r: f"{r['indexer_changed_f32_vs_f64']['transformers']} / {r['indexer_changed_f32_vs_f64']['linattn']}")
    for path in ("transformers", "linattn"):
        for dt in ("f32", "f64"):
            name = {"f32": "float32", "f64": "float64"}[dt]
            row(f"4. indexer ties broken lowest index first vs highest first, {path}, {name}",
                lambda r, p=path, t=dt: r["tie_breaking"][p, t]["low_vs_high"])
    g7 = lambda x: f"{x:.7g}"  # noqa: E731
    lines.append("| 4. ties lowest index first vs torch's CPU top-k, linattn, float32 (H200's CUDA vs CPU: "
                 f"{GPU_CUDA_VS_CPU:.7g}) | {g7(s['tie_breaking']['linattn', 'f32']['low_vs_default'])} | "
                 f"{fmt(d['tie_breaking']['linattn', 'f32']['low_vs_default'])} |")
    row("4. ties highest index first vs torch's CPU top-k, linattn, float32",
        lambda r: r["tie_breaking"]["linattn", "f32"]["high_vs_default"])
    row("4. ties lowest index first vs torch's CPU top-k, transformers' path, float32",
        lambda r: r["tie_breaking"]["transformers", "f32"]["low_vs_default"])
    lines.append("| 4. packed row (as check.py), ties lowest index first vs torch's CPU top-k, linattn, float32 (H200: "
                 f"{GPU_PACKED_CUDA_VS_CPU:.7g}) | {g7(s['packed']['low_vs_default'])} | "
                 f"{fmt(d['packed']['low_vs_default'])} |")
    row("4. packed row: highest index first vs torch's CPU top-k", lambda r: r["packed"]["high_vs_default"])
    lines.append("| 4. bf16 with ties lowest index first vs float32 with torch's CPU top-k, linattn (H200: "
                 f"{GPU_BF16_VS_CPU:.7g}) | "
                 f"{g7(s['bf16_low_vs_f32_default'])} | {fmt(d['bf16_low_vs_f32_default'])} |")
    row("4. bf16 vs float32, both torch's CPU top-k, linattn", lambda r: r["bf16_default_vs_f32_default"])
    for path in ("transformers", "linattn"):
        row(f"4. inputs x (1 + 1e-7 N(0,1)), {path}, float32: largest change of {s['perturbed'][path]['draws']} draws",
            lambda r, p=path: r["perturbed"][p]["worst"])
    row("5. MoE ties broken lowest first vs highest first, linattn, float32", lambda r: r["router_low_vs_high"])
    lines += [
        "",
        f"The H200 measured, with linattn attached on both devices: CUDA vs CPU {GPU_CUDA_VS_CPU:.4g}, packed row "
        f"{GPU_PACKED_CUDA_VS_CPU:.4g} (float32), bf16 on CUDA vs float32 on the CPU {GPU_BF16_VS_CPU:.4g} "
        "(/work/shared/gpu/results-run2.jsonl).",
        "",
        "## The indexer's top-k (layer 1) and the routers' top-k (layers 1 and 3 together), float32, linattn",
        "",
        "Rows: one per query (indexer) or token (router) with more valid candidates than k. Margin: the k-th "
        "score minus the (k+1)-th, relative to the row's largest |score|.",
        "",
        "| | sparse: indexer | sparse: routers | dense: indexer | dense: routers |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    items = [("rows with a choice", "rows"), ("exact ties at the k-th place", "ties"),
             ("... of which tied at score 0 (ReLU)", "ties_at_zero"), ("margins below 1e-6 (not tied)", "below_1e-6"),
             ("margins below 1e-4 (not tied)", "below_1e-4"), ("smallest non-zero margin", "min_nonzero"),
             ("valid scores exactly 0 / all valid scores", None)]
    for name, key in items:
        cells = []
        for r in (s, d):
            for kind in ("indexer_margins", "router_margins"):
                m = r[kind]
                cells.append(f"{m['zero_scores']} / {m['valid_scores']}" if key is None else fmt(m[key]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for a, b, name in (("low", "high", "lowest vs highest index first"), ("low", "default", "lowest index first vs "
                                                                                         "torch's CPU top-k")):
        cells = []
        for r in (s, d):
            cells += [f"{r['tie_breaking']['linattn', 'f32'][f'rows_{a}_vs_{b}']} of {r['indexer_margins']['rows']}",
                      "-"]
        lines.append(f"| rows chosen differently, ties broken {name} | " + " | ".join(cells) + " |")
    cells = []
    for r in (s, d):
        p = r["perturbed"]["linattn"]
        cells += [f"{p['indexer_flips']} in {p['draws']} draws", f"{p['router_flips']} in {p['draws']} draws"]
    lines.append("| rows chosen differently under 1e-7 input perturbations | " + " | ".join(cells) + " |")
    lines += ["", "## Reading", ""] + meta["reading"](s, d)
    (HERE / "glm5_devices.md").write_text("\n".join(lines) + "\n")


def reading(s, d) -> list[str]:
    tb, im, rm = s["tie_breaking"], s["indexer_margins"], s["router_margins"]
    low = tb["linattn", "f32"]["low_vs_default"]
    return [
        f"- linattn is not the source. transformers' path and linattn's agree to {s['hf_vs_linattn']['f32']:.1e} "
        f"(float32) and {s['hf_vs_linattn']['f64']:.1e} (float64); float32 vs float64 differs by "
        f"{s['f32_vs_f64']['transformers']:.1e} on transformers' path and {s['f32_vs_f64']['linattn']:.1e} on "
        "linattn's, with the same indexer and router selections in both. (A `.double()` GLM5-Next still scores its "
        "indexer and its routers in float32: both cast with `.float()`.)",
        "- The source is the sparse-attention indexer's top-k meeting exact ties. Its pool scores are "
        "sum_h w_h(x) relu(q_h . k_pool), with per-query head weights w_h of either sign, so many are exactly 0 "
        f"({im['zero_scores']} of {im['valid_scores']} valid scores here) and {im['ties']} of the {im['rows']} "
        f"queries that have a choice have an exact tie at the k-th place ({im['ties_at_zero']} of them at 0). "
        "`topk` does not specify which of equal elements it returns, and torch's CPU and CUDA kernels return "
        "different ones. Same scores and weights on the CPU, ties broken lowest index first instead of torch's "
        f"CPU order: logits {low:.7g} away (H200: {GPU_CUDA_VS_CPU:.7g}), packed row "
        f"{s['packed']['low_vs_default']:.7g} (H200: {GPU_PACKED_CUDA_VS_CPU:.7g}), and bf16 "
        f"{s['bf16_low_vs_f32_default']:.7g} (H200: {GPU_BF16_VS_CPU:.7g}). The H200's figures are reproduced to six "
        "digits, so CUDA's top-k returned the lowest-index tied pools here and the CPU's did not; the rest is float32 rounding. "
        f"On transformers' path alone the same change gives {tb['transformers', 'f32']['low_vs_default']:.4g}.",
        f"- Not a rounding flip: perturbing the inputs by 1e-7 (relative) moves the logits by at most "
        f"{max(p['worst'] for p in s['perturbed'].values()):.1e} and changes "
        f"{s['perturbed']['linattn']['indexer_flips']} indexer selections; the smallest margin that is not a tie is "
        f"{im['min_nonzero']:.1e} of the row's scale. Exact zeros stay tied under any rounding and any dtype.",
        f"- Dense indexer (`index_topk` = {DENSE_TOPK}, every pool selected): tie order changes nothing "
        f"({max(v['low_vs_high'] for v in d['tie_breaking'].values()):.1e}), float32 vs float64 "
        f"{d['f32_vs_f64']['linattn']:.1e}, transformers vs linattn {d['hf_vs_linattn']['f32']:.1e}: the linear "
        "layers agree as in the other families.",
        f"- MoE routers (the config's other discrete choice; one group, so the group top-k chooses nothing): no ties "
        f"({rm['ties']} of {rm['rows']}), smallest margin {rm['min_nonzero']:.1e} of the scale, "
        f"{s['perturbed']['linattn']['router_flips']} flips under the perturbations, and breaking ties either way "
        f"changes the logits by {s['router_low_vs_high']:.1e}: not a source.",
    ]


def main():
    t0 = time.time()
    torch.set_num_threads(1)
    cfg, model32, ids = build()
    model64 = copy.deepcopy(model32).double()
    model64.set_experts_implementation("eager")  # grouped_mm takes no float64; float32 keeps check.py's default
    sparse = study(model32, model64, ids, "sparse")
    set_topk(model32, DENSE_TOPK)
    set_topk(model64, DENSE_TOPK)
    dense = study(model32, model64, ids, "dense")
    meta = {"command": ".venv/bin/python docs/benchmarks/transformers/glm5_devices.py",
            "env": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                   f"{platform.processor() or platform.machine()}, 1 thread",
            "reading": reading}
    write_md((sparse, dense), meta, time.time() - t0)
    print((HERE / "glm5_devices.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
