"""Replay a routing trace through predictor, planner and trigger, as the runtime would run them.

Per MoE layer, independently (each layer has its own experts and placement):

1. step t runs with the current placement; its loads are only known afterwards (no lookahead);
2. the predictor absorbs step t's loads;
3. the re-plan rule of ``balance.schedule`` (the one the runtime uses) checks the forecast cheaply,
   solves when the drift since the last plan could pay a move or ``interval`` steps have passed, and
   migrates only if the predicted saving over the next ``horizon`` steps beats the predicted
   migration time (weights and optimizer state over the links); a new plan that only changes
   replicas' token shares moves no weights and is applied whenever it saves time;
4. a migration decided after step t is paid in step t+1: the weights' copy before it, and the optimizer
   state's copy where it outlasts step t+1's compute on that layer (``BalanceCostModel.migration_seconds``).

"Before" is the static contiguous layout; "after" is the balanced run, migration time included;
"ideal" is every rank at the mean load (no placement beats it). All times come from the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moetrain.balance.online import default_slots_per_rank
from moetrain.balance.placement import ExpertPlacement
from moetrain.balance.predict import Predictor
from moetrain.balance.schedule import Decision, LayerSchedule, LayerStep, ReplanRule
from moetrain.balance.traces import RoutingTrace
from moetrain.errors import UserError

__all__ = ["Decision", "ReplayResult", "replay"]


@dataclass
class ReplayResult:
    steps: np.ndarray
    imbalance_before: np.ndarray
    """[T, L] max/mean EP-rank load, static contiguous placement."""
    imbalance_after: np.ndarray
    """[T, L] the same with balancing."""
    seconds_before: np.ndarray
    """[T] predicted MoE-layer time per step (sum over layers), static placement."""
    seconds_after: np.ndarray
    """[T] the same with balancing, migration time included."""
    seconds_ideal: np.ndarray
    """[T] every rank at the mean load."""
    seconds_migration: np.ndarray
    """[T] the part of ``seconds_after`` that migrations add (exposed copy time)."""
    decisions: list[Decision] = field(default_factory=list)
    final_placements: list[ExpertPlacement] = field(default_factory=list)
    migration_bytes: float = 0.0
    """Bytes the migrations sent between ranks (weights and optimizer state, all layers)."""
    replica_sync_seconds: np.ndarray | None = None
    """[T] the part of ``seconds_after`` that the replicas' gradient rings add (``BalanceCostModel.
    exposed_replica_sync_seconds``: what outlasts the backward under them): what replication costs, which the
    ideal does not pay."""

    @property
    def predicted_gain(self) -> float:
        """Step-time ratio without / with balancing, minus 1 (throughput gain)."""
        return float(self.seconds_before.sum() / self.seconds_after.sum() - 1.0)

    @property
    def ideal_gain(self) -> float:
        return float(self.seconds_before.sum() / self.seconds_ideal.sum() - 1.0)

    @property
    def gap_to_ideal(self) -> float:
        """How much slower than the perfectly balanced ideal the balanced run is (0.05 = 5%):
        Σ_t time with balancing (migration included) / Σ_t time with every rank at the mean load − 1,
        equivalently (1 + ideal gain) / (1 + predicted gain) − 1."""
        return float(self.seconds_after.sum() / self.seconds_ideal.sum() - 1.0)

    @property
    def steady_gap_to_ideal(self) -> float:
        """``gap_to_ideal`` from step 1 on: step 0 runs the static layout in any run, before a load is seen."""
        return float(self.seconds_after[1:].sum() / self.seconds_ideal[1:].sum() - 1.0)

    def steady_gap_parts(self) -> dict:
        """``steady_gap_to_ideal`` split by cause, each over the ideal's time from step 1 on: the replicas'
        gradient rings (``replica_sync``: what replication costs, which the ideal does not pay), the exposed
        migration, the steps at which a load shift was seen (``shift_steps``: run on the placement made for the
        load before it, which no forecast sees coming; all layers of such a step) and the rest (``imbalance``)."""
        ideal = float(self.seconds_ideal[1:].sum())
        index = {int(step): t for t, step in enumerate(self.steps)}
        shifted = sorted({index[d.step] for d in self.decisions if d.shift and index[d.step] >= 1})
        sync = np.zeros_like(self.seconds_ideal) if self.replica_sync_seconds is None else self.replica_sync_seconds
        excess = self.seconds_after - self.seconds_ideal - self.seconds_migration - sync
        parts = {"replica_sync": float(sync[1:].sum()) / ideal,
                 "migration": float(self.seconds_migration[1:].sum()) / ideal,
                 "shift_steps": float(excess[shifted].sum()) / ideal}
        parts["imbalance"] = self.steady_gap_to_ideal - sum(parts.values())
        return {**parts, "steps_shifted": len(shifted)}

    def summary(self) -> dict:
        solve = [d.solve_ms for d in self.decisions]
        solve_cpu = [d.solve_cpu_ms for d in self.decisions]
        return {
            "steps": int(self.steps.size),
            "imbalance_before": float(self.imbalance_before.mean()),
            "imbalance_after": float(self.imbalance_after.mean()),
            "step_seconds_before": float(self.seconds_before.mean()),
            "step_seconds_after": float(self.seconds_after.mean()),
            "step_seconds_ideal": float(self.seconds_ideal.mean()),
            "predicted_gain": self.predicted_gain,
            "ideal_gain": self.ideal_gain,
            "gap_to_ideal": self.gap_to_ideal,
            "steady_gap_to_ideal": self.steady_gap_to_ideal,
            "migrations": int(sum(d.migrate for d in self.decisions)),
            "migration_seconds_total": float(self.seconds_migration.sum()),
            "migration_bytes": self.migration_bytes,
            "fallbacks": int(sum(d.fallback for d in self.decisions)),
            "shifts": int(sum(d.shift for d in self.decisions)),
            "reshares": int(sum(d.reshare for d in self.decisions)),
            "early_solves": int(sum(d.early for d in self.decisions)),
            "decisions": len(self.decisions),
            "solve_ms_mean": float(np.mean(solve)) if solve else 0.0,
            "solve_ms_max": float(np.max(solve)) if solve else 0.0,
            "solve_cpu_ms_mean": float(np.mean(solve_cpu)) if solve_cpu else 0.0,
            "solve_cpu_ms_max": float(np.max(solve_cpu)) if solve_cpu else 0.0,
        }

    def per_step(self) -> list[dict]:
        return [
            {
                "step": int(step),
                "imbalance_before": round(float(self.imbalance_before[t].mean()), 4),
                "imbalance_after": round(float(self.imbalance_after[t].mean()), 4),
                "seconds_before": float(self.seconds_before[t]),
                "seconds_after": float(self.seconds_after[t]),
                "seconds_ideal": float(self.seconds_ideal[t]),
            }
            for t, step in enumerate(self.steps)
        ]


def replay(trace: RoutingTrace, rule: ReplanRule, predictor: Predictor,
           slots_per_rank: int | None = None) -> ReplayResult:
    """Run ``trace`` through ``predictor`` and ``rule`` (its cost model prices every step), starting from the
    contiguous layout with ``slots_per_rank`` slots per EP rank (default ``experts/ep + 1``)."""
    costs = rule.costs
    ep = costs.ep
    num_experts = trace.num_experts
    if num_experts % ep:
        raise UserError(f"trace has {num_experts} experts, not divisible by ep={ep}; pick ep dividing it")
    slots = default_slots_per_rank(num_experts, ep) if slots_per_rank is None else slots_per_rank
    static = ExpertPlacement.contiguous(num_experts, ep, slots)
    loads = trace.tokens_per_expert.astype(float)  # [T, L, E]
    num_steps, num_layers = loads.shape[:2]

    imbalance_before = static.imbalance(loads)
    seconds_before = np.asarray(costs.layer_seconds(static, loads)).sum(axis=1)
    seconds_ideal = np.asarray(costs.ideal_layer_seconds(loads)).sum(axis=1)
    imbalance_after = np.empty((num_steps, num_layers))
    seconds_after = np.zeros(num_steps)
    seconds_migration = np.zeros(num_steps)
    replica_sync = np.zeros(num_steps)
    decisions: list[Decision] = []
    finals: list[ExpertPlacement] = []
    migration_bytes = 0.0

    for layer in range(num_layers):
        current = static
        state = predictor.init_state(loads[0, layer])
        schedule = LayerSchedule()
        for t in range(num_steps):
            actual = loads[t, layer]
            imbalance_after[t, layer] = float(current.imbalance(actual))
            seconds_after[t] += float(costs.layer_seconds(current, actual))
            replica_sync[t] += float(costs.exposed_replica_sync_seconds(current, actual))
            if t:
                predictor.update(state, actual)
            if t + 1 >= num_steps:
                continue
            ran = LayerStep(int(trace.steps[t]), int(trace.layers[layer]), current, actual)
            decision, adopted = rule.step(ran, schedule, predictor, state)
            if decision is None:
                continue
            decisions.append(decision)
            if adopted is not current:
                if decision.migrate:
                    # paid in step t+1: the weights before it, the optimizer state beyond its compute
                    window = costs.overlap_window_seconds(adopted, loads[t + 1, layer])
                    exposed = costs.migration_seconds(list(decision.moves), window)
                    seconds_after[t + 1] += exposed
                    seconds_migration[t + 1] += exposed
                    migration_bytes += costs.migration_bytes(list(decision.moves))
                current = adopted
        finals.append(current)
    return ReplayResult(
        trace.steps.copy(), imbalance_before, imbalance_after, seconds_before, seconds_after, seconds_ideal,
        seconds_migration, decisions, finals, migration_bytes, replica_sync,
    )
