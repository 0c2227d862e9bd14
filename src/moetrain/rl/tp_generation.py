"""A generation model tensor-parallel over a rollout replica's ranks (Megatron's TP without the sequence split).

Each of the replica's T ranks keeps the training runtime's TP share of the weights
(``distributed.tp.shard_tensor_parallel``: 1/T of every attention layer's heads and of every dense FFN's
columns; norms, the latent down-projections, the router, the experts, the embedding and the head whole),
so a weight sync reads its pieces with the rule every layout uses (``placements.local_pieces``: one range
of the split dimension per sharded tensor).

Generation differs from training in one way: every rank of the replica holds all the rows' tokens whole
(decoding adds one token per row, nothing to split along the sequence), so the row-parallel projections
(``o_proj``, the dense ``down``) end in an all-reduce of their partial sums, and the MoE layers, the
norms and the head then compute the same values on every rank (the ranks sample the same tokens in
lockstep, from the same per-sample generators). The KV cache follows the heads: GQA's keys and values
are cached for this rank's kv heads only; MLA caches the per-token latent that every head reads, so each
rank keeps it whole (the heads' up-projections, sharded, apply it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ModelConfig
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import StageModel, chunk_layers
from moetrain.distributed.tp import shard_tensor_parallel
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer, build_model


def check_heads_divide(model_cfg: ModelConfig, tp: int) -> None:
    """A replica of ``tp`` ranks splits the heads (and kv heads) and the dense FFN width over them."""
    attention = model_cfg.attention
    for what, count in (("attention heads", attention.num_heads),
                        ("kv heads", getattr(attention, "num_kv_heads", attention.num_heads)),
                        ("dense FFN columns", model_cfg.dense_ffn_hidden)):
        if count % tp:
            raise UserError(f"rollout replicas of {tp} tensor-parallel ranks split the {what}: {model_cfg.name}'s "
                            f"{count} do not divide by {tp}; give --gen-tp a divisor")


def _sum_partial_outputs(module: nn.Module, group: dist.ProcessGroup) -> None:
    """A row-parallel projection: its output is this rank's partial sum; every rank gets the whole."""
    def hook(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=group)
        return out

    module.register_forward_hook(hook)


def tp_generation_model(model_cfg: ModelConfig, dims: ParallelDims,
                        device: torch.device) -> tuple[MoETransformer, StageModel]:
    """This rank's generation model in the TP layout ``dims`` (its TP group: the replica), and its stage.
    Built from seed 0: every value is overwritten by the first sync (which checks that it is)."""
    tp = dims.parallel.tp
    check_heads_divide(model_cfg, tp)
    model = build_model(model_cfg, device, seed=0).eval()
    kinds = shard_tensor_parallel(model, tp, dims.local_rank("tp"))
    group = dims.get_group("tp")
    for layer in list(model.layers) + [m.layer for m in model.mtp]:
        _sum_partial_outputs(layer.attention.o_proj, group)
        if not layer.is_moe:
            _sum_partial_outputs(layer.ffn.down, group)
    chunks = chunk_layers(model_cfg.num_layers, 1, 1, 0, len(model.mtp))
    return model.requires_grad_(False), StageModel(model, chunks, dims, tp_kinds=kinds)
