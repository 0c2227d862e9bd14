import io
import json
import random

import pytest
import torch
from rich.console import Console

from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.config.run import RunSpec
from moetrain.errors import UserError
from moetrain.train import SuppliedParts, Trainer

WORDS = ["the", "king", "and", "queen", "of", "denmark", "speak", "love", "death", "honour", "night",
         "crown", "ghost", "sword", "my", "lord", "good", "sir", "what", "say", "you", "now", "mark", "me"]
LOSS_FIELDS = ("loss", "lm_loss", "mtp_loss", "aux_loss", "lr", "grad_norm", "expert_load_max_over_mean")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small JSONL corpus of word-salad documents of varied length (so packing crosses boundaries)."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "."} for _ in range(120)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture(autouse=True)
def _cache_and_one_thread(tmp_path_factory, monkeypatch):
    """A private cache; one torch thread, because a busy 2-core CI machine makes 2 threads crawl."""
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(corpus: str, micro_batch: int = 2, model_cfg: ModelConfig | None = None, steps: int = 6,
             **run) -> Trainer:
    cfg = TrainingConfig(steps=steps, global_batch=4, micro_batch=micro_batch, seq_len=32, lr=3e-3, warmup_steps=2)
    run = {key: str(value) if value is not None and key in ("save_dir", "metrics_out", "trace_routing") else value
           for key, value in run.items()}
    spec = RunSpec(training=cfg, run={"device": "cpu", "cluster": "cpu", "data": corpus, "quiet": True, **run})
    return Trainer(spec, SuppliedParts(model_cfg=model_cfg, console=Console(file=io.StringIO())))


@pytest.mark.slow
def test_resume_replays_the_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    straight = _trainer(corpus, metrics_out=tmp_path / "straight.jsonl").train()
    save = {"save_dir": tmp_path / "ckpt", "metrics_out": tmp_path / "resumed.jsonl"}
    first = _trainer(corpus, stop_at=3, **save).train()
    second = _trainer(corpus, resume=True, **save).train()
    assert [r["step"] for r in first] == [1, 2, 3] and [r["step"] for r in second] == [4, 5, 6]
    for expected, got in zip(straight, first + second, strict=True):
        assert {k: got[k] for k in LOSS_FIELDS} == {k: expected[k] for k in LOSS_FIELDS}
    # the resumed run appended to the interrupted run's metrics file: one curve of six rows
    rows = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000003", "step-000006"]


@pytest.mark.slow
def test_gradient_accumulation_trains_on_the_same_math(corpus):
    """One micro-batch of 4 or two of 2: token losses are normalised by the global label count either
    way. Router balance losses are per-micro-batch statistics, so they are switched off here."""
    preset = load_model_config("tiny-pangu")
    router = preset.moe.router.model_copy(update={"device_balance_coef": 0.0, "z_loss_coef": 0.0})
    model_cfg = preset.model_copy(update={"moe": preset.moe.model_copy(update={"router": router})})
    rows_whole = _trainer(corpus, micro_batch=4, model_cfg=model_cfg).train()
    rows_split = _trainer(corpus, micro_batch=2, model_cfg=model_cfg).train()
    for a, b in zip(rows_whole, rows_split, strict=True):
        assert a["aux_loss"] == b["aux_loss"] == 0.0
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_metrics_rows_carry_the_documented_fields(corpus):
    trainer = _trainer(corpus, steps=2)
    row = trainer.train()[-1]
    num_moe_rows = 6 + 1  # 6 MoE decoder layers + the MTP module's MoE layer
    assert len(row["expert_load_max_over_mean"]) == num_moe_rows
    assert all(1.0 <= v <= 16 / 4 for v in row["expert_load_max_over_mean"])
    assert row["tokens"] == 4 * 32 and row["tokens_per_s"] == pytest.approx(row["tokens"] / row["step_time_s"])
    expected_mfu = row["tokens_per_s"] * trainer.flops_per_token / 0.1e12
    assert row["mfu"] == pytest.approx(expected_mfu)
    assert row["layout"]["dp"] == 1 and row["layout"]["global_batch"] == 4
    assert row["loss"] == pytest.approx(row["lm_loss"] + 0.3 * row["mtp_loss"] + row["aux_loss"], rel=1e-5)


def test_multi_rank_layout_is_refused_in_one_process(corpus):
    cfg = TrainingConfig(steps=2, global_batch=4, micro_batch=2, seq_len=32)
    spec = RunSpec(training=cfg, parallel=ParallelConfig(dp=2, tp=2), run={"data": corpus, "device": "cpu"})
    with pytest.raises(UserError, match="the layout needs 4 ranks"):
        Trainer(spec)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the one-rank group it made is gone


@pytest.mark.slow
def test_routing_trace_rides_in_the_steps_single_read_and_leaves_the_metrics_unchanged(corpus, tmp_path, monkeypatch):
    reads = {"count": 0}
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            reads["count"] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    runs = {}
    for trace in (None, tmp_path / "routing.jsonl"):
        reads["count"] = 0
        rows = _trainer(corpus, steps=2, trace_routing=trace).train()
        runs[trace is not None] = (rows, reads["count"])
    (plain_rows, plain_reads), (traced_rows, traced_reads) = runs[False], runs[True]
    assert traced_reads == plain_reads  # no host read added for the trace
    for plain, traced in zip(plain_rows, traced_rows, strict=True):
        assert {k: traced[k] for k in LOSS_FIELDS} == {k: plain[k] for k in LOSS_FIELDS}
        assert "tokens_per_expert" not in traced
    trace_rows = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    model = load_model_config("tiny-pangu")
    num_moe_blocks = sum(model.is_moe_layer(i) for i in range(model.num_layers)) + model.num_mtp_layers
    assert [(r["step"], r["layer"]) for r in trace_rows][:num_moe_blocks + 1] == [
        *[(1, layer) for layer in range(model.num_layers) if model.is_moe_layer(layer)],
        *[(1, model.num_layers + j) for j in range(model.num_mtp_layers)], (2, trace_rows[0]["layer"])]
    assert len(trace_rows) == 2 * num_moe_blocks


def test_routing_trace_of_a_dense_model_is_refused(corpus, tmp_path):
    dense = load_model_config("tiny-pangu").model_copy(update={"moe": None})
    with pytest.raises(UserError, match="--trace-routing needs an MoE model"):
        _trainer(corpus, model_cfg=dense, trace_routing=tmp_path / "t.jsonl")
