"""Online expert balancing inside the expert-parallel runtime.

Per step, ``LoadTelemetry`` keeps each MoE layer's tokens per logical expert on the device (summed
over micro-batches by forward hooks, no host read) and the rows each rank's local experts computed
(shapes, known on the host). After the optimizer step, ``OnlineExpertBalancer.after_step`` sums the
counts over the stage's ranks with one all-reduce and reads them to the host once: the only read it
adds, taken where the step already synchronises to report its loss.

Every ``interval`` steps, per MoE layer, the balancer does what ``moetrain.balance.replay`` models:
the predictor forecasts the load, the placement solver proposes a placement (aligned to the current
one), and the trigger compares the predicted saving over the next ``horizon`` steps with the cost
model's time to move the experts' weights and optimizer state; each evaluation is reported as a
``Decision``. When it fires, ``migrate_experts`` copies the moved slots' weights and AdamW moments
between EP ranks (the ZeRO shards of the expert bucket are gathered, moved with the weights and
re-sliced), and the layer's dispatcher switches to the new table. Every rank of the stage sees the
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
from moetrain.balance.executor import migrate_experts, sum_replica_gradients
from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, Move, diff
from moetrain.balance.predict import EMAPredictor, Predictor
from moetrain.balance.replay import Decision
from moetrain.balance.solver import SOLVERS, timed_plan
from moetrain.distributed.ep import ExpertTable
from moetrain.distributed.parallelize import StageModel
from moetrain.distributed.trace import span
from moetrain.distributed.zero import ZeroAdamW, _flat
from moetrain.errors import UserError

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
        correction = self.balancer.sum_replica_gradients()
        return self.inner.step(lr, norm_sq_correction=correction)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@dataclass
class OnlineExpertBalancer:
    """Telemetry → predictor → solver → trigger → executor, between training steps.

    ``trigger_margin``: migrate when the predicted saving over ``horizon`` steps exceeds
    ``trigger_margin`` × the predicted migration time (1 is break-even; 0 migrates whenever the
    candidate is predicted faster; ``inf`` only observes).
    """

    stage: StageModel
    optimizer: ZeroAdamW
    costs: BalanceCostModel
    interval: int = 10
    horizon: int = 50
    predictor: Predictor = field(default_factory=lambda: EMAPredictor(0.8))
    solver: str = "local"
    trigger_margin: float = 1.0
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
        self.device = next(model.parameters()).device
        self.telemetry = LoadTelemetry(model, self.time_experts)
        table = self.stage.expert_table
        initial = ExpertPlacement.from_slot_experts(model.cfg.moe.num_experts, np.array(table.experts_by_rank))
        self.placements = [initial for _ in self.telemetry.layers]
        self._predictor_states: list[dict[str, np.ndarray]] | None = None
        self.migrations = 0

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
        if self._predictor_states is None:
            self._predictor_states = [self.predictor.init_state(row) for row in loads.tokens_per_expert]
        else:
            for state, row in zip(self._predictor_states, loads.tokens_per_expert):
                self.predictor.update(state, row)
        if (step + 1) % self.interval:
            return []
        decisions: list[Decision] = []
        moves_by_layer: list[list[Move]] = []
        candidates: list[ExpertPlacement] = []
        for index, (layer, _) in enumerate(self.telemetry.layers):
            current = self.placements[index]
            forecast = self.predictor.forecast(self._predictor_states[index], min(self.interval, self.horizon))
            candidate, solve_s = timed_plan(
                forecast, current.num_ranks, current.slots_per_rank, self.solver,
                score=lambda p, f=forecast, c=current: float(self.costs.layer_seconds(p, f))
                + self.costs.migration_seconds(diff(c, p)) / self.horizon,
                current=current,
            )
            moves = diff(current, candidate)
            saving = self.horizon * float(self.costs.layer_seconds(current, forecast)
                                          - self.costs.layer_seconds(candidate, forecast))
            migration = self.costs.migration_seconds(moves)
            migrate = bool(moves) and saving > 0.0 and saving > self.trigger_margin * migration
            reshare = not moves and saving > 0.0 and candidate != current
            decisions.append(Decision(
                step=step, layer=layer, migrate=migrate, predicted_saving_s=saving, migration_s=migration,
                num_moves=len(moves), imbalance_current=float(current.imbalance(forecast)),
                imbalance_candidate=float(candidate.imbalance(forecast)), solve_ms=solve_s * 1e3,
                reshare=reshare,
            ))
            moves_by_layer.append(moves if migrate else [])
            candidates.append(candidate if (migrate or reshare) else current)
        if any(moves_by_layer):
            self.migrate(moves_by_layer)
            self.migrations += 1
        for index, (_, block) in enumerate(self.telemetry.layers):
            if candidates[index] is not self.placements[index]:
                self.placements[index] = candidates[index]
                block.dispatcher.table = ExpertTable.from_placement(candidates[index], self.device)
        self.decisions.extend(decisions)
        return decisions

    # ---- executor ------------------------------------------------------------------------------

    @torch.no_grad()
    def migrate(self, moves_by_layer: list[list[Move]]) -> None:
        """Move weights and AdamW moments of every moved slot (all layers), then rebuild the ZeRO
        shards of the expert buckets from the moved tensors. Runs between steps (no live gradients)."""
        with span("expert_migration", "comm"):
            buckets = [b for b in self.optimizer.buckets if any(".moe.experts." in f".{n}" for n in b.names)]
            full_moments: dict[int, dict[str, torch.Tensor]] = {}
            gathered: list[dict[str, torch.Tensor]] = []
            for bucket in buckets:
                state = self.optimizer.optimizer.state.get(bucket.shard, {})
                flats: dict[str, torch.Tensor] = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        continue
                    parts = [torch.empty_like(state[key]) for _ in range(bucket.group_size)]
                    dist.all_gather(parts, state[key].contiguous(), group=bucket.group)
                    flats[key] = torch.cat(parts)
                    offset = 0
                    for p in bucket.params:
                        full_moments.setdefault(id(p), {})[key] = flats[key][offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
                gathered.append(flats)
            for (_, block), moves in zip(self.telemetry.layers, moves_by_layer):
                if not moves:
                    continue
                params = [getattr(block.experts, name) for name in EXPERT_WEIGHTS]
                tensors = [p.data for p in params]
                for key in ("exp_avg", "exp_avg_sq"):
                    tensors += [full_moments[id(p)][key] for p in params if key in full_moments.get(id(p), {})]
                migrate_experts(moves, tensors, self.ep_group)
            for bucket, flats in zip(buckets, gathered):
                size = bucket.shard_size * bucket.group_size
                lo, hi = bucket.rank_in_group * bucket.shard_size, (bucket.rank_in_group + 1) * bucket.shard_size
                bucket.shard.copy_(_flat([p.detach() for p in bucket.params], size)[lo:hi])
                state = self.optimizer.optimizer.state.get(bucket.shard)
                for key, flat in flats.items():
                    state[key] = flat[lo:hi].clone()
