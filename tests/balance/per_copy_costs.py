"""A cost model the balance tests can price by hand."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from moetrain.balance.costs import OverlapWindow


@dataclass(frozen=True, eq=False)
class PerCopyCosts:
    """A layer takes 1 ms per token copy on its busiest rank; each expert moved between ranks costs
    ``seconds_per_move`` whatever the compute around it."""

    seconds_per_move: float = 0.05
    ep: int = 2
    cluster = SimpleNamespace(devices_per_node=8)

    def layer_seconds(self, placement, loads):
        return placement.apply_to_tokens_per_expert(np.asarray(loads, dtype=float)).max(axis=-1) * 1e-3

    def replica_sync_seconds(self, placement):
        return 0.0  # replicas cost nothing here beyond their slot

    def exposed_replica_sync_seconds(self, placement, loads):
        return np.zeros(np.shape(loads)[:-1])

    def ideal_layer_seconds(self, loads):
        return np.asarray(loads, dtype=float).sum(axis=-1) / self.ep * 1e-3

    def migration_seconds(self, moves, window=None):
        return self.seconds_per_move * sum(move.crosses_ranks for move in moves)

    def migration_bytes(self, moves):
        return 1e9 * sum(move.crosses_ranks for move in moves)  # 1 GB per expert sent to another rank

    def overlap_window_seconds(self, placement, loads):
        return OverlapWindow(0.0, 0.0)

    def ideal_overlap_window_seconds(self, loads):
        return OverlapWindow(0.0, 0.0)
