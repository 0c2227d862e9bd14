"""Roles by group: which process of a disaggregated StaleSync run does what.

The controller (every rank computes it from the spec, so no message assigns it) places the groups on
the global ranks in this order:

- ``replicas`` rollout replicas, ranks ``0 .. R − 1``: each a whole generation model on one rank,
  generating its contiguous share of every batch;
- the trainer group, ranks ``R .. R + T − 1``: the training runtime in its own layout (``T`` = the
  trainer's tp·pp·dp ranks; EP and ETP live inside them); its first rank receives every batch;
- a reward worker and a reference worker when the run has them (then after the trainer group), between
  the rollout worker and the trainer in the order a batch visits them.

With one replica and one trainer rank this is the two-rank pipeline of before: rollout worker 0,
trainer 1, reward worker 2, reference worker 3. Middle stages run only there: a reward or reference
stage in front of a group of replicas or trainer ranks is not built.

Torch-free: the CLI sizes the launch with it before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT, REWARD, REFERENCE, TRAINER = "rollout worker", "reward worker", "reference worker", "trainer"


@dataclass(frozen=True)
class Roles:
    """The groups of one disaggregated run and the global ranks each holds."""

    reward: bool = False
    reference: bool = False
    replicas: int = 1
    """Rollout replicas, one rank each."""
    trainer_ranks: int = 1
    """Ranks of the trainer group (its layout's world size)."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.trainer_ranks < 1:
            raise ValueError(f"a run needs a rollout replica and a trainer rank, not {self.replicas} and "
                             f"{self.trainer_ranks}")
        if (self.reward or self.reference) and (self.replicas, self.trainer_ranks) != (1, 1):
            raise ValueError("reward and reference workers run between one rollout worker and a one-rank trainer")

    @property
    def order(self) -> tuple[str, ...]:
        """The stages in the order a batch visits them."""
        middle = ((REWARD,) if self.reward else ()) + ((REFERENCE,) if self.reference else ())
        return (ROLLOUT, *middle, TRAINER)

    @property
    def world_size(self) -> int:
        return self.replicas + self.trainer_ranks + len(self.order) - 2

    @property
    def replica_ranks(self) -> range:
        return range(self.replicas)

    @property
    def trainer_group(self) -> range:
        return range(self.replicas, self.replicas + self.trainer_ranks)

    @property
    def first_trainer(self) -> int:
        """The trainer rank that receives the batches and deals them to the others."""
        return self.replicas

    def rank(self, stage: str) -> int:
        """The rank a batch visits for ``stage`` (the rollout worker: replica 0's; the trainer: its first)."""
        if stage == ROLLOUT:
            return 0
        if stage == TRAINER:
            return self.first_trainer
        return self.replicas + self.trainer_ranks + self.order.index(stage) - 1

    def stage(self, rank: int) -> str:
        if rank in self.replica_ranks:
            return ROLLOUT
        if rank in self.trainer_group:
            return TRAINER
        return self.order[rank - self.replicas - self.trainer_ranks + 1]

    def next_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) + 1])

    def previous_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) - 1])

    def worker_name(self, rank: int) -> str:
        """How a failure names a rank: ``StaleSync rollout worker (rank 0)``, ``StaleSync rollout replica 1
        (rank 1)`` when there are several."""
        stage = self.stage(rank)
        if stage == ROLLOUT and self.replicas > 1:
            stage = f"rollout replica {rank}"
        return f"StaleSync {stage} (rank {rank})"
