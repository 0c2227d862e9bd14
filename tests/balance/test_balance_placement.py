import numpy as np
import pytest

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, Move, diff
from moetrain.errors import UserError


def test_contiguous_layout_and_rank_loads():
    placement = ExpertPlacement.contiguous(8, 4, 3)
    assert placement.num_slots == 12
    assert placement.experts_on_rank(1).tolist() == [2, 3, EMPTY_SLOT]
    assert placement.slot_of_logical().tolist() == [0, 1, 3, 4, 6, 7, 9, 10]
    loads = np.array([10, 0, 5, 5, 1, 1, 0, 2])
    assert placement.apply_to_tokens_per_expert(loads).tolist() == [10, 10, 2, 2]
    assert placement.imbalance(loads) == pytest.approx(10 / 6)


def test_replica_shares_split_tokens_and_dispatch_table():
    # expert 0 on ranks 0 and 1 with shares 0.25 / 0.75
    table = np.array([[0, 1], [2, 0]])
    placement = ExpertPlacement.from_slot_experts(3, table, np.array([[0.25, 1.0], [1.0, 0.75]]))
    assert placement.replicas(0) == [(0, 0), (1, 1)]
    assert placement.num_replicas().tolist() == [2, 1, 1]
    assert placement.apply_to_tokens_per_expert(np.array([100, 10, 20])).tolist() == [35.0, 95.0]
    # batched loads [T, E] → [T, R]
    batched = placement.apply_to_tokens_per_expert(np.array([[100, 10, 20], [0, 0, 4]]))
    assert batched.tolist() == [[35.0, 95.0], [0.0, 4.0]]
    slots, counts, cum_share = placement.logical_to_physical()
    assert slots.tolist() == [[0, 3], [1, -1], [2, -1]]
    assert counts.tolist() == [2, 1, 1]
    assert cum_share[0].tolist() == [0.25, 1.0]


def test_equal_shares_by_default():
    placement = ExpertPlacement.from_slot_experts(2, np.array([[0, 1], [0, EMPTY_SLOT]]))
    assert placement.slot_share.tolist() == [0.5, 1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    ("table", "share", "message"),
    [
        ([[0, 1], [1, EMPTY_SLOT]], None, "expert 2 has no slot; every expert needs at least one replica"),
        ([[0, 0], [1, 2]], None, "rank 0 holds two replicas of one expert; replicas must sit on distinct ranks"),
        ([[0, 1, EMPTY_SLOT], [2, EMPTY_SLOT, 2]], None,
         "rank 1 holds two replicas of one expert; replicas must sit on distinct ranks"),
        ([[0, 1], [2, 7]], None, "placement names expert 7, outside 0..2"),
        ([[0, 1], [2, 0]], [[0.5, 1.0], [1.0, 0.4]], "replica shares of expert 0 sum to 0.9, not 1"),
    ],
)
def test_validation_errors(table, share, message):
    with pytest.raises(UserError) as err:
        ExpertPlacement.from_slot_experts(3, np.array(table), None if share is None else np.array(share))
    assert str(err.value) == message


def test_empty_slots_are_no_replicas():
    placement = ExpertPlacement.from_slot_experts(3, np.array([[0, EMPTY_SLOT, EMPTY_SLOT], [1, 2, EMPTY_SLOT]]))
    assert placement.replicas(2) == [(1, 1)]


def test_too_few_slots():
    with pytest.raises(UserError, match="2 ranks × 1 slots = 2 slots cannot hold 3 experts"):
        ExpertPlacement(3, 2, 1, np.array([0, 1]), np.array([1.0, 1.0]))


def test_tables_are_read_only():
    placement = ExpertPlacement.contiguous(4, 2)
    with pytest.raises(ValueError):
        placement.slot_expert[0] = 3


def _apply_moves(old: ExpertPlacement, moves: list[Move]) -> np.ndarray:
    """What an executor does: read every source first, then write every destination."""
    table = old.slot_expert.reshape(old.num_ranks, old.slots_per_rank)
    reads = [int(table[m.src]) for m in moves]
    new = table.copy()
    for move, expert in zip(moves, reads):
        new[move.dst] = expert
    return new


def test_diff_gives_the_moves_that_build_the_new_placement():
    rng = np.random.default_rng(0)
    old = ExpertPlacement.contiguous(16, 4, 5)
    for _ in range(20):
        flat = np.concatenate([rng.permutation(16), rng.choice(16, size=4, replace=False)])
        table = flat.reshape(4, 5)
        if any(np.unique(row).size < row.size for row in table):
            continue
        new = ExpertPlacement.from_slot_experts(16, table)
        moves = diff(old, new)
        # every move copies the expert the old slot really holds, into a slot that needs it
        assert all(old.slot_expert[m.src[0] * 5 + m.src[1]] == m.expert for m in moves)
        built = _apply_moves(old, moves)
        used = table != EMPTY_SLOT
        assert np.array_equal(built[used], table[used])
        # slots that keep their expert are not touched
        assert len(moves) == int(np.sum(used & (old.slot_expert.reshape(4, 5) != table)))
        old = new


def test_diff_prefers_a_local_source():
    old = ExpertPlacement.from_slot_experts(3, np.array([[0, 1], [2, 0]]))
    new = ExpertPlacement.from_slot_experts(3, np.array([[0, 1], [0, 2]]))
    # rank 1 already holds expert 0 and 2: the moves stay on rank 1
    assert diff(old, new) == [Move(0, (1, 1), (1, 0)), Move(2, (1, 0), (1, 1))]
    assert not any(m.crosses_ranks for m in diff(old, new))
    assert diff(new, new) == []
