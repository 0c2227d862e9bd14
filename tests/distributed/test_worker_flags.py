"""Launcher and worker flags of the real-data loop: passed through to every rank, refused before any
process starts when they cannot work, and the worker's TrainingConfig equals ``moetrain train``'s."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moetrain.config import TrainingConfig
from moetrain.distributed import launch
from moetrain.distributed.worker import parse_args, training_config
from moetrain.errors import UserError


def _launch_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(["--nproc", "2", "--ep", "2", *argv])


def test_new_flags_reach_the_worker_with_absolute_paths(tmp_path: Path) -> None:
    args = _launch_args("--data", "corpus.txt", "--save-dir", "ckpt", "--save-every", "2", "--stop-at", "3",
                        "--resume", "--trace-routing", "trace.jsonl", "--lr", "0.001", "--warmup", "1", "--seed", "7")
    out = launch.worker_args(args, launch.parallel_config(args, 2))
    worker = parse_args(out)
    assert worker.data == str(Path("corpus.txt").resolve()) and worker.save_dir == str(Path("ckpt").resolve())
    assert worker.trace_routing == str(Path("trace.jsonl").resolve())
    assert (worker.save_every, worker.stop_at, worker.resume) == (2, 3, True)
    assert (worker.lr, worker.warmup, worker.seed, worker.ep, worker.dp) == (0.001, 1, 7, 2, 2)
    assert not worker.synthetic_data


def test_an_old_style_namespace_still_builds_worker_args() -> None:
    args = argparse.Namespace(model="tiny-pangu", tp=1, pp=1, vpp=1, ep=2, hierarchical_a2a=False, overlap=False,
                              ranks_per_node=None, steps=4, global_batch=8, micro_batch=2, seq_len=32,
                              trace_dir=None, metrics_out=None)
    out = launch.worker_args(args, launch.parallel_config(args, 2))
    assert parse_args(out).ep == 2 and "--data" not in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--stop-at", "2"], "--stop-at and --resume need --save-dir (the folder holding the checkpoints)"),
    (["--resume"], "--stop-at and --resume need --save-dir (the folder holding the checkpoints)"),
    (["--stop-at", "11", "--save-dir", "x"], "--stop-at 11 must lie in 1..--steps (10)"),
    (["--synthetic-data", "--data", "a.txt"], "--synthetic-data and --data exclude each other; drop one"),
])
def test_bad_checkpoint_flags_are_refused_before_any_process_starts(argv: list[str], message: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(UserError) as excinfo:
        launch.launch(2, _launch_args(*argv))
    assert str(excinfo.value) == message


def test_worker_training_config_is_that_of_moetrain_train() -> None:
    shape = ["--steps", "3", "--global-batch", "4", "--micro-batch", "2", "--seq-len", "16"]
    assert training_config(parse_args(shape)) == TrainingConfig(steps=3, global_batch=4, micro_batch=2, seq_len=16)
    assert training_config(parse_args([*shape, "--warmup", "1", "--lr", "0.01"])) == TrainingConfig(
        steps=3, global_batch=4, micro_batch=2, seq_len=16, warmup_steps=1, lr=0.01)
    # the synthetic runs keep their historical warm-up
    assert training_config(parse_args([*shape, "--steps", "10", "--synthetic-data"])).warmup_steps == 2
