"""In-node fabric topology: a full mesh (Ascend HCCS) gives a collective only the links to its peers,
a switch (NVSwitch) the whole bandwidth. Hand-computed cases."""

from __future__ import annotations

import pytest

from moetrain.config.cluster import ClusterConfig
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import RankGroup, allgather_time, allreduce_time, alltoall_time, mesh_share, p2p_time

# 8 devices per node, 56 GB/s in the node (7 links of 8 GB/s when meshed), 25 GB/s to the network; no
# latency and full bus efficiency, so every time is bytes / bandwidth
LINKS = dict(name="t", device="t", peak_tflops_bf16=100, hbm_gb=64, hbm_bandwidth_tbps=1, devices_per_node=8,
             intra_node_gbps=56, inter_node_gbps=25, intra_node_latency_us=0, inter_node_latency_us=0)
MESH = ClusterConfig(**LINKS, intra_node_mesh_links=7)
SWITCH = ClusterConfig(**LINKS)
FULL = Efficiency(bus_intra=1.0, bus_inter=1.0)
MB = 112e6


def test_mesh_share() -> None:
    assert mesh_share(SWITCH, 2) == 1.0
    assert float(mesh_share(MESH, 8)) == 1.0
    assert float(mesh_share(MESH, 2)) == pytest.approx(1 / 7)
    assert float(mesh_share(MESH, 4)) == pytest.approx(3 / 7)
    assert float(mesh_share(MESH, 1)) == 1.0  # alone in its node: no in-node hop


def test_rank_group_members_per_node() -> None:
    # Nodes of 8: 8 ranks 2 apart span 16 devices, 4 on each node; 4 consecutive ranks share one node;
    # 16 consecutive ranks fill two nodes, 8 on each; 2 ranks 8 apart sit on two nodes, one each.
    assert int(RankGroup(8, 8, stride=2).in_node) == 4
    assert int(RankGroup(4, 8).in_node) == 4
    assert int(RankGroup(16, 8).in_node) == 8
    assert int(RankGroup(2, 8, stride=8).in_node) == 1


def test_ring_collectives_on_a_mesh() -> None:
    # two ranks of a node: each sends half the buffer over its one link to the other (8 GB/s)
    assert float(allgather_time(MB, 2, 2, MESH, FULL)) == pytest.approx(0.5 * MB / 8e9)
    assert float(allgather_time(MB, 2, 2, SWITCH, FULL)) == pytest.approx(0.5 * MB / 56e9)
    # the whole node: 7/8 of the buffer over all 7 links, as on a switch
    assert float(allgather_time(MB, 8, 8, MESH, FULL)) == pytest.approx(7 / 8 * MB / 56e9)
    assert float(allreduce_time(MB, 4, 4, MESH, FULL)) == pytest.approx(2 * 3 / 4 * MB / 24e9)
    # one member per node: the network alone, whatever the fabric
    assert float(allgather_time(MB, 4, 1, MESH, FULL)) == pytest.approx(3 / 4 * MB / 25e9)


def test_all_to_all_and_send_on_a_mesh() -> None:
    # EP 2 inside a node: half the copies go to the one peer over one link
    assert float(alltoall_time(MB, RankGroup(2, 8), MESH, efficiency=FULL)) == pytest.approx(0.5 * MB / 8e9)
    # EP 8 fills the node: 7/8 of the copies over the 7 links
    assert float(alltoall_time(MB, RankGroup(8, 8), MESH, efficiency=FULL)) == pytest.approx(7 / 8 * MB / 56e9)
    # a pipeline send inside the node crosses one link; across nodes the NIC
    assert float(p2p_time(MB, False, MESH, FULL)) == pytest.approx(MB / 8e9)
    assert float(p2p_time(MB, True, MESH, FULL)) == pytest.approx(MB / 25e9)
    assert float(p2p_time(MB, False, SWITCH, FULL)) == pytest.approx(MB / 56e9)


def test_the_mesh_is_priced_only_where_a_cluster_file_sets_it() -> None:
    """The Atlas preset leaves the mesh off until its per-link bandwidth is measured (the preset's comment);
    a cluster file with ``intra_node_mesh_links`` turns it on."""
    from moetrain.config.presets import load_cluster_config

    atlas = load_cluster_config("atlas-800t-a2")
    assert atlas.intra_node_mesh_links is None and float(mesh_share(atlas, 2)) == 1.0
    meshed = atlas.model_copy(update={"intra_node_mesh_links": 7})
    assert float(p2p_time(8e9, False, meshed)) > float(p2p_time(8e9, False, atlas))


def test_nvl72_domain_prices_expert_all_to_all_by_the_rack() -> None:
    """GB200 NVL72: 72 GPUs share NVLink although a tray holds 4. EP 64 of DeepSeek-V3 stays on NVLink
    (63/64 of the copies at 900 GB/s); EP 144 sends half its copies over the 50 GB/s NICs."""
    import numpy as np

    from moetrain.config.parallel import ParallelConfig
    from moetrain.config.presets import load_cluster_config, load_model_config
    from moetrain.planner.layer_costs import layer_costs
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    gb200 = load_cluster_config("gb200")
    assert gb200.devices_per_node == 4 and gb200.fabric_devices == 72
    send = 4096 * 8 * 7168 * 2.0  # one micro-batch of 4096 tokens, top-8, hidden 7168, bf16
    in_rack = 63 / 64 * send / 900e9 + 3e-6
    in_one_rack = RankGroup(64, gb200.fabric_devices)
    assert float(alltoall_time(send, in_one_rack, gb200, efficiency=FULL)) == pytest.approx(in_rack)
    across = max(71 / 144 * send / 900e9, 72 / 144 * send / 50e9) + 10e-6 + 3e-6
    over_two_racks = RankGroup(144, gb200.fabric_devices)
    assert float(alltoall_time(send, over_two_racks, gb200, efficiency=FULL)) == pytest.approx(across)
    # the cost model takes the rack, not the tray: dispatch + combine, forward and backward
    w = Workload(load_model_config("deepseek-v3-671b"), gb200, 4096, 1024)
    s = Strategies.from_parallel([ParallelConfig(ep=64, dp=64)])
    a2a = layer_costs(w, s, FULL, moe_layer=True, num_micro=16).a2a
    assert float(np.asarray(a2a).ravel()[0]) == pytest.approx(4 * in_rack)


def test_blackwell_and_hopper_presets() -> None:
    """NVLink domains and dense peaks of the GB200 NVL72, B200 and H200 presets; fp4 falls back to fp8."""
    from moetrain.config.presets import load_cluster_config

    gb200, b200, h200 = (load_cluster_config(n) for n in ("gb200", "b200", "h200-sxm-141gb"))
    assert (gb200.fabric_devices, b200.fabric_devices, h200.fabric_devices) == (72, 8, 8)
    assert (gb200.intra_node_gbps, b200.intra_node_gbps, h200.intra_node_gbps) == (900, 900, 450)
    assert gb200.peak_flops("fp4") == 2 * gb200.peak_flops("fp8") == 4 * gb200.peak_flops("bf16") == 1e16
    assert b200.peak_flops("fp4") == 9e15 and b200.peak_flops("fp8") == 4.5e15
    assert h200.peak_flops("fp4") == h200.peak_flops("fp8") == 1979e12
