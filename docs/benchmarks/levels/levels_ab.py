"""The accelerator strategy's blocks between sub-chunks (a gate per key channel: KDA, GLA per
channel), this checkout against an earlier revision: kernel launches, an estimate of the memory
traffic, peak memory and the time of one call on this CPU (``../accelerator_ab.py`` with these cases,
this folder and this title).

    .venv/bin/python docs/benchmarks/levels/levels_ab.py OLD_REV [--runs 3] [--n 4096]

Writes levels_ab.json and levels_ab.md beside this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/benchmarks: accelerator_ab.py
from accelerator_ab import compare  # noqa: E402

HERE = Path(__file__).resolve().parent
CASES = [("kda", "prefill"), ("kda", "train"), ("gla_channel", "prefill"), ("gla_channel", "train")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old_rev")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--n", type=int, default=4096)
    a = p.parse_args()
    compare(a.old_rev, CASES, HERE, runs=a.runs, n=a.n, title="Blocks between sub-chunks on the accelerator strategy",
            command=f"python docs/benchmarks/levels/levels_ab.py {a.old_rev} --runs {a.runs} --n {a.n}",
            name="levels_ab")


if __name__ == "__main__":
    main()
