"""Achieved compute speed: hardware peaks times efficiency curves that depend on the operation's shape.

Three operation classes (Calculon, Isaev et al. SC23, uses the same split):

- GEMMs: ``flops / (peak × gemm_max)`` plus a fixed ``gemm_overhead_us`` per call, so a small GEMM
  reaches a lower fraction of the peak than a large one (efficiency = W / (W + peak·gemm_max·t0)).
  FP8 GEMMs run ``fp8_gain`` times faster than BF16 on hardware with an FP8 peak.
- Fused attention (QKᵀ, softmax, PV): ``flops / (peak × attention)``; always BF16.
- Element-wise kernels (norms, activation functions, permutes, optimizer update): memory-bound,
  ``bytes / (HBM bandwidth × memory)``.

All functions broadcast over numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.costs.params import mlp_params
from moetrain.planner.calibration import Efficiency, load_calibration

# Grouped GEMMs pad each expert's rows to the kernel's tile; on average half a tile is wasted per expert.
GROUPED_GEMM_TILE_ROWS = 128


@lru_cache(maxsize=64)
def _default_efficiency(device: str) -> Efficiency:
    return load_calibration().for_device(device)


def _eff(cluster: ClusterConfig, efficiency: Efficiency | None) -> Efficiency:
    return efficiency if efficiency is not None else _default_efficiency(cluster.device)


def gemm_rate(cluster: ClusterConfig, eff: Efficiency, precision: str = "bf16") -> float:
    """Achieved FLOP/s of a large GEMM in ``precision``."""
    gain = eff.fp8_gain if (precision == "fp8" and cluster.peak_tflops_fp8) else 1.0
    return cluster.peak_flops("bf16") * eff.gemm_max * gain


def gemm_time(flops, num_calls, cluster: ClusterConfig, efficiency: Efficiency | None = None,
              precision: str = "bf16"):
    """Seconds for ``num_calls`` GEMMs totalling ``flops``."""
    eff = _eff(cluster, efficiency)
    return np.asarray(flops, dtype=float) / gemm_rate(cluster, eff, precision) + (
        np.asarray(num_calls, dtype=float) * eff.gemm_overhead_us * 1e-6
    )


# Fused attention spends per score element a fixed amount of non-matmul work (scale, running max, exp,
# row sums) against 2·head_dim multiply-adds, so its speed per FLOP grows with the head dimension as
# d / (d + d0). d0 ≈ 50 reproduces the head-dim ratios of the FlashAttention-3 H100 benchmarks (Shah et
# al. 2024, §4.1: head dim 64 runs at about 0.77× the FLOP rate of head dim 128, 256 at about 1.15×;
# read off their figures, approximate). ``Efficiency.attention`` is the value at head dim 128.
ATTENTION_HEAD_DIM_HALF_SPEED = 50.0
REFERENCE_HEAD_DIM = 128.0


def attention_head_dim_factor(head_dim) -> np.ndarray:
    """Attention speed at ``head_dim`` relative to head dim 128 (1.0 there)."""
    d = np.asarray(head_dim, dtype=float)
    d0, ref = ATTENTION_HEAD_DIM_HALF_SPEED, REFERENCE_HEAD_DIM
    return (d / (d + d0)) / (ref / (ref + d0))


def attention_time(flops, cluster: ClusterConfig, efficiency: Efficiency | None = None,
                   head_dim: float = REFERENCE_HEAD_DIM):
    """Seconds of fused attention (QKᵀ and PV) totalling ``flops`` with heads of ``head_dim`` (for MLA,
    the mean of the query-key and value dimensions)."""
    eff = _eff(cluster, efficiency)
    rate = cluster.peak_flops("bf16") * eff.attention * attention_head_dim_factor(head_dim)
    return np.asarray(flops, dtype=float) / rate


def memory_time(num_bytes, cluster: ClusterConfig, efficiency: Efficiency | None = None):
    """Seconds of memory-bound kernels moving ``num_bytes`` through HBM."""
    eff = _eff(cluster, efficiency)
    return np.asarray(num_bytes, dtype=float) / (cluster.hbm_bandwidth_tbps * 1e12 * eff.memory)


def mlp_matrix_count(model: ModelConfig) -> int:
    """Weight matrices (GEMM calls) per MLP: gate, up, down for swiglu; up, down otherwise."""
    return 3 if model.gated_ffn else 2


@dataclass(frozen=True)
class GroupedGemm:
    """The routed experts' grouped GEMM on one device in one MoE layer pass."""

    tokens: object
    """(token, expert) pairs the device processes: its local experts' loads summed (the hottest device's
    load prices imbalance: the all-to-all waits for it)."""
    num_local_experts: object = 1
    """Experts resident on the device; each adds half a tile of padded rows, which is why many small
    experts run slower per FLOP than few large ones."""
    etp: object = 1
    """Expert tensor-parallel size (each expert's FFN width split over ``etp`` devices)."""
    precision: str = "bf16"


@dataclass(frozen=True)
class _Roofline:
    math: np.ndarray
    """Seconds of one GEMM set's multiply-adds (forward, or input gradient, or weight gradient)."""
    weight_params: np.ndarray
    """Parameters of the device's local experts."""
    io_bytes: np.ndarray
    """The tokens' inputs and outputs of one GEMM set."""
    act_bytes: np.ndarray
    """The activation function's pass over the expert hidden states."""


def _expert_roofline(gemm: GroupedGemm, model: ModelConfig, cluster: ClusterConfig, eff: Efficiency) -> _Roofline:
    assert model.moe is not None, "the grouped GEMM prices a MoE model"
    tokens, etp = np.asarray(gemm.tokens, dtype=float), np.asarray(gemm.etp, dtype=float)
    params_per_expert = mlp_params(model, model.moe.expert_ffn_hidden) / etp
    padded_rows = tokens + np.asarray(gemm.num_local_experts) * GROUPED_GEMM_TILE_ROWS / 2
    math = gemm_time(2.0 * params_per_expert * padded_rows, mlp_matrix_count(model), cluster, eff, gemm.precision)
    io_bytes = tokens * (2 * model.hidden_size + 3 * model.moe.expert_ffn_hidden / etp) * 2.0
    act_bytes = tokens * model.moe.expert_ffn_hidden / etp * 2.0 * 3
    weight_params = np.asarray(gemm.num_local_experts, dtype=float) * params_per_expert
    return _Roofline(math, weight_params, io_bytes, act_bytes)


def expert_compute_time(
    tokens,
    model: ModelConfig,
    cluster: ClusterConfig,
    efficiency: Efficiency | None = None,
    num_local_experts=1,
    etp=1,
    precision: str = "bf16",
):
    """Forward seconds of the routed experts on one device in one MoE layer (grouped GEMM); the arguments
    are those of ``GroupedGemm``.

    Backward costs twice this (input and weight gradients), plus ``expert_weight_grad_extra``.
    """
    eff = _eff(cluster, efficiency)
    r = _expert_roofline(GroupedGemm(tokens, num_local_experts, etp, precision), model, cluster, eff)
    # Roofline: a grouped GEMM reads every local expert's weights once per pass, plus the tokens' inputs
    # and outputs; with few tokens per expert (fine-grained experts, many experts per device) that
    # traffic, not the math, sets the time (Williams et al. 2009). Weights in the GEMM precision.
    weight_bytes = r.weight_params * (1.0 if precision == "fp8" else 2.0)
    traffic = memory_time(weight_bytes + r.io_bytes, cluster, eff)
    return np.maximum(r.math, traffic) + memory_time(r.act_bytes, cluster, eff)


def expert_weight_grad_extra(gemm: GroupedGemm, model: ModelConfig, cluster: ClusterConfig,
                             efficiency: Efficiency | None = None, grad_bytes: float = 4.0):
    """Seconds the experts' weight-gradient GEMM takes beyond the forward's GEMM set, per micro-batch.

    The stacks accumulate each micro-batch's weight gradient into the gradient buffer inside the GEMM
    (Megatron-Core ``--gradient-accumulation-fusion`` into ``main_grad``; Transformer Engine's
    ``GroupedLinear(fuse_wgrad_accumulation=True)``, the GEMM's C input read and D output written in the
    buffer's dtype; the buffer is FP32 unless gradients are reduced in 16 bits: ``grad_bytes``). So the
    weight-gradient GEMM moves every local expert's gradient twice, read and written, where the forward
    reads its weights once in 1-2 bytes. With many local experts and few tokens each (DeepSeek-V3 on EP8:
    32 experts of 44 M parameters, about 1,000 rows each) that traffic, not the math, sets its time."""
    eff = _eff(cluster, efficiency)
    r = _expert_roofline(gemm, model, cluster, eff)
    forward_traffic = memory_time(r.weight_params * (1.0 if gemm.precision == "fp8" else 2.0) + r.io_bytes,
                                  cluster, eff)
    wgrad_traffic = memory_time(r.weight_params * 2.0 * grad_bytes + r.io_bytes, cluster, eff)
    return np.maximum(r.math, wgrad_traffic) - np.maximum(r.math, forward_traffic)
