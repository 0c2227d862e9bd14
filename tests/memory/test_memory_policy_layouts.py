"""The memory policy on a multi-rank layout changes no number: ``moetrain train --nproc 4 --ep 2 --pp 2
--policy auto --budget-fraction 0.5`` logs the losses and gradient norms of the same layout without it,
each rank installing the options of the layers it holds."""

from __future__ import annotations

import json
import random

import pytest

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
    rows = {}
    for name, policy in (("plain", []), ("auto", ["--policy", "auto", "--budget-fraction", "0.5"])):
        out = tmp_path / f"{name}.jsonl"
        code = main(["train", "--nproc", "4", "--ep", "2", "--pp", "2", "--data", str(data), *SHAPE, *policy,
                     "--metrics-out", str(out), "--log-dir", str(tmp_path / f"{name}_logs")])
        printed = capfd.readouterr()
        assert code == 0, printed.err + (tmp_path / f"{name}_logs" / "torchrun.log").read_text()[-3000:]
        rows[name] = [json.loads(line) for line in out.read_text().splitlines()]
        assert ("memory policy auto:" in printed.out) == bool(policy), printed.out
    assert [r["step"] for r in rows["auto"]] == [1, 2]
    for plain, auto in zip(rows["plain"], rows["auto"]):
        for key in COMPARED:
            assert auto[key] == pytest.approx(plain[key], rel=1e-4), key
