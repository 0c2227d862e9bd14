"""The planner's output is the runtime's input: ``moetrain plan ... --out plan.yaml && moetrain train --plan
plan.yaml`` runs the winner on its ranks, and trains like one process (loss within 1e-4)."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from forked_ranks import forked_train_ranks
from moetrain.cli import main
from moetrain.config import ParallelConfig
from moetrain.config.parallel import runtime_limits

PLAN = ["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--seq-len", "128",
        "--global-batch", "16"]


@pytest.mark.slow
@pytest.mark.dist
def test_the_planned_layout_trains_like_one_process(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(rng.choice(["the", "king", "sword", "night", "crown", "of", "my"]) for _ in range(6000)))
    # The planner and the CLI in this process, the plan's ranks forked from it (tests/forked_ranks.py: the
    # spec still goes through the file the ranks read); torchrun starting a training run stays under test
    # in tests/cli/test_train_cli.py and tests/distributed/test_launch.py.
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main([*PLAN, "--out", str(tmp_path / "plan.yaml")]) == 0
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    layout = ParallelConfig(**plan["parallel"])
    assert layout.world_size == 4 and runtime_limits(layout, 8, 16, None) == []
    common = ["--data", str(data), "--steps", "2", "--seq-len", "32", "--quiet"]
    rows = {}
    threads = torch.get_num_threads()
    try:
        for name, extra in (("plan", ["--plan", str(tmp_path / "plan.yaml"), "--log-dir", str(tmp_path / "logs")]),
                            ("single", ["--global-batch", "16", "--micro-batch", str(layout.micro_batch),
                                        "--threads", "1"])):
            out = tmp_path / f"{name}.jsonl"
            with forked_train_ranks():  # the plan's 4 ranks forked from this process: 4 start-ups fewer
                assert main(["train", *extra, *common, "--metrics-out", str(out)]) == 0
            rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
    finally:
        torch.set_num_threads(threads)
    assert rows["plan"][0]["layout"]["dp"] == layout.dp and rows["plan"][0]["layout"]["tp"] == layout.tp
    for got, want in zip(rows["plan"], rows["single"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
