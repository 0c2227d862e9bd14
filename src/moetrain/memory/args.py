"""The memory-policy flags shared by ``moetrain memory`` and ``moetrain train``."""

from __future__ import annotations

import argparse

from moetrain.errors import UserError
from moetrain.memory.policy import POLICIES, DeviceSpeed, PolicyResult, choose_memory_plan

GIB = 1024**3


def add_memory_policy_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory policy (recompute and swap)")
    g.add_argument("--policy", choices=POLICIES, default="none",
                   help="none | full (whole layers) | selective (fine-grained recompute) | auto (budgeted greedy)")
    budget = g.add_mutually_exclusive_group()
    budget.add_argument("--budget-fraction", type=float, default=None,
                        help="activation budget as a fraction of the no-recompute activation bytes")
    budget.add_argument("--budget-gib", type=float, default=None, help="activation budget in GiB")


def budget_bytes_from_args(args: argparse.Namespace, baseline_bytes: float) -> float | None:
    fraction, gib = getattr(args, "budget_fraction", None), getattr(args, "budget_gib", None)
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise UserError(f"--budget-fraction {fraction} must be in (0, 1]")
        return fraction * baseline_bytes
    if gib is not None:
        if gib <= 0:
            raise UserError(f"--budget-gib {gib} must be positive")
        return gib * GIB
    if getattr(args, "policy", "none") == "auto":
        raise UserError("--policy auto needs a budget: add --budget-fraction F or --budget-gib G")
    return None


def uses_flash_attention(model_cfg, device_type: str) -> bool:
    """Fused attention keeps no S×S probabilities: always on CUDA; on CPU torch uses its fused kernel
    only when the QK and V head dims agree (else the math fallback)."""
    return device_type == "cuda" or model_cfg.attention.qk_head_dim == model_cfg.attention.v_head_dim


def plan_from_args(model_cfg, args: argparse.Namespace, seq_len: int, micro_batch: int, dtype_bytes: float,
                   device_type: str, speed: DeviceSpeed) -> PolicyResult:
    flash = uses_flash_attention(model_cfg, device_type)
    probe = choose_memory_plan(model_cfg, seq_len, micro_batch, "none", None, speed, dtype_bytes, flash)
    budget = budget_bytes_from_args(args, probe.baseline_bytes)
    return choose_memory_plan(model_cfg, seq_len, micro_batch, args.policy, budget, speed, dtype_bytes, flash)


def apply_memory_policy_from_args(model, args: argparse.Namespace, seq_len: int, micro_batch: int,
                                  speed: DeviceSpeed | None = None):
    """Choose the plan the flags ask for and install it on ``model``; returns (PolicyResult, handle or None).

    ``speed`` defaults to a nominal one (the ranking only needs relative costs)."""
    import torch

    from moetrain.memory.runtime import apply_memory_policy

    param = next(model.parameters())
    device_type = param.device.type
    if speed is None:
        speed = DeviceSpeed(flops_per_s=4e14, bytes_per_s=2e12, host_link_bytes_per_s=2.5e10) if (
            device_type == "cuda") else DeviceSpeed(flops_per_s=5e10, bytes_per_s=1e10)
    dtype_bytes = float(torch.finfo(param.dtype).bits // 8)
    result = plan_from_args(model.cfg, args, seq_len, micro_batch, dtype_bytes, device_type, speed)
    if args.policy == "none":
        return result, None
    return result, apply_memory_policy(model, result.plan)
