"""SwiGLU feed-forward blocks: a dense one, and E experts computed by grouped GEMMs.

``GroupedExperts`` stores each projection stacked over experts (``w_gate_EDF`` [E, D, F], ``w_up_EDF``,
``w_down_EFD`` [E, F, D]) and runs one grouped GEMM per projection over tokens already sorted by
expert (see ``dispatch.permute``). On GPUs with ``torch.nn.functional.grouped_mm`` (bf16, SM ≥ 9.0)
the group sizes stay on the device; elsewhere an exact per-expert loop is used, which reads the
group sizes on the host once per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedSiLU(nn.Module):
    """silu(gate) · up: the SwiGLU activation, a module of its own so the memory policy can recompute
    its output instead of saving it (``moetrain.memory``)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)) (Shazeer 2020)."""

    def __init__(self, hidden: int, ffn_hidden: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False, device=device)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False, device=device)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False, device=device)
        self.act = GatedSiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


def _native_grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and hasattr(F, "grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and x.dtype == torch.bfloat16
        and w.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
    )


def grouped_mm(x_PK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """Row block e of ``x`` (``tokens_per_expert[e]`` rows, blocks in expert order) times ``w[e]``."""
    if torch.is_autocast_enabled(x_PK.device.type):
        dtype = torch.get_autocast_dtype(x_PK.device.type)
        x_PK, w_EKN = x_PK.to(dtype), w_EKN.to(dtype)
    if _native_grouped_mm_ok(x_PK, w_EKN):
        offsets = torch.cumsum(tokens_per_expert_E, dim=0).to(torch.int32)
        return F.grouped_mm(x_PK, w_EKN, offs=offsets)
    blocks = torch.split(x_PK, tokens_per_expert_E.tolist())
    # unbind, not w[e]: the backward of E separate selects would add E full-size zero gradients
    outs = [block @ w_KN for block, w_KN in zip(blocks, w_EKN.unbind(0))]
    return torch.cat(outs) if outs else x_PK.new_zeros(0, w_EKN.shape[-1])


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, device=device))
        self.w_up_EDF = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, device=device))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, device=device))
        self.act = GatedSiLU()

    def forward(self, tokens_PD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        gate = grouped_mm(tokens_PD, self.w_gate_EDF, tokens_per_expert_E)
        up = grouped_mm(tokens_PD, self.w_up_EDF, tokens_per_expert_E)
        return grouped_mm(self.act(gate, up), self.w_down_EFD, tokens_per_expert_E)
