"""Throughput leaves out the steps that compiled: the first of a compiled run, and any later one that met a
new shape or mask (a step of 27 s among steps of 0.5 s would halve a short run's tokens/s)."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from rich.console import Console

from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.distributed import parallelize
from moetrain.train import SuppliedParts, Trainer
from moetrain.train import trainer as trainer_module
from moetrain.train.metrics import summary_table


def _row(step: int, seconds: float, compiled: bool, tokens: int = 100) -> dict:
    return {"step": step, "loss": 1.0, "tokens": tokens, "step_time_s": seconds, "mfu": tokens / seconds / 1e3,
            "expert_load_max_over_mean": None, "compiled": compiled}


def _summary(rows: list[dict]) -> dict[str, str]:
    table = summary_table(rows, "t")
    metrics, values = table.columns
    return dict(zip(metrics._cells, values._cells, strict=True))


def test_tokens_per_s_and_mfu_leave_out_the_steps_that_compiled() -> None:
    rows = [_row(1, 30.0, True), _row(2, 25.0, True), _row(3, 1.0, False), _row(4, 0.5, False, tokens=200),
            _row(5, 2.0, False)]
    summary = _summary(rows)
    assert summary["tokens/s"] == "114"  # (100 + 200 + 100) tokens over (1 + 0.5 + 2) s
    assert summary["mean MFU"] == f"{(0.1 + 0.4 + 0.05) / 3:.2%}"
    assert summary["timed steps"] == "3 of 5 (left out: step 1 and 1 later that compiled)"


def test_without_compiling_only_step_1_is_left_out_and_nothing_is_said() -> None:
    summary = _summary([_row(1, 30.0, False), _row(2, 1.0, False), _row(3, 3.0, False)])
    assert summary["tokens/s"] == "50" and "timed steps" not in summary


def test_a_run_that_compiled_at_every_step_says_so() -> None:
    summary = _summary([_row(1, 30.0, True), _row(2, 20.0, True)])
    assert summary["tokens/s"] == "5"
    assert summary["timed steps"] == "1 of 2, every one compiling: a longer run measures the compiled speed"


def test_compile_events_grow_when_torch_compiles_and_only_then() -> None:
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    start = parallelize.compile_events()
    double(torch.ones(3))
    first = parallelize.compile_events()
    double(torch.ones(3))
    again = parallelize.compile_events()
    double(torch.ones(5))  # a new shape: Dynamo compiles again
    assert first > start and again == first and parallelize.compile_events() > again


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path / "cache"))
    rng = random.Random(0)
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(["a", "king", "queen", "lord", "now"])
                                                             for _ in range(60))}) for _ in range(40)))
    return str(path)


def test_the_trainer_marks_the_step_during_which_torch_compiled(corpus, monkeypatch) -> None:
    # the counter read before and after each of three steps: it grows during step 2 only
    readings = iter([0, 0, 0, 4, 4, 4])
    monkeypatch.setattr(trainer_module, "compile_events", lambda: next(readings))
    spec = RunSpec(training=TrainingConfig(steps=3, global_batch=2, micro_batch=2, seq_len=16),
                   run={"device": "cpu", "cluster": "cpu", "data": corpus, "quiet": True})
    rows = Trainer(spec, SuppliedParts(console=Console(file=io.StringIO()))).train()
    assert [r["compiled"] for r in rows] == [False, True, False]
