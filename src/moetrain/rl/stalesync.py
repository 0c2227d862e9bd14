"""StaleSync, disaggregated: rollout replicas and a trainer group on ranks of their own, joined by
bounded queues, the trainer admitting samples at most k weight versions old.

The ranks' roles follow from the spec (``roles.Roles``): R rollout replicas (ranks 0 .. R − 1), each a
whole generation model generating its contiguous share of every batch, then the trainer group in any
layout the runtime trains (``RLTrainer`` whose batch source is the queues instead of its own engine:
``StaleSyncTrainer`` overrides ``rollout``; the step, the GRPO objective, metrics and checkpoints are the
runtime's). The trainer group's first rank receives every replica's share, joins them into the batch
and deals it to the other trainer ranks, each of which slices its rows as the layout does.

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
  replica receives the whole model, each slice sent by the trainer rank that owns it (TP shards by
  range, experts by index, replicated tensors by one holder);
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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import ModelConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.weight_sync import SyncInFlight, SyncReport, WeightSync, WeightSyncError
from moetrain.distributed.world import collective_timeout
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer, build_model
from moetrain.rl.admission import AdmissionStats, StalenessGate
from moetrain.rl.batch import Rollouts, TrainingSequences
from moetrain.rl.config import RLOptions, StaleSyncOptions
from moetrain.rl.fusion import generation_views, global_shapes, sample_generators, training_views
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.loop import RLTrainer, scored_rollouts, step_problems
from moetrain.rl.partial_rollout import generate_with_resume
from moetrain.rl.roles import ROLLOUT, TRAINER, Roles
from moetrain.rl.rollout_queue import BatchReceiver, BatchSender, QueuedBatch, broadcast_batch, pack
from moetrain.rl.sft import prompt_ids
from moetrain.rl.stalesync_stages import StageReport, middle_stage
from moetrain.rl.tasks import get_task
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.train.faults import injected_faults

START_TAG = 3
"""The trainer's first step, sent to each rollout replica on the queue's group (the batches use tags 1, 2)."""


@dataclass(frozen=True)
class Schedule:
    """Which weight version generates each batch ``start .. last − 1`` of a run: at most ``staleness``
    versions old, and never older than the step the run started from or the newest checkpoint step at
    or before the batch. Checkpoints are synchronisation points (the batch after one is generated with
    the saved weights), so a run resumed from one generates exactly what the uninterrupted run did."""

    staleness: int
    last: int
    """The run ends after this step (``--steps``, or ``--stop-at``)."""
    start: int = 0
    """The step the run starts at (after a resume: the checkpoint's)."""
    save_every: int = 0
    """Checkpoint steps inside the run (0: none, or no save dir)."""
    partial: bool = False
    """Partial rollouts: a batch may finish on the weights its successor starts with (``resume_version``)."""

    @classmethod
    def of_run(cls, staleness: int, spec: RunSpec, start: int, partial: bool = False) -> Schedule:
        run = spec.run
        last = min(spec.training.steps, run.stop_at or spec.training.steps)
        return cls(staleness, last, start, run.save_every if run.save_dir is not None else 0, partial)

    def version(self, batch: int) -> int:
        checkpoint = batch // self.save_every * self.save_every if self.save_every else 0
        return max(self.start, checkpoint, batch - self.staleness)

    def resume_version(self, batch: int) -> int | None:
        """With partial rollouts: the version batch ``batch`` is resumed on after its interruption, the one
        its successor starts with, when that is newer and the trainer has made it before it needs this
        batch (version ≤ batch: never at k = 0, so k = 0 stays the synchronous loop); else None."""
        if not self.partial:
            return None
        newer = self.version(batch + 1)
        return newer if self.version(batch) < newer <= batch else None

    def pushed(self) -> list[int]:
        """The versions the trainer pushes after the starting one: those some batch is generated with."""
        used = {self.version(b) for b in range(self.start, self.last)}
        used |= {v for b in range(self.start, self.last) if (v := self.resume_version(b)) is not None}
        return sorted(used - {self.start})


@dataclass(frozen=True)
class StaleSyncJob:
    """Everything every rank needs (picklable: ``spawn`` hands it to each process)."""

    spec: RunSpec
    """The GRPO run: the trainer group's layout is its parallel section."""
    options: RLOptions
    stale: StaleSyncOptions
    model_cfg: ModelConfig
    initial: dict[str, torch.Tensor] | None = None
    """The starting policy's weights (e.g. the SFT warm-up's); None: the model built from the seed."""
    replicas: int = 1
    """Rollout replicas (one rank each), generating contiguous shares of every batch."""
    resend_first_after: int | None = None
    """Test hook: after batch b, the rollout worker sends batch 0 again (an old batch the trainer must drop)."""
    record_weights: bool = False
    """Test hook: the reports keep the weights of every sync (each replica's after it, each trainer
    rank's slices as pushed), to compare them outside the sync's own checks."""

    @property
    def roles(self) -> Roles:
        return Roles(self.stale.reward_worker, self.options.grpo.kl_coef > 0, self.replicas, self.spec.world_size)


@dataclass(frozen=True)
class RolloutReport:
    """What a rollout replica did."""

    batches: int
    generated_tokens: int
    versions: list[int]
    """The weight version each generated batch started with."""
    seconds: float
    syncs: list[SyncReport]
    """Every weight sync it received (bytes received, seconds)."""
    ideal_sync_bytes: int
    """Its share of the weights: the bytes of the whole generation model it holds."""
    synced_states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """``record_weights``: its generation weights after each sync, by version."""


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
    pushed_slices: dict[int, list[tuple[str, tuple[int, ...], torch.Tensor]]] = field(default_factory=dict)
    """``record_weights``: per pushed version, this rank's slices (tensor name, global offsets, values)."""

    @property
    def dropped_batches(self) -> int:
        return self.admission.dropped_batches

    @property
    def dropped_samples(self) -> int:
        return self.admission.dropped_samples


@dataclass(frozen=True)
class Channels:
    """The process groups of the run: the queues' (every rank), the weight sync's (the replicas and the
    trainer group) and the trainer group's layout."""

    queue: dist.ProcessGroup
    sync: dist.ProcessGroup
    dims: ParallelDims
    roles: Roles

    @classmethod
    def build(cls, rank: int, roles: Roles, spec: RunSpec) -> Channels:
        """Every rank calls this, in this order (``new_group``'s contract)."""
        if dist.get_world_size() != roles.world_size:
            raise UserError(f"the disaggregated StaleSync run ({roles.replicas} rollout replica(s), a trainer group of "
                            f"{roles.trainer_ranks}, {', '.join(roles.order[1:-1]) or 'no middle stage'}) runs on "
                            f"{roles.world_size} ranks, not {dist.get_world_size()}")
        dims = ParallelDims.build(spec.parallel, rank, spec.run.ranks_per_node, rank_offset=roles.first_trainer)
        everyone = list(range(roles.world_size))
        # the run's timeout, not new_group's 30-minute default: a rank waiting on a hung peer gives up in time
        timeout = collective_timeout()
        sync = dist.new_group([*roles.replica_ranks, *roles.trainer_group], timeout=timeout)
        return cls(dist.new_group(everyone, timeout=timeout), sync, dims, roles)


def sampling_params(options: RLOptions, max_new_tokens: int, eos_id: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=options.grpo.temperature,
                          top_k=options.top_k, top_p=options.top_p, stop_token_ids=(eos_id,))


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class RolloutWorker:
    """A rollout replica: generate, score and queue its share of every batch with the weights the
    schedule names."""

    def __init__(self, job: StaleSyncJob, channels: Channels, replica: int = 0) -> None:
        self.job, self.k, self.replica = job, job.stale.staleness, replica
        self.task, self.tokenizer = get_task(job.options.task), CharTokenizer()
        self.device = torch.device("cpu")
        # built from seed 0: every value is overwritten (and checked) by the version-0 sync
        self.model: MoETransformer = build_model(job.model_cfg, self.device, seed=0).eval().requires_grad_(False)
        shapes = global_shapes(job.model_cfg)
        self.sync = WeightSync.plan({}, generation_views(self.model, None, shapes),
                                    int(job.stale.bucket_mib * 2**20), channels.sync)
        self.engine = RolloutEngine(self.model, self.tokenizer.pad_id, self.tokenizer.decode)
        max_new = job.options.max_new_tokens or self.task.max_answer_chars + 2
        self.sampling = sampling_params(job.options, max_new, self.tokenizer.eos_id)
        self.channels = channels
        self.scores = not channels.roles.reward  # else the reward worker does
        self.sender = BatchSender(channels.queue, channels.roles.next_rank(ROLLOUT), capacity=self.k + 1)
        self.version = -1
        self.syncs: list[SyncReport] = []
        self.synced_states: dict[int, dict[str, torch.Tensor]] = {}

    def starting_step(self) -> int:
        """The trainer's first step (0, or the step of the checkpoint it resumed from)."""
        step = torch.empty(1, dtype=torch.int64)
        dist.recv(step, self.channels.roles.first_trainer, group=self.channels.queue, tag=START_TAG)
        return int(step)

    def receive(self, version: int) -> int:
        """The trainer's push of ``version`` (every bucket's version and CRC checked by the sync)."""
        self.syncs.append(self.sync.run(version))
        self.version = version
        if self.job.record_weights:
            self.synced_states[version] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return version

    def share(self, rows: int) -> range:
        """This replica's contiguous rows of a batch."""
        per = rows // self.channels.roles.replicas
        return range(self.replica * per, (self.replica + 1) * per)

    def generate(self, batch: int, resume_version: int | None = None) -> QueuedBatch:
        problems = step_problems(self.task, self.job.options, self.job.spec.training.seed, batch)
        rows = self.share(len(problems))
        problems = [problems[i] for i in rows]
        prompts = [prompt_ids(self.tokenizer, p) for p in problems]
        generators = sample_generators(self.job.spec.training.seed, batch, len(rows), self.device, first=rows.start)
        if resume_version is None:
            generation = self.engine.generate(prompts, self.sampling, generators, weight_version=self.version)
        else:
            generation = generate_with_resume(self.engine, prompts, self.sampling, generators, self.version,
                                              lambda: self.receive(resume_version))
        queued = QueuedBatch(batch, generation.weight_version, generation)
        if self.scores:
            queued = queued.scored(scored_rollouts(self.task, self.tokenizer, self.job.options.grpo, problems,
                                                   generation))
        return queued

    def run(self) -> RolloutReport:
        start, tokens, versions = time.perf_counter(), 0, []
        first = None
        stale = self.job.stale
        schedule = Schedule.of_run(stale.staleness, self.job.spec, self.starting_step(), stale.partial_rollouts)
        fault = injected_faults(self.channels.roles.replica_ranks[self.replica])
        for batch in range(schedule.start, schedule.last):
            version = schedule.version(batch)
            if version != self.version:
                self.receive(version)
            fault(batch, "step")  # MOETRAIN_FAULT=RANK:B:KIND: this replica, holding batch B's weights
            queued = self.generate(batch, schedule.resume_version(batch))
            tokens += queued.generation.num_generated
            versions.append(version)
            message = pack(queued)
            first = first or message
            self.sender.put(*message)
            if batch == self.job.resend_first_after:
                self.sender.put(*first)
        self.sender.close(end_mark=self.sender.dst != self.channels.roles.first_trainer)
        return RolloutReport(len(versions), tokens, versions, time.perf_counter() - start, self.syncs,
                             model_bytes(self.model), self.synced_states)


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
        self.shapes = global_shapes(job.model_cfg)
        self.sync = WeightSync.plan(training_views(self.run, self.shapes), {}, int(job.stale.bucket_mib * 2**20),
                                    channels.sync)
        self.channels = channels
        roles = channels.roles
        self.receives = self.dims.rank == roles.first_trainer
        sources = list(roles.replica_ranks) if roles.order[-2] == ROLLOUT else [roles.previous_rank(TRAINER)]
        self.receivers = [BatchReceiver(channels.queue, src) for src in sources] if self.receives else []
        self._reference_logp: torch.Tensor | None = None
        self.pushes: list[int] | None = None
        self.in_flight: SyncInFlight | None = None
        self.trained: list[tuple[int, int]] = []
        self.samples: list[torch.Tensor] = []
        self.push_reports: list[SyncReport] = []
        self.pushed_slices: dict[int, list[tuple[str, tuple[int, ...], torch.Tensor]]] = {}
        self.gate = StalenessGate(job.stale.staleness)

    def start_pipeline(self) -> None:
        """Before the first step (after a resume's load): tell the rollout replicas where the run starts and
        push the starting weights, the version their first batch is generated with."""
        if self.receives:
            for replica in self.channels.roles.replica_ranks:
                dist.send(torch.tensor([self.step], dtype=torch.int64), replica, group=self.channels.queue,
                          tag=START_TAG)
        self.pushes = Schedule.of_run(self.stale.staleness, self.spec, self.step, self.stale.partial_rollouts).pushed()
        self.record_slices(self.weight_version)
        self.push_reports.append(self.sync.run(self.weight_version))

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
        self._pending.update(self.gate.stats().row(), batch_index=batch.index)
        versions_BN = batch.generation.token_versions_BN
        if versions_BN is not None:  # a partial rollout: the newest weights any of its tokens came from
            self._pending["newest_token_version"] = int(versions_BN.max())
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
        replicas = (f"{roles.replicas} rollout replicas (ranks 0–{roles.replicas - 1})" if roles.replicas > 1
                    else "rollout worker (rank 0)")
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
            start = time.perf_counter()
            extra.update(self.push_landed())
            self.record_slices(self.weight_version)
            self.in_flight = self.sync.start(self.weight_version)
            extra.update(sync_version=self.weight_version, sync_pack_s=self.in_flight.pack_s,
                         sync_time_s=time.perf_counter() - start, **self.sync_bytes())
        return extra

    def sync_bytes(self) -> dict[str, Any]:
        """What every push moves, per rank of the plan, against the ideal: each replica receives its share
        (the whole model), and the trainer ranks send R × the model between them."""
        roles = self.channels.roles
        sent, received = self.sync.planned_bytes()
        whole = sum(shape.numel() for shape in self.shapes.values()) * 4  # fp32, as the generation models hold it
        return {"sync_received_mib": [received[r] / 2**20 for r in roles.replica_ranks],
                "sync_replica_share_mib": whole / 2**20,
                "sync_sent_mib": [sent[r] / 2**20 for r in roles.trainer_group]}

    def record_slices(self, version: int) -> None:
        if self.job.record_weights:
            self.pushed_slices[version] = [(name, offsets, piece.detach().clone())
                                           for name, view in self.sync.sources.items()
                                           for offsets, piece in view.pieces]

    def push_landed(self) -> dict[str, Any]:
        """Wait for the push in flight, if any (raising what it raised); its figures for the metrics row."""
        if self.in_flight is None:
            return {}
        report, self.in_flight = self.in_flight.wait(), None
        self.push_reports.append(report)
        return {"sync_landed_version": report.version, "sync_mib": report.bytes_sent / 2**20,
                "sync_landed_s": report.seconds}


PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Socket Timeout|timed out", re.I)
"""gloo's errors of a rank whose peer is gone (as ``distributed.launch`` recognises them)."""
PEER_GRACE_S = 5.0


class StaleSyncWorkerError(RuntimeError):
    """A worker of the pipeline failed: the one message of the run names it."""


def run_stalesync(rank: int, world_size: int, job: StaleSyncJob) -> RolloutReport | TrainerReport | StageReport:
    """One rank of the run (``spawn``'s entry in tests and benchmarks; the CLI's ranks call it too).
    A failure is raised naming the worker; its peers, left waiting on a message or a sync, are stopped by
    the launcher (``spawn`` / torchrun end every rank when one fails) or by the group's timeout."""
    roles = job.roles
    try:
        channels = Channels.build(rank, roles, job.spec)
        stage = roles.stage(rank)
        if stage == ROLLOUT:
            return RolloutWorker(job, channels, replica=rank).run()
        if stage == TRAINER:
            return _train(job, channels)
        return middle_stage(stage, job, channels).run()
    except UserError:
        raise
    except Exception as exc:
        me = roles.worker_name(rank).removeprefix("StaleSync ") if rank < roles.world_size else f"rank {rank}"
        if isinstance(exc, PeerLost) or PEER_LOST.search(str(exc)):
            # A peer died: its own report (with the cause) should be the run's message, so give the
            # launcher time to see it first and stop this rank; otherwise this one names the lost peer
            # (the one it was receiving from, or the other rank of a two-rank run; else "a peer").
            time.sleep(PEER_GRACE_S)
            peer = (roles.worker_name(exc.rank) if isinstance(exc, PeerLost) else
                    roles.worker_name(1 - rank) if roles.world_size == 2 else "a StaleSync peer")
            gone = "stopped responding" if re.search(r"timed out|timeout", str(exc), re.I) else "died"
            raise StaleSyncWorkerError(f"{peer} {gone}: the {me} lost it "
                                       f"({str(exc).splitlines()[0][:120]})") from exc
        failed = rank
        if isinstance(exc, WeightSyncError) and exc.failed_rank is not None:
            failed = exc.failed_rank  # the sync group's ranks are the global ones: replicas, then trainers
        raise StaleSyncWorkerError(f"{roles.worker_name(failed)} failed: {type(exc).__name__}: {exc}") from exc


def _train(job: StaleSyncJob, channels: Channels) -> TrainerReport:
    model = build_model(job.model_cfg, torch.device("cpu"), seed=job.spec.training.seed)
    if job.initial is not None:
        model.load_state_dict(job.initial)
    start = time.perf_counter()
    trainer = StaleSyncTrainer(job, channels, model=model)
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    trainer.push_landed()  # the last push reaches the replicas before this rank leaves
    state = {name: value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}
    return TrainerReport(rows, trainer.trained, trainer.samples, trainer.gate.stats(), state,
                         time.perf_counter() - start, trainer.push_reports, trainer.pushed_slices)
