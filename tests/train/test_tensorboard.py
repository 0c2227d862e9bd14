"""``--tensorboard DIR`` writes the rows of the metrics file as TensorBoard scalars, step for step."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moetrain.cli import main
from moetrain.train.metrics import tensorboard_scalars


def test_scalars_of_a_row_keep_numbers_and_index_lists() -> None:
    row = {"step": 3, "loss": 2.5, "lr": 1e-3, "expert_load_max_over_mean": [1.5, 2.0], "layout": {"tp": 2},
           "tokens": 128}
    assert tensorboard_scalars(row) == {"loss": 2.5, "lr": 1e-3, "expert_load_max_over_mean/0": 1.5,
                                        "expert_load_max_over_mean/1": 2.0, "tokens": 128.0}


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_rows(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    rng = random.Random(5)
    data = tmp_path / "text.txt"
    data.write_text(" ".join(rng.choice(["a", "king", "sword", "night", "crown"]) for _ in range(1500)))
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(data), "--steps", "3", "--seq-len", "32", "--global-batch", "4",
                     "--micro-batch", "2", "--threads", "1", "--quiet", "--metrics-out", str(tmp_path / "m.jsonl"),
                     "--tensorboard", str(tmp_path / "tb")]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for tag in ("loss", "lm_loss", "grad_norm", "lr", "tokens_per_s", "expert_load_max_over_mean/0"):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2, 3]
        want = [tensorboard_scalars(r)[tag] for r in rows]
        assert [s.value for s in scalars] == pytest.approx(want, rel=1e-6)
