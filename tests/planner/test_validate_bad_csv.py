"""`moetrain validate` on a CSV it cannot use: one line naming what is wrong, exit code 2, file untouched."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from refusals import refused, snapshot


def _write(path: Path, rows: list[dict], drop: tuple[str, ...] = ()) -> Path:
    columns = [c for c in rows[0] if c not in drop]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture
def rows(published_rows: list[dict]) -> list[dict]:
    return [dict(r) for r in published_rows if r["id"] in ("NAR21-01", "VTRAIN-M-002")]


def _refused_untouched(capsys: pytest.CaptureFixture[str], path: Path, *expected: str) -> None:
    before = snapshot(path)
    refused(capsys, ["validate", str(path)], *expected)
    assert snapshot(path) == before


def test_missing_columns_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[dict]) -> None:
    path = _write(tmp_path / "rows.csv", rows, drop=("num_devices", "tp"))
    _refused_untouched(capsys, path, f"{path}: missing column(s) num_devices, tp; add them as in "
                                     "shared/validation/README.md")


@pytest.mark.parametrize(("column", "value", "problem"),
                         [("tp", "eight", "not a number"), ("layers", "96.5", "not a whole number"),
                          ("value", "nan", "not a finite number")])
def test_unreadable_number_names_row_column_and_value(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      rows: list[dict], column: str, value: str, problem: str) -> None:
    rows[1][column] = value
    path = _write(tmp_path / "rows.csv", rows)
    _refused_untouched(capsys, path, f"{path} line 3 (id VTRAIN-M-002): {column} is {value!r}, {problem}; fix that "
                                     "cell or leave it empty if the source does not say")


def test_undecodable_binary_and_empty_files(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            rows: list[dict]) -> None:
    path = _write(tmp_path / "rows.csv", rows)
    latin1 = path.read_bytes().replace(b"Megatron", b"M\xe9gatron", 1)
    line = latin1[:latin1.index(b"\xe9")].count(b"\n") + 1
    path.write_bytes(latin1)
    _refused_untouched(capsys, path, f"validation file {path} is not UTF-8 text: byte 0xe9 at line {line}, column ",
                       "; save it as UTF-8")
    path.write_bytes(b"id,model\x00\n")
    _refused_untouched(capsys, path, f"validation file {path} holds a NUL byte at line 1, column 9, so it is binary")
    _write(path, rows)
    path.write_text(path.read_text(encoding="utf-8").splitlines()[0] + "\n", encoding="utf-8")
    _refused_untouched(capsys, path, f"{path} holds a header but no rows; add one row per measurement")
