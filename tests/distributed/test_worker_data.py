"""Multi-rank runs through the product's entry points: ``moetrain train --nproc 2 --ep 2`` on a small text
file gives the per-step losses, metrics and routing trace of the one-process run on the same file, an
EP2 checkpoint resumes in one process on the uninterrupted curve, and the multi-node entry
(``torchrun -m moetrain.cli.worker --config run.yaml``) writes the same metrics rows as
``moetrain train --nproc 4 --config run.yaml``."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forked_ranks import forked_train_ranks
from moetrain.cli import main

WORDS = ["the", "of", "and", "to", "in", "king", "queen", "lord", "sword", "crown", "night", "day", "love", "death",
         "war", "peace", "heart", "blood", "honour"]
SHAPE = ["--steps", "3", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _single_process(data: Path, *extra: str) -> None:
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(data), *SHAPE, "--device", "cpu", "--threads", "1", "--quiet",
                     *extra]) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("worker_data")
    rng = random.Random(1)
    data = root / "tiny.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(4)))
    # The launcher runs in this process (one Python and torch start-up fewer per run), and its ranks are
    # forked from it (forked_ranks: each reads back the spec file the launcher writes; a torchrun start costs
    # about 5 CPU-seconds a rank). torchrun starts the ranks of the multi-node entry below, of
    # test_launch.py's and test_nodes.py's runs and of test_recovery.py's restarts.
    with pytest.MonkeyPatch.context() as patch, forked_train_ranks():
        patch.setenv("MOETRAIN_CACHE", str(root / "cache"))
        patch.setenv("OMP_NUM_THREADS", "1")
        _single_process(data, "--metrics-out", str(root / "single.jsonl"),
                        "--trace-routing", str(root / "single_trace.jsonl"))
        code = main(["train", "--nproc", "2", "--ep", "2", "--data", str(data), "--quiet", *SHAPE,
                     "--metrics-out", str(root / "ep2.jsonl"), "--trace-routing", str(root / "ep2_trace.jsonl"),
                     "--save-dir", str(root / "ep2_ckpt"), "--save-every", "2", "--log-dir", str(root / "logs")])
        assert code == 0  # a forked rank's failure raises here
        _config_runs(root)
        # Resume from the EP2 run's step-2 checkpoint in the single-process trainer.
        shutil.copytree(root / "ep2_ckpt" / "step-000002", root / "resume_ckpt" / "step-000002")
        _single_process(data, "--save-dir", str(root / "resume_ckpt"), "--resume",
                        "--metrics-out", str(root / "resumed.jsonl"))
    return root


def _config_runs(root: Path) -> None:
    """The same run.yaml through the launcher and through torchrun on the worker module."""
    (root / "run.yaml").write_text(
        "model: tiny-pangu\n"
        "training: {steps: 2, seq_len: 16, global_batch: 8, micro_batch: 2}\n"
        "parallel: {pp: 2, ep: 2}\n"
        f"run: {{data: {root / 'tiny.txt'}, quiet: true}}\n")
    code = main(["train", "--nproc", "4", "--config", str(root / "run.yaml"),
                 "--metrics-out", str(root / "launched.jsonl"), "--log-dir", str(root / "logs4")])
    assert code == 0  # a forked rank's failure raises here
    started = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "-m", "moetrain.cli.worker", "--config", str(root / "run.yaml"),
         "--metrics-out", str(root / "torchrun.jsonl")],
        capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr[-3000:]


def _assert_close(got: dict, want: dict, what: str) -> None:
    for key in COMPARED:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), f"{what} {key}"


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_on_a_corpus_gives_the_single_process_metrics(runs: Path) -> None:
    single, ep2 = _rows(runs / "single.jsonl"), _rows(runs / "ep2.jsonl")
    assert [r["step"] for r in ep2] == [r["step"] for r in single] == [1, 2, 3]
    assert set(ep2[0]) == set(single[0])  # the same row format
    for got, want in zip(ep2, single):
        _assert_close(got, want, f"step {want['step']}")
        assert got["lr"] == want["lr"] and got["tokens"] == want["tokens"] == 4 * 16
        assert got["layout"]["ep"] == 2 and got["layout"]["dp"] == 2
        assert got["expert_load_max_over_mean"] == pytest.approx(want["expert_load_max_over_mean"])


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_routing_trace_counts_every_rank(runs: Path) -> None:
    single, ep2 = _rows(runs / "single_trace.jsonl"), _rows(runs / "ep2_trace.jsonl")
    assert len(ep2) == len(single) > 0
    assert ep2 == single  # global counts: both ranks' tokens, exactly the single-process routing


@pytest.mark.slow
@pytest.mark.dist
def test_ep2_checkpoint_resumes_in_the_single_process_trainer(runs: Path) -> None:
    marker = json.loads((runs / "ep2_ckpt" / "step-000002" / "COMPLETE").read_text())
    assert marker["step"] == 2 and marker["config_hash"] not in ("", "synthetic")
    assert (runs / "ep2_ckpt" / "step-000003").is_dir()  # the end of the run is saved too
    assert not list((runs / "ep2_ckpt").glob("*.tmp"))
    resumed, single = _rows(runs / "resumed.jsonl"), _rows(runs / "single.jsonl")
    assert [r["step"] for r in resumed] == [3]
    _assert_close(resumed[0], single[2], "resumed step 3")


TIMINGS = ("step_time_s", "tokens_per_s", "mfu", "batch_time_s", "train_step_time_s", "after_step_time_s")


@pytest.mark.slow
@pytest.mark.dist
def test_the_multi_node_entry_and_the_launcher_write_the_same_metrics_rows(runs: Path) -> None:
    launched, started = _rows(runs / "launched.jsonl"), _rows(runs / "torchrun.jsonl")
    assert [r["step"] for r in launched] == [1, 2]
    assert launched[0]["layout"]["pp"] == 2 and launched[0]["layout"]["ep"] == 2 and launched[0]["layout"]["dp"] == 2
    strip = lambda row: {k: v for k, v in row.items() if k not in TIMINGS}
    assert [strip(r) for r in started] == [strip(r) for r in launched]
