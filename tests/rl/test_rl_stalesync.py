"""StaleSync, disaggregated (rank 0 generates, rank 1 trains): k = 0 is the synchronous one-process
GRPO trainer bit for bit; no batch older than k is trained on; the decoupled loss by hand."""

import copy
import functools
import io
import json
import math
import shutil
import time

import pytest
import torch
from rich.console import Console
from rl_models import small_model

from forked_ranks import forked_rl_ranks
from moetrain.cli import main
from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed.weight_sync import SyncFault
from moetrain.distributed.world import spawn
from moetrain.rl.config import GRPOConfig, RLOptions, StaleSyncOptions
from moetrain.rl.grpo import ScoredTokens, grpo_token_loss
from moetrain.rl.loop import GRPO
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.stalesync import (
    RolloutWorker,
    Schedule,
    StaleSyncHooks,
    StaleSyncJob,
    run_stalesync,
)
from moetrain.rl.tasks import get_task
from moetrain.train.trainer import SuppliedParts, Trainer
from refusals import refused

TASK = get_task("addition")
SEQ_LEN = sequence_len_for(TASK, TASK.max_answer_chars + 2)
COMPARED = ("loss", "grad_norm", "reward", "accuracy", "completion_len", "nll", "is_weight_mean", "logp_gap_max",
            "heldout_accuracy", "weight_version")


def _setup(steps: int, seed: int = 0):
    model = small_model(seed=seed)
    options = RLOptions(task="addition", prompts_per_step=4, grpo=GRPOConfig(group_size=4), eval_every=0,
                        eval_size=16)
    cfg = TrainingConfig(steps=steps, global_batch=16, micro_batch=8, seq_len=SEQ_LEN, lr=1e-3, warmup_steps=0,
                         seed=seed)
    spec = RunSpec(training=cfg, run={"device": "cpu", "cluster": "cpu", "quiet": True})
    return model, options, spec


class _RecordingGRPO(GRPO):
    """The synchronous reference, keeping every step's generated tokens."""

    def rollout(self, trainer, step):
        rollouts = super().rollout(trainer, step)
        self.samples = [*getattr(self, "samples", []), rollouts.generation.tokens_BN.clone()]
        return rollouts


def _synchronous(steps: int):
    """The one-process loop's (rows, samples, final weights): a copy of the session's one run of ``steps``
    (several tests here and in test_rl_stalesync_scale / _tp compare against the same computation)."""
    return copy.deepcopy(_synchronous_once(steps))


@functools.cache
def _synchronous_once(steps: int):
    model, options, spec = _setup(steps)
    hooks = _RecordingGRPO(spec, options)
    trainer = Trainer(spec, SuppliedParts(model_cfg=model.cfg, model=model, console=Console(file=io.StringIO()),
                                          hooks=hooks))
    rows = trainer.train()
    return rows, hooks.samples, {k: v.detach().clone() for k, v in trainer.run.stage.model.state_dict().items()}


def _stalesync(steps: int, staleness: int, decoupled: bool = False, run_update: dict | None = None, **job):
    model, options, spec = _setup(steps)
    if run_update:
        spec = spec.model_copy(update={"run": spec.run.model_copy(update=run_update)})
    stale = StaleSyncOptions(staleness=staleness, loss="decoupled" if decoupled else "tis")
    job = StaleSyncJob(spec, options, stale, model.cfg, model.state_dict(), **job)
    return spawn(run_stalesync, 2, job)


def _plain_stalesync(steps: int, staleness: int, decoupled: bool = False):
    """``_stalesync`` with no fault, checkpoint or resend: a copy of the session's one run of these arguments
    (test_rl_colocated compares its placement with the same runs this module's tests read). Tests that
    plant a fault call ``_stalesync``, which always runs."""
    return copy.deepcopy(_plain_stalesync_once(steps, staleness, decoupled))


@functools.cache
def _plain_stalesync_once(steps: int, staleness: int, decoupled: bool):
    return _stalesync(steps, staleness, decoupled)


def test_schedule_generates_with_versions_at_most_k_old_and_not_across_a_checkpoint():
    assert [Schedule(2, last=5).version(b) for b in range(5)] == [0, 0, 0, 1, 2]
    assert Schedule(2, last=5).pushed() == [1, 2] and Schedule(0, last=3).pushed() == [1, 2]
    # checkpoints after steps 3 and 6: batches 3 and 6 come from the saved weights (versions 3 and 6)
    every3 = Schedule(2, last=8, save_every=3)
    assert [every3.version(b) for b in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert every3.pushed() == [3, 6]
    # resumed at step 3: what the uninterrupted run generates from there
    assert [Schedule(2, last=8, start=3, save_every=3).version(b) for b in range(3, 8)] == [3, 3, 3, 6, 6]
    assert Schedule(2, last=8, start=3, save_every=3).pushed() == [6]


@pytest.mark.dist
def test_k0_reproduces_the_synchronous_loop_bit_for_bit():
    steps = 3
    rows, samples, state = _synchronous(steps)
    rollout, trainer = _stalesync(steps, staleness=0)
    assert rollout.versions == [0, 1, 2] and trainer.trained == [(0, 0), (1, 1), (2, 2)]
    for expected, got in zip(samples, trainer.samples, strict=True):
        assert torch.equal(expected, got)  # same samples
    for expected, got in zip(rows, trainer.rows, strict=True):
        assert {k: got.get(k) for k in COMPARED} == {k: expected.get(k) for k in COMPARED}  # same losses
    assert state.keys() == trainer.final_state.keys()
    for name, value in state.items():
        assert torch.equal(value, trainer.final_state[name]), name  # same weights
    assert all(r["staleness_max"] == 0 and r["dropped_samples"] == 0 for r in trainer.rows if "loss" in r)


@pytest.mark.dist
def test_a_batch_older_than_k_is_dropped_counted_and_never_trained_on():
    # batch 0 again after batch 1: it arrives when the trainer is at version 2 > k = 0
    steps = 3
    _, _, state = _synchronous(steps)
    _, trainer = _stalesync(steps, staleness=0, resend_first_after=1)
    assert trainer.dropped_batches == 1 and trainer.dropped_samples == 16
    assert trainer.trained == [(0, 0), (1, 1), (2, 2)]
    assert trainer.rows[-1]["dropped_samples"] == 16
    for name, value in state.items():  # the weights never saw it: still the synchronous run's
        assert torch.equal(value, trainer.final_state[name]), name


@pytest.mark.dist
def test_resumed_from_a_checkpoint_the_pipeline_continues_the_uninterrupted_run_bit_for_bit(tmp_path):
    save = tmp_path / "ckpt"
    rollout, trainer = _stalesync(5, staleness=2, run_update={"save_dir": str(save), "save_every": 2})
    # checkpoints after steps 2 and 4 are synchronisation points: batches 2 and 4 use the saved weights
    assert rollout.versions == [0, 0, 2, 2, 4]
    assert [r["staleness_max"] for r in trainer.rows if "loss" in r] == [0, 1, 0, 1, 0]
    shutil.rmtree(save)
    _stalesync(5, staleness=2, run_update={"save_dir": str(save), "save_every": 2, "stop_at": 2})
    rollout_resumed, resumed = _stalesync(5, staleness=2, run_update={"save_dir": str(save), "save_every": 2,
                                                                       "resume": True})
    assert rollout_resumed.versions == [2, 2, 4] and resumed.trained == [(2, 2), (3, 2), (4, 4)]
    expected = [r for r in trainer.rows if r["step"] > 2]
    for want, got in zip(expected, resumed.rows, strict=True):
        assert {k: got.get(k) for k in COMPARED} == {k: want.get(k) for k in COMPARED}
    for name, value in trainer.final_state.items():
        assert torch.equal(value, resumed.final_state[name]), name


def test_decoupled_loss_by_hand():
    """Hilton et al. 2022 (decoupled PPO): ratio π_θ/π_prox clipped, times the truncated weight
    min(π_prox/μ, C); the behaviour policy μ enters only through that weight."""
    cfg = GRPOConfig(group_size=2, clip_low=0.2, clip_high=0.28, is_cap=2.0)
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.3, -0.5, -1.0]])
    behaviour = torch.tensor([[-2.5, -0.6, -0.9]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True]])
    terms = grpo_token_loss(logp, ScoredTokens(behaviour, adv, mask, old_logp_BS=prox), cfg)
    expected = []
    for t in range(3):
        r = torch.exp(logp[0, t] - prox[0, t])
        clipped = r.clamp(1 - 0.2, 1 + 0.28)
        weight = min(float(torch.exp(prox[0, t] - behaviour[0, t])), 2.0)
        expected.append(-torch.min(r * adv[0, t], clipped * adv[0, t]) * weight)
    expected = torch.stack(expected)
    assert torch.allclose(terms.loss_BS[0], expected)
    # token 0: r = e^0.3 > 1.28 with A > 0 (clipped, no gradient); weight e^1.2 > C truncated to 2
    assert terms.clipped_BS.tolist() == [[True, False, False]] and terms.truncated_BS.tolist() == [[True, False, False]]
    terms.loss_BS.sum().backward()
    grad = logp.grad[0]
    assert grad[0] == 0.0  # clipped
    assert grad[1] == pytest.approx(math.exp(0.1))  # L = r·w (A = −1), r = 1: dL/dlogπ = w = π_prox/μ
    assert grad[2] == pytest.approx(-math.exp(-1.0) * math.exp(-0.1))  # L = −r·w: −r·w, r = e^−1, w = e^−0.1


@pytest.mark.dist
def test_decoupled_loss_in_the_pipeline_matches_tis_with_one_update_per_batch():
    # π_prox is a forward of the weights before the step: with one update per batch it is π_old, so
    # both forms give the same step up to the forward's rounding
    # the 4-step runs test_rl_colocated holds the colocated placement to
    tis = _plain_stalesync(4, staleness=1)[1].rows
    decoupled = _plain_stalesync(4, staleness=1, decoupled=True)[1].rows
    for a, b in zip(tis, decoupled, strict=True):
        if "loss" in a:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["is_weight_mean"] == pytest.approx(a["is_weight_mean"], rel=1e-4)


@pytest.mark.dist
def test_a_dead_rollout_worker_ends_the_run_with_one_message_naming_it(monkeypatch):
    def die(self, batch, *rest):
        if batch == 1:
            raise RuntimeError("generation crashed")
        return original(self, batch, *rest)

    original = RolloutWorker.generate
    monkeypatch.setattr(RolloutWorker, "generate", die)  # the forked ranks inherit it
    start = time.monotonic()
    message = r"StaleSync rollout worker \(rank 0\) failed: RuntimeError: generation crashed"
    with pytest.raises(Exception, match=message):
        _stalesync(3, staleness=1)
    assert time.monotonic() - start < 60


@pytest.mark.dist
def test_a_dead_trainer_ends_the_run_with_one_message_naming_it(monkeypatch):
    def die(self, trainer, step, batch):
        raise RuntimeError("optimizer crashed")

    monkeypatch.setattr(StaleSyncHooks, "after_step", die)
    start = time.monotonic()
    # the rollout worker, waiting in the weight sync, loses its peer: the message still names the trainer
    with pytest.raises(Exception, match=r"StaleSync trainer \(rank 1\) (failed: RuntimeError: optimizer crashed|died)"):
        _stalesync(3, staleness=0)
    assert time.monotonic() - start < 60


TINY = ["--sft-steps", "2", "--sft-batch", "8", "--steps", "3", "--prompts", "2", "--group-size", "2",
        "--eval-size", "4", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--placement", "disaggregated"], ("give --staleness K",)),
    (["rl", "--staleness", "-1"], ("--staleness -1",)),
    (["rl", "--staleness", "1", "--nproc", "2", "--rollout-replicas", "2"], ("--nproc 2", "leaves no trainer rank")),
])
def test_cli_refuses_what_is_not_built_in_one_line_exit_2(capsys, argv, expected):
    refused(capsys, argv, *expected)


@pytest.mark.slow
def test_cli_runs_the_disaggregated_pipeline_on_two_ranks_and_resumes_it(tmp_path, capsys, monkeypatch):
    metrics = tmp_path / "rl.jsonl"
    argv = ["rl", *TINY, "--staleness", "1", "--placement", "disaggregated", "--metrics-out", str(metrics),
            "--log-dir", str(tmp_path / "log"), "--save-dir", str(tmp_path / "run")]
    # The launcher's work (spec, warm-up, stop and resume) as the CLI does it; its two ranks forked from this
    # process, one torch thread each (two Python and torch start-ups fewer per run). torchrun starting the
    # disaggregated pipeline stays under test in test_rl_nodes.py and test_rl_restart.py.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with forked_rl_ranks():
        assert main([*argv, "--stop-at", "2"]) == 0, capsys.readouterr().err
        assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    # the resumed step 3 generates with the checkpoint's weights (version 2): staleness 0 there
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["weight_version"] for r in steps] == [0, 0, 2]
    assert [r["staleness_max"] for r in steps] == [0, 1, 0] and steps[-1]["dropped_samples"] == 0
    assert metrics.with_suffix(".png").stat().st_size > 1000
    # the warm-up's weights, which every rank read as it started, do not outlive the run
    assert sorted(path.name for path in (tmp_path / "log").glob("*.pt")) == []


@pytest.mark.dist
def test_a_damaged_weight_push_fails_the_run_on_its_checksum(fault_at_receive):
    # one byte of the version-1 push flipped on the rollout worker: the sync's CRC, recomputed from the
    # generation weights, refuses it on both ranks, so nothing is generated from damaged weights
    fault_at_receive(1, 0, lambda worker: SyncFault(rank=0, corrupt=0))
    with pytest.raises(Exception, match=r"StaleSync (rollout worker \(rank 0\)|trainer \(rank 1\)) failed: "
                                        r"WeightSyncError: weight sync failed on rank 0"):
        _stalesync(3, staleness=0)
