import itertools

import numpy as np
import pytest

from moetrain.balance.placement import ExpertPlacement, diff
from moetrain.balance.solver import (
    PlanRequest,
    align_to,
    bridge_replicas,
    group_replicas_by_node,
    optimal_shares,
    plan_placement,
    replica_counts,
    replicate_hot,
    rings_cross_nodes,
    solve_milp,
)
from moetrain.balance.traces import TraceShape, zipf_trace
from moetrain.errors import UserError

ONE_STEP_256_ON_32 = TraceShape(1, 1, 256, 32, 32 * 8192, 8)
"""One step, one layer: 256 experts (top-8) over 32 ranks, 8192 tokens per rank."""


def _busiest_over_even(placement: ExpertPlacement, loads: np.ndarray) -> float:
    return float(placement.apply_to_tokens_per_expert(loads).max() / (loads.sum() / placement.num_ranks))


def test_replica_counts_stop_at_even_share():
    loads = np.array([60.0, 10, 10, 10, 5, 5])  # even share over 3 ranks: 33.3
    assert replica_counts(loads, 3, budget=6).tolist() == [2, 1, 1, 1, 1, 1]
    assert replica_counts(loads, 3, budget=6, stop_at_even=False).sum() == 12
    assert replica_counts(loads, 3, budget=0).tolist() == [1] * 6


def test_optimal_shares_balance_a_replicated_expert():
    # expert 0 (load 100) on both ranks; rank 0 also has expert 1 (load 40)
    table = np.array([[0, 1], [0, 2]])
    share = optimal_shares(table, np.array([100.0, 40.0, 0.0]))
    # even: 70 per rank → rank 0 serves 30 of expert 0, rank 1 serves 70
    assert share.tolist() == pytest.approx([0.3, 1.0, 0.7, 1.0])


def test_remembered_shares_are_the_callers_own():
    """A table met again under the same loads gets its shares from memory: equal to the first answer, and
    a copy that the caller may change without changing what the next caller gets."""
    table, loads = np.array([[0, 1], [0, 2]]), np.array([100.0, 40.0, 0.0])
    first = optimal_shares(table, loads)
    first[:] = -1.0
    assert optimal_shares(table, loads).tolist() == pytest.approx([0.3, 1.0, 0.7, 1.0])
    assert optimal_shares(table, np.array([100.0, 0.0, 40.0])).tolist() == pytest.approx([0.7, 1.0, 0.3, 1.0])


@pytest.mark.parametrize("solver", ["greedy", "local"])
def test_uniform_loads_balance_perfectly(solver):
    loads = np.full(64, 100.0)
    placement = plan_placement(PlanRequest(loads, 8, 9, solver))
    assert _busiest_over_even(placement, loads) == pytest.approx(1.0)


@pytest.mark.parametrize("solver", ["greedy", "local"])
def test_skewed_loads_come_close_to_even(solver):
    loads = zipf_trace(ONE_STEP_256_ON_32, exponent=1.0, seed=3).tokens_per_expert[0, 0].astype(float)
    contiguous = ExpertPlacement.contiguous(256, 32, 9)
    assert _busiest_over_even(contiguous, loads) > 4.0
    placement = plan_placement(PlanRequest(loads, 32, 9, solver))
    assert _busiest_over_even(placement, loads) < (1.01 if solver == "local" else 1.05)
    assert placement.num_replicas().sum() <= 32 * 9


def _brute_force_no_replicas(loads: np.ndarray, ranks: int, slots: int) -> float:
    best = np.inf
    for assignment in itertools.product(range(ranks), repeat=loads.size):
        counts = np.bincount(assignment, minlength=ranks)
        if counts.max() <= slots:
            best = min(best, np.bincount(assignment, weights=loads, minlength=ranks).max())
    return float(best)


def test_milp_matches_brute_force_and_beats_or_equals_heuristics():
    loads = np.array([9.0, 7, 6, 5, 4, 4, 3, 2])
    ranks, slots = 3, 3
    optimal = _brute_force_no_replicas(loads, ranks, slots)
    # 9 slots for 8 experts: the MILP may add one replica; without it it must reach brute force
    exact = solve_milp(loads, ranks, slots, max_replicas=loads.size)
    assert exact.apply_to_tokens_per_expert(loads).max() == pytest.approx(optimal)
    with_replica = solve_milp(loads, ranks, slots)
    assert with_replica.apply_to_tokens_per_expert(loads).max() <= optimal + 1e-9
    for solver in ("greedy", "local"):
        heuristic = plan_placement(PlanRequest(loads, ranks, slots, solver))
        assert heuristic.apply_to_tokens_per_expert(loads).max() >= with_replica.apply_to_tokens_per_expert(
            loads).max() - 1e-6


def test_align_keeps_experts_in_place():
    loads = zipf_trace(TraceShape(1, 1, 32, 4, 4096, 4), seed=0).tokens_per_expert[0, 0].astype(float)
    placement = plan_placement(PlanRequest(loads, 4, 9, "local"))
    # a relabelled copy of the same layout needs no move once aligned
    shuffled = ExpertPlacement.from_slot_experts(
        32, placement.slot_expert.reshape(4, 9)[[2, 0, 3, 1]][:, ::-1],
        placement.slot_share.reshape(4, 9)[[2, 0, 3, 1]][:, ::-1])
    assert diff(placement, align_to(shuffled, placement)) == []
    assert len(diff(placement, shuffled)) > 0


def test_align_by_node_keeps_node_mates_together_and_keeps_the_most_experts():
    import itertools

    # 8 experts on 4 ranks, 2 ranks per node; the new plan replicates expert 0 on ranks 0 and 1 (one node)
    current = ExpertPlacement.from_slot_experts(8, np.array([[0, 1, 6], [2, 3, 7], [4, 5, -1], [0, 6, -1]]))
    new = ExpertPlacement.from_slot_experts(8, np.array([[0, 4, 6], [0, 5, 7], [1, 2, -1], [3, -1, -1]]))
    aligned = align_to(new, current, ranks_per_node=2)
    table = aligned.slot_expert.reshape(4, 3)
    rank_of = {tuple(sorted(set(row.tolist()) - {-1})): r for r, row in enumerate(table)}
    mapped = [rank_of[tuple(sorted(set(row.tolist()) - {-1}))] for row in new.slot_expert.reshape(4, 3)]
    assert mapped[0] // 2 == mapped[1] // 2 and mapped[2] // 2 == mapped[3] // 2  # node mates stay mates
    # kept experts, against every node-preserving relabelling by brute force
    old_sets = [set(row.tolist()) - {-1} for row in current.slot_expert.reshape(4, 3)]
    new_sets = [set(row.tolist()) - {-1} for row in new.slot_expert.reshape(4, 3)]
    best = max(sum(len(new_sets[r] & old_sets[perm[r]]) for r in range(4))
               for perm in itertools.permutations(range(4))
               if perm[0] // 2 == perm[1] // 2 and perm[2] // 2 == perm[3] // 2)
    assert sum(len(new_sets[r] & old_sets[mapped[r]]) for r in range(4)) == best
    loads = np.arange(1.0, 9.0)  # the same layout, relabelled: every rank's load moves with it
    np.testing.assert_allclose(aligned.apply_to_tokens_per_expert(loads)[mapped], new.apply_to_tokens_per_expert(loads))


def test_warm_start_moves_few_experts():
    trace = zipf_trace(TraceShape(2, 1, 256, 32, 32 * 8192, 8), exponent=0.6, seed=5)
    first = plan_placement(PlanRequest(trace.tokens_per_expert[0, 0].astype(float), 32, 9, "local"))
    # the next step's noisy loads: the plan stays close to the current one
    loads = trace.tokens_per_expert[1, 0].astype(float)
    def score(p: ExpertPlacement) -> float:  # busiest rank plus a price per move, as the replay's score
        return _busiest_over_even(p, loads) + 1e-3 * len(diff(first, p))
    second = plan_placement(PlanRequest(loads, 32, 9, "local", current=first), score)
    assert len(diff(first, second)) < 32
    assert _busiest_over_even(second, loads) < 1.02


def test_bad_inputs():
    with pytest.raises(UserError, match="unknown solver 'ilp'; choose one of: greedy, local, milp"):
        plan_placement(PlanRequest(np.ones(8), 4, 2, "ilp"))
    with pytest.raises(UserError, match="use --slots-per-rank >= 3"):
        plan_placement(PlanRequest(np.ones(9), 4, 2))


def test_bridging_pairs_ranks_inside_a_node_when_asked():
    # 4 ranks of 2 slots (one expert and a spare each), 2 ranks per node: ranks 0-1 and 2-3.
    # Loads 10, 2, 1, 7 (mean 5). Heavy ranks 0 and 3, light ranks 2 (1) and 1 (2), lightest first.
    loads = np.array([10.0, 2.0, 1.0, 7.0])
    placement = ExpertPlacement.contiguous(4, 4, 2)
    anywhere = bridge_replicas(placement, loads)
    # heaviest with lightest: expert 0 onto rank 2 (11 split 5.5/5.5), expert 3 onto rank 1 (9, at most
    # 5.5 on either: the LP minimises the busiest rank only)
    assert [r for r, _ in anywhere.replicas(0)] == [0, 2] and [r for r, _ in anywhere.replicas(3)] == [1, 3]
    per_rank = anywhere.apply_to_tokens_per_expert(loads)
    np.testing.assert_allclose(per_rank[[0, 2]], [5.5, 5.5], atol=1e-9)
    assert per_rank.max() == pytest.approx(5.5) and per_rank.sum() == pytest.approx(20.0)
    local = bridge_replicas(placement, loads, ranks_per_node=2)
    # each heavy rank with the light rank of its own node: expert 0 onto rank 1 (12: 6/6), 3 onto 2 (8)
    assert [r for r, _ in local.replicas(0)] == [0, 1] and [r for r, _ in local.replicas(3)] == [2, 3]
    per_rank = local.apply_to_tokens_per_expert(loads)
    np.testing.assert_allclose(per_rank[[0, 1]], [6.0, 6.0], atol=1e-9)
    assert per_rank.max() == pytest.approx(6.0) and per_rank.sum() == pytest.approx(20.0)


def test_grouping_gathers_each_replicated_experts_ranks_into_one_node():
    # 8 ranks of 2 slots, 4 ranks per node (ranks 0-3, 4-7), experts 0-7 one per rank, 8 spare slots.
    # Expert 0 (rank 0) has a replica on rank 5 and expert 2 (rank 2) replicas on ranks 6 and 7: both
    # rings cross the node boundary. Linked ranks: {0, 5} and {2, 6, 7}, the other three stand alone.
    table = np.array([[0, -1], [1, -1], [2, -1], [3, -1], [4, -1], [5, 0], [6, 2], [7, 2]])
    placement = ExpertPlacement.from_slot_experts(8, table)
    loads = np.array([8.0, 3.0, 9.0, 2.0, 5.0, 1.0, 4.0, 6.0])
    grouped = group_replicas_by_node(placement, ranks_per_node=4)
    for expert in (0, 2):
        nodes = {rank // 4 for rank, _ in grouped.replicas(expert)}
        assert len(nodes) == 1, (expert, grouped.replicas(expert))
    assert [len(grouped.replicas(e)) for e in range(8)] == [2, 1, 3, 1, 1, 1, 1, 1]
    # ranks are only relabelled: the same multiset of per-rank loads (expert 0 is 4 + 4 on its two ranks,
    # expert 2 is 3 + 3 + 3 on its three: equal shares by default), by hand
    by_hand = sorted([4.0, 3.0, 3.0, 2.0, 5.0, 1.0 + 4.0, 4.0 + 3.0, 6.0 + 3.0])
    np.testing.assert_allclose(sorted(grouped.apply_to_tokens_per_expert(loads)), by_hand)
    np.testing.assert_allclose(sorted(placement.apply_to_tokens_per_expert(loads)), by_hand)
    # the largest component (3 ranks) and the pair cannot share a 4-rank node: 3 + 1 single, 2 + 2 singles
    linked = {rank for expert in (0, 2) for rank, _ in grouped.replicas(expert)}
    assert sorted(sum(rank // 4 == node for rank in linked) for node in range(2)) == [2, 3]
    # nothing replicated, or one node only: unchanged
    plain = ExpertPlacement.contiguous(8, 8, 2)
    assert group_replicas_by_node(plain, 4) is plain
    assert group_replicas_by_node(placement, 8) is placement


def test_grouping_moves_the_replicas_all_reduce_onto_the_in_node_links():
    from moetrain.balance.costs import BalanceCostModel
    from moetrain.config import load_cluster_config, load_model_config
    from moetrain.costs.params import moe_block_params
    from moetrain.planner import comm

    model = load_model_config("pangu-ultra-moe-718b")
    model = model.model_copy(update={"moe": model.moe.model_copy(update={"num_experts": 64})})
    costs = BalanceCostModel(model, load_cluster_config("atlas-800t-a2"), 16)  # 2 nodes of 8 NPUs
    table = np.full((16, 5), -1)
    table[:, :4] = np.arange(64).reshape(16, 4)
    table[9, 4] = 0  # expert 0 (rank 0, node 0) replicated on rank 9 (node 1)
    table[10, 4] = 4  # expert 4 (rank 1, node 0) replicated on rank 10 (node 1)
    placement = ExpertPlacement.from_slot_experts(64, table)
    grad = moe_block_params(model)[1] / 64 * 4  # fp32 gradient of one expert
    # before: each ring of two sends one gradient each way over the network
    # (two rounds of a ring of two: the message's latency and one more)
    lat_in, lat_across = costs.cluster.intra_node_latency_us * 1e-6, costs.cluster.inter_node_latency_us * 1e-6
    assert costs.replica_sync_seconds(placement) == pytest.approx(
        float(comm.p2p_time(grad, True, costs.cluster)) + lat_across)
    grouped = group_replicas_by_node(placement, 8)
    # after: both rings inside a node, one gradient per rank over the in-node link
    assert costs.replica_sync_seconds(grouped) == pytest.approx(float(comm.p2p_time(grad, False, costs.cluster))
                                                                 + lat_in)
    loads = np.arange(1.0, 65.0)
    np.testing.assert_allclose(np.sort(grouped.apply_to_tokens_per_expert(loads)),
                               np.sort(placement.apply_to_tokens_per_expert(loads)))
    # the planner offers the grouped layout and its cost model (sync included) prefers it
    current = placement
    best = plan_placement(PlanRequest(loads, 16, 5, current=current, ranks_per_node=8),
                          lambda p: float(costs.layer_seconds(p, loads)))
    assert float(costs.layer_seconds(best, loads)) <= float(costs.layer_seconds(grouped, loads)) + 1e-12


def test_shares_leave_the_ranks_that_do_not_decide_the_maximum_at_or_below_the_mean():
    # 3 ranks of 2 slots; expert 0 (12 tokens) on ranks 0 and 1, expert 2 (3) on rank 1, expert 1 (15) alone
    # on rank 2: the busiest rank is rank 2 at 15 whatever the shares, so every split s of expert 0 with
    # 12·s <= 15 and 3 + 12·(1 − s) <= 15 is a least maximum. The mean is 30 / 3 = 10: both linked ranks
    # get to it or below exactly when 12·s <= 10 and 15 − 12·s <= 10, i.e. 5/12 <= s <= 5/6.
    table = np.array([[0, -1], [0, 2], [1, -1]])
    loads = np.array([12.0, 15.0, 3.0])
    share = optimal_shares(table, loads, settle=True)
    s = share[0]
    assert 5 / 12 - 1e-9 <= s <= 5 / 6 + 1e-9
    assert share[2] == pytest.approx(1.0 - s) and share[3] == 1.0 and share[4] == 1.0
    per_rank = ExpertPlacement.from_slot_experts(3, table, share.reshape(3, 2)).apply_to_tokens_per_expert(loads)
    assert per_rank.max() == pytest.approx(15.0) and per_rank[:2].max() <= 10.0 + 1e-9


def test_spread_bridging_partners_ranks_outside_the_rings_first():
    # 6 ranks of 3 slots. Expert 0 (8 tokens) is split 4 / 4 over ranks 0 and 3 (one ring). Rank loads:
    # 7, 12, 5, 4.5, 8, 6 (mean 42.5 / 6 = 7.08): heavy ranks 1 and 4, light ranks 3, 2, 5, 0 (lightest
    # first), of which 3 and 0 are in expert 0's ring.
    loads = np.array([8.0, 3.0, 9.0, 5.0, 3.0, 0.5, 8.0, 6.0])
    table = np.array([[0, 1, -1], [2, 4, -1], [3, -1, -1], [0, 5, -1], [6, -1, -1], [7, -1, -1]])
    share = np.where(table == 0, 0.5, np.where(table >= 0, 1.0, 0.0))
    placement = ExpertPlacement.from_slot_experts(8, table, share)
    plain = bridge_replicas(placement, loads)
    spread = bridge_replicas(placement, loads, spread=True)

    def rings_per_rank(p):
        return [sum(1 for e in set(p.slot_expert[3 * r:3 * r + 3].tolist()) if e >= 0 and p.num_replicas()[e] > 1)
                for r in range(6)]

    # plain: rank 1 with rank 3 (expert 2 onto it: rank 3 now in two rings), rank 4 with rank 2 (expert 6)
    assert [r for r, _ in plain.replicas(2)] == [1, 3] and [r for r, _ in plain.replicas(6)] == [2, 4]
    assert rings_per_rank(plain) == [1, 1, 1, 2, 1, 0]
    # spread: rank 1 with rank 2, rank 4 with rank 5, the ranks outside rings: no rank in two rings
    assert [r for r, _ in spread.replicas(2)] == [1, 2] and [r for r, _ in spread.replicas(6)] == [4, 5]
    assert rings_per_rank(spread) == [1, 1, 1, 1, 1, 1]
    # by hand: plain links ranks 0, 1, 3 (experts 0, 2: 8 + 3 + 9 + 3 + 0.5 = 23.5 over three ranks) and
    # 2, 4 (13 over two); spread links 1, 2 (17 over two), 4, 5 (14) and 0, 3 (11.5)
    assert plain.apply_to_tokens_per_expert(loads).max() == pytest.approx(23.5 / 3)
    assert spread.apply_to_tokens_per_expert(loads).max() == pytest.approx(8.5)


def test_replica_counts_keep_each_expert_within_max_replicas():
    loads = np.array([10.0, 1, 1, 1])
    # uncapped, the 5 extra replicas go to the largest per-replica load: expert 0 at 10, 5, 3.33 (then it is
    # on all 4 ranks), then experts 1 and 2 at 1 each
    assert replica_counts(loads, 4, budget=5, stop_at_even=False).tolist() == [4, 2, 2, 1]
    # at most 2 replicas each: expert 0 once (10 → 5), then experts 1, 2, 3; the fifth replica has nowhere to go
    assert replica_counts(loads, 4, budget=5, stop_at_even=False, max_replicas=2).tolist() == [2, 2, 2, 2]
    assert replica_counts(loads, 4, budget=5, stop_at_even=False, max_replicas=1).tolist() == [1, 1, 1, 1]


def test_rings_cross_nodes_when_an_experts_replicas_sit_in_two_nodes():
    # 4 ranks of 2 slots, nodes {0, 1} and {2, 3}; expert 0 has two replicas
    in_node = ExpertPlacement.from_slot_experts(6, np.array([[0, 1], [0, 2], [3, 4], [5, -1]]),
                                                np.array([[0.5, 1.0], [0.5, 1.0], [1.0, 1.0], [1.0, 0.0]]))
    across = ExpertPlacement.from_slot_experts(6, np.array([[1, 2], [0, 3], [0, 4], [5, -1]]),
                                               np.array([[1.0, 1.0], [0.5, 1.0], [0.5, 1.0], [1.0, 0.0]]))
    assert not rings_cross_nodes(in_node, 2)
    assert rings_cross_nodes(across, 2)
    # one node of 4 holds every ring
    assert not rings_cross_nodes(across, 4)
    # no replicas, no rings
    assert not rings_cross_nodes(ExpertPlacement.contiguous(8, 4, 2), 2)


def test_a_giant_spans_every_rank_when_the_other_ranks_cannot_take_enough_experts():
    """E256 on EP8 with 33 slots per rank, one expert at 1.42× a rank's mean: a rank without the giant holds at
    most 33 experts of load 1 (33 < the mean 38.75), so the giant must sit on all 8 ranks (7 extra replicas, one
    ring); a spare slot given to any other expert adds a second ring on some rank."""
    from moetrain.balance.costs import BalanceCostModel
    from moetrain.config import load_cluster_config, load_model_config

    model = load_model_config("pangu-ultra-moe-718b")
    model = model.model_copy(update={"moe": model.moe.model_copy(update={"num_experts": 256})})
    # rings priced whole (after the backward): under it a second ring would hide at this size, and the point here
    # is the solver's count of rings
    costs = BalanceCostModel(model, load_cluster_config("atlas-800t-a2"), 8, overlap_replica_rings=False)
    loads = np.ones(256)
    loads[5] = 55.0  # mean per rank (255 + 55) / 8 = 38.75: the giant is 1.42× it
    tokens = loads * 1000  # 38,750 token copies per rank: about 4,800 tokens of top-8 each
    plan = plan_placement(PlanRequest(tokens, 8, 33, "local"), lambda p: float(costs.layer_seconds(p, tokens)))
    replicas = plan.num_replicas()
    assert replicas[5] == 8 and (np.delete(replicas, 5) == 1).all()
    # 7 ranks with 32 experts of load 1 and the eighth with 31 take 6.75 and 7.75 of the giant: every rank 38.75
    np.testing.assert_allclose(plan.apply_to_tokens_per_expert(loads), 38.75, rtol=1e-6)


def test_a_hot_experts_replica_stays_in_its_node_where_the_group_spans_nodes():
    # 4 ranks, 2 per node; expert 0 (40 tokens) on rank 0 is above a rank's mean (57 / 4 = 14.25). Rank 1, in
    # its node, is busier (12) than rank 2 (2) in the other node: the replica goes to rank 1 all the same (its
    # gradient ring stays on in-node links), and the shares even ranks 0 and 1: 1 + 40a = 12 + 40(1 - a),
    # a = 51/80, 26.5 each. Not knowing the nodes, it goes to the lightest rank: 1 + 40a = 2 + 40(1 - a), 21.5.
    current = ExpertPlacement.from_slot_experts(8, np.array([[0, 1, -1], [2, 3, -1], [4, 5, -1], [6, 7, -1]]))
    loads = np.array([40.0, 1.0, 6.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    in_node = replicate_hot(current, loads, ranks_per_node=2)[0]
    assert in_node.slot_expert.reshape(4, 3)[1].tolist() == [2, 3, 0]
    np.testing.assert_allclose(in_node.apply_to_tokens_per_expert(loads), [26.5, 26.5, 2.0, 2.0])
    anywhere = replicate_hot(current, loads)[0]
    assert anywhere.slot_expert.reshape(4, 3)[2].tolist() == [4, 5, 0]
    np.testing.assert_allclose(anywhere.apply_to_tokens_per_expert(loads), [21.5, 12.0, 21.5, 2.0])
