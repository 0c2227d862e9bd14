"""StaleSync on Ray actors (``--engine ray``) on a local Ray cluster: k = 0 gives what the torch.distributed
(local) engine gives, with one rollout worker and one trainer rank, with 2 rollout replicas beside a TP2
trainer group, and with a replica of TP2×EP2 ranks (and, through the CLI, of TP2 ranks); a dead worker ends
the run in one line naming it within 60 s and leaves the last checkpoint valid; with ``--max-restarts`` a
killed actor (a replica or a trainer rank) is restarted and the run ends equal to the uninterrupted one; a
hung worker is named within the run's timeout; and the CLI refuses in one line what the engine cannot run."""

import contextlib
import datetime
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from test_rl_stalesync import COMPARED, TINY, _setup
from test_rl_stalesync_scale import TP2
from test_rl_stalesync_scale import _job as _scale_job
from torch.distributed import TCPStore

from forked_ranks import forked_rl_ranks
from moetrain.cli import main
from moetrain.config import load_model_config
from moetrain.config.run import RunSpec
from moetrain.distributed.world import spawn
from moetrain.rl.config import StaleSyncOptions
from moetrain.rl.loop import policy_config
from moetrain.rl.roles import Roles
from moetrain.rl.spec import resolve_rl_spec
from moetrain.rl.stalesync import RolloutWorker, StaleSyncHooks, StaleSyncJob, run_stalesync
from moetrain.rl.start import starting_weights
from moetrain.runtime_base.checkpoint_files import latest_checkpoint, read_marker, verify_checkpoint
from refusals import refused

try:
    import ray
except ImportError:
    ray = None

needs_ray = pytest.mark.skipif(ray is None, reason="the Ray engine's runs need ray (pip install ray)")
NAMES = [Roles().worker_name(rank) for rank in range(2)]
PER_STEP = (*COMPARED, "staleness_max", "dropped_samples", "batch_index")


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 5 logical CPUs (one actor each: at most a replica of 4 TP×EP ranks beside a
    one-rank trainer; the actors run one thread each, so they share the machine's cores); the failure
    injections below, defined here, travel to the actors by value (the actors cannot import this test
    module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # what the actors inherit: one thread each, as a forked rank runs
        ray.init(num_cpus=5, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


@needs_ray
def test_rank_zero_hosts_each_attempts_store_on_the_port_it_bound() -> None:
    """The rendezvous port is bound when it is chosen and held, so no other process (another run's rank 0)
    can take it before the ranks join; each attempt's store is new, without a failed attempt's keys."""
    from moetrain.rl.ray_engine import RankActor

    actor = RankActor("rank 0")
    first = actor.host_store(30.0)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", first.port))
    client = TCPStore(first.host, first.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("rank 1's address", "from attempt 0")
    second = actor.host_store(30.0)
    again = TCPStore(second.host, second.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    assert second.pid == first.pid == os.getpid()
    assert not again.check(["rank 1's address"])


def _job(steps: int, staleness: int, save_dir: Path | None = None) -> StaleSyncJob:
    model, options, spec = _setup(steps)
    if save_dir is not None:
        spec = RunSpec.model_validate({**spec.model_dump(), "run": {**spec.run.model_dump(),
                                                                    "save_dir": str(save_dir), "save_every": 1}})
    return StaleSyncJob(spec, options, StaleSyncOptions(staleness=staleness), model.cfg, model.state_dict())


@needs_ray
@pytest.mark.dist
def test_k0_on_ray_actors_equals_the_torch_distributed_run(cluster):
    from moetrain.rl.ray_engine import run_ranks

    job = _job(3, staleness=0)
    local_rollout, local = spawn(run_stalesync, 2, job)
    rollout, trainer = run_ranks(run_stalesync, 2, job, names=NAMES, timeout_s=120)
    assert rollout.versions == local_rollout.versions == [0, 1, 2]
    assert trainer.trained == local.trained == [(0, 0), (1, 1), (2, 2)]
    for expected, got in zip(local.samples, trainer.samples, strict=True):
        assert torch.equal(expected, got)  # same generated tokens
    assert [r["step"] for r in trainer.rows] == [r["step"] for r in local.rows] == [0, 1, 2, 3]  # eval at 0
    for expected, got in zip(local.rows, trainer.rows, strict=True):
        assert {k: got.get(k) for k in PER_STEP} == {k: expected.get(k) for k in PER_STEP}  # same losses
    assert trainer.final_state.keys() == local.final_state.keys()
    for name, value in local.final_state.items():
        assert torch.equal(value, trainer.final_state[name]), name  # same weights, bit for bit


@needs_ray
@pytest.mark.dist
def test_k0_with_two_replicas_beside_a_tp2_trainer_on_ray_equals_the_torch_distributed_run(cluster):
    """The same run_stalesync (2 steps) on 4 ranks (replicas 0, 1; trainer group 2, 3 in TP2) on both engines:
    every replica's versions, every trainer rank's samples, metrics rows and final shards, bit for bit."""
    from moetrain.rl.ray_engine import run_ranks

    job = _scale_job(2, 0, TP2, replicas=2)
    names = [job.roles.worker_name(rank) for rank in range(4)]
    local = spawn(run_stalesync, 4, job)
    on_ray = run_ranks(run_stalesync, 4, job, names=names, timeout_s=120)
    for want, got in zip(local[:2], on_ray[:2], strict=True):
        assert got.versions == want.versions == [0, 1]
        assert got.generated_tokens == want.generated_tokens
    for want, got in zip(local[2:], on_ray[2:], strict=True):
        assert got.trained == want.trained == [(0, 0), (1, 1)]
        assert len(got.samples) == len(want.samples) == 2
        for expected, samples in zip(want.samples, got.samples, strict=True):
            assert torch.equal(expected, samples)  # same generated tokens, both replicas' shares
        assert [{k: r.get(k) for k in PER_STEP} for r in got.rows] == [{k: r.get(k) for k in PER_STEP}
                                                                     for r in want.rows]
        assert got.final_state.keys() == want.final_state.keys()
        for name, value in want.final_state.items():
            assert torch.equal(value, got.final_state[name]), name  # this rank's TP shard, bit for bit
    # the two TP ranks hold different shards: the comparison above is of each rank's own
    assert any(not torch.equal(on_ray[2].final_state[n], on_ray[3].final_state[n]) for n in on_ray[2].final_state)


@needs_ray
@pytest.mark.dist
def test_k0_a_tp2_by_ep2_replica_on_ray_equals_the_torch_distributed_run(cluster):
    """A replica of 4 ranks (TP2×EP2: each its TP range and half the experts) beside a one-rank trainer, as 5
    Ray actors and as 5 local processes: the same rank function, so every rank's versions and weights after
    each sync, and the trainer's samples, rows and final weights, bit for bit."""
    from moetrain.rl.ray_engine import run_ranks

    job = _scale_job(2, 0, None, replicas=1, ranks_per_replica=4, replica_tp=2,
                     record_weights=True)
    names = [job.roles.worker_name(rank) for rank in range(5)]
    local = spawn(run_stalesync, 5, job)
    on_ray = run_ranks(run_stalesync, 5, job, names=names, timeout_s=180)
    for want, got in zip(local[:4], on_ray[:4], strict=True):
        assert got.versions == want.versions == [0, 1]
        assert got.ideal_sync_bytes == want.ideal_sync_bytes
        for version, pieces in want.synced_pieces.items():
            assert [(n, o) for n, o, _ in got.synced_pieces[version]] == [(n, o) for n, o, _ in pieces]
            assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(pieces, got.synced_pieces[version]))
    want, got = local[4], on_ray[4]
    assert got.trained == want.trained == [(0, 0), (1, 1)]
    for expected, samples in zip(want.samples, got.samples, strict=True):
        assert torch.equal(expected, samples)
    assert [{k: r.get(k) for k in PER_STEP} for r in got.rows] == [{k: r.get(k) for k in PER_STEP} for r in want.rows]
    for name, value in want.final_state.items():
        assert torch.equal(value, got.final_state[name]), name


def _trainer_raises_at_step_2(rank: int, world_size: int, job: StaleSyncJob):
    """``run_stalesync`` with the trainer's optimizer failing after step 2 (runs in the actors)."""
    def crash(self, trainer, step, batch):
        if step == 2:
            raise RuntimeError("optimizer crashed")
        return original(self, trainer, step, batch)

    original = StaleSyncHooks.after_step
    StaleSyncHooks.after_step = crash
    return run_stalesync(rank, world_size, job)


def _rollout_killed_at_batch_2(rank: int, world_size: int, job: StaleSyncJob):
    """``run_stalesync`` with the rollout worker's process killed (SIGKILL, as the OOM killer does) as it
    starts batch 2, while the trainer may be writing its step-2 checkpoint."""
    def die(self, batch, *rest):
        if batch == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, batch, *rest)

    original = RolloutWorker.generate
    RolloutWorker.generate = die
    return run_stalesync(rank, world_size, job)


@needs_ray
@pytest.mark.dist
@pytest.mark.parametrize("inject, message", [
    (_trainer_raises_at_step_2,
     r"^rank 1 failed: StaleSyncWorkerError: StaleSync trainer \(rank 1\) failed: RuntimeError: optimizer crashed$"),
    (_rollout_killed_at_batch_2,
     r"^rank 0 failed: StaleSync rollout worker \(rank 0\) died: its Ray actor \(pid \d+ on [\d.]+\) exited"),
], ids=["trainer-raises", "rollout-worker-killed"])
def test_a_dead_worker_ends_the_run_in_one_line_naming_it_and_the_checkpoint_stays_valid(
        cluster, tmp_path, inject, message):
    from moetrain.rl.ray_engine import RayRankError, run_ranks

    timeout_s = 120
    start = time.monotonic()
    with pytest.raises(RayRankError, match=message) as failure:
        run_ranks(inject, 2, _job(4, staleness=0, save_dir=tmp_path), names=NAMES, timeout_s=timeout_s)
    # the death ends the run, not the groups' timeout (a fixed 60 s bound also counted the actors' start-up,
    # which took 62 s once on a loaded 2-core machine)
    assert time.monotonic() - start < timeout_s
    assert len(str(failure.value).splitlines()) == 1
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and read_marker(newest)["step"] in (1, 2)
    verify_checkpoint(newest)  # every file matches its checksum


def _never_runs(rank: int, world_size: int) -> None:
    raise AssertionError("the ranks ran although their actors had not started in time")


@needs_ray
def test_actors_that_do_not_start_in_time_are_named_in_one_line(cluster, monkeypatch):
    """Start-up has its own bound (``START_TIMEOUT_S``: a fresh actor imports torch, which took 62 s once on a
    loaded 2-core machine, past the 60 s placement bound it used to share), and the line says what did not
    happen: the actor did not start, not that a rank's result is late."""
    from moetrain.rl import ray_engine

    monkeypatch.setattr(ray_engine, "START_TIMEOUT_S", 0.0)
    expected = rf"^{re.escape(NAMES[0])}, {re.escape(NAMES[1])}: its Ray actor did not start within 0 s$"
    with pytest.raises(ray_engine.RayRankError, match=expected):
        ray_engine.run_ranks(_never_runs, 2, names=NAMES)


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--staleness", "0", "--placement", "colocated", "--engine", "ray"], ("--engine ray", "colocated")),
    (["rl", "--engine", "ray"], ("give --staleness K",)),
])
def test_cli_refuses_what_the_ray_engine_cannot_run_in_one_line_exit_2(capsys, argv, expected):
    refused(capsys, argv, *expected)


def test_cli_without_ray_says_pip_install_ray_in_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when Ray is not installed
    refused(capsys, ["rl", "--staleness", "1", "--engine", "ray"], "--engine ray", "pip install ray")


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("layout", [(), ("--nproc", "3", "--gen-tp", "2")], ids=["1-replica-1-trainer", "tp2-replica"])
def test_cli_k0_on_ray_actors_equals_the_cli_on_the_local_engine(cluster, tmp_path, capsys, monkeypatch, layout):
    """The same `moetrain rl --staleness 0` run (warm-up, 3 GRPO steps) through both engines, with one rollout
    worker and one trainer rank, and with a replica of 2 TP ranks (--gen-tp: the same worker code on Ray): the
    same metrics rows and the same final checkpoint, bit for bit. The local engine's ranks, the reference, are
    forked from this process (``forked_ranks``; the StaleSync CLI tests run that engine's ranks under
    torchrun). Replicas beside a TP2 trainer group are not run again here: the Ray launch is the same for
    every layout (one actor per rank of the spec's roles, each running the torchrun rank's function), and
    that layout is compared engine to engine above, as the CLI gives it in test_rl_stalesync_scale.py."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread a rank, as each actor runs (forked ranks need it)
    runs = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        argv = ["rl", *TINY, *layout, "--staleness", "0", "--engine", engine, "--metrics-out", str(out / "rl.jsonl"),
                "--save-dir", str(out / "run"), "--log-dir", str(out / "log")]
        with forked_rl_ranks() if engine == "local" else contextlib.nullcontext():
            assert main(argv) == 0, capsys.readouterr().err
        rows = [json.loads(line) for line in (out / "rl.jsonl").read_text().splitlines()]
        runs[engine] = rows, starting_weights(out / "run" / "rl", policy_config(load_model_config("tiny-pangu")))
    (local_rows, local_weights), (rows, weights) = runs["local"], runs["ray"]
    assert [r.get("weight_version") for r in rows if "loss" in r] == [0, 1, 2]
    assert [{k: r.get(k) for k in PER_STEP} for r in rows] == [{k: r.get(k) for k in PER_STEP} for r in local_rows]
    assert weights.keys() == local_weights.keys()
    for name, value in local_weights.items():
        assert torch.equal(value, weights[name]), name
    assert (tmp_path / "ray" / "rl.png").stat().st_size > 1000


@needs_ray
@pytest.mark.dist
def test_the_cli_launch_reports_a_failed_rank_in_one_line_and_exits_1(cluster, tmp_path, capsys):
    from moetrain.rl.ray_engine import launch

    spec = resolve_rl_spec([{"sft": {"steps": 0}, "rl": {"prompts_per_step": 2, "grpo": {"group_size": 2}},
                             "trainer": {"training": {"steps": 2},
                                         "run": {"device": "cpu", "quiet": True, "timeout_s": 30}},
                             "stalesync": {"staleness": 0}, "initial_weights": str(tmp_path / "missing.pt")}],
                           ["test"])
    assert launch(spec) == 1  # the warm-up weights' file is gone: both ranks fail to read it
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert re.match(r"moetrain rl: rank [01] failed: FileNotFoundError: .*missing\.pt.* \(all Ray actors stopped "
                    r"after [\d.]+ s\)$", lines[0]), lines


RESTART_RUN = ["rl", "--sft-steps", "2", "--sft-batch", "8", "--steps", "5", "--prompts", "2", "--group-size", "2",
               "--eval-size", "4", "--device", "cpu", "--quiet", "--threads", "1", "--staleness", "1",
               "--save-every", "2", "--engine", "ray"]
"""tests/rl/test_rl_restart.py's run (k = 1, a checkpoint every 2 steps), on Ray actors."""
TIMING = ("mfu", "gen_tokens_per_s", "sync_landed_version", "sync_mib")
"""Timings, and the push bookkeeping a restarted trainer reports in another row (test_rl_restart.py)."""


def _cli_run(out: Path, capsys, *flags: str) -> tuple[int, str, str]:
    code = main([*RESTART_RUN, *flags, "--save-dir", str(out / "ckpt"), "--metrics-out", str(out / "metrics.jsonl"),
                 "--log-dir", str(out / "logs")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not (k.endswith("_s") or k in TIMING)}
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(cluster, tmp_path_factory):
    """The uninterrupted run on Ray: its metrics rows and final weights."""
    out = tmp_path_factory.mktemp("straight")
    assert main([*RESTART_RUN, "--save-dir", str(out / "ckpt"), "--metrics-out", str(out / "metrics.jsonl"),
                 "--log-dir", str(out / "logs")]) == 0
    return _rows(out / "metrics.jsonl"), starting_weights(out / "ckpt" / "rl",
                                                          policy_config(load_model_config("tiny-pangu")))


@needs_ray
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("fault, failed", [("0:4:kill", "rank 0"), ("1:3:kill", "rank 1")],
                         ids=["rollout-worker-killed", "trainer-killed"])
def test_a_killed_actor_is_restarted_by_ray_and_the_run_ends_as_the_uninterrupted_one(
        straight_run, tmp_path, capsys, monkeypatch, fault, failed):
    """MOETRAIN_FAULT kills the actor's process (SIGKILL) in the first attempt; Ray restarts the group, which
    resumes from the newest checkpoint (step 2 or 4): one curve, the same rows and weights, staleness ≤ k."""
    monkeypatch.setenv("MOETRAIN_FAULT", fault)
    code, out, err = _cli_run(tmp_path, capsys, "--max-restarts", "1")
    assert code == 0, err
    assert re.search(r"^moetrain rl: recovered from 1 failure \(resumed at step [24]\)", out, re.M), out
    restart = json.loads((tmp_path / "logs" / "restarts.jsonl").read_text())
    assert restart["attempt"] == 1 and restart["resumed_at"] in (2, 4)
    assert restart["cause"].startswith(f"{failed} failed: "), restart  # the killed actor, named by the driver
    want_rows, want_weights = straight_run
    got = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(6))  # one curve: step 0's held-out accuracy, then 1..5 once
    assert got == want_rows
    assert all(r["staleness_max"] <= 1 and r["dropped_batches"] == 0 for r in got if "loss" in r)
    weights = starting_weights(tmp_path / "ckpt" / "rl", policy_config(load_model_config("tiny-pangu")))
    assert weights.keys() == want_weights.keys()
    for name, value in want_weights.items():
        assert torch.equal(value, weights[name]), name


@needs_ray
@pytest.mark.dist
def test_restarts_spent_end_the_run_in_one_line_naming_the_actor(cluster, tmp_path, capsys, monkeypatch):
    # every attempt, at batch 3 (the warm-up in this process, 2 steps, never reaches a step 3): the one
    # restart fails the same way
    monkeypatch.setenv("MOETRAIN_FAULT", "0:3:kill@*")
    code, _, err = _cli_run(tmp_path, capsys, "--max-restarts", "1", "--steps", "4")
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.match(r"moetrain rl: rank 0 failed: StaleSync rollout worker \(rank 0\) died: its Ray actor .* "
                    r"\(after 1 restart, all Ray actors stopped after [\d.]+ s\)$", lines[0]), lines


@needs_ray
@pytest.mark.dist
def test_a_hung_rollout_worker_is_named_within_the_runs_timeout(cluster, tmp_path, capsys, monkeypatch):
    """MOETRAIN_FAULT's hang: the rollout worker sleeps as it starts batch 3 (beyond the 2-step warm-up in
    this process); the trainer's wait on it gives up after the run's timeout_s, and the one line names the
    rollout worker's group and rank."""
    monkeypatch.setenv("MOETRAIN_FAULT", "0:3:hang")
    start = time.monotonic()
    config = tmp_path / "rl.yaml"
    config.write_text("trainer:\n  run:\n    timeout_s: 10\n")
    code, _, err = _cli_run(tmp_path, capsys, "--steps", "4", "--config", str(config))
    assert code == 1
    # the hang ends the run (the actors' start-up, over a minute on a loaded machine, is in this bound) ...
    assert time.monotonic() - start < 240
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.match(r"moetrain rl: rank 1 failed: StaleSyncWorkerError: StaleSync rollout worker \(rank 0\) "
                    r"stopped responding: the trainer \(rank 1\) lost it", lines[0]), lines
    assert "Timed out waiting 10000ms" in lines[0], lines  # ... at the run's timeout_s: gloo's words for 10 s
