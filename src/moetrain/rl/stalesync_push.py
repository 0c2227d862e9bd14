"""StaleSync's weight push: the trainer group's side of the sync into every rollout rank.

One plan (``moetrain.distributed.weight_sync``) from the trainer group's layout to the rollout pool's:
each rollout rank needs the tensors it holds (the whole model in a one-rank replica; its experts by index
and the dense tensors whole in a replica of G ranks), each region is sent by one trainer rank that owns
it (TP shards by range, experts by index, replicated tensors by the least-loaded holder), once per
rollout rank that needs it, in buckets carrying the version and a CRC-32. A push is packed at once and
sent on a thread while the next step trains; the previous push lands first, so pushes arrive in order.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moetrain.distributed.step import LayoutRun
from moetrain.distributed.weight_sync import SyncInFlight, SyncReport, WeightSync
from moetrain.models.transformer import is_routed_expert
from moetrain.rl.fusion import training_views
from moetrain.rl.stalesync_job import Channels, Slices


def rollout_rank_share_bytes(shapes: dict[str, torch.Size], ranks_per_replica: int, itemsize: int = 4) -> int:
    """What one rank of a replica of ``ranks_per_replica`` ranks holds, in bytes: the dense tensors whole, its
    1/G of every expert tensor (fp32 by default, as the generation models hold them)."""
    total = 0
    for name, shape in shapes.items():
        elements = shape.numel()
        if is_routed_expert(name):
            elements //= ranks_per_replica
        total += elements * itemsize
    return total


class WeightPush:
    """A trainer rank's pushes: the plan, the push in flight, the reports (and, as a test hook, the slices)."""

    def __init__(self, run: LayoutRun, shapes: dict[str, torch.Size], channels: Channels, bucket_bytes: int,
                 record: bool = False) -> None:
        self.sync = WeightSync.plan(training_views(run, shapes), {}, bucket_bytes, channels.sync)
        self.shapes, self.roles, self.record = shapes, channels.roles, record
        self.in_flight: SyncInFlight | None = None
        self.reports: list[SyncReport] = []
        self.slices: dict[int, Slices] = {}

    def now(self, version: int) -> None:
        """Push ``version`` and wait for every rollout rank to check it (the starting weights)."""
        self.record_slices(version)
        self.reports.append(self.sync.run(version))

    def start(self, version: int) -> dict[str, Any]:
        """Land the previous push, pack ``version`` and send it in the background; the metrics row's fields."""
        start = time.perf_counter()
        fields = self.landed()
        self.record_slices(version)
        self.in_flight = self.sync.start(version)
        fields.update(sync_version=version, sync_pack_s=self.in_flight.pack_s,
                      sync_time_s=time.perf_counter() - start, **self.planned_bytes())
        return fields

    def landed(self) -> dict[str, Any]:
        """Wait for the push in flight, if any (raising what it raised); its figures for the metrics row."""
        if self.in_flight is None:
            return {}
        report, self.in_flight = self.in_flight.wait(), None
        self.reports.append(report)
        return {"sync_landed_version": report.version, "sync_mib": report.bytes_sent / 2**20,
                "sync_landed_s": report.seconds}

    def planned_bytes(self) -> dict[str, Any]:
        """What every push moves, per rank of the plan, against the ideal: each rollout rank receives its
        share (the tensors it holds), and the trainer ranks send the sum of the shares between them."""
        sent, received = self.sync.planned_bytes()
        share = rollout_rank_share_bytes(self.shapes, self.roles.ranks_per_replica)
        return {"sync_received_mib": [received[r] / 2**20 for r in self.roles.replica_ranks],
                "sync_replica_share_mib": share / 2**20,
                "sync_sent_mib": [sent[r] / 2**20 for r in self.roles.trainer_group]}

    def record_slices(self, version: int) -> None:
        if self.record:
            self.slices[version] = [(name, offsets, piece.detach().clone())
                                    for name, view in self.sync.sources.items() for offsets, piece in view.pieces]
