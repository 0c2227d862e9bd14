"""Pipeline balance: stage boundaries that even out per-stage time.

The model is a chain of pieces: embedding, the decoder layers (dense leading layers are cheaper than
MoE layers), then the output head with the loss and the multi-token-prediction layers, which share
the head and so stay with it on the last stage. A pipeline of ``pp`` ranks with ``vpp`` virtual
stages each cuts the chain into ``pp·vpp`` contiguous chunks; the schedule runs at the pace of the
slowest chunk, so we minimise the largest chunk time (exact, by dynamic programming over cut points).

Runtimes that want the same number of layers in every stage fill the lighter stages with no-op
(identity) layers: ``StagePlan.noop_layers``.

Per-piece time: forward + backward of one token through it, from the planner's compute model
(GEMM and fused-attention efficiencies) and FLOPs from ``moetrain.costs.flops``; a user may pass
measured per-piece times instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.costs.flops import layer_forward_flops, model_forward_flops
from moetrain.errors import UserError
from moetrain.planner import compute


@dataclass(frozen=True)
class Piece:
    name: str
    seconds: float
    """Forward + backward seconds per token."""
    is_layer: bool
    """A decoder layer (counts toward the per-stage layer count; no-op layers stand in for these)."""


def _seconds(gemm_flops: float, attention_flops: float, cluster: ClusterConfig) -> float:
    forward = compute.gemm_time(gemm_flops, 0, cluster) + compute.attention_time(attention_flops, cluster)
    return 3.0 * float(forward)


def model_pieces(model: ModelConfig, cluster: ClusterConfig, seq_len: int) -> list[Piece]:
    """The chain: embedding, decoder layers, then head with the MTP layers (one piece, last stage)."""
    pieces = [Piece("embedding", 0.0, False)]  # a lookup: no FLOPs (its memory traffic is negligible)
    for index in range(model.num_layers):
        moe_layer = model.is_moe_layer(index)
        flops = layer_forward_flops(model, seq_len, moe_layer=moe_layer, causal=True)
        kind = "moe" if moe_layer else "dense"
        pieces.append(Piece(f"layer{index}:{kind}", _seconds(flops.total - flops.attention_core,
                                                              flops.attention_core, cluster), True))
    whole = model_forward_flops(model, seq_len, causal=True)
    name = "head" + (f"+mtp{model.num_mtp_layers}" if model.num_mtp_layers else "")
    if model.num_mtp_layers:
        mtp_block = layer_forward_flops(model, seq_len, moe_layer=model.moe is not None, causal=True)
        mtp_attention = model.num_mtp_layers * mtp_block.attention_core
        tail = _seconds(whole.head + whole.mtp - mtp_attention, mtp_attention, cluster)
    else:
        tail = _seconds(whole.head, 0.0, cluster)
    pieces.append(Piece(name, tail, False))
    return pieces


@dataclass(frozen=True)
class StagePlan:
    boundaries: tuple[int, ...]
    """Index of the first piece of each stage (stage i = pieces[b_i : b_{i+1}])."""
    stage_seconds: tuple[float, ...]
    stage_layers: tuple[int, ...]
    """Decoder layers per stage."""

    @property
    def max_over_mean(self) -> float:
        mean = float(np.mean(self.stage_seconds))
        return max(self.stage_seconds) / mean if mean > 0 else 1.0

    @property
    def noop_layers(self) -> tuple[int, ...]:
        """Identity layers each stage needs so that all stages have the same layer count."""
        most = max(self.stage_layers)
        return tuple(most - n for n in self.stage_layers)


def _plan_from_cuts(pieces: list[Piece], boundaries: list[int]) -> StagePlan:
    ends = boundaries[1:] + [len(pieces)]
    return StagePlan(
        tuple(boundaries),
        tuple(sum(p.seconds for p in pieces[a:b]) for a, b in zip(boundaries, ends)),
        tuple(sum(p.is_layer for p in pieces[a:b]) for a, b in zip(boundaries, ends)),
    )


def uniform_stages(pieces: list[Piece], num_stages: int) -> StagePlan:
    """The common default: the same number of decoder layers per stage, embedding on the first and
    head (+MTP) on the last; extra layers go to the earliest stages."""
    layer_positions = [i for i, p in enumerate(pieces) if p.is_layer]
    if num_stages > len(layer_positions):
        raise UserError(f"{num_stages} stages exceed the {len(layer_positions)} decoder layers")
    per_stage, extra = divmod(len(layer_positions), num_stages)
    boundaries, taken = [0], 0
    for stage in range(num_stages - 1):
        taken += per_stage + (stage < extra)
        boundaries.append(layer_positions[taken])
    return _plan_from_cuts(pieces, boundaries)


def balance_stages(pieces: list[Piece], num_stages: int) -> StagePlan:
    """Contiguous cut into ``num_stages`` stages (each with at least one decoder layer) minimising the
    largest stage time; among optimal cuts, the latest ones (deterministic)."""
    n = len(pieces)
    layer_count = np.cumsum([0] + [p.is_layer for p in pieces])
    if num_stages < 1 or num_stages > layer_count[-1]:
        raise UserError(f"num_stages={num_stages} must be between 1 and the {layer_count[-1]} decoder layers")
    prefix = np.cumsum([0.0] + [p.seconds for p in pieces])
    inf = float("inf")
    # best[k][j]: smallest max-stage time cutting pieces[:j] into k stages; cut[k][j] the last cut
    best = np.full((num_stages + 1, n + 1), inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(1, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf or layer_count[j] - layer_count[i] < 1:
                    continue
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value <= best[k][j] * (1 + 1e-12):
                    best[k][j], cut[k][j] = value, i
    boundaries = []
    j = n
    for k in range(num_stages, 0, -1):
        boundaries.append(int(cut[k][j]))
        j = int(cut[k][j])
    boundaries.reverse()
    boundaries[0] = 0
    return _plan_from_cuts(pieces, boundaries)
