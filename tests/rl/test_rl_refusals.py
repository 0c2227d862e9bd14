"""``moetrain rl`` input that would otherwise be ignored, fail late or print a traceback: each is one line
on stderr, exit 2, before any model is built, naming the flag (or the file's field) and the mend; nothing
is written to disk."""

from __future__ import annotations

import pytest
import yaml

from moetrain.models.transformer import MoETransformer
from refusals import refused_within, snapshot

PLAN_HEADER = "# written by `moetrain plan --rl`: moetrain plan --rl --model tiny-pangu --cluster cpu\n"
COLOCATED_PLAN = {
    "model": "tiny-pangu", "rl": {"prompts_per_step": 16, "max_new_tokens": 16, "grpo": {"group_size": 8}},
    "trainer": {"parallel": {"tp": 1, "pp": 1, "vpp": 1, "ep": 2, "etp": 1, "cp": 1, "dp": 2, "zero": 0},
                "training": {"micro_batch": 8}, "run": {"cluster": "cpu"}},
    "generation": {"gen_ep": 1}, "rollout": {"replicas": 2, "ranks_per_replica": 1},
}
"""What ``moetrain plan --rl --devices 2`` writes for tiny-pangu on cpu (the colocated winner)."""
DISAGGREGATED_PLAN = {
    **COLOCATED_PLAN, "rollout": {"replicas": 1, "ranks_per_replica": 1},
    "stalesync": {"placement": "disaggregated", "staleness": 1},
}
"""``--placement disaggregated --devices 3``: one rollout rank beside a trainer of dp 2."""


@pytest.fixture(autouse=True)
def _refused_before_any_run(tmp_path, monkeypatch):
    """Relative paths as a user types them, and no model, no run: a refusal that came too late fails fast."""
    monkeypatch.chdir(tmp_path)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    def no_run(*args, **kwargs):
        raise AssertionError("the run started: nothing refused the input")

    monkeypatch.setattr(MoETransformer, "__init__", no_model)
    monkeypatch.setattr("moetrain.rl.launch.run_rl", no_run)


def _write(name: str, data: dict, header: str = "") -> str:
    with open(name, "w", encoding="utf-8") as file:
        file.write(header + yaml.safe_dump(data, sort_keys=False))
    return name


def _refused(capsys, tmp_path, argv: list[str], message: str) -> None:
    """``refused_within`` (within 2 s: the path checks import the trainer's checks), leaving the folder as it was."""
    before = snapshot(tmp_path)
    refused_within(capsys, ["rl", *argv], message, seconds=2.0)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("plan, argv, message", [
    (COLOCATED_PLAN, ["--nproc", "1"], "--nproc 1 but rl.yaml lays out 2 ranks (tp·cp·pp·dp = 1·1·1·2); give "
     "--nproc 2, or drop --nproc (the plan sets it)"),
    (COLOCATED_PLAN, ["--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "host:29500"],
     "--nnodes 2 × --nproc 2 = 4 ranks but rl.yaml lays out 2 ranks (tp·cp·pp·dp = 1·1·1·2); give --nnodes × "
     "--nproc = 2 (--nproc 1)"),
    (DISAGGREGATED_PLAN, ["--nproc", "2"], "--nproc 2 but rl.yaml lays out 3 ranks (trainer tp·cp·pp·dp = 1·1·1·2 "
     "+ 1 rollout); give --nproc 3, or drop --nproc (the plan sets it)"),
    (DISAGGREGATED_PLAN, ["--nproc", "1"], "--nproc 1 but rl.yaml lays out 3 ranks (trainer tp·cp·pp·dp = 1·1·1·2 "
     "+ 1 rollout); give --nproc 3, or drop --nproc (the plan sets it)"),
    (DISAGGREGATED_PLAN, ["--nproc", "3", "--kl-coef", "0.1", "--reward-worker"], "--nproc 3 but rl.yaml lays out 5 "
     "ranks (trainer tp·cp·pp·dp = 1·1·1·2 + 1 rollout + 1 reward + 1 reference); give --nproc 5, or drop --nproc "
     "(the plan sets it)"),
])
def test_a_rank_count_other_than_the_plans_names_the_plans_count(capsys, tmp_path, plan, argv, message):
    """The plan's dp is the planner's choice: the mend is its rank count, not dropping a dp nobody typed."""
    _write("rl.yaml", plan, PLAN_HEADER)
    _refused(capsys, tmp_path, ["--plan", "rl.yaml", *argv], message)


@pytest.mark.parametrize("config, argv, message", [
    ({"trainer": {"parallel": {"tp": "2"}}}, ["--nproc", "2"],
     'rl.yaml: trainer.parallel.tp: Input should be a whole number (unquoted in YAML), got "2"'),
    ({"trainer": {"parallel": {"pp": "two"}}}, [], 'rl.yaml: trainer.parallel.pp: Input should be a whole number, '
     'got "two"'),
    ({"trainer": {"parallel": {"tp": None}}}, [], "rl.yaml: trainer.parallel.tp: Input should be a whole number, "
     "got null"),
    ({"trainer": [1]}, ["--nproc", "2"], "rl.yaml: trainer: Input should be a valid dictionary or instance of RunSpec"),
    ({"sft": {"steps": 0}}, ["--sft-batch", "4"], "--sft-batch tunes the SFT warm-up, which --config rl.yaml's "
     "sft.steps 0 skips; drop it, or give --sft-steps N"),
])
def test_a_config_of_the_wrong_types_or_combinations_is_one_line(capsys, tmp_path, config, argv, message):
    _write("rl.yaml", config)
    _refused(capsys, tmp_path, ["--config", "rl.yaml", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--staleness", "100000"], "--staleness: Input should be at most 64 weight versions (asynchronous RL keeps k in "
     "single digits: a sample's gradient drifts with its age); give 0 to 64, got 100000"),
    (["--nproc", "3"], "the 256 samples per step (--prompts × --group-size, rl.prompts_per_step × rl.grpo.group_size) "
     "do not split over the trainer's 3 data-parallel ranks (--nproc ÷ tp·cp·pp); make --prompts × --group-size a "
     "multiple of 3, or give an --nproc whose dp divides 256"),
    (["--nproc", "3", "--prompts", "3", "--group-size", "2"], "--sft-batch 64 (sft.batch) examples do not split over "
     "the trainer's 3 data-parallel ranks; give --sft-batch a multiple of 3"),
    (["--gen-ep", "2"], "--gen-ep 2 (generation.gen_ep) sets how RL Fusion generates across ranks, but this run is "
     "one process: give --nproc N, or drop it"),
    (["--sync-bucket-mib", "64", "--offload", "never"], "--sync-bucket-mib 64 (generation.bucket_mib), --offload "
     "never (generation.offload) set how RL Fusion generates across ranks, but this run is one process: give "
     "--nproc N, or drop them"),
    (["--micro-batch", "0"], "--micro-batch: Input should be greater than 0, got 0"),
    (["--micro-batch", "1000"], "--micro-batch 1000 (trainer.training.micro_batch): a step's 256 samples (--prompts × "
     "--group-size) give the trainer's one rank 256, which micro-batches of 1000 do not split; give a --micro-batch "
     "that divides 256"),
    (["--nproc", "2", "--micro-batch", "48"], "--micro-batch 48 (trainer.training.micro_batch): a step's 256 samples "
     "(--prompts × --group-size) give each of the trainer's 2 data-parallel ranks 128, which micro-batches of 48 do "
     "not split; give a --micro-batch that divides 128"),
    (["--max-restarts", "100000", "--save-dir", "ckpt"],
     "--max-restarts: Input should be less than or equal to 10000, got 100000"),
    (["--log-dir", "logs"], "--log-dir logs holds torchrun's log and the ranks' errors, but this run is one process: "
     "drop it, or give --nproc N"),
    (["--sft-steps", "0", "--sft-lr", "0.1", "--sft-target", "0.5"], "--sft-target, --sft-lr tune the SFT warm-up, "
     "which --sft-steps 0 skips; drop them, or give --sft-steps N"),
    (["--sft-target", "0", "--sft-check-every", "5"], "--sft-check-every spaces the warm-up's validation checks, "
     "which --sft-target 0 turns off (every --sft-steps step runs); drop it, or give --sft-target T above 0"),
])
def test_a_flag_the_run_would_ignore_or_fail_on_later_is_refused(capsys, tmp_path, argv, message):
    _refused(capsys, tmp_path, argv, message)


@pytest.mark.parametrize("argv, message", [
    (["--log-dir", "afile/logs", "--nproc", "2"], "--log-dir afile/logs: {tmp}/afile is a file, not a folder; name a "
     "folder"),
    (["--metrics-out", "afile/rl.jsonl"], "--metrics-out {tmp}/afile: a file is in the way of that folder; choose "
     "another path"),
    (["--save-dir", "afile"], "--save-dir {tmp}/afile: a file is in the way of that folder; choose another path"),
])
def test_a_file_in_the_way_names_the_flag_that_was_typed(capsys, tmp_path, argv, message):
    """Not ``--plot`` for a reward curve that follows from --metrics-out or --save-dir; not a traceback from
    torchrun's log folder after the warm-up."""
    (tmp_path / "afile").write_text("not a folder")
    _refused(capsys, tmp_path, argv, message.format(tmp=tmp_path.resolve()))
