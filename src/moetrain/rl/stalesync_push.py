"""StaleSync's weight push: the trainer group's side of the sync into every rollout rank.

One plan (``moetrain.distributed.weight_sync``) from the trainer group's layout to the rollout pool's:
each rollout rank needs the tensors it holds (the whole model in a one-rank replica; in a replica of G
ranks its experts by index and the dense tensors whole (EP), its range of every TP-sharded tensor and
the rest whole (TP), or its TP ranges and its experts (TP×EP)), each region is sent by one trainer rank that owns
it (TP shards by range, experts by index, replicated tensors by the least-loaded holder), once per
rollout rank that needs it, in buckets carrying the version and a CRC-32. A push is packed at once and
sent on a thread while the next step trains; the previous push lands first, so pushes arrive in order.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moetrain.config import ModelConfig
from moetrain.distributed.step import LayoutRun
from moetrain.distributed.tp import shard_tensor_parallel
from moetrain.distributed.weight_sync import SyncInFlight, SyncReport, WeightSync
from moetrain.models.transformer import build_model, is_routed_expert
from moetrain.rl.fusion import training_views
from moetrain.rl.roles import Roles
from moetrain.rl.stalesync_job import Channels, Slices


def rollout_rank_share_bytes(model_cfg: ModelConfig, roles: Roles, itemsize: int = 4) -> int:
    """What one rank of a rollout replica holds, in bytes (fp32 by default, as the generation models hold
    them): the whole model in a one-rank replica; under EP the dense tensors whole and 1/E of every expert
    tensor; under TP the layout's shards of a model built on the meta device (each rank's are the same
    size: the layout divides the heads and the columns); under TP×EP both."""
    model = build_model(model_cfg, "meta")
    if roles.gen_tp > 1:
        shard_tensor_parallel(model, roles.gen_tp, 0)
    total = 0
    for name, value in model.state_dict().items():
        elements = value.numel()
        if is_routed_expert(name):
            elements //= roles.gen_ep
        total += elements * itemsize
    return total


class WeightPush:
    """A trainer rank's pushes: the plan, the push in flight, the reports (and, as a test hook, the slices)."""

    def __init__(self, run: LayoutRun, shapes: dict[str, torch.Size], channels: Channels, bucket_bytes: int,
                 record: bool = False) -> None:
        self.sync = WeightSync.plan(training_views(run, shapes), {}, bucket_bytes, channels.sync)
        self.roles, self.record = channels.roles, record
        self.share_bytes = rollout_rank_share_bytes(run.stage.model.cfg, self.roles)
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
        share = self.share_bytes
        return {"sync_received_mib": [received[r] / 2**20 for r in self.roles.replica_ranks],
                "sync_replica_share_mib": share / 2**20,
                "sync_sent_mib": [sent[r] / 2**20 for r in self.roles.trainer_group]}

    def record_slices(self, version: int) -> None:
        if self.record:
            self.slices[version] = [(name, offsets, piece.detach().clone())
                                    for name, view in self.sync.sources.items() for offsets, piece in view.pieces]
