"""Runs a test body on P gloo processes on this machine and collects every rank's results: the
launcher the context-parallel tests share."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from linattn.train.dist import join_group, spawn_local


def _rank_main(body: Callable[[int, int], dict], out_dir: str) -> None:
    rank, P = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    join_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(body(rank, P), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gloo_ranks(body: Callable[[int, int], dict], P: int, out_dir: Path) -> list[dict[Any, Any]]:
    """``body(rank, P)`` on each of P processes of one gloo group (a module-level function: it is
    pickled by name); returns the P results in rank order. Raises if any process fails."""
    spawn_local(_rank_main, P, (body, str(out_dir)))
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(P)]
