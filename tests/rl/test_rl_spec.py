"""The RL run spec (``moetrain.rl.spec``): defaults < ``--config rl.yaml`` < flags, one-line refusals naming
the file and field (or the flag), a config of the wrong kind, and the one file every process reads."""

from __future__ import annotations

import argparse

import pytest

from moetrain.cli.parsing import CommandParser
from moetrain.cli.rl import add_arguments, build_rl_spec
from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec
from moetrain.errors import UserError
from moetrain.rl.config import GRPOConfig, RLOptions, WarmupCriterion
from moetrain.rl.spec import RLRunSpec, WarmupSpec, read_spec, resolve_rl_spec, write_spec
from moetrain.rl.tasks import get_task, sequence_len_for
from refusals import refused

CONFIG = """\
model: tiny-qwen3
sft: {steps: 7, batch: 16, criterion: {target: 0.5}}
rl: {task: sort, prompts_per_step: 4, eval_every: 3, grpo: {group_size: 4, kl_coef: 0.01}}
trainer:
  training: {steps: 9, lr: 0.001}
  run: {device: cpu, quiet: true}
generation: {bucket_mib: 8}
stalesync: {staleness: 2, placement: colocated}
"""


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="moetrain rl")
    add_arguments(parser)
    return parser


def _spec(*argv: str) -> RLRunSpec:
    return build_rl_spec(_parser().parse_args(list(argv)))


def test_defaults_are_moetrain_rl_s_own():
    spec = _spec()
    assert spec == RLRunSpec()
    assert (spec.sft.steps, spec.sft.batch, spec.sft.lr, spec.sft.criterion) == (600, 64, 3e-3, WarmupCriterion())
    assert spec.rl.filter_groups and spec.rl.replay_stats_every == 10 and spec.rl.eval_every == 20
    training = spec.trainer.training
    assert (training.steps, training.lr, training.warmup_steps, training.seed) == (200, 3e-4, 5, TrainingConfig().seed)
    # the trainer's batch and sequence follow from the RL sections
    task = get_task("addition")
    assert training.global_batch == 32 * 8 == training.micro_batch
    assert training.seq_len == sequence_len_for(task, task.max_answer_chars + 2)
    assert spec.trainer.model == "tiny-pangu" and spec.trainer.run.cluster == "cpu"
    assert (spec.rollout.replicas, spec.rollout.ranks_per_replica) == (1, 1)
    assert spec.stalesync is None and spec.engine == "local" and spec.plot is None


def test_a_config_overrides_the_defaults_and_flags_override_the_config(tmp_path):
    config = tmp_path / "rl.yaml"
    config.write_text(CONFIG)
    spec = _spec("--config", str(config))
    assert spec.model == "tiny-qwen3" and spec.trainer.model == "tiny-qwen3"
    assert spec.sft == WarmupSpec(steps=7, batch=16, criterion=WarmupCriterion(target=0.5))
    assert spec.rl.task == "sort" and spec.rl.prompts_per_step == 4 and spec.rl.eval_every == 3
    assert spec.rl.grpo == GRPOConfig(group_size=4, kl_coef=0.01)
    assert spec.rl.filter_groups  # a default the file leaves alone stays moetrain rl's
    assert spec.trainer.training.steps == 9 and spec.trainer.training.lr == 1e-3
    assert spec.trainer.training.warmup_steps == 5 and spec.trainer.training.global_batch == 16
    assert spec.stalesync is not None and spec.stalesync.staleness == 2 and spec.stalesync.placement == "colocated"
    assert spec.stalesync.bucket_mib == 8  # the weight-sync bucket is set once, in generation

    spec = _spec("--config", str(config), "--steps", "11", "--group-size", "2", "--sft-target", "0.25",
                 "--staleness", "1", "--no-filter-groups", "--task", "addition")
    assert spec.trainer.training.steps == 11 and spec.trainer.training.lr == 1e-3
    assert spec.rl.grpo.group_size == 2 and spec.rl.grpo.kl_coef == 0.01 and spec.trainer.training.global_batch == 8
    assert spec.sft.criterion.target == 0.25 and spec.sft.steps == 7
    assert spec.stalesync.staleness == 1 and spec.stalesync.placement == "colocated"
    assert not spec.rl.filter_groups and spec.rl.task == "addition"


def test_flags_and_the_same_values_in_a_config_give_the_same_spec(tmp_path):
    config = tmp_path / "rl.yaml"
    config.write_text("rl: {prompts_per_step: 2, grpo: {group_size: 2}}\ntrainer: {parallel: {tp: 2}}\n")
    from_file = _spec("--config", str(config), "--nproc", "4")
    from_flags = _spec("--prompts", "2", "--group-size", "2", "--tp", "2", "--nproc", "4")
    assert from_file == from_flags
    assert from_file.trainer.parallel.dp == 2 and from_file.trainer.training.micro_batch == 2
    assert from_file.trainer.training.seq_len % 2 == 0  # sequence parallelism: tp divides it
    assert (from_file.rollout.replicas, from_file.rollout.ranks_per_replica) == (4, 1)


def test_paths_are_absolute_and_the_plot_goes_beside_the_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = _spec("--metrics-out", "out/rl.jsonl", "--save-dir", "ckpt")
    assert spec.trainer.run.metrics_out == str(tmp_path / "out" / "rl.jsonl")
    assert spec.trainer.run.save_dir == str(tmp_path / "ckpt")
    assert spec.plot == str(tmp_path / "out" / "rl.png")


def test_the_spec_round_trips_through_its_one_file(tmp_path):
    config = tmp_path / "rl.yaml"
    config.write_text(CONFIG)
    spec = _spec("--config", str(config), "--nproc", "2", "--ep", "2", "--metrics-out", str(tmp_path / "m.jsonl"))
    path = write_spec(spec, tmp_path)
    assert path.name == "rl_spec.json"
    assert read_spec(path) == spec
    assert read_spec(path).model_dump_json() == spec.model_dump_json()


@pytest.mark.parametrize(("text", "message"), [
    ("rl: {grpo: {group_siz: 4}}\n",
     f"rl.yaml: rl.grpo.group_siz: unknown field (did you mean group_size?); valid fields: "
     f"{', '.join(GRPOConfig.model_fields)}"),
    ("sftt: {steps: 3}\n",
     f"rl.yaml: sftt: unknown field (did you mean sft?); valid fields: {', '.join(RLRunSpec.model_fields)}"),
    ("trainer: {training: {stepz: 3}}\n",
     f"rl.yaml: trainer.training.stepz: unknown field (did you mean steps?); valid fields: "
     f"{', '.join(TrainingConfig.model_fields)}"),
    ("rl: {prompts_per_step: 0}\n", "rl.yaml: rl.prompts_per_step: Input should be greater than 0, got 0"),
    ("stalesync: {staleness: -1}\n",
     "rl.yaml: stalesync.staleness: Input should be greater than or equal to 0, got -1"),
])
def test_a_config_error_names_the_file_and_the_field(tmp_path, capsys, text, message):
    config = tmp_path / "rl.yaml"
    config.write_text(text)
    assert refused(capsys, ["rl", "--config", str(config)]) == f"moetrain rl: error: {message}"


def test_a_flag_overriding_the_file_takes_the_blame_for_its_own_value(tmp_path, capsys):
    config = tmp_path / "rl.yaml"
    config.write_text("rl: {grpo: {group_size: 4}}\n")
    assert refused(capsys, ["rl", "--config", str(config), "--group-size", "1"]) == \
        "moetrain rl: error: --group-size: Input should be greater than or equal to 2, got 1"


def test_a_config_of_the_wrong_kind_is_one_line(tmp_path, capsys):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("model: tiny-pangu\ntraining: {steps: 3}\nparallel: {tp: 1}\n")
    refused(capsys, ["rl", "--config", str(run_yaml)], f"--config {run_yaml} is not an RL run spec",
            "its parallel, training sections are a training run's", "moetrain train")
    run_yaml.write_text("training: {steps: 3}\n")
    refused(capsys, ["rl", "--config", str(run_yaml)], "its training section is a training run's")
    rl_yaml = tmp_path / "rl.yaml"
    rl_yaml.write_text(CONFIG)
    refused(capsys, ["train", "--config", str(rl_yaml)], f"--config {rl_yaml} is an RL run spec", "moetrain rl")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--plan", "rl_plan.yaml"], ("--plan rl_plan.yaml does not exist; give a YAML file with model, rl",)),
    (["--stale-loss", "decoupled"], ("--stale-loss", "give --staleness K")),
])
def test_what_the_flags_cannot_give_is_one_line(capsys, argv, expected):
    refused(capsys, ["rl", *argv], *expected)


@pytest.mark.parametrize(("text", "expected"), [
    ("rollout: {replicas: 2}\n", ("rollout.replicas 2: not built yet", "1 here")),
    ("rollout: {ranks_per_replica: 3}\nstalesync: {staleness: 1}\n",
     ("rollout.ranks_per_replica 3: tiny-pangu's 16 experts do not split over a replica's 3 ranks",)),
    ("rollout: {ranks_per_replica: 2}\ngeneration: {gen_ep: 4}\nstalesync: {staleness: 1}\n",
     ("rollout.ranks_per_replica 2 differs from generation.gen_ep 4",)),
    ("trainer: {training: {global_batch: 5}}\n", ("trainer.training.global_batch 5: RL sets it to 256",)),
    ("trainer: {model: tiny-qwen3}\n", ("trainer.model tiny-qwen3", "set once, at the top")),
    ("trainer: {training: {micro_batch: 7}}\n",
     ("--micro-batch 7 (trainer.training.micro_batch): a step's 256 samples (--prompts × --group-size) give the "
      "trainer's one rank 256, which micro-batches of 7 do not split; give a --micro-batch that divides 256",)),
    ("generation: {bucket_mib: 4}\nstalesync: {staleness: 1, bucket_mib: 8}\n",
     ("stalesync.bucket_mib 8.0 differs from generation.bucket_mib 4.0",)),
])
def test_what_the_spec_decides_or_is_not_built_is_refused_in_one_line(tmp_path, capsys, text, expected):
    config = tmp_path / "rl.yaml"
    config.write_text(text)
    refused(capsys, ["rl", "--config", str(config)], *expected)


def test_resolving_without_the_cli_gives_the_same_refusals():
    with pytest.raises(UserError, match=r"^rl\.yaml: rl\.top_p: Input should be greater than 0"):
        resolve_rl_spec([{"rl": {"top_p": 0}}], ["rl.yaml"])
    with pytest.raises(UserError, match="ranks are not a multiple of tp·cp·pp = 2"):
        resolve_rl_spec([{"trainer": {"parallel": {"tp": 2}}}], ["rl.yaml"], world_size=3)


def test_a_library_caller_gets_the_same_defaults_as_the_command_line():
    spec = RLRunSpec(rl={"prompts_per_step": 4}, trainer={"training": {"seed": 3}})
    assert spec.rl.filter_groups and spec.rl.eval_every == 20  # moetrain rl's, not RLOptions()'s
    assert not RLOptions().filter_groups
    assert spec.trainer.training.steps == 200 and spec.trainer.training.seed == 3
    assert spec.trainer.training.global_batch == 32 and isinstance(spec.trainer, RunSpec)


def test_help_shows_the_spec_defaults_its_flags_stand_for():
    helps = {action.option_strings[0]: action.help for action in _parser()._actions if action.option_strings}
    for flag, default in (("--sft-steps", "600"), ("--sft-target", "0.3"), ("--steps", "200"), ("--lr", "0.0003"),
                          ("--prompts", "32"), ("--group-size", "8"), ("--filter-groups", "on"),
                          ("--eval-every", "20"), ("--seed", str(TrainingConfig().seed)), ("--gen-ep", "1"),
                          ("--engine", "local"), ("--stale-loss", "tis"), ("--task", "addition"), ("--tp", "1")):
        assert helps[flag].endswith(f"(default: {default})"), (flag, helps[flag])


def test_the_spec_imports_and_builds_without_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom moetrain.rl.spec import RLRunSpec\nRLRunSpec(stalesync={'staleness': 1})\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
