"""StaleSync rollout replicas generating tensor-parallel (``--gen-tp``): each replica's ranks split the
attention heads and dense FFN columns, the weight sync gives each rank only its ranges, and at k = 0
the run is the one-process loop.

The TP ranges each rank should hold are computed here from the tensor names (Megatron's rule: q/kv
up-projections and the dense gate/up split by output rows, o_proj and the dense down by input columns),
not read from the layout code."""

import time

import pytest
import torch
from rl_models import small_model
from test_rl_stalesync import _synchronous
from test_rl_stalesync_scale import EXACT, TP2, _cli_steps, _job, _run, _trainers_weights

from moetrain.distributed.weight_sync import SyncFault
from moetrain.distributed.world import spawn
from moetrain.rl import stalesync
from moetrain.rl.spec import resolve_rl_spec
from refusals import refused

TP = {"ranks_per_replica": 2, "replica_tp": 2}
ROWS = ("attention.q_up.weight", "attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight",
        "attention.kv_up.weight", "ffn.gate.weight", "ffn.up.weight")
COLUMNS = ("attention.o_proj.weight", "ffn.down.weight")


def _split_dim(name: str) -> int | None:
    return 0 if name.endswith(ROWS) else 1 if name.endswith(COLUMNS) else None


def _tp_range(whole: torch.Tensor, name: str, tp_rank: int, tp: int) -> torch.Tensor:
    """The part of a whole tensor that TP rank ``tp_rank`` of ``tp`` holds."""
    dim = _split_dim(name)
    if dim is None:
        return whole
    width = whole.shape[dim] // tp
    return whole.narrow(dim, tp_rank * width, width)


def _tp_share_bytes(tp: int, state: dict[str, torch.Tensor] | None = None) -> int:
    """A TP rollout rank's share of the weights (``state``: the tests' small model's): the split tensors'
    1/tp, the rest whole (fp32)."""
    state = state if state is not None else small_model().state_dict()
    return sum(v.numel() * v.element_size() // (tp if _split_dim(k) is not None else 1) for k, v in state.items())


def _assert_tp_ranks_hold_their_ranges(replicas, trainers, versions, tp: int = 2):
    """After each sync, rollout rank i·tp + r holds TP range r of every split tensor and every other tensor
    whole, equal bit for bit to the trainer's weights of that version (the values, not the pieces' labels)."""
    names = set(small_model().state_dict())
    assert any(_split_dim(name) == 0 for name in names) and any(_split_dim(name) == 1 for name in names)
    for version in versions:
        whole = _trainers_weights(trainers, version)
        for rank, replica in enumerate(replicas):
            held = replica.synced_pieces[version]
            assert {name for name, _, _ in held} == names, (version, rank)
            for name, _, piece in held:
                assert torch.equal(piece, _tp_range(whole[name], name, rank % tp, tp)), (version, rank, name)


def _assert_each_rank_received_its_share(replicas, tp: int = 2):
    share = _tp_share_bytes(tp)
    assert share < _tp_share_bytes(1)
    for replica in replicas:
        assert replica.ideal_sync_bytes == share
        for sync in replica.syncs:
            assert abs(sync.bytes_received - share) <= 0.1 * share
            assert sync.bytes_received == share


def assert_one_process_loop(trainer, steps: int) -> None:
    """The trainer's samples, losses and final weights are the one-process loop's bit for bit; the rollout
    log-probs μ of a sharded replica are not (TP's all-reduce and EP's all-to-all add partial sums in another
    order than one matmul), so their statistics (``is_weight_mean``, ``logp_gap_max``) are bounded instead."""
    rows, samples, state = _synchronous(steps)
    assert all(torch.equal(a, b) for a, b in zip(samples, trainer.samples, strict=True))  # same samples
    for want, got in zip(rows, trainer.rows, strict=True):
        assert {k: got.get(k) for k in EXACT} == {k: want.get(k) for k in EXACT}  # same losses
        if "is_weight_mean" in want:
            assert got["is_weight_mean"] == pytest.approx(want["is_weight_mean"], rel=1e-6)
        if "logp_gap_max" in want:
            assert max(got["logp_gap_max"], want["logp_gap_max"]) < 1e-5
    assert state.keys() == trainer.final_state.keys()
    assert all(torch.equal(value, trainer.final_state[name]) for name, value in state.items())


@pytest.mark.dist
def test_k0_two_replicas_of_two_tp_ranks_beside_one_trainer_rank_are_the_one_process_loop():
    """5 ranks: replicas of 2 TP ranks (ranks 0–1, 2–3) beside a one-rank trainer. The samples, the losses
    and the final weights are the one-process loop's bit for bit; the rollout log-probs μ are not (TP sums
    o_proj's and the dense down-projection's partial products over 2 ranks, in another order than one
    matmul), so their statistics (``is_weight_mean``, ``logp_gap_max``) are bounded instead."""
    steps = 2
    replicas, trainers = _run(_job(steps, 0, None, replicas=2, record_weights=True, **TP))
    (trainer,) = trainers
    assert len(replicas) == 4 and [r.versions for r in replicas] == [[0, 1]] * 4
    assert trainer.trained == [(0, 0), (1, 1)]
    assert_one_process_loop(trainer, steps)
    _assert_tp_ranks_hold_their_ranges(replicas, trainers, [0, 1])
    _assert_each_rank_received_its_share(replicas)
    row = next(r for r in trainer.rows if "sync_received_mib" in r)
    assert row["sync_received_mib"] == [_tp_share_bytes(2) / 2**20] * 4
    assert row["sync_replica_share_mib"] == _tp_share_bytes(2) / 2**20


@pytest.mark.dist
def test_k1_a_replica_of_two_tp_ranks_beside_a_tp2_trainer_gets_each_range_from_the_rank_that_owns_it():
    """4 ranks: one replica of 2 TP ranks beside a TP2 trainer (ranks 2–3). Trainer rank r holds TP range r,
    the only copy of it, so it sends that range to replica rank r; the tensors both trainer ranks hold are
    shared out between them: each sends about one rollout rank's share per push."""
    replicas, trainers = _run(_job(3, 1, TP2, replicas=1, record_weights=True, **TP))
    assert [r.versions for r in replicas] == [[0, 0, 1]] * 2
    assert all(t.trained == [(0, 0), (1, 0), (2, 1)] for t in trainers)
    for tp_rank, trainer in enumerate(trainers):  # the trainer's own shards: range r of each split tensor
        whole = _trainers_weights(trainers, 1)
        for name, _, piece in trainer.pushed_slices[1]:
            assert torch.equal(piece, _tp_range(whole[name], name, tp_rank, 2)), name
    _assert_tp_ranks_hold_their_ranges(replicas, trainers, [0, 1])
    _assert_each_rank_received_its_share(replicas)
    share = _tp_share_bytes(2)
    for trainer in trainers:
        assert all(abs(push.bytes_sent - share) <= 0.1 * share for push in trainer.push_reports)


@pytest.mark.dist
def test_a_skipped_bucket_on_a_tp_rank_is_one_error_naming_the_replica_and_rank(fault_at_receive):
    fault_at_receive(1, 3, lambda worker: SyncFault(rank=3, drop=worker.sync.buckets[-1].index))
    with pytest.raises(Exception, match=r"StaleSync rollout replica 1 \(rank 3\) failed: WeightSyncError: .*bucket "
                                        r"\d+ .*not written at version 1"):
        _run(_job(2, 0, None, replicas=2, **TP))


def test_nproc_counts_the_tp_replicas_ranks():
    spec = resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"replicas": 2},
                             "generation": {"gen_tp": 2}}], ["flags"], world_size=5)
    assert spec.rollout.ranks_per_replica == 2 and spec.generation.gen_tp == 2 and spec.generation.gen_ep == 1
    assert spec.roles.replica_layout == "tp" and spec.trainer.world_size == 1
    assert list(spec.roles.trainer_group) == [4] and list(spec.roles.replica_leaders) == [0, 2]


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "4", "--gen-tp", "3"],
     "RL run spec: generation.gen_tp 3: tiny-pangu's 4 attention heads do not split over a replica's 3 "
     "tensor-parallel ranks; give --gen-tp a divisor of 4"),
    (["--nproc", "2", "--gen-tp", "2", "--placement", "colocated"],
     "RL run spec: generation.gen_tp 2: tensor-parallel generation runs in the disaggregated pipeline's rollout "
     "replicas only (not built yet for RL Fusion or the colocated placement); drop --gen-tp or give --staleness K "
     "--placement disaggregated"),
])
def test_cli_refuses_a_tp_replica_layout_that_does_not_run_in_one_line_exit_2(capsys, argv, message):
    line = refused(capsys, ["rl", "--prompts", "4", "--staleness", "1", *argv])
    assert line == f"moetrain rl: error: {message}"


@pytest.mark.dist
def test_a_lost_rank_of_a_tp_replica_that_is_not_its_leader_is_named_by_replica_and_rank(monkeypatch):
    """Rank 3 (replica 1's second rank: it sends no batch, only takes part in its replica's all-reduces and
    the weight syncs) ends without a word before generating batch 1; its leader loses it mid-generation."""
    monkeypatch.setenv("MOETRAIN_FAULT", "3:1:exit=0")
    monkeypatch.setattr(stalesync, "PEER_GRACE_S", 0.2)
    with pytest.raises(Exception, match=r"StaleSync rollout replica 1 rank 3 died: the rollout replica 1 \(rank 2\) "
                                        r"lost it \(.*Connection (reset|closed) by"):
        _run(_job(3, 0, None, replicas=2, **TP))


@pytest.mark.slow
def test_cli_runs_a_replica_of_two_tp_ranks_beside_a_trainer(tmp_path, capsys):


    from moetrain.config import load_model_config
    from moetrain.models.transformer import build_model
    from moetrain.rl.loop import policy_config

    steps = _cli_steps(tmp_path, capsys, "--nproc", "3", "--gen-tp", "2")
    assert [r["weight_version"] for r in steps] == [0, 0, 1] and [r["staleness_max"] for r in steps] == [0, 1, 1]
    share = _tp_share_bytes(2, build_model(policy_config(load_model_config("tiny-pangu")), "meta").state_dict())
    pushed = [r for r in steps if "sync_received_mib" in r]
    assert pushed and all(r["sync_received_mib"] == [share / 2**20] * 2 for r in pushed)  # each TP rank: its half


@pytest.mark.dist
def test_a_hung_rank_of_a_tp_replica_that_is_not_its_leader_is_named_within_the_runs_timeout(monkeypatch):
    """Rank 3 (replica 1's second rank) stops answering as it starts batch 1, alive (MOETRAIN_FAULT's hang):
    its leader waits in the replica's all-reduce, the trainer on the leader's batch, replica 0 on the next
    push; each gives up at the run's collective timeout (8 s here) and names the hung rank by replica and
    rank (the progress counts in the store: rank 3's is behind its replica's), not "a StaleSync peer" nor
    the leader it was receiving from."""
    monkeypatch.setenv("MOETRAIN_FAULT", "3:1:hang=120")
    monkeypatch.setattr(stalesync, "PEER_GRACE_S", 0.2)
    timeout_s = 8
    job = _job(3, 0, None, replicas=2, **TP)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"StaleSync rollout replica 1 rank 3 stopped responding: the "
                                        r"(rollout replica [01]|trainer) \(rank \d\) lost it \(.*[Tt]imed out"):
        spawn(stalesync.run_stalesync, job.roles.world_size, job, timeout_s=timeout_s)
    # the timeout, the grace, and the ranks' start-up and first batch (seconds each on a busy 2-core host)
    assert time.monotonic() - start < timeout_s + 60
