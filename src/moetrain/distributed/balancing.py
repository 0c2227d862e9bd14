"""Online expert balancing inside the expert-parallel runtime.

Per step, ``LoadTelemetry`` keeps each MoE layer's tokens per logical expert on the device (summed
over micro-batches by forward hooks, no host read) and the rows each rank's local experts computed
(shapes, known on the host). After the optimizer step, ``OnlineExpertBalancer.after_step`` sums the
counts over the stage's ranks with one all-reduce and reads them to the host once: the only read it
adds, taken where the step already synchronises to report its loss.

After every step, per MoE layer, the balancer runs the re-plan rule of ``moetrain.balance.schedule``,
the one ``moetrain.balance.replay`` models: a cheap cost-model check of the forecast load; a solve
(incremental, warm-started from the current placement) when the drift since the last plan could pay a
move, and a full re-plan every ``interval`` steps; the trigger compares the predicted saving over the
next ``horizon`` steps with the cost model's time to move the experts' weights and optimizer state.
Each solve is reported as a ``Decision``. When the trigger fires, ``post_expert_moves`` copies the
moved slots' weights between EP ranks (landed where the layer's experts first run in the next step),
the layer's dispatcher switches to the new table, and the moved slots' fp32 master and AdamW moments
follow as point-to-point pieces between the ZeRO shards that hold them (``post_sharded_moves``), in
flight during the next step and landed before its optimizer update. Every rank of the stage sees the
same loads and runs the same deterministic solver, so all take the same decisions.

Replicas: ``ReplicaSyncedOptimizer`` sums each replicated expert's gradient over its replicas before
the ZeRO step (so replicas receive identical updates and stay bit-identical), and takes the extra
replicas back out of the global gradient norm so that clipping sees each expert once, as in a run
without replicas. Training math is unchanged by a migration; only float summation order differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.online import BALANCE_DEFAULTS, check_online_balance, default_slots_per_rank
from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, Move
from moetrain.balance.predict import Predictor
from moetrain.balance.schedule import Decision, LayerSchedule, ReplanRule
from moetrain.balance.solver import SOLVERS
from moetrain.config import ClusterConfig, ModelConfig, TrainingConfig
from moetrain.config.model import moe_layer_indices
from moetrain.distributed.ep import ExpertTable
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.migration import (
    PendingCopies,
    ShardedSlots,
    post_expert_moves,
    post_sharded_moves,
    sum_replica_gradients,
)
from moetrain.distributed.parallelize import StageModel, parallelize
from moetrain.distributed.pipeline import Executor
from moetrain.distributed.step import LayoutRun
from moetrain.distributed.trace import span
from moetrain.distributed.zero import ZeroAdamW
from moetrain.errors import UserError
from moetrain.models.attention import AttentionBackend
from moetrain.models.transformer import MoETransformer, build_model

EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


def moe_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, MoE block) of this rank's MoE layers; MTP layers follow the decoder's."""
    layers = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    blocks = [(int(key), layer.moe) for key, layer in layers if layer.is_moe]
    num_layers = model.cfg.num_layers
    return blocks + [(num_layers + i, m.layer.moe) for i, m in enumerate(model.mtp) if m.layer.is_moe]


class LoadTelemetry:
    """Tokens per logical expert of every local MoE layer, per step, kept on the device.

    Also the rows each rank's local experts computed per layer (``rows_per_layer``, host ints taken
    from tensor shapes) and, with ``time_experts``, the host time of the experts' forward (CPU only:
    on an accelerator the host clock does not see kernel time).
    """

    def __init__(self, model: nn.Module, time_experts: bool = False) -> None:
        self.layers = moe_layers(model)
        if not self.layers:
            raise UserError("this rank holds no MoE layer; expert balancing needs one")
        num_experts = model.cfg.moe.num_experts
        device = next(model.parameters()).device
        self.counts_LE = torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=device)
        self.rows_per_layer = [0] * len(self.layers)
        self.expert_seconds_per_layer = [0.0] * len(self.layers)
        self._started: list[float] = [0.0] * len(self.layers)
        self.handles = []
        for index, (_, block) in enumerate(self.layers):
            self.handles.append(block.register_forward_hook(self._count_hook(index)))
            self.handles.append(block.experts.register_forward_pre_hook(self._rows_hook(index, time_experts)))
            if time_experts:
                self.handles.append(block.experts.register_forward_hook(self._stop_hook(index)))

    def _count_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self.counts_LE[index].add_(output.tokens_per_expert_E.detach())
        return hook

    def _rows_hook(self, index: int, timed: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            self.rows_per_layer[index] += int(args[0].shape[0])
            if timed:
                self._started[index] = time.perf_counter()
        return hook

    def _stop_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            self.expert_seconds_per_layer[index] += time.perf_counter() - self._started[index]
        return hook

    def reset(self) -> None:
        self.counts_LE.zero_()
        self.rows_per_layer = [0] * len(self.layers)
        self.expert_seconds_per_layer = [0.0] * len(self.layers)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclass
class StepLoads:
    """What one step's telemetry read gives the host."""

    step: int
    tokens_per_expert: np.ndarray
    """[L, E] over the stage's ranks."""
    tokens_per_rank: np.ndarray
    """[L, R] token-expert copies each EP rank computes under the placement the step ran with."""
    local_rows: list[int]
    """Rows this rank's experts computed, per layer (measured)."""
    local_expert_seconds: list[float]
    """Host time of this rank's expert forward, per layer (measured with ``time_experts``)."""

    def imbalance(self) -> np.ndarray:
        """[L] max/mean EP-rank load."""
        mean = self.tokens_per_rank.mean(axis=-1)
        return np.where(mean > 0, self.tokens_per_rank.max(axis=-1) / np.maximum(mean, 1e-12), 1.0)


class ReplicaSyncedOptimizer:
    """The ZeRO optimizer with replicated experts' gradients summed first (same interface)."""

    def __init__(self, inner: ZeroAdamW, balancer: OnlineExpertBalancer) -> None:
        self.inner, self.balancer = inner, balancer

    def zero_grad(self) -> None:
        self.inner.zero_grad()

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
class OnlineExpertBalancer:
    """Telemetry → predictor → solver → trigger → executor, between training steps.

    ``trigger_margin``: migrate when the predicted saving over ``horizon`` steps exceeds
    ``trigger_margin`` × the predicted migration time (1 is break-even; 0 migrates whenever the
    candidate is predicted faster; ``inf`` only observes). ``interval``: steps between full re-plans;
    ``adaptive``: also check after every step and re-plan incrementally when the drift pays a move
    (``balance.schedule``); False solves every ``interval`` steps only.
    """

    stage: StageModel
    optimizer: ZeroAdamW
    costs: BalanceCostModel
    interval: int = BALANCE_DEFAULTS.interval
    horizon: int = BALANCE_DEFAULTS.horizon
    predictor: Predictor = field(default_factory=BALANCE_DEFAULTS.build_predictor)
    solver: str = BALANCE_DEFAULTS.solver
    trigger_margin: float = BALANCE_DEFAULTS.trigger_margin
    adaptive: bool = True
    time_experts: bool = False
    decisions: list[Decision] = field(default_factory=list)
    history: list[StepLoads] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.stage.expert_table is None:
            raise UserError("expert balancing needs expert parallelism (ep > 1)")
        if self.interval < 1 or self.horizon < 1:
            raise UserError(f"interval={self.interval} and horizon={self.horizon} must be >= 1")
        if self.solver not in SOLVERS:
            raise UserError(f"unknown solver {self.solver!r}; choose one of: {', '.join(SOLVERS)}")
        model = self.stage.model
        dims = self.stage.dims
        self.ep_group = dims.get_group("ep")
        self.load_group = dims.get_group("stage")
        self.edp_size = dims.size("edp")
        self.ep_groups_per_stage = dims.size("stage") // dims.size("ep")
        """EP groups whose tokens the stage-wide load counts add up (edp · etp of them)."""
        self.device = next(model.parameters()).device
        self.telemetry = LoadTelemetry(model, self.time_experts)
        table = self.stage.expert_table
        initial = ExpertPlacement.from_slot_experts(model.cfg.moe.num_experts, np.array(table.experts_by_rank))
        self.placements = [initial for _ in self.telemetry.layers]
        self._predictor_states: list[dict[str, np.ndarray]] | None = None
        self.rule = ReplanRule(self.costs, self.interval, self.horizon, self.solver, self.trigger_margin,
                               adaptive=self.adaptive)
        self.schedules = [LayerSchedule() for _ in self.telemetry.layers]
        self.migrations = 0
        self._pending_state: PendingCopies | None = None
        """The moved slots' optimizer-state pieces in flight (landed before the next optimizer update)."""
        self._pending_weights: dict[int, tuple[PendingCopies, object]] = {}
        """Per local MoE layer: its moved weights in flight, and the hook that lands them."""
        self.migration_timings: list[dict[str, float]] = []
        """Per migration, host seconds: ``moved`` (copies posted, before the next step), ``weights_landed``
        (the waits for the weights where the layers' experts first run) and ``landed`` (the wait for the
        optimizer state before the next optimizer update)."""

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    def wrap(self, optimizer: ZeroAdamW) -> ReplicaSyncedOptimizer:
        return ReplicaSyncedOptimizer(optimizer, self)

    # ---- replicas ----------------------------------------------------------------------------

    @torch.no_grad()
    def sum_replica_gradients(self) -> torch.Tensor | None:
        """Sum replicated experts' gradients over their replicas; return this rank's share of the
        squared norm counted more than once (negative), or None when nothing is replicated."""
        correction = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = False
        for (_, block), placement in zip(self.telemetry.layers, self.placements):
            if int(placement.num_replicas().max()) == 1:
                continue
            replicated = True
            params = [getattr(block.experts, name) for name in EXPERT_WEIGHTS]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            with span("replica_grad_sum", "comm"):
                sum_replica_gradients(placement, grads, self.ep_group)
            # every replica but the first of each expert is a duplicate for the norm
            for slot, expert in enumerate(placement.experts_on_rank(self.ep_rank).tolist()):
                if expert == EMPTY_SLOT or placement.replicas(expert)[0] == (self.ep_rank, slot):
                    continue
                for grad in grads:
                    correction -= grad[slot].double().pow(2).sum() / self.edp_size
        return correction if replicated else None

    # ---- telemetry --------------------------------------------------------------------------

    def read_loads(self, step: int) -> StepLoads:
        """Sum this step's counts over the stage and read them to the host (one read), then reset."""
        counts = self.telemetry.counts_LE.clone()
        dist.all_reduce(counts, group=self.load_group)
        tokens_per_expert = counts.cpu().numpy().astype(np.float64)
        per_rank = np.stack([p.apply_to_tokens_per_expert(loads)
                             for p, loads in zip(self.placements, tokens_per_expert)])
        loads = StepLoads(step, tokens_per_expert, per_rank, list(self.telemetry.rows_per_layer),
                          list(self.telemetry.expert_seconds_per_layer))
        self.telemetry.reset()
        return loads

    # ---- the loop ------------------------------------------------------------------------------

    def after_step(self, step: int) -> list[Decision]:
        """Call after every optimizer step (``step`` counted from 0). Returns this call's decisions."""
        loads = self.read_loads(step)
        self.history.append(loads)
        # the cost model prices one EP group; the stage's counts cover all of its EP groups
        per_group = loads.tokens_per_expert / self.ep_groups_per_stage
        if self._predictor_states is None:
            self._predictor_states = [self.predictor.init_state(row) for row in per_group]
        else:
            for state, row in zip(self._predictor_states, per_group):
                self.predictor.update(state, row)
        decisions: list[Decision] = []
        moves_by_layer: list[list[Move]] = []
        candidates: list[ExpertPlacement] = []
        for index, (layer, _) in enumerate(self.telemetry.layers):
            current = self.placements[index]
            decision, adopted = self.rule.step(step, layer, self.schedules[index], current, self.predictor,
                                               self._predictor_states[index], per_group[index])
            if decision is not None:
                decisions.append(decision)
            moves_by_layer.append(list(decision.moves) if decision is not None and decision.migrate else [])
            candidates.append(adopted)
        if any(moves_by_layer):
            self.migrate(moves_by_layer)
            self.migrations += 1
        for index, (_, block) in enumerate(self.telemetry.layers):
            if candidates[index] is not self.placements[index]:
                self.placements[index] = candidates[index]
                block.dispatcher.table = ExpertTable.from_placement(candidates[index], self.device)
        self.decisions.extend(decisions)
        return decisions

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
        return {
            "num_ranks": self.placements[0].num_ranks,
            "slots_per_rank": self.placements[0].slots_per_rank,
            "predictor": self.predictor.name,
            "layers": {
                str(layer): {
                    "slot_expert": placement.slot_expert.tolist(),
                    "slot_share": placement.slot_share.tolist(),
                    "predictor_state": None if self._predictor_states is None else
                    {k: v.tolist() for k, v in self._predictor_states[index].items()},
                    "schedule": self.schedules[index].state_dict(),
                }
                for index, ((layer, _), placement) in enumerate(zip(self.telemetry.layers, self.placements))
            },
        }

    def load_state_dict(self, state: dict) -> bool:
        """Adopt a saved placement (before the checkpoint's tensors are loaded: the slots then read
        their new logical experts). Returns False, changing nothing, when the saved EP size, slot
        count or layers differ from this run's (the checkpoint still loads, by logical expert)."""
        layers = state.get("layers", {})
        current = self.placements[0]
        if (state.get("num_ranks") != current.num_ranks or state.get("slots_per_rank") != current.slots_per_rank
                or any(str(layer) not in layers for layer, _ in self.telemetry.layers)):
            return False
        num_experts = current.num_experts
        placements = [
            ExpertPlacement(num_experts, current.num_ranks, current.slots_per_rank,
                            np.array(layers[str(layer)]["slot_expert"], dtype=np.int64),
                            np.array(layers[str(layer)]["slot_share"], dtype=np.float64))
            for layer, _ in self.telemetry.layers
        ]
        for (_, block), placement in zip(self.telemetry.layers, placements):
            block.dispatcher.table = ExpertTable.from_placement(placement, self.device)
        self.placements = placements
        saved_states = [layers[str(layer)].get("predictor_state") for layer, _ in self.telemetry.layers]
        if state.get("predictor") == self.predictor.name and all(s is not None for s in saved_states):
            self._predictor_states = [{k: np.array(v, dtype=np.float64) for k, v in s.items()} for s in saved_states]
        saved_schedules = [layers[str(layer)].get("schedule") for layer, _ in self.telemetry.layers]
        if all(s is not None for s in saved_schedules):
            self.schedules = [LayerSchedule.from_state_dict(s) for s in saved_schedules]
        return True

    # ---- executor ------------------------------------------------------------------------------

    def _expert_grid_rank(self, ep_position: int, edp_position: int) -> int:
        """Global rank at (EP position, EDP position) of this rank's expert grid. The grid is linear in
        global ranks (``layout.rank_groups``), so a step along EDP is the same offset at every EP position."""
        ep_ranks, edp_ranks = self.stage.dims.group_ranks["ep"], self.stage.dims.group_ranks["edp"]
        return ep_ranks[ep_position] + edp_ranks[edp_position] - self.stage.dims.rank

    @torch.no_grad()
    def migrate(self, moves_by_layer: list[list[Move]]) -> None:
        """Move every moved slot (all layers), all of it as point-to-point copies left in flight:

        * the weights of a layer's moved slots land just before that layer's experts first run in the
          next step (a forward pre-hook), so they travel under the earlier layers' forward and this
          layer's attention;
        * the ZeRO shards of their fp32 master and AdamW moments land just before the next optimizer
          update (``ReplicaSyncedOptimizer.step``), so they travel while the next step computes.

        ``finish_migration`` lands whatever is still in flight (a checkpoint, the end of a run). The
        cost model's ``defer_weights`` / ``defer_optimizer_state`` False land each part at once."""
        self.finish_migration()
        start = time.perf_counter()
        with span("expert_migration", "comm"):
            tag = 0
            for index, ((_, block), moves) in enumerate(zip(self.telemetry.layers, moves_by_layer)):
                if not moves:
                    continue
                weights = [getattr(block.experts, name).data for name in EXPERT_WEIGHTS]
                pending = post_expert_moves(moves, weights, self.ep_group, tag_offset=tag)
                tag += len(moves) * len(weights)
                # first among the experts' pre-hooks: the wait for the weights is migration time (timed in
                # ``migration_timings``), not the expert forward that ``LoadTelemetry`` times after it
                hook = block.experts.register_forward_pre_hook(lambda module, args, index=index: self._land(index),
                                                               prepend=True)
                self._pending_weights[index] = (pending, hook)
            where = {}
            for bucket in self.optimizer.buckets:
                state = self.optimizer.optimizer.state.get(bucket.shard, {})
                shards = [bucket.shard.data] + [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]
                offset = 0
                for p in bucket.params:
                    where[id(p)] = (bucket, shards, offset)
                    offset += p.numel()
            items = []
            for (_, block), moves in zip(self.telemetry.layers, moves_by_layer):
                for name in EXPERT_WEIGHTS if moves else ():
                    param = getattr(block.experts, name)
                    bucket, shards, offset = where[id(param)]
                    items.append(ShardedSlots(moves, offset, param[0].numel(), shards, bucket.shard_size))
            self._pending_state = post_sharded_moves(items, self.ep_rank, self.stage.dims.local_rank("edp"),
                                                     self._expert_grid_rank, self.load_group)
        self.migration_timings.append({"moved": time.perf_counter() - start, "weights_landed": 0.0, "landed": 0.0})
        if not self.costs.defer_weights:  # the weights land before the next step
            for index in sorted(self._pending_weights):
                self._land(index)
        if not self.costs.defer_optimizer_state:  # so does the optimizer state
            self._land_state()

    @torch.no_grad()
    def _land(self, index: int) -> None:
        """Land layer ``index``'s moved weights (its experts are about to run)."""
        if index not in self._pending_weights:
            return
        pending, hook = self._pending_weights.pop(index)
        hook.remove()
        start = time.perf_counter()
        with span("expert_migration_weights", "comm"):
            pending.finish()
        self.migration_timings[-1]["weights_landed"] += time.perf_counter() - start

    @torch.no_grad()
    def _land_state(self) -> None:
        if self._pending_state is not None:
            start = time.perf_counter()
            with span("expert_migration_state", "comm"):
                self._pending_state.finish()
            self._pending_state = None
            self.migration_timings[-1]["landed"] = time.perf_counter() - start

    @torch.no_grad()
    def finish_migration(self) -> None:
        """Land everything of the last migration still in flight (no-op when nothing is): the weights of
        layers whose experts have not run yet, then the optimizer state."""
        for index in sorted(self._pending_weights):
            self._land(index)
        self._land_state()


def build_balanced_run(dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainingConfig, device: torch.device | str,
                       cluster: ClusterConfig, *, model: MoETransformer | None = None,
                       slots_per_rank: int | None = None, placement: ExpertPlacement | None = None,
                       backend: AttentionBackend = "eager", defer_weights: bool = True,
                       defer_optimizer_state: bool = True,
                       **balancer_options) -> tuple[LayoutRun, OnlineExpertBalancer]:
    """A layout whose EP ranks have spare expert slots, with its balancer: what ``moetrain train
    --online-balance``, the tests and the benchmark all train with.

    ``model``: a full model built by the caller (e.g. with a skewed router); default: ``build_model``
    with the run's seed. ``placement``: the starting table; default: the contiguous layout with
    ``slots_per_rank`` slots (default ``experts/ep + 1``, as ``moetrain balance``). The returned run's
    optimizer sums replicated experts' gradients; call ``balancer.after_step(step)`` after each step.
    """
    check_online_balance(dims.parallel, model_cfg)
    assert model_cfg.moe is not None
    num_experts, ep = model_cfg.moe.num_experts, dims.parallel.ep
    if model is None:
        model = build_model(model_cfg, device, backend=backend, seed=cfg.seed)
    if placement is None:
        slots = slots_per_rank or default_slots_per_rank(num_experts, ep)
        placement = ExpertPlacement.contiguous(num_experts, ep, slots)
    stage = parallelize(model, dims, placement)
    # Flat buckets even on one rank: the migration moves expert state by its offset in the ZeRO shards.
    optimizer = ZeroAdamW(stage.model, dims, cfg, stage.tp_kinds, keep_flat=True)
    costs = BalanceCostModel(model_cfg, cluster, ep, hierarchical_a2a=dims.parallel.a2a == "hierarchical",
                             etp=dims.parallel.etp, seq_len=cfg.seq_len, defer_weights=defer_weights,
                             defer_optimizer_state=defer_optimizer_state)
    balancer = OnlineExpertBalancer(stage, optimizer, costs, **balancer_options)
    run = LayoutRun(stage, balancer.wrap(optimizer), Executor(stage), cfg, torch.device(device),
                    moe_layers=moe_layer_indices(model_cfg))
    return run, balancer

