"""Parallel plan: the layout the planner writes and the runtime reads.

Convention (Megatron, MoE parallel folding): ``world = tp·cp·pp·dp`` for attention and dense parts;
inside each pipeline stage the MoE layers regroup the same ``tp·cp·dp`` ranks as ``ep·etp·edp``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RecomputeLevel = Literal["none", "selective", "full"]


class ParallelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(default=1, gt=0)
    sp: bool = False
    """Sequence parallel (needs tp > 1): norms/dropout regions split along the sequence."""
    pp: int = Field(default=1, gt=0)
    vpp: int = Field(default=1, gt=0)
    """Virtual stages (model chunks) per pipeline rank: the interleaved schedule."""
    ep: int = Field(default=1, gt=0)
    etp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    dp: int = Field(default=1, gt=0)
    zero: int = Field(default=1, ge=0, le=3)
    micro_batch: int = Field(default=1, gt=0)
    recompute: RecomputeLevel = "none"
    a2a: Literal["flat", "hierarchical"] = "flat"
    overlap: bool = False
    """Pair one micro-batch's forward with another's backward so all-to-all hides under compute."""

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the replicas of each expert shard."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)

    @model_validator(mode="after")
    def _divides(self) -> ParallelConfig:
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1 (sequence parallel splits the TP group's activations)")
        ranks_per_stage = self.tp * self.cp * self.dp
        if ranks_per_stage % (self.ep * self.etp):
            raise ValueError(
                f"ep·etp={self.ep * self.etp} must divide tp·cp·dp={ranks_per_stage} "
                "(experts regroup the ranks of one pipeline stage)"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp > 1 needs pp > 1")
        return self
