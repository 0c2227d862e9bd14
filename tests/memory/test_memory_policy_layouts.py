"""The memory policy on a multi-rank layout changes no number: ``moetrain train --nproc 4 --ep 2 --pp 2
--policy auto --budget-fraction 0.5`` logs the losses and gradient norms of the one-process run without
it (which the same layout without a policy gives: tests/distributed/test_layout_parity.py), each rank
installing the options of the layers it holds."""

from __future__ import annotations

import json
import random

import pytest
import torch

from forked_ranks import forked_train_ranks
from moetrain.cli import main

SHAPE = ["--steps", "2", "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--quiet"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")


@pytest.mark.slow
@pytest.mark.dist
def test_auto_policy_under_ep2_pp2_gives_the_losses_of_no_policy(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(7)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(rng.choice(["the", "king", "sword", "night", "crown", "of"]) for _ in range(3000)))
    # The launcher runs in this process (one Python and torch start-up fewer per run); the ranks print
    # to the file descriptors they inherit, hence capfd.
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The reference without a policy runs in this process: one launch of 4 ranks fewer.
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(data), *SHAPE, "--device", "cpu", "--threads", "1",
                     "--metrics-out", str(tmp_path / "plain.jsonl")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "memory policy" not in capfd.readouterr().out
    out = tmp_path / "auto.jsonl"
    # the 4 ranks forked from this process, each reading back the launcher's spec file (forked_ranks): a
    # torchrun start costs about 5 CPU-seconds a rank, and torchrun stays under test in test_launch.py
    with forked_train_ranks():
        code = main(["train", "--nproc", "4", "--ep", "2", "--pp", "2", "--data", str(data), *SHAPE, "--policy",
                     "auto", "--budget-fraction", "0.5", "--metrics-out", str(out),
                     "--log-dir", str(tmp_path / "auto_logs")])
    printed = capfd.readouterr()
    assert code == 0, printed.err
    assert "memory policy auto:" in printed.out, printed.out
    rows = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("plain", "auto")}
    assert [r["step"] for r in rows["auto"]] == [1, 2]
    for plain, auto in zip(rows["plain"], rows["auto"], strict=True):
        for key in COMPARED:
            assert auto[key] == pytest.approx(plain[key], rel=1e-4), key
