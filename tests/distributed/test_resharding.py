"""DCP checkpoints reshard: saved under one layout (or by the single-process trainer), loaded under
another, the run continues with the losses of the uninterrupted single-process run; a checkpoint
written by the parallel layout loads in the single-process trainer with the reference's exact
weights and AdamW moments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _parity import single_thread_reference

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.checkpoint import load_checkpoint, save_checkpoint
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.step import build_layout, train_step
from moetrain.distributed.world import spawn
from moetrain.models.transformer import build_model
from moetrain.train import checkpoint as single
from moetrain.train.optim import build_optimizer

STEPS, SAVED_AT = 6, 3
TRAINING = TrainingConfig(steps=STEPS, global_batch=8, micro_batch=2, seq_len=32, warmup_steps=2)
SAVE_LAYOUT = ParallelConfig(tp=2, sp=True, dp=2, ep=2)
LOAD_LAYOUTS = {
    "pp2_ep2_overlap": ParallelConfig(pp=2, dp=2, ep=2, overlap=True),
    "ep4_from_single_process": ParallelConfig(dp=4, ep=4),
}


def _worker(rank: int, world_size: int, root: str) -> dict[str, list[float]]:
    model_cfg = load_model_config("tiny-pangu")
    cpu = torch.device("cpu")
    dims = {name: ParallelDims.build(parallel, rank) for name, parallel in
            [("save", SAVE_LAYOUT), *LOAD_LAYOUTS.items()]}
    run = build_layout(dims["save"], model_cfg, TRAINING, cpu)
    losses = {"tp2_ep2_save": [train_step(run, step, TRAINING, cpu) for step in range(SAVED_AT)]}
    save_checkpoint(Path(root, "parallel"), SAVED_AT, run, model_cfg, TRAINING, config_hash="test")
    for name in LOAD_LAYOUTS:
        source = "single" if name.endswith("single_process") else "parallel"
        run = build_layout(dims[name], model_cfg, TRAINING, cpu)
        start = load_checkpoint(single.checkpoint_dir(Path(root, source), SAVED_AT), run, model_cfg)
        losses[name] = [train_step(run, step, TRAINING, cpu) for step in range(start, STEPS)]
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("checkpoints")
    saved: dict = {}

    def after_step(done: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if done == SAVED_AT:  # the single-process trainer's own checkpoint format
            single.save_checkpoint(root / "single", done, model, optimizer, {"step": done}, "test")
            saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            saved["optim"] = {name: {k: v.clone() for k, v in optimizer.state[p].items()}
                              for name, p in model.named_parameters()}

    reference = single_thread_reference(load_model_config("tiny-pangu"), TRAINING, STEPS, after_step=after_step)
    return {"reference": reference, "saved": saved, "root": root, "ranks": spawn(_worker, 4, str(root))}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("layout", LOAD_LAYOUTS)
def test_resumed_layout_continues_the_reference(runs: dict, layout: str) -> None:
    reference = runs["reference"]
    for rank_losses in runs["ranks"]:
        got = rank_losses["tp2_ep2_save"] + rank_losses[layout]
        assert len(got) == STEPS
        for step, (a, b) in enumerate(zip(got, reference)):
            assert abs(a - b) <= 1e-4 * abs(b), f"{layout} step {step}: {a} vs {b}"


@pytest.mark.slow
@pytest.mark.dist
def test_parallel_checkpoint_loads_in_the_single_process_trainer(runs: dict) -> None:
    cfg = load_model_config("tiny-pangu")
    model = build_model(cfg, "cpu", seed=999)  # other weights: all must come from the checkpoint
    optimizer = build_optimizer(model, TRAINING)
    path = single.latest_checkpoint(runs["root"] / "parallel")
    assert path is not None and path.name == f"step-{SAVED_AT:06d}"
    state = single.load_checkpoint(path, model, optimizer, "test")
    assert state["step"] == SAVED_AT
    saved = runs["saved"]
    for name, value in model.state_dict().items():
        _assert_near(value, saved["model"][name], name)
    for name, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_near(optimizer.state[param][key], saved["optim"][name][key], f"{name} {key}")
        assert float(optimizer.state[param]["step"]) == SAVED_AT


def _assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to fp32 reduction order (the layouts sum gradients in another order): relative
    distance under 1e-3, where a missing or misplaced value gives about 1."""
    assert got.shape == want.shape, what
    distance = float((got - want).norm() / want.norm().clamp(min=1e-30))
    assert distance < 1e-3, f"{what}: relative distance {distance:.2e}"
