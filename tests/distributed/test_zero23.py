"""ZeRO-2 and ZeRO-3 (FSDP2, ``moetrain.distributed.fsdp``) give the single-process losses and gradient
norms (tiny-pangu, fp32, gloo), under data, expert, expert-tensor, tensor (+ sequence), context and
pipeline (+ interleaved) parallelism; their checkpoint state round-trips; ZeroAdamW's one-rank path
is ``torch.optim.AdamW(foreach=True)`` + ``clip_grad_norm_`` bit for bit.

As ``test_layout_parity.py``: several small layouts side by side on disjoint ranks of one 8-process
world, each process single-threaded. Each layout's run is built by ``_build_run`` and stepped by
``_train_step`` (the runtime's step function), so switching to another step function is one place.
"""

from __future__ import annotations

import pytest
import torch
from _parity import assert_parity, losses_by_layout, single_thread_reference
from torch import nn

from moetrain.balance.online import check_online_balance
from moetrain.config import ModelConfig, ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import parallelize
from moetrain.distributed.pipeline import Executor
from moetrain.distributed.step import LayoutRun, train_step
from moetrain.distributed.world import spawn
from moetrain.distributed.zero import ZeroAdamW, build_sharded_optimizer
from moetrain.errors import UserError
from moetrain.models.transformer import build_model
from moetrain.train.optim import build_optimizer

STEPS = 6
RESUME_AT = 3
"""Resumed layouts save after this many steps and a fresh run continues from the saved state."""
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
"""Layouts whose state is saved and loaded into a fresh run (the shared embedding, experts, both stages)."""
CPU = torch.device("cpu")


class _NormRecorder:
    """The layout's optimizer, keeping the gradient norm each step returns."""

    def __init__(self, inner: object) -> None:
        self.inner, self.norms = inner, []

    def step(self, lr: float, norm_sq_correction: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.inner.step(lr, norm_sq_correction)
        self.norms.append(float(norm))
        return norm

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _build_run(dims: ParallelDims, model_cfg: ModelConfig, cfg: TrainingConfig) -> LayoutRun:
    stage = parallelize(build_model(model_cfg, CPU, backend="eager", seed=cfg.seed), dims)
    optimizer = build_sharded_optimizer(stage.model, dims, cfg, stage.tp_kinds)
    return LayoutRun(stage, _NormRecorder(optimizer), Executor(stage))  # type: ignore[arg-type]


def _train_step(run: LayoutRun, step: int, cfg: TrainingConfig) -> float:
    return train_step(run, step, cfg, CPU)


def _train(name: str, dims: ParallelDims, model_cfg: ModelConfig) -> dict[str, list[float]]:
    """The layout's losses and norms; for a resumed layout also the loss of a fresh run loaded with the
    state saved after ``RESUME_AT`` steps, at its next step."""
    run = _build_run(dims, model_cfg, TRAINING)
    out: dict[str, list[float]] = {name: []}
    for step in range(STEPS):
        if name in RESUMED and step == RESUME_AT:
            saved = run.optimizer.params_by_name(), *run.optimizer.moments_by_name()
        out[name].append(_train_step(run, step, TRAINING))
    out[f"{name}:norm"] = run.optimizer.norms
    if name in RESUMED:
        fresh = _build_run(dims, model_cfg, TRAINING)
        params, moments, step_count = saved
        fresh.optimizer.load_params(params)
        fresh.optimizer.load_moments(moments, float(step_count))
        out[f"{name}:resumed"] = [_train_step(fresh, RESUME_AT, TRAINING)]
    return out


def _worker(rank: int, world_size: int) -> dict[str, list[float]]:
    model_cfg = load_model_config("tiny-pangu")
    results: dict[str, list[float]] = {}
    for layouts in ROUNDS:
        offset, members = 0, []
        for name, parallel in layouts.items():
            members.append((name, ParallelDims.build(parallel, rank, rank_offset=offset)))
            offset += parallel.world_size
        for name, dims in members:
            if dims.is_member:
                results.update(_train(name, dims, model_cfg))
    return results


@pytest.fixture(scope="module")
def layout_results() -> dict[str, list[list[float]]]:
    return losses_by_layout(spawn(_worker, 8))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[float]]:
    """Single-process losses and pre-clip gradient norms (``clip_grad_norm_``'s return, recorded)."""
    norms: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(*args, **kwargs) -> torch.Tensor:
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
        losses = single_thread_reference(load_model_config("tiny-pangu"), TRAINING, STEPS)
    return losses, norms


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", [name for layouts in ROUNDS for name in layouts])
def test_zero23_matches_single_process(layout: str, layout_results: dict, reference: tuple) -> None:
    losses, norms = reference
    ranks = next(p.world_size for layouts in ROUNDS for n, p in layouts.items() if n == layout)
    assert_parity(layout, layout_results[layout], losses, ranks)
    # The norm would show gradients averaged instead of summed, or an element counted twice (AdamW
    # alone hardly sees a uniform gradient scale).
    assert_parity(f"{layout} grad norm", layout_results[f"{layout}:norm"], norms, ranks)
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", sorted(RESUMED))
def test_saved_state_resumes_exactly(layout: str, layout_results: dict) -> None:
    for uninterrupted, resumed in zip(layout_results[layout], layout_results[f"{layout}:resumed"]):
        assert resumed == [uninterrupted[RESUME_AT]], f"{layout}: resumed {resumed} vs {uninterrupted[RESUME_AT]}"


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
