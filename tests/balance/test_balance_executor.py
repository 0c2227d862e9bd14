"""Executor on a 4-rank gloo world: moves copy every slot bit for bit, replicas' gradients are summed,
and training across a migration gives the same losses as training without one."""

import os
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, diff  # noqa: E402
from moetrain.balance.solver import plan_placement  # noqa: E402

NUM_EXPERTS, NUM_RANKS, SLOTS, HIDDEN, TOKENS = 8, 4, 3, 6, 96
pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _expert_init(expert: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + expert)
    return torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.3


def _slot_state(placement: ExpertPlacement, rank: int) -> list[torch.Tensor]:
    """[S, H, H] weights, Adam m and v; empty slots hold NaN (must never be read)."""
    weights = torch.full((SLOTS, HIDDEN, HIDDEN), float("nan"))
    for slot, expert in enumerate(placement.experts_on_rank(rank).tolist()):
        if expert != EMPTY_SLOT:
            weights[slot] = _expert_init(expert)
    return [weights, torch.zeros_like(weights).nan_to_num(), torch.zeros_like(weights).nan_to_num()]


def _routing() -> tuple[torch.Tensor, np.ndarray]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randn(TOKENS, HIDDEN, generator=generator)
    # skewed router: experts 0 and 1 (both on rank 0 in the contiguous layout) take most tokens
    probabilities = np.array([0.35, 0.25, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05])
    expert_of_token = np.random.default_rng(3).choice(NUM_EXPERTS, size=TOKENS, p=probabilities)
    return tokens, expert_of_token


def _served_tokens(placement: ExpertPlacement, expert_of_token: np.ndarray, rank: int) -> dict[int, np.ndarray]:
    """Local slot → token indices it computes: an expert's tokens split over its replicas by share."""
    served: dict[int, np.ndarray] = {}
    for expert in range(NUM_EXPERTS):
        ids = np.flatnonzero(expert_of_token == expert)
        start = 0
        holders = placement.replicas(expert)
        for position, (holder_rank, slot) in enumerate(holders):
            share = placement.slot_share[holder_rank * SLOTS + slot]
            stop = ids.size if position == len(holders) - 1 else start + int(round(share * ids.size))
            if holder_rank == rank:
                served[slot] = ids[start:stop]
            start = stop
    return served


def _train_step(placement, state, tokens, expert_of_token, rank, step) -> float:
    from moetrain.balance.executor import sum_replica_gradients

    weights, exp_avg, exp_avg_sq = state
    leaf = weights.clone().requires_grad_(True)
    partial = torch.zeros(())
    for slot, ids in _served_tokens(placement, expert_of_token, rank).items():
        out = torch.tanh(tokens[ids] @ leaf[slot])
        partial = partial + (out - 0.5).pow(2).sum() / TOKENS
    partial.backward()
    grad = torch.nan_to_num(leaf.grad)
    sum_replica_gradients(placement, [grad])
    loss = partial.detach().clone()
    dist.all_reduce(loss)
    with torch.no_grad():  # Adam, lr 1e-2, on the used slots
        used = torch.tensor([e != EMPTY_SLOT for e in placement.experts_on_rank(rank).tolist()])
        exp_avg[used] = 0.9 * exp_avg[used] + 0.1 * grad[used]
        exp_avg_sq[used] = 0.999 * exp_avg_sq[used] + 0.001 * grad[used] ** 2
        update = (exp_avg[used] / (1 - 0.9**step)) / ((exp_avg_sq[used] / (1 - 0.999**step)).sqrt() + 1e-8)
        weights[used] -= 1e-2 * update
    return float(loss)


def _worker(rank: int, init_file: str, results: dict) -> None:
    from moetrain.balance.executor import migrate_experts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=NUM_RANKS)
    tokens, expert_of_token = _routing()
    old = ExpertPlacement.contiguous(NUM_EXPERTS, NUM_RANKS, SLOTS)
    loads = np.bincount(expert_of_token, minlength=NUM_EXPERTS).astype(float)
    new = plan_placement(loads, NUM_RANKS, SLOTS, "local", current=old)
    assert new.num_replicas().max() > 1  # the hot expert is replicated

    # 1. moves copy every slot exactly
    state = _slot_state(old, rank)
    migrate_experts(diff(old, new), state)
    for slot, expert in enumerate(new.experts_on_rank(rank).tolist()):
        if expert != EMPTY_SLOT:
            assert torch.equal(state[0][slot], _expert_init(expert)), (rank, slot, expert)

    # 2. training: 2 steps, migrate, 3 steps  vs  5 steps without migration
    reference_state, migrated_state = _slot_state(old, rank), _slot_state(old, rank)
    reference = [_train_step(old, reference_state, tokens, expert_of_token, rank, s) for s in range(1, 6)]
    migrated = [_train_step(old, migrated_state, tokens, expert_of_token, rank, s) for s in range(1, 3)]
    migrate_experts(diff(old, new), migrated_state)
    migrated += [_train_step(new, migrated_state, tokens, expert_of_token, rank, s) for s in range(3, 6)]
    served_before = sum(ids.size for ids in _served_tokens(old, expert_of_token, rank).values())
    served_after = sum(ids.size for ids in _served_tokens(new, expert_of_token, rank).values())
    results[rank] = {"reference": reference, "migrated": migrated, "before": served_before, "after": served_after}
    dist.destroy_process_group()


def test_migration_keeps_training_math():
    with tempfile.TemporaryDirectory() as folder:
        manager = mp.Manager()
        results = manager.dict()
        # fork: the ranks inherit the imported modules (CPU only, no CUDA state to share)
        mp.start_processes(_worker, args=(os.path.join(folder, "init"), results), nprocs=NUM_RANKS, join=True,
                           start_method="fork")
        results = dict(results)
    reference = np.array(results[0]["reference"])
    migrated = np.array(results[0]["migrated"])
    assert reference[-1] < reference[0]  # it trains
    np.testing.assert_allclose(migrated, reference, rtol=1e-6, atol=0)
    before = [results[r]["before"] for r in range(NUM_RANKS)]
    after = [results[r]["after"] for r in range(NUM_RANKS)]
    assert sum(before) == sum(after) == TOKENS
    assert max(after) < max(before)  # per-rank expert work evens out
    assert max(after) <= TOKENS / NUM_RANKS + 2
