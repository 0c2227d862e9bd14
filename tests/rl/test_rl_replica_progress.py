"""The replicas' progress counts (``moetrain.rl.replica_progress``) on a store of this process: a replica
rank whose count lags its replica's others is the stalled one, read from any rank of the run."""

import torch
import torch.distributed as dist
from rl_models import small_model

from moetrain.rl.replica_progress import ReplicaProgress
from moetrain.rl.roles import Roles

ROLES = Roles(replicas=2, trainer_ranks=1, ranks_per_replica=2, replica_tp=2)


def test_the_replica_rank_whose_count_lags_its_replicas_others_is_the_stalled_one():
    store = dist.HashStore()
    ranks = [ReplicaProgress(store, rank, ROLES) for rank in range(5)]
    trainer = ranks[4]
    assert [p.counts for p in ranks] == [True] * 4 + [False]  # the trainer counts nothing, but reads
    assert trainer.stalled() == []  # every count 0
    for progress in ranks[:4]:
        progress.tick()  # a sync every replica rank takes
    ranks[2].tick()  # replica 1's leader starts a batch; rank 3 does not (hung)
    assert [p.stalled() for p in ranks] == [[3]] * 5
    ranks[3].tick()
    assert trainer.stalled() == []


def test_every_forward_of_the_generation_model_counts():
    store = dist.HashStore()
    leader, other = ReplicaProgress(store, 0, ROLES), ReplicaProgress(store, 1, ROLES)
    model = small_model()
    leader.watch(model)
    other.watch(small_model())
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert leader.count == 1 and other.count == 0
    assert other.stalled() == [1]


def test_one_rank_replicas_count_nothing_and_name_no_one():
    store = dist.HashStore()
    progress = ReplicaProgress(store, 0, Roles(replicas=2))
    progress.tick()
    assert not progress.counts and progress.count == 0 and progress.stalled() == []
    assert ReplicaProgress(None, 0, ROLES).stalled() == []
