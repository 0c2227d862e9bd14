"""StaleSync, disaggregated: rollout replicas and a trainer group on ranks of their own, joined by
bounded queues, the trainer admitting samples at most k weight versions old.

The ranks' roles follow from the spec (``roles.Roles``): R rollout replicas of G ranks each (ranks
0 .. R·G − 1; G > 1 generates in an EP, TP or TP×EP layout over the replica's ranks), each replica
generating its contiguous share of every batch (``stalesync_rollout``), then the trainer group in any
layout the runtime trains (``stalesync_trainer``: GRPO hooks whose batches come from the queues). The
trainer group's first rank receives every replica's share, joins them into the batch and deals it to
the other trainer ranks, each of which slices its rows as the layout does. This module runs one rank
of it; ``stalesync_job`` holds what every rank shares, ``stalesync_schedule`` the versions, and
``stalesync_push`` the weight sync.

The schedule (deterministic, so a run is reproducible and k = 0 is the synchronous loop):

- the trainer tells the rollout worker the step it starts at (0, or a resumed checkpoint's) and pushes
  those weights;
- the rollout worker generates batch b (the prompts and per-sample generators of step b, exactly those
  of the synchronous loop) with weights of version ``max(b − k, start)`` (``Schedule``; and, when the
  run saves checkpoints, never older than the newest checkpoint step ≤ b: a checkpoint is a
  synchronisation point, so a resumed run generates what the uninterrupted one did), scores it and puts
  it on the queue (``rollout_queue``: at most k + 1 batches in flight), tagged with that version;
- the trainer takes the next batch (every replica's share of it), admits it only if ``current version −
  batch version ≤ k`` (else it drops and counts it and takes the next; ``admission.StalenessGate``,
  shared with the colocated placement), trains one step, and pushes its new weights (version = steps
  taken) through the same bucketed, CRC-checked weight sync as RL Fusion
  (``moetrain.distributed.weight_sync``), but only the versions the rollout worker will use: each
  rollout rank receives the tensors it holds (a one-rank replica the whole model; a rank of a G-rank
  replica its experts by index and the dense tensors), each slice sent by the trainer rank that owns it
  (TP shards by range, experts by index, replicated tensors by one holder);
- the rollout worker receives version v just before it generates the first batch that needs it; the
  sync checks every bucket's version and checksum on the receiving side, so a missed or damaged push
  fails the run.

With partial rollouts (``StaleSyncOptions.partial_rollouts``) a batch whose successor starts on newer
weights that the trainer has by then is interrupted halfway and resumed on them (``partial_rollout``;
``Schedule.resume_version``); its samples record their tokens' versions and are admitted by the oldest.

While the trainer trains step s, the rollout worker generates batch s + k: generation and training
overlap for k ≥ 1. By this schedule no batch is older than k when it arrives; the admission check is
the guard that proves it (a test injects an old batch, which is dropped and never trained on).

Staleness is corrected in the loss: by default the truncated importance weight min(π_old/μ, C) against
the behaviour policy μ's rollout log-probs (``grpo``); with ``loss="decoupled"`` the ratio is taken
against a proximal policy π_prox (the trainer's weights before the step, one extra forward) and the
weight is min(π_prox/μ, C) (Hilton et al. 2022, "Batch size-invariance for policy optimization").
"""

from __future__ import annotations

import re
import time

from moetrain.distributed.weight_sync import WeightSyncError
from moetrain.errors import UserError
from moetrain.rl.roles import ROLLOUT, TRAINER, Roles
from moetrain.rl.stalesync_job import Channels, StaleSyncJob
from moetrain.rl.stalesync_rollout import RolloutReport, RolloutWorker, sampling_params
from moetrain.rl.stalesync_schedule import Schedule
from moetrain.rl.stalesync_stages import StageReport, middle_stage
from moetrain.rl.stalesync_trainer import PEER_LOST, PeerLost, StaleSyncHooks, TrainerReport, train_rank

__all__ = ["Channels", "RolloutReport", "RolloutWorker", "Schedule", "StaleSyncJob", "StaleSyncHooks",
           "StaleSyncWorkerError", "TrainerReport", "run_stalesync", "sampling_params"]

PEER_GRACE_S = 5.0


class StaleSyncWorkerError(RuntimeError):
    """A worker of the pipeline failed: the one message of the run names it."""


def run_stalesync(rank: int, world_size: int, job: StaleSyncJob) -> RolloutReport | TrainerReport | StageReport:
    """One rank of the run (``spawn``'s entry in tests and benchmarks; the CLI's ranks call it too).
    A failure is raised naming the worker; its peers, left waiting on a message or a sync, are stopped by
    the launcher (``spawn`` / torchrun end every rank when one fails) or by the group's timeout."""
    roles = job.roles
    channels = None
    try:
        channels = Channels.build(rank, roles, job.spec)
        stage = roles.stage(rank)
        if stage == ROLLOUT:
            return RolloutWorker(job, channels, rank=rank).run()
        if stage == TRAINER:
            return train_rank(job, channels)
        return middle_stage(stage, job, channels).run()
    except UserError:
        raise
    except Exception as exc:
        me = roles.worker_name(rank).removeprefix("StaleSync ") if rank < roles.world_size else f"rank {rank}"
        if isinstance(exc, PeerLost) or PEER_LOST.search(str(exc)):
            # A peer died: its own report (with the cause) should be the run's message, so give the
            # launcher time to see it first and stop this rank; otherwise this one names the lost peer.
            time.sleep(PEER_GRACE_S)
            gone = "stopped responding" if re.search(r"timed out|timeout", str(exc), re.I) else "died"
            raise StaleSyncWorkerError(f"{lost_peer(exc, rank, roles, channels)} {gone}: the {me} lost it "
                                       f"({str(exc).splitlines()[0][:120]})") from exc
        failed = rank
        if isinstance(exc, WeightSyncError) and exc.failed_rank is not None:
            failed = exc.failed_rank  # the sync group's ranks are the global ones: replicas, then trainers
        raise StaleSyncWorkerError(f"{roles.worker_name(failed)} failed: {type(exc).__name__}: {exc}") from exc


def lost_peer(exc: Exception, rank: int, roles: Roles, channels: Channels | None) -> str:
    """Whom a rank lost: a peer whose process has ended on this host (the one it was receiving from, if
    that one has), else a rank of a replica behind the replica's others (``ReplicaProgress``: hung, or
    ended on another host), else the one it was receiving from, or the other rank of a two-rank run; else
    "a StaleSync peer". gloo's error says only that a connection closed or a wait timed out, and a rank
    of a replica that is not its leader sends no batch, so the process check and the progress counts are
    what name it."""
    ended = [r for r in (channels.ended_ranks() if channels is not None else []) if r != rank]
    if not ended and channels is not None and channels.progress is not None:
        # none gone on this host: a replica rank behind its replica's others (hung, or gone elsewhere)
        ended = [r for r in channels.progress.stalled() if r != rank]
    if isinstance(exc, PeerLost) and (exc.rank in ended or not ended):
        return roles.lost_name(exc.rank)
    if ended:
        return roles.lost_name(ended[0])
    return roles.worker_name(1 - rank) if roles.world_size == 2 else "a StaleSync peer"
