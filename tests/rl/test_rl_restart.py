"""Recovery of a StaleSync run (issue 40, item 4): ``moetrain rl --staleness K --max-restarts N`` on two gloo
ranks. The rollout replica killed as it starts batch 4 (it holds version 4: the trainer has done step 4), with
checkpoints every 2 steps: torchrun restarts both ranks, the trainer resumes from step 2 or 4 (whether step 4's
save was complete) and tells the replica where to start; the run ends with the
uninterrupted run's final weights and metrics rows (timings aside), so no admitted batch is lost, and every
row's staleness is within k."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from checkpoint_tensors import checkpoint_tensors
from cli_in_process import Finished, InProcessCli
from forked_ranks import forked_rl_ranks
from refusals import refused

K = 1
LAUNCH = ["rl", "--sft-steps", "2", "--sft-batch", "8", "--steps", "5",
          "--prompts", "2", "--group-size", "2", "--eval-size", "4", "--device", "cpu", "--quiet", "--threads", "1",
          "--staleness", str(K), "--save-every", "2"]
PUSH_BOOKKEEPING = ("sync_landed_version", "sync_mib")
"""A restarted trainer pushes its starting weights before its first step, not after the checkpoint's step: the
row that reports that push's landing differs, not what was generated or trained."""


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> Callable[..., Finished]:
    """``moetrain rl`` with the flags above, its checkpoints, metrics and logs in ``tmp_path / name``, in
    this process with the warm-up the launcher runs (``cli_in_process``)."""
    cli = InProcessCli(monkeypatch, capfd)

    def launch(name: str, *flags: str, fault: str | None = None) -> Finished:
        return cli([*LAUNCH, *flags, "--save-dir", str(tmp_path / name / "ckpt"),
                    "--metrics-out", str(tmp_path / name / "metrics.jsonl"),
                    "--log-dir", str(tmp_path / name / "logs")], fault)

    return launch


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items()
             if not (k.endswith("_s") or k in ("mfu", "gen_tokens_per_s", *PUSH_BOOKKEEPING))}
            for line in path.read_text().splitlines()]


def _tensors(checkpoint: Path, out: Path) -> dict:
    return checkpoint_tensors(checkpoint, out)


@pytest.mark.slow
@pytest.mark.dist
def test_a_killed_rollout_replica_is_restarted_and_no_admitted_batch_is_lost(run, tmp_path: Path) -> None:
    with forked_rl_ranks():  # the uninterrupted run, the reference: its ranks forked from this process
        straight = run("straight")
    assert straight.returncode == 0, straight.stderr
    recovered = run("recovered", "--max-restarts", "1", fault="0:4:kill")  # rank 0: the replica
    assert recovered.returncode == 0, recovered.stderr
    out = recovered.stdout
    # the replica's rank is named, not the trainer that torchrun stopped after it
    assert re.search(r"restart 1 of 1 after rank 0 stopped without a report \(a signal, or an exit\): "
                     r"resumed from step [24]; ", out), out
    assert re.search(r"moetrain rl: recovered from 1 failure \(resumed at step [24]\)", out), out
    got, want = _rows(tmp_path / "recovered" / "metrics.jsonl"), _rows(tmp_path / "straight" / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(6))  # one curve: step 0's held-out accuracy, then 1..5 once
    assert got == want
    trained = [r for r in got if "loss" in r]
    assert [r["batch_index"] for r in trained] == list(range(5))  # every step trained its own batch
    assert all(r["staleness_max"] <= K and r["dropped_batches"] == 0 for r in trained)
    final = _tensors(tmp_path / "recovered" / "ckpt" / "rl" / "step-000005", tmp_path / "recovered.pt")
    expected = _tensors(tmp_path / "straight" / "ckpt" / "rl" / "step-000005", tmp_path / "straight.pt")
    assert final.keys() == expected.keys() and sum(key.startswith("model.") for key in expected) > 50
    differ = [key for key, value in expected.items()
              if not (torch.equal(final[key], value) if isinstance(value, torch.Tensor) else final[key] == value)]
    assert differ in ([], ["rng.torch"]), differ  # the torch RNG state: process state no step reads


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--staleness", "1", "--max-restarts", "1"], ("--max-restarts 1 needs --save-dir",)),
    (["rl", "--staleness", "1", "--max-restarts", "-1", "--save-dir", "x"], ("--max-restarts -1 must be ≥ 0",)),
    (["rl", "--max-restarts", "1", "--save-dir", "x"], ("this run is one process",)),
])
def test_cli_refuses_restarts_it_cannot_give_in_one_line_exit_2(capsys, argv, expected):
    refused(capsys, argv, *expected)


@pytest.mark.slow
@pytest.mark.dist
def test_a_hung_rollout_replica_is_named_within_the_runs_timeout_on_torchrun(run, tmp_path: Path) -> None:
    """MOETRAIN_FAULT's hang: replica 0 sleeps as it starts batch 3 (past the 2-step warm-up in the CLI's
    process); the trainer's receive gives up after the run's timeout_s (10 s here, not the 30 minutes of a
    group made without it), and the run ends in one line naming the hung replica."""
    config = tmp_path / "rl.yaml"
    config.write_text("trainer:\n  run:\n    timeout_s: 10\n")
    hung = run("hung", "--steps", "4", "--config", str(config), fault="0:3:hang")
    assert hung.returncode == 1, hung.stderr
    lines = hung.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.search(r"StaleSync rollout worker \(rank 0\) stopped responding: the trainer \(rank 1\) lost it",
                     lines[0]), lines
