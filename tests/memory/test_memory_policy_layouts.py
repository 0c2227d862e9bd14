"""The memory policy on a multi-rank layout changes no number: ``moetrain train --nproc 4 --ep 2 --pp 2
--policy auto --budget-fraction 0.5`` logs the losses and gradient norms of the same layout without it,
each rank installing the options of the layers it holds."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

SHAPE = ["--steps", "2", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--quiet"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")


@pytest.mark.slow
@pytest.mark.dist
def test_auto_policy_under_ep2_pp2_gives_the_losses_of_no_policy(tmp_path) -> None:
    rng = random.Random(7)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(rng.choice(["the", "king", "sword", "night", "crown", "of"]) for _ in range(3000)))
    env = dict(os.environ, MOETRAIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    rows = {}
    for name, policy in (("plain", []), ("auto", ["--policy", "auto", "--budget-fraction", "0.5"])):
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "--nproc", "4", "--ep", "2", "--pp", "2",
                               "--data", str(data), *SHAPE, *policy, "--metrics-out", str(out)],
                              capture_output=True, text=True, timeout=180, env=env)
        assert proc.returncode == 0, proc.stderr
        rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
        if policy:
            assert "memory policy auto:" in proc.stdout
    assert [r["step"] for r in rows["auto"]] == [1, 2]
    for plain, auto in zip(rows["plain"], rows["auto"]):
        for key in COMPARED:
            assert auto[key] == pytest.approx(plain[key], rel=1e-4), key
