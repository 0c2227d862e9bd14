"""What every rank of a disaggregated StaleSync run shares: the job (the run, its options, the pool's
size) and the process groups built from it (``Channels``).

Every rank builds the same groups in the same order (``torch.distributed.new_group``'s contract), member
or not: the queues' group (every rank), the weight sync's (every rollout rank and the trainer group), the
trainer group's layout and, when a replica has several ranks, the rollout pool's layout (``pool_layout``:
EP, TP or TP×EP over replica ``i``'s G ranks; the pool's data-parallel axis is the replicas).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrain.config import ModelConfig, ParallelConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import new_group
from moetrain.errors import UserError
from moetrain.rl.config import RLOptions, StaleSyncOptions
from moetrain.rl.replica_progress import ReplicaProgress
from moetrain.rl.roles import Roles

START_TAG = 3
"""The trainer's first step, sent to each rollout rank on the queue's group (the batches use tags 1, 2)."""
Slices = list[tuple[str, tuple[int, ...], torch.Tensor]]
"""(tensor name, global offsets, values) of the pieces of the weights a rank holds (a test hook's record)."""


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
    """Rollout replicas, generating contiguous shares of every batch."""
    ranks_per_replica: int = 1
    """Ranks of each replica: its generation layout's TP degree times its EP degree."""
    replica_tp: int = 1
    """The TP degree inside a replica (``Roles.replica_tp``: 1 EP only, ``ranks_per_replica`` TP only)."""
    resend_first_after: int | None = None
    """Test hook: after batch b, the rollout worker sends batch 0 again (an old batch the trainer must drop)."""
    record_weights: bool = False
    """Test hook: the reports keep the weights of every sync (each replica's after it, each trainer
    rank's slices as pushed), to compare them outside the sync's own checks."""

    @property
    def roles(self) -> Roles:
        return Roles(self.stale.reward_worker, self.options.grpo.kl_coef > 0, self.replicas, self.spec.world_size,
                     self.ranks_per_replica, self.replica_tp)


@dataclass(frozen=True)
class Channels:
    """The process groups of the run: the queues' (every rank), the weight sync's (the replicas and the
    trainer group), the trainer group's layout and the rollout pool's."""

    queue: dist.ProcessGroup
    sync: dist.ProcessGroup
    dims: ParallelDims
    roles: Roles
    pool: ParallelDims | None = None
    """The rollout pool's layout when a replica has several ranks (G > 1): ``pool_layout``."""
    processes: tuple[tuple[str, int], ...] = ()
    """Every rank's (host, process id): a rank that loses a peer tells which one is gone (``ended_ranks``)."""
    progress: ReplicaProgress | None = None
    """This rank's progress count in the store, and its replica peers' (``stalled``): which rank of a replica
    stopped answering."""

    @classmethod
    def build(cls, rank: int, roles: Roles, spec: RunSpec) -> Channels:
        """Every rank calls this, in this order (``new_group``'s contract)."""
        if dist.get_world_size() != roles.world_size:
            raise UserError(f"the disaggregated StaleSync run ({roles.replicas} rollout replica(s) of "
                            f"{roles.ranks_per_replica} rank(s), a trainer group of "
                            f"{roles.trainer_ranks}, {', '.join(roles.order[1:-1]) or 'no middle stage'}) runs on "
                            f"{roles.world_size} ranks, not {dist.get_world_size()}")
        dims = ParallelDims.build(spec.parallel, rank, spec.run.ranks_per_node, rank_offset=roles.first_trainer)
        pool = ParallelDims.build(pool_layout(roles), rank) if roles.ranks_per_replica > 1 else None
        everyone = list(range(roles.world_size))
        # the run's timeout (``new_group``), not torch's 30-minute default: a rank waiting on a hung peer gives up
        sync = new_group([*roles.replica_ranks, *roles.trainer_group])
        queue = new_group(everyone)
        progress = ReplicaProgress.of_group(rank, roles)  # its key written before the gather below
        processes: list = [None] * roles.world_size
        dist.all_gather_object(processes, (socket.gethostname(), os.getpid()), group=queue)
        return cls(queue, sync, dims, roles, pool, tuple(processes), progress)

    def ended_ranks(self) -> list[int]:
        """The ranks on this host whose process has ended (gone, or a zombie its launcher has not reaped):
        which peer a rank lost when gloo's error only says a connection closed. A rank on another host, or
        one that hangs, is not found here (``progress.stalled`` finds a replica's)."""
        host = socket.gethostname()
        return [rank for rank, (where, pid) in enumerate(self.processes) if where == host and _ended(pid)]


def pool_layout(roles: Roles) -> ParallelConfig:
    """The rollout pool's layout in the training runtime's grid (``distributed.layout.rank_groups``), each
    replica one expert-data-parallel position: EP (dp = R·G, ep = G), TP (dp = R, tp = G), or TP×EP (G = T·E:
    dp = R·E, tp = T, ep = E, etp = T). The last is the runtime's expert grid ``[edp, ep, etp]`` with etp = tp:
    the TP groups are T neighbouring ranks, and each EP group is the E ranks at one TP position (stride T),
    so the E·T ranks hold every pair (TP range, experts) once. The etp axis stays a replica axis of the
    experts (each rank keeps its experts whole, ``tp_generation.tp_ep_generation_model``): the ranks of a
    TP group generate the same tokens, so splitting an expert's FFN over them would save no work."""
    g = roles.ranks_per_replica
    if roles.replica_layout == "tp":
        return ParallelConfig(dp=roles.replicas, tp=g)
    if roles.replica_layout == "tp_ep":
        return ParallelConfig(dp=roles.replicas * roles.gen_ep, tp=roles.gen_tp, ep=roles.gen_ep, etp=roles.gen_tp)
    return ParallelConfig(dp=roles.rollout_ranks, ep=g)


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # the state follows the name
    except FileNotFoundError:
        return True
    except OSError:
        return False  # no /proc (not Linux): nothing is known
