"""Expert tensor parallelism's activation memory: the bytes autograd keeps for one MoE block at EP2×ETP2
(and EP2×ETP1, same model, same tokens) on 4 gloo ranks, counted by ``measure_saved_bytes``, equal the
activation formula's router, dispatch, expert and shared-expert parts, in fp32 and bf16.

What the runtime keeps at etp 2 that it does not at etp 1 (``moetrain.distributed.etp``): the experts'
first GEMMs keep the ETP group's gathered rows (2·P rows × hidden, where etp 1 keeps the P received
rows); the FFN intermediates are 2·P rows × F/2, as many bytes as P × F; the gather's reorder index and
its inverse (int64, 2·P each); the combine keeps the device's own P output rows, as at etp 1.

The routing is replayed (router replay, ``Router.forward``) so that every rank receives exactly T·k
rows: each token picks two experts on each EP rank's half. The formula's ``imbalance`` is then 1 and the
comparison exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _replayed_block import ReplayedBlock
from torch import nn

from moetrain.balance.placement import ExpertPlacement
from moetrain.config import load_model_config
from moetrain.costs.activations import ActivationShape, Sharding, activation_bytes_per_layer
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, shard_experts
from moetrain.distributed.etp import ExpertTensorParallelDispatcher
from moetrain.distributed.world import spawn
from moetrain.memory.measure import measure_saved_bytes
from moetrain.models.moe import MoE

# tiny-pangu's MoE block (16 experts of width 64, top-4, one shared expert, hidden 128: every GEMM
# width a multiple of 8 at etp 2, so the grouped GEMM kernel runs as on a GPU). Pre-norm: with the
# sandwich norm the post-norm would keep the block's fp32 output, which is not the block's.
MODEL = load_model_config("tiny-pangu").model_copy(update={"norm_style": "pre"})
SEQ, MICRO_BATCH = 32, 2
TOKENS = SEQ * MICRO_BATCH
EP, ETP = 2, 2
DTYPES = {"fp32": (torch.float32, 4.0), "bf16": (torch.bfloat16, 2.0)}


def _balanced_replay(rank: int) -> torch.Tensor:
    """Two experts from each EP rank's half (contiguous placement: experts 0-7 on EP rank 0, 8-15 on 1)."""
    gen = torch.Generator().manual_seed(100 + rank)
    half = MODEL.moe.num_experts // EP
    low = torch.stack([torch.randperm(half, generator=gen)[:2] for _ in range(TOKENS)])
    high = torch.stack([torch.randperm(half, generator=gen)[:2] + half for _ in range(TOKENS)])
    return torch.cat([low, high], dim=1)


def _block(dtype: torch.dtype, etp: int, table: ExpertTable, ep_rank: int, etp_rank: int,
           groups: dict[str, dist.ProcessGroup]) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MODEL.hidden_size, MODEL.moe)
    for param in moe.parameters():
        nn.init.normal_(param, std=0.05)
    moe.experts = shard_experts(moe.experts, table, ep_rank, etp_rank if etp > 1 else 0, etp)
    moe = moe.to(dtype)
    if etp == 1:
        moe.dispatcher = AllToAllDispatcher(groups["ep"], table)
    else:  # as apply_expert_parallel installs it: the count exchange over the EP × ETP ranks
        moe.dispatcher = ExpertTensorParallelDispatcher(AllToAllDispatcher(groups["ep"], table, dist.group.WORLD),
                                                        groups["etp"], table)
    return moe


def _worker(rank: int, world_size: int) -> dict[tuple[str, int], int]:
    # Expert grid [ep, etp] = [2, 2], ETP fastest: rank = ep_rank · 2 + etp_rank. The etp 1 runs use the
    # same EP groups with whole experts.
    torch.set_num_threads(1)
    ep_rank, etp_rank = divmod(rank, ETP)
    ep_groups = [dist.new_group([e * ETP + t for e in range(EP)]) for t in range(ETP)]
    etp_groups = [dist.new_group([e * ETP + t for t in range(ETP)]) for e in range(EP)]
    groups = {"ep": ep_groups[etp_rank], "etp": etp_groups[ep_rank]}
    table = ExpertTable.from_placement(ExpertPlacement.contiguous(MODEL.moe.num_experts, EP))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(MICRO_BATCH, SEQ, MODEL.hidden_size, generator=gen)
    saved: dict[tuple[str, int], int] = {}
    for name, (dtype, _) in DTYPES.items():
        for etp in (1, ETP):
            block = ReplayedBlock(_block(dtype, etp, table, ep_rank, etp_rank, groups), _balanced_replay(rank))
            # the input needs a gradient, as a layer's does: else the dispatch keeps nothing for backward
            saved[name, etp] = measure_saved_bytes(block, x.to(dtype).requires_grad_(True), None)
    return saved


@pytest.fixture(scope="module")
def saved_bytes() -> list[dict[tuple[str, int], int]]:
    return spawn(_worker, EP * ETP)


def _formula(dtype_bytes: float, etp: int) -> float:
    shape = ActivationShape(MODEL, SEQ, MICRO_BATCH, dtype_bytes, sharding=Sharding(ep=EP, etp=etp))
    parts = activation_bytes_per_layer(shape, moe_layer=True)
    return float(parts["router"] + parts["dispatch"] + parts["experts"] + parts["shared_expert"])


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("etp", [1, ETP])
def test_moe_block_keeps_the_formulas_bytes(saved_bytes: list[dict], dtype: str, etp: int) -> None:
    dtype_bytes = DTYPES[dtype][1]
    # The block's input is kept too (by the router's GEMM and the shared expert's), but it is the FFN
    # pre-norm's output, which the formula counts under ffn_norm; the aux loss's scalar sum (4 bytes)
    # is saved by nothing.
    block_input = TOKENS * MODEL.hidden_size * dtype_bytes
    for rank, measured in enumerate(saved_bytes):
        assert measured[dtype, etp] - block_input == _formula(dtype_bytes, etp), (rank, dtype, etp)


@pytest.mark.dist
def test_etp2_keeps_the_gathered_rows(saved_bytes: list[dict]) -> None:
    """The measured growth from etp 1 to 2, tensor by tensor: the gathered input rows (P more rows of
    hidden), the gather's index and inverse (2·P int64 each), with the intermediates unchanged
    (2·P rows × F/2 = P × F). P = T·k = 64·4 = 256 rows per device."""
    rows, hidden = TOKENS * MODEL.moe.router.top_k, MODEL.hidden_size
    for name, (_, dtype_bytes) in DTYPES.items():
        # fp32: 256·128·4 + 2·512·8 = 131,072 + 8,192; bf16: 256·128·2 + 8,192 = 65,536 + 8,192
        growth = rows * hidden * dtype_bytes + 2 * (ETP * rows) * 8
        for measured in saved_bytes:
            assert measured[name, ETP] - measured[name, 1] == growth, name
