"""ZeRO-2 and ZeRO-3 (FSDP2, ``moetrain.distributed.fsdp``) give the single-process losses, loss parts and
gradient norms (tiny-pangu, fp32, gloo, the real data pipeline) under data, expert, expert-tensor, tensor
(+ sequence), context and pipeline (+ interleaved) parallelism, through the loop ``moetrain train`` runs;
their checkpoints (DCP, through ``params_by_name``/``moments_by_name``) resume on the uninterrupted
curve; ZeroAdamW's one-rank path is ``torch.optim.AdamW(foreach=True)`` + ``clip_grad_norm_`` bit for bit.

As ``test_layout_parity.py``: several small layouts side by side on disjoint ranks of one 8-process
world, each process single-threaded. The gradient norm is compared too: AdamW alone hardly sees a
uniform gradient scale, so averaged instead of summed gradients would pass a loss-only check.
"""

from __future__ import annotations

import pytest
import torch
from _parity import (
    LOSS_FIELDS,
    assert_parity,
    losses_by_layout,
    run_spec,
    side_by_side,
    train_rows,
)
from torch import nn

from moetrain.balance.online import check_online_balance
from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.distributed.zero import ZeroAdamW, build_sharded_optimizer
from moetrain.errors import UserError
from moetrain.models.transformer import build_model
from moetrain.runtime_base.optim import build_optimizer

STEPS = 3
RESUME_AT = 1
"""Resumed layouts stop (saving a checkpoint) after this many steps, and a new run resumes from it: two
steps after the resume, so the last one's loss shows the moments and step count the resume restored."""
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
ROUNDS: list[dict[str, ParallelConfig]] = [
    {
        "dp2_zero2": ParallelConfig(dp=2, zero=2),
        "dp2_zero3": ParallelConfig(dp=2, zero=3),
        "dp2_ep2_zero3": ParallelConfig(dp=2, ep=2, zero=3),
        "dp2_etp2_zero2": ParallelConfig(dp=2, etp=2, zero=2),
    },
    {
        "tp2_sp_dp2_zero3": ParallelConfig(tp=2, sp=True, dp=2, zero=3),
        "pp2_dp2_zero2": ParallelConfig(pp=2, dp=2, zero=2),
    },
    {
        "pp2_vpp2_dp2_zero3": ParallelConfig(pp=2, vpp=2, dp=2, zero=3),
        "cp2_dp2_zero3": ParallelConfig(cp=2, dp=2, zero=3),
    },
]
RESUMED = {"pp2_dp2_zero2", "pp2_vpp2_dp2_zero3", "dp2_ep2_zero3"}
"""Layouts saved and resumed (the shared embedding, experts, both stages)."""


def _train(name: str, parallel: ParallelConfig, dims: ParallelDims, data, save_root) -> dict[str, list[dict]]:
    out = {name: train_rows(run_spec(TRAINING, parallel, data), dims)}
    if name in RESUMED:
        save = {"save_dir": str(save_root / name)}
        train_rows(run_spec(TRAINING, parallel, data, stop_at=RESUME_AT, **save), dims)
        out[f"{name}:resumed"] = train_rows(run_spec(TRAINING, parallel, data, resume=True, **save), dims)
    return out


def _worker(rank: int, world_size: int, data, save_root) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    for layouts in ROUNDS:
        for name, parallel, dims in side_by_side(layouts, rank):
            results.update(_train(name, parallel, dims, data, save_root))
    return results


@pytest.fixture(scope="module")
def reference(references) -> list[dict]:
    return references.rows(TRAINING)


@pytest.fixture(scope="module")
def layout_results(corpus, reference, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict]]]:
    return losses_by_layout(spawn(_worker, 8, corpus, tmp_path_factory.mktemp("zero23_ckpt")))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_zero23_matches_single_process(layout: str, layout_results: dict, reference: list[dict]) -> None:
    ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert_parity(layout, layout_results[layout], reference, ranks, fields=LOSS_FIELDS)
    assert reference[-1]["loss"] < reference[0]["loss"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", sorted(RESUMED))
def test_a_checkpoint_resumes_on_the_uninterrupted_curve(layout: str, layout_results: dict) -> None:
    for uninterrupted, resumed in zip(layout_results[layout], layout_results[f"{layout}:resumed"]):
        assert [r["step"] for r in resumed] == list(range(RESUME_AT + 1, STEPS + 1))
        for got, want in zip(resumed, uninterrupted[RESUME_AT:]):
            for key in LOSS_FIELDS:
                assert got[key] == pytest.approx(want[key], rel=1e-6), f"{layout} step {got['step']} {key}"


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.unused = nn.Linear(4, 4)  # no gradient: AdamW and the clip skip it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _one_rank_worker(rank: int, world_size: int) -> None:
    cfg = TrainingConfig(steps=5, lr=1e-2, grad_clip=0.5, weight_decay=0.1)
    dims = ParallelDims.build(ParallelConfig(), rank)
    torch.manual_seed(0)
    model = _Small()
    expected = _Small()
    expected.load_state_dict(model.state_dict())
    optimizer = ZeroAdamW(model, dims, cfg)
    assert all(b.shard is None for b in optimizer.buckets), "one-rank buckets are not flattened"
    assert {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()}, "the optimizer updates the parameters themselves"
    reference = build_optimizer(expected, cfg)
    inputs = torch.Generator().manual_seed(1)
    for step in range(cfg.steps):
        x = torch.randn(32, 8, generator=inputs)
        lr = cfg.lr * (step + 1) / cfg.steps
        optimizer.zero_grad()
        (model(x).pow(2).sum() * 10).backward()
        norm = optimizer.step(lr)
        (expected(x).pow(2).sum() * 10).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(expected.parameters(), cfg.grad_clip)
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        reference.zero_grad(set_to_none=True)
        assert torch.equal(norm, expected_norm) and float(norm) > cfg.grad_clip, "the clip bites, same norm"
        for (name, got), want in zip(model.named_parameters(), expected.parameters()):
            assert torch.equal(got, want), f"step {step}: {name} differs"
    moments, step_count = optimizer.moments_by_name()
    for (name, _), want in zip(model.named_parameters(), expected.parameters()):
        if name.startswith("unused."):
            continue
        assert torch.equal(moments[name]["exp_avg_sq"], reference.state[want]["exp_avg_sq"])
    assert float(step_count) == cfg.steps


@pytest.mark.dist
def test_one_rank_zero_adamw_is_torch_adamw_bit_for_bit() -> None:
    spawn(_one_rank_worker, 1)


def _zero_adamw_resume_worker(rank: int, world_size: int) -> None:
    """ZeroAdamW's saved state, flat shards or not, continues a fresh model exactly."""
    cfg = TrainingConfig(steps=3, lr=1e-2, grad_clip=0.5, weight_decay=0.1)
    dims = ParallelDims.build(ParallelConfig(), rank)
    inputs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(step)) for step in range(cfg.steps)]

    def train(model: _Small, optimizer: ZeroAdamW, step: int) -> None:
        optimizer.zero_grad()
        model(inputs[step]).pow(2).sum().backward()
        optimizer.step(cfg.lr)

    for keep_flat in (False, True):
        torch.manual_seed(0)
        model, fresh = _Small(), _Small()
        optimizer = ZeroAdamW(model, dims, cfg, keep_flat=keep_flat)
        for step in range(cfg.steps - 1):
            train(model, optimizer, step)
        params, (moments, step_count) = optimizer.params_by_name(), optimizer.moments_by_name()
        resumed = ZeroAdamW(fresh, dims, cfg, keep_flat=keep_flat)
        resumed.load_params(params)
        resumed.load_moments(moments, float(step_count))
        train(model, optimizer, cfg.steps - 1)
        train(fresh, resumed, cfg.steps - 1)
        for (name, want), got in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(got, want), f"keep_flat={keep_flat}: {name} differs after the resumed step"


@pytest.mark.dist
def test_zero_adamw_saved_state_resumes_exactly() -> None:
    spawn(_zero_adamw_resume_worker, 1)


def test_refused_combinations() -> None:
    cfg = TrainingConfig(steps=1)
    model_cfg = load_model_config("tiny-pangu")
    overlap = ParallelDims(ParallelConfig(dp=2, zero=2, overlap=True), rank=0)
    with pytest.raises(UserError, match="--overlap"):
        build_sharded_optimizer(build_model(model_cfg, "meta"), overlap, cfg)
    tied = build_model(model_cfg.model_copy(update={"tie_embeddings": True}), "meta")
    with pytest.raises(UserError, match="tied embeddings"):
        build_sharded_optimizer(tied, ParallelDims(ParallelConfig(dp=2, zero=3), rank=0), cfg)
    with pytest.raises(UserError, match="zero 1"):
        check_online_balance(ParallelConfig(dp=2, ep=2, zero=2), model_cfg)
