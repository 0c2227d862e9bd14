"""Metrics a strict JSON reader accepts, MTP blocks labelled as such, and the progress display."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from moetrain.config import load_model_config
from moetrain.train.metrics import MetricsLogger, PlainLineCadence, TrainingProgress, summary_table


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_are_written_as_null_and_kept_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(path)
    logger.log({"step": 1, "loss": math.nan, "grad_norm": math.inf, "expert_load_max_over_mean": [1.5, -math.inf],
                "layout": {"tp": 1, "ratio": math.nan}})
    logger.close()
    assert _strict(path.read_text()) == {"step": 1, "loss": None, "grad_norm": None,
                                         "expert_load_max_over_mean": [1.5, None], "layout": {"tp": 1, "ratio": None}}
    assert math.isnan(logger.rows[0]["loss"]) and logger.rows[0]["grad_norm"] == math.inf


def _row(step: int, loads: list[float]) -> dict:
    return {"step": step, "loss": 6.0, "tokens": 128, "step_time_s": 0.1, "mfu": 0.1, "lr": 1e-3,
            "tokens_per_s": 1280.0, "expert_load_max_over_mean": loads}


def _text(renderable: object) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_summary_labels_decoder_moe_layers_by_index_and_the_mtp_block() -> None:
    cfg = load_model_config("tiny-pangu")  # 8 layers, the first 2 dense, 1 MTP module
    rows = [_row(s, [1.0 + k for k in range(7)]) for s in (1, 2)]
    text = _text(summary_table(rows, "t", model_cfg=cfg))
    assert [line.split("│")[1].strip() for line in text.splitlines() if "expert load" in line] == [
        *(f"expert load max/mean, MoE layer {i}" for i in range(2, 8)), "expert load max/mean, MTP layer 8"]
    assert "MTP layer 8 │ 7.00 (last 7.00)" in text
    assert "MoE block 6" in _text(summary_table(rows, "t"))  # without the config: numbered, no layer claimed


def _plain(total: int = 25, enabled: bool = True, **cadence: Any) -> tuple[TrainingProgress, io.StringIO, list[float]]:
    out, now = io.StringIO(), [0.0]
    progress = TrainingProgress(Console(file=out, width=200), total, enabled=enabled,
                                cadence=PlainLineCadence(clock=lambda: now[0], **cadence))
    return progress, out, now


def test_plain_lines_every_n_steps_every_s_seconds_and_at_the_end() -> None:
    progress, out, now = _plain(every_steps=10, every_s=30.0)
    row = {"loss": 6.12345, "lr": 2.9e-3, "tokens_per_s": 3210.4}
    with progress:
        for step in range(1, 26):
            now[0] += 40.0 if step == 4 else 1.0  # a slow step 4: 30 s have passed
            progress.update(step, row)
    expected = [f"step {s}/25 loss 6.1235 lr 2.9e-03 tokens/s 3,210" for s in (4, 10, 20, 25)]
    assert out.getvalue().splitlines() == expected
    progress, out, now = _plain(every_steps=10)
    with progress:  # a run that stops early (--stop-at 3) still shows where it ended
        for step in range(1, 4):
            progress.update(step, row)
    assert out.getvalue().splitlines() == ["step 3/25 loss 6.1235 lr 2.9e-03 tokens/s 3,210"]
    progress, out, now = _plain(enabled=False)
    with progress:
        progress.update(25, row)
    assert out.getvalue() == ""


def test_terminal_bar_shows_a_dash_before_the_first_step() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with TrainingProgress(console, 200, start_step=40):
        pass
    assert "40/200" in out.getvalue() and "loss — lr — tokens/s —" in out.getvalue()
    assert "nan" not in out.getvalue()
    with TrainingProgress(console, 200, start_step=40) as progress:
        progress.update(41, {"loss": 6.1, "lr": 3e-3, "tokens_per_s": 3210.0})
    assert "41/200" in out.getvalue() and "loss 6.1000 lr 3.0e-03 tokens/s 3,210" in out.getvalue()


@pytest.mark.parametrize("every_steps", [0, 1])
def test_every_step_prints_each_step(every_steps: int) -> None:
    progress, out, _ = _plain(total=3, every_steps=every_steps)
    with progress:
        for step in (1, 2, 3):
            progress.update(step, {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
    assert len(out.getvalue().splitlines()) == 3


def test_plain_lines_follow_the_seconds_of_the_cadence() -> None:
    # 2 s a step, a line every 5 s (the step count never reaches 100): at 6 s (step 3), 12 s (step 6), 18 s
    # (step 9) and at the last step, 10
    progress, out, now = _plain(total=10, every_steps=100, every_s=5.0)
    with progress:
        for step in range(1, 11):
            now[0] += 2.0
            progress.update(step, {"loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0})
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["3/10", "6/10", "9/10", "10/10"]
