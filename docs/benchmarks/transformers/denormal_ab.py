"""The delta-rule engine against an earlier revision of it, at Qwen3.5-0.8B's Gated DeltaNet width:
first written for the flush of negligible decay factors (functional/log_decays.py,
NEGLIGIBLE_DECAY), with the decays Qwen3.5's layers have (set "denormal", the default), and used
again for later engine work (set "engine": prefill and forward+backward at N = 1024 .. 16384 with
the mild decays of `bench transformers`, and the layers' decays at two settings; set "kda": KDA, a
decay per key channel, at kda_small_model's and Kimi Linear's widths).

    .venv/bin/python docs/benchmarks/transformers/denormal_ab.py OLD_REV [SET [NAME]]

Builds OLD_REV's package into a temporary folder (renamed linattn_old, its custom ops renamed),
then, in 3 fresh processes, times ``linattn.integrations.transformers.delta_rule`` of both
interleaved (docs/benchmarks/ab.py), B = 1, H = 16, Dk = Dv = 128, float32, 2 threads, with log
decays as a Qwen3.5 layer computes them at initialisation: -A softplus(a + dt_bias), A uniform in
[0.01, 16] per head, dt_bias 1, a ~ N(0, 1) (so a chunk's cumulative decay reaches exp(-100) and
less); and with the mild decays of `bench transformers`' core (log-sigmoid(N(0, 1) + 4)) as control.
Writes SET_ab.json and SET_ab.md beside this file (denormal_ab.*, engine_ab.*), or NAME.json and
NAME.md (a later round of a set against another revision: engine2_ab.*).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SETS = {
    "denormal": ("Flushing negligible decay factors: the delta rule against the engine before it",
                 (("layer decays", "prefill", 1024), ("layer decays", "prefill", 4096),
                  ("layer decays", "train", 1024), ("mild decays", "prefill", 4096))),
    "engine": ("The delta-rule engine against an earlier revision",
               (("mild decays", "prefill", 1024), ("mild decays", "prefill", 4096), ("mild decays", "prefill", 16384),
                ("mild decays", "train", 1024), ("mild decays", "train", 4096), ("layer decays", "prefill", 4096),
                ("layer decays", "train", 1024))),
    # KDA (a decay per key channel) at kda_small_model's width (8 heads of 64) and Kimi Linear's (32 of 128)
    "kda": ("KDA's engine against an earlier revision",
            (("kda 8x64 mild", "prefill", 2048), ("kda 8x64 mild", "train", 2048), ("kda 8x64 layer", "prefill", 2048),
             ("kda 32x128 mild", "prefill", 4096), ("kda 32x128 mild", "train", 1024))),
}


def _inputs(decays: str, pass_: str, n: int, g):
    """The inputs of one setting: Gated DeltaNet at 16 heads of 128 (a decay per head), or KDA at
    the width its label names, ``kda HxD mild|layer`` (a decay per key channel)."""
    import torch
    import torch.nn.functional as F

    kda = decays.startswith("kda")
    H, D = (int(s) for s in decays.split()[1].split("x")) if kda else (16, 128)
    x = {name: torch.randn(1, n, H, D, generator=g) for name in ("query", "key", "value")}
    shape = (1, n, H, D) if kda else (1, n, H)
    if "layer" in decays:
        A = torch.empty(H, *((1,) if kda else ())).uniform_(0.01, 16, generator=g)
        x["g"] = -A * F.softplus(torch.randn(*shape, generator=g) + 1.0)
    else:
        x["g"] = F.logsigmoid(torch.randn(*shape, generator=g) + 4)
    x["beta"] = torch.sigmoid(torch.randn(1, n, H, generator=g))
    return {k: t.requires_grad_(pass_ == "train") for k, t in x.items()}


def child(old_src: str, name: str) -> dict:
    import torch

    sys.path.insert(0, old_src)
    sys.path.insert(0, str(ROOT / "docs" / "benchmarks"))
    from ab import interleaved

    import linattn.integrations.transformers as new
    import linattn_old.integrations.transformers as old

    from linattn.bench.harness import OtherLoad

    torch.set_num_threads(2)
    monitor = OtherLoad(reference=True)
    out = {}
    for decays, pass_, n in SETS[name][1]:
        x = _inputs(decays, pass_, n, torch.Generator().manual_seed(0))

        def f(package):
            args = (x["query"], x["key"], x["value"], x["g"], x["beta"])
            if pass_ == "prefill":
                with torch.no_grad():
                    package.delta_rule(*args, output_final_state=True)
            else:
                for t in x.values():
                    t.grad = None
                o, _ = package.delta_rule(*args)
                o.backward(torch.ones_like(o))

        out[f"{decays}/{pass_}/{n}"] = interleaved(f, new, old, 5)
    out["load"] = os.getloadavg()
    out["machine"] = monitor.finish()  # other processes' CPU share, the reference matmul's speed
    return out


def main(old_rev: str, name: str, out_name: str | None = None) -> None:
    out_name = out_name or f"{name}_ab"
    # the revision by its hash, so that the command written below names it after HEAD has moved on
    old_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", old_rev], capture_output=True, text=True,
                             check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(f"git -C {ROOT} archive {old_rev} src/linattn | tar -x -C {tmp}", shell=True, check=True)
        old = Path(tmp) / "src" / "linattn_old"
        (Path(tmp) / "src" / "linattn").rename(old)
        for path in old.rglob("*.py"):
            text = path.read_text()
            if '"linattn::' in text:
                path.write_text(text.replace('"linattn::', '"linattn_old::'))
        runs = []
        for _ in range(3):
            proc = subprocess.run([sys.executable, __file__, "child", str(Path(tmp) / "src"), name], capture_output=True,
                                  text=True, check=True)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = [f"{d}/{p}/{n}" for d, p, n in SETS[name][1]]
    command = (f"python docs/benchmarks/transformers/denormal_ab.py {old_rev}" + ("" if name == "denormal" else f" {name}")
               + ("" if out_name == f"{name}_ab" else f" {out_name}"))
    result = {"command": command, "runs": runs,
              "new/old": {k: {"median": statistics.median(r[k]["new/old"] for r in runs),
                              "min": min(r[k]["new/old"] for r in runs), "max": max(r[k]["new/old"] for r in runs)}
                          for k in keys}}
    (HERE / f"{out_name}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# {SETS[name][0]}", "",
             f"Written by `{result['command']}` (see its docstring). new/old time, 3 runs in fresh processes of 5 "
             f"interleaved calls each; median (min-max). Each run's medians in seconds are in {out_name}.json.", "",
             "| decays | pass | N | new/old | old s (run 1) | new s (run 1) |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for k in keys:
        d, p, n = k.split("/")
        s = result["new/old"][k]
        lines.append(f"| {d} | {p} | {n} | {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f}x) | "
                     f"{runs[0][k]['old']:.3f} | {runs[0][k]['new']:.3f} |")
    lines += ["", "Load average (1 min) at the end of each run: "
              + ", ".join(f"{r['load'][0]:.2f}" for r in runs), ""]
    if all("machine" in r for r in runs):
        from linattn.bench.harness import format_run_loads

        lines += ["Each run's machine:", "", *format_run_loads([r["machine"] for r in runs]), ""]
    (HERE / f"{out_name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "HEAD", sys.argv[2] if len(sys.argv) > 2 else "denormal",
             sys.argv[3] if len(sys.argv) > 3 else None)
