"""Selective recompute and swap under a memory budget.

Torch-free names (importable by the planner): ``MemoryPlan``, ``DeviceSpeed``, ``ActivationShape``,
``choose_memory_plan``,
``choose_plan`` (from a run's memory options). Torch-side names load on first use:
``apply_memory_policy``, ``measure_activations``.
"""

from __future__ import annotations

import importlib

from moetrain.memory.options import choose_plan
from moetrain.memory.policy import POLICIES, ActivationShape, DeviceSpeed, MemoryPlan, PolicyResult, choose_memory_plan

_LAZY = {
    "apply_memory_policy": "moetrain.memory.runtime",
    "AppliedPolicy": "moetrain.memory.runtime",
    "measure_activations": "moetrain.memory.measure",
    "ActivationMeter": "moetrain.memory.measure",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetrain.memory' has no attribute {name!r}")


__all__ = [
    "POLICIES", "ActivationShape", "DeviceSpeed", "MemoryPlan", "PolicyResult", "choose_memory_plan", "choose_plan",
    *_LAZY,
]
