"""Roles by group: which process of a disaggregated StaleSync run does what.

The controller (every rank computes it from the spec, so no message assigns it) places the groups on
the global ranks in this order:

- ``replicas`` rollout replicas of ``ranks_per_replica`` (G) ranks each, ranks ``0 .. R·G − 1``, replica
  ``i`` on ranks ``i·G .. i·G + G − 1``: each replica generates its contiguous share of every batch, its
  G ranks in an EP layout (the experts split over them, the dense weights whole on each), a TP layout
  (the attention heads and dense FFN columns split over them, the experts whole on each) or both (G =
  T·E: TP groups of T neighbouring ranks, the experts split over the E ranks at one TP position), the
  same rows in lockstep; the replica's first rank (its leader) sends the share on;
- the trainer group, ranks ``R·G .. R·G + T − 1``: the training runtime in its own layout (``T`` = the
  trainer's tp·pp·dp ranks; EP and ETP live inside them); its first rank receives every batch;
- a reward worker and a reference worker when the run has them (then after the trainer group), between
  the rollout worker and the trainer in the order a batch visits them.

With one replica and one trainer rank this is the two-rank pipeline of before: rollout worker 0,
trainer 1, reward worker 2, reference worker 3. A middle stage takes every replica's share (from each
replica's leader) and passes the joined batch on; it sends to the trainer group's first rank.

Torch-free: the CLI sizes the launch with it before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ROLLOUT, REWARD, REFERENCE, TRAINER = "rollout worker", "reward worker", "reference worker", "trainer"


@dataclass(frozen=True)
class Roles:
    """The groups of one disaggregated run and the global ranks each holds."""

    reward: bool = False
    reference: bool = False
    replicas: int = 1
    """Rollout replicas."""
    trainer_ranks: int = 1
    """Ranks of the trainer group (its layout's world size)."""
    ranks_per_replica: int = 1
    """Ranks of each rollout replica (G: its generation layout's TP degree times its EP degree)."""
    replica_tp: int = 1
    """The TP degree T inside a replica, a divisor of G: 1 splits the experts over the G ranks (EP), G the
    heads and dense columns (TP), anything between both (T TP ranks times G / T EP ranks)."""

    def __post_init__(self) -> None:
        if min(self.replicas, self.trainer_ranks, self.ranks_per_replica) < 1:
            raise ValueError(f"a run needs a rollout replica of a rank and a trainer rank, not {self.replicas} "
                             f"replica(s) of {self.ranks_per_replica} and {self.trainer_ranks}")
        if self.replica_tp < 1 or self.ranks_per_replica % self.replica_tp:
            raise ValueError(f"a replica of {self.ranks_per_replica} ranks needs a TP degree that divides them, "
                             f"not {self.replica_tp}")

    @property
    def replica_layout(self) -> Literal["ep", "tp", "tp_ep"]:
        """How a replica of several ranks splits the model: its experts (ep), its heads and dense columns (tp),
        or both (tp_ep)."""
        if self.replica_tp == 1:
            return "ep"
        return "tp" if self.replica_tp == self.ranks_per_replica else "tp_ep"

    @property
    def gen_tp(self) -> int:
        """The TP degree inside a replica (1: none)."""
        return self.replica_tp

    @property
    def gen_ep(self) -> int:
        """The EP degree inside a replica (1: none)."""
        return self.ranks_per_replica // self.replica_tp

    def describe(self) -> str:
        """Who does what, as the run's first console line says it."""
        layout = f"TP{self.gen_tp}×EP{self.gen_ep}" if self.replica_layout == "tp_ep" else self.replica_layout.upper()
        each = f" of {self.ranks_per_replica} {layout} ranks" if self.ranks_per_replica > 1 else ""
        plural = "s" if self.replicas > 1 else ""
        replicas = (f"{self.replicas} rollout replica{plural}{each} (ranks 0–{self.rollout_ranks - 1})"
                    if self.rollout_ranks > 1 else "rollout worker (rank 0)")
        middle = "".join(f" → {stage} (rank {self.rank(stage)})" for stage in self.order[1:-1])
        group = self.trainer_group
        trainers = f"ranks {group[0]}–{group[-1]}" if len(group) > 1 else f"rank {group[0]}"
        return f"{replicas}{middle} → trainer ({trainers})"

    @property
    def order(self) -> tuple[str, ...]:
        """The stages in the order a batch visits them."""
        middle = ((REWARD,) if self.reward else ()) + ((REFERENCE,) if self.reference else ())
        return (ROLLOUT, *middle, TRAINER)

    @property
    def world_size(self) -> int:
        return self.rollout_ranks + self.trainer_ranks + len(self.order) - 2

    @property
    def rollout_ranks(self) -> int:
        return self.replicas * self.ranks_per_replica

    @property
    def replica_ranks(self) -> range:
        """Every rank of every rollout replica (each receives the weights it holds)."""
        return range(self.rollout_ranks)

    @property
    def replica_leaders(self) -> range:
        """Each replica's first rank: the one that sends the replica's share of every batch."""
        return range(0, self.rollout_ranks, self.ranks_per_replica)

    def replica_of(self, rank: int) -> int:
        return rank // self.ranks_per_replica

    @property
    def trainer_group(self) -> range:
        return range(self.rollout_ranks, self.rollout_ranks + self.trainer_ranks)

    @property
    def first_trainer(self) -> int:
        """The trainer rank that receives the batches and deals them to the others."""
        return self.rollout_ranks

    def rank(self, stage: str) -> int:
        """The rank a batch visits for ``stage`` (the rollout worker: replica 0's; the trainer: its first)."""
        if stage == ROLLOUT:
            return 0
        if stage == TRAINER:
            return self.first_trainer
        return self.rollout_ranks + self.trainer_ranks + self.order.index(stage) - 1

    def stage(self, rank: int) -> str:
        if rank in self.replica_ranks:
            return ROLLOUT
        if rank in self.trainer_group:
            return TRAINER
        return self.order[rank - self.rollout_ranks - self.trainer_ranks + 1]

    def next_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) + 1])

    def previous_rank(self, stage: str) -> int:
        return self.rank(self.order[self.order.index(stage) - 1])

    def worker_name(self, rank: int) -> str:
        """How a failure names a rank: ``StaleSync rollout worker (rank 0)``, ``StaleSync rollout replica 1
        (rank 1)`` when there are several replicas or ranks in one."""
        stage = self.stage(rank)
        if stage == ROLLOUT and self.rollout_ranks > 1:
            stage = f"rollout replica {self.replica_of(rank)}"
        return f"StaleSync {stage} (rank {rank})"

    def lost_name(self, rank: int) -> str:
        """How a failure names a rank that is gone: ``StaleSync rollout replica 1 rank 3`` for a rank of a
        replica of several ranks (which rank of the replica matters: only its leader sends batches), else
        as ``worker_name``."""
        if self.stage(rank) == ROLLOUT and self.ranks_per_replica > 1:
            return f"StaleSync rollout replica {self.replica_of(rank)} rank {rank}"
        return self.worker_name(rank)
