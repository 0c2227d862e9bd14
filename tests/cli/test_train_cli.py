import json
import random

import pytest
import torch

from moetrain.cli import main

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in",
         "mind", "suffer", "slings", "arrows"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(1)
    folder = tmp_path_factory.mktemp("texts")
    for i in range(6):
        (folder / f"play{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    return str(folder)


@pytest.fixture(autouse=True)
def _cache_and_threads(tmp_path_factory, monkeypatch):
    """A private cache; --threads 1 below (a busy 2-core CI machine makes 2 threads crawl), undone after."""
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _train(corpus: str, *extra: str) -> int:
    return main(["train", "--data", corpus, "--steps", "4", "--seq-len", "32", "--global-batch", "4",
                 "--micro-batch", "2", "--threads", "1", "--quiet", *extra])


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_stop_at_then_resume_continues_the_same_loss_curve(corpus, tmp_path, capsys):
    assert _train(corpus, "--metrics-out", str(tmp_path / "straight.jsonl")) == 0
    ckpt = ["--save-dir", str(tmp_path / "ckpt"), "--metrics-out", str(tmp_path / "resumed.jsonl")]
    assert _train(corpus, *ckpt, "--stop-at", "2") == 0
    assert _train(corpus, *ckpt, "--resume") == 0
    assert "resumed from" in capsys.readouterr().out
    straight, resumed = _rows(tmp_path / "straight.jsonl"), _rows(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "tiny-nothing"], "unknown model preset 'tiny-nothing'; choose one of:"),
        (["--data", "/no/such/file.txt"], "--data '/no/such/file.txt' does not exist"),
        (["--stop-at", "2"], "--stop-at saves a checkpoint to resume from: give --save-dir too"),
        (["--stop-at", "9", "--save-dir", "x"], "--stop-at 9 must lie in 1..--steps (4)"),
        (["--global-batch", "3"], "global_batch=3 is not a multiple of micro_batch=2"),
        (["--resume"], "--resume needs --save-dir"),
        (["--plan", "/no/plan.yaml"], "plan file '/no/plan.yaml' does not exist"),
        (["--model", "pangu-ultra-moe-718b"],
         "model pangu-ultra-moe-718b needs about 11,705 GB for weights, gradients and optimizer state"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(corpus, args, message, capsys):
    assert _train(corpus, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetrain train: error: ")
    assert message in err


def test_a_multi_rank_plan_is_refused(corpus, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("parallel: {dp: 2, micro_batch: 2}\n")
    assert _train(corpus, "--plan", str(plan)) == 2
    assert "the plan needs 2 ranks" in capsys.readouterr().err


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_refused_with_its_folder_named(corpus, tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert _train(corpus, "--save-dir", str(save_dir), "--stop-at", "1") == 0
    (save_dir / "step-000001" / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert _train(corpus, "--save-dir", str(save_dir), "--resume") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"checkpoint {save_dir / 'step-000001'} is corrupt or unreadable" in err
