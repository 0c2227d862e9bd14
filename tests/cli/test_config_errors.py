"""A bad value in a config file names the file and the field, not a flag; an unknown key names the fields
that exist (issue 45, item 6). One line, exit 2, before anything runs."""

from __future__ import annotations

import pytest

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.config.run import RunSpec
from refusals import refused

SECTIONS = ", ".join(RunSpec.model_fields)
TRAINING = ", ".join(TrainingConfig.model_fields)


def _exact(capsys, argv: list[str], message: str) -> None:
    assert refused(capsys, argv) == f"moetrain {argv[0]}: error: {message}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training: {steps: lots}\n",
         'run.yaml: training.steps: Input should be a valid integer, unable to parse string as an integer, '
         'got "lots"'),
        ("training: {steps: 0}\n", "run.yaml: training.steps: Input should be greater than 0, got 0"),
        ("trainng: {steps: 3}\n",
         f"run.yaml: trainng: unknown field (did you mean training?); valid fields: {SECTIONS}"),
        ("training: {stepz: 3}\n",
         f"run.yaml: training.stepz: unknown field (did you mean steps?); valid fields: {TRAINING}"),
    ],
)
def test_a_config_file_error_names_the_file_and_field(text, message, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    _exact(capsys, ["train", "--config", str(config)], message)


def test_a_flag_overriding_the_file_takes_the_blame_for_its_own_value(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("training: {steps: 5}\n")
    _exact(capsys, ["train", "--config", str(config), "--save-every", "-1"],
           "--save-every: Input should be greater than or equal to 0, got -1")


def test_a_plan_file_error_names_the_plan_and_its_fields(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("parallel: {tpp: 2}\n")
    _exact(capsys, ["train", "--plan", str(plan)],
           f"{plan}: parallel.tpp: unknown field (did you mean tp?); valid fields: "
           f"{', '.join(ParallelConfig.model_fields)}")


def test_a_model_file_error_lists_the_fields_of_its_attention_kind(tmp_path, capsys):
    model = tmp_path / "m.yaml"
    model.write_text("vocab_size: 64\nhidden_size: 8\nnum_layers: 2\ndense_ffn_hidden: 8\n"
                     "attention: {kind: gqa, num_heads: 2, num_kv_heads: 2, head_dim: 4, qk_nrom: true}\n")
    _exact(capsys, ["model-info", "--model", str(model)],
           f"{model}: attention.gqa.qk_nrom: unknown field (did you mean qk_norm?); valid fields: kind, num_heads, "
           "num_kv_heads, head_dim, qk_norm")
