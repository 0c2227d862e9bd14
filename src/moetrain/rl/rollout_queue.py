"""The bounded queues between the stages of a StaleSync pipeline (rollout worker, reward and reference
workers, trainer): batches as tensors over torch.distributed point-to-point messages.

A batch is the step index whose prompts and sample seeds it holds, the weight version that generated
it, and its scored samples (token ids, rollout log-probs, router replay record, rewards, advantages).
It travels as two messages on a process group of its own (so it never interleaves with the weight
sync's collectives): a fixed int64 header ``[index, version, payload bytes]`` (tag 1), then the payload
(tag 2): the generation's tensors and numbers, and what the stages added (rewards and advantages, the
reference log-probs), serialised by ``torch.save`` into one uint8 tensor, so every value arrives bit
for bit. A header of index −1 alone ends a stream that a stage forwards without counting batches. The
problems and texts are not sent: the receiver recomputes them from the index (problems are a function
of (seed, step)) and the token ids.

The sender keeps at most ``capacity`` batches in flight (sent with ``isend``, not yet received): the
rollout worker waits for the oldest before it sends one more, so it never runs further ahead of the
trainer than the queue holds.
"""

from __future__ import annotations

import io
from collections import deque
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from moetrain.rl.batch import Rollouts
from moetrain.rl.generate import Generation, concat_generations
from moetrain.rl.tasks import Problem

HEADER_TAG, PAYLOAD_TAG = 1, 2
END_INDEX = -1
"""A header with this index ends the stream: no batch follows."""


@dataclass(frozen=True)
class QueuedBatch:
    """One batch of the queue: what the stages before the trainer have made of it so far."""

    index: int
    """The step whose prompts and per-sample generators produced it."""
    version: int
    """Optimizer steps of the weights that generated it."""
    generation: Generation
    rewards_B: torch.Tensor | None = None
    """The scorer's rewards (None until a reward stage has scored the batch)."""
    advantages_B: torch.Tensor | None = None
    ref_logp_BS: torch.Tensor | None = None
    """The reference model's log-probs of the samples' tokens (a reference worker's; the KL term)."""

    @property
    def sample_versions(self) -> list[int]:
        """Each sample's oldest token's weight version (what admission judges): the header's version, or
        an older one than a partial rollout's later tokens."""
        return self.generation.sample_versions

    @classmethod
    def joined(cls, parts: list[QueuedBatch]) -> QueuedBatch:
        """One batch from the replicas' shares of it, in replica order (rows are contiguous shares)."""
        first = parts[0]
        assert all(p.index == first.index and p.version == first.version for p in parts), \
            f"shares of different batches: {[(p.index, p.version) for p in parts]}"
        if len(parts) == 1:
            return first
        cat = lambda key: None if getattr(first, key) is None else torch.cat([getattr(p, key) for p in parts])
        return QueuedBatch(first.index, first.version, concat_generations([p.generation for p in parts]),
                           cat("rewards_B"), cat("advantages_B"), cat("ref_logp_BS"))

    def scored(self, rollouts: Rollouts) -> QueuedBatch:
        return replace(self, rewards_B=rollouts.rewards_B, advantages_B=rollouts.advantages_B)

    def rollouts(self, problems: list[Problem], decode) -> Rollouts:
        assert self.rewards_B is not None and self.advantages_B is not None, "an unscored batch"
        texts = [decode(self.generation.completion(row)) for row in range(len(problems))]
        return Rollouts(problems, self.generation, texts, self.rewards_B, self.advantages_B)


def pack(batch: QueuedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a batch."""
    generation = batch.generation
    state = {f.name: _cpu(getattr(generation, f.name)) for f in fields(generation)}
    state.update({name: _cpu(getattr(batch, name)) for name in EXTRAS})
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    header = torch.tensor([batch.index, batch.version, payload.numel()], dtype=torch.int64)
    return header, payload


EXTRAS = ("rewards_B", "advantages_B", "ref_logp_BS")


def unpack(header: torch.Tensor, payload: torch.Tensor) -> QueuedBatch:
    index, version, _ = header.tolist()
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    extras = {name: state.pop(name) for name in EXTRAS}
    return QueuedBatch(index, version, Generation(**state), **extras)


class BatchSender:
    """The rollout worker's end: at most ``capacity`` batches in flight to ``dst``."""

    def __init__(self, group: dist.ProcessGroup, dst: int, capacity: int) -> None:
        assert capacity >= 1
        self.group, self.dst, self.capacity = group, dst, capacity
        self.in_flight: deque[tuple[list[dist.Work], tuple[torch.Tensor, torch.Tensor]]] = deque()

    def put(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        while len(self.in_flight) >= self.capacity:
            self._wait_oldest()
        works = [dist.isend(header, self.dst, group=self.group, tag=HEADER_TAG),
                 dist.isend(payload, self.dst, group=self.group, tag=PAYLOAD_TAG)]
        self.in_flight.append((works, (header, payload)))  # the tensors live until their sends complete

    def close(self, end_mark: bool = False) -> None:
        """Wait until the next stage has received every batch; with ``end_mark``, tell it first that no
        batch follows (a reward or reference stage, which does not count the run's batches)."""
        if end_mark:
            header = torch.tensor([END_INDEX, 0, 0], dtype=torch.int64)
            self.in_flight.append(([dist.isend(header, self.dst, group=self.group, tag=HEADER_TAG)], (header,)))
        while self.in_flight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        works, _ = self.in_flight.popleft()
        for work in works:
            work.wait()


class BatchReceiver:
    """The trainer's end: the next batch from ``src``, in the order they were sent."""

    def __init__(self, group: dist.ProcessGroup, src: int) -> None:
        self.group, self.src = group, src

    def get(self) -> QueuedBatch | None:
        """The next batch; None after the previous stage's end mark."""
        header = torch.empty(3, dtype=torch.int64)
        dist.recv(header, self.src, group=self.group, tag=HEADER_TAG)
        if int(header[0]) == END_INDEX:
            return None
        payload = torch.empty(int(header[2]), dtype=torch.uint8)
        dist.recv(payload, self.src, group=self.group, tag=PAYLOAD_TAG)
        return unpack(header, payload)


def broadcast_batch(batch: QueuedBatch | None, group: dist.ProcessGroup, src: int) -> QueuedBatch:
    """Deal a batch from global rank ``src`` (which passes it) to every rank of ``group`` (the trainer
    group: each builds the whole batch, as the runtime's layouts expect, and slices its own rows)."""
    if batch is not None:
        header, payload = pack(batch)
    else:
        header = torch.empty(3, dtype=torch.int64)
    dist.broadcast(header, src, group=group)
    if batch is None:
        payload = torch.empty(int(header[2]), dtype=torch.uint8)
    dist.broadcast(payload, src, group=group)
    return batch if batch is not None else unpack(header, payload)


def _cpu(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value
