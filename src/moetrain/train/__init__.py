"""The training loop of every layout (``Trainer``), AdamW + warm-up/cosine schedule, checkpoints, metrics.

Names load on first use, so the distributed runtime can import ``moetrain.train.precision`` or
``moetrain.train.optim`` without the trainer that is built on it.
"""

from __future__ import annotations

_LAZY = {
    "Trainer": "moetrain.train.trainer",
    "build_lr_scheduler": "moetrain.train.optim",
    "build_optimizer": "moetrain.train.optim",
    "lr_multiplier": "moetrain.train.optim",
    "latest_checkpoint": "moetrain.train.checkpoint",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetrain.train' has no attribute {name!r}")


__all__ = list(_LAZY)
