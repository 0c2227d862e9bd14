"""How many spare expert slots per rank to give the placement: a cost/benefit choice, priced by replay.

A spare slot lets the solver replicate an expert: the only way to balance a single expert that carries
more than a rank's mean load, and a finer packing for the rest. It costs memory on every rank (the
slot's weights, optimizer state and gradient, in every MoE layer) and, when used, the replicas' gradient
all-reduce (already inside the replayed step time). ``choose_spare_slots`` replays one trace with each
candidate count and recommends the fewest spare slots whose step time is within ``tolerance`` of the
best candidate's (DeepSeek's EPLB fixes the redundant experts per rank by hand; here the replay decides).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.predict import Predictor
from moetrain.balance.replay import replay
from moetrain.balance.schedule import ReplanRule
from moetrain.balance.traces import RoutingTrace
from moetrain.errors import UserError

DEFAULT_SPARE_OPTIONS = (0, 1, 2)
SPARE_TOLERANCE = 0.005
"""Step time within this fraction of the best option's counts as no worse."""


@dataclass(frozen=True)
class SpareSlotOption:
    spare_per_rank: int
    slots_per_rank: int
    step_seconds: float
    """Mean predicted MoE-layer time per step (sum over layers), migration included."""
    predicted_gain: float
    gap_to_ideal: float
    memory_bytes_per_rank: float
    """What the spare slots hold on one rank over all MoE layers of the model: weights, optimizer state
    and gradient of one expert slice per slot."""


@dataclass(frozen=True)
class SpareSlotChoice:
    options: tuple[SpareSlotOption, ...]
    recommended: SpareSlotOption
    tolerance: float


def spare_slot_bytes(costs: BalanceCostModel) -> float:
    """Memory one spare slot per rank costs, over all MoE layers of the model (bytes per rank)."""
    moe_layers = costs.model.num_moe_layers
    per_param = costs.bytes_per_param + costs.grad_bytes_per_param
    return costs.params_per_slice * per_param * moe_layers


def choose_spare_slots(
    trace: RoutingTrace, rule: ReplanRule, predictor: Predictor,
    options: tuple[int, ...] = DEFAULT_SPARE_OPTIONS, tolerance: float = SPARE_TOLERANCE,
) -> SpareSlotChoice:
    """Replay ``trace`` under ``rule`` with ``experts/ep + spare`` slots per rank for each spare count in
    ``options``; recommend the fewest spare slots whose step time is within ``tolerance`` of the best option's."""
    if not options or min(options) < 0:
        raise UserError(f"spare slot options {options} must be a non-empty list of counts >= 0")
    costs = rule.costs
    per_rank = trace.num_experts // costs.ep
    rows = []
    for spare in sorted(set(options)):
        result = replay(trace, rule, predictor, slots_per_rank=per_rank + spare)
        rows.append(SpareSlotOption(spare, per_rank + spare, float(result.seconds_after.mean()),
                                    result.predicted_gain, result.gap_to_ideal, spare * spare_slot_bytes(costs)))
    best = min(row.step_seconds for row in rows)
    recommended = next(row for row in rows if row.step_seconds <= (1.0 + tolerance) * best)
    return SpareSlotChoice(tuple(rows), recommended, tolerance)
