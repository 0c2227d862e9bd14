"""The run spec: one object, one set of defaults and one place deciding sequence parallelism, built the
same way by ``moetrain train`` and by the worker users start with torchrun."""

from __future__ import annotations

import argparse

import pytest
import yaml

from moetrain.cli import train as train_cli
from moetrain.config import TrainingConfig
from moetrain.config.run import RunSpec, resolve_run_spec, spec_source_from_plan
from moetrain.errors import UserError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_the_training_configs_for_every_entry() -> None:
    spec = train_cli.build_spec(_args())
    worker = train_cli.build_spec(_args(), world_size=1)  # the worker under torchrun with one rank
    assert spec == worker == RunSpec()
    assert (spec.training.steps, spec.training.global_batch, spec.training.micro_batch, spec.training.seq_len) == (
        200, 16, 4, 128)
    assert spec.parallel.micro_batch == spec.training.micro_batch == 4


def test_sources_stack_defaults_then_config_then_plan_then_flags(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("model: tiny-qwen3\ntraining: {steps: 7, seq_len: 64, lr: 0.001}\nrun: {save_every: 3}\n")
    plan = tmp_path / "plan.yaml"
    plan.write_text("model: tiny-mixtral\nseq_len: 32\nglobal_batch: 8\n"
                    "parallel: {tp: 2, sp: true, ep: 2, dp: 2, micro_batch: 1, recompute: selective}\n")
    spec = train_cli.build_spec(_args("--config", str(config), "--plan", str(plan), "--steps", "9"))
    assert spec.model == "tiny-mixtral"  # the plan's model over the config's
    assert (spec.training.steps, spec.training.seq_len, spec.training.global_batch) == (9, 32, 8)
    assert spec.training.lr == 0.001 and spec.run.save_every == 3  # config fields nobody overrode
    assert (spec.parallel.tp, spec.parallel.sp, spec.parallel.ep, spec.parallel.dp) == (2, True, 2, 2)
    assert spec.training.micro_batch == spec.parallel.micro_batch == 1
    assert spec.memory.policy == "selective"  # the plan's recompute level
    assert spec.world_size == 4


def test_sequence_parallelism_follows_tp_and_is_decided_once() -> None:
    assert RunSpec(parallel={"tp": 2}).parallel.sp is True
    assert RunSpec(parallel={"tp": 1}).parallel.sp is False
    with pytest.raises(ValueError, match="the runtime runs sequence parallelism exactly when tp > 1"):
        RunSpec(parallel={"tp": 2, "sp": False})
    with pytest.raises(ValueError, match="set the micro-batch once, in training"):
        RunSpec(training={"micro_batch": 2}, parallel={"micro_batch": 4})


def test_the_rank_count_fills_dp_and_must_agree_with_it() -> None:
    assert resolve_run_spec([{"parallel": {"tp": 2, "ep": 2}}], world_size=8).parallel.dp == 4
    with pytest.raises(UserError, match="6 ranks are not a multiple of tp·cp·pp = 4"):
        resolve_run_spec([{"parallel": {"tp": 2, "pp": 2}}], world_size=6)
    with pytest.raises(UserError, match="the layout's tp·cp·pp·dp is 2 but 4 ranks run it"):
        resolve_run_spec([{"parallel": {"dp": 2}}], world_size=4)


def test_a_plan_sets_its_layout_model_shape_and_recompute() -> None:
    plan = {"model": "qwen3-30b-a3b", "seq_len": 4096, "global_batch": 256,
            "parallel": {"tp": 2, "sp": True, "pp": 4, "vpp": 2, "ep": 8, "etp": 1, "cp": 1, "dp": 8, "zero": 2,
                         "micro_batch": 1, "recompute": "full", "a2a": "hierarchical", "overlap": False}}
    source = spec_source_from_plan(plan)
    assert source["model"] == "qwen3-30b-a3b"
    assert source["training"] == {"seq_len": 4096, "global_batch": 256, "micro_batch": 1}
    assert source["memory"] == {"policy": "full"}
    assert source["parallel"]["zero"] == 2 and source["parallel"]["a2a"] == "hierarchical"
    assert "micro_batch" not in source["parallel"] and "recompute" not in source["parallel"]
    assert "run" not in source  # no cluster named: the node size comes from --ranks-per-node
    assert spec_source_from_plan({**plan, "cluster": "h100-sxm-80gb"})["run"] == {"ranks_per_node": 8}


@pytest.mark.parametrize(("text", "message"), [
    ("training: {stepz: 3}\n", "run.yaml: training.stepz: unknown field"),
    ("- a list\n", "must hold a mapping of sections"),
    ("training: [\n", "is not readable YAML"),
    ("training: {lr: .nan}\n", "run.yaml: training.lr: Input should be a finite number, got NaN"),
    ("training: {grad_clip: .inf}\n", "run.yaml: training.grad_clip: Input should be a finite number"),
])
def test_a_bad_config_file_is_one_line(tmp_path, text: str, message: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("[", r"\[")):
        train_cli.build_spec(_args("--config", str(config)))


def test_a_config_that_is_not_utf8_is_one_line(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes(b"model: tiny-pangu\ntraining: {steps: \xff}\n")
    # 0xff is the 36th byte: line 2 ("training: {steps: "), column 19
    with pytest.raises(UserError, match=r"is not UTF-8 text: byte 0xff at line 2, column 19; save it as UTF-8 YAML"):
        train_cli.build_spec(_args("--config", str(config)))


def test_training_config_defaults_are_the_documented_ones() -> None:
    assert TrainingConfig().steps == 200 and TrainingConfig().warmup_steps == 20


@pytest.mark.parametrize(("text", "message"), [
    ('parallel: {tp: "2"}', 'run.yaml: parallel.tp: Input should be a whole number (unquoted in YAML), got "2"'),
    ("parallel: {pp: null}", "run.yaml: parallel.pp: Input should be a whole number, got null"),
    ("parallel: {dp: 1.5}", "run.yaml: parallel.dp: Input should be a whole number, got 1.5"),
])
@pytest.mark.parametrize("world_size", [None, 2])
def test_a_layout_count_that_is_no_whole_number_is_named_before_any_arithmetic(text, message, world_size):
    # tp·cp·pp (fill_data_parallel) and tp > 1 (the sequence-parallel rule) run before pydantic checks types
    with pytest.raises(UserError) as info:
        resolve_run_spec([yaml.safe_load(text)], world_size, ["run.yaml"])
    assert str(info.value) == message
