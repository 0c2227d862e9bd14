"""The MoE terms by hand: the grouped GEMM's efficiency against tokens per expert (half a tile of padding
per expert and the weight reads, whichever bounds it), and the top-k all-to-all volume with imbalance."""

from __future__ import annotations

import numpy as np
import pytest

from moetrain.config.presets import load_cluster_config, load_model_config
from moetrain.planner.calibration import Efficiency
from moetrain.planner.comm import alltoall_time, alltoall_volume
from moetrain.planner.compute import GroupedGemm, expert_compute_time, expert_weight_grad_extra

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
    got = float(expert_compute_time(np.array([tokens]), model, h100, EFF, num_local_experts=8)[0])
    assert got == pytest.approx(_by_hand(tokens, 8))


def test_small_m_falls_off() -> None:
    """Achieved FLOP rate over a large GEMM's: bound by reading the 8 experts' 704 MB of weights up to
    about 300 tokens per expert (5 % at 16, 40 % at 128), then by half a tile of padding per expert and the
    activation traffic (94 % at 4,096)."""
    model, h100 = load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb")
    params = 3 * 7168 * 2048
    share = {}
    for m in (16, 128, 4096):
        t = float(expert_compute_time(np.array([8 * m]), model, h100, EFF, num_local_experts=8)[0])
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
    flat = float(alltoall_time(send, 64, 8, h100, top_k=8, efficiency=EFF))
    assert flat == pytest.approx(56 / 64 * send / 50e9 + 10e-6 + 3e-6)
    hot = float(alltoall_time(1.3 * send, 64, 8, h100, top_k=8, efficiency=EFF))
    assert hot - 13e-6 == pytest.approx(1.3 * (flat - 13e-6))
    # hierarchical: a token crosses the network once per node holding one of its experts, 7·(1 − (7/8)^8)
    # of the 7 other nodes, then 7/8 of the copies cross the node's links
    hier = float(alltoall_time(send, 64, 8, h100, hierarchical=True, top_k=8, efficiency=EFF))
    nodes_hit = 7 * (1 - (7 / 8) ** 8)
    assert hier == pytest.approx(nodes_hit * send / 8 / 50e9 + 10e-6 + 7 / 8 * send / 450e9 + 3e-6)


def _wgrad_extra_by_hand(tokens: float, local: int, grad_bytes: float, h: int = 7168, f: int = 2048) -> float:
    """The weight-gradient GEMM's time beyond the forward's: the same math, but the gradient buffer read and
    written (2 × grad_bytes per parameter) where the forward reads the bf16 weights (2 B)."""
    params = 3 * h * f
    math = 2.0 * params * (tokens + local * 64) / RATE + 3 * 10e-6
    io = tokens * (2 * h + 3 * f) * 2.0
    forward = max(math, (local * params * 2.0 + io) / BANDWIDTH)
    wgrad = max(math, (local * params * 2.0 * grad_bytes + io) / BANDWIDTH)
    return wgrad - forward


@pytest.mark.parametrize(("tokens_per_expert", "local", "grad_bytes"),
                         [(1024, 32, 4.0), (1024, 32, 2.0), (4096, 8, 4.0), (128, 8, 4.0)])
def test_weight_gradient_accumulation_by_hand(tokens_per_expert: int, local: int, grad_bytes: float) -> None:
    """32 DeepSeek-V3 experts of 44 M parameters at 1,024 rows each (EP 8): the math takes 4.46 ms, reading
    the bf16 weights 1.77 ms, reading and writing the FP32 gradient buffer 5.38 ms, so the weight gradient
    costs 0.92 ms more than the forward (with 16-bit buffers, 2.98 ms, the math bounds both: 0); at 4,096
    rows per expert on 8 experts the math bounds both; at 128 rows the traffic bounds both, 6 B more per
    parameter (8 read and written against 2 read)."""
    model, h100 = load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb")
    tokens = local * tokens_per_expert
    gemm = GroupedGemm(np.array([tokens]), local)
    got = float(expert_weight_grad_extra(gemm, model, h100, EFF, grad_bytes)[0])
    assert got == pytest.approx(_wgrad_extra_by_hand(tokens, local, grad_bytes), abs=1e-12)
    params = 3 * 7168 * 2048
    if (tokens_per_expert, local, grad_bytes) == (1024, 32, 4.0):
        assert got == pytest.approx((32 * params * 8.0 + tokens * (2 * 7168 + 3 * 2048) * 2.0) / BANDWIDTH
                                    - (2.0 * params * (tokens + 32 * 64) / RATE + 30e-6))
        assert got == pytest.approx(0.92e-3, abs=0.005e-3)
    if tokens_per_expert == 4096 or grad_bytes == 2.0:
        assert got == 0.0
    if tokens_per_expert == 128:
        assert got == pytest.approx(local * params * 6.0 / BANDWIDTH)


def test_weight_gradient_extra_is_in_the_backward() -> None:
    """A MoE layer's backward holds the extra once (the weight gradient, not the input gradient), and the
    step's expert time is 3 × the forward plus it."""
    from moetrain.planner.costmodel import evaluate
    from moetrain.planner.layer_costs import layer_costs
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    model, h100 = load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb")

    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    s = Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(8), etp=one(1), cp=one(1),
                   dp=one(8), zero=one(1), micro_batch=one(1), recompute=one(0.0), a2a=one(0), overlap=one(False))
    fp32, bf16 = (Workload(model, h100, 4096, 64, grad_bytes=b) for b in (4.0, 2.0))
    with_buffer, without = (layer_costs(w, s, EFF, moe_layer=True, num_micro=1) for w in (fp32, bf16))
    extra = float(with_buffer.experts_wgrad_extra[0])
    by_hand = _wgrad_extra_by_hand(4096 * 8, 32, 4.0) - _wgrad_extra_by_hand(4096 * 8, 32, 2.0)
    assert extra == pytest.approx(by_hand)
    assert float(with_buffer.bwd[0] - without.bwd[0]) == pytest.approx(extra)
    assert float(with_buffer.fwd[0]) == float(without.fwd[0])
    # the step's expert time per MoE layer pass: 3 × the forward, plus the extra
    ratio = float(evaluate(fp32, s, EFF).compute.experts_s[0] / evaluate(bf16, s, EFF).compute.experts_s[0])
    forward = float(with_buffer.experts[0])
    assert ratio == pytest.approx((3.0 * forward + extra) / (3.0 * forward))


def test_the_fixed_cost_of_a_moe_pass_is_the_kernel_chain() -> None:
    """31 kernels (DeepSeek-V3's fused router, Megatron-LM's GB200 notes) at 18.2 µs of host time each
    (455.717 ms over 25,044 launches in our H100 profile) = 0.5641 ms per pass, the same in every fit: the
    shipped one and each of its held-out fits, which no fit moves."""
    from moetrain.planner.calibration import load_calibration
    from moetrain.planner.fit import BOUNDS

    assert Efficiency().moe_overhead_us == pytest.approx(564.096, abs=0.001)
    assert "moe_overhead_us" not in BOUNDS
    shipped = load_calibration()
    assert shipped.global_params.moe_overhead_us == pytest.approx(564.096, abs=0.001)
    assert shipped.held_out_fits, "the shipped calibration keeps its held-out fits"
    for family, fit in shipped.held_out_fits.items():
        assert fit.for_device("b200").moe_overhead_us == pytest.approx(564.096, abs=0.001), family


def test_the_moe_pass_cost_is_in_the_forward_and_twice_in_the_backward() -> None:
    """A MoE layer's forward holds the pass cost once and its backward (input and weight gradients) twice:
    1.69 ms per MoE layer and micro-batch at 0.5641 ms; a dense layer holds none."""
    from dataclasses import replace

    from moetrain.planner.layer_costs import layer_costs
    from moetrain.planner.strategy import Strategies
    from moetrain.planner.workload import Workload

    def one(value: float | bool) -> np.ndarray:
        return np.array([value])

    s = Strategies(tp=one(1), sp=one(False), pp=one(1), vpp=one(1), ep=one(8), etp=one(1), cp=one(1),
                   dp=one(8), zero=one(1), micro_batch=one(1), recompute=one(0.0), a2a=one(0), overlap=one(False))
    w = Workload(load_model_config("deepseek-v3-671b"), load_cluster_config("h100-sxm-80gb"), 4096, 64)
    eff = replace(EFF, moe_overhead_us=Efficiency().moe_overhead_us)
    with_cost, without = (layer_costs(w, s, e, moe_layer=True, num_micro=1)
                          for e in (eff, replace(eff, moe_overhead_us=0.0)))
    assert float(with_cost.moe_pass) == pytest.approx(0.564096e-3, abs=1e-8)
    assert float(with_cost.fwd[0] - without.fwd[0]) == pytest.approx(0.564096e-3, abs=1e-8)
    assert float(with_cost.bwd[0] - without.bwd[0]) == pytest.approx(2 * 0.564096e-3, abs=1e-8)
    dense = layer_costs(w, s, eff, moe_layer=False, num_micro=1)
    assert float(dense.moe_pass) == 0.0
