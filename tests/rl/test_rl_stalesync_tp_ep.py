"""StaleSync rollout replicas generating TP×EP (``--gen-tp T --gen-ep E``): a replica of T·E ranks, each
holding its TP range of the heads and dense FFN columns and its block of the experts, the weight sync
giving each rank exactly those, and at k = 0 the run is the one-process loop.

What each rank should hold is computed here, not read from the layout code: replica rank ``j = e·T + t``
(TP groups of T neighbouring ranks, each EP group the E ranks at one TP position) holds TP range ``t`` of
every split tensor (Megatron's rule, ``_tp_range``) and experts ``e·X/E .. (e+1)·X/E − 1`` of every MoE
layer, the rest whole."""

import pytest
import torch
from rl_models import small_model
from test_rl_stalesync_scale import _cli_steps, _job, _run, _trainers_weights
from test_rl_stalesync_scale import _share_bytes as _ep_share_bytes
from test_rl_stalesync_tp import _split_dim, _tp_range, _tp_share_bytes, assert_one_process_loop

from moetrain.errors import UserError
from moetrain.rl.roles import Roles
from moetrain.rl.spec import resolve_rl_spec
from refusals import refused

T, E = 2, 2
TP_EP = {"ranks_per_replica": T * E, "replica_tp": T}


def _is_expert(name: str) -> bool:
    return ".moe.experts." in f".{name}"


def _held_region(whole: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """The part of a whole tensor that replica rank ``rank`` holds: its TP range, or its experts' rows."""
    tp_rank, ep_rank = rank % T, rank // T
    if _is_expert(name):
        per = whole.shape[0] // E
        return whole[ep_rank * per:(ep_rank + 1) * per]
    return _tp_range(whole, name, tp_rank, T)


def _share_bytes() -> int:
    """One rank's share (the small model, fp32): split tensors' 1/T, expert tensors' 1/E, the rest whole."""
    state = small_model().state_dict()
    return sum(v.numel() * v.element_size() // (T if _split_dim(k) is not None else E if _is_expert(k) else 1)
               for k, v in state.items())


def _assert_ranks_hold_their_regions(replicas, trainers, versions):
    """After each sync, every replica rank holds exactly its region of every tensor, bit for bit the trainer's."""
    names = set(small_model().state_dict())
    assert any(_is_expert(n) for n in names) and any(_split_dim(n) is not None for n in names)
    for version in versions:
        whole = _trainers_weights(trainers, version)
        for rank, replica in enumerate(replicas):
            held: dict[str, list] = {}
            for name, offsets, piece in replica.synced_pieces[version]:
                held.setdefault(name, []).append((offsets, piece))
            assert set(held) == names, (version, rank)
            for name, pieces in held.items():
                pieces.sort(key=lambda p: tuple(p[0]))
                got = torch.cat([piece for _, piece in pieces]) if _is_expert(name) else pieces[0][1]
                assert torch.equal(got, _held_region(whole[name], name, rank)), (version, rank, name)


@pytest.mark.dist
def test_k0_a_replica_of_tp2_by_ep2_ranks_beside_one_trainer_rank_is_the_one_process_loop():
    """5 ranks: one replica of 4 ranks (TP2×EP2) beside a one-rank trainer. The samples, the losses and the
    final weights are the one-process loop's bit for bit; the rollout log-probs μ are not (the TP all-reduce
    and the experts' all-to-all add partial sums in another order than one process), so their statistics
    are bounded, as in the TP and EP replica tests."""
    steps = 2
    replicas, trainers = _run(_job(steps, 0, None, replicas=1, record_weights=True, **TP_EP))
    (trainer,) = trainers
    assert len(replicas) == 4 and [r.versions for r in replicas] == [[0, 1]] * 4
    assert trainer.trained == [(0, 0), (1, 1)]
    assert_one_process_loop(trainer, steps)
    _assert_ranks_hold_their_regions(replicas, trainers, [0, 1])
    share = _share_bytes()
    assert share < min(_tp_share_bytes(T), _ep_share_bytes(E))  # less than either axis alone holds
    for replica in replicas:
        assert replica.ideal_sync_bytes == share
        assert all(abs(sync.bytes_received - share) <= 0.1 * share for sync in replica.syncs)
    row = next(r for r in trainer.rows if "sync_received_mib" in r)
    assert row["sync_replica_share_mib"] == share / 2**20
    assert all(abs(got - share / 2**20) <= 0.1 * share / 2**20 for got in row["sync_received_mib"])


def test_roles_place_a_tp_ep_replica_and_name_its_layout():
    roles = Roles(replicas=2, trainer_ranks=1, ranks_per_replica=4, replica_tp=2)
    assert (roles.gen_tp, roles.gen_ep, roles.world_size, list(roles.replica_leaders)) == (2, 2, 9, [0, 4])
    assert roles.describe() == "2 rollout replicas of 4 TP2×EP2 ranks (ranks 0–7) → trainer (rank 8)"
    spec = resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"replicas": 2},
                             "generation": {"gen_tp": 2, "gen_ep": 2}}], ["flags"], world_size=9)
    assert spec.roles == roles and (spec.generation.gen_tp, spec.generation.gen_ep) == (2, 2)


@pytest.mark.parametrize("argv, message", [
    (["--nproc", "7", "--gen-tp", "2", "--gen-ep", "3"],
     "RL run spec: generation.gen_ep 3: tiny-pangu's 16 experts do not split over the 3 expert-parallel ranks at "
     "each TP position of a replica; give --gen-ep a divisor of the experts"),
    (["--nproc", "7", "--gen-tp", "3", "--gen-ep", "2"],
     "RL run spec: generation.gen_tp 3: tiny-pangu's 4 attention heads do not split over a replica's 3 "
     "tensor-parallel ranks; give --gen-tp a divisor of 4"),
])
def test_cli_refuses_a_tp_ep_replica_layout_that_does_not_divide_in_one_line_exit_2(capsys, argv, message):
    line = refused(capsys, ["rl", "--prompts", "4", "--staleness", "1", *argv])
    assert line == f"moetrain rl: error: {message}"


def test_a_pool_size_other_than_tp_times_ep_is_refused_naming_both():
    with pytest.raises(UserError, match=r"rollout.ranks_per_replica 2 differs from generation.gen_tp·gen_ep = 2·2: "
                                        r"a disaggregated replica of TP×EP generates on T·E ranks; set "
                                        r"ranks_per_replica 4 or leave it out"):
        resolve_rl_spec([{"stalesync": {"staleness": 1}, "rollout": {"ranks_per_replica": 2},
                          "generation": {"gen_tp": 2, "gen_ep": 2}}], ["rl.yaml"], world_size=3)


@pytest.mark.slow
def test_cli_runs_a_tp2_by_ep2_replica_beside_a_trainer(tmp_path, capsys):
    """``moetrain rl --nproc 5 --gen-tp 2 --gen-ep 2``: the spec, the worker and the job carry both degrees to
    the ranks; every push gives each of the 4 replica ranks its share (its TP ranges and half the experts)."""
    from moetrain.config import load_model_config
    from moetrain.models.transformer import build_model
    from moetrain.rl.loop import policy_config

    steps = _cli_steps(tmp_path, capsys, "--nproc", "5", "--gen-tp", "2", "--gen-ep", "2")
    assert [r["weight_version"] for r in steps] == [0, 0, 1] and [r["staleness_max"] for r in steps] == [0, 1, 1]
    state = build_model(policy_config(load_model_config("tiny-pangu")), "meta").state_dict()
    share = sum(v.numel() * 4 // (T if _split_dim(k) is not None else E if _is_expert(k) else 1)
                for k, v in state.items())
    pushed = [r for r in steps if "sync_received_mib" in r]
    assert pushed and all(r["sync_received_mib"] == [share / 2**20] * 4 for r in pushed)
