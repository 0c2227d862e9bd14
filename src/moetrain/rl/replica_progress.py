"""Each rollout rank's progress, kept in the run's store: which rank of a replica stopped answering.

A rank of a replica of several ranks that hangs (alive, not answering) leaves its replica's other ranks
waiting in a collective, and the trainer waiting on the replica's leader, until the run's timeout; gloo's
error then says only that a wait timed out, and a process check (``Channels.ended_ranks``) finds no rank
gone. So every rank of such a replica counts the steps all of its ranks take together (each weight
version received, each batch started, each forward of its generation model) and writes the count to the
process group's store (a key per rank; the store is served apart from any rank's main thread: torchrun's
agent, or rank 0's store thread). A rank that gives up reads the counts: a rank of a replica whose count
is behind the replica's other ranks is the one they are waiting on. A rank that hangs inside a forward
after its peers entered the same one ties with them and is not found here (its peers then name whom they
were receiving from, as before). One-rank replicas have no peers to fall behind: they count nothing.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from moetrain.rl.roles import Roles

KEY = "moetrain/stalesync/progress/{rank}"


class ReplicaProgress:
    """This rank's count in the store, and the replicas' laggards read from it."""

    def __init__(self, store: dist.Store | None, rank: int, roles: Roles) -> None:
        self.store, self.rank, self.roles = store, rank, roles
        self.count = 0
        self.counts = store is not None and roles.ranks_per_replica > 1 and rank in roles.replica_ranks
        if self.counts:
            self._publish()

    @classmethod
    def of_group(cls, rank: int, roles: Roles) -> ReplicaProgress:
        """On the default process group's store (every rank calls this before the group's first collective,
        so each counting rank's key exists once that collective is done)."""
        # the store the group was built from; torch exposes it only under this name
        store = dist.distributed_c10d._get_default_store() if roles.ranks_per_replica > 1 else None
        return cls(store, rank, roles)

    def tick(self) -> None:
        """One more step taken (by every rank of the replica, in the same order)."""
        if self.counts:
            self.count += 1
            self._publish()

    def watch(self, model: nn.Module) -> None:
        """Count every forward of the generation model: its embedding's, which every forward (the engine's
        cached decode steps too, which walk the layers themselves) starts with, on every rank."""
        if self.counts:
            model.get_submodule("embed").register_forward_pre_hook(lambda _module, _args: self.tick())

    def _publish(self) -> None:
        assert self.store is not None
        self.store.set(KEY.format(rank=self.rank), str(self.count))

    def stalled(self) -> list[int]:
        """The rollout ranks whose count is behind the other ranks of their replica (empty when there are
        none, or the counts cannot be read)."""
        if self.store is None:
            return []
        behind = []
        g = self.roles.ranks_per_replica
        for leader in self.roles.replica_leaders:
            counts = {rank: self._read(rank) for rank in range(leader, leader + g)}
            known = [c for c in counts.values() if c is not None]
            if len(known) == g:
                behind += [rank for rank, count in counts.items() if count is not None and count < max(known)]
        return behind

    def _read(self, rank: int) -> int | None:
        assert self.store is not None
        key = KEY.format(rank=rank)
        try:  # get waits for a missing key: check first
            return int(self.store.get(key)) if self.store.check([key]) else None
        except (RuntimeError, ValueError):  # the store's host is gone, or the key was never written
            return None
