"""What online expert balancing needs from a run's layout, checked before any process starts.

Torch-free, so that the launcher can refuse a bad combination of flags up front; the runtime half is
``moetrain.distributed.balancing``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.balance.predict import parse_predictor
from moetrain.config import ModelConfig, ParallelConfig
from moetrain.errors import UserError


@dataclass(frozen=True)
class BalanceDefaults:
    """The settings a user gets without flags, in one place: ``moetrain balance``, ``moetrain train
    --online-balance`` (``OnlineExpertBalancer``, ``build_balanced_run``), the replay and
    ``benchmarks/balance_families.py`` all read ``BALANCE_DEFAULTS``. They are the best of the sweep in
    ``benchmarks/balance_defaults.py`` (``benchmarks/results/balance_defaults.json``; a test checks that they
    still are), and the families benchmark runs with them."""

    interval: int = 5
    """Steps between full re-plans (cheap drift checks run every step)."""
    horizon: int = 50
    """Steps over which a migration's predicted saving must repay its cost."""
    predictor: str = "adaptive"
    """``balance.predict.parse_predictor`` spelling: the bank of EMA and Holt forecasts."""
    spare_slots_per_rank: int = 1
    """Expert slots per EP rank beyond ``experts/ep``: room for replicas of hot experts."""
    solver: str = "local"
    trigger_margin: float = 1.0
    """Migrate when the saving beyond the forecast noise exceeds this many times the migration time."""

    def slots_per_rank(self, num_experts: int, ep: int) -> int:
        return num_experts // ep + self.spare_slots_per_rank

    def build_predictor(self):
        return parse_predictor(self.predictor)


BALANCE_DEFAULTS = BalanceDefaults()
REPLAN_INTERVAL = BALANCE_DEFAULTS.interval
"""Default steps between full re-plans (``BALANCE_DEFAULTS.interval``)."""
PAYBACK_HORIZON = BALANCE_DEFAULTS.horizon
"""Default steps over which a migration's predicted saving must repay its cost (``BALANCE_DEFAULTS.horizon``)."""


def default_slots_per_rank(num_experts: int, ep: int) -> int:
    """``experts/ep + 1`` (``BALANCE_DEFAULTS.spare_slots_per_rank``): one spare slot per EP rank, so that the
    solver may replicate a hot expert (the default of ``moetrain balance`` and ``--online-balance``)."""
    return BALANCE_DEFAULTS.slots_per_rank(num_experts, ep)


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
        check_slots_per_rank(slots_per_rank, model_cfg.moe.num_experts, parallel.ep)


def check_slots_per_rank(slots_per_rank: int, num_experts: int, ep: int) -> None:
    """Enough slots for every expert, and no more than a rank can fill: it holds at most one replica of
    each expert."""
    needed = -(-num_experts // ep)
    spare = BALANCE_DEFAULTS.spare_slots_per_rank
    default = f"default {needed + spare}: {'one spare slot' if spare == 1 else f'{spare} spare slots'} for replicas"
    if slots_per_rank < needed:
        raise UserError(f"--slots-per-rank {slots_per_rank} cannot hold {num_experts} experts on {ep} ranks; give at "
                        f"least {needed} ({default})")
    if slots_per_rank > num_experts:
        raise UserError(f"--slots-per-rank {slots_per_rank}: a rank holds at most one replica of each of the "
                        f"{num_experts} experts; give at most {num_experts} ({default})")
