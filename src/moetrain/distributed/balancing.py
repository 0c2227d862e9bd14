"""Online expert balancing inside the expert-parallel runtime, in three parts of one concept each:

* **load accounting** (``moetrain.distributed.expert_telemetry``): forward hooks keep each MoE layer's tokens
  per logical expert on the device; after the optimizer step one all-reduce and one host read give the
  step's ``StepLoads``, taken where the step already synchronises to report its loss;
* **decision** (``BalancePlanner``, here): per MoE layer after every step, the re-plan rule of
  ``moetrain.balance.schedule``, the one ``moetrain.balance.replay`` models: a cheap cost-model check of the
  forecast load; a solve (incremental, warm-started from the current placement) when the drift since the
  last plan could pay a move, and a full re-plan every ``interval`` steps; the trigger compares the predicted
  saving over the next ``horizon`` steps with the cost model's time to move the experts' weights and
  optimizer state. Each solve is reported as a ``Decision``. Every rank of the stage sees the same loads and
  runs the same deterministic check; the solves a step is due are split over the EP group's ranks
  (``SplitSearches``, round robin) and their results all-gathered, so all ranks take the same decisions for
  the time of the busiest rank's share, not of every layer's solve;
* **migration execution** (``moetrain.distributed.migration_executor``): the moved slots' weights land where
  the layer's experts first run in the next step, their fp32 master and AdamW moments follow as
  point-to-point pieces between the ZeRO shards that hold them, landed before the next optimizer update.

``OnlineExpertBalancer`` runs them in that order after every step and switches each layer's dispatcher to
its new table. Replicas: ``ReplicaGradients`` sums each replicated expert's gradient over its replicas before
the ZeRO step (``ReplicaSyncedOptimizer``; replicas then receive identical updates and stay bit-identical),
and takes the extra replicas back out of the global gradient norm so that clipping sees each expert once, as
in a run without replicas; each layer's rings start as soon as its gradients are final, under the rest of the
backward (``moetrain.distributed.replica_gradients``). Training math is unchanged by a migration; only float
summation order differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.online import BALANCE_DEFAULTS, check_online_balance, default_slots_per_rank
from moetrain.balance.placement import ExpertPlacement, Move
from moetrain.balance.predict import Predictor
from moetrain.balance.schedule import Decision, LayerSchedule, LayerStep, ReplanRule, SearchResult, SolveJob
from moetrain.config import ClusterConfig, ModelConfig, TrainingConfig
from moetrain.config.model import moe_layer_indices
from moetrain.distributed.ep import ExpertTable
from moetrain.distributed.expert_telemetry import LoadTelemetry, StepLoads, moe_layers
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.migration_executor import MigrationExecutor
from moetrain.distributed.parallelize import StageModel, parallelize
from moetrain.distributed.pipeline import Executor
from moetrain.distributed.replica_gradients import ReplicaGradients
from moetrain.distributed.step import LayoutRun
from moetrain.distributed.zero import ZeroAdamW
from moetrain.errors import UserError
from moetrain.models.attention import AttentionBackend
from moetrain.models.transformer import MoETransformer, build_model

__all__ = ["BalancePlanner", "BalancedRunSetup", "BalancerTuning", "LoadTelemetry", "OnlineExpertBalancer",
           "ReplicaGradients", "ReplicaSyncedOptimizer", "SplitSearches", "StepLoads", "build_balanced_run",
           "moe_layers", "search_here"]


class ReplicaSyncedOptimizer:
    """The ZeRO optimizer with replicated experts' gradients summed first (same interface)."""

    def __init__(self, inner: ZeroAdamW, balancer: OnlineExpertBalancer) -> None:
        self.inner, self.balancer = inner, balancer

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def expect_backward(self, num_backward: int) -> None:
        """Called by the step before its backward passes (one per micro-batch): the replicated experts'
        gradient rings then start under the backward (``ReplicaGradients``)."""
        self.balancer.replicas.expect_backward(self.balancer.placements, num_backward)

    def step(self, lr: float) -> torch.Tensor:
        grad_norm = self.reduce_gradients()
        self.inner.apply_update(lr, grad_norm)
        return grad_norm

    def reduce_gradients(self) -> torch.Tensor:
        self.balancer.finish_migration()  # the moved experts' optimizer state, in flight since the last step
        correction = self.balancer.sum_replica_gradients()
        return self.inner.reduce_gradients(norm_sq_correction=correction)

    def moments_by_name(self) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
        self.balancer.finish_migration()
        return self.inner.moments_by_name()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@dataclass
class PlannedStep:
    """What the planner decided after one step: its decisions, each layer's moves (empty: none) and the
    placement each layer runs next (the current one unless a migration or a reshare was adopted)."""

    decisions: list[Decision]
    moves_by_layer: list[list[Move]]
    adopted: list[ExpertPlacement]


def search_here(rule: ReplanRule, jobs: list[SolveJob]) -> list[SearchResult]:
    """Every due solve in this process."""
    return [rule.search(job) for job in jobs]


@dataclass
class SplitSearches:
    """The due solves split over a process group, round robin over the whole run (the n-th solve of the run
    goes to rank n mod size), and one all-gather of each step's results gives every rank all of them. Every
    rank holds the same jobs (same loads, same check), so the ranks agree on the job count, on who searches
    what and on each result; a step waits for the busiest rank's share, and over a run no rank runs more
    than one solve beyond an even share."""

    group: dist.ProcessGroup
    searched: int = 0
    """Solves this rank ran (the others came from its peers)."""
    assigned: int = 0
    """Solves handed out so far, the same count on every rank."""

    def __call__(self, rule: ReplanRule, jobs: list[SolveJob]) -> list[SearchResult]:
        if not jobs:
            return []
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        mine = {index: _search_or_error(rule, job) for index, job in enumerate(jobs)
                if (self.assigned + index) % size == rank}
        self.assigned += len(jobs)
        self.searched += len(mine)
        gathered: list[dict[int, SearchResult | Exception] | None] = [None] * size
        dist.all_gather_object(gathered, mine, group=self.group)
        found = {index: result for part in gathered if part for index, result in part.items()}
        failed = [result for result in found.values() if isinstance(result, Exception)]
        if failed:
            raise failed[0]  # on every rank, as when each ran every solve, not a peer left waiting
        return [found[index] for index in range(len(jobs))]


def _search_or_error(rule: ReplanRule, job: SolveJob) -> SearchResult | Exception:
    try:
        return rule.search(job)
    except Exception as error:  # noqa: BLE001 - sent to the peers, raised on every rank after the gather
        return error


@dataclass
class BalancePlanner:
    """The decision part: predictor state, re-plan schedule and placement of every local MoE layer.
    ``searches`` runs the step's due solves (default: all here; ``SplitSearches`` over the EP group)."""

    rule: ReplanRule
    predictor: Predictor
    layer_ids: list[int]
    placements: list[ExpertPlacement]
    schedules: list[LayerSchedule] = field(default_factory=list)
    predictor_states: list[dict[str, np.ndarray]] | None = None
    searches: Callable[[ReplanRule, list[SolveJob]], list[SearchResult]] = search_here

    def __post_init__(self) -> None:
        if not self.schedules:
            self.schedules = [LayerSchedule() for _ in self.layer_ids]

    def plan(self, step: int, per_group: np.ndarray) -> PlannedStep:
        """Absorb one step's loads [L, E] (of one EP group) and run the re-plan rule on every layer: the check
        of each, then the due solves at once (``searches``), then each solve's trigger."""
        if self.predictor_states is None:
            self.predictor_states = [self.predictor.init_state(row) for row in per_group]
        else:
            for state, row in zip(self.predictor_states, per_group):
                self.predictor.update(state, row)
        jobs = [self.rule.check(LayerStep(step, layer, self.placements[index], per_group[index]),
                                self.schedules[index], self.predictor, self.predictor_states[index])
                for index, layer in enumerate(self.layer_ids)]
        found = iter(self.searches(self.rule, [job for job in jobs if job is not None]))
        planned = PlannedStep([], [], [])
        for index, job in enumerate(jobs):
            if job is None:
                planned.moves_by_layer.append([])
                planned.adopted.append(self.placements[index])
                continue
            decision, adopted = self.rule.finish(job, self.schedules[index], next(found))
            planned.decisions.append(decision)
            planned.moves_by_layer.append(list(decision.moves) if decision.migrate else [])
            planned.adopted.append(adopted)
        return planned

    def state_dict(self) -> dict:
        """Every layer's placement, predictor state and schedule, as JSON-ready values."""
        return {
            "num_ranks": self.placements[0].num_ranks,
            "slots_per_rank": self.placements[0].slots_per_rank,
            "predictor": self.predictor.name,
            "layers": {
                str(layer): {
                    "slot_expert": placement.slot_expert.tolist(),
                    "slot_share": placement.slot_share.tolist(),
                    "predictor_state": None if self.predictor_states is None else
                    {k: v.tolist() for k, v in self.predictor_states[index].items()},
                    "schedule": self.schedules[index].state_dict(),
                }
                for index, (layer, placement) in enumerate(zip(self.layer_ids, self.placements))
            },
        }

    def load_state_dict(self, state: dict) -> bool:
        """Adopt a saved state; False, changing nothing, when its EP size, slot count or layers differ."""
        layers = state.get("layers", {})
        current = self.placements[0]
        if (state.get("num_ranks") != current.num_ranks or state.get("slots_per_rank") != current.slots_per_rank
                or any(str(layer) not in layers for layer in self.layer_ids)):
            return False
        self.placements = [
            ExpertPlacement(current.num_experts, current.num_ranks, current.slots_per_rank,
                            np.array(layers[str(layer)]["slot_expert"], dtype=np.int64),
                            np.array(layers[str(layer)]["slot_share"], dtype=np.float64))
            for layer in self.layer_ids
        ]
        saved_states = [layers[str(layer)].get("predictor_state") for layer in self.layer_ids]
        if state.get("predictor") == self.predictor.name and all(s is not None for s in saved_states):
            self.predictor_states = [{k: np.array(v, dtype=np.float64) for k, v in s.items()} for s in saved_states]
        saved_schedules = [layers[str(layer)].get("schedule") for layer in self.layer_ids]
        if all(s is not None for s in saved_schedules):
            self.schedules = [LayerSchedule.from_state_dict(s) for s in saved_schedules]
        return True


@dataclass(frozen=True)
class BalancerTuning:
    """How the balancer decides, and what its moves and replica rings overlap (defaults: ``BALANCE_DEFAULTS``).

    ``trigger_margin``: migrate when the predicted saving over ``horizon`` steps exceeds
    ``trigger_margin`` × the predicted migration time (1 is break-even; 0 migrates whenever the
    candidate is predicted faster; ``inf`` only observes). ``interval``: steps between full re-plans;
    ``adaptive``: also check after every step and re-plan incrementally when the drift pays a move
    (``balance.schedule``); False solves every ``interval`` steps only. The last three are the cost
    model's (``BalanceCostModel``): what runs under the step's compute rather than exposed.
    """

    interval: int = BALANCE_DEFAULTS.interval
    horizon: int = BALANCE_DEFAULTS.horizon
    predictor: Predictor = field(default_factory=BALANCE_DEFAULTS.build_predictor)
    solver: str = BALANCE_DEFAULTS.solver
    trigger_margin: float = BALANCE_DEFAULTS.trigger_margin
    adaptive: bool = True
    time_experts: bool = False
    """Time each rank's expert forward on the host (``LoadTelemetry``)."""
    defer_weights: bool = True
    defer_optimizer_state: bool = True
    overlap_replica_rings: bool = True
    split_searches: bool = True
    """Split each step's due solves over the EP group's ranks (``SplitSearches``); False: every rank runs
    every solve (the same decisions, for comparison)."""


@dataclass(frozen=True)
class BalancedRunSetup:
    """What a balanced run starts from beyond its layout's inputs, and how its balancer is tuned.

    ``model``: a full model built by the caller (e.g. with a skewed router); default: ``build_model``
    with the run's seed and ``backend``. ``placement``: the starting table; default: the contiguous layout
    with ``slots_per_rank`` slots (default ``experts/ep + 1``, as ``moetrain balance``).
    """

    model: MoETransformer | None = None
    placement: ExpertPlacement | None = None
    slots_per_rank: int | None = None
    backend: AttentionBackend = "eager"
    tuning: BalancerTuning = field(default_factory=BalancerTuning)


@dataclass
class OnlineExpertBalancer:
    """Load accounting → decision → migration execution, between training steps (``BalancerTuning``)."""

    stage: StageModel
    optimizer: ZeroAdamW
    costs: BalanceCostModel
    tuning: BalancerTuning = field(default_factory=BalancerTuning)
    decisions: list[Decision] = field(default_factory=list)
    history: list[StepLoads] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stage.expert_table is None:
            raise UserError("expert balancing needs expert parallelism (ep > 1)")
        tuning = self.tuning
        # the rule checks the tuning (interval, horizon, solver) before anything is built
        rule = ReplanRule(self.costs, tuning.interval, tuning.horizon, tuning.solver, tuning.trigger_margin,
                          adaptive=tuning.adaptive)
        model, dims = self.stage.model, self.stage.dims
        self.ep_group = dims.get_group("ep")
        self.load_group = dims.get_group("stage")
        self.ep_groups_per_stage = dims.size("stage") // dims.size("ep")
        """EP groups whose tokens the stage-wide load counts add up (edp · etp of them)."""
        self.device = next(model.parameters()).device
        self.telemetry = LoadTelemetry(model, tuning.time_experts)
        initial = ExpertPlacement.from_slot_experts(model.cfg.moe.num_experts,
                                                    np.array(self.stage.expert_table.experts_by_rank))
        self.searches = SplitSearches(self.ep_group) if tuning.split_searches else None
        self.planner = BalancePlanner(rule, tuning.predictor, [layer for layer, _ in self.telemetry.layers],
                                      [initial for _ in self.telemetry.layers],
                                      searches=self.searches or search_here)
        self.executor = MigrationExecutor(self.stage, self.optimizer, self.costs, self.telemetry.layers)
        self.replicas = ReplicaGradients(self.telemetry.layers, self.ep_group, dims.size("edp"), self.device,
                                         overlap=self.costs.overlap_replica_rings)
        self.migrations = 0

    @property
    def placements(self) -> list[ExpertPlacement]:
        return self.planner.placements

    @property
    def migration_timings(self) -> list[dict[str, float]]:
        """Per migration, host seconds (``MigrationExecutor.timings``)."""
        return self.executor.timings

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    def wrap(self, optimizer: ZeroAdamW) -> ReplicaSyncedOptimizer:
        return ReplicaSyncedOptimizer(optimizer, self)

    def sum_replica_gradients(self) -> torch.Tensor | None:
        """``ReplicaGradients.sum`` under the current placements."""
        return self.replicas.sum(self.placements)

    def read_loads(self, step: int) -> StepLoads:
        """This step's counts over the stage, read to the host once (``LoadTelemetry.read``)."""
        return self.telemetry.read(step, self.placements, self.load_group)

    def after_step(self, step: int) -> list[Decision]:
        """Call after every optimizer step (``step`` counted from 0). Returns this call's decisions."""
        loads = self.read_loads(step)
        self.history.append(loads)
        # the cost model prices one EP group; the stage's counts cover all of its EP groups
        planned = self.planner.plan(step, loads.tokens_per_expert / self.ep_groups_per_stage)
        if any(planned.moves_by_layer):
            self.executor.migrate(planned.moves_by_layer)
            self.migrations += 1
        self._switch_tables(planned.adopted)
        self.decisions.extend(planned.decisions)
        return planned.decisions

    def _switch_tables(self, placements: list[ExpertPlacement]) -> None:
        """Each layer whose placement changed dispatches by its new table from the next step on."""
        for index, (_, block) in enumerate(self.telemetry.layers):
            if placements[index] is not self.planner.placements[index]:
                self.planner.placements[index] = placements[index]
                block.dispatcher.table = ExpertTable.from_placement(placements[index], self.device)

    def finish_migration(self) -> None:
        """Land everything still in flight (``MigrationExecutor.finish``)."""
        self.executor.finish()

    # ---- reporting -----------------------------------------------------------------------------

    def step_metrics(self, decisions: list[Decision]) -> dict:
        """Metrics-row fields of the step just absorbed: its max/mean EP-rank load (mean over the
        local MoE layers, under the placement it ran with) and the expert slots moved after it."""
        loads = self.history[-1]
        return {"imbalance": float(loads.imbalance().mean()),
                "migrated": sum(d.num_moves for d in decisions if d.migrate)}

    def describe(self, decisions: list[Decision]) -> list[str]:
        """One line per migrating (or re-sharing) decision, for the run's log."""
        lines = []
        for d in decisions:
            if not (d.migrate or d.reshare):
                continue
            what = f"migrate {d.num_moves} expert slots" if d.migrate else "re-share replicas (no move)"
            lines.append(
                f"balance after step {d.step} layer {d.layer}: {what}; forecast max/mean {d.imbalance_current:.3f}"
                f" -> {d.imbalance_candidate:.3f}; predicted saving {d.predicted_saving_s * 1e3:.3g} ms over "
                f"{d.lasting_steps:.3g} steps vs migration {d.migration_s * 1e3:.3g} ms"
            )
        return lines

    # ---- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The placement of every local MoE layer and the predictor's state, as JSON-ready values
        (the checkpoint's ``expert_placement.json``; tensors are saved by logical expert anyway)."""
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> bool:
        """Adopt a saved placement (before the checkpoint's tensors are loaded: the slots then read
        their new logical experts). Returns False, changing nothing, when the saved EP size, slot
        count or layers differ from this run's (the checkpoint still loads, by logical expert)."""
        if not self.planner.load_state_dict(state):
            return False
        for (_, block), placement in zip(self.telemetry.layers, self.placements):
            block.dispatcher.table = ExpertTable.from_placement(placement, self.device)
        return True


def build_balanced_run(dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainingConfig, device: torch.device | str,
                       cluster: ClusterConfig, setup: BalancedRunSetup | None = None,
                       ) -> tuple[LayoutRun, OnlineExpertBalancer]:
    """A layout whose EP ranks have spare expert slots, with its balancer: what ``moetrain train
    --online-balance``, the tests and the benchmark all train with (``setup``: ``BalancedRunSetup``'s
    defaults when None). The returned run's optimizer sums replicated experts' gradients; call
    ``balancer.after_step(step)`` after each step.
    """
    setup = setup or BalancedRunSetup()
    check_online_balance(dims.parallel, model_cfg)
    assert model_cfg.moe is not None
    num_experts, ep = model_cfg.moe.num_experts, dims.parallel.ep
    model = setup.model
    if model is None:
        model = build_model(model_cfg, device, backend=setup.backend, seed=cfg.seed)
    placement = setup.placement
    if placement is None:
        slots = setup.slots_per_rank or default_slots_per_rank(num_experts, ep)
        placement = ExpertPlacement.contiguous(num_experts, ep, slots)
    stage = parallelize(model, dims, placement)
    # Flat buckets even on one rank: the migration moves expert state by its offset in the ZeRO shards.
    optimizer = ZeroAdamW(stage.model, dims, cfg, stage.tp_kinds, keep_flat=True)
    tuning = setup.tuning
    costs = BalanceCostModel(model_cfg, cluster, ep, hierarchical_a2a=dims.parallel.a2a == "hierarchical",
                             etp=dims.parallel.etp, seq_len=cfg.seq_len, defer_weights=tuning.defer_weights,
                             defer_optimizer_state=tuning.defer_optimizer_state,
                             overlap_replica_rings=tuning.overlap_replica_rings)
    balancer = OnlineExpertBalancer(stage, optimizer, costs, tuning)
    run = LayoutRun(stage, balancer.wrap(optimizer), Executor(stage), cfg, torch.device(device),
                    moe_layers=moe_layer_indices(model_cfg))
    return run, balancer
