"""Tier 4: training a :class:`linattn.TransformerLM` (``linattn train``).

Config (:class:`TrainConfig`, JSON/TOML files with dotted overrides), data (the built-in
associative-recall stream or a memmapped token file), the loop (AdamW, warm-up + cosine,
clipping, accumulation, bf16 autocast, evaluation, JSONL metrics), exact checkpoint/resume, one
run per output folder (a lock) and DistributedDataParallel under ``torchrun`` or :func:`launch_local`.
"""

from .checkpoint import latest_checkpoint, load_train_checkpoint, save_train_checkpoint
from .config import DATA_SOURCES, RESUMABLE_CHANGES, DataConfig, TrainConfig, apply_overrides, load_config
from .data import TokenData, WindowSampler, load_token_file, make_data, recall_tokens
from .dist import launch_local
from .lock import OutDirBusyError
from .loop import TrainResult, lr_at, train

__all__ = [
    "DATA_SOURCES",
    "DataConfig",
    "OutDirBusyError",
    "RESUMABLE_CHANGES",
    "TokenData",
    "TrainConfig",
    "TrainResult",
    "WindowSampler",
    "apply_overrides",
    "latest_checkpoint",
    "launch_local",
    "load_config",
    "load_token_file",
    "load_train_checkpoint",
    "lr_at",
    "make_data",
    "recall_tokens",
    "save_train_checkpoint",
    "train",
]
