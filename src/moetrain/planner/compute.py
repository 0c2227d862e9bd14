"""Achieved compute speed: hardware peaks times efficiency curves that depend on the operation's shape.

Three operation classes (Calculon, Isaev et al. SC23, uses the same split):

- GEMMs: ``flops / (peak × gemm_max)`` plus a fixed ``gemm_overhead_us`` per call, so a small GEMM
  reaches a lower fraction of the peak than a large one (efficiency = W / (W + peak·gemm_max·t0)).
  FP8 GEMMs run ``fp8_gain`` times faster than BF16 on hardware with an FP8 peak; quantising their
  operands is an element-wise cost apart (``layer_costs.FP8_CAST_BYTES_PER_ELEMENT``).
- Fused attention (QKᵀ, softmax, PV): ``flops / (peak × attention)`` at head dim 128 on Hopper, scaled by
  head dim and architecture (``attention_speed_factor``); always BF16.
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
from moetrain.planner.calibration import Efficiency, arch_of, load_calibration

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
# read off their figures, approximate). ``Efficiency.attention`` is the value at head dim 128 on Hopper.
ATTENTION_HEAD_DIM_HALF_SPEED = 50.0
REFERENCE_HEAD_DIM = 128.0
# d0 is that non-matmul work counted in tensor-core time, so it grows with the tensor cores' FLOP per SM and
# clock where the units doing the rest do not. From Hopper to Blackwell the tensor cores doubled per SM while
# the exponential units (16 per clock and SM) and shared-memory bandwidth (128 B per clock and SM) stayed
# (Zadouri et al. 2026, FlashAttention-4, §2: the forward is bound by the exponential, the backward by shared
# memory): d0 ≈ 100. That puts head dim 128 on Blackwell at 0.78 of Hopper's share of peak; the published
# kernels agree: cuDNN 9.13 reaches about 1,235 TFLOPS of a B200's 2,250 (55 %; FlashAttention-4's 1,605 is
# "up to 1.3×" it), FlashAttention-3 740 of an H100's 989 (75 %), a ratio of 0.73.
ATTENTION_NON_MATMUL_SCALE: dict[str, float] = {"blackwell": 2.0}
# Share of the peak the fused attention kernel reaches on an architecture over its share on Hopper.
# ``Efficiency.attention``, fitted on published runs, sits at the share of a kernel written before Hopper
# (0.25 of peak forward, where this project's H100 probe measured FlashAttention-2 at 0.31 and cuDNN at
# 0.58: benchmarks/results/gpu_attention_probe.json), not at Hopper's own kernels'. FlashAttention-2 was
# written for Ampere: it reaches 50-73 % of an A100's peak (Dao 2023, arXiv:2307.08691, abstract) and 35 %
# of an H100's, whose asynchronous tensor-core and copy instructions it does not use (Shah et al. 2024,
# FlashAttention-3, arXiv:2407.08608, abstract). So an Ampere device runs fused attention at
# (50 + 73) / 2 / 35 = 1.76 times the Hopper share. (Blackwell's scale above compares its cuDNN kernel with
# FlashAttention-3 on Hopper instead; its rows, predicted too fast already, do not support pricing it
# against the FlashAttention-2 share.)
ATTENTION_SHARE_OVER_HOPPER: dict[str, float] = {"ampere": (0.50 + 0.73) / 2 / 0.35}


def attention_speed_factor(head_dim, arch: str = "hopper") -> np.ndarray:
    """Attention speed (share of ``arch``'s peak) at ``head_dim`` on ``arch`` (``calibration.arch_of``)
    relative to head dim 128 on Hopper (1.0 there): the head-dim law with the architecture's d0, times
    the architecture's kernel share (``ATTENTION_SHARE_OVER_HOPPER``)."""
    d = np.asarray(head_dim, dtype=float)
    d0, ref = ATTENTION_HEAD_DIM_HALF_SPEED, REFERENCE_HEAD_DIM
    d0_arch = d0 * ATTENTION_NON_MATMUL_SCALE.get(arch, 1.0)
    return (d / (d + d0_arch)) / (ref / (ref + d0)) * ATTENTION_SHARE_OVER_HOPPER.get(arch, 1.0)


def attention_time(flops, cluster: ClusterConfig, efficiency: Efficiency | None = None,
                   head_dim: float = REFERENCE_HEAD_DIM):
    """Seconds of fused attention (QKᵀ and PV) totalling ``flops`` with heads of ``head_dim`` (for MLA,
    the mean of the query-key and value dimensions) on ``cluster``'s devices."""
    eff = _eff(cluster, efficiency)
    factor = attention_speed_factor(head_dim, arch_of(cluster.device))
    return np.asarray(flops, dtype=float) / (cluster.peak_flops("bf16") * eff.attention * factor)


def memory_time(num_bytes, cluster: ClusterConfig, efficiency: Efficiency | None = None):
    """Seconds of memory-bound kernels moving ``num_bytes`` through HBM."""
    eff = _eff(cluster, efficiency)
    return np.asarray(num_bytes, dtype=float) / (cluster.hbm_bandwidth_tbps * 1e12 * eff.memory)


def mlp_matrix_count(model: ModelConfig) -> int:
    """Weight matrices (GEMM calls) per MLP: gate, up, down for swiglu; up, down otherwise."""
    return 3 if model.gated_ffn else 2


@dataclass(frozen=True)
class ExpertShard:
    """What one device holds of an MoE layer's routed experts. Fields broadcast like ``expert_compute_time``'s
    tokens (one value, or one per candidate layout)."""

    num_local_experts: object = 1
    """Experts resident on the device; each adds half a tile of padded rows to the grouped GEMM, which is
    why many small experts run slower per FLOP than few large ones."""
    etp: object = 1
    """Expert tensor-parallel size: each expert's FFN width is split over ``etp`` devices."""


def expert_compute_time(tokens, model: ModelConfig, cluster: ClusterConfig, efficiency: Efficiency | None = None,
                        shard: ExpertShard | None = None, precision: str = "bf16"):
    """Forward seconds of the routed experts on one device in one MoE layer (grouped GEMM).

    Args:
        tokens: (token, expert) pairs the device processes: its local experts' loads summed. Pass the
            hottest device's load to price imbalance (the all-to-all waits for it).
        shard: the device's experts (default: one whole expert).

    Backward costs twice this (input and weight gradients).
    """
    assert model.moe is not None, "expert_compute_time needs a MoE model"
    eff = _eff(cluster, efficiency)
    shard = shard or ExpertShard()
    num_local_experts, etp = shard.num_local_experts, shard.etp
    params_per_expert = mlp_params(model, model.moe.expert_ffn_hidden) / np.asarray(etp, dtype=float)
    per_token = 2.0 * params_per_expert
    padded_rows = np.asarray(tokens, dtype=float) + np.asarray(num_local_experts) * GROUPED_GEMM_TILE_ROWS / 2
    flops = per_token * padded_rows
    act_bytes = np.asarray(tokens, dtype=float) * model.moe.expert_ffn_hidden / np.asarray(etp) * 2.0 * 3
    # Roofline: a grouped GEMM reads every local expert's weights once per pass, plus the tokens' inputs
    # and outputs; with few tokens per expert (fine-grained experts, many experts per device) that
    # traffic, not the math, sets the time (Williams et al. 2009). Weights in the GEMM precision.
    weight_bytes = np.asarray(num_local_experts, dtype=float) * params_per_expert * (
        1.0 if precision == "fp8" else 2.0)
    io_bytes = np.asarray(tokens, dtype=float) * (2 * model.hidden_size + 3 * model.moe.expert_ffn_hidden
                                                  / np.asarray(etp, dtype=float)) * 2.0
    math = gemm_time(flops, mlp_matrix_count(model), cluster, eff, precision)
    traffic = memory_time(weight_bytes + io_bytes, cluster, eff)
    return np.maximum(math, traffic) + memory_time(act_bytes, cluster, eff)
