"""ZeroAdamW's one-rank path is ``torch.optim.AdamW(foreach=True)`` + ``clip_grad_norm_`` bit for bit,
and its saved state continues a fresh model exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config import ParallelConfig, TrainingConfig
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.world import spawn
from moetrain.distributed.zero import ZeroAdamW
from moetrain.train.optim import build_optimizer


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
