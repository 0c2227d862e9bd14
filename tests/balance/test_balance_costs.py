import numpy as np
import pytest

from moetrain.balance.costs import BalanceCostModel, OverlapWindow
from moetrain.balance.placement import ExpertPlacement, Move
from moetrain.config import load_cluster_config, load_model_config
from moetrain.costs.params import moe_block_params
from moetrain.errors import UserError
from moetrain.planner import comm


@pytest.fixture(scope="module")
def costs() -> BalanceCostModel:
    return BalanceCostModel(load_model_config("pangu-ultra-moe-718b"), load_cluster_config("atlas-800t-a2"), 32)


def test_imbalance_costs_time_and_ideal_is_a_bound(costs):
    even = np.full(256, 1000.0)
    skewed = even.copy()
    skewed[:8] = 9000.0  # all on rank 0 in the contiguous layout
    contiguous = ExpertPlacement.contiguous(256, 32, 9)
    assert costs.layer_seconds(contiguous, even) == pytest.approx(costs.ideal_layer_seconds(even), rel=1e-9)
    assert costs.layer_seconds(contiguous, skewed) > 1.5 * costs.ideal_layer_seconds(skewed)


def test_alltoall_priced_at_the_busiest_rank(costs):
    copies = np.array([[100.0] * 31 + [400.0]])
    expected = 4 * comm.alltoall_time(400.0 * 7680 * 2, comm.RankGroup(32, 8), costs.cluster)
    assert costs.alltoall_seconds(copies)[0] == pytest.approx(float(expected))


def test_migration_cost_uses_weights_master_and_adam_over_the_right_link(costs):
    params = moe_block_params(costs.model)[1] / 256
    stop_the_world = BalanceCostModel(costs.model, costs.cluster, 32, defer_weights=False,
                                      defer_optimizer_state=False)
    assert stop_the_world.migration_seconds([]) == 0.0
    in_node = stop_the_world.migration_seconds([Move(3, (0, 0), (1, 8))])
    across = stop_the_world.migration_seconds([Move(3, (0, 0), (8, 8))])
    assert in_node == pytest.approx(float(comm.p2p_time(params * 14, False, costs.cluster)))
    assert across == pytest.approx(float(comm.p2p_time(params * 14, True, costs.cluster)))
    assert across > in_node
    # two experts leaving one rank take twice as long as two ranks sending one each
    same_sender = stop_the_world.migration_seconds([Move(1, (0, 0), (8, 8)), Move(2, (0, 1), (9, 8))])
    two_senders = stop_the_world.migration_seconds([Move(1, (0, 0), (8, 8)), Move(9, (1, 1), (9, 8))])
    assert same_sender > 1.9 * two_senders
    assert stop_the_world.migration_seconds([Move(1, (0, 0), (0, 8))]) == 0.0  # a local copy


def test_expert_tensor_parallel_ranks_move_and_reduce_their_slice_only(costs):
    sliced = BalanceCostModel(costs.model, costs.cluster, 32, etp=2)
    params = moe_block_params(costs.model)[1] / 256
    move = [Move(3, (0, 0), (8, 8))]
    assert sliced.transfer_seconds(move, 14) == pytest.approx(float(comm.p2p_time(params * 7, True, costs.cluster)))
    table = ExpertPlacement.contiguous(256, 32, 9).slot_expert.reshape(32, 9).copy()
    table[9, 8] = 1  # a replica of expert 1 on another node
    replicated = ExpertPlacement.from_slot_experts(256, table)
    # half of the 4-byte gradient, once, in the two rounds of a ring of two (a network latency each)
    latency = costs.cluster.inter_node_latency_us * 1e-6
    assert sliced.replica_sync_seconds(replicated) == pytest.approx(
        float(comm.p2p_time(params * 2, True, costs.cluster)) - latency + 2 * latency)
    # the expert GEMM work per rank is the same: 1/etp of each expert for etp ranks' tokens
    loads = np.full(256, 1000.0)
    assert sliced.layer_seconds(ExpertPlacement.contiguous(256, 32, 9), loads) == pytest.approx(
        costs.layer_seconds(ExpertPlacement.contiguous(256, 32, 9), loads))


def test_copies_hide_under_the_next_steps_compute(costs):
    move = [Move(3, (0, 0), (8, 8))]
    params = moe_block_params(costs.model)[1] / 256
    weights = float(comm.p2p_time(params * 2, True, costs.cluster))
    state = float(comm.p2p_time(params * 12, True, costs.cluster))
    # no compute to hide under: both copies show; enough compute: nothing does
    assert costs.migration_seconds(move) == pytest.approx(weights + state)
    assert costs.migration_seconds(move, OverlapWindow(10 * weights, 10 * state)) == 0.0
    # the weights outlast the compute before the experts by half: the step waits that long, and the
    # state, following on the link, outlasts the layer by what is left
    window = OverlapWindow(weights / 2, state / 2)
    assert costs.migration_seconds(move, window) == pytest.approx(weights / 2 + (weights + state - state / 2
                                                                                 - weights / 2))
    # weights landed before the step: the state alone travels under the layer
    before = BalanceCostModel(costs.model, costs.cluster, 32, defer_weights=False)
    assert before.migration_seconds(move, window) == pytest.approx(weights + state / 2)
    with pytest.raises(UserError, match="defer both or neither"):
        BalanceCostModel(costs.model, costs.cluster, 32, defer_optimizer_state=False)
    # the window is the layer's compute: expert GEMMs of the slowest rank plus the rest of the layer;
    # before the experts, the rest of the layer's forward (a third of its forward and backward)
    loads = np.full(256, 1000.0)
    contiguous = ExpertPlacement.contiguous(256, 32, 9)
    copies = contiguous.apply_to_tokens_per_expert(loads)
    rest = float(costs.other_seconds(copies))
    expected = (rest / 3, float(costs.expert_seconds(copies, 8).max()) + rest)
    for window in (costs.overlap_window_seconds(contiguous, loads), costs.ideal_overlap_window_seconds(loads)):
        assert (window.before_experts, window.layer) == pytest.approx(expected)


def test_replicas_pay_a_ring_all_reduce_of_their_gradient(costs):
    plain = ExpertPlacement.contiguous(256, 32, 9)
    table = plain.slot_expert.reshape(32, 9).copy()
    table[1, 8] = 0  # a replica of expert 0 on rank 1 (same node)
    table[9, 8] = 1  # a replica of expert 1 on rank 9 (another node)
    replicated = ExpertPlacement.from_slot_experts(256, table)
    assert costs.replica_sync_seconds(plain) == 0.0
    grad_bytes = moe_block_params(costs.model)[1] / 256 * 4
    # a ring of two: each replica sends 2·(2 − 1)/2 = one gradient to the other and receives one
    in_node = float(comm.p2p_time(grad_bytes, False, costs.cluster))
    across = float(comm.p2p_time(grad_bytes, True, costs.cluster))
    assert in_node < across
    # rank 0 holds both experts: one ring on its in-node link, one on the network, at once; the rings run
    # in 2·(2 − 1) = 2 rounds, each waiting a latency (the network's: a ring crosses nodes)
    lat_in, lat_across = costs.cluster.intra_node_latency_us * 1e-6, costs.cluster.inter_node_latency_us * 1e-6
    assert costs.replica_sync_seconds(replicated) == pytest.approx(
        max(in_node - lat_in, across - lat_across) + 2 * lat_across)
    # expert 2 on ranks 0, 1, 2, 3 of node 0 too: rank 0 now sends 2·3/4 of a gradient (expert 2) and one
    # (expert 0) over its in-node link; the network still carries expert 1's one gradient
    table[2, 8], table[3, 8] = 2, 2
    table[1, 7] = 2  # rank 1 gives expert 15's slot to expert 2 ...
    table[4, 8] = 15  # ... and expert 15 moves to rank 4
    four = ExpertPlacement.from_slot_experts(256, table)
    assert four.num_replicas()[2] == 4
    # ... in 2·(4 − 1) = 6 rounds, the longest ring's
    assert costs.replica_sync_seconds(four) == pytest.approx(
        max(float(comm.p2p_time(2.5 * grad_bytes, False, costs.cluster)) - lat_in, across - lat_across)
        + 6 * lat_across)


def test_dense_model_is_refused():
    dense = load_model_config("tiny-pangu").model_copy(update={"moe": None, "num_dense_layers": 0})
    with pytest.raises(UserError, match="has no MoE layers"):
        BalanceCostModel(dense, load_cluster_config("cpu"), 4)
