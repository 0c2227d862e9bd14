"""``moetrain convert``'s bad input: an output that is a file or already holds a model, a damaged
safetensors file, a config.json that is no JSON object. One line, exit code 2, before any model is built,
and the user's files as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.config import load_model_config
from moetrain.hf.converted_checkpoint import write_converted_checkpoint
from moetrain.hf.save import save_pretrained
from moetrain.models.transformer import build_model
from refusals import refused, snapshot

ERROR = "moetrain convert: error: "


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Hugging Face folder, a converted checkpoint) of tiny-qwen3: both directions' inputs."""
    cfg = load_model_config("tiny-qwen3")
    model = build_model(cfg, "cpu", seed=1)
    root = tmp_path_factory.mktemp("convert")
    hf = save_pretrained(model, root / "hf")
    write_converted_checkpoint(model, cfg, root / "ckpt")
    return hf, root / "ckpt"


def _refused_whole(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert refused(capsys, ["convert", *argv]) == ERROR + message


def test_an_output_that_is_a_file_is_refused_and_kept(folders, tmp_path, capsys) -> None:
    hf, ckpt = folders
    file = tmp_path / "notes.txt"
    file.write_text("kept")
    _refused_whole(capsys, ["--to-hf", str(ckpt), "--out", str(file)],
                   f"--out {file} is a file, not a folder; name a new folder to write into")
    _refused_whole(capsys, ["--from-hf", str(hf), "--to", str(file)],
                   f"--to {file} is a file, not a folder; name a new folder to write into")
    _refused_whole(capsys, ["--from-hf", str(hf), "--to", str(file / "ckpt")],
                   f"--to {file / 'ckpt'}: {file} is a file, not a folder; choose another path")
    assert file.read_text() == "kept"


def test_an_output_folder_that_holds_a_model_is_refused_and_kept(folders, tmp_path, capsys) -> None:
    hf, ckpt = folders
    before = snapshot(hf), snapshot(ckpt)
    _refused_whole(capsys, ["--to-hf", str(ckpt), "--out", str(hf)],
                   f"--out {hf} already holds a Hugging Face model (config.json, model.safetensors); export into "
                   "a new or empty folder, or delete those files first")
    _refused_whole(capsys, ["--from-hf", str(hf), "--to", str(ckpt)],
                   f"--to {ckpt} already holds model.yaml, step-000000; convert into a new or empty folder")
    assert (snapshot(hf), snapshot(ckpt)) == before


def test_the_help_says_an_output_holding_a_model_is_refused(capsys) -> None:
    from moetrain.cli import build_parser

    text = " ".join(build_parser().commands["convert"].format_help().split())
    assert "one that holds checkpoints or a model.yaml is refused, never overwritten" in text
    assert "one that holds config.json or safetensors is refused, never overwritten" in text


def _hf_copy(hf: Path, folder: Path) -> Path:
    folder.mkdir()
    for file in hf.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda data: b"junk\n", "Error while deserializing header: header too small"),
    (lambda data: data[: len(data) // 2], "Error while deserializing header: incomplete metadata, file not fully "
     "covered"),
])
def test_a_damaged_safetensors_file_is_one_line(folders, tmp_path, capsys, damage, reason) -> None:
    hf, _ = folders
    broken = _hf_copy(hf, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    _refused_whole(capsys, ["--from-hf", str(broken), "--to", str(tmp_path / "out")],
                   f"{weights}: not a readable safetensors file ({reason}); replace it with the model's own "
                   "(download or export it again)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("config.json", b"[1, 2]", "holds a JSON list, not an object ({...}); give the model's own config.json"),
    ("config.json", b'"deepseek_v3"', "holds a JSON str, not an object ({...}); give the model's own config.json"),
    ("config.json", b"{bad", "not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)); give the model's own config.json"),
    ("config.json", b"\xff\xfe{}", "not valid JSON ('utf-8' codec can't decode byte 0xff in position 0: invalid "
     "start byte); give the model's own config.json"),
    ("model.safetensors.index.json", b"[]", "holds a JSON list, not an object ({...}); give the model's own index "
     "file"),
    ("model.safetensors.index.json", b'{"metadata": {}}', "no weight_map of tensor names to shard files; give the "
     "model's own index file"),
])
def test_a_json_file_that_is_not_what_it_should_be_is_one_line(folders, tmp_path, capsys, name, text,
                                                                problem) -> None:
    hf, _ = folders
    broken = _hf_copy(hf, tmp_path / "broken")
    (broken / name).write_bytes(text)
    _refused_whole(capsys, ["--from-hf", str(broken), "--to", str(tmp_path / "out")], f"{broken / name}: {problem}")
    assert not (tmp_path / "out").exists()
