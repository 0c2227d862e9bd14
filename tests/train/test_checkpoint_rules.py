"""The checkpoint module's rules without a training run: sealing, verifying, run identity, when to save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.config import TrainingConfig, load_model_config
from moetrain.errors import UserError
from moetrain.runtime_base.checkpoint_files import (
    COMPLETE_MARKER,
    RESUMABLE_CHANGES,
    check_resumable,
    read_marker,
    run_identity,
    seal_checkpoint,
    should_save,
    verify_checkpoint,
)

MODEL = load_model_config("tiny-pangu")
TRAINING = TrainingConfig(steps=4, global_batch=4, micro_batch=2, seq_len=32)


def _identity(**changes: object) -> dict:
    return run_identity(MODEL, TRAINING.model_copy(update=changes), "corpus-a")


def test_seal_writes_checksums_and_verify_names_the_first_bad_file(tmp_path: Path) -> None:
    staging, final = tmp_path / "step-000003.tmp", tmp_path / "step-000003"
    (staging / "sub").mkdir(parents=True)
    (staging / "a.bin").write_bytes(b"a" * 10)
    (staging / "sub" / "b.bin").write_bytes(b"b" * 10)
    final.mkdir()
    (final / "stale").write_text("an older save of the same step")
    assert seal_checkpoint(staging, final, {"step": 3, "config_hash": "h"}) == final
    assert not staging.exists() and not (final / "stale").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        final.name]
    marker = verify_checkpoint(final)
    assert marker["step"] == 3 and sorted(marker["files"]) == ["a.bin", "sub/b.bin"]
    assert read_marker(final)["config_hash"] == "h"
    (final / "sub" / "b.bin").write_bytes(b"b" * 9 + b"c")
    with pytest.raises(UserError, match=rf"^checkpoint {final} is damaged: sub/b.bin does not match its checksum; "
                                        "remove that folder to resume from an older one$"):
        verify_checkpoint(final)
    (final / "a.bin").unlink()
    with pytest.raises(UserError, match="damaged: a.bin is missing"):
        verify_checkpoint(final)


def test_a_marker_with_spaces_added_or_a_key_renamed_is_damaged(tmp_path: Path) -> None:
    staging, final = tmp_path / "s.tmp", tmp_path / "s"
    staging.mkdir()
    seal_checkpoint(staging, final, {"step": 1, "config_hash": "h"})
    marker = final / COMPLETE_MARKER
    text = marker.read_text()
    for damaged in (text.replace(",", ", ", 1), text.replace('"files"', '"filez"'),
                    text.replace('"marker_sha256"', '"marker_sha257"'), text.replace('"step":1', '"step":2')):
        marker.write_text(damaged)
        with pytest.raises(UserError, match="damaged: COMPLETE does not match its checksum"):
            verify_checkpoint(final)
    marker.write_text(json.dumps({"step": 1, "config_hash": "h"}))  # written before checksums: loads, unverified
    assert verify_checkpoint(final) == {"step": 1, "config_hash": "h"}


def test_identity_hash_is_the_hash_older_checkpoints_carry() -> None:
    """Markers written before the identity hold only this hash: sha256 of model JSON | training JSON | corpus."""
    import hashlib

    key = "|".join([MODEL.model_dump_json(), TRAINING.model_dump_json(), "corpus-a"])
    assert _identity()["hash"] == hashlib.sha256(key.encode()).hexdigest()[:16]


def test_resume_rules_field_by_field() -> None:
    saved = {"step": 2, "config_hash": _identity()["hash"], "identity": _identity()}
    check_resumable(saved, _identity(micro_batch=1, dtype="bf16"))
    check_resumable(saved, run_identity(MODEL.model_copy(update={"name": "copy"}), TRAINING, "corpus-a"))
    assert set(RESUMABLE_CHANGES) == {"model.name", "training.micro_batch", "training.dtype"}
    refusals = {
        "steps": "steps 4 → 8 (the learning-rate schedule of the steps still to run would change)",
        "warmup_steps": "warmup_steps 20 → 8 (the learning-rate schedule",
        "global_batch": "global_batch 4 → 8 (each step would train on other sequences)",
        "seed": "seed 1234 → 8 (the order of the data still to come would change)",
        "grad_clip": "grad_clip 1.0 → 8.0 (the optimizer's update rule would change)",
    }
    for field, message in refusals.items():
        with pytest.raises(UserError, match="^the checkpoint was written with other settings: ") as err:
            check_resumable(saved, _identity(**{field: 8}))
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match=r'corpus_hash "corpus-a" → "corpus-b" \(the training text differs\)'):
        check_resumable(saved, run_identity(MODEL, TRAINING, "corpus-b"))
    other_model = MODEL.model_copy(update={"hidden_size": 256, "num_layers": 4, "vocab_size": 4096,
                                           "num_dense_layers": 1, "rope_theta": 1e6})
    with pytest.raises(UserError, match=r"model.hidden_size 128 → 256 \(the model would change\).*, and 1 more;"):
        check_resumable(saved, run_identity(other_model, TRAINING, "corpus-a"))


def test_markers_without_an_identity_compare_the_hash() -> None:
    check_resumable({"step": 2, "config_hash": _identity()["hash"]}, _identity())
    check_resumable({"step": 2, "config_hash": "abc"}, {"hash": "abc"})  # a caller with the hash only
    expected = (r"^the checkpoint was written by a run with another model, data or training config \(hash abc ≠ "
                r"[0-9a-f]{16}\); resume with the same flags or another --save-dir$")
    with pytest.raises(UserError, match=expected):
        check_resumable({"step": 2, "config_hash": "abc"}, _identity())


def test_should_save_at_the_last_step_and_every_k() -> None:
    assert [s for s in range(1, 11) if should_save(s, 10, 0)] == [10]
    assert [s for s in range(1, 11) if should_save(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 8) if should_save(s, 7, 1)] == list(range(1, 8))
