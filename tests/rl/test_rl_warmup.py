"""The SFT warm-up's stopping criterion: the decision on known accuracies, the validation set, and the
trainer stopping on it (and a later run reusing the stopped warm-up)."""

import io
import json

import pytest
from rich.console import Console
from rl_models import small_model

from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.rl.config import WarmupCriterion
from moetrain.rl.loop import WARMUP_DECISION_FILE, SFTWarmup
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.tasks import get_task, heldout_problems, split_of
from moetrain.rl.warmup import WarmupCheck, WarmupDecision, decide, validation_problems
from moetrain.train.trainer import SuppliedParts, Trainer

TASK = get_task("addition")
CRITERION = WarmupCriterion(target=0.3, check_every=10)


def test_the_first_check_at_the_target_stops_the_warm_up():
    assert decide(WarmupCheck(240, 0.29), CRITERION, cap=600) is None
    decision = decide(WarmupCheck(250, 0.34), CRITERION, cap=600)
    assert decision == WarmupDecision(step=250, accuracy=0.34, reason="target", target=0.3, cap=600, check_every=10)
    assert decision.describe() == ("SFT warm-up stopped at step 250 of at most 600: validation accuracy 34.0% "
                                   "reached the target 30%; checked every 10 steps")
    assert decide(WarmupCheck(10, 0.3), CRITERION, cap=600).reason == "target"  # exactly at it counts


def test_the_cap_stops_it_below_the_target():
    assert decide(WarmupCheck(590, 0.2), CRITERION, cap=600) is None
    decision = decide(WarmupCheck(600, 0.2), CRITERION, cap=600)
    assert (decision.step, decision.reason) == (600, "cap")
    assert decision.describe() == ("SFT warm-up stopped at step 600 of at most 600: the step cap (validation "
                                   "accuracy 20.0%, target 30%); checked every 10 steps")
    assert decide(WarmupCheck(600, 0.4), CRITERION, cap=600).reason == "target"  # the target wins at the cap


def test_validation_problems_are_held_out_distinct_and_not_in_the_evaluation_set():
    evaluation = heldout_problems(TASK, 1234, 256)
    validation = validation_problems(TASK, 1234, 256, evaluation)
    prompts = [p.prompt for p in validation]
    assert len(prompts) == len(set(prompts)) == 256
    assert not set(prompts) & {p.prompt for p in evaluation}
    assert all(split_of(prompt) == "heldout" for prompt in prompts)
    assert validation == validation_problems(TASK, 1234, 256, evaluation)  # a function of the seed


def test_a_target_of_zero_turns_the_criterion_off_and_bad_values_are_refused():
    assert not WarmupCriterion(target=0).enabled and WarmupCriterion().enabled
    with pytest.raises(ValueError, match="less than or equal to 1"):
        WarmupCriterion(target=1.5)


def _sft(tmp_path, criterion, steps, task=TASK):
    model = small_model()
    batch = 8 if task is TASK else 64
    cfg = TrainingConfig(steps=steps, global_batch=batch, micro_batch=batch, lr=3e-3, warmup_steps=5,
                         seq_len=sequence_len_for(task, task.max_answer_chars + 2))
    spec = RunSpec(training=cfg, run={"device": "cpu", "cluster": "cpu", "quiet": True, "save_dir": str(tmp_path),
                                      "resume": True})
    hooks = SFTWarmup(spec, task, criterion=criterion, eval_size=16)
    return Trainer(spec, SuppliedParts(model_cfg=model.cfg, console=Console(file=io.StringIO()), batches=hooks.examples,
                                       hooks=hooks))


def test_the_trainer_stops_at_the_cap_saves_and_a_later_run_reuses_the_stopped_warm_up(tmp_path):
    # a check every 2 steps and at the cap; a few steps of a small model are far from the target
    criterion = WarmupCriterion(target=0.9, check_every=2, val_size=16)
    trainer = _sft(tmp_path, criterion, steps=5)
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    checks = {r["step"]: r["validation_accuracy"] for r in rows if "validation_accuracy" in r}
    assert list(checks) == [2, 4, 5] and all(accuracy < 0.9 for accuracy in checks.values())
    assert trainer.hooks.decision == WarmupDecision(5, checks[5], "cap", 0.9, 5, 2)
    assert (tmp_path / "step-000005").is_dir()
    assert json.loads((tmp_path / WARMUP_DECISION_FILE).read_text())["reason"] == "cap"
    again = _sft(tmp_path, criterion, steps=5)
    assert again.train() == [] and again.step == 5 and again.hooks.decision == trainer.hooks.decision


def test_the_trainer_stops_at_the_first_check_that_reaches_the_target(tmp_path):
    # sort: a small model answers a fair share right within a few dozen steps, long before the cap
    criterion = WarmupCriterion(target=0.2, check_every=10, val_size=64)
    trainer = _sft(tmp_path, criterion, steps=200, task=get_task("sort"))
    rows = trainer.train()
    checks = [(r["step"], r["validation_accuracy"]) for r in rows if "validation_accuracy" in r]
    assert [step for step, _ in checks] == list(range(10, 10 * len(checks) + 1, 10))
    assert all(accuracy < 0.2 for _, accuracy in checks[:-1]) and checks[-1][1] >= 0.2
    assert trainer.hooks.decision == WarmupDecision(checks[-1][0], checks[-1][1], "target", 0.2, 200, 10)
    assert rows[-1]["step"] == checks[-1][0] < 200
