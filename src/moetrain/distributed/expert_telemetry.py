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

    Also the rows each rank's local experts computed per layer (``rows_per_layer``, host ints taken
    from tensor shapes) and, with ``time_experts``, the host time of the experts' forward (CPU only:
    on an accelerator the host clock does not see kernel time).
    """

    def __init__(self, model: nn.Module, time_experts: bool = False) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise UserError("this rank holds no MoE layer; expert balancing needs one")
        num_experts = model.cfg.moe.num_experts
        device = next(model.parameters()).device
        self.counts_LE = torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=device)
        self.rows_per_layer = [0] * len(self.layers)
        self.expert_seconds_per_layer = [0.0] * len(self.layers)
        self._started: list[float] = [0.0] * len(self.layers)
        self.handles = []
        for index, (_, block) in enumerate(self.layers):
            self.handles.append(block.register_forward_hook(self._count_hook(index)))
            self.handles.append(block.experts.register_forward_pre_hook(self._rows_hook(index, time_experts)))
            if time_experts:
                self.handles.append(block.experts.register_forward_hook(self._stop_hook(index)))

    def _count_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self.counts_LE[index].add_(output.tokens_per_expert_E.detach())
        return hook

    def _rows_hook(self, index: int, timed: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            self.rows_per_layer[index] += int(args[0].shape[0])
            if timed:
                self._started[index] = time.perf_counter()
        return hook

    def _stop_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self.expert_seconds_per_layer[index] += time.perf_counter() - self._started[index]
        return hook

    def read(self, step: int, placements: list[ExpertPlacement], group: dist.ProcessGroup | None) -> StepLoads:
        """Sum this step's counts over ``group`` (the stage) and read them to the host (one read), with each
        EP rank's copies under ``placements`` (the ones the step ran with); then reset."""
        counts = self.counts_LE.clone()
        dist.all_reduce(counts, group=group)
        tokens_per_expert = counts.cpu().numpy().astype(np.float64)
        per_rank = np.stack([p.apply_to_tokens_per_expert(loads) for p, loads in zip(placements, tokens_per_expert)])
        loads = StepLoads(step, tokens_per_expert, per_rank, list(self.rows_per_layer),
                          list(self.expert_seconds_per_layer))
        self.reset()
        return loads

    def reset(self) -> None:
        self.counts_LE.zero_()
        self.rows_per_layer = [0] * len(self.layers)
        self.expert_seconds_per_layer = [0.0] * len(self.layers)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
