"""StaleSync, disaggregated: one rollout worker and one trainer on two ranks, joined by a bounded queue,
the trainer admitting samples at most k weight versions old.

Rank 0, the rollout worker, holds a whole generation model; rank 1, the trainer, is ``RLTrainer`` on a
one-rank layout whose batch source is the queue instead of its own engine (``StaleSyncTrainer``
overrides ``rollout``; the step, the GRPO objective, metrics and checkpoints are the runtime's).

The schedule (deterministic, so a run is reproducible and k = 0 is the synchronous loop):

- the trainer tells the rollout worker the step it starts at (0, or a resumed checkpoint's) and pushes
  those weights;
- the rollout worker generates batch b (the prompts and per-sample generators of step b, exactly those
  of the synchronous loop) with weights of version ``max(b − k, start)`` (``Schedule``; and, when the
  run saves checkpoints, never older than the newest checkpoint step ≤ b: a checkpoint is a
  synchronisation point, so a resumed run generates what the uninterrupted one did), scores it and puts
  it on the queue (``rollout_queue``: at most k + 1 batches in flight), tagged with that version;
- the trainer takes the next batch, admits it only if ``current version − batch version ≤ k`` (else it
  drops and counts it and takes the next; ``admission.StalenessGate``, shared with the colocated
  placement), trains one step, and pushes its new weights (version = steps taken) through the same
  bucketed, CRC-checked weight sync as RL Fusion (``moetrain.distributed.weight_sync``), but only the
  versions the rollout worker will use;
- the rollout worker receives version v just before it generates the first batch that needs it; the sync checks every
  bucket's version and checksum on the receiving side, so a missed or damaged push fails the run.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import ModelConfig, ParallelConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.weight_sync import SyncInFlight, WeightSync
from moetrain.errors import UserError
from moetrain.models.transformer import MoETransformer, build_model
from moetrain.rl.admission import AdmissionStats, StalenessGate
from moetrain.rl.batch import Rollouts, TrainingSequences
from moetrain.rl.config import RLOptions, StaleSyncOptions
from moetrain.rl.fusion import generation_views, global_shapes, sample_generators, training_views
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.loop import RLTrainer, scored_rollouts, step_problems
from moetrain.rl.rollout_queue import BatchReceiver, BatchSender, QueuedBatch, pack
from moetrain.rl.sft import prompt_ids
from moetrain.rl.stalesync_stages import StageReport, middle_stage
from moetrain.rl.tasks import get_task
from moetrain.rl.tokenizer import CharTokenizer

ROLLOUT_RANK, TRAINER_RANK = 0, 1
START_TAG = 3
"""The trainer's first step, sent to the rollout worker on the queue's group (the batches use tags 1, 2)."""


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

    @classmethod
    def of_run(cls, staleness: int, spec: RunSpec, start: int) -> Schedule:
        run = spec.run
        last = min(spec.training.steps, run.stop_at or spec.training.steps)
        return cls(staleness, last, start, run.save_every if run.save_dir is not None else 0)

    def version(self, batch: int) -> int:
        checkpoint = batch // self.save_every * self.save_every if self.save_every else 0
        return max(self.start, checkpoint, batch - self.staleness)

    def pushed(self) -> list[int]:
        """The versions the trainer pushes after the starting one: those some batch is generated with."""
        return sorted({self.version(b) for b in range(self.start, self.last)} - {self.start})


@dataclass(frozen=True)
class Pipeline:
    """The ranks of a run in the order a batch visits them: the rollout worker (rank 0), a reward worker
    and a reference worker when the run has them (ranks 2, 3), the trainer (rank 1)."""

    reward: bool = False
    reference: bool = False

    @classmethod
    def of(cls, stale: StaleSyncOptions, options: RLOptions) -> Pipeline:
        return cls(stale.reward_worker, options.grpo.kl_coef > 0)

    @property
    def order(self) -> tuple[str, ...]:
        middle = (("reward worker",) if self.reward else ()) + (("reference worker",) if self.reference else ())
        return ("rollout worker", *middle, "trainer")

    @property
    def world_size(self) -> int:
        return len(self.order)

    def rank(self, stage: str) -> int:
        position = self.order.index(stage)
        return {0: ROLLOUT_RANK, len(self.order) - 1: TRAINER_RANK}.get(position, position + 1)

    def stage(self, rank: int) -> str:
        return next(stage for stage in self.order if self.rank(stage) == rank)

    def next_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) + 1])

    def previous_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) - 1])

    def worker_name(self, rank: int) -> str:
        """How a failure names a rank: ``StaleSync rollout worker (rank 0)``."""
        return f"StaleSync {self.stage(rank)} (rank {rank})"


@dataclass(frozen=True)
class StaleSyncJob:
    """Everything both ranks need (picklable: ``spawn`` hands it to each process)."""

    spec: RunSpec
    """The GRPO run (a one-rank layout: the trainer's)."""
    options: RLOptions
    stale: StaleSyncOptions
    model_cfg: ModelConfig
    initial: dict[str, torch.Tensor] | None = None
    """The starting policy's weights (e.g. the SFT warm-up's); None: the model built from the seed."""
    resend_first_after: int | None = None
    """Test hook: after batch b, the rollout worker sends batch 0 again (an old batch the trainer must drop)."""

    @property
    def pipeline(self) -> Pipeline:
        return Pipeline.of(self.stale, self.options)


@dataclass(frozen=True)
class RolloutReport:
    """What the rollout worker did."""

    batches: int
    generated_tokens: int
    versions: list[int]
    """The weight version of each generated batch."""
    seconds: float


@dataclass(frozen=True)
class TrainerReport:
    rows: list[dict[str, Any]]
    trained: list[tuple[int, int]]
    """(batch index, batch version) of every batch trained on, in order."""
    samples: list[torch.Tensor]
    """Every trained batch's generated token ids [B, N]."""
    admission: AdmissionStats
    """The admission gate's counts and staleness histogram over the run."""
    final_state: dict[str, torch.Tensor]
    seconds: float

    @property
    def dropped_batches(self) -> int:
        return self.admission.dropped_batches

    @property
    def dropped_samples(self) -> int:
        return self.admission.dropped_samples


@dataclass(frozen=True)
class Channels:
    """The two process groups of the pipeline (the queue's over every rank, the weight sync's over the
    rollout worker and the trainer) and the trainer's layout."""

    queue: dist.ProcessGroup
    sync: dist.ProcessGroup
    dims: ParallelDims
    pipeline: Pipeline

    @classmethod
    def build(cls, rank: int, pipeline: Pipeline) -> Channels:
        """Every rank calls this, in this order (``new_group``'s contract)."""
        if dist.get_world_size() != pipeline.world_size:
            raise UserError(f"the disaggregated StaleSync pipeline ({', '.join(pipeline.order)}) runs on "
                            f"{pipeline.world_size} ranks, not {dist.get_world_size()}")
        dims = ParallelDims.build(ParallelConfig(), rank, rank_offset=TRAINER_RANK)
        everyone = list(range(pipeline.world_size))
        return cls(dist.new_group(everyone), dist.new_group([ROLLOUT_RANK, TRAINER_RANK]), dims, pipeline)


def sampling_params(options: RLOptions, max_new_tokens: int, eos_id: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=options.grpo.temperature,
                          top_k=options.top_k, top_p=options.top_p, stop_token_ids=(eos_id,))


class RolloutWorker:
    """Rank 0: generate, score and queue every batch of the run with the weights the schedule names."""

    def __init__(self, job: StaleSyncJob, channels: Channels) -> None:
        self.job, self.k = job, job.stale.staleness
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
        self.scores = not channels.pipeline.reward  # else the reward worker does
        self.sender = BatchSender(channels.queue, channels.pipeline.next_rank("rollout worker"), capacity=self.k + 1)
        self.version = -1

    def starting_step(self) -> int:
        """The trainer's first step (0, or the step of the checkpoint it resumed from)."""
        step = torch.empty(1, dtype=torch.int64)
        dist.recv(step, TRAINER_RANK, group=self.channels.queue, tag=START_TAG)
        return int(step)

    def receive(self, version: int) -> None:
        """The trainer's push of ``version`` (every bucket's version and CRC checked by the sync)."""
        self.sync.run(version)
        self.version = version

    def generate(self, batch: int) -> QueuedBatch:
        problems = step_problems(self.task, self.job.options, self.job.spec.training.seed, batch)
        prompts = [prompt_ids(self.tokenizer, p) for p in problems]
        generators = sample_generators(self.job.spec.training.seed, batch, len(problems), self.device)
        generation = self.engine.generate(prompts, self.sampling, generators, weight_version=self.version)
        queued = QueuedBatch(batch, self.version, generation)
        if self.scores:
            queued = queued.scored(scored_rollouts(self.task, self.tokenizer, self.job.options.grpo, problems,
                                                   generation))
        return queued

    def run(self) -> RolloutReport:
        start, tokens, versions = time.perf_counter(), 0, []
        first = None
        schedule = Schedule.of_run(self.k, self.job.spec, self.starting_step())
        for batch in range(schedule.start, schedule.last):
            version = schedule.version(batch)
            if version != self.version:
                self.receive(version)
            queued = self.generate(batch)
            tokens += queued.generation.num_generated
            versions.append(version)
            message = pack(queued)
            first = first or message
            self.sender.put(*message)
            if batch == self.job.resend_first_after:
                self.sender.put(*first)
        self.sender.close(end_mark=self.sender.dst != TRAINER_RANK)
        return RolloutReport(len(versions), tokens, versions, time.perf_counter() - start)


class StaleSyncTrainer(RLTrainer):
    """Rank 1: ``RLTrainer`` whose step batches come from the queue, admitted by their staleness."""

    def __init__(self, job: StaleSyncJob, channels: Channels, model: MoETransformer | None = None,
                 **kwargs: Any) -> None:
        self.receives_reference = channels.pipeline.reference
        super().__init__(job.spec, job.options, model_cfg=job.model_cfg, model=model, dims=channels.dims, **kwargs)
        self.stale = job.stale
        shapes = global_shapes(job.model_cfg)
        self.sync = WeightSync.plan(training_views(self.run, shapes), {}, int(job.stale.bucket_mib * 2**20),
                                    channels.sync)
        self.channels = channels
        self.receiver = BatchReceiver(channels.queue, channels.pipeline.previous_rank("trainer"))
        self._reference_logp: torch.Tensor | None = None
        self.pushes: list[int] | None = None
        self.in_flight: SyncInFlight | None = None
        self.trained: list[tuple[int, int]] = []
        self.samples: list[torch.Tensor] = []
        self.gate = StalenessGate(job.stale.staleness)

    def start_pipeline(self) -> None:
        """Before the first step (after a resume's load): tell the rollout worker where the run starts and
        push the starting weights, the version its first batch is generated with."""
        dist.send(torch.tensor([self.step], dtype=torch.int64), ROLLOUT_RANK, group=self.channels.queue,
                  tag=START_TAG)
        self.pushes = Schedule.of_run(self.stale.staleness, self.spec, self.step).pushed()
        self.sync.run(self.weight_version)

    def rollout(self, step: int) -> Rollouts:
        """The next admissible batch of the queue (older ones are dropped and counted)."""
        if self.pushes is None:
            self.start_pipeline()
        while True:
            batch = self.receiver.get()
            assert batch is not None, "the rollout stream ended before the run's last step"
            if self.gate.admit(self.weight_version, batch.sample_versions):
                break
        self.trained.append((batch.index, batch.version))
        self.samples.append(batch.generation.tokens_BN)
        self._pending.update(self.gate.stats().row(), batch_index=batch.index)
        self._reference_logp = batch.ref_logp_BS
        problems = step_problems(self.task, self.options, self.cfg.seed, batch.index)
        return batch.rollouts(problems, self.tokenizer.decode)

    def reference_logprobs(self, sequences: TrainingSequences) -> torch.Tensor:
        """The reference worker's log-probs of this batch."""
        assert self._reference_logp is not None, "a batch without the reference worker's log-probs"
        return self._reference_logp

    def proximal_logprobs(self, sequences: TrainingSequences) -> torch.Tensor | None:
        """The decoupled loss's π_prox: the current weights (before the step), with router replay."""
        return self.sequence_logprobs(self.run.stage.model, sequences) if self.stale.loss == "decoupled" else None

    def describe(self) -> str:
        pipeline = self.channels.pipeline
        ranks = " → ".join(f"{stage} (rank {pipeline.rank(stage)})" for stage in pipeline.order)
        return (super().describe()
                + f" · StaleSync k={self.stale.staleness}, disaggregated: {ranks}, loss {self.stale.loss}")

    def after_step(self) -> dict[str, Any]:
        """Push the new weights when the rollout worker will use them: packed now, sent in the background
        while the next step trains (the previous push lands first, so pushes arrive in order)."""
        extra = super().after_step()
        if self.pushes is not None and self.weight_version in self.pushes:
            start = time.perf_counter()
            extra.update(self.push_landed())
            self.in_flight = self.sync.start(self.weight_version)
            extra.update(sync_version=self.weight_version, sync_pack_s=self.in_flight.pack_s,
                         sync_time_s=time.perf_counter() - start)
        return extra

    def push_landed(self) -> dict[str, Any]:
        """Wait for the push in flight, if any (raising what it raised); its figures for the metrics row."""
        if self.in_flight is None:
            return {}
        report, self.in_flight = self.in_flight.wait(), None
        return {"sync_landed_version": report.version, "sync_mib": report.bytes_sent / 2**20,
                "sync_landed_s": report.seconds}


PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Socket Timeout|timed out", re.I)
"""gloo's errors of a rank whose peer is gone (as ``distributed.launch`` recognises them)."""
PEER_GRACE_S = 5.0


class StaleSyncWorkerError(RuntimeError):
    """A worker of the pipeline failed: the one message of the run names it."""


def run_stalesync(rank: int, world_size: int, job: StaleSyncJob) -> RolloutReport | TrainerReport | StageReport:
    """One rank of the pipeline (``spawn``'s entry in tests and benchmarks; the CLI's ranks call it too).
    A failure is raised naming the worker; its peers, left waiting on a message or a sync, are stopped by
    the launcher (``spawn`` / torchrun end every rank when one fails) or by the group's timeout."""
    pipeline = job.pipeline
    try:
        channels = Channels.build(rank, pipeline)
        stage = pipeline.stage(rank)
        if stage == "rollout worker":
            return RolloutWorker(job, channels).run()
        if stage == "trainer":
            return _train(job, channels)
        return middle_stage(stage, job, channels).run()
    except UserError:
        raise
    except Exception as exc:
        me = pipeline.stage(rank) if rank < pipeline.world_size else f"rank {rank}"
        if PEER_LOST.search(str(exc)):
            # A peer died: its own report (with the cause) should be the run's message, so give the
            # launcher time to see it first and stop this rank; otherwise this one names the lost peer
            # (the other rank of a two-rank pipeline; "a peer" in a longer one).
            time.sleep(PEER_GRACE_S)
            peer = pipeline.worker_name(1 - rank) if pipeline.world_size == 2 else "a StaleSync peer"
            raise StaleSyncWorkerError(f"{peer} died: the {me} (rank {rank}) lost it "
                                       f"({str(exc).splitlines()[0][:120]})") from exc
        raise StaleSyncWorkerError(f"{pipeline.worker_name(rank)} failed: {type(exc).__name__}: {exc}") from exc


def _train(job: StaleSyncJob, channels: Channels) -> TrainerReport:
    model = build_model(job.model_cfg, torch.device("cpu"), seed=job.spec.training.seed)
    if job.initial is not None:
        model.load_state_dict(job.initial)
    start = time.perf_counter()
    trainer = StaleSyncTrainer(job, channels, model=model)
    trainer.console.print(trainer.describe())
    rows = trainer.train()
    trainer.push_landed()  # the last push reaches the rollout worker before this rank leaves
    state = {name: value.detach().clone() for name, value in trainer.run.stage.model.state_dict().items()}
    return TrainerReport(rows, trainer.trained, trainer.samples, trainer.gate.stats(), state,
                         time.perf_counter() - start)
