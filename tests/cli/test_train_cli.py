import json
import random

import pytest
import torch

from moetrain.cli import main
from refusals import refused_within

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
        (["--stop-at", "2"], "--stop-at needs --save-dir (the folder holding the checkpoints)"),
        (["--stop-at", "9", "--save-dir", "x"], "--stop-at 9 must lie in 1..--steps (4)"),
        (["--global-batch", "3"], "global_batch=3 is not a multiple of micro_batch=2"),
        (["--log-dir", "logs"], "--log-dir logs holds torchrun's log and the ranks' errors, but this run is one "
                                "process: drop it, or give --nproc N"),
        (["--resume"], "--resume needs --save-dir (the folder holding the checkpoints)"),
        (["--save-every", "2"], "--save-every needs --save-dir (the folder holding the checkpoints)"),
        (["--stop-at", "2", "--resume", "--save-every", "1"], "--stop-at, --resume and --save-every need --save-dir"),
        (["--seq-len", "8192"], "--seq-len 8192 exceeds tiny-pangu's max_seq_len"),
        (["--zero", "2", "--overlap"], "ZeRO-2 does not run with the overlapped schedule yet"),
        (["--plan", "/no/plan.yaml"], "plan file '/no/plan.yaml' does not exist"),
        (["--policy", "bogus"], "--policy 'bogus' is not a memory policy; choose one of none, full, selective, auto"),
        (["--policy", "auto"], "--policy auto needs a budget: add --budget-fraction F or --budget-gib G"),
        (["--policy", "auto", "--budget-fraction", "1.5"], "--budget-fraction 1.5 must be in (0, 1]"),
        (["--model", "pangu-ultra-moe-718b"],
         "model pangu-ultra-moe-718b needs about 11,705 GB for weights, gradients and optimizer state"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_code_2(corpus, args, message, capsys):
    assert _train(corpus, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moetrain train: error: ")
    assert message in err


def test_a_micro_batch_below_one_is_named_once(capsys):
    """Not a second time as ``parallel.micro_batch``, the copy the run spec keeps for the layout."""
    refused_within(capsys, ["train", "--micro-batch", "0"], "--micro-batch: Input should be greater than 0, got 0")


def test_a_config_files_log_dir_in_a_one_process_run_names_the_file(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("run: {log_dir: logs}\n")
    refused_within(capsys, ["train", "--config", str(config)], f"--config {config}: run.log_dir logs holds torchrun's "
                   "log and the ranks' errors, but this run is one process: drop it, or give --nproc N")
    assert not (tmp_path / "logs").exists()


@pytest.fixture
def no_process_starts(monkeypatch):
    """Any attempt to start the ranks fails the test: refusals must come before torchrun."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started")
    monkeypatch.setattr("moetrain.distributed.launch.subprocess.call", refuse)


@pytest.mark.parametrize(
    ("plan_text", "extra", "message"),
    [
        ("parallel: {cp: 2, micro_batch: 2}", ["--seq-len", "30"],
         "--seq-len 30 does not split into 2·cp = 4 context-parallel chunks"),
        ("parallel: {dp: 2, zero: 3, overlap: true, micro_batch: 2}", [],
         "ZeRO-3 does not run with the overlapped schedule yet; use zero 1 or drop --overlap"),
        ("parallel: {dp: 2, micro_batch: 2}", ["--nproc", "4"],
         "lays out 2 ranks (tp·cp·pp·dp = 1·1·1·2); give --nproc 2, or drop --nproc"),
        ("parallel: {dp: 2, micro_batch: 2}", ["--ep", "2"], "--plan already sets the layout; drop --ep"),
        ("parallel: {tp: 2, sp: false, micro_batch: 2}", [],
         "parallel.sp=False with tp=2: the runtime runs sequence parallelism exactly when tp > 1"),
    ],
)
def test_a_multi_rank_plan_is_checked_before_any_process_starts(plan_text, extra, message, tmp_path, capsys,
                                                                 no_process_starts):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_text + "\n")
    assert main(["train", "--plan", str(plan), "--steps", "2", "--global-batch", "4", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "3", "--ep", "2"], "ep·etp=2 must divide tp·cp·dp=3"),
        (["--ep", "2"], "--ep 2 needs several ranks: give --nproc N"),
        (["--nproc", "2", "--ep", "2", "--stop-at", "1"], "--stop-at needs --save-dir"),
        (["--nproc", "2", "--ep", "2", "--online-balance", "--zero", "2"],
         "--online-balance moves ZeRO-1 optimizer shards"),
        (["--nproc", "2", "--balance-interval", "3"],
         "interval (--balance-interval) tunes online balancing, which is off; add --online-balance"),
        (["--nproc", "2", "--balance-interval", "3", "--balance-horizon", "9"],
         "interval, horizon (--balance-interval, --balance-horizon) tune online balancing, which is off; add "
         "--online-balance (enabled: true) or drop them"),
        (["--nproc", "2", "--ep", "2", "--online-balance", "--balance-interval", "0"],
         "--balance-interval: Input should be greater than 0"),
    ],
)
def test_a_bad_multi_rank_run_is_one_line_before_any_process_starts(args, message, capsys, no_process_starts):
    assert main(["train", "--steps", "2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2",
                 *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("moetrain train: error: ") and message in captured.err


@pytest.mark.slow
def test_selective_recompute_gives_the_losses_of_no_recompute(corpus, tmp_path, capsys):
    for policy in ("none", "selective"):
        assert _train(corpus, "--steps", "2", "--dtype", "fp32", "--device", "cpu", "--policy", policy,
                      "--metrics-out", str(tmp_path / f"{policy}.jsonl")) == 0
    assert "memory policy selective:" in capsys.readouterr().out
    plain, recomputed = _rows(tmp_path / "none.jsonl"), _rows(tmp_path / "selective.jsonl")
    assert len(plain) == len(recomputed) == 2
    for row_plain, row_recomputed in zip(plain, recomputed):
        for key in ("loss", "lm_loss", "mtp_loss", "aux_loss", "grad_norm"):
            assert row_recomputed[key] == pytest.approx(row_plain[key], rel=1e-6, abs=0), key
        assert row_recomputed["expert_load_max_over_mean"] == pytest.approx(row_plain["expert_load_max_over_mean"],
                                                                             rel=1e-6)


@pytest.mark.slow
def test_a_routing_trace_is_read_back_by_the_balance_reader(corpus, tmp_path):
    from moetrain.balance.traces import read_trace
    from moetrain.config import load_model_config

    trace_path, metrics_path = tmp_path / "routing.jsonl", tmp_path / "metrics.jsonl"
    assert _train(corpus, "--steps", "2", "--trace-routing", str(trace_path), "--metrics-out", str(metrics_path)) == 0
    model = load_model_config("tiny-pangu")
    moe_layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    moe_layers += [model.num_layers + j for j in range(model.num_mtp_layers)]
    trace = read_trace(trace_path)
    assert len(trace_path.read_text().splitlines()) == 2 * len(moe_layers)
    assert trace.steps.tolist() == [1, 2] and trace.layers.tolist() == moe_layers
    assert trace.num_experts == model.moe.num_experts
    tokens_per_step = 4 * 32  # --global-batch 4, --seq-len 32
    assert (trace.tokens_per_expert.sum(-1) == tokens_per_step * model.moe.router.top_k).all()
    # the trace and the metrics come from the same counts: max/mean of each row is the logged load
    loads = trace.tokens_per_expert.max(-1) / trace.tokens_per_expert.mean(-1)
    logged = [row["expert_load_max_over_mean"] for row in _rows(metrics_path)]
    assert loads.flatten().tolist() == pytest.approx([load for step in logged for load in step], rel=1e-6)


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_refused_with_its_folder_named(corpus, tmp_path, capsys):
    save_dir = tmp_path / "ckpt"
    assert _train(corpus, "--save-dir", str(save_dir), "--stop-at", "1") == 0
    (save_dir / "step-000001" / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert _train(corpus, "--save-dir", str(save_dir), "--resume") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"checkpoint {save_dir / 'step-000001'} is damaged: __0_0.distcp does not match its checksum" in err


def test_output_paths_are_checked_before_any_step(corpus, tmp_path, capsys, no_process_starts, monkeypatch):
    """A path under a file, a folder given as the metrics file, or a folder that takes no new file is refused
    before training, not at the first save after every step has run."""
    monkeypatch.setattr("moetrain.train.checks._writable", lambda path: True)  # as for root: /proc "is writable"
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    cases = [
        (["--save-dir", str(afile / "sub")], "--save-dir", "a part of that path is a file, not a folder"),
        (["--metrics-out", str(tmp_path)], "--metrics-out", "is a folder; name a file"),
        (["--trace-routing", str(afile / "t.jsonl")], "--trace-routing", "a file is in the way of that folder"),
        (["--nproc", "2", "--ep", "2", "--save-dir", str(afile)], "--save-dir", "a file is in the way"),
        (["--nproc", "2", "--log-dir", str(afile / "logs")], "--log-dir",
         "a part of that path is a file, not a folder"),
        (["--metrics-out", "/proc/metrics.jsonl"], "--metrics-out", "/proc: cannot create files in it"),
    ]
    for args, flag, message in cases:
        assert _train(corpus, *args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and flag in err and message in err, err
    assert afile.read_text() == "keep me"
