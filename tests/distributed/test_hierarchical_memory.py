"""Expert-parallel activation memory on 4 gloo ranks: what autograd keeps for one MoE block, counted by
``measure_saved_bytes``, equals the activation formula's router, dispatch, expert and shared-expert
parts, in fp32 and bf16, for

- the hierarchical dispatcher (``HierarchicalDispatcher``: 2 nodes × 2 ranks), which keeps other
  tensors than the flat all-to-all: its hop-1 source index, the mask of the assignments each hop-1 row
  carries, the expand order, the expanded rows' source row and gating weight, and the rows the
  combine's first hop returns (one copy, in the activation dtype), in place of the flat dispatch's sort
  order, inverse, gating weights and returned rows. The combine's sums keep no fp32 or weighted copy
  and no second-hop rows (their backward is a gather);
- the flat all-to-all under a skewed routing (one rank receives twice the mean rows, two half of it),
  compared at each rank's measured imbalance: what a rank keeps for its own tokens (sort order,
  inverse, the combine's returned rows) does not grow with the rows it receives.

Routing is replayed (``Router.forward``'s router replay) so that the counts are known exactly.
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
from moetrain.distributed.ep import AllToAllDispatcher, ExpertTable, HierarchicalDispatcher, shard_experts
from moetrain.distributed.world import spawn
from moetrain.memory.measure import measure_saved_bytes
from moetrain.models.moe import MoE

# tiny-pangu's MoE block (16 experts of width 64, top-4, one shared expert, hidden 128), pre-norm (a
# sandwich post-norm would keep the block's fp32 output, which is not the block's).
MODEL = load_model_config("tiny-pangu").model_copy(update={"norm_style": "pre"})
SEQ, MICRO_BATCH = 32, 2
TOKENS = SEQ * MICRO_BATCH
EP, NODES = 4, 2
EXPERTS_PER_RANK = MODEL.moe.num_experts // EP
DTYPES = {"fp32": (torch.float32, 4.0), "bf16": (torch.bfloat16, 2.0)}
SKEWED_RANKS = ((0, 0, 1, 2), (0, 0, 1, 2), (0, 0, 1, 3), (0, 0, 1, 3))
"""Skewed routing: the EP rank of each of a token's 4 experts, by source rank. Every source sends 2·T
rows to rank 0 and T to rank 1; sources 0-1 send T to rank 2, sources 2-3 T to rank 3. Received:
512, 256, 128, 128 rows; mean T·k = 256, so imbalance 2, 1, 0.5, 0.5."""


def _replay(rank: int, ep_ranks: tuple[int, ...]) -> torch.Tensor:
    """[T, 4] experts: for each token, distinct experts on the given EP ranks (contiguous placement)."""
    gen = torch.Generator().manual_seed(100 + rank)
    choices = []
    for _ in range(TOKENS):
        picked = []
        for ep_rank in sorted(set(ep_ranks)):
            count = ep_ranks.count(ep_rank)
            picked += (torch.randperm(EXPERTS_PER_RANK, generator=gen)[:count] + ep_rank * EXPERTS_PER_RANK).tolist()
        choices.append(picked)
    return torch.tensor(choices)


def _block(dtype: torch.dtype, dispatcher: object, table: ExpertTable, rank: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(MODEL.hidden_size, MODEL.moe)
    for param in moe.parameters():
        nn.init.normal_(param, std=0.05)
    moe.experts = shard_experts(moe.experts, table, rank)
    moe = moe.to(dtype)
    moe.dispatcher = dispatcher
    return moe


def _worker(rank: int, world_size: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(case, dtype) → (saved bytes, rows the local experts received)."""
    torch.set_num_threads(1)
    ep_group = dist.group.WORLD
    # node = rank // 2: hop 1 between ranks of one position, hop 2 inside the node
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    table = ExpertTable.from_placement(ExpertPlacement.contiguous(MODEL.moe.num_experts, EP))
    x = torch.randn(MICRO_BATCH, SEQ, MODEL.hidden_size, generator=torch.Generator().manual_seed(rank))
    cases = {
        # one expert on each rank: every token goes to both nodes, two experts in each
        "flat": (lambda: AllToAllDispatcher(ep_group, table), (0, 1, 2, 3)),
        "hierarchical": (lambda: HierarchicalDispatcher(ep_group, intra, inter, table), (0, 1, 2, 3)),
        "skewed": (lambda: AllToAllDispatcher(ep_group, table), SKEWED_RANKS[rank]),
    }
    measured: dict[tuple[str, str], tuple[int, int]] = {}
    for case, (dispatcher, ep_ranks) in cases.items():
        for name, (dtype, _) in DTYPES.items():
            moe = _block(dtype, dispatcher(), table, rank)
            received: list[int] = []
            moe.experts.register_forward_hook(lambda module, args, out, rows=received: rows.append(args[0].shape[0]))
            block = ReplayedBlock(moe, _replay(rank, ep_ranks))
            # the input needs a gradient, as a layer's does: else the dispatch keeps nothing for backward
            nbytes = measure_saved_bytes(block, x.to(dtype).requires_grad_(True), None)
            measured[case, name] = (nbytes, received[0])
    return measured


@pytest.fixture(scope="module")
def measured() -> list[dict[tuple[str, str], tuple[int, int]]]:
    return spawn(_worker, EP)


def _formula(dtype_bytes: float, sharding: Sharding, **load: float) -> float:
    shape = ActivationShape(MODEL, SEQ, MICRO_BATCH, dtype_bytes, sharding=sharding, **load)
    parts = activation_bytes_per_layer(shape, moe_layer=True)
    return float(parts["router"] + parts["dispatch"] + parts["experts"] + parts["shared_expert"])


def _block_input(dtype_bytes: float) -> float:
    # The block's input is kept too (by the router's GEMM and the shared expert's), but it is the FFN
    # pre-norm's output, which the formula counts under ffn_norm.
    return TOKENS * MODEL.hidden_size * dtype_bytes


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_hierarchical_dispatch_keeps_the_formulas_bytes(measured: list[dict], dtype: str) -> None:
    dtype_bytes = DTYPES[dtype][1]
    # every token reaches both nodes: 2 distinct nodes per token (uniform routing would give 1.875)
    hierarchical = Sharding(ep=EP, hierarchical=True, ep_nodes=NODES)
    for rank, by_case in enumerate(measured):
        nbytes, received = by_case["hierarchical", dtype]
        assert received == TOKENS * MODEL.moe.router.top_k
        assert nbytes - _block_input(dtype_bytes) == _formula(dtype_bytes, hierarchical, nodes_per_token=2), rank
        flat_bytes, _ = by_case["flat", dtype]
        assert flat_bytes - _block_input(dtype_bytes) == _formula(dtype_bytes, Sharding(ep=EP)), rank


@pytest.mark.dist
def test_hierarchical_keeps_more_than_flat_tensor_by_tensor(measured: list[dict]) -> None:
    """T = 64 tokens, each to 2 nodes: S = 128 hop-1 rows sent and 128 received per rank; X = 256 rows
    expanded at each peer (T·k); hidden 128, k 4.
    Added: source index 128·8 = 1,024; assignment mask 128·4·1 = 512; expand order 128·4·8 = 4,096;
    expanded rows' source row 256·8 = 2,048 and gating weight 256·4 = 1,024; the rows the first hop
    returns 256·128·d (once: no fp32 copy, no weighted copy, no second-hop rows).
    Gone: the flat sort order and inverse 2·256·8 = 4,096, the combine's gating weights 256·4 = 1,024
    and its returned rows 256·128·d.
    Both dtypes: 1,024 + 512 + 4,096 + 2,048 + 1,024 − 4,096 − 1,024 = 3,584 (the rows cancel). The
    combine that kept index_add's sources and the multiply's fp32 rows grew by 200,192 (fp32) and
    167,424 (bf16)."""
    for rank, by_case in enumerate(measured):
        for dtype, growth in (("fp32", 3_584), ("bf16", 3_584)):
            assert by_case["hierarchical", dtype][0] - by_case["flat", dtype][0] == growth, (rank, dtype)


@pytest.mark.dist
@pytest.mark.parametrize("dtype", DTYPES)
def test_skewed_routing_scales_only_the_received_rows(measured: list[dict], dtype: str) -> None:
    dtype_bytes = DTYPES[dtype][1]
    assigned = TOKENS * MODEL.moe.router.top_k
    assert [by_case["skewed", dtype][1] for by_case in measured] == [512, 256, 128, 128]
    for rank, by_case in enumerate(measured):
        nbytes, received = by_case["skewed", dtype]
        imbalance = received / assigned
        assert nbytes - _block_input(dtype_bytes) == _formula(dtype_bytes, Sharding(ep=EP), imbalance=imbalance), rank


@pytest.mark.dist
def test_the_hot_rank_keeps_more_by_its_received_rows_only(measured: list[dict]) -> None:
    """Rank 0 receives 512 rows where the balanced run's ranks receive 256: 256 more rows, each with
    its reorder index and inverse (2·8), its input row (128·d, kept by the gate and up GEMMs) and its
    gate, up, silu and product (4·64·d); its own 256 assignments keep the same sort order, inverse
    and returned rows. fp32: 256·(16 + 512 + 1,024) = 397,312; bf16: 256·(16 + 256 + 512) = 200,704."""
    for dtype, growth in (("fp32", 397_312), ("bf16", 200_704)):
        assert measured[0]["skewed", dtype][0] - measured[0]["flat", dtype][0] == growth, dtype
