"""Apply a parallel layout to a full model: ``parallelize(model, dims) -> StageModel``.

Every rank builds the same full model from the same seed, then keeps and shards its part, so every
layout starts from identical weights. Order (fixed): pipeline split, tensor (+ sequence)
parallelism, expert parallelism (the MoE blocks then run their shared expert under the dispatch),
and for the overlapped schedule experts whose weight gradient is computed apart.

Parameter names stay those of the full model (``layers.5.moe.experts.w_up_EDF``), so checkpoints of
different layouts name the same tensors; ``layers`` becomes a ``ModuleDict`` keyed by the global layer
index (its keys print exactly as the ``ModuleList`` indices did).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from moetrain.balance.placement import ExpertPlacement
from moetrain.distributed.cp import ContextParallel, apply_context_parallel
from moetrain.distributed.ep import (
    AllToAllDispatcher,
    ExpertTable,
    HierarchicalDispatcher,
    shard_experts,
)
from moetrain.distributed.etp import ExpertTensorParallelDispatcher
from moetrain.distributed.layout import ParallelDims, layers_per_chunk
from moetrain.distributed.overlap import SplitGradExperts
from moetrain.distributed.tp import ParamKind, apply_tensor_parallel
from moetrain.models.experts import probe_grouped_mm
from moetrain.models.transformer import MoETransformer


@dataclass(frozen=True)
class Chunk:
    """One pipeline model chunk held by this rank."""

    index: int
    """Global chunk index (0..pp·vpp-1)."""
    layers: tuple[int, ...]
    is_first: bool
    is_last: bool


@dataclass
class StageModel:
    model: MoETransformer
    """The full model with only this rank's parts left in it."""
    chunks: list[Chunk]
    dims: ParallelDims
    expert_table: ExpertTable | None = None
    tp_kinds: dict[str, ParamKind] | None = None
    """Gradient kind of each parameter under tensor parallelism (None when tp = 1)."""
    cp: ContextParallel | None = None
    """How this rank splits and gathers the sequence under context parallelism (None when cp = 1)."""


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int, num_mtp_layers: int = 0) -> list[Chunk]:
    """Rank r holds global chunks r, r+pp, ... (interleaved placement), of consecutive layers split by
    ``layers_per_chunk`` (equal chunks when pp·vpp divides the layer count)."""
    counts = layers_per_chunk(num_layers, pp, vpp, num_mtp_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    chunks = []
    for local in range(vpp):
        index = local * pp + pp_rank
        layers = tuple(range(starts[index], starts[index] + counts[index]))
        chunks.append(Chunk(index, layers, index == 0, index == len(counts) - 1))
    return chunks


def last_stage_holds_embedding(cfg) -> bool:
    """The last pipeline stage keeps a copy of the embedding: MTP looks up future tokens' embeddings, and a
    tied head reads the embedding's weight."""
    return cfg.num_mtp_layers > 0 or cfg.tie_embeddings


def apply_pipeline_split(model: MoETransformer, chunks: list[Chunk]) -> None:
    """Drop what this rank does not compute. The last stage keeps a copy of the embedding when the
    model predicts extra tokens (MTP looks up the embedding of future tokens); its gradient is summed
    with the first stage's over the ``embed`` group, as Megatron does for tied embeddings."""
    kept = {i for chunk in chunks for i in chunk.layers}
    model.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(model.layers) if i in kept})
    has_first = any(c.is_first for c in chunks)
    has_last = any(c.is_last for c in chunks)
    if not has_first and not (has_last and last_stage_holds_embedding(model.cfg)):
        del model.embed
    if not has_last:
        del model.final_norm
        if hasattr(model, "head"):
            del model.head
        model.mtp = nn.ModuleList()


def apply_expert_parallel(model: MoETransformer, dims: ParallelDims,
                          placement: ExpertPlacement | None = None) -> ExpertTable:
    """Keep this rank's expert slots and install the all-to-all dispatcher in every MoE block. With
    expert tensor parallelism each slot keeps this rank's slice of the expert FFN and the dispatcher
    gathers the ETP group's tokens after the all-to-all (``moetrain.distributed.etp``); with ep = 1 the
    model's local dispatcher stays inside that wrapper."""
    parallel = dims.parallel
    assert model.cfg.moe is not None
    placement = placement or ExpertPlacement.contiguous(model.cfg.moe.num_experts, parallel.ep)
    table = ExpertTable.from_placement(placement, device=next(model.parameters()).device)
    ep_rank = dims.local_rank("ep")
    etp_rank = dims.local_rank("etp")
    for block in model_moe_blocks(model):
        block.experts = shard_experts(block.experts, table, ep_rank, etp_rank, parallel.etp)
        if parallel.ep > 1 and parallel.a2a == "hierarchical":
            block.dispatcher = HierarchicalDispatcher(dims.get_group("ep"), dims.get_group("ep_intra"),
                                                      dims.get_group("ep_inter"), table)
        elif parallel.ep > 1:
            count_group = dims.get_group("ep_etp") if parallel.etp > 1 else None
            block.dispatcher = AllToAllDispatcher(dims.get_group("ep"), table, count_group)
        if parallel.etp > 1:
            block.dispatcher = ExpertTensorParallelDispatcher(block.dispatcher, dims.get_group("etp"), table)
    return table


def model_moe_blocks(model: MoETransformer) -> list[nn.Module]:
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    blocks = [layer.moe for layer in layers if layer.is_moe]
    return blocks + [m.layer.moe for m in model.mtp if m.layer.is_moe]


def parallelize(model: MoETransformer, dims: ParallelDims, placement: ExpertPlacement | None = None) -> StageModel:
    parallel = dims.parallel
    chunks = chunk_layers(model.cfg.num_layers, parallel.pp, parallel.vpp, dims.pp_rank, len(model.mtp))
    apply_pipeline_split(model, chunks)
    tp_kinds = apply_tensor_parallel(model, dims.get_group("tp")) if parallel.tp > 1 else None
    cp = apply_context_parallel(model, dims)
    table = apply_expert_parallel(model, dims, placement) if parallel.ep * parallel.etp > 1 else None
    if parallel.overlap:
        for block in model_moe_blocks(model):
            SplitGradExperts.adopt(block.experts)
    return StageModel(model, chunks, dims, table, tp_kinds, cp)


def apply_compile(model: MoETransformer, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer this rank holds (MTP modules' layers too), in place, as
    torchtitan does per transformer block: each layer's norms, rotary, router scoring, permutation and
    SwiGLU fuse into a few kernels, and the layers share one compiled graph (same code, parameters as
    inputs). Expert-parallel exchanges, whose split sizes the host reads, are kept out of the graph
    (``eager_only`` on the dispatchers); at EP = 1 a layer compiles whole. ``backend``: torch's
    compiler backend, ``aot_eager`` or ``eager`` to tell a fault of Inductor's kernels from one of the
    tracing (``benchmarks/compiled_grad_check.py``). Returns the number of layers compiled."""
    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    layers += [module.layer for module in model.mtp]
    probe_grouped_mm(next(model.parameters()).device)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def compile_events() -> int:
    """How much compiling torch has done in this process so far: Dynamo's graphs (recompiles included),
    AOTAutograd's forward and backward graphs, Inductor's. A step during which this grows spent part of its
    time compiling (a new shape, a new mask: not only the first step), so throughput leaves it out
    (``train.metrics.summary_table``). 0 while the compiler is not loaded: nothing has compiled."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if dynamo_utils is None:
        return 0
    return sum(sum(group.values()) for group in dynamo_utils.counters.values())
