"""The planner's cost model, seen from expert balancing: what a placement costs per step, and what
moving experts costs.

All times come from ``moetrain.planner.comm`` (communication, expert GEMMs) and all FLOPs and
parameter counts from ``moetrain.costs``: this module only decides *which* tokens and bytes go where
for a given placement, never how fast a link or a GEMM is.

Per MoE layer and step, on EP rank r holding ``n_r`` token-expert copies (replicas' shares included;
loads are those of one EP group: with data or expert tensor parallelism beside EP, the runtime divides
the stage's counts by the number of EP groups in it):

* expert compute: the slowest rank, ``max_r expert_compute_time(n_r)`` (forward + backward; under
  expert tensor parallelism a rank computes ``1/etp`` of every expert for the ``etp`` members' tokens,
  the same work);
* all-to-all: dispatch and combine, forward and backward (4 calls). Every rank sends the same volume
  (its tokens, top_k copies each) but rank r receives ``n_r`` copies, so the busiest rank decides:
  the planner's even-spread all-to-all is priced at ``max(mean, max_r n_r)`` copies per rank;
* replicas: once per step the replicas of each replicated expert sum their gradients with a ring
  all-reduce (``distributed.migration.sum_replica_gradients``): each replica sends 2(n − 1)/n of a
  gradient to the next replica of the ring; the rings of a rank's experts run together, in 2(n − 1)
  rounds of the longest ring, each paying a link latency. The runtime starts a layer's rings as soon as
  its expert gradients are final (``distributed.replica_gradients``, as DDP overlaps its bucketed
  all-reduce with the backward), so only what outlasts the backward compute after them shows
  (``backward_after_seconds``); ``overlap_replica_rings=False`` charges them whole, as after the backward;
* the rest of the layer (attention, router, shared expert) does not depend on the placement; it is
  priced as GEMM work of the same efficiency so that gains are relative to the whole layer.

Migration: each moved expert carries its weights and optimizer state; ranks send and receive in
parallel, in-node and network links concurrently, so the busiest rank's busiest link decides. The
runtime posts both parts right after the decision and lands each where it is first needed
(``distributed.balancing``), so the next step's compute hides them up to its length:

* the bf16 weight (``weight_bytes_per_param`` = 2) is needed when the layer's experts first run in the
  next step: it travels under the compute before them (``OverlapWindow.before_experts``: at least the
  layer's own attention, router and shared expert forward);
* the fp32 master and Adam's two moments (``deferred_bytes_per_param`` = 12) are needed by the next
  optimizer update: they follow on the same links under the rest of the layer's compute
  (``OverlapWindow.layer``: its expert GEMMs and the rest of the layer, forward and backward, the
  time its links carry none of the step's own traffic).

Only what outlasts those windows shows. ``defer_weights=False`` lands the weights before the step;
``defer_optimizer_state=False`` (which needs ``defer_weights=False``) prices a stop-the-world move of
all 14 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from moetrain.balance.placement import EMPTY_SLOT, ExpertPlacement, Move
from moetrain.config.cluster import ClusterConfig
from moetrain.config.model import ModelConfig
from moetrain.costs.flops import layer_forward_flops
from moetrain.costs.params import moe_block_params
from moetrain.errors import UserError
from moetrain.planner import comm, compute
from moetrain.planner.calibration import Efficiency

# Passes of the MoE all-to-all per layer and step: dispatch and combine, forward and backward.
ALLTOALL_CALLS_PER_LAYER = 4


@dataclass(frozen=True)
class BalanceCostModel:
    model: ModelConfig
    cluster: ClusterConfig
    ep: int
    hierarchical_a2a: bool = False
    etp: int = 1
    """Expert tensor parallelism: each of an EP position's ``etp`` ranks holds a ``1/etp`` slice of its
    experts, computes that slice for the group's tokens, and moves and all-reduces only that slice."""
    activation_bytes: float = 2.0
    """Bytes per hidden element sent by the all-to-all (bf16)."""
    weight_bytes_per_param: float = 2.0
    """Bytes per expert parameter that a migration must deliver before the next forward (bf16 weight)."""
    deferred_bytes_per_param: float = 12.0
    """Bytes per expert parameter needed only by the next optimizer update (fp32 master, Adam m and v)."""
    defer_weights: bool = True
    """The weights travel under the next step's compute before the layer's experts (False: before the step)."""
    defer_optimizer_state: bool = True
    """The optimizer state travels under the next step's compute (False: everything before the step)."""
    overlap_replica_rings: bool = True
    """The replicas' gradient rings run under the backward (False: after it, before the optimizer step)."""
    grad_bytes_per_param: float = 4.0
    """Bytes per parameter in the replicas' gradient all-reduce (fp32 gradients)."""
    seq_len: int = 4096
    """Sequence length for the attention part of the placement-independent layer time."""
    efficiency: Efficiency | None = None
    """The planner's efficiency factors; None: the shipped calibration for the cluster's device."""

    def __post_init__(self) -> None:
        if self.model.moe is None:
            raise UserError(f"model {self.model.name!r} has no MoE layers; expert balancing needs an MoE model")
        if self.ep < 1 or self.etp < 1:
            raise UserError(f"ep={self.ep} and etp={self.etp} must be >= 1")
        if self.defer_weights and not self.defer_optimizer_state:
            raise UserError("defer_weights needs defer_optimizer_state: the state follows the weights on the "
                            "links; defer both or neither")

    @property
    def top_k(self) -> int:
        assert self.model.moe is not None
        return self.model.moe.router.top_k

    @cached_property
    def params_per_expert(self) -> int:
        assert self.model.moe is not None
        return moe_block_params(self.model)[1] // self.model.moe.num_experts

    @property
    def params_per_slice(self) -> float:
        """Parameters of one expert on one rank: what a rank moves, and all-reduces, per expert slot."""
        return self.params_per_expert / self.etp

    @cached_property
    def _layer_flops(self):
        return layer_forward_flops(self.model, self.seq_len, moe_layer=True)

    def _same_node(self, rank_a: int, rank_b: int) -> bool:
        node = self.cluster.devices_per_node
        return rank_a // node == rank_b // node

    # ---- per-layer step time of a placement -------------------------------------------------

    def expert_seconds(self, copies_per_rank: np.ndarray, num_local_experts=1) -> np.ndarray:
        """Forward + backward (3× forward) expert GEMMs for ``copies_per_rank`` token-expert copies
        on a rank holding ``num_local_experts`` experts (each pads the grouped GEMM)."""
        forward = comm.expert_compute_time(
            np.asarray(copies_per_rank, float), self.model, self.cluster, self.efficiency,
            shard=comm.ExpertShard(num_local_experts=num_local_experts),
        )
        return 3.0 * np.asarray(forward)

    def alltoall_seconds(self, copies_per_rank: np.ndarray) -> np.ndarray:
        """All-to-all time per layer and step for loads [..., R] (copies received per rank)."""
        copies = np.asarray(copies_per_rank, dtype=float)
        busiest = np.maximum(copies.max(axis=-1), copies.mean(axis=-1))
        send_bytes = busiest * self.model.hidden_size * self.activation_bytes
        one = comm.alltoall_time(
            send_bytes, comm.RankGroup(self.ep, self.cluster.devices_per_node), self.cluster,
            hierarchical=self.hierarchical_a2a, top_k=self.top_k, efficiency=self.efficiency,
        )
        return ALLTOALL_CALLS_PER_LAYER * np.asarray(one)

    def other_seconds(self, copies_per_rank: np.ndarray) -> np.ndarray:
        """Placement-independent rest of the layer on one rank: its tokens' attention, router, shared."""
        # a rank's own tokens: the mean copies over ranks / top_k (data parallel makes them equal)
        tokens = np.asarray(copies_per_rank, dtype=float).mean(axis=-1) / self.top_k
        flops = self._layer_flops
        gemm = tokens * (flops.attention_proj + flops.router + flops.shared_experts)
        # GEMM call overheads are left out: this part is the same for every placement
        forward = compute.gemm_time(gemm, 0, self.cluster, self.efficiency) + compute.attention_time(
            tokens * flops.attention_core, self.cluster, self.efficiency
        )
        return 3.0 * np.asarray(forward)

    def replica_sync_seconds(self, placement: ExpertPlacement) -> float:
        """Once per step, the replicated experts' ring all-reduces (module docstring): for each replicated
        expert it holds, rank r sends 2(n − 1)/n of a gradient slice to the next replica of the ring
        (replica order) and receives as much from the one before, over the in-node link when that
        neighbour shares its node and the network otherwise. Links work concurrently, in both
        directions; the busiest rank's busiest link direction decides, as for migrations. The rings
        advance together in 2(n − 1) rounds for the longest ring, each round waiting for its messages
        (``sum_replica_gradients``): one link latency per round, the network's if a ring crosses nodes."""
        grad_bytes = self.params_per_slice * self.grad_bytes_per_param
        # [rank, link, direction]: link 0 in-node, 1 network; direction 0 sent, 1 received
        carried = np.zeros((placement.num_ranks, 2, 2))
        rounds = 0
        for expert in np.flatnonzero(placement.num_replicas() > 1):
            ring = [rank for rank, _ in placement.replicas(int(expert))]
            rounds = max(rounds, 2 * (len(ring) - 1))
            share = 2.0 * (len(ring) - 1) / len(ring) * grad_bytes
            for position, rank in enumerate(ring):
                after = ring[(position + 1) % len(ring)]
                link = 0 if self._same_node(rank, after) else 1
                carried[rank, link, 0] += share
                carried[after, link, 1] += share
        if not rounds:
            return 0.0
        busiest = carried.max(axis=(0, 2))
        crosses = bool(busiest[1])
        # p2p_time is one message: its latency plus its bytes over the link; the bytes part of each link
        latency = float(comm.p2p_time(0.0, crosses, self.cluster, self.efficiency))
        bytes_time = max(float(comm.p2p_time(busiest[link], bool(link), self.cluster, self.efficiency))
                         - float(comm.p2p_time(0.0, bool(link), self.cluster, self.efficiency))
                         for link in (0, 1))
        return bytes_time + rounds * latency

    def backward_after_seconds(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """[...] Backward compute that runs after a layer's expert weight gradients are final, until the
        next layer's (one layer down) are: the rest of this layer's backward (attention, router, shared
        expert: 2/3 of ``other_seconds``) and the expert backward of the layer below (2/3 of
        ``expert_seconds``, at even ranks: the least any placement of it takes). One layer's worth, not all
        the layers below: every layer's rings share the same links, one after the other, so each layer's
        rings hide under one layer's backward. The all-to-alls are left out: they use the same links."""
        loads = np.asarray(tokens_per_expert, dtype=float)
        even = np.repeat((loads.sum(axis=-1) / self.ep)[..., None], self.ep, axis=-1)
        per_rank = -(-self.model.moe.num_experts // self.ep)  # type: ignore[union-attr]
        return 2.0 / 3.0 * (self.other_seconds(even) + self.expert_seconds(even[..., 0], per_rank))

    def exposed_replica_sync_seconds(self, placement: ExpertPlacement, tokens_per_expert: np.ndarray) -> np.ndarray:
        """[...] What the replicas' rings add to the step: all of ``replica_sync_seconds`` after the backward,
        or what outlasts ``backward_after_seconds`` when they run under it (``overlap_replica_rings``)."""
        ring = self.replica_sync_seconds(placement)
        shape = np.shape(tokens_per_expert)[:-1]
        if not ring or not self.overlap_replica_rings:
            return np.full(shape, ring)
        return np.maximum(0.0, ring - self.backward_after_seconds(tokens_per_expert))

    def layer_seconds(self, placement: ExpertPlacement, tokens_per_expert: np.ndarray) -> np.ndarray:
        """Predicted time of one MoE layer per step, for loads [..., E] under ``placement``."""
        copies = placement.apply_to_tokens_per_expert(tokens_per_expert)
        experts_per_rank = (placement.slot_expert != EMPTY_SLOT).reshape(placement.num_ranks, -1).sum(axis=1)
        return (
            self.expert_seconds(copies, experts_per_rank).max(axis=-1)
            + self.alltoall_seconds(copies)
            + self.other_seconds(copies)
            + self.exposed_replica_sync_seconds(placement, tokens_per_expert)
        )

    def ideal_layer_seconds(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """The same layer with perfectly even ranks and no replicas: the bound no placement beats."""
        loads = np.asarray(tokens_per_expert, dtype=float)
        even = np.repeat((loads.sum(axis=-1) / self.ep)[..., None], self.ep, axis=-1)
        per_rank = -(-self.model.moe.num_experts // self.ep)  # type: ignore[union-attr]
        return (
            self.expert_seconds(even[..., 0], per_rank) + self.alltoall_seconds(even) + self.other_seconds(even)
        )

    # ---- migration ----------------------------------------------------------------------------

    @property
    def bytes_per_param(self) -> float:
        """Everything a moved expert carries, per parameter (14: weight, master, Adam moments)."""
        return self.weight_bytes_per_param + self.deferred_bytes_per_param

    def _window(self, copies: np.ndarray, experts_per_rank) -> OverlapWindow:
        rest = float(self.other_seconds(copies))
        experts = float(self.expert_seconds(copies, experts_per_rank).max(axis=-1))
        return OverlapWindow(before_experts=rest / 3.0, layer=experts + rest)  # rest / 3: its forward

    def overlap_window_seconds(self, placement: ExpertPlacement, tokens_per_expert: np.ndarray) -> OverlapWindow:
        """The layer's compute in one step under ``placement``: what the moved experts' copies travel under."""
        copies = placement.apply_to_tokens_per_expert(tokens_per_expert)
        experts_per_rank = (placement.slot_expert != EMPTY_SLOT).reshape(placement.num_ranks, -1).sum(axis=1)
        return self._window(copies, experts_per_rank)

    def ideal_overlap_window_seconds(self, tokens_per_expert: np.ndarray) -> OverlapWindow:
        """The same for perfectly even ranks: the least compute any placement leaves the links."""
        loads = np.asarray(tokens_per_expert, dtype=float)
        even = np.repeat((loads.sum(axis=-1) / self.ep)[..., None], self.ep, axis=-1)
        per_rank = -(-self.model.moe.num_experts // self.ep)  # type: ignore[union-attr]
        return self._window(even, per_rank)

    def migration_bytes(self, moves: list[Move]) -> float:
        """Bytes a layer's moves send between ranks: weights and optimizer state of every moved slice
        (a copy inside one rank's memory sends nothing)."""
        return sum(move.crosses_ranks for move in moves) * self.params_per_slice * self.bytes_per_param

    def transfer_seconds(self, moves: list[Move], bytes_per_param: float) -> float:
        """Time to copy ``bytes_per_param`` bytes of every moved expert's parameters (one layer's moves)."""
        expert_bytes = self.params_per_slice * bytes_per_param
        # [rank, link]: link 0 in-node, 1 network; sends and receives use separate directions.
        sent = np.zeros((self.ep, 2))
        received = np.zeros((self.ep, 2))
        for move in moves:
            if not move.crosses_ranks:
                continue  # a copy inside one rank's memory: negligible next to the links
            link = 0 if self._same_node(move.src[0], move.dst[0]) else 1
            sent[move.src[0], link] += expert_bytes
            received[move.dst[0], link] += expert_bytes
        busiest = np.maximum(sent, received).max(axis=0)
        intra = float(comm.p2p_time(busiest[0], False, self.cluster, self.efficiency)) if busiest[0] else 0.0
        inter = float(comm.p2p_time(busiest[1], True, self.cluster, self.efficiency)) if busiest[1] else 0.0
        return max(intra, inter)

    def migration_seconds(self, moves: list[Move], window: OverlapWindow | None = None) -> float:
        """Step time a layer's moves add: what the weights' and the optimizer state's copies outlast of
        the next step's compute (``window``; None: no compute to hide under). See the module docstring."""
        if not moves:
            return 0.0
        if not self.defer_optimizer_state:
            return self.transfer_seconds(moves, self.bytes_per_param)
        window = window or OverlapWindow(0.0, 0.0)
        weights = self.transfer_seconds(moves, self.weight_bytes_per_param)
        state = self.transfer_seconds(moves, self.deferred_bytes_per_param)
        # the weights first: the step waits for what they outlast of the compute before the experts
        # (all of them when they land before the step); the state follows on the same links
        waited = max(0.0, weights - window.before_experts) if self.defer_weights else weights
        return waited + max(0.0, weights + state - window.layer - waited)


@dataclass(frozen=True)
class OverlapWindow:
    """Compute of one MoE layer in a step that a migration's copies can travel under (seconds)."""

    before_experts: float
    """Before the layer's experts first run: at least its attention, router and shared expert forward."""
    layer: float
    """The layer's whole compute in the step, forward and backward."""
