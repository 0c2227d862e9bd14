"""StaleSync's replica side: a rollout rank generates its replica's share of every batch with the weights
the schedule names, receives the trainer's pushes, and (its replica's leader) queues the share.

A replica of G > 1 ranks generates in an EP layout (``fusion.ep_generation_model``, RL Fusion's
generation model: each rank holds ``experts / G`` experts of every MoE layer and the dense tensors whole,
the experts' all-to-all serves the G ranks) or a TP layout (``tp_generation_model``: each rank holds
``heads / G`` of every attention layer and ``1/G`` of every dense FFN's columns, the experts whole, the
row-parallel outputs summed over the G ranks), or both (``tp_ep_generation_model``: G = T·E ranks, each
with its TP range and ``experts / E`` experts). Either way the G ranks run the same rows in lockstep and
each receives only the weights it holds. Only the leader scores and sends: the others' rows are the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moetrain.distributed.weight_sync import SyncReport, WeightSync
from moetrain.models.transformer import build_model
from moetrain.rl.config import RLOptions
from moetrain.rl.fusion import ep_generation_model, generation_views, global_shapes, sample_generators
from moetrain.rl.generate import RolloutEngine, SamplingParams
from moetrain.rl.loop import scored_rollouts, step_problems
from moetrain.rl.partial_rollout import generate_with_resume
from moetrain.rl.replica_progress import ReplicaProgress
from moetrain.rl.roles import ROLLOUT
from moetrain.rl.rollout_queue import BatchSender, QueuedBatch, pack
from moetrain.rl.sft import prompt_ids
from moetrain.rl.stalesync_job import START_TAG, Channels, Slices, StaleSyncJob
from moetrain.rl.stalesync_schedule import Schedule
from moetrain.rl.tasks import get_task, new_tokens_for
from moetrain.rl.tokenizer import CharTokenizer
from moetrain.rl.tp_generation import check_experts_divide, tp_ep_generation_model, tp_generation_model
from moetrain.train.faults import injected_faults


@dataclass(frozen=True)
class RolloutReport:
    """What a rollout rank did."""

    batches: int
    generated_tokens: int
    versions: list[int]
    """The weight version each generated batch started with."""
    seconds: float
    syncs: list[SyncReport]
    """Every weight sync it received (bytes received, seconds)."""
    ideal_sync_bytes: int
    """Its share of the weights: the bytes of the generation model it holds (whole, its experts, or its TP
    shards)."""
    synced_pieces: dict[int, Slices] = field(default_factory=dict)
    """``record_weights``: its generation weights after each sync, by version, as global pieces."""


def sampling_params(options: RLOptions, max_new_tokens: int, eos_id: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=options.grpo.temperature,
                          top_k=options.top_k, top_p=options.top_p, stop_token_ids=(eos_id,))


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


class RolloutWorker:
    """A rank of a rollout replica: generate its replica's share of every batch with the weights the
    schedule names; the leader scores and queues it."""

    def __init__(self, job: StaleSyncJob, channels: Channels, rank: int = 0) -> None:
        roles = channels.roles
        self.job, self.k, self.rank = job, job.stale.staleness, rank
        self.replica = roles.replica_of(rank)
        self.task, self.tokenizer = get_task(job.options.task), CharTokenizer()
        self.device = torch.device("cpu")
        shapes = global_shapes(job.model_cfg)
        if channels.pool is None:
            # built from seed 0: every value is overwritten (and checked) by the version-0 sync
            self.model, stage = build_model(job.model_cfg, self.device, seed=0).eval().requires_grad_(False), None
        elif roles.replica_layout == "tp":
            self.model, stage = tp_generation_model(job.model_cfg, channels.pool, self.device)
        elif roles.replica_layout == "tp_ep":
            self.model, stage = tp_ep_generation_model(job.model_cfg, channels.pool, self.device)
        else:
            check_experts_divide(job.model_cfg, roles.ranks_per_replica)
            self.model, stage = ep_generation_model(job.model_cfg, channels.pool, self.device)
        self.sync = WeightSync.plan({}, generation_views(self.model, stage, shapes),
                                    int(job.stale.bucket_mib * 2**20), channels.sync)
        self.progress = channels.progress or ReplicaProgress(None, rank, roles)
        self.progress.watch(self.model)
        self.engine = RolloutEngine(self.model, self.tokenizer.pad_id, self.tokenizer.decode)
        max_new = new_tokens_for(self.task, job.options.max_new_tokens)
        self.sampling = sampling_params(job.options, max_new, self.tokenizer.eos_id)
        self.channels = channels
        self.leads = rank in roles.replica_leaders
        self.scores = self.leads and not roles.reward  # else the reward worker does (or the leader)
        self.sender = BatchSender(channels.queue, roles.next_rank(ROLLOUT), capacity=self.k + 1) if self.leads \
            else None
        self.version = -1
        self.syncs: list[SyncReport] = []
        self.synced_pieces: dict[int, Slices] = {}

    def starting_step(self) -> int:
        """The trainer's first step (0, or the step of the checkpoint it resumed from)."""
        step = torch.empty(1, dtype=torch.int64)
        dist.recv(step, self.channels.roles.first_trainer, group=self.channels.queue, tag=START_TAG)
        return int(step)

    def receive(self, version: int) -> int:
        """The trainer's push of ``version`` (every bucket's version and CRC checked by the sync)."""
        self.syncs.append(self.sync.run(version))
        self.progress.tick()
        self.version = version
        if self.job.record_weights:
            self.synced_pieces[version] = [(name, offsets, piece.detach().clone())
                                           for name, view in self.sync.targets.items()
                                           for offsets, piece in view.pieces]
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
        fault = injected_faults(self.rank)
        for batch in range(schedule.start, schedule.last):
            version = schedule.version(batch)
            if version != self.version:
                self.receive(version)
            fault(batch, "step")  # MOETRAIN_FAULT=RANK:B:KIND: this rank, holding batch B's weights
            self.progress.tick()
            queued = self.generate(batch, schedule.resume_version(batch))
            tokens += queued.generation.num_generated
            versions.append(version)
            if self.sender is None:
                continue  # the leader of this replica sends the rows all its ranks generated
            message = pack(queued)
            first = first or message
            self.sender.put(*message)
            if batch == self.job.resend_first_after:
                self.sender.put(*first)
        if self.sender is not None:
            self.sender.close(end_mark=self.sender.dst != self.channels.roles.first_trainer)
        return RolloutReport(len(versions), tokens, versions, time.perf_counter() - start, self.syncs,
                             model_bytes(self.model), self.synced_pieces)
