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
                         [("tp", "eight", "not a number"), ("layers", "96.5", "not a whole number of at least 1"),
                          ("tp", "0", "not a whole number of at least 1"),
                          ("pp", "-1", "not a whole number of at least 1"),
                          ("zero", "7", "not a whole number from 0 to 3"),
                          ("recompute", "bogus", "not one of none, selective, full"),
                          ("precision", "fp4", "not one of bf16, fp16, fp8"),
                          ("metric", "step_time", "not one of step_time_s, tflops_per_device, tokens_per_s_per_device, "
                                                  "mfu, peak_memory_gib")])
def test_unreadable_cell_names_row_column_value_and_what_it_may_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[dict], column: str, value: str,
        problem: str) -> None:
    rows[1][column] = value
    path = _write(tmp_path / "rows.csv", rows)
    _refused_untouched(capsys, path, f"{path} line 3 (id VTRAIN-M-002): {column} is {value!r}, {problem}; fix that "
                                     "cell or leave it empty if the source does not say")


@pytest.mark.parametrize(("value", "problem"), [("", "value is empty"), ("nan", "value is 'nan', not a finite number"),
                                                ("0", "value is '0', not a positive number")])
def test_a_missing_or_unusable_measurement_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      rows: list[dict], value: str, problem: str) -> None:
    rows[1]["value"] = value
    path = _write(tmp_path / "rows.csv", rows)
    line = refused(capsys, ["validate", str(path)])
    assert line == (f"moetrain validate: error: {path} line 3 (id VTRAIN-M-002): {problem}; give the measurement, "
                    "a positive number in the unit its metric names")


def test_a_layout_that_does_not_fit_the_devices_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           rows: list[dict]) -> None:
    rows[1]["num_devices"] = "3"
    path = _write(tmp_path / "rows.csv", rows)
    line = refused(capsys, ["validate", str(path)])
    assert line == (f"moetrain validate: error: {path} line 3 (id VTRAIN-M-002): tp·pp·cp·dp = 1·1·1·64 = 64 devices, "
                    "not num_devices 3; fix the row's tp, pp, cp, dp or num_devices")


def test_a_file_without_one_simulable_row_is_refused_with_the_reasons(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[dict]) -> None:
    for row in rows:
        row["hardware"] = "nan"
    path = _write(tmp_path / "rows.csv", rows)
    line = refused(capsys, ["validate", str(path)])
    assert line == (f"moetrain validate: error: {path}: no row can be simulated (NAR21-01: hardware 'nan' is not in "
                    "the hardware table; VTRAIN-M-002: hardware 'nan' is not in the hardware table); give each row "
                    "what shared/validation/README.md says a prediction needs")


@pytest.mark.parametrize(("text", "problem"), [
    ("model: tiny-qwen3\ncluster: cpu\ndevices: 2\nseq_len: 128\nglobal_batch: 8\nparallel: {tp: 1}\n",
     "not a calibration file (it has model, cluster, devices, seq_len, …; a calibration file has global and per_arch "
     "sections); write one with `moetrain profile --out FILE` or `moetrain validate --fit FILE`"),
    ("fitted_on: by hand\n", "not a calibration file (no global or per_arch section); write one with `moetrain "
                             "profile --out FILE` or `moetrain validate --fit FILE`"),
    ("global: {gemm_max: fast}\n", "global.gemm_max is 'fast'; give a finite number above 0"),
    ("global: {gemm_max: .nan}\n", "global.gemm_max is nan; give a finite number above 0"),
    ("per_arch: {hopper: {step_overhead_ms: -1}}\n", "per_arch.hopper.step_overhead_ms is -1; give a finite number "
                                                     "0 or more"),
    ("per_arch: {hopper: 3}\n", "per_arch.hopper must map parameter names to numbers, e.g. {gemm_max: 0.7}"),
])
def test_a_file_that_is_no_calibration_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  small_csv: Path, text: str, problem: str) -> None:
    calibration = tmp_path / "plan.yaml"
    calibration.write_text(text, encoding="utf-8")
    line = refused(capsys, ["validate", str(small_csv), "--calibration", str(calibration)])
    assert line == f"moetrain validate: error: {calibration}: {problem}"


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
