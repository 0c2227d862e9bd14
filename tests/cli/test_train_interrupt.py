"""Ctrl-C while a checkpoint is written: one line "interrupted", exit 130, no partial checkpoint, the earlier
checkpoint intact; the resumed run drops the rows logged after that checkpoint and replays them, so the
metrics file holds one row per step, equal to an uninterrupted run's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from moetrain.cli import main

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in"]
COMPARED = ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    rng = random.Random(3)
    path = tmp_path / "play.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(2000)))
    threads = torch.get_num_threads()
    yield str(path)
    torch.set_num_threads(threads)


def _train(corpus: str, *extra: str) -> int:
    return main(["train", "--data", corpus, "--steps", "4", "--seq-len", "32", "--global-batch", "4",
                 "--micro-batch", "2", "--threads", "1", "--quiet", *extra])


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_an_interrupted_save_ends_quietly_and_the_resume_keeps_one_row_per_step(corpus, tmp_path, capsys,
                                                                                monkeypatch):
    assert _train(corpus, "--metrics-out", str(tmp_path / "straight.jsonl")) == 0
    save_dir, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    real_write = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_then_interrupt(self, plan, planner):
        calls["n"] += 1
        if calls["n"] == 2:  # the second save (after step 4): the user presses Ctrl-C
            raise KeyboardInterrupt
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_interrupt)
    capsys.readouterr()
    assert _train(corpus, "--save-dir", str(save_dir), "--save-every", "2", "--metrics-out", str(metrics)) == 130
    err = capsys.readouterr().err
    assert err == "moetrain train: interrupted\n"
    assert sorted(p.name for p in save_dir.iterdir()) == ["step-000002"]  # no .tmp, the older one intact
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4]  # the interrupted run logged step 3 and 4

    monkeypatch.setattr(FileSystemWriter, "write_data", real_write)
    assert _train(corpus, "--save-dir", str(save_dir), "--save-every", "2", "--metrics-out", str(metrics),
                  "--resume") == 0
    assert "dropped 2 rows after step 2" in capsys.readouterr().out
    resumed, straight = _rows(metrics), _rows(tmp_path / "straight.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, straight):
        assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
