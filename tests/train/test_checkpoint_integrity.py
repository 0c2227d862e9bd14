"""Sealed checkpoints through the CLI: a flipped byte in any file is named on --resume, before anything is
loaded; an old marker still loads; the checkpoint library's failures are one line; resume says what changed."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch

from moetrain.cli import main
from moetrain.runtime_base.checkpoint_files import COMPLETE_MARKER, checkpoint_dir
from refusals import refused, snapshot

WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind", "suffer"]
FLIPS_PER_FILE = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("texts") / "play.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(1500)))
    return path


@pytest.fixture(autouse=True)
def _cache_and_threads(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _train(corpus: Path, save_dir: Path, *extra: str, steps: int = 2) -> list[str]:
    return ["train", "--data", str(corpus), "--steps", str(steps), "--global-batch", "4", "--micro-batch", "2",
            "--seq-len", "32", "--threads", "1", "--quiet", "--save-dir", str(save_dir), *extra]


def _unwrapped(text: str) -> str:
    """The console wraps long lines (and paths) at its width: compare without any white space."""
    return "".join(text.split())


@pytest.fixture(scope="module")
def saved(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A save dir with the checkpoint of a 2-step run, made once for the module (copy it before changing it)."""
    save_dir = tmp_path_factory.mktemp("saved") / "ckpt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "moetrain-cache"))
        assert main(_train(corpus, save_dir)) == 0
    return save_dir


def test_a_flipped_byte_in_any_file_is_named_on_resume(saved: Path, corpus: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved, save_dir)
    folder = checkpoint_dir(save_dir, 2)
    original = snapshot(save_dir)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", COMPLETE_MARKER, "__0_0.distcp"]
    rng = random.Random(0)
    for name in names:
        path = folder / name
        for _ in range(FLIPS_PER_FILE):
            data = bytearray(path.read_bytes())
            at = rng.randrange(len(data))
            data[at] ^= rng.randrange(1, 256)
            path.write_bytes(bytes(data))
            error = refused(capsys, _train(corpus, save_dir, "--resume"), f"checkpoint {folder} is damaged: ",
                            "; remove that folder to resume from an older one")
            assert name in error, (name, at, error)
            assert snapshot(save_dir) == {**original, f"step-000002/{name}": bytes(data)}  # nothing else touched
            path.write_bytes(original[f"step-000002/{name}"])
    (folder / "__0_0.distcp").unlink()
    refused(capsys, _train(corpus, save_dir, "--resume"),
            f"checkpoint {folder} is damaged: __0_0.distcp is missing; remove that folder to resume from an older one")


def test_old_markers_load_and_the_library_failures_are_one_line(saved: Path, corpus: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(saved, save_dir)
    folder = checkpoint_dir(save_dir, 2)
    marker = folder / COMPLETE_MARKER
    sealed = json.loads(marker.read_text())
    marker.write_text(json.dumps({"step": 2, "config_hash": sealed["config_hash"]}))  # as written before checksums
    assert main(_train(corpus, save_dir, "--resume", "--stop-at", "2")) == 0
    out, err = capsys.readouterr()
    assert _unwrapped(f"resumed from {folder} (step 2)") in _unwrapped(out) and err == ""
    metadata = folder / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[100] ^= 0xFF  # unseen by a checksum now: DCP itself fails, and logged two tracebacks before
    metadata.write_bytes(bytes(data))
    with caplog.at_level(logging.DEBUG):
        refused(capsys, _train(corpus, save_dir, "--resume"),
                f"checkpoint {folder} is unreadable (its .metadata file cannot be read); remove that folder to resume "
                "from an older one")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert marker.exists() and metadata.read_bytes() == bytes(data)


def test_resume_continues_after_a_micro_batch_change_and_names_what_else_changed(
        corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_dir, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    assert main(_train(corpus, save_dir, "--stop-at", "2", "--metrics-out", str(metrics), steps=4)) == 0
    marker = json.loads((checkpoint_dir(save_dir, 2) / COMPLETE_MARKER).read_text())
    assert marker["identity"]["training"]["micro_batch"] == 2 and marker["config_hash"] == marker["identity"]["hash"]
    before = snapshot(save_dir)
    refused(capsys, _train(corpus, save_dir, "--resume", steps=6),
            f"checkpoint {checkpoint_dir(save_dir, 2)} was written with other settings: steps 4 → 6 (the learning-rate "
            "schedule of the steps still to run would change); resume with the saved values, or start a new run "
            "with another --save-dir")
    refused(capsys, _train(corpus, save_dir, "--resume", "--seed", "7", "--lr", "0.01", steps=4),
            "lr 0.003 → 0.01 (the learning-rate schedule of the steps still to run would change), "
            "seed 1234 → 7 (the order of the data still to come would change)")
    assert snapshot(save_dir) == before
    capsys.readouterr()
    assert main(_train(corpus, save_dir, "--resume", "--micro-batch", "1", "--metrics-out", str(metrics),
                       steps=4)) == 0
    assert _unwrapped(f"resumed from {checkpoint_dir(save_dir, 2)} (step 2)") in _unwrapped(capsys.readouterr().out)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
