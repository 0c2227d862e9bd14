"""The checkpoints of the one loop (``moetrain.distributed.checkpoint``) in one process: a round trip
restores weights, router buffers and AdamW moments; unfinished saves are skipped; damage is one line."""

import pytest
import torch

from moetrain.config import ParallelConfig, TrainingConfig, load_model_config
from moetrain.distributed.checkpoint import load_checkpoint, save_checkpoint
from moetrain.distributed.layout import ParallelDims
from moetrain.distributed.parallelize import model_moe_blocks
from moetrain.distributed.step import build_layout
from moetrain.distributed.world import join_world
from moetrain.errors import UserError
from moetrain.hf.converted_checkpoint import newest_step_folder
from moetrain.runtime_base.checkpoint_files import COMPLETE_MARKER, checkpoint_dir, latest_checkpoint, run_identity

MODEL = load_model_config("tiny-pangu")
CPU = torch.device("cpu")


@pytest.fixture
def world():
    with join_world(CPU) as rank:
        yield ParallelDims.build(ParallelConfig(), rank)


def _run(dims, seed: int):
    cfg = TrainingConfig(seed=seed)
    run = build_layout(dims, MODEL, cfg, CPU)
    for p in run.stage.model.parameters():  # a step's worth of optimizer state
        p.grad = torch.randn_like(p) * 1e-3
    run.optimizer.step(1e-3)
    for block in model_moe_blocks(run.stage.model):
        block.router.score_bias.add_(torch.randn_like(block.router.score_bias))
    return run, cfg


def test_round_trip_restores_weights_buffers_and_moments(tmp_path, world):
    run, cfg = _run(world, seed=0)
    identity = run_identity(MODEL, cfg, "corpus")
    path = save_checkpoint(tmp_path, 7, run, identity=identity)
    assert path == checkpoint_dir(tmp_path, 7) and (path / COMPLETE_MARKER).is_file()
    other, _ = _run(world, seed=1)
    assert load_checkpoint(latest_checkpoint(tmp_path), other, MODEL, identity=identity) == 7
    for (name, a), b in zip(run.stage.model.state_dict().items(), other.stage.model.state_dict().values()):
        assert torch.equal(a, b), name
    saved, loaded = run.optimizer.moments_by_name()[0], other.optimizer.moments_by_name()[0]
    assert all(torch.equal(saved[k]["exp_avg_sq"], loaded[k]["exp_avg_sq"]) for k in saved)


def test_latest_skips_unfinished_saves_and_removes_them(tmp_path, world):
    run, cfg = _run(world, seed=0)
    save_checkpoint(tmp_path, 2, run, identity="h")
    save_checkpoint(tmp_path, 4, run, identity="h")
    crashed = tmp_path / "step-000006.tmp"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    # a reader (convert --to-hf, rl --from) may look while the run writes step 6: it leaves the folder be
    assert newest_step_folder(tmp_path) == checkpoint_dir(tmp_path, 4)
    assert (crashed / "__0_0.distcp").read_bytes() == b"partial"
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)  # the run itself clears it
    assert not crashed.exists()
    assert latest_checkpoint(tmp_path / "absent") is None


def test_damaged_checkpoints_are_one_line_user_errors(tmp_path, world):
    run, cfg = _run(world, seed=0)
    path = save_checkpoint(tmp_path, 3, run, identity="h")
    with pytest.raises(UserError, match="another model, data or training config"):
        load_checkpoint(path, run, MODEL, identity="other-hash")
    (path / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(UserError) as err:
        load_checkpoint(path, run, MODEL, identity="h")
    assert str(err.value) == (f"checkpoint {path} is damaged: __0_0.distcp does not match its checksum; "
                              "remove that folder to resume from an older one")
    (path / COMPLETE_MARKER).unlink()
    with pytest.raises(UserError, match=r"step-000003 is incomplete or corrupt \(no COMPLETE marker\)"):
        latest_checkpoint(tmp_path)
