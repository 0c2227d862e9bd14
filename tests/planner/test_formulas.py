"""Cost formulas against numbers worked out by hand in the test, not against the code's own helpers.

The cluster below has round numbers (400 GB/s in the node, 50 GB/s over the network, 2 and 10 µs
latency, 8 devices per node) and the efficiencies reach the full link bandwidth, so every expected
value is arithmetic on the page: the all-to-all (flat and hierarchical, alone and inside an MoE
layer), ZeRO's model-state bytes on the busiest pipeline stage, and the micro-batches whose
activations a pipeline stage holds at once.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from moetrain.config import ClusterConfig, ParallelConfig, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import RankGroup, alltoall_time, alltoall_volume
from moetrain.planner.costmodel import evaluate
from moetrain.planner.device_memory import in_flight_micro_batches
from moetrain.planner.layer_costs import layer_costs
from moetrain.planner.strategy import Strategies
from moetrain.planner.workload import Workload
from moetrain.schedules import Overlapped, build_schedule

CLUSTER = ClusterConfig(name="round-numbers", device="round-numbers", peak_tflops_bf16=1000.0, hbm_gb=80.0,
                        hbm_bandwidth_tbps=3.0, devices_per_node=8, intra_node_gbps=400.0, inter_node_gbps=50.0,
                        intra_node_latency_us=2.0, inter_node_latency_us=10.0)
FULL_BANDWIDTH = replace(Efficiency(), bus_intra=1.0, bus_inter=1.0)
INTRA, INTER = 400e9, 50e9  # bytes/s
LAT_INTRA, LAT_INTER = 2e-6, 10e-6  # s


def _one(**parallel: object) -> Strategies:
    return Strategies.from_parallel([ParallelConfig(**parallel)])


# --- all-to-all ----------------------------------------------------------------------------------


def test_all_to_all_volume_is_every_token_to_each_of_its_experts() -> None:
    # 4,096 tokens × top-8 × hidden 7,168 × 2 bytes
    assert alltoall_volume(4096, 7168, 8, 2.0) == 469_762_048


def test_flat_all_to_all_sends_each_copy_over_the_link_to_its_expert() -> None:
    send = 469_762_048.0  # bytes one rank sends (4,096 tokens, top-8, hidden 7,168, bf16)
    # ep 32 over 4 nodes of 8: 7/32 of the copies stay in the node (400 GB/s), 24/32 cross the network
    # (50 GB/s); the two run at once, so the network decides: 352,321,536 B / 50 GB/s = 7.04643072 ms,
    # plus one network and one in-node latency.
    in_node = 7 / 32 * send / INTRA  # 0.25690112 ms
    network = 24 / 32 * send / INTER  # 7.04643072 ms
    assert in_node < network
    expected = 7.04643072e-3 + LAT_INTER + LAT_INTRA
    got = float(alltoall_time(send, RankGroup(32, 8), CLUSTER, hierarchical=False, top_k=8, efficiency=FULL_BANDWIDTH))
    assert got == pytest.approx(expected, rel=1e-12)


def test_hierarchical_all_to_all_crosses_the_network_once_per_node_a_token_hits() -> None:
    send = 469_762_048.0
    # A token's 8 experts hit a given one of the 3 other nodes with probability 1 − (3/4)^8 =
    # 58,975/65,536, so it crosses the network 3 · 58,975/65,536 = 2.6996613 times, as one token
    # (send / 8 = 58,720,256 B per rank for all its tokens): 58,720,256 · 176,925/65,536 = 158,524,800 B
    # over 50 GB/s = 3.170496 ms, + 10 µs. Then an in-node all-to-all delivers the copies: 7/8 of the
    # routed bytes, 411,041,792 B over 400 GB/s = 1.02760448 ms, + 2 µs.
    network = 158_524_800 / INTER + LAT_INTER
    in_node = 411_041_792 / INTRA + LAT_INTRA
    assert network == pytest.approx(3.180496e-3, rel=1e-12) and in_node == pytest.approx(1.02960448e-3, rel=1e-12)
    got = float(alltoall_time(send, RankGroup(32, 8), CLUSTER, hierarchical=True, top_k=8, efficiency=FULL_BANDWIDTH))
    assert got == pytest.approx(4.21010048e-3, rel=1e-12)


def test_an_all_to_all_inside_one_node_is_the_same_either_way() -> None:
    send = 1_000_000.0
    # ep 8 on 8 devices per node: 7/8 of the bytes over the in-node links, one latency
    expected = 7 / 8 * send / INTRA + LAT_INTRA  # 4.1875 µs
    for hierarchical in (False, True):
        got = float(alltoall_time(send, RankGroup(8, 8), CLUSTER, hierarchical=hierarchical, top_k=8,
                                  efficiency=FULL_BANDWIDTH))
        assert got == pytest.approx(4.1875e-6, rel=1e-12) == expected


@pytest.mark.parametrize(("a2a", "recompute", "expected_s"), [
    # flat: 7/16 in the node (0.00172032 ms) and 8/16 over the network: 786,432 B / 50 GB/s = 15.72864 µs,
    # + 10 + 2 µs = 27.72864 µs per exchange; dispatch and combine, forward and backward: × 4
    ("flat", "none", 4 * 27.72864e-6),
    # full recompute runs the forward's two exchanges again: × 6
    ("flat", "full", 6 * 27.72864e-6),
    # hierarchical: a token's 4 experts hit the other node with probability 1 − (1/2)^4 = 15/16, so
    # 393,216 B (one copy per token) · 15/16 = 368,640 B over the network = 7.3728 µs + 10 µs; then 7/8 of
    # the routed bytes in the node, 1,376,256 B / 400 GB/s = 3.44064 µs + 2 µs: 22.81344 µs per exchange
    ("hierarchical", "none", 4 * 22.81344e-6),
])
def test_an_moe_layer_pays_four_exchanges_of_the_routed_tokens(a2a: str, recompute: str, expected_s: float) -> None:
    model = load_model_config("tiny-qwen3")  # hidden 128, 16 experts, top-4
    assert (model.hidden_size, model.moe.num_experts, model.moe.router.top_k) == (128, 16, 4)
    w = Workload(model, CLUSTER, seq_len=1024, global_batch=16, imbalance=1.5)
    # ep 16 over 2 nodes, no tp: a rank's 1,024 tokens × 4 copies × 128 × 2 bytes × 1.5 (the hottest
    # rank's load over the mean) = 1,572,864 bytes per exchange
    layer = layer_costs(w, _one(ep=16, dp=16, micro_batch=1, a2a=a2a, recompute=recompute), FULL_BANDWIDTH,
                        moe_layer=True, num_micro=1.0)
    assert float(layer.a2a[0]) == pytest.approx(expected_s, rel=1e-12)


# --- ZeRO memory per stage -----------------------------------------------------------------------

# tiny-mixtral: vocab 2,048, hidden 128, 8 layers, 4 heads of 32 (2 kv heads), 8 experts of width 192.
# Per layer: attention 3 · 128 · 128 (q, o, and k + v at half width) = 49,152; two norms 256; router
# 128 · 8 = 1,024; experts 8 · 3 · 128 · 192 = 589,824. Embedding and (untied) head 2,048 · 128 = 262,144
# each, final norm 128. Dense body: 8 · (49,152 + 256 + 1,024) + 128 = 403,584; experts 4,718,592.
DENSE_BODY, EXPERTS, EMBEDDING = 403_584, 4_718_592, 262_144


def _model_state(parallel: ParallelConfig):
    w = Workload(load_model_config("tiny-mixtral"), CLUSTER, seq_len=128, global_batch=64)
    memory = evaluate(w, Strategies.from_parallel([parallel]), Efficiency()).memory
    return float(memory.weights[0]), float(memory.grads[0]), float(memory.optimizer[0])


def test_hand_counted_parameters_match_the_config() -> None:
    from moetrain.costs.params import count_params

    counts = count_params(load_model_config("tiny-mixtral"))
    assert counts.total - counts.embedding - counts.head - counts.experts == DENSE_BODY
    assert (counts.experts, counts.embedding, counts.head) == (EXPERTS, EMBEDDING, EMBEDDING)


@pytest.mark.parametrize(("zero", "expected"), [
    # pp 2 × tp 2 × dp 4, ep 4: the busiest stage holds half the body and the embedding (or the head),
    # split over tp: (403,584/2 + 262,144)/2 = 231,968 dense parameters, replicated over dp·cp = 4; and
    # 4,718,592/2/4 = 589,824 expert parameters, replicated over tp·cp·dp/(ep·etp) = 2.
    # bf16 weights (2 B), fp32 gradients (4 B), Adam master + moments (12 B).
    (0, (2 * (231_968 + 589_824), 4 * (231_968 + 589_824), 12 * (231_968 + 589_824))),
    # ZeRO-1 shards the optimizer state: 12 · (231,968/4 + 589,824/2) = 12 · 352,904
    (1, (2 * 821_792, 4 * 821_792, 12 * 352_904)),
    # ZeRO-2 the gradients too: 4 · 352,904
    (2, (2 * 821_792, 4 * 352_904, 12 * 352_904)),
    # ZeRO-3 under a pipeline keeps the stage's weights gathered and gradients whole (FSDP2 + PP): ZeRO-1
    (3, (2 * 821_792, 4 * 821_792, 12 * 352_904)),
])
def test_zero_shards_model_state_on_the_busiest_stage(zero: int, expected: tuple[int, int, int]) -> None:
    got = _model_state(ParallelConfig(tp=2, sp=True, pp=2, ep=4, dp=4, zero=zero, micro_batch=1))
    assert got == pytest.approx(expected, rel=1e-12)


def test_zero3_without_a_pipeline_shards_the_weights_too() -> None:
    # pp 1 × tp 2 × dp 8, ep 4: (403,584 + 2 · 262,144)/2 = 463,936 dense parameters over dp 8 (57,992),
    # 4,718,592/4 = 1,179,648 expert parameters over 2·8/4 = 4 (294,912): 352,904 of each kind of state
    got = _model_state(ParallelConfig(tp=2, sp=True, pp=1, ep=4, dp=8, zero=3, micro_batch=1))
    assert got == pytest.approx((2 * 352_904, 4 * 352_904, 12 * 352_904), rel=1e-12)


# --- pipeline activations in flight --------------------------------------------------------------


@pytest.mark.parametrize(("pp", "vpp", "num_micro", "overlap", "expected"), [
    (4, 1, 8, False, 4.0),  # 1F1B: the first stage holds pp micro-batches (min(pp, m))
    (4, 1, 2, False, 2.0),  # ... or all of them when there are fewer
    (4, 2, 8, False, 5.5),  # interleaved: pp·vpp + pp − 1 = 11 chunks of half a stage
    (4, 2, 4, False, 4.0),  # ... at most the m·vpp = 8 chunks there are
    (2, 3, 4, False, 7 / 3),  # 2·3 + 2 − 1 = 7 chunks of a third
    (4, 1, 8, True, 5.0),  # the paired schedule keeps one more chunk
    (4, 2, 8, True, 6.0),
])
def test_micro_batches_in_flight(pp: int, vpp: int, num_micro: int, overlap: bool, expected: float) -> None:
    s = _one(pp=pp, vpp=vpp, dp=1, overlap=overlap)
    assert float(in_flight_micro_batches(s, float(num_micro))[0]) == pytest.approx(expected, rel=1e-12)
    # the runtime's own schedule for the first rank holds as many chunks at its peak
    alive = peak = 0
    for step in build_schedule(pp, vpp, num_micro, overlap)[0]:
        for action in (step.forward, step.backward) if isinstance(step, Overlapped) else (step,):
            alive += 1 if action.kind == "F" else -1
            peak = max(peak, alive)
    assert peak / vpp == pytest.approx(expected, rel=1e-12)


def test_first_stage_activations_scale_with_the_micro_batches_in_flight() -> None:
    # A vocabulary of 64 keeps the head's logits small, so the first stage (2 layers × the micro-batches
    # in flight) is the busiest; the bytes per layer and micro-batch are the same in every layout below.
    model = load_model_config("tiny-mixtral").model_copy(update={"vocab_size": 64})
    eff = Efficiency()

    def activations(global_batch: int, **parallel: object) -> float:
        w = Workload(model, CLUSTER, seq_len=128, global_batch=global_batch)
        return float(evaluate(w, _one(pp=4, dp=1, micro_batch=1, **parallel), eff).memory.activations[0])

    one_f_one_b = activations(8)  # m = 8: 4 in flight
    assert activations(2) / one_f_one_b == pytest.approx(2 / 4, rel=1e-12)  # m = 2: 2 in flight
    assert activations(8, vpp=2) / one_f_one_b == pytest.approx(5.5 / 4, rel=1e-12)  # 1 + (p − 1)/(p·v)
    assert activations(8, overlap=True) / one_f_one_b == pytest.approx(5 / 4, rel=1e-12)
    assert activations(8, vpp=2) > activations(8) > activations(2) > 0
    assert np.isfinite(one_f_one_b)
