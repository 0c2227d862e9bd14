"""Optimizer state and gradients to host memory while generation runs, and back before the next step.

Generation needs room for its own weights and its KV cache; the trainer's AdamW moments (two fp32
copies of every parameter it owns) and the last step's gradients are not touched until the next step.
``HostOffload`` moves them to host memory (pinned on CUDA, so the copies are asynchronous) and puts the
same bytes back: values are restored bit for bit. Whether to do it is ``offload_decision``'s: only when
the generation's memory does not fit in what the device has free (on a CPU the "device" is host memory
already, so never unless forced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

OffloadMode = Literal["auto", "always", "never"]
FREE_MARGIN = 0.9
"""Use at most this share of the device's free memory before offloading (fragmentation, workspaces)."""


@dataclass(frozen=True)
class OffloadDecision:
    offload: bool
    reason: str


def offload_decision(mode: OffloadMode, device: torch.device, need_bytes: int,
                     free_bytes: int | None = None) -> OffloadDecision:
    """Offload when ``mode`` is ``always``, or ``auto`` and ``need_bytes`` (generation's memory) exceeds
    the device's free memory (``free_bytes``, measured when not given)."""
    if mode != "auto":
        return OffloadDecision(mode == "always", f"offload {mode}")
    if device.type != "cuda":
        return OffloadDecision(False, "fits: the CPU's memory is the host's")
    free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
    fits = need_bytes <= FREE_MARGIN * free
    return OffloadDecision(not fits, f"{'fits' if fits else 'does not fit'}: generation needs "
                                     f"{need_bytes / 2**20:,.0f} MiB, {free / 2**20:,.0f} MiB free")


@dataclass
class HostOffload:
    """The optimizer's state tensors and the parameters' gradients, moved out and back."""

    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    """Every parameter whose ``.grad`` moves (the model's and the optimizer's own flat shards)."""
    _state: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)
    _grads: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)

    @property
    def is_offloaded(self) -> bool:
        return bool(self._state or self._grads)

    @torch.no_grad()
    def offload(self) -> int:
        """Move to host; returns the bytes moved. The device copies are released (no reference is kept)."""
        assert not self.is_offloaded, "already offloaded"
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    self._state.append((state, key, _to_host(value)))
                    moved += value.numel() * value.element_size()
        for p in self.params:
            if p.grad is not None:
                self._grads.append((p, _to_host(p.grad)))
                moved += p.grad.numel() * p.grad.element_size()
        for state, key, host in self._state:
            state[key] = host
        for p, _ in self._grads:
            p.grad = None
        _synchronize()
        return moved

    @torch.no_grad()
    def restore(self, device: torch.device) -> int:
        """Put every tensor back on ``device``; returns the bytes moved."""
        moved = 0
        for state, key, host in self._state:
            state[key] = host.to(device, non_blocking=True)
            moved += host.numel() * host.element_size()
        for p, host in self._grads:
            p.grad = host.to(device, non_blocking=True)
            moved += host.numel() * host.element_size()
        self._state, self._grads = [], []
        _synchronize()
        return moved


def _to_host(value: torch.Tensor) -> torch.Tensor:
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
    host.copy_(value, non_blocking=value.is_cuda)
    return host


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
