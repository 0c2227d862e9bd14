"""``moetrain train --nproc``: a bad layout is refused before any process starts; a killed rank ends the
job with one line naming it, in well under a minute, with no process left behind."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cli_in_process import Finished, InProcessCli

LAUNCH = [sys.executable, "-m", "moetrain", "train"]


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def test_bad_layout_refused_before_start(tmp_path: Path) -> None:
    proc = subprocess.run([*LAUNCH, "--nproc", "4", "--ep", "3", "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "moetrain train: error: run spec: parallel: ep·etp=3 must divide tp·cp·dp=4 "
        "(experts regroup the ranks of one pipeline stage)"
    ]
    assert not (tmp_path / "torchrun.log").exists()


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> Callable[..., Finished]:
    """``moetrain train *flags`` with ``MOETRAIN_FAULT=fault``, in this process (``cli_in_process``)."""
    cli = InProcessCli(monkeypatch, capfd)

    def run(*flags: str, fault: str | None = None) -> Finished:
        return cli(["train", *flags], fault)

    return run


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find leftover processes")
@pytest.mark.parametrize(("fault", "expected"), [
    ("1:1:kill", "rank 1 failed: killed by signal SIGKILL"),
    ("0:1:raise", "rank 0 failed: RuntimeError: injected fault at step 1"),
])
def test_failed_rank_stops_the_job(tmp_path: Path, fault: str, expected: str, launch) -> None:
    start = time.monotonic()
    proc = launch("--nproc", "2", "--ep", "2", "--steps", "4", "--seq-len", "32", "--global-batch", "4",
                  "--micro-batch", "2", "--synthetic-data", "--quiet", "--log-dir", str(tmp_path), fault=fault)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"moetrain train: {expected} (all ranks stopped after"), last
    assert elapsed < 60
    assert _processes_with(f"MOETRAIN_ERROR_DIR={tmp_path / 'errors'}") == []


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find leftover processes")
def test_a_rank_killed_mid_save_leaves_the_newest_complete_checkpoint(tmp_path: Path, launch) -> None:
    from moetrain.runtime_base.checkpoint_files import latest_checkpoint, verify_checkpoint

    shape = ["--steps", "4", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--synthetic-data",
             "--quiet", "--save-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    start = time.monotonic()
    proc = launch("--nproc", "2", "--ep", "2", *shape, "--log-dir", str(tmp_path / "logs"), fault="1:4:kill:save")
    assert proc.returncode == 1 and time.monotonic() - start < 60
    assert "rank 1 failed: killed by signal SIGKILL" in proc.stderr
    assert _processes_with(f"MOETRAIN_ERROR_DIR={tmp_path / 'logs' / 'errors'}") == []
    newest = latest_checkpoint(tmp_path / "ckpt")  # also clears the unfinished step-000004.tmp
    assert newest is not None and newest.name == "step-000002"
    assert verify_checkpoint(newest)["step"] == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000002"]
    # it loads: the run resumes (here in one process) and finishes
    threads = torch.get_num_threads()
    try:
        resumed = launch(*shape, "--threads", "1", "--resume")
    finally:
        torch.set_num_threads(threads)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and (tmp_path / "ckpt" / "step-000004").is_dir()
