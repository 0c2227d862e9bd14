"""The StaleSync pipeline's middle stages: a reward worker and a reference worker, each a rank of its own
between the rollout worker and the trainer (``moetrain.rl.roles.Roles``).

Each stage takes the next batch from the stage before it, adds what it computes, and passes it on
through a bounded queue of its own (``rollout_queue``: at most k + 1 batches in flight), so the four
kinds of work run concurrently on different batches:

- the **reward worker** scores the samples with the task's scorer and normalises rewards within each
  group (``loop.scored_rollouts``, what the rollout worker does when the run has no reward worker);
- the **reference worker** holds the frozen starting policy and computes the log-probs of every sample's
  tokens under it, with the generation's experts replayed (``loop.sequence_logprobs``, the trainer's own
  forward of its reference model in one process), for GRPO's KL term.

A stage does not count the run's batches: it forwards until the stage before it sends the end mark,
then sends its own (unless the trainer, which counts its steps, is next). Nothing here is timed against
the weights: the reference is fixed, and the scorer reads only the samples.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch

from moetrain.models.transformer import build_model
from moetrain.rl.batch import training_sequences
from moetrain.rl.loop import scored_rollouts, sequence_logprobs, step_problems
from moetrain.rl.roles import ROLLOUT
from moetrain.rl.rollout_queue import BatchReceiver, BatchSender, QueuedBatch, pack
from moetrain.rl.stalesync_job import Channels, StaleSyncJob
from moetrain.rl.tasks import get_task
from moetrain.rl.tokenizer import CharTokenizer


@dataclass(frozen=True)
class StageReport:
    """What a middle stage did."""

    stage: str
    batches: int
    busy_s: float
    """Seconds spent on its own work (not waiting for batches or for room in the next queue)."""


class Stage(ABC):
    """A rank that takes batches from the stage before it, adds its part, and passes them on."""

    name = ""

    def __init__(self, job: StaleSyncJob, channels: Channels) -> None:
        self.job, self.task, self.tokenizer = job, get_task(job.options.task), CharTokenizer()
        pipeline = channels.roles
        previous = pipeline.order[pipeline.order.index(self.name) - 1]
        sources = pipeline.replica_leaders if previous == ROLLOUT else [pipeline.previous_rank(self.name)]
        self.receivers = [BatchReceiver(channels.queue, src) for src in sources]
        self.sender = BatchSender(channels.queue, pipeline.next_rank(self.name), capacity=job.stale.staleness + 1)
        self.ends_stream = pipeline.order[pipeline.order.index(self.name) + 1] != "trainer"

    @abstractmethod
    def process(self, batch: QueuedBatch) -> QueuedBatch:
        """The batch with this stage's part added."""

    def run(self) -> StageReport:
        batches, busy = 0, 0.0
        while (batch := self.next_batch()) is not None:
            start = time.perf_counter()
            message = pack(self.process(batch))
            busy += time.perf_counter() - start
            self.sender.put(*message)
            batches += 1
        self.sender.close(end_mark=self.ends_stream)
        return StageReport(self.name, batches, busy)

    def next_batch(self) -> QueuedBatch | None:
        """The next batch, every replica's share joined in replica order (None: the stream has ended)."""
        parts = [receiver.get() for receiver in self.receivers]
        if any(part is None for part in parts):
            assert all(part is None for part in parts), "one replica's stream ended before the others'"
            return None
        return QueuedBatch.joined([part for part in parts if part is not None])

    def problems(self, batch: QueuedBatch):
        return step_problems(self.task, self.job.options, self.job.spec.training.seed, batch.index)


class RewardWorker(Stage):
    name = "reward worker"

    def process(self, batch: QueuedBatch) -> QueuedBatch:
        rollouts = scored_rollouts(self.task, self.tokenizer, self.job.options.grpo, self.problems(batch),
                                   batch.generation)
        return batch.scored(rollouts)


class ReferenceWorker(Stage):
    name = "reference worker"

    def __init__(self, job: StaleSyncJob, channels: Channels) -> None:
        super().__init__(job, channels)
        self.device = torch.device("cpu")
        # the starting policy, as the one-process trainer's reference is (``moetrain rl --kl-coef``)
        self.model = build_model(job.model_cfg, self.device, seed=job.spec.training.seed)
        if job.initial is not None:
            self.model.load_state_dict(job.initial)
        self.model.eval().requires_grad_(False)

    def process(self, batch: QueuedBatch) -> QueuedBatch:
        training = self.job.spec.training
        sequences = training_sequences(batch.rollouts(self.problems(batch), self.tokenizer.decode), training.seq_len,
                                       self.tokenizer.pad_id)
        logp_BS = sequence_logprobs(self.model, sequences, self.job.options, training.micro_batch, self.device)
        return replace(batch, ref_logp_BS=logp_BS)


def middle_stage(name: str, job: StaleSyncJob, channels: Channels) -> Stage:
    return {RewardWorker.name: RewardWorker, ReferenceWorker.name: ReferenceWorker}[name](job, channels)
