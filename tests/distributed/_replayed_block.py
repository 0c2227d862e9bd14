"""An MoE block as ``measure_saved_bytes`` takes a model, for the memory tests that count what it keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetrain.models.moe import MoE


@dataclass(frozen=True)
class BlockLoss:
    loss: torch.Tensor


class ReplayedBlock(nn.Module):
    """The MoE block on replayed routing, with a loss that keeps no tensor of its own (a sum), so that
    everything saved is the block's."""

    def __init__(self, moe: MoE, replay_TK: torch.Tensor) -> None:
        super().__init__()
        self.moe, self.replay_TK = moe, replay_TK

    def forward(self, x_BSD: torch.Tensor, labels: object = None) -> BlockLoss:
        out = self.moe(x_BSD, self.replay_TK)
        return BlockLoss(out.out_TD.float().sum() + out.aux_loss)
