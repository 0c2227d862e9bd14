"""Data pipeline: corpus (embedded Shakespeare or the user's files) → cached BPE tokenizer → packed
sequences with document boundaries → deterministic, resumable per-step batches for any DP layout.

Names load on first use: the corpus and its size (``corpus``, ``size``) are torch-free, so the checks that
run before a training run starts (``moetrain.train.checks``) read them without importing torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "IGNORE_INDEX": "moetrain.data.packing",
    "MicroBatch": "moetrain.data.packing",
    "PackedDataset": "moetrain.data.packing",
    "StepBatch": "moetrain.data.packing",
    "boundary_rows": "moetrain.data.packing",
    "Document": "moetrain.data.corpus",
    "cache_dir": "moetrain.data.corpus",
    "PreparedData": "moetrain.data.prepare",
    "prepare_data": "moetrain.data.prepare",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetrain.data' has no attribute {name!r}")


__all__ = list(_LAZY)
