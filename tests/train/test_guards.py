"""Bad-step guards (issue 40, item 3) with injected faults (item 5): a step whose loss is NaN is skipped,
counted and changes nothing, in one process and on two ranks of which only one sees the NaN; a loss
spike, or bad steps in a row, rolls the run back to its last checkpoint past the offending batches."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from rich.console import Console

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.errors import UserError
from moetrain.train import SuppliedParts, Trainer
from moetrain.train.faults import Fault, injected_faults, parse_fault

if TYPE_CHECKING:
    from moetrain.distributed.layout import ParallelDims

TRAINING = TrainingConfig(steps=6, global_batch=4, micro_batch=2, seq_len=32, lr=3e-3, warmup_steps=2)


class RecordingTrainer(Trainer):
    """The trainer, keeping the state after each step (weights, buffers, AdamW moments and step) and the
    data position of each batch it reads."""

    def __init__(self, spec: RunSpec, dims: ParallelDims | None = None) -> None:
        super().__init__(spec, SuppliedParts(dims=dims, console=Console(file=io.StringIO(), width=400)))
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.positions: list[int] = []

    def state(self) -> dict[str, torch.Tensor]:
        moments, count = self.run.optimizer.moments_by_name()
        state = {name: value.detach().clone() for name, value in self.run.stage.model.state_dict().items()}
        state.update({f"{name}.{key}": value for name, by_key in moments.items() for key, value in by_key.items()})
        return {**state, "adamw_step": count.clone()}  # on a CPU the count is the optimizer's own tensor

    def next_batch(self):
        self.positions.append(self.step)
        return super().next_batch()

    def after_step(self):
        self.states[self.step] = self.state()
        return super().after_step()

    def roll_back(self, verdict) -> None:
        super().roll_back(verdict)
        self.states[self.step] = self.state()  # the state the next step starts from

    @property
    def output(self) -> str:
        return self.console.file.getvalue()


def _spec(parallel: ParallelConfig | None = None, training: TrainingConfig = TRAINING, guards: dict | None = None,
          **run) -> RunSpec:
    run = {key: str(value) if isinstance(value, Path) else value for key, value in run.items()}
    return RunSpec(training=training, parallel=parallel or ParallelConfig(), guards=guards or {},
                   run={"device": "cpu", "cluster": "cpu", "synthetic_data": True, "quiet": True, **run})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fault_specs_parse_and_refuse_in_one_line():
    assert parse_fault("1:5:nan").rank == 1 and math.isnan(parse_fault("1:5:nan").factor)
    assert parse_fault("*:2:spike=50") == Fault(None, 2, "spike", "step", 50.0)
    assert parse_fault("0:4:kill:save") == Fault(0, 4, "kill", "save", 1.0)
    faults = injected_faults(1, "0:3:nan,*:4:spike=10")
    assert faults.loss_scale(3) == 1.0 and faults.loss_scale(4) == 10.0 and faults.loss_scale(5) == 1.0
    assert math.isnan(injected_faults(0, "0:3:nan").loss_scale(3))
    for bad, message in (("1:5", "give RANK:STEP:KIND[:PHASE][@ATTEMPT]"), ("x:5:nan", "are integers"),
                         ("0:5:melt", "KIND is one of raise, kill, exit, hang, nan, spike, save_error"),
                         ("0:5:nan:save", "PHASE is step")):
        with pytest.raises(UserError, match=re.escape(message)):
            parse_fault(bad)


@pytest.mark.slow
def test_a_nan_step_is_skipped_counted_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("MOETRAIN_FAULT", "0:2:nan")  # the third step (row 3)
    trainer = RecordingTrainer(_spec())
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert math.isnan(rows[2]["loss"]) and rows[2]["skipped"] is True
    assert rows[2]["batch"] == 2 and rows[2]["skipped_steps"] == 1
    assert all("skipped" not in r and math.isfinite(r["loss"]) for r in rows[:2] + rows[3:])
    assert _same(trainer.states[3], trainer.states[2])  # weights, router biases, moments and AdamW step
    assert not _same(trainer.states[4], trainer.states[3])
    assert trainer.positions == [0, 1, 2, 3, 4, 5]  # the skipped batch is consumed, not read again
    assert "step 3 skipped (loss nan, gradient norm nan): no update from batch 2; 1 step skipped so far" \
        in trainer.output


def _two_rank_worker(rank: int, world_size: int) -> dict:
    from moetrain.distributed.layout import ParallelDims

    dims = ParallelDims.build(ParallelConfig(dp=2), rank)
    trainer = RecordingTrainer(_spec(ParallelConfig(dp=2), TRAINING.model_copy(update={"steps": 4})), dims=dims)
    rows = trainer.train()
    return {"rows": rows, "states": trainer.states}


@pytest.mark.slow
@pytest.mark.dist
def test_a_nan_on_one_rank_is_skipped_by_both(monkeypatch):
    from moetrain.distributed.world import spawn

    monkeypatch.setenv("MOETRAIN_FAULT", "1:1:nan")  # rank 1 only, the second step
    ranks = spawn(_two_rank_worker, 2)
    for result in ranks:
        rows, states = result["rows"], result["states"]
        assert [r.get("skipped", False) for r in rows] == [False, True, False, False]
        assert _same(states[2], states[1])
        assert all(torch.isfinite(value).all() for value in states[4].values())
    assert _same(ranks[0]["states"][4], ranks[1]["states"][4])  # the replicas never diverged


@pytest.mark.slow
def test_a_spike_rolls_back_to_the_checkpoint_past_the_offending_batches(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETRAIN_FAULT", "0:5:spike")  # the sixth step's loss × 1000
    training = TRAINING.model_copy(update={"steps": 8})
    spec = _spec(training=training, guards={"spike_factor": 3.0, "spike_window": 2},
                 save_dir=tmp_path / "ckpt", save_every=2, metrics_out=tmp_path / "metrics.jsonl")
    trainer = RecordingTrainer(spec)
    rows = trainer.train()
    assert [r["step"] for r in rows] == list(range(1, 9))  # one curve: no step twice, none missing
    assert [r["step"] for r in rows if "roll_back" in r] == [6]
    assert rows[5]["roll_back"].startswith("loss ") and "the median of the last 2 steps" in rows[5]["roll_back"]
    assert _same(trainer.states[6], trainer.states[4])  # step 7 starts from the checkpoint of step 4
    assert trainer.positions == list(range(8))  # batches 4 and 5 were trained on, undone, and not read again
    assert "rolled back to step-000004 (step 4), skipping batches 4–5" in trainer.output
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"step-{s:06d}" for s in (2, 4, 6, 8)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 8
    # the rollback was saved: a run resumed from step 6 starts from step 4's weights, past the batches
    resumed = RecordingTrainer(_spec(training=training))
    try:
        resumed.restore(tmp_path / "ckpt" / "step-000006")
        assert _same(resumed.state(), trainer.states[4]) and resumed.step == 6
    finally:
        resumed.close()


@pytest.mark.slow
def test_bad_steps_in_a_row_roll_back_or_stop_without_a_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETRAIN_FAULT", "0:2:nan,0:3:nan")  # rows 3 and 4
    guards = {"max_bad_steps": 2}
    trainer = RecordingTrainer(_spec(guards=guards, save_dir=tmp_path / "ckpt", save_every=2))
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "2 bad steps in a row" in rows[3]["roll_back"]
    assert _same(trainer.states[4], trainer.states[2])
    with pytest.raises(UserError, match=r"^step 4: 2 bad steps in a row \(loss nan, gradient norm nan\); no "
                                        r"checkpoint to roll back to"):
        RecordingTrainer(_spec(guards=guards)).train()
