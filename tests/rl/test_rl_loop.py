import io
import json

import pytest
import torch
from rich.console import Console
from rl_models import small_model

from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.rl.config import GRPOConfig, RLOptions
from moetrain.rl.loop import GRPO, SFTWarmup
from moetrain.rl.sft import sequence_len_for
from moetrain.rl.tasks import get_task
from moetrain.train.trainer import SuppliedParts, Trainer

TASK = get_task("addition")
SEQ_LEN = sequence_len_for(TASK, TASK.max_answer_chars + 2)


def _trainer(steps=3, replay=True, keep_logprobs=False, seed=0, **run) -> Trainer:
    model = small_model(seed=seed)
    options = RLOptions(task="addition", prompts_per_step=4, grpo=GRPOConfig(group_size=4), replay=replay,
                        eval_every=0, eval_size=16)
    cfg = TrainingConfig(steps=steps, global_batch=16, micro_batch=8, seq_len=SEQ_LEN, lr=1e-3, warmup_steps=0,
                         seed=seed)
    run = {k: str(v) if k in ("save_dir", "metrics_out") else v for k, v in run.items()}
    spec = RunSpec(training=cfg, run={"device": "cpu", "cluster": "cpu", "quiet": True, **run})
    return Trainer(spec, SuppliedParts(model_cfg=model.cfg, model=model, console=Console(file=io.StringIO()),
                                       hooks=GRPO(spec, options, keep_logprobs=keep_logprobs)))


def test_trainer_logprobs_of_generated_tokens_equal_the_rollout_engines_with_replay():
    trainer = _trainer(steps=1, keep_logprobs=True)
    rows = trainer.train()
    grpo = trainer.hooks
    sequences = grpo.last_sequences
    logprobs_T = torch.cat(grpo.last_stats.logprobs)  # the completion tokens, micro-batch by micro-batch
    chunks = grpo.batching.chunks(sequences.labels_BS)
    rollout_T = torch.cat([chunk.cut(sequences.rollout_logp_BS)[chunk.cut(sequences.labels_BS) != -100]
                           for chunk in chunks])
    mask = sequences.labels_BS != -100
    assert mask.sum() > 16 and logprobs_T.shape == (int(mask.sum()),) == rollout_T.shape
    gap = (logprobs_T - rollout_T).abs().max().item()
    assert gap < 1e-5
    assert rows[-1]["logp_gap_max"] < 1e-5 and rows[-1]["replay_token_mismatch"] == 0.0
    assert rows[-1]["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_rows_carry_reward_accuracy_versions_and_a_starting_evaluation(tmp_path):
    rows = _trainer(steps=2, metrics_out=tmp_path / "m.jsonl").train()
    written = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == [0, 1, 2] and "heldout_accuracy" in written[0]
    for row in written[1:]:
        assert {"reward", "accuracy", "loss", "completion_len", "weight_version", "staleness"} <= set(row)
        assert 0 <= row["reward"] <= 1 and row["staleness"] == 0
    assert [r["weight_version"] for r in written[1:]] == [0, 1]
    assert "heldout_accuracy" in written[-1]  # the last step is always evaluated
    assert rows == written
    # the step's parts, as the planner's check compares them phase by phase (rl_switch.py)
    for row in written[1:]:
        parts = ("batch_time_s", "train_step_time_s", "after_step_time_s", "score_time_s", "stats_time_s")
        assert all(row[key] >= 0 for key in parts)
        assert row["batch_time_s"] + row["train_step_time_s"] + row["after_step_time_s"] <= row["step_time_s"]
        assert row["score_time_s"] <= row["batch_time_s"] and row["stats_time_s"] <= row["after_step_time_s"]
    assert written[-1]["eval_time_s"] <= written[-1]["after_step_time_s"] and "eval_time_s" not in written[1]


@pytest.mark.slow
def test_resume_continues_the_same_reward_curve(tmp_path):
    fields = ("reward", "accuracy", "loss", "grad_norm", "completion_len", "nll")
    straight = _trainer(steps=4, metrics_out=tmp_path / "straight.jsonl").train()
    save = {"save_dir": tmp_path / "ckpt", "metrics_out": tmp_path / "resumed.jsonl"}
    _trainer(steps=4, stop_at=2, **save).train()
    _trainer(steps=4, resume=True, **save).train()
    resumed = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    for expected, got in zip(straight, resumed, strict=True):
        assert {k: got.get(k) for k in fields} == {k: expected.get(k) for k in fields}


def test_sft_warm_up_trains_on_answers_only():
    model = small_model()
    cfg = TrainingConfig(steps=2, global_batch=8, micro_batch=8, seq_len=SEQ_LEN, lr=1e-3, warmup_steps=0)
    spec = RunSpec(training=cfg, run={"device": "cpu", "cluster": "cpu", "quiet": True})
    warm_up = SFTWarmup(spec, TASK)
    trainer = Trainer(spec, SuppliedParts(model_cfg=model.cfg, console=Console(file=io.StringIO()),
                                          batches=warm_up.examples, hooks=warm_up))
    batch = trainer.next_batch()
    micro = batch.micro_batches[0]
    for row in range(8):
        labels = micro.labels[row][micro.labels[row] != -100].tolist()
        assert warm_up.tokenizer.decode(labels) == warm_up.tokenizer.decode(labels[:-1]) and labels[-1] == 2
        assert len(labels) == TASK.max_answer_chars + 1  # padded sum + EOS
    assert len(trainer.train()) == 2


@pytest.mark.slow
def test_compiled_layers_train_grpo_like_eager_ones():
    # torch.compile per decoder layer (on by default on CUDA) with router replay and the GRPO objective:
    # the same rewards (the same samples) and the same losses to rounding (inductor reorders fp32 sums)
    torch.set_num_threads(1)
    eager = _trainer(steps=2).train()
    compiled_trainer = _trainer(steps=2, compile=True)
    assert compiled_trainer.compiled_layers > 0
    compiled = compiled_trainer.train()
    assert [r.get("reward") for r in compiled] == [r.get("reward") for r in eager]
    for a, b in zip(eager[1:], compiled[1:], strict=True):
        for key in ("loss", "grad_norm", "nll", "logp_gap_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
