"""Expert-parallel dispatch across gloo ranks: flat == hierarchical, and both == one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moetrain.balance.placement import ExpertPlacement
from moetrain.distributed.ep import (
    AllToAllDispatcher,
    ExpertTable,
    HierarchicalDispatcher,
    regroup_index,
    shard_experts,
)
from moetrain.distributed.world import spawn
from moetrain.models.dispatch import LocalDispatcher
from moetrain.models.experts import GroupedExperts
from moetrain.models.router import Routing, count_tokens_per_expert

NUM_EXPERTS, TOP_K, HIDDEN, TOKENS = 8, 3, 6, 10


def test_regroup_index_reorders_blocks() -> None:
    # Blocks (a, b) with lengths [[1, 2], [0, 3]] stored a-major; b-major order is (0,0),(1,0),(0,1),(1,1).
    lengths = np.array([[1, 2], [0, 3]])
    assert regroup_index(lengths, (1, 0)).tolist() == [0, 1, 2, 3, 4, 5]
    lengths = np.array([[2, 1], [1, 2]])  # rows: a0b0=[0,1], a0b1=[2], a1b0=[3], a1b1=[4,5]
    assert regroup_index(lengths, (1, 0)).tolist() == [0, 1, 3, 2, 4, 5]


def _routing(rank: int) -> tuple[torch.Tensor, Routing]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    if rank == 1:
        ids[:] = ids[0]  # a skewed rank: every token to the same experts
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    return x, Routing(ids, weights, count_tokens_per_expert(ids, NUM_EXPERTS), torch.zeros(()))


def _dispatch_worker(rank: int, world_size: int) -> dict:
    return {permuted: _dispatch_case(rank, world_size, permuted) for permuted in (False, True)}


def _dispatch_case(rank: int, world_size: int, permuted: bool) -> dict:
    ep_group = dist.new_group(list(range(world_size)))
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    if permuted:  # a non-contiguous home for each expert: the table, not arithmetic, decides
        slots = np.random.default_rng(0).permutation(NUM_EXPERTS).reshape(world_size, -1)
        placement = ExpertPlacement.from_slot_experts(NUM_EXPERTS, slots)
    else:
        placement = ExpertPlacement.contiguous(NUM_EXPERTS, world_size)
    table = ExpertTable.from_placement(placement)
    torch.manual_seed(0)
    full = GroupedExperts(NUM_EXPERTS, HIDDEN, 5)
    torch.nn.init.normal_(full.w_gate_EDF), torch.nn.init.normal_(full.w_up_EDF), torch.nn.init.normal_(full.w_down_EFD)
    local_experts = shard_experts(full, table, rank)
    dispatchers = {
        "flat": AllToAllDispatcher(ep_group, table),
        "hier": HierarchicalDispatcher(ep_group, intra[rank // 2], inter[rank % 2], table),
    }
    out: dict = {}
    for name, dispatcher in dispatchers.items():
        x, routing = _routing(rank)
        x.requires_grad_(True)
        weights = routing.weights_TK.clone().requires_grad_(True)
        routing = Routing(routing.expert_ids_TK, weights, routing.tokens_per_expert_E, routing.aux_loss)
        tokens, per_expert, meta = dispatcher.dispatch(x, routing)
        y = dispatcher.combine(local_experts(tokens, per_expert), meta)
        y.pow(2).sum().backward()
        out[name] = {"tokens": tokens.detach(), "per_expert": per_expert, "y": y.detach(),
                     "x_grad": x.grad, "w_grad": weights.grad}
    # One process, all experts: the reference for this rank's tokens.
    x, routing = _routing(rank)
    x.requires_grad_(True)
    weights = routing.weights_TK.clone().requires_grad_(True)
    routing = Routing(routing.expert_ids_TK, weights, routing.tokens_per_expert_E, routing.aux_loss)
    local = LocalDispatcher()
    tokens, per_expert, meta = local.dispatch(x, routing)
    y = local.combine(full(tokens, per_expert), meta)
    y.pow(2).sum().backward()
    out["local"] = {"y": y.detach(), "x_grad": x.grad, "w_grad": weights.grad}
    return out


@pytest.fixture(scope="module")
def dispatch_results() -> list[dict]:
    return spawn(_dispatch_worker, 4)


@pytest.mark.dist
@pytest.mark.parametrize("permuted", [False, True])
def test_hierarchical_equals_flat_equals_local(dispatch_results: list[dict], permuted: bool) -> None:
    results = [r[permuted] for r in dispatch_results]
    for rank, res in enumerate(results):
        flat, hier, local = res["flat"], res["hier"], res["local"]
        assert torch.equal(flat["tokens"], hier["tokens"]), f"rank {rank}: dispatched tokens differ"
        assert torch.equal(flat["per_expert"], hier["per_expert"])
        for key in ("y", "x_grad", "w_grad"):
            torch.testing.assert_close(flat[key], hier[key], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(flat[key], local[key], rtol=1e-4, atol=1e-4)
    # Every assignment lands somewhere exactly once.
    assert sum(int(r["flat"]["per_expert"].sum()) for r in results) == 4 * TOKENS * TOP_K
