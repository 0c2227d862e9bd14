"""``moetrain plan --rl`` writes an rl.yaml that ``moetrain rl --plan`` runs: the file round-trips through the RL
run spec, its sources stack as defaults < --config < --plan < flags, a CPU plan of 2 devices runs as is, and
bad input (a split without a trainer, too few devices, a file of the wrong kind) is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from forked_ranks import forked_rl_ranks
from moetrain.cli import main
from moetrain.cli.parsing import CommandParser
from moetrain.cli.rl import add_arguments, build_rl_spec
from moetrain.rl.spec import plan_source, resolve_rl_spec
from refusals import refused

CLOUDMATRIX = str(Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "cloudmatrix-384-die.yaml")
CPU_PLAN = ["plan", "--rl", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--prompts", "4",
            "--group-size", "4", "--prompt-len", "16", "--response-len", "8", "--dtype", "fp32"]


def _plan(tmp_path: Path, capsys, *extra: str) -> tuple[Path, dict]:
    out = tmp_path / "rl.yaml"
    assert main([*CPU_PLAN, *extra, "--json", "--out", str(out)]) == 0
    return out, json.loads(capsys.readouterr().out)


def _rl_spec(*argv: str):
    parser = CommandParser(prog="moetrain rl")
    add_arguments(parser)
    return build_rl_spec(parser.parse_args(list(argv)))


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_the_written_plan_round_trips_through_the_rl_run_spec(tmp_path, capsys, placement):
    out, summary = _plan(tmp_path, capsys, "--placement", placement)
    text = out.read_text()
    assert text.startswith("# written by `moetrain plan --rl`") and "predicted on 2 × cpu" in text
    win = summary["top"][0]
    assert summary["runnable"] and win["placement"] == placement and not win["not_runnable"]
    spec = resolve_rl_spec([plan_source(yaml.safe_load(text), str(out))], [out.name])
    layout = spec.trainer.parallel
    for axis in ("tp", "pp", "ep", "etp", "dp", "zero"):
        assert getattr(layout, axis) == win["trainer"][axis], axis
    assert spec.trainer.training.micro_batch == win["trainer"]["micro_batch"]
    assert (spec.samples_per_step, spec.rl.max_new_tokens, spec.model_name) == (16, 8, "tiny-pangu")
    assert spec.generation.gen_ep == win["gen_devices_per_replica"]
    assert spec.rollout.replicas == win["replicas"]
    if placement == "disaggregated":
        assert spec.disaggregated and spec.stalesync.staleness == win["staleness"]
        assert (win["rollout_devices"], win["train_devices"]) == (1, 1)
    else:
        assert layout.world_size == 2
        assert (spec.stalesync is None) == (win["staleness"] == 0)
    # the spec's own dump reads back as the same spec
    assert resolve_rl_spec([spec.model_dump()], ["dump"]) == spec


def test_sources_stack_defaults_config_plan_flags(tmp_path, capsys):
    out, summary = _plan(tmp_path, capsys, "--placement", "colocated")
    config = tmp_path / "config.yaml"
    config.write_text("rl: {prompts_per_step: 8, eval_every: 3}\nsft: {steps: 7}\ntrainer: {training: {steps: 9}}\n")
    spec = _rl_spec("--config", str(config), "--plan", str(out), "--steps", "2")
    assert spec.rl.prompts_per_step == 4  # the plan over the config
    assert spec.rl.eval_every == 3 and spec.sft.steps == 7  # the config where the plan is silent
    assert spec.trainer.training.steps == 2  # the flags over both
    assert spec.trainer.parallel.world_size == 2 and spec.generation.gen_ep == summary["top"][0][
        "gen_devices_per_replica"]


@pytest.mark.slow
@pytest.mark.dist
def test_moetrain_rl_runs_a_cpu_plan_as_is(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                           capfd: pytest.CaptureFixture[str]):
    # The planner and the launcher run in this process (two Python start-ups fewer); the ranks inherit the
    # environment and print to the file descriptors capfd reads.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "rl.yaml"
    assert main([*CPU_PLAN, "--placement", "colocated", "--out", str(out)]) == 0
    assert "runs as is" in capfd.readouterr().out
    metrics = tmp_path / "m.jsonl"
    # its 2 ranks forked from this process (two Python and torch start-ups fewer): the plan is read, checked
    # and written to the ranks' spec file by the launcher as ever; torchrun starting a colocated run stays
    # under test in tests/rl/test_rl_cli.py
    with forked_rl_ranks():
        code = main(["rl", "--plan", str(out), "--steps", "2", "--sft-steps", "0", "--eval-every", "0",
                     "--eval-size", "4", "--quiet", "--metrics-out", str(metrics)])
    assert code == 0, capfd.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    plan = yaml.safe_load(out.read_text())
    assert steps[0]["layout"]["ep"] == plan["trainer"]["parallel"]["ep"]
    assert steps[0]["layout"]["dp"] == plan["trainer"]["parallel"]["dp"]


def test_a_plan_of_several_nodes_says_how_to_start_each_node(tmp_path, capsys):
    out = tmp_path / "rl.yaml"
    assert main(["plan", "--rl", "--model", "qwen3-30b-a3b", "--cluster", "h100-sxm-80gb", "--devices", "64",
                 "--prompts", "64", "--group-size", "16", "--prompt-len", "1024", "--response-len", "4096",
                 "--top", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    start = f"on each of 8 nodes, moetrain rl --plan {out} --nnodes 8 --nproc 8 --rdzv-endpoint HOST:PORT"
    assert f"runs as is: {start}" in printed
    assert f"# run it: {start}" in out.read_text() and "not runnable" not in out.read_text()
    refused(capsys, ["rl", "--plan", str(out)], f"--plan {out} runs 64 ranks on nodes of 8: start it on each of its "
            "8 nodes with --nnodes 8 --nproc 8 --rdzv-endpoint HOST:PORT")


@pytest.mark.parametrize(("extra", "expected"), [
    (["--rollout-devices", "2"], ("--rollout-devices 2 of --devices 2 leaves no trainer",)),
    (["--rollout-devices", "0"], ("--rollout-devices must be positive",)),
    (["--max-staleness", "-1"], ("--max-staleness cannot be negative",)),
    (["--placement", "disaggregated", "--devices", "1"], ("disaggregated needs", "--devices 1 is too few")),
])
def test_a_plan_that_leaves_no_trainer_or_no_job_is_one_line(capsys, tmp_path, extra, expected):
    refused(capsys, [*CPU_PLAN, "--out", str(tmp_path / "x.yaml"), *extra], *expected)
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize(("command", "extra", "message"), [
    ("plan", ["--seq-len", "99"], "--seq-len sizes a training step; with --rl the step is sized by --prompt-len + "
     "--response-len and --prompts × --group-size, so drop --seq-len"),
    ("simulate", ["--seq-len", "99", "--global-batch", "3"], "--seq-len and --global-batch size a training step; "
     "with --rl the step is sized by --prompt-len + --response-len and --prompts × --group-size, so drop --seq-len "
     "and --global-batch"),
    ("simulate", ["--timeline", "t.png"], "--timeline draws a training step's pipeline schedule; an RL step has "
     "none to draw, so drop --timeline (or --rl)"),
])
def test_training_step_flags_beside_rl_are_refused_not_ignored(capsys, tmp_path, command, extra, message):
    argv = [command, *CPU_PLAN[1:], *extra]
    assert refused(capsys, argv) == f"moetrain {command}: error: {message}"


def test_too_few_devices_for_the_smallest_job_is_one_line(capsys, tmp_path):
    refused(capsys, ["plan", "--rl", "--model", "pangu-ultra-moe-718b", "--cluster", CLOUDMATRIX, "--devices", "8",
                     "--prompt-len", "1024", "--response-len", "4096", "--out", str(tmp_path / "x.yaml")],
            "fits 8 × cloudmatrix-384-die", "one generation replica alone needs 64 devices", "add devices")


def test_files_of_the_wrong_kind_are_one_line(capsys, tmp_path):
    rl_yaml, _ = _plan(tmp_path, capsys)
    training = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "2", "--seq-len", "64",
                 "--global-batch", "8", "--json", "--out", str(training)]) == 0
    capsys.readouterr()
    refused(capsys, ["rl", "--plan", str(training)], f"--plan {training} is a training plan", "moetrain train --plan")
    refused(capsys, ["train", "--plan", str(rl_yaml)], f"{rl_yaml} is an RL plan", f"moetrain rl --plan {rl_yaml}")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("model: tiny-pangu\ntraining: {steps: 3}\n")
    refused(capsys, ["rl", "--plan", str(run_yaml)], "is not an RL run spec")
    config = tmp_path / "config.yaml"
    config.write_text("rl: {prompts_per_step: 8}\n")
    refused(capsys, ["rl", "--plan", str(config)], "sets no layout", "--config")


@pytest.mark.parametrize(("extra", "config", "expected"), [
    (["--tp", "2"], None, ("--plan already sets the layout; drop --tp",)),
    (["--staleness", "1", "--gen-ep", "1"], None, ("drop --gen-ep, --staleness",)),
    ([], "trainer: {parallel: {dp: 2}}\n", ("trainer.parallel both set the layout",)),
    ([], "generation: {gen_ep: 1}\n", ("generation both set the layout",)),
])
def test_the_layout_is_set_once_beside_a_plan(capsys, tmp_path, extra, config, expected):
    rl_yaml, _ = _plan(tmp_path, capsys)
    argv = ["rl", "--plan", str(rl_yaml), *extra]
    if config:
        (tmp_path / "c.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "c.yaml")]
    refused(capsys, argv, *expected)
