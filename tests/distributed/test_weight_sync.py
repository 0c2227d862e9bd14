"""The weight sync's background push (``WeightSync.start``): what lands is the weights as they were when the
push started, whatever the sender does to them afterwards; a damaged bucket fails the push on both ranks."""

from __future__ import annotations

import pytest
import torch

from moetrain.distributed.weight_sync import SyncFault, WeightSync, WeightSyncError, tensor_views
from moetrain.distributed.world import spawn

SENDER, RECEIVER = 0, 1
BUCKET_BYTES = 4096  # several buckets: 2 × 64 × 24 fp32 and a 500-element bias


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 24, generator=generator), "b.weight": torch.randn(64, 24, generator=generator),
            "b.bias": torch.randn(500, generator=generator)}


def _push(rank: int, world_size: int, corrupt: bool) -> dict:
    if rank == SENDER:
        weights = _weights(seed=1)
        sync = WeightSync.plan(tensor_views(weights), {}, BUCKET_BYTES)
        before = {name: value.clone() for name, value in weights.items()}
        in_flight = sync.start(version=7)
        for value in weights.values():  # the next update, before the push has landed
            value.mul_(-3.0).add_(1.0)
        try:
            report = in_flight.wait()
        except WeightSyncError as exc:
            return {"error": str(exc)}
        return {"sent": before, "bytes_sent": report.bytes_sent, "buckets": len(sync.buckets),
                "pack_s": in_flight.pack_s}
    received = {name: torch.zeros_like(value) for name, value in _weights(seed=1).items()}
    sync = WeightSync.plan({}, tensor_views(received), BUCKET_BYTES)
    if corrupt:
        sync.fault = SyncFault(rank=RECEIVER, corrupt=1)
    try:
        report = sync.run(version=7)
    except WeightSyncError as exc:
        return {"error": str(exc)}
    return {"received": received, "verified": report.checksums_verified}


@pytest.mark.dist
def test_a_background_push_lands_the_weights_as_they_were_when_it_started():
    sender, receiver = spawn(_push, 2, False)
    assert sender["buckets"] > 1 and receiver["verified"] == sender["buckets"]
    for name, value in sender["sent"].items():
        assert torch.equal(receiver["received"][name], value), name
    assert sender["bytes_sent"] == sum(v.numel() * 4 for v in _weights(seed=1).values())


@pytest.mark.dist
def test_a_damaged_bucket_fails_the_background_push_on_both_ranks():
    sender, receiver = spawn(_push, 2, True)
    assert receiver["error"].startswith("weight sync failed on rank 1: bucket 1 from rank 0")
    assert sender["error"].startswith("weight sync failed on rank 1 (see its error): bucket 1 from rank 0")


def test_a_rank_that_receives_runs_the_sync_in_the_foreground():
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        weights = _weights(seed=2)
        sync = WeightSync.plan(tensor_views(weights), tensor_views({k: v.clone() for k, v in weights.items()}),
                               BUCKET_BYTES)
        with pytest.raises(ValueError, match="syncs with run"):
            sync.start(version=1)
    finally:
        dist.destroy_process_group()
