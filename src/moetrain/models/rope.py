"""Rotary position embedding (Su et al. 2021), "rotate-half" layout, positions per token.

Positions come per token so that packed documents restart at 0 (see ``positions_from_documents``).
Shapes: ``x_BSND`` = [batch, seq, heads, rotary dims]; ``positions_BS`` = [batch, seq].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetrain.config.model import YarnRopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale_factor(scaling: YarnRopeConfig | None) -> float:
    """Extra factor on the softmax scale under YaRN (1 without it)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_inv_freq(dim: int, theta: float, scaling: YarnRopeConfig | None, device: torch.device) -> tuple[
        torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the factor on cos/sin (YaRN's attention temperature)."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits ``rotations`` times into the original context
        return dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 on fast-rotating dims (kept), 0 on slow ones (interpolated)
    inv_freq = inv_freq / scaling.factor * (1 - extrapolate) + inv_freq * extrapolate
    if scaling.mscale and scaling.mscale_all_dim:
        factor = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    else:
        factor = yarn_mscale(scaling.factor)
    return inv_freq, factor


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding: its base ``theta`` and, for a context extended past training, YaRN's
    ``scaling`` (None: none). Every attention layer of the model rotates with the same one."""

    theta: float
    scaling: YarnRopeConfig | None = None

    def cos_sin(self, positions_BS: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions_BS, dim, self.theta, self.scaling)


def rope_cos_sin(positions_BS: torch.Tensor, dim: int, theta: float,
                 scaling: YarnRopeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [batch, seq, 1, dim] in fp32."""
    inv_freq, factor = rope_inv_freq(dim, theta, scaling, positions_BS.device)
    angles = positions_BS.float().unsqueeze(-1) * inv_freq  # [B, S, dim/2]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


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
