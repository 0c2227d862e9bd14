"""The planner's output is the runtime's input: ``moetrain plan ... --out plan.yaml && moetrain train --plan
plan.yaml`` runs the winner on its ranks, and trains like one process (loss within 1e-4)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import yaml

from moetrain.config import ParallelConfig
from moetrain.config.parallel import runtime_limits

PLAN = ["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "4", "--seq-len", "128",
        "--global-batch", "16"]


@pytest.mark.slow
@pytest.mark.dist
def test_the_planned_layout_trains_like_one_process(tmp_path) -> None:
    rng = random.Random(11)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(rng.choice(["the", "king", "sword", "night", "crown", "of", "my"]) for _ in range(6000)))
    env = dict(os.environ, MOETRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    moetrain = [sys.executable, "-m", "moetrain"]
    planned = subprocess.run([*moetrain, *PLAN, "--out", str(tmp_path / "plan.yaml")], capture_output=True,
                             text=True, timeout=120, env=env)
    assert planned.returncode == 0, planned.stderr
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    layout = ParallelConfig(**plan["parallel"])
    assert layout.world_size == 4 and runtime_limits(layout, 8, 16, None) == []
    common = ["--data", str(data), "--steps", "2", "--seq-len", "32", "--quiet"]
    rows = {}
    for name, extra in (("plan", ["--plan", str(tmp_path / "plan.yaml")]),
                        ("single", ["--global-batch", "16", "--micro-batch", str(layout.micro_batch),
                                    "--threads", "1"])):
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([*moetrain, "train", *extra, *common, "--metrics-out", str(out)],
                              capture_output=True, text=True, timeout=180, env=env)
        assert proc.returncode == 0, proc.stderr
        rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows["plan"][0]["layout"]["dp"] == layout.dp and rows["plan"][0]["layout"]["tp"] == layout.tp
    for got, want in zip(rows["plan"], rows["single"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
