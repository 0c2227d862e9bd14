import json
import shutil

import pytest

from forked_ranks import forked_rl_ranks
from moetrain.cli import main
from refusals import refused

TINY = ["--sft-steps", "2", "--sft-batch", "8", "--steps", "2", "--prompts", "2", "--group-size", "2",
        "--eval-size", "4", "--device", "cpu", "--quiet"]


@pytest.mark.parametrize("argv, expected", [
    (["rl", "--task", "multiply"], ("--task", "unknown task 'multiply'", "addition")),
    (["rl", "--group-size", "1"], ("--group-size",)),
    (["rl", "--top-p", "0"], ("--top-p",)),
    (["rl", "--nproc", "4", "--gen-ep", "3"], ("generation layout ep3 does not divide the 4 ranks",)),
    (["rl", "--nproc", "3", "--gen-ep", "3", "--sft-steps", "0", "--prompts", "3", "--group-size", "2"],
     ("--gen-ep 3", "16 experts do not divide by it")),
    (["rl", "--tp", "2"], ("--tp 2 needs several ranks",)),
    (["rl", "--nproc", "4", "--tp", "2", "--prompts", "3", "--group-size", "2"], ("6 samples", "4 generation")),
    (["rl", "--resume"], ("--resume needs --save-dir (the folder holding the checkpoints)",)),
    (["rl", "--sft-steps", "-1"], ("--sft-steps -1",)),
    (["rl", "--sft-target", "1.5"], ("--sft-target: Input should be less than or equal to 1",)),
    (["rl", "--sft-check-every", "0"], ("--sft-check-every: Input should be greater than 0",)),
    (["rl", "--model", "no-such-model"], ("no-such-model",)),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, expected):
    refused(capsys, argv, *expected)


@pytest.mark.slow
def test_sft_then_grpo_writes_rows_a_plot_and_checkpoints_and_refuses_another_models_resume(tmp_path, capsys):
    metrics, save = tmp_path / "rl.jsonl", tmp_path / "ckpt"
    assert main(["rl", *TINY, "--metrics-out", str(metrics), "--save-dir", str(save)]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all({"reward", "accuracy"} <= set(r) for r in rows[1:]) and "heldout_accuracy" in rows[-1]
    assert metrics.with_suffix(".png").stat().st_size > 1000
    assert (save / "sft" / "step-000002").is_dir() and (save / "rl" / "step-000002").is_dir()
    capsys.readouterr()
    no_warmup = [*TINY[4:], "--sft-steps", "0"]  # TINY without its warm-up flags: --sft-steps 0 refuses them
    refused(capsys, ["rl", *no_warmup, "--model", "tiny-qwen3", "--save-dir", str(save), "--resume"],
            "was written with other settings")


@pytest.mark.slow
@pytest.mark.dist
def test_rl_fusion_on_4_ranks_trains_tp2_pp2_ep2_generates_in_replicas_and_resumes_its_reward_curve(tmp_path,
                                                                                                      monkeypatch):
    """TP2 × PP2 × EP2 training, generation in 4 replicas, saving after each step; resumed from its step-1
    checkpoint (the newer one removed, as an interrupted run leaves it): the warm-up is read back, the
    resumed run drops the metrics rows after step 1 and writes the rows the uninterrupted run wrote.
    One layout with every axis, so the uninterrupted run is also the one the layout's checks read."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread a rank in both runs (forked ranks need it)
    straight, resumed, save = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    layout = [*TINY, "--nproc", "4", "--tp", "2", "--pp", "2", "--ep", "2", "--eval-every", "0"]
    assert main(["rl", *layout, "--metrics-out", str(straight), "--log-dir", str(tmp_path / "logs"),
                 "--save-dir", str(save), "--save-every", "1"]) == 0
    assert (save / "rl" / "step-000001").is_dir()
    shutil.rmtree(save / "rl" / "step-000002")
    shutil.copy(straight, resumed)
    with forked_rl_ranks():  # the resumed run's ranks forked from this process (torchrun: the run above)
        assert main(["rl", *layout, "--metrics-out", str(resumed), "--save-dir", str(save), "--resume"]) == 0
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()]
            for name, path in (("straight", straight), ("resumed", resumed))}
    assert [r["step"] for r in rows["straight"]] == [0, 1, 2] and "heldout_accuracy" in rows["straight"][-1]
    for row in rows["straight"][1:]:
        assert (row["layout"]["tp"], row["layout"]["pp"], row["layout"]["ep"]) == (2, 2, 2)
        assert row["sync_checksums_verified"] > 0
        assert row["switch_s"] > 0 and row["offloaded"] is False  # a CPU's memory always fits
    assert straight.with_suffix(".png").stat().st_size > 1000
    assert [r["step"] for r in rows["resumed"]] == [0, 1, 2]
    for got, expected in zip(rows["resumed"], rows["straight"], strict=True):
        for key in ("reward", "completion_len", "loss", "grad_norm"):
            assert (key in got) == (key in expected), (key, got["step"])
            if key in expected:
                assert got[key] == pytest.approx(expected[key], rel=1e-6), (key, got["step"])
    assert rows["resumed"][-1]["heldout_accuracy"] == rows["straight"][-1]["heldout_accuracy"]


@pytest.mark.parametrize("flag, expected", [([], None), (["--compile"], True), (["--no-compile"], False)])
def test_compile_reaches_both_trainers_specs(flag, expected):
    import argparse

    from moetrain.cli.rl import add_arguments, build_rl_spec
    from moetrain.rl.run import build_rl_run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run = build_rl_run(build_rl_spec(parser.parse_args([*TINY, *flag])))
    assert run.sft.run.compile is expected and run.grpo.run.compile is expected
