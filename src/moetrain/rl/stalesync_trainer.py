"""StaleSync's trainer side: ``RLTrainer`` whose step batches come from the rollout replicas' queues instead
of its own engine (``StaleSyncTrainer`` overrides ``rollout``; the step, the GRPO objective, metrics and
checkpoints are the runtime's), admitted by their staleness (``admission.StalenessGate``), its new
weights pushed to the replicas after each step they will use (``stalesync_push``).

The trainer group's first rank receives every replica's share (from each replica's leader), joins them
into the batch and deals it to the other trainer ranks, each of which slices its rows as the layout does.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetrain.distributed.weight_sync import SyncReport
from moetrain.models.transformer import MoETransformer, build_model
from moetrain.rl.admission import AdmissionStats, StalenessGate
from moetrain.rl.batch import Rollouts, TrainingSequences
from moetrain.rl.fusion import global_shapes
from moetrain.rl.loop import RLTrainer, step_problems
from moetrain.rl.roles import ROLLOUT, TRAINER
from moetrain.rl.rollout_queue import BatchReceiver, QueuedBatch, broadcast_batch
from moetrain.rl.stalesync_job import START_TAG, Channels, Slices, StaleSyncJob
from moetrain.rl.stalesync_push import WeightPush
from moetrain.rl.stalesync_schedule import Schedule

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


class StaleSyncTrainer(RLTrainer):
    """A trainer rank: ``RLTrainer`` whose step batches come from the queues, admitted by their staleness.
    The group's first rank receives every replica's share and deals the batch to the others."""

    def __init__(self, job: StaleSyncJob, channels: Channels, model: MoETransformer | None = None,
                 **kwargs: Any) -> None:
        self.receives_reference = channels.roles.reference
        super().__init__(job.spec, job.options, model_cfg=job.model_cfg, model=model, dims=channels.dims, **kwargs)
        self.job, self.stale = job, job.stale
        self.push = WeightPush(self.run, global_shapes(job.model_cfg), channels, int(job.stale.bucket_mib * 2**20),
                               record=job.record_weights)
        self.channels = channels
        roles = channels.roles
        self.receives = self.dims.rank == roles.first_trainer
        sources = list(roles.replica_leaders) if roles.order[-2] == ROLLOUT else [roles.previous_rank(TRAINER)]
        self.receivers = [BatchReceiver(channels.queue, src) for src in sources] if self.receives else []
        self._reference_logp: torch.Tensor | None = None
        self.pushes: list[int] | None = None
        self.trained: list[tuple[int, int]] = []
        self.samples: list[torch.Tensor] = []
        self.gate = StalenessGate(job.stale.staleness)

    def start_pipeline(self) -> None:
        """Before the first step (after a resume's load): tell the rollout replicas where the run starts and
        push the starting weights, the version their first batch is generated with."""
        if self.receives:
            for replica in self.channels.roles.replica_ranks:
                dist.send(torch.tensor([self.step], dtype=torch.int64), replica, group=self.channels.queue,
                          tag=START_TAG)
        self.pushes = Schedule.of_run(self.stale.staleness, self.spec, self.step, self.stale.partial_rollouts).pushed()
        self.push.now(self.weight_version)

    def next_queued(self) -> QueuedBatch:
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
        return broadcast_batch(batch, self.dims.get_group("world"), self.channels.roles.first_trainer)

    def rollout(self, step: int) -> Rollouts:
        """The next admissible batch of the queues (older ones are dropped and counted)."""
        if self.pushes is None:
            self.start_pipeline()
        while True:
            batch = self.next_queued()
            if self.gate.admit(self.weight_version, batch.sample_versions):
                break
        self.trained.append((batch.index, batch.version))
        self.samples.append(batch.generation.tokens_BN)
        self.note(**self.gate.stats().row(), batch_index=batch.index)
        versions_BN = batch.generation.token_versions_BN
        if versions_BN is not None:  # a partial rollout: the newest weights any of its tokens came from
            self.note(newest_token_version=int(versions_BN.max()))
        self._reference_logp = batch.ref_logp_BS
        problems = step_problems(self.task, self.options, self.cfg.seed, batch.index)
        return batch.rollouts(problems, self.tokenizer.decode)

    def reference_logprobs(self, sequences: TrainingSequences) -> torch.Tensor:
        """The reference worker's log-probs of this batch."""
        assert self._reference_logp is not None, "a batch without the reference worker's log-probs"
        return self._reference_logp

    def proximal_logprobs(self, sequences: TrainingSequences) -> torch.Tensor | None:
        """The decoupled loss's π_prox: the current weights (before the step), with router replay."""
        if self.stale.loss != "decoupled":
            return None
        if self.fusion is not None:  # a sharded layout: the whole model the evaluation uses, synced now
            self.fusion.ensure_synced(self.weight_version)
            return self.sequence_logprobs(self.fusion.model, sequences)
        return self.sequence_logprobs(self.run.stage.model, sequences)

    def replay_diagnostics(self, sequences: TrainingSequences) -> dict[str, float]:
        if self.fusion is not None:  # the whole model of a sharded layout holds the current weights first
            self.fusion.ensure_synced(self.weight_version)
        return super().replay_diagnostics(sequences)

    @property
    def ranks_in_run(self) -> int:
        return self.channels.roles.world_size  # the replicas (and middle stages) too: a restart names them

    def _fusion_text(self) -> str:
        return ""  # a sharded trainer's whole model per rank only evaluates: the roles below say who generates

    def describe(self) -> str:
        roles = self.channels.roles
        each = f" of {roles.ranks_per_replica} ranks" if roles.ranks_per_replica > 1 else ""
        plural = "s" if roles.replicas > 1 else ""
        replicas = (f"{roles.replicas} rollout replica{plural}{each} (ranks 0–{roles.rollout_ranks - 1})"
                    if roles.rollout_ranks > 1 else "rollout worker (rank 0)")
        middle = "".join(f" → {stage} (rank {roles.rank(stage)})" for stage in roles.order[1:-1])
        trainer = roles.trainer_group
        group = f"ranks {trainer[0]}–{trainer[-1]}" if len(trainer) > 1 else f"rank {trainer[0]}"
        return (super().describe() + f" · StaleSync k={self.stale.staleness}, disaggregated: {replicas}{middle} → "
                f"trainer ({group}), loss {self.stale.loss}"
                + (", partial rollouts" if self.stale.partial_rollouts else ""))

    def after_step(self) -> dict[str, Any]:
        """Push the new weights when the rollout replicas will use them: packed now, sent in the background
        while the next step trains (the previous push lands first, so pushes arrive in order)."""
        extra = super().after_step()
        if self.pushes is not None and self.weight_version in self.pushes:
            extra.update(self.push.start(self.weight_version))
        return extra


def train_rank(job: StaleSyncJob, channels: Channels) -> TrainerReport:
    """One trainer rank's whole run."""
    model = build_model(job.model_cfg, torch.device("cpu"), seed=job.spec.training.seed)
    if job.initial is not None:
        model.load_state_dict(job.initial)
    start = time.perf_counter()
    trainer = StaleSyncTrainer(job, channels, model=model)
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    trainer.push.landed()  # the last push reaches the replicas before this rank leaves
    state = {name: value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}
    return TrainerReport(rows, trainer.trained, trainer.samples, trainer.gate.stats(), state,
                         time.perf_counter() - start, trainer.push.reports, trainer.push.slices)
