"""Load accounting for online expert balancing: each MoE layer's tokens per logical expert, per step.

Forward hooks add each layer's counts into one device tensor (summed over micro-batches, no host read);
``LoadTelemetry.read`` all-reduces them over the stage's ranks and reads them to the host once per step,
where the step already synchronises to report its loss. What the counts are used for is
``moetrain.distributed.balancing``'s business.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moetrain.balance.placement import ExpertPlacement
from moetrain.errors import UserError
from moetrain.runtime_base.eager_only import eager_only


def moe_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, MoE block) of this rank's MoE layers; MTP layers follow the decoder's."""
    layers = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    blocks = [(int(key), layer.moe) for key, layer in layers if layer.is_moe]
    num_layers = model.cfg.num_layers
    return blocks + [(num_layers + i, m.layer.moe) for i, m in enumerate(model.mtp) if m.layer.is_moe]


@dataclass
class StepLoads:
    """What one step's telemetry read gives the host."""

    step: int
    tokens_per_expert: np.ndarray
    """[L, E] over the stage's ranks."""
    tokens_per_rank: np.ndarray
    """[L, R] token-expert copies each EP rank computes under the placement the step ran with."""
    local_rows: list[int]
    """Rows this rank's experts computed, per layer (measured)."""
    local_expert_seconds: list[float]
    """Host time of this rank's expert forward, per layer (measured with ``time_experts``)."""

    def imbalance(self) -> np.ndarray:
        """[L] max/mean EP-rank load."""
        mean = self.tokens_per_rank.mean(axis=-1)
        return np.where(mean > 0, self.tokens_per_rank.max(axis=-1) / np.maximum(mean, 1e-12), 1.0)


class LoadTelemetry:
    """Tokens per logical expert of every local MoE layer, per step, kept on the device.

    Also the rows each rank's local experts computed per layer (``StepLoads.local_rows``, counted on the
    device from tensor shapes) and, with ``time_experts``, the host time of the experts' forward (CPU only:
    on an accelerator the host clock does not see kernel time).

    The hooks are the same functions for every layer and keep their counts in tensors the layer's modules
    hold (views of this object's): hooks closing over a layer index made ``torch.compile`` guard on the
    index and build one graph per MoE layer, and past its recompile limit (8) run the remaining layers
    eager; a host int read from a shape made it guard on each step's row count.
    """

    def __init__(self, model: nn.Module, time_experts: bool = False) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise UserError("this rank holds no MoE layer; expert balancing needs one")
        num_experts = model.cfg.moe.num_experts
        device = next(model.parameters()).device
        self.counts_LE = torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=device)
        self.rows_L = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        self.timers = [_ExpertTimer() for _ in self.layers] if time_experts else []
        self.handles = []
        for index, (_, block) in enumerate(self.layers):
            block.load_counts_E = self.counts_LE[index]
            block.experts.load_rows = self.rows_L[index]
            self.handles.append(block.register_forward_hook(_count_tokens))
            self.handles.append(block.experts.register_forward_pre_hook(_count_rows))
            if time_experts:
                block.experts.load_timer = self.timers[index]
                self.handles.append(block.experts.register_forward_pre_hook(_start_timer))
                self.handles.append(block.experts.register_forward_hook(_stop_timer))

    def read(self, step: int, placements: list[ExpertPlacement], group: dist.ProcessGroup | None) -> StepLoads:
        """Sum this step's counts over ``group`` (the stage) and read them with this rank's rows to the host
        (one read), with each EP rank's copies under ``placements`` (the ones the step ran with); then reset."""
        counts = self.counts_LE.clone()
        dist.all_reduce(counts, group=group)
        host = torch.cat([counts.flatten(), self.rows_L]).cpu().numpy()
        tokens_per_expert = host[: counts.numel()].reshape(counts.shape).astype(np.float64)
        per_rank = np.stack([p.apply_to_tokens_per_expert(loads) for p, loads in zip(placements, tokens_per_expert)])
        seconds = [timer.seconds for timer in self.timers] or [0.0] * len(self.layers)
        loads = StepLoads(step, tokens_per_expert, per_rank, host[counts.numel():].tolist(), seconds)
        self.reset()
        return loads

    def reset(self) -> None:
        self.counts_LE.zero_()
        self.rows_L.zero_()
        for timer in self.timers:
            timer.seconds = 0.0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for _, block in self.layers:
            del block.load_counts_E, block.experts.load_rows
            if self.timers:
                del block.experts.load_timer


def _count_tokens(block: nn.Module, args: tuple, output) -> None:
    block.load_counts_E.add_(output.tokens_per_expert_E.detach())


def _count_rows(experts: nn.Module, args: tuple) -> None:
    experts.load_rows.add_(args[0].shape[0])


@dataclass
class _ExpertTimer:
    started: float = 0.0
    seconds: float = 0.0


@eager_only  # the host clock, read as the experts start and end: never inside a compiled graph
def _start_timer(experts: nn.Module, args: tuple) -> None:
    experts.load_timer.started = time.perf_counter()


@eager_only
def _stop_timer(experts: nn.Module, args: tuple, output) -> None:
    experts.load_timer.seconds += time.perf_counter() - experts.load_timer.started
