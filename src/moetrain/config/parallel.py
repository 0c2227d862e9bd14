"""Parallel plan: the layout the planner writes and the runtime reads.

Convention (Megatron, MoE parallel folding): ``world = tp·cp·pp·dp`` for attention and dense parts;
inside each pipeline stage the MoE layers regroup the same ``tp·cp·dp`` ranks as ``ep·etp·edp``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RecomputeLevel = Literal["none", "selective", "full"]


class ParallelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

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


def runtime_limits(parallel: ParallelConfig, num_layers: int, global_batch: int,
                   ranks_per_node: int | None) -> list[str]:
    """Why the runtime (``moetrain train``) cannot run ``parallel``: one sentence per broken rule, naming the
    dimension and the mend; empty when it runs. The one statement of these rules: the planner ranks only
    layouts for which it is empty (``moetrain.planner.runnable`` is the same rules over arrays) and the
    runtime refuses the others before any rank starts."""
    p = parallel
    limits = []
    chunks = p.pp * p.vpp
    if num_layers < chunks:
        limits.append(f"pp·vpp = {chunks} chunks for {num_layers} layers: every chunk needs a layer; pick pp·vpp "
                      "no larger than the layer count")
    micro_per_replica = global_batch // max(p.dp * p.micro_batch, 1)
    if p.vpp > 1 and micro_per_replica % p.pp:
        limits.append(f"interleaving (vpp {p.vpp}) needs the micro-batches per replica ({micro_per_replica}) to be a "
                      f"multiple of pp {p.pp}: change the micro-batch or vpp")
    if p.tp > 1 and not p.sp:
        limits.append(f"tp {p.tp} without sequence parallelism: the runtime runs tp > 1 with sp only")
    if p.a2a == "hierarchical" and p.ep > 1:
        if p.etp > 1:
            limits.append(f"the hierarchical all-to-all with etp {p.etp}: the runtime runs it with etp 1 only "
                          "(or use the flat all-to-all)")
        if ranks_per_node is not None and p.ep % ranks_per_node and ranks_per_node % p.ep:
            limits.append(f"the hierarchical all-to-all needs each EP group to fill whole nodes or sit inside one: "
                          f"ep {p.ep} with {ranks_per_node} ranks per node does neither")
    if p.zero >= 2 and p.overlap:
        limits.append(f"ZeRO-{p.zero} with the overlapped schedule: the runtime runs ZeRO-2/3 without overlap only "
                      "(use zero 1 to overlap)")
    return limits
