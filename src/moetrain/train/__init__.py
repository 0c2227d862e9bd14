"""Single-process training: trainer, AdamW + warm-up/cosine schedule, DCP checkpoints, metrics."""

from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from moetrain.train.optim import build_lr_scheduler, build_optimizer, lr_multiplier
from moetrain.train.trainer import RunOptions, Trainer

__all__ = [
    "RunOptions",
    "Trainer",
    "build_lr_scheduler",
    "build_optimizer",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_multiplier",
    "save_checkpoint",
]
