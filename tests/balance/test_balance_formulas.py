"""Expert balancing's charges and gains against numbers worked out by hand in the test.

- ``BalanceCostModel.migration_seconds``: moved experts' bytes over the busiest rank's busiest link,
  the weights before the layer's experts run, the optimizer state under the rest of the step;
- ``BalanceCostModel.alltoall_seconds``: the busiest rank's copies, four exchanges per layer;
- ``BalanceCostModel.exposed_replica_sync_seconds``: the replicas' ring less the backward after its layer;
- ``replay``: the step after a decision pays its migration, and the gain is the step time saved net of
  it. The replay runs on a cost model simple enough to price by hand (seconds per token copy on the
  busiest rank, a fixed charge per moved expert), so its bookkeeping is checked, not the cost model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from per_copy_costs import PerCopyCosts

from moetrain.balance.costs import BalanceCostModel, OverlapWindow
from moetrain.balance.placement import ExpertPlacement, Move
from moetrain.balance.predict import EMAPredictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import ReplanRule
from moetrain.balance.traces import RoutingTrace
from moetrain.config import ClusterConfig, load_model_config
from moetrain.planner.calibration import Efficiency

# 4 devices per node, 100 GB/s in the node and 10 GB/s over the network, 1 and 5 µs latency; the
# efficiencies reach the full bandwidth.
CLUSTER = ClusterConfig(name="round-numbers", device="round-numbers", peak_tflops_bf16=1000.0, hbm_gb=80.0,
                        hbm_bandwidth_tbps=3.0, devices_per_node=4, intra_node_gbps=100.0, inter_node_gbps=10.0,
                        intra_node_latency_us=1.0, inter_node_latency_us=5.0)
FULL_BANDWIDTH = replace(Efficiency(), bus_intra=1.0, bus_inter=1.0)
# tiny-mixtral's experts: 3 · 128 · 192 = 73,728 parameters each
PARAMS_PER_EXPERT = 73_728
# Rank 0 sends two experts to rank 1 (same node) and one to rank 5 (the other node).
MOVES = [Move(0, (0, 0), (1, 0)), Move(1, (0, 1), (1, 1)), Move(2, (0, 2), (5, 0))]


def _costs(**options: object) -> BalanceCostModel:
    return BalanceCostModel(load_model_config("tiny-mixtral"), CLUSTER, ep=8, efficiency=FULL_BANDWIDTH, **options)


def test_a_migration_pays_what_its_copies_outlast_of_the_next_steps_compute() -> None:
    costs = _costs()
    assert costs.params_per_expert == PARAMS_PER_EXPERT
    # bf16 weights (2 B per parameter): in the node 2 experts = 294,912 B / 100 GB/s + 1 µs = 3.94912 µs;
    # over the network 1 expert = 147,456 B / 10 GB/s + 5 µs = 19.7456 µs; the slower link decides.
    weights = 19.7456e-6
    # fp32 master and Adam moments (12 B): network 884,736 B / 10 GB/s + 5 µs = 93.4736 µs (the node's
    # 1,769,472 B take 18.69472 µs).
    state = 93.4736e-6
    assert costs.transfer_seconds(MOVES, 2.0) == pytest.approx(weights, rel=1e-12)
    assert costs.transfer_seconds(MOVES, 12.0) == pytest.approx(state, rel=1e-12)
    # 10 µs of compute before the layer's experts: the step waits 19.7456 − 10 = 9.7456 µs for the
    # weights; the state follows on the same links and outlasts the layer's 50 µs by
    # 19.7456 + 93.4736 − 50 − 9.7456 = 53.4736 µs. Together 63.2192 µs.
    window = OverlapWindow(before_experts=10e-6, layer=50e-6)
    assert costs.migration_seconds(MOVES, window) == pytest.approx(63.2192e-6, rel=1e-12)
    # no compute to hide under: all of both, 113.2192 µs
    assert costs.migration_seconds(MOVES) == pytest.approx(weights + state, rel=1e-12)
    # compute longer than both: nothing shows
    assert costs.migration_seconds(MOVES, OverlapWindow(1.0, 1.0)) == 0.0
    # a copy inside one rank is free
    assert costs.migration_seconds([Move(3, (2, 0), (2, 1))], window) == 0.0


def test_a_stop_the_world_migration_moves_all_14_bytes_before_the_step() -> None:
    costs = _costs(defer_weights=False, defer_optimizer_state=False)
    # the network's one expert: 73,728 · 14 = 1,032,192 B / 10 GB/s + 5 µs = 108.2192 µs
    assert costs.migration_seconds(MOVES, OverlapWindow(1.0, 1.0)) == pytest.approx(108.2192e-6, rel=1e-12)


@pytest.mark.parametrize(("hierarchical", "expected_s"), [
    # The busiest rank receives 2,000 copies (the mean is 1,000): 2,000 · 128 · 2 B = 512,000 B. Flat over
    # 2 nodes of 4: 3/8 in the node (1.92 µs) and 4/8 over the network, 256,000 B / 10 GB/s = 25.6 µs,
    # + 5 + 1 µs = 31.6 µs.
    (False, 4 * 31.6e-6),
    # Hierarchical: 512,000/2 = 256,000 B of tokens (top-2), each hits the other node with probability
    # 1 − (1/2)^2 = 3/4: 192,000 B / 10 GB/s = 19.2 µs + 5 µs; then 3/4 · 512,000 B in the node = 3.84 µs
    # + 1 µs: 29.04 µs.
    (True, 4 * 29.04e-6),
])
def test_the_all_to_all_is_priced_at_the_busiest_ranks_copies(hierarchical: bool, expected_s: float) -> None:
    costs = _costs(hierarchical_a2a=hierarchical)
    copies = np.array([2000.0, 1000, 1000, 1000, 1000, 1000, 500, 500])
    assert float(costs.alltoall_seconds(copies)) == pytest.approx(expected_s, rel=1e-12)


# 4 experts on 2 ranks (3 slots each: one spare), 10 steps of the same load: experts 0 and 1 (rank 0)
# take 300 tokens each, experts 2 and 3 (rank 1) 100 each.
TRACE = RoutingTrace(np.arange(10), np.arange(1), np.tile(np.array([300, 300, 100, 100]), (10, 1, 1)))


def test_replay_charges_the_migration_in_the_next_step_and_gains_what_is_left() -> None:
    result = replay(TRACE, ReplanRule(PerCopyCosts(), interval=100, horizon=50), EMAPredictor(0.5))
    # Static: rank 0 computes 600 copies a step, 0.6 s; the ideal is 400 on each rank, 0.4 s.
    np.testing.assert_allclose(result.seconds_before, np.full(10, 0.6), rtol=1e-12)
    np.testing.assert_allclose(result.seconds_ideal, np.full(10, 0.4), rtol=1e-12)
    # After step 0 the plan replicates expert 0 into rank 1's spare slot (one move): rank 0 keeps a third
    # of its tokens (100 + 300), rank 1 serves two thirds (200 + 100 + 100). Saving 0.2 s a step over 50
    # steps (10 s) pays the 0.05 s move, which step 1 pays.
    [decision] = result.decisions
    assert decision.migrate and len(decision.moves) == 1 and decision.moves[0].crosses_ranks
    np.testing.assert_allclose(result.seconds_migration, [0.0, 0.05] + [0.0] * 8, atol=1e-15)
    np.testing.assert_allclose(result.seconds_after, [0.6, 0.4 + 0.05] + [0.4] * 8, rtol=1e-12)
    # 6 s before, 0.6 + 0.45 + 8 · 0.4 = 4.25 s after: 6/4.25 − 1 = 41.18 % faster, 6.25 % off the ideal
    assert result.predicted_gain == pytest.approx(6.0 / 4.25 - 1.0, rel=1e-12)
    assert result.gap_to_ideal == pytest.approx(4.25 / 4.0 - 1.0, rel=1e-12)
    assert result.summary()["migration_seconds_total"] == pytest.approx(0.05, rel=1e-12)
    assert result.summary()["migration_bytes"] == 1e9  # the one move, across ranks
    # from step 1 on: 0.45 + 8 · 0.4 = 3.65 s against 9 · 0.4 = 3.6 s
    assert result.steady_gap_to_ideal == pytest.approx(3.65 / 3.6 - 1.0, rel=1e-12)


def test_replay_keeps_a_placement_whose_move_would_not_pay() -> None:
    # 0.2 s saved a step over a 50-step horizon is 10 s: a 20 s move does not pay for itself
    result = replay(TRACE, ReplanRule(PerCopyCosts(seconds_per_move=20.0), interval=100, horizon=50), EMAPredictor(0.5))
    assert [d.migrate for d in result.decisions] == [False]
    np.testing.assert_allclose(result.seconds_after, result.seconds_before, rtol=1e-12)
    assert result.predicted_gain == 0.0


def test_replica_rings_pay_only_what_outlasts_the_backward_after_their_layer() -> None:
    """``exposed_replica_sync_seconds``: the ring's time less ``backward_after_seconds`` (the rest of the
    layer's backward and the expert backward of the layer below, at even ranks), never below 0."""
    slow = CLUSTER.model_copy(update={"inter_node_gbps": 1.0})  # 1 GB/s between the two nodes: a ring that shows
    costs = BalanceCostModel(load_model_config("tiny-mixtral"), slow, ep=8, efficiency=FULL_BANDWIDTH)
    whole = replace(costs, overlap_replica_rings=False)
    # expert 0 (rank 0, node 0) also on rank 5 (node 1): a ring of two over the network. Each replica sends
    # 2·(2 − 1)/2 = one fp32 gradient, 73,728 · 4 = 294,912 B / 1 GB/s = 294.912 µs, in 2 rounds of 5 µs
    table = np.stack([np.arange(8), np.full(8, -1)], axis=1)  # [rank, slot]: expert r on rank r, a spare slot
    table[5, 1] = 0
    placement = ExpertPlacement.from_slot_experts(8, table)
    ring = 294.912e-6 + 2 * 5e-6
    assert costs.replica_sync_seconds(placement) == pytest.approx(ring, rel=1e-12)
    for per_expert in (100.0, 200_000.0):
        loads = np.full(8, per_expert)
        even = np.full(8, per_expert)  # 8 experts on 8 ranks: every rank computes the mean load
        # what runs after the layer's expert weight gradients: 2/3 (the backward's share of forward + backward)
        # of the rest of the layer and of one layer's experts at even ranks (1 expert per rank)
        backward_after = 2.0 / 3.0 * (float(costs.other_seconds(even)) + float(costs.expert_seconds(even[0], 1)))
        assert costs.backward_after_seconds(loads) == pytest.approx(backward_after, rel=1e-12)
        exposed = max(0.0, ring - backward_after)
        assert costs.exposed_replica_sync_seconds(placement, loads) == pytest.approx(exposed, rel=1e-12, abs=1e-15)
        assert whole.exposed_replica_sync_seconds(placement, loads) == pytest.approx(ring, rel=1e-12)
        # the layer's time carries the exposed part only
        assert whole.layer_seconds(placement, loads) - costs.layer_seconds(placement, loads) == pytest.approx(
            ring - exposed, rel=1e-9)
    # at 100 tokens per expert most of the ring shows; at 200,000 the backward after the layer hides it all
    assert 0 < costs.exposed_replica_sync_seconds(placement, np.full(8, 100.0)) < ring
    assert costs.exposed_replica_sync_seconds(placement, np.full(8, 200_000.0)) == 0.0
