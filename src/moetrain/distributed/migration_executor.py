"""Migration execution for online expert balancing: the moved expert slots' weights and optimizer state,
posted as point-to-point copies and left in flight, each landed where it is first needed.

* The weights of a layer's moved slots land just before that layer's experts first run in the next step
  (a forward pre-hook), so they travel under the earlier layers' forward and this layer's attention.
* The ZeRO shards of their fp32 master and AdamW moments land just before the next optimizer update, so
  they travel while the next step computes.

``finish`` lands whatever is still in flight (a checkpoint, the end of a run). The cost model's
``defer_weights`` / ``defer_optimizer_state`` False land each part at once. Which slots move is decided
elsewhere (``moetrain.distributed.balancing``).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch import nn

from moetrain.balance.costs import BalanceCostModel
from moetrain.balance.placement import Move
from moetrain.distributed.migration import PendingCopies, ShardedSlots, post_expert_moves, post_sharded_moves
from moetrain.distributed.parallelize import StageModel
from moetrain.distributed.trace import span
from moetrain.distributed.zero import ZeroAdamW
from moetrain.runtime_base.eager_only import eager_only

EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


class MigrationExecutor:
    """Moves expert slots between the EP ranks of one stage (all local MoE layers at once)."""

    def __init__(self, stage: StageModel, optimizer: ZeroAdamW, costs: BalanceCostModel,
                 layers: list[tuple[int, nn.Module]]) -> None:
        self.stage, self.optimizer, self.costs, self.layers = stage, optimizer, costs, layers
        self.ep_group = stage.dims.get_group("ep")
        self.load_group = stage.dims.get_group("stage")
        self._pending_state: PendingCopies | None = None
        """The moved slots' optimizer-state pieces in flight (landed before the next optimizer update)."""
        self._pending_weights: dict[int, tuple[PendingCopies, object]] = {}
        """Per local MoE layer: its moved weights in flight, and the hook that lands them."""
        self.timings: list[dict[str, float]] = []
        """Per migration, host seconds: ``moved`` (copies posted, before the next step), ``weights_landed``
        (the waits for the weights where the layers' experts first run) and ``landed`` (the wait for the
        optimizer state before the next optimizer update)."""

    def _expert_grid_rank(self, ep_position: int, edp_position: int) -> int:
        """Global rank at (EP position, EDP position) of this rank's expert grid. The grid is linear in
        global ranks (``layout.rank_groups``), so a step along EDP is the same offset at every EP position."""
        ep_ranks, edp_ranks = self.stage.dims.group_ranks["ep"], self.stage.dims.group_ranks["edp"]
        return ep_ranks[ep_position] + edp_ranks[edp_position] - self.stage.dims.rank

    @torch.no_grad()
    def migrate(self, moves_by_layer: list[list[Move]]) -> None:
        """Post every moved slot's copies (all layers), as the module docstring says."""
        self.finish()
        start = time.perf_counter()
        with span("expert_migration", "comm"):
            self._post_weights(moves_by_layer)
            self._post_optimizer_state(moves_by_layer)
        self.timings.append({"moved": time.perf_counter() - start, "weights_landed": 0.0, "landed": 0.0})
        if not self.costs.defer_weights:  # the weights land before the next step
            for index in sorted(self._pending_weights):
                self._land(index)
        if not self.costs.defer_optimizer_state:  # so does the optimizer state
            self._land_state()

    def _post_weights(self, moves_by_layer: list[list[Move]]) -> None:
        tag = 0
        for index, ((_, block), moves) in enumerate(zip(self.layers, moves_by_layer)):
            if not moves:
                continue
            weights = [getattr(block.experts, name).data for name in EXPERT_WEIGHTS]
            pending = post_expert_moves(moves, weights, self.ep_group, tag_offset=tag)
            tag += len(moves) * len(weights)
            # first among the experts' pre-hooks: the wait for the weights is migration time (timed in
            # ``timings``), not the expert forward that ``LoadTelemetry`` times after it
            block.experts.land_moved_weights = functools.partial(self._land, index)
            hook = block.experts.register_forward_pre_hook(_land_moved_weights, prepend=True)
            self._pending_weights[index] = (pending, hook)

    def _post_optimizer_state(self, moves_by_layer: list[list[Move]]) -> None:
        where = {}
        for bucket in self.optimizer.buckets:
            state = self.optimizer.optimizer.state.get(bucket.shard, {})
            shards = [bucket.shard.data] + [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]
            offset = 0
            for p in bucket.params:
                where[id(p)] = (bucket, shards, offset)
                offset += p.numel()
        items = []
        for (_, block), moves in zip(self.layers, moves_by_layer):
            for name in EXPERT_WEIGHTS if moves else ():
                param = getattr(block.experts, name)
                bucket, shards, offset = where[id(param)]
                items.append(ShardedSlots(moves, offset, param[0].numel(), shards, bucket.shard_size))
        self._pending_state = post_sharded_moves(items, dist.get_rank(self.ep_group), self.stage.dims.local_rank("edp"),
                                                 self._expert_grid_rank, self.load_group)

    @torch.no_grad()
    def _land(self, index: int) -> None:
        """Land layer ``index``'s moved weights (its experts are about to run)."""
        if index not in self._pending_weights:
            return
        pending, hook = self._pending_weights.pop(index)
        hook.remove()
        del self.layers[index][1].experts.land_moved_weights
        start = time.perf_counter()
        with span("expert_migration_weights", "comm"):
            pending.finish()
        self.timings[-1]["weights_landed"] += time.perf_counter() - start

    @torch.no_grad()
    def _land_state(self) -> None:
        if self._pending_state is not None:
            start = time.perf_counter()
            with span("expert_migration_state", "comm"):
                self._pending_state.finish()
            self._pending_state = None
            self.timings[-1]["landed"] = time.perf_counter() - start

    @torch.no_grad()
    def finish(self) -> None:
        """Land everything of the last migration still in flight (no-op when nothing is): the weights of
        layers whose experts have not run yet, then the optimizer state."""
        for index in sorted(self._pending_weights):
            self._land(index)
        self._land_state()


@eager_only
def _land_moved_weights(experts: nn.Module, args: tuple) -> None:
    # One hook for every layer (its layer is the partial's): a lambda closing over the layer's index made
    # torch.compile guard on the index and build a graph per layer. Disabled, since it waits on copies.
    experts.land_moved_weights()
