"""Expert migration on a 4-rank gloo world: moves copy every slot bit for bit, replicas' gradients are summed,
and training across a migration gives the same losses as training without one."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, diff  # noqa: E402
from moetrain.balance.solver import PlanRequest, plan_placement  # noqa: E402
from moetrain.distributed.world import spawn  # noqa: E402

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
    from moetrain.distributed.migration import sum_replica_gradients

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


def _worker(rank: int, world_size: int) -> dict:
    from moetrain.distributed.migration import migrate_experts

    tokens, expert_of_token = _routing()
    old = ExpertPlacement.contiguous(NUM_EXPERTS, NUM_RANKS, SLOTS)
    loads = np.bincount(expert_of_token, minlength=NUM_EXPERTS).astype(float)
    new = plan_placement(PlanRequest(loads, NUM_RANKS, SLOTS, "local", current=old))
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
    return {"reference": reference, "migrated": migrated, "before": served_before, "after": served_after}


def test_migration_keeps_training_math():
    results = spawn(_worker, NUM_RANKS)
    reference = np.array(results[0]["reference"])
    migrated = np.array(results[0]["migrated"])
    assert reference[-1] < reference[0]  # it trains
    np.testing.assert_allclose(migrated, reference, rtol=1e-6, atol=0)
    before = [results[r]["before"] for r in range(NUM_RANKS)]
    after = [results[r]["after"] for r in range(NUM_RANKS)]
    assert sum(before) == sum(after) == TOKENS
    assert max(after) < max(before)  # per-rank expert work evens out
    assert max(after) <= TOKENS / NUM_RANKS + 2


def test_shard_segments_cut_at_both_sides_boundaries():
    from moetrain.distributed.migration import shard_segments

    # 10 elements from offset 7 to offset 2, shards of 4: source cuts at 8, 12, 16; destination at 4, 8, 12
    pieces = shard_segments(7, 2, 10, 4)
    assert pieces == [(1, 3, 0, 2, 1), (2, 0, 0, 3, 1), (2, 1, 1, 0, 3), (3, 0, 1, 3, 1), (3, 1, 2, 0, 3),
                      (4, 0, 2, 3, 1)]
    assert sum(p[-1] for p in pieces) == 10
    assert shard_segments(0, 8, 8, 8) == [(0, 0, 1, 0, 8)]  # aligned: one piece


EP_SHARDED, EDP_SHARDED, SLOT_NUMELS = 2, 2, (6, 5)
"""Sharded-state test: 2 EP × 2 EDP ranks, a bucket of two slot-major parameters (3 slots of 6 and of 5
elements, 33 elements, shards of 17) so that slots straddle shard boundaries differently on each side."""


def _bucket_values(ep_rank: int, state: int) -> torch.Tensor:
    """The full flat bucket of one state tensor on one EP rank: values name (state, rank, element)."""
    numel = 3 * sum(SLOT_NUMELS)
    return torch.arange(numel, dtype=torch.float64) + 1000.0 * ep_rank + 1e5 * state


def _sharded_worker(rank: int, world_size: int) -> list[np.ndarray]:
    from moetrain.balance.placement import Move
    from moetrain.distributed.migration import ShardedSlots, post_sharded_moves

    # global rank = edp * EP + ep (the layout's expert grid, [edp, ep])
    edp, ep = divmod(rank, EP_SHARDED)
    numel = 3 * sum(SLOT_NUMELS)
    shard_size = -(-numel // EDP_SHARDED)
    shards = [torch.nn.functional.pad(_bucket_values(ep, k), (0, shard_size * EDP_SHARDED - numel))
              [edp * shard_size:(edp + 1) * shard_size].clone() for k in range(3)]
    # slot 2 of EP rank 0 and slot 0 of EP rank 1 swap places; slot 1 of rank 1 moves to slot 2 of rank 1
    moves = [Move(0, (0, 2), (1, 0)), Move(1, (1, 0), (0, 2)), Move(2, (1, 1), (1, 2))]
    items = [ShardedSlots(moves, 0, SLOT_NUMELS[0], shards, shard_size),
             ShardedSlots(moves, 3 * SLOT_NUMELS[0], SLOT_NUMELS[1], shards, shard_size)]
    before = [s.clone() for s in shards]
    pending = post_sharded_moves(items, ep, edp, lambda e, d: d * EP_SHARDED + e)
    assert all(torch.equal(a, b) for a, b in zip(shards, before))  # nothing lands before finish
    pending.finish()
    return [s.numpy().copy() for s in shards]


def test_sharded_state_moves_piece_by_piece():
    results = spawn(_sharded_worker, 4)
    numel = 3 * sum(SLOT_NUMELS)
    for ep in range(EP_SHARDED):
        for k in range(3):
            got = np.concatenate([results[edp * EP_SHARDED + ep][k] for edp in range(EDP_SHARDED)])[:numel]
            want = _bucket_values(ep, k).numpy().copy()
            sources = {0: {2: (1, 0)}, 1: {0: (0, 2), 2: (1, 1)}}[ep]  # destination slot → (source rank, slot)
            for dst_slot, (src_rank, src_slot) in sources.items():
                offset = 0
                for slot_numel in SLOT_NUMELS:
                    src = _bucket_values(src_rank, k).numpy()[offset + src_slot * slot_numel:][:slot_numel]
                    want[offset + dst_slot * slot_numel:offset + (dst_slot + 1) * slot_numel] = src
                    offset += 3 * slot_numel
            np.testing.assert_array_equal(got, want)


def _ring_worker(rank: int, world_size: int) -> dict:
    from moetrain.distributed.migration import sum_replica_gradients

    # 6 experts on 4 ranks of 3 slots: expert 0 on all four ranks, expert 1 on three, expert 2 on two
    # (rank 2 runs three rings at once, of 4, 3 and 2 replicas); the rest once. Each slot's gradient: a function of
    # (expert, rank), 7 × 5 values, so that chunks of unequal length (35 over 3 or 4) are cut
    table = np.array([[0, 2, 3], [0, 1, 4], [0, 1, 2], [0, 1, 5]])
    placement = ExpertPlacement.from_slot_experts(6, table)
    grads = [torch.zeros(3, 7, 5), torch.zeros(3, 2)]
    for slot, expert in enumerate(table[rank].tolist()):
        generator = torch.Generator().manual_seed(100 * expert + rank)
        grads[0][slot] = torch.randn(7, 5, generator=generator)
        grads[1][slot] = torch.randn(2, generator=generator)
    before = [g.clone() for g in grads]
    sum_replica_gradients(placement, grads)
    return {"table": table, "before": before, "after": grads}


def test_replica_gradients_are_summed_by_a_ring_and_replicas_agree_bit_for_bit():
    results = spawn(_ring_worker, 4)
    table = results[0]["table"]
    for expert in range(6):
        holders = [(rank, slot) for rank in range(4) for slot in range(3) if table[rank, slot] == expert]
        for k in range(2):
            # the sum computed independently, in float64
            expected = sum(results[r]["before"][k][s].double() for r, s in holders)
            got = [results[r]["after"][k][s] for r, s in holders]
            for tensor in got:
                torch.testing.assert_close(tensor.double(), expected, rtol=1e-6, atol=1e-6)
                assert torch.equal(tensor, got[0])  # every replica the same bits
