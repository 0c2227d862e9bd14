import pytest
import torch

from moetrain.errors import UserError
from moetrain.train.checkpoint import (
    COMPLETE_MARKER,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model.register_buffer("score_bias", torch.randn(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_model_optimizer_buffers_rng_and_trainer_state(tmp_path):
    model, optimizer = _model_and_optimizer(seed=0)
    torch.manual_seed(42)
    path = save_checkpoint(tmp_path, 7, model, optimizer, {"step": 7, "note": "x"}, "hash-a")
    assert path == checkpoint_dir(tmp_path, 7) and (path / COMPLETE_MARKER).is_file()
    expected_draw = torch.rand(3)

    other, other_optimizer = _model_and_optimizer(seed=1)
    state = load_checkpoint(latest_checkpoint(tmp_path), other, other_optimizer, "hash-a")
    assert state == {"step": 7, "note": "x"}
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg_sq"], loaded[k]["exp_avg_sq"]) for k in saved)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run was


def test_latest_skips_unfinished_saves_and_removes_them(tmp_path):
    model, optimizer = _model_and_optimizer(seed=0)
    save_checkpoint(tmp_path, 2, model, optimizer, {"step": 2}, "h")
    save_checkpoint(tmp_path, 4, model, optimizer, {"step": 4}, "h")
    crashed = tmp_path / "step-000006.tmp"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)
    assert not crashed.exists()
    assert latest_checkpoint(tmp_path / "absent") is None


def test_corrupt_checkpoints_are_one_line_user_errors(tmp_path):
    model, optimizer = _model_and_optimizer(seed=0)
    path = save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3}, "h")
    with pytest.raises(UserError, match="another model, data or training config"):
        load_checkpoint(path, model, optimizer, "other-hash")
    (path / "__0_0.distcp").write_bytes(b"garbage")
    with pytest.raises(UserError) as err:
        load_checkpoint(path, model, optimizer, "h")
    assert str(err.value) == (f"checkpoint {path} is damaged: __0_0.distcp does not match its checksum; "
                              "remove that folder to resume from an older one")
    assert "\n" not in str(err.value)
    (path / COMPLETE_MARKER).unlink()
    with pytest.raises(UserError, match=r"step-000003 is incomplete or corrupt \(no COMPLETE marker\)"):
        latest_checkpoint(tmp_path)
