"""What online expert balancing needs from a run's layout, checked before any process starts.

Torch-free, so that the launcher can refuse a bad combination of flags up front; the runtime half is
``moetrain.distributed.balancing``.
"""

from __future__ import annotations

from moetrain.config import ModelConfig, ParallelConfig
from moetrain.errors import UserError

REPLAN_INTERVAL = 10
"""Default steps between full re-plans (cheap drift checks run every step)."""
PAYBACK_HORIZON = 50
"""Default steps over which a migration's predicted saving must repay its cost."""


def default_slots_per_rank(num_experts: int, ep: int) -> int:
    """``experts/ep + 1``: one spare slot per EP rank, so that the solver may replicate a hot expert
    (the default of ``moetrain balance``)."""
    return num_experts // ep + 1


def check_online_balance(parallel: ParallelConfig, model_cfg: ModelConfig, interval: int | None = None,
                         horizon: int | None = None, slots_per_rank: int | None = None) -> None:
    """Refuse ``--online-balance`` (and its tuning flags) where it cannot run (one line each). None: the
    flag was not given (its default applies)."""
    interval = REPLAN_INTERVAL if interval is None else interval
    horizon = PAYBACK_HORIZON if horizon is None else horizon
    if interval < 1 or horizon < 1:
        raise UserError(f"--balance-interval {interval} and --balance-horizon {horizon} must be >= 1")
    if model_cfg.moe is None:
        raise UserError(f"--online-balance needs an MoE model; {model_cfg.name} has no MoE layers")
    if parallel.ep <= 1:
        raise UserError("--online-balance moves experts between expert-parallel ranks; give --ep > 1")
    if parallel.zero >= 2:
        raise UserError(f"--online-balance moves ZeRO-1 optimizer shards; it does not run with zero {parallel.zero} "
                        "yet: use zero 1")
    if slots_per_rank is not None:
        needed = -(-model_cfg.moe.num_experts // parallel.ep)
        if slots_per_rank < needed:
            raise UserError(f"--slots-per-rank {slots_per_rank} cannot hold {model_cfg.moe.num_experts} experts on "
                            f"{parallel.ep} ranks; give at least {needed} "
                            f"(default {needed + 1}: one spare slot for replicas)")
