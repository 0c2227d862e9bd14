"""Rotary position embedding (Su et al. 2021), "rotate-half" layout, positions per token.

Positions come per token so that packed documents restart at 0 (see ``positions_from_documents``).
Shapes: ``x_BSND`` = [batch, seq, heads, rotary dims]; ``positions_BS`` = [batch, seq].
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions_BS: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [batch, seq, 1, dim] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions_BS.device, dtype=torch.float32) / dim))
    angles = positions_BS.float().unsqueeze(-1) * inv_freq  # [B, S, dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
    return angles.cos(), angles.sin()


def apply_rope(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x_BSND.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x_BSND.dtype)


def positions_from_documents(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document: index minus the index where its document starts.

    Sync-free (cummax over start indices), so it can run inside a step on any device.
    """
    seq = document_ids_BS.shape[1]
    index = torch.arange(seq, device=document_ids_BS.device).expand_as(document_ids_BS)
    starts = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index
