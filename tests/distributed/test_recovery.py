"""Automatic recovery (issue 40, item 1): ``moetrain train --max-restarts N`` on two gloo ranks. A rank killed
at step 5, with checkpoints every 2 steps, is restarted with its peer from step 4; the run ends with the final
weights and moments of the uninterrupted run bit for bit, and a metrics file whose rows are exactly the
uninterrupted run's (timings aside). A rank that fails in every attempt ends the run after N restarts with one
line naming it and the cause; a lone process recovers the same way. A save that fails on one rank (its own
write, or the coordinator's seal) is skipped by every rank, and training goes on. A rank late to load its
checkpoint is waited for until the start-up timeout, and past it named in a line that keeps the checkpoint."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moetrain.train.saver
from checkpoint_tensors import checkpoint_tensors
from cli_in_process import Finished, InProcessCli
from forked_ranks import forked_train_ranks, train_forked
from moetrain.distributed.checkpoint import finish_folder
from moetrain.runtime_base.checkpoint_files import verify_checkpoint
from moetrain.train.saver import CheckpointSaver

SHAPE = ["--steps", "8", "--seq-len", "32", "--global-batch", "4", "--micro-batch", "2", "--synthetic-data",
         "--quiet", "--save-every", "2"]
TIMINGS = ("step_time_s", "tokens_per_s", "mfu", "batch_time_s", "train_step_time_s", "after_step_time_s",
           "save_stall_s", "save_wait_s")


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> Callable[..., Finished]:
    """``moetrain train`` with the shape above, its checkpoints, metrics and logs in ``tmp_path / name``,
    in this process (``cli_in_process``)."""
    cli = InProcessCli(monkeypatch, capfd)

    def launch(name: str, *flags: str, fault: str | None = None) -> Finished:
        return cli(["train", *SHAPE, *flags, "--save-dir", str(tmp_path / name / "ckpt"),
                    "--metrics-out", str(tmp_path / name / "metrics.jsonl"),
                    "--log-dir", str(tmp_path / name / "logs")], fault)

    return launch


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in path.read_text().splitlines()]


def _tensors(checkpoint: Path, tmp_path: Path) -> dict:
    """Every tensor of a checkpoint, whole (DCP's own conversion to one torch file)."""
    return checkpoint_tensors(checkpoint, tmp_path / f"{checkpoint.parent.parent.name}.pt")


@pytest.mark.slow
@pytest.mark.dist
def test_a_killed_rank_is_restarted_and_the_run_ends_as_the_uninterrupted_one(run, tmp_path: Path) -> None:
    layout = ["--nproc", "2", "--ep", "2"]
    straight = tmp_path / "straight"  # the uninterrupted run: the reference, on forked ranks (forked_ranks)
    train_forked([*SHAPE, *layout, "--save-dir", str(straight / "ckpt"),
                  "--metrics-out", str(straight / "metrics.jsonl")])
    start = time.monotonic()
    recovered = run("recovered", *layout, "--max-restarts", "1", fault="1:5:kill")
    assert recovered.returncode == 0, recovered.stderr
    assert time.monotonic() - start < 240
    out = recovered.stdout
    assert ("restart 1 of 1 after rank 1 stopped without a report (a signal, or an exit): resumed from step 4; "
            "1 step lost (step 5 is trained again)") in out, out
    assert "moetrain train: recovered from 1 failure (resumed at step 4); 1 step trained again" in out, out
    # one curve: rows 1..8 once each, equal to the uninterrupted run's but for the timings
    got, want = _rows(tmp_path / "recovered" / "metrics.jsonl"), _rows(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got == want
    # the final weights, moments, optimizer groups and step, bit for bit. The torch RNG state recorded beside
    # them is the first rank's process state, which a resume (by hand or by restart) does not restore and no
    # step depends on: the rows above are the same
    final = _tensors(tmp_path / "recovered" / "ckpt" / "step-000008", tmp_path)
    expected = _tensors(tmp_path / "straight" / "ckpt" / "step-000008", tmp_path)
    assert final.keys() == expected.keys()
    differ = [key for key, value in expected.items()
              if not (torch.equal(final[key], value) if isinstance(value, torch.Tensor) else final[key] == value)]
    assert differ in ([], ["rng.torch"]), differ
    assert sum(key.startswith("model.") for key in expected) > 50


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_failing_in_every_attempt_stops_the_run_after_n_restarts(run, tmp_path: Path) -> None:
    proc = run("doomed", "--nproc", "2", "--ep", "2", "--max-restarts", "1", fault="1:3:exit@*")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("moetrain train: rank 1 failed: exited with code 3 without a report (after 1 restart, "
                           "all ranks stopped after"), last
    # the restart resumed from step 2 and lost step 3; the checkpoint of step 2 is intact
    assert "restart 1 of 1 after rank 1 stopped without a report (a signal, or an exit): resumed from step 2; " \
           "1 step lost (step 3 is trained again)" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "doomed" / "ckpt").iterdir()) == ["step-000002"]


def _assert_recovered_at_step_2(proc, cause: str, run_dir: Path) -> None:
    """One restart after ``cause`` at step 3, resumed from step 2's checkpoint, and one curve of 8 steps."""
    assert proc.returncode == 0, proc.stderr
    assert (f"restart 1 of 1 after {cause}: resumed from step 2; 1 step lost (step 3 is trained again)"
            in proc.stdout), proc.stdout
    assert [r["step"] for r in _rows(run_dir / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.slow
def test_a_lone_process_runs_under_torchrun_and_recovers(run, tmp_path: Path) -> None:
    proc = run("lone", "--max-restarts", "1", fault="0:3:raise")
    _assert_recovered_at_step_2(proc, "rank 0 failed: RuntimeError: injected fault at step 3", tmp_path / "lone")


@pytest.mark.slow
@pytest.mark.dist
def test_a_hung_rank_times_its_peer_out_and_the_group_recovers(run, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  timeout_s: 5\n")  # the collective timeout the hang runs past
    # the restarted rank 1 is also 8 s late to load step 2: past timeout_s, well within the start-up timeout
    proc = run("hung", "--config", str(config), "--nproc", "2", "--ep", "2", "--max-restarts", "1",
               fault="1:3:hang=120,1:2:hang=8:load@1")
    _assert_recovered_at_step_2(proc, "rank 1 stopped without a report (a signal, or an exit)", tmp_path / "hung")


def _seal_fails_at_step_4(staging: Path, final: Path, step: int, identity: dict | str,
                          expert_placement: dict | None = None) -> Path:
    """The coordinator's own part of the save (the checksums, ``COMPLETE``, the rename) meets a full disk at
    step 4, as ``save_error`` fails a rank's DCP write. Only the coordinator seals, so only it sees this."""
    if step == 4:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected)", str(staging))
    return finish_folder(staging, final, step, identity, expert_placement)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("failing", ["rank 1's write", "the coordinator's seal"])
def test_a_write_that_fails_on_one_rank_is_skipped_by_every_rank(run, tmp_path: Path, failing: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP itself tells every rank of a failed write (its gather and broadcast), so rank 1's full disk reaches
    # rank 0 anyway; a failed seal is known to the coordinator alone, and only the saver's broadcast of the
    # coordinator's outcome makes rank 1 skip the checkpoint too. Each rank records the saves it gave up
    # (its console is quiet): the forked ranks inherit these patches
    failed = tmp_path / "failed"
    failed.mkdir()
    give_up = CheckpointSaver._failed

    def recorded(saver: CheckpointSaver, step: int, staging: Path, error: str) -> None:
        with (failed / f"rank{dist.get_rank()}").open("a", encoding="utf-8") as record:
            record.write(f"{step}\n")
        give_up(saver, step, staging, error)

    monkeypatch.setattr(CheckpointSaver, "_failed", recorded)
    if failing == "the coordinator's seal":
        monkeypatch.setattr(moetrain.train.saver, "finish_folder", _seal_fails_at_step_4)
    # no restart here: the ranks are forked from this process (forked_ranks; torchrun starts the runs above)
    with forked_train_ranks():
        proc = run("disk", "--nproc", "2", "--ep", "2", "--async-save", "--on-save-error", "continue",
                   fault="1:4:save_error" if failing == "rank 1's write" else None)  # a full disk at step 4
    assert proc.returncode == 0, proc.stderr
    staging = tmp_path / "disk" / "ckpt" / "step-000004.tmp"
    assert (f"checkpoint step-000004 not saved: [Errno 28] No space left on device (injected): '{staging}'; "
            "step-000002 is intact; training goes on (--on-save-error continue)") in proc.stdout, proc.stdout
    assert {p.name: p.read_text() for p in failed.iterdir()} == {"rank0": "4\n", "rank1": "4\n"}
    assert sorted(p.name for p in (tmp_path / "disk" / "ckpt").iterdir()) == \
        ["step-000002", "step-000006", "step-000008"]
    rows = [json.loads(line) for line in (tmp_path / "disk" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("save_mode") == "async"] == [2, 4, 6, 8]


@pytest.mark.slow
@pytest.mark.dist
def test_a_peer_late_to_a_resume_is_named_and_the_checkpoint_kept(run, tmp_path: Path) -> None:
    # rank 1 sleeps as it is about to load step 2, past the start-up timeout (3 s; the steps' 2 s is not
    # yet in force): rank 0's load gives up on it, in one line that keeps the checkpoint and exits 1
    layout = ["--nproc", "2", "--ep", "2"]
    checkpoints = tmp_path / "late" / "ckpt"
    train_forked([*SHAPE, *layout, "--stop-at", "2", "--save-dir", str(checkpoints)])
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  timeout_s: 2\n  startup_timeout_s: 3\n")
    proc = run("late", "--config", str(config), *layout, "--resume", fault="1:2:hang=60:load")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"moetrain train: rank 0 failed: loading checkpoint {checkpoints / 'step-000002'} "
                           "stopped waiting on another rank ("), last
    assert "Timed out waiting 3000ms" in last, last
    assert ("); the checkpoint is not at fault, keep it: the rank that stopped says why in its own line, and a "
            "rank that was only slow needs a longer run.startup_timeout_s (all ranks stopped after") in last, last
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002"]
    assert verify_checkpoint(checkpoints / "step-000002")["step"] == 2
