"""The MoE terms by hand: the grouped GEMM's efficiency against tokens per expert (half a tile of padding
per expert and the weight reads, whichever bounds it), and the top-k all-to-all volume with imbalance."""

from __future__ import annotations

import numpy as np
import pytest

from moetrain.config.presets import load_cluster_config, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import RankGroup, alltoall_time, alltoall_volume
from moetrain.planner.compute import ExpertShard, expert_compute_time

# H100: 989.4 TFLOP/s bf16 at gemm_max 0.7; 3.35 TB/s at memory 0.7; 10 µs per GEMM call
EFF = Efficiency(gemm_max=0.7, memory=0.7, gemm_overhead_us=10.0, bus_intra=1.0, bus_inter=1.0)
RATE, BANDWIDTH = 989.4e12 * 0.7, 3.35e12 * 0.7


def _by_hand(tokens: float, local: int, h: int = 7168, f: int = 2048) -> float:
    """DeepSeek-V3's expert (hidden 7168, width 2048, SwiGLU: 3 matrices) on one H100, forward."""
    params = 3 * h * f
    math = 2.0 * params * (tokens + local * 64) / RATE + 3 * 10e-6  # half a 128-row tile per expert
    reads = (local * params * 2.0 + tokens * (2 * h + 3 * f) * 2.0) / BANDWIDTH
    return max(math, reads) + tokens * f * 2.0 * 3 / BANDWIDTH


@pytest.mark.parametrize("tokens_per_expert", [16, 128, 512, 4096])
def test_grouped_gemm_against_tokens_per_expert(tokens_per_expert: int) -> None:
    model, h100 = load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb")
    tokens = 8 * tokens_per_expert
    got = float(expert_compute_time(np.array([tokens]), model, h100, EFF, ExpertShard(num_local_experts=8))[0])
    assert got == pytest.approx(_by_hand(tokens, 8))


def test_small_m_falls_off() -> None:
    """Achieved FLOP rate over a large GEMM's: bound by reading the 8 experts' 704 MB of weights up to
    about 300 tokens per expert (5 % at 16, 40 % at 128), then by half a tile of padding per expert and the
    activation traffic (94 % at 4,096)."""
    model, h100 = load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb")
    params = 3 * 7168 * 2048
    share = {}
    for m in (16, 128, 4096):
        t = float(expert_compute_time(np.array([8 * m]), model, h100, EFF, ExpertShard(num_local_experts=8))[0])
        share[m] = 2.0 * params * 8 * m / RATE / t
    assert share[16] == pytest.approx(0.054, abs=0.005)
    assert share[128] == pytest.approx(0.40, abs=0.02)
    assert share[4096] == pytest.approx(0.94, abs=0.02)


def test_top_k_volume_and_imbalance_in_the_all_to_all() -> None:
    """4,096 tokens of hidden 7168 to 8 experts each, bf16: 470 MB leave a rank per dispatch; over EP 64
    on 8 nodes of 8 (flat), 56/64 of the copies take the 50 GB/s NIC; an imbalance of 1.3 sends 1.3×."""
    h100 = load_cluster_config("h100-sxm-80gb")
    send = float(alltoall_volume(4096, 7168, 8))
    assert send == 4096 * 8 * 7168 * 2
    flat = float(alltoall_time(send, RankGroup(64, 8), h100, top_k=8, efficiency=EFF))
    assert flat == pytest.approx(56 / 64 * send / 50e9 + 10e-6 + 3e-6)
    hot = float(alltoall_time(1.3 * send, RankGroup(64, 8), h100, top_k=8, efficiency=EFF))
    assert hot - 13e-6 == pytest.approx(1.3 * (flat - 13e-6))
    # hierarchical: a token crosses the network once per node holding one of its experts, 7·(1 − (7/8)^8)
    # of the 7 other nodes, then 7/8 of the copies cross the node's links
    hier = float(alltoall_time(send, RankGroup(64, 8), h100, hierarchical=True, top_k=8, efficiency=EFF))
    nodes_hit = 7 * (1 - (7 / 8) ** 8)
    assert hier == pytest.approx(nodes_hit * send / 8 / 50e9 + 10e-6 + 7 / 8 * send / 450e9 + 3e-6)
