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

TP×EP (``tp_ep_generation_model``): the same TP share, and the experts split over the E ranks at one TP
position as expert parallelism splits them (``parallelize.apply_expert_parallel``'s flat path: contiguous
blocks of ``experts / E``, the all-to-all over that EP group); the rank grid is ``stalesync_job.pool_layout``'s.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from moetrain.balance.placement import ExpertPlacement
from moetrain.config import ModelConfig
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, shard_experts
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import StageModel, chunk_layers, model_moe_blocks
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


def check_experts_divide(model_cfg: ModelConfig, ep: int) -> None:
    """A replica's E EP ranks split every MoE layer's experts."""
    moe = model_cfg.moe
    if moe is None or moe.num_experts % ep:
        raise UserError(f"rollout replicas of {ep} expert-parallel ranks split the experts over them: "
                        f"{model_cfg.name}'s {moe.num_experts if moe else 0} experts do not divide by {ep}; give "
                        "--gen-ep a divisor")


def tp_generation_model(model_cfg: ModelConfig, dims: ParallelDims,
                        device: torch.device) -> tuple[MoETransformer, StageModel]:
    """This rank's generation model in the TP layout ``dims`` (its TP group: the replica, or one TP group of a
    TP×EP replica, whose experts ``tp_ep_generation_model`` then splits), and its stage.
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


def tp_ep_generation_model(model_cfg: ModelConfig, dims: ParallelDims,
                           device: torch.device) -> tuple[MoETransformer, StageModel]:
    """This rank's generation model in the TP×EP layout ``dims`` (``stalesync_job.pool_layout``: tp = T,
    ep = E, etp = T): its TP range of the heads and dense columns, and ``experts / E`` experts whole, and
    its stage. The experts are split with etp = 1: the etp axis only places the EP groups (the ranks at
    one TP position), which all hold every token, so each keeps its experts whole."""
    ep = dims.parallel.ep
    check_experts_divide(model_cfg, ep)
    assert model_cfg.moe is not None
    model, stage = tp_generation_model(model_cfg, dims, device)
    # apply_expert_parallel's flat path with etp = 1 (it would cut each expert's FFN over the etp axis)
    table = ExpertTable.from_placement(ExpertPlacement.contiguous(model_cfg.moe.num_experts, ep), device=device)
    for block in model_moe_blocks(model):
        block.experts = shard_experts(block.experts, table, dims.local_rank("ep"))
        block.dispatcher = AllToAllDispatcher(dims.get_group("ep"), table)
    return model.requires_grad_(False), replace(stage, expert_table=table)
