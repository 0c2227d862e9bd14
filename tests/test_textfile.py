"""``textfile.require_file``: a path that is not a regular file is refused in one line that says which it is,
and every command that reads a user's file says so for a folder instead of calling it missing; a calibration
file that is not UTF-8 is refused where it is read, like every other file a user names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moetrain.errors import UserError
from moetrain.textfile import require_file
from refusals import refused


def test_each_kind_of_non_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "f.yaml").write_text("a: 1\n")
    require_file(tmp_path / "f.yaml", "plan file 'f.yaml'", "write one")
    cases = [(tmp_path / "missing.yaml", "does not exist"), (tmp_path, "is a folder, not a file")]
    if Path(os.devnull).exists():
        cases.append((Path(os.devnull), "is not a regular file"))
    for path, state in cases:
        with pytest.raises(UserError) as info:
            require_file(path, f"plan file {str(path)!r}", "write one with `moetrain plan --out FILE`")
        assert str(info.value) == f"plan file {str(path)!r} {state}; write one with `moetrain plan --out FILE`"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--plan", "{d}", "--quiet"], "--plan {d} is a folder, not a file; --plan takes a plan YAML "
         "file, the one `moetrain plan --out FILE` writes"),
        (["model-info", "--model", "{d}.yaml"], "model file '{d}.yaml' is a folder, not a file; give a preset name "
         "or an existing YAML path"),
        (["validate", "{d}"], "validation file '{d}' is a folder, not a file; give a CSV in the schema of "
         "shared/validation/README.md"),
    ],
)
def test_a_folder_given_as_a_file_is_called_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    argv: list[str], message: str) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    (tmp_path / "runs.yaml").mkdir()
    refused(capsys, [a.replace("{d}", str(folder)) for a in argv], message.replace("{d}", str(folder)))


def test_a_calibration_file_that_is_not_utf8_is_refused_in_one_line(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "cal.yaml"
    bad.write_bytes(b"global:\n  gemm_max: 0.7 # caf\xe9\n")
    refused(capsys, ["simulate", "--model", "tiny-pangu", "--cluster", "cpu", "--devices", "1", "--seq-len", "64",
                     "--global-batch", "4", "--calibration", str(bad)],
            f"calibration file {bad} is not UTF-8 text: byte 0xe9 at line 2, column 22; save it as UTF-8 or write "
            "it again with `moetrain profile --out FILE`")
