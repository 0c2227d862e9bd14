"""StaleSync's trainer side: the runtime's ``Trainer`` with GRPO's hooks whose step batches come from the
rollout replicas' queues instead of its own engine (``StaleSyncHooks`` overrides ``rollout``; the step, the
GRPO objective, metrics and checkpoints are the runtime's), admitted by their staleness
(``admission.StalenessGate``), its new weights pushed to the replicas after each step they will use
(``stalesync_push``).

The trainer group's first rank receives every replica's share (from each replica's leader), joins them
into the batch and deals it to the other trainer ranks, each of which slices its rows as the layout does.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetrain.data.packing import StepBatch
from moetrain.distributed.weight_sync import SyncReport
from moetrain.models.transformer import build_model
from moetrain.rl.admission import AdmissionStats, StalenessGate
from moetrain.rl.batch import Rollouts, TrainingSequences
from moetrain.rl.fusion import global_shapes
from moetrain.rl.loop import GRPO, step_problems
from moetrain.rl.roles import ROLLOUT, TRAINER
from moetrain.rl.rollout_queue import BatchReceiver, QueuedBatch, broadcast_batch
from moetrain.rl.stalesync_job import START_TAG, Channels, Slices, StaleSyncJob
from moetrain.rl.stalesync_push import WeightPush
from moetrain.rl.stalesync_schedule import Schedule
from moetrain.train.trainer import SuppliedParts, Trainer

PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Socket Timeout|timed out", re.I)
"""gloo's errors of a rank whose peer is gone (as ``distributed.launch`` recognises them)."""


@dataclass(frozen=True)
class TrainerReport:
    """What a trainer rank did (every rank of the group trains on the same batches)."""

    rows: list[dict[str, Any]]
    trained: list[tuple[int, int]]
    """(batch index, batch version) of every batch trained on, in order."""
    samples: list[torch.Tensor]
    """Every trained batch's generated token ids [B, N]."""
    admission: AdmissionStats
    """The admission gate's counts and staleness histogram over the run."""
    final_state: dict[str, torch.Tensor]
    """This rank's trained tensors (its shards in a multi-rank layout)."""
    seconds: float
    push_reports: list[SyncReport]
    """Every push of this rank (bytes sent, seconds)."""
    pushed_slices: dict[int, Slices] = field(default_factory=dict)
    """``record_weights``: per pushed version, this rank's slices (tensor name, global offsets, values)."""

    @property
    def dropped_batches(self) -> int:
        return self.admission.dropped_batches

    @property
    def dropped_samples(self) -> int:
        return self.admission.dropped_samples


class PeerLost(RuntimeError):
    """A rank this one was receiving from is gone (gloo closed its connection)."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(str(cause).splitlines()[0][:120])
        self.rank = rank


class StaleSyncHooks(GRPO):
    """A trainer rank's hooks: GRPO's, whose step batches come from the queues, admitted by their staleness.
    The group's first rank receives every replica's share and deals the batch to the others."""

    def __init__(self, job: StaleSyncJob, channels: Channels) -> None:
        super().__init__(job.spec, job.options, reference_in_batches=channels.roles.reference)
        self.job, self.stale, self.channels = job, job.stale, channels
        roles = channels.roles
        self.receives = channels.dims.rank == roles.first_trainer
        sources = list(roles.replica_leaders) if roles.order[-2] == ROLLOUT else [roles.previous_rank(TRAINER)]
        self.receivers = [BatchReceiver(channels.queue, src) for src in sources] if self.receives else []
        self.push: WeightPush | None = None
        self.pushes: list[int] | None = None
        self.trained: list[tuple[int, int]] = []
        self.samples: list[torch.Tensor] = []
        self.gate = StalenessGate(job.stale.staleness)

    def attach(self, trainer: Trainer) -> None:
        super().attach(trainer)
        self.push = WeightPush(trainer.run, global_shapes(self.job.model_cfg), self.channels,
                               int(self.stale.bucket_mib * 2**20), record=self.job.record_weights)

    def start_pipeline(self, trainer: Trainer) -> None:
        """Before the first step (after a resume's load): tell the rollout replicas where the run starts and
        push the starting weights, the version their first batch is generated with."""
        if self.receives:
            for replica in self.channels.roles.replica_ranks:
                dist.send(torch.tensor([trainer.step], dtype=torch.int64), replica, group=self.channels.queue,
                          tag=START_TAG)
        self.pushes = Schedule.of_run(self.stale.staleness, self.spec, trainer.step,
                                      self.stale.partial_rollouts).pushed()
        assert self.push is not None
        self.push.now(trainer.step)

    def next_queued(self, trainer: Trainer) -> QueuedBatch:
        """The next batch on every trainer rank: the first one joins the replicas' shares and deals it."""
        batch = None
        if self.receives:
            parts = []
            for receiver in self.receivers:
                try:
                    part = receiver.get()
                except RuntimeError as exc:
                    if PEER_LOST.search(str(exc)):
                        raise PeerLost(receiver.src, exc) from exc
                    raise
                assert part is not None, "the rollout stream ended before the run's last step"
                parts.append(part)
            batch = QueuedBatch.joined(parts)
        if self.channels.roles.trainer_ranks == 1:
            assert batch is not None
            return batch
        return broadcast_batch(batch, trainer.dims.get_group("world"), self.channels.roles.first_trainer)

    def rollout(self, trainer: Trainer, step: int) -> Rollouts:
        """The next admissible batch of the queues (older ones are dropped and counted)."""
        if self.pushes is None:
            self.start_pipeline(trainer)
        while True:
            batch = self.next_queued(trainer)
            if self.gate.admit(trainer.step, batch.sample_versions):
                break
        self.trained.append((batch.index, batch.version))
        self.samples.append(batch.generation.tokens_BN)
        trainer.note(**self.gate.stats().row(), batch_index=batch.index)
        versions_BN = batch.generation.token_versions_BN
        if versions_BN is not None:  # a partial rollout: the newest weights any of its tokens came from
            trainer.note(newest_token_version=int(versions_BN.max()))
        problems = step_problems(self.task, self.options, self.cfg.seed, batch.index)
        return dataclasses.replace(batch.rollouts(problems, self.tokenizer.decode), reference_logp_BS=batch.ref_logp_BS)

    def reference_logprobs(self, trainer: Trainer, rollouts: Rollouts, sequences: TrainingSequences) -> torch.Tensor:
        """The reference worker's log-probs of this batch (they came with it from the queue)."""
        assert rollouts.reference_logp_BS is not None, "a batch without the reference worker's log-probs"
        return rollouts.reference_logp_BS

    def proximal_logprobs(self, trainer: Trainer, sequences: TrainingSequences) -> torch.Tensor | None:
        """The decoupled loss's π_prox: the current weights (before the step), with router replay."""
        if self.stale.loss != "decoupled":
            return None
        if self.fusion is not None:  # a sharded layout: the whole model the evaluation uses, synced now
            self.fusion.ensure_synced(trainer.step)
            return self.sequence_logprobs(trainer, self.fusion.model, sequences)
        return self.sequence_logprobs(trainer, trainer.run.stage.model, sequences)

    def replay_diagnostics(self, trainer: Trainer, sequences: TrainingSequences) -> dict[str, float]:
        if self.fusion is not None:  # the whole model of a sharded layout holds the current weights first
            self.fusion.ensure_synced(trainer.step)
        return super().replay_diagnostics(trainer, sequences)

    def ranks_in_run(self, trainer: Trainer) -> int:
        return self.channels.roles.world_size  # the replicas (and middle stages) too: a restart names them

    def fusion_text(self) -> str:
        return ""  # a sharded trainer's whole model per rank only evaluates: the roles below say who generates

    def describe(self, trainer: Trainer) -> str:
        return (super().describe(trainer) + f" · StaleSync k={self.stale.staleness}, disaggregated: "
                f"{self.channels.roles.describe()}, loss {self.stale.loss}"
                + (", partial rollouts" if self.stale.partial_rollouts else ""))

    def after_step(self, trainer: Trainer, step: int, batch: StepBatch) -> dict[str, Any]:
        """Push the new weights when the rollout replicas will use them: packed now, sent in the background
        while the next step trains (the previous push lands first, so pushes arrive in order)."""
        extra = super().after_step(trainer, step, batch)
        if self.pushes is not None and step in self.pushes:
            assert self.push is not None
            extra.update(self.push.start(step))
        return extra


def train_rank(job: StaleSyncJob, channels: Channels) -> TrainerReport:
    """One trainer rank's whole run."""
    model = build_model(job.model_cfg, torch.device("cpu"), seed=job.spec.training.seed)
    if job.initial is not None:
        model.load_state_dict(job.initial)
    start = time.perf_counter()
    hooks = StaleSyncHooks(job, channels)
    trainer = Trainer(job.spec, SuppliedParts(dims=channels.dims, model_cfg=job.model_cfg, model=model, hooks=hooks))
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    assert hooks.push is not None
    hooks.push.landed()  # the last push reaches the replicas before this rank leaves
    state = {name: value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}
    return TrainerReport(rows, hooks.trained, hooks.samples, hooks.gate.stats(), state,
                         time.perf_counter() - start, hooks.push.reports, hooks.push.slices)
