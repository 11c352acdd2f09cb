"""Tier 4: training (``linattn train``) and the one training loop every trainer uses.

:class:`TrainingLoop` (schedule, accumulation, clipping, stopping on steps, time or signals,
metrics, evaluation and checkpoint cadence, progress) runs language-model training
(:func:`train`), the experiments' contenders and distillation. :func:`train` adds what a
:class:`linattn.TransformerLM` run needs: the config (:class:`TrainConfig`, JSON/TOML files with
dotted overrides), data (the built-in associative-recall stream or a memmapped token file), bf16
autocast, exact checkpoint/resume, one run per output folder (a lock) and DistributedDataParallel
under ``torchrun`` or :func:`launch_local`.
"""

from .checkpoint import latest_checkpoint, load_train_checkpoint, save_train_checkpoint
from .config import DATA_SOURCES, RESUMABLE_CHANGES, DataConfig, TrainConfig, apply_overrides, load_config
from .data import TokenData, WindowSampler, load_token_file, make_data, pack_documents, recall_tokens
from .lock import OutDirBusyError
from .loop import CosineSchedule, LoopResult, MetricsLog, TrainingLoop, decay_groups
from .trainer import TrainResult, launch_local, lr_at, train

__all__ = [
    "CosineSchedule",
    "DATA_SOURCES",
    "DataConfig",
    "LoopResult",
    "MetricsLog",
    "OutDirBusyError",
    "RESUMABLE_CHANGES",
    "TokenData",
    "TrainConfig",
    "TrainResult",
    "TrainingLoop",
    "WindowSampler",
    "apply_overrides",
    "decay_groups",
    "latest_checkpoint",
    "launch_local",
    "load_config",
    "load_token_file",
    "load_train_checkpoint",
    "lr_at",
    "make_data",
    "pack_documents",
    "recall_tokens",
    "save_train_checkpoint",
    "train",
]
