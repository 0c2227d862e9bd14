"""The training loop of every layout (``Trainer``), run checks, the rank a launcher starts, metrics.

``Trainer`` loads on first use, so importing a module of this package does not build the trainer. The
optimizer, precision, host-memory, recovery and checkpoint-folder helpers it shares with the distributed
runtime live below both, in ``moetrain.runtime_base``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Trainer": "moetrain.train.trainer",
    "SuppliedParts": "moetrain.train.trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetrain.train' has no attribute {name!r}")


__all__ = list(_LAZY)
