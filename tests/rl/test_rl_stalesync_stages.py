"""The disaggregated pipeline with a reward worker and a reference worker on ranks of their own
(``moetrain.rl.stalesync_stages``): k = 0 is the synchronous one-process GRPO trainer with its KL
reference bit for bit; staleness stays bounded with four stages; a dead stage is named."""

import io
import time

import pytest
import torch
from rich.console import Console
from test_rl_stalesync import COMPARED, _RecordingGRPO, _setup
from test_rl_stalesync_scale import DP2, EXACT, TP2, _layout_spec, _synchronous_in_layout

from moetrain.distributed.world import spawn
from moetrain.models.transformer import build_model
from moetrain.rl.config import StaleSyncOptions
from moetrain.rl.roles import Roles
from moetrain.rl.stalesync import StaleSyncJob, run_stalesync
from moetrain.rl.stalesync_stages import RewardWorker, StageReport
from moetrain.train.trainer import SuppliedParts, Trainer
from refusals import refused

KL = 0.05


def _with_kl(steps: int):
    model, options, spec = _setup(steps)
    return model, options.model_copy(update={"grpo": options.grpo.model_copy(update={"kl_coef": KL})}), spec


def _pipeline(steps: int, staleness: int, reward_worker: bool = True, kl: bool = True, replicas: int = 1,
              parallel: dict | None = None):
    model, options, spec = _with_kl(steps) if kl else _setup(steps)
    if parallel:
        spec = _layout_spec(steps, parallel)
    stale = StaleSyncOptions(staleness=staleness, reward_worker=reward_worker)
    job = StaleSyncJob(spec, options, stale, model.cfg, model.state_dict(), replicas=replicas)
    return spawn(run_stalesync, job.roles.world_size, job)


def test_the_pipeline_orders_its_ranks_rollout_reward_reference_trainer():
    pipeline = Roles(reward=True, reference=True)
    assert pipeline.order == ("rollout worker", "reward worker", "reference worker", "trainer")
    assert [pipeline.rank(s) for s in pipeline.order] == [0, 2, 3, 1]
    assert pipeline.next_rank("rollout worker") == 2 and pipeline.next_rank("reference worker") == 1
    assert pipeline.previous_rank("trainer") == 3 and pipeline.worker_name(3) == "StaleSync reference worker (rank 3)"
    assert Roles(reference=True).rank("reference worker") == 2 and Roles().world_size == 2


@pytest.mark.dist
@pytest.mark.parametrize("replicas", [1, 2])
def test_k0_with_reward_and_reference_workers_is_the_synchronous_loop_with_its_reference_bit_for_bit(replicas):
    """With two replicas the stages join both shares (ranks: replicas 0-1, trainer 2, reward 3, reference 4)."""
    steps = 3
    model, options, spec = _with_kl(steps)
    reference = build_model(model.cfg, "cpu")
    reference.load_state_dict(model.state_dict())
    recorded = _RecordingGRPO(spec, options, reference=reference)
    sync = Trainer(spec, SuppliedParts(model_cfg=model.cfg, model=model, console=Console(file=io.StringIO()),
                                       hooks=recorded))
    rows = sync.train()
    state = {k: v.detach().clone() for k, v in sync.run.stage.model.state_dict().items()}
    *rollouts, trainer, reward, ref = _pipeline(steps, staleness=0, replicas=replicas)
    assert len(rollouts) == replicas and all(r.versions == [0, 1, 2] for r in rollouts)
    assert trainer.trained == [(0, 0), (1, 1), (2, 2)]
    assert reward == StageReport("reward worker", 3, reward.busy_s)
    assert (ref.stage, ref.batches) == ("reference worker", 3)
    for expected, got in zip(recorded.samples, trainer.samples, strict=True):
        assert torch.equal(expected, got)
    # two replicas generate 8 rows each: the rollout log-probs' statistics differ from 16 rows' in the last bits
    behaviour = ("is_weight_mean", "logp_gap_max") if replicas > 1 else ()
    compared = tuple(k for k in (*COMPARED, "kl") if k not in behaviour)
    for expected, got in zip(rows, trainer.rows, strict=True):
        assert {k: got.get(k) for k in compared} == {k: expected.get(k) for k in compared}
        if "is_weight_mean" in behaviour and "is_weight_mean" in expected:
            assert got["is_weight_mean"] == pytest.approx(expected["is_weight_mean"], rel=1e-6)
        if "logp_gap_max" in behaviour and "logp_gap_max" in expected:  # a gap of rounding: both below 1e-5
            assert max(got["logp_gap_max"], expected["logp_gap_max"]) < 1e-5
    assert any(r.get("kl", 0) != 0 for r in rows)  # the KL term is live, not zero
    for name, value in state.items():
        assert torch.equal(value, trainer.final_state[name]), name


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [TP2, DP2], ids=["tp2", "dp2"])
def test_k0_reward_and_reference_workers_beside_a_two_rank_trainer_are_its_synchronous_loop(parallel):
    """Ranks: rollout 0, trainer 1–2 (TP2 or DP2), reward 3, reference 4. The first trainer rank receives the
    scored batch with the reference's log-probs and deals it to the other; each trains as the synchronous
    loop in that layout does, KL term included (its losses, KL and weights bit for bit; the rollout
    log-probs' statistics to rounding: that loop generates 8 rows per rank, the replica all 16)."""
    steps = 2
    expected = spawn(_synchronous_in_layout, 2, steps, parallel, KL)
    rollout, *trainers, reward, ref = _pipeline(steps, staleness=0, parallel=parallel)
    assert rollout.versions == [0, 1] and (reward.batches, ref.batches) == (2, 2)
    for (rows, samples, state), trainer in zip(expected, trainers, strict=True):
        assert trainer.trained == [(0, 0), (1, 1)]
        assert all(torch.equal(a, b) for a, b in zip(samples, trainer.samples, strict=True))
        for want, got in zip(rows, trainer.rows, strict=True):
            assert {k: got.get(k) for k in (*EXACT, "kl")} == {k: want.get(k) for k in (*EXACT, "kl")}
            if "is_weight_mean" in want:
                assert got["is_weight_mean"] == pytest.approx(want["is_weight_mean"], rel=1e-6)
            if "logp_gap_max" in want:
                assert max(got["logp_gap_max"], want["logp_gap_max"]) < 1e-5
        assert any(r.get("kl", 0) != 0 for r in rows)  # the KL term is live, not zero
        assert state.keys() == trainer.final_state.keys()
        assert all(torch.equal(value, trainer.final_state[name]) for name, value in state.items())


@pytest.mark.dist
def test_k2_with_a_reward_worker_keeps_the_bound():
    rollout, trainer, reward = _pipeline(4, staleness=2, kl=False)
    assert rollout.versions == [0, 0, 0, 1] and trainer.trained == [(0, 0), (1, 0), (2, 0), (3, 1)]
    assert [r["staleness_max"] for r in trainer.rows if "loss" in r] == [0, 1, 2, 2] and reward.batches == 4


@pytest.mark.dist
def test_a_dead_reward_worker_ends_the_run_with_one_message_naming_it(monkeypatch):
    def die(self, batch):
        if batch.index == 1:
            raise RuntimeError("scorer crashed")
        return original(self, batch)

    original = RewardWorker.process
    monkeypatch.setattr(RewardWorker, "process", die)
    start = time.monotonic()
    with pytest.raises(Exception, match=r"StaleSync reward worker \(rank 2\) failed: RuntimeError: scorer crashed"):
        _pipeline(3, staleness=1, kl=False)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--reward-worker"], ("give --staleness K",)),
    (["rl", "--staleness", "1", "--placement", "colocated", "--reward-worker"], ("--reward-worker", "disaggregated")),
])
def test_cli_refuses_a_reward_worker_where_it_cannot_run(capsys, argv, expected):
    refused(capsys, argv, *expected)
