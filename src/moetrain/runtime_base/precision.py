"""Mixed precision of a training step: one rule for the trainer and the planner's host probe."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(dtype: str, device_type: str) -> torch.dtype | None:
    """bf16 autocast when asked (``dtype`` "bf16") or by default on a GPU ("auto"); None: fp32."""
    if dtype == "bf16" or (dtype == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


def autocast(dtype: torch.dtype | None, device_type: str) -> contextlib.AbstractContextManager:
    """The autocast region of a forward pass in ``dtype`` (no region for fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
