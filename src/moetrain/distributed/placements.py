"""Where each local tensor of a layout sits in the single-process model: its global pieces.

One rule for every consumer that must address a rank's tensors globally (the DCP checkpoint, the RL
weight sync): a tensor-parallel shard is one slice along its split dimension at ``tp_rank · width``;
an expert-parallel slot is the ``[1, …]`` piece of the logical expert its MoE block's dispatcher table
assigns to it now (after online balancing moved or replicated experts, still by logical expert);
under expert tensor parallelism that piece is further cut along the FFN dimension at
``etp_rank · width``; a replicated tensor is whole (``None``: no pieces, the tensor itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.distributed.parallelize import StageModel
from moetrain.models.transformer import is_routed_expert

Piece = tuple[torch.Size, torch.Tensor]
"""(offsets in the global tensor, the local view holding that region)."""


def local_pieces(stage: StageModel,
                 global_shapes: dict[str, torch.Size]) -> Callable[[str, torch.Tensor], list[Piece] | None]:
    """For a local tensor name and value: its global pieces, or None when it is the whole global tensor."""
    dims = stage.dims
    tp_rank = dims.local_rank("tp") if dims.parallel.tp > 1 else 0
    ep_rank = dims.local_rank("ep") if stage.expert_table is not None else 0
    etp_rank = dims.local_rank("etp") if stage.expert_table is not None else 0

    def pieces(name: str, local: torch.Tensor) -> list[Piece] | None:
        shape = global_shapes[name]
        if stage.expert_table is not None and is_routed_expert(name):
            block = stage.model.get_submodule(name.rsplit(".experts.", 1)[0])
            held = block.dispatcher.table.experts_by_rank[ep_rank]
            # Under ETP a slot holds this rank's slice of the FFN dimension (the one dimension narrower
            # than the global tensor's).
            inner = tuple(etp_rank * local.shape[d] if local.shape[d] != shape[d] else 0 for d in range(1, local.ndim))
            return [(torch.Size((expert, *inner)), local[slot:slot + 1]) for slot, expert in enumerate(held)
                    if expert >= 0]
        if local.shape == shape:
            return None
        split = [d for d in range(local.ndim) if local.shape[d] != shape[d]]
        assert len(split) == 1 and (stage.tp_kinds or {}).get(name) == "sharded", f"{name}: {local.shape} vs {shape}"
        offsets = [0] * local.ndim
        offsets[split[0]] = tp_rank * local.shape[split[0]]
        return [(torch.Size(offsets), local)]

    return pieces
