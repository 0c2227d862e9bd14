from __future__ import annotations

import csv
from pathlib import Path

import pytest

CALIBRATION_CSV = Path("/work/shared/validation/calibration.csv")
REPO_CSV = Path(__file__).resolve().parents[2] / "shared" / "validation" / "calibration.csv"


def _calibration_csv() -> Path | None:
    for path in (REPO_CSV, CALIBRATION_CSV):
        if path.is_file():
            return path
    return None


@pytest.fixture
def published_rows() -> list[dict]:
    path = _calibration_csv()
    if path is None:
        pytest.skip("shared/validation/calibration.csv not present")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def small_csv(tmp_path: Path, published_rows: list[dict]) -> Path:
    """Three simulable rows and one that is not (no device count)."""
    wanted = {"NAR21-01", "VTRAIN-M-002", "MBR-1", "DSV2-1"}
    rows = [r for r in published_rows if r["id"] in wanted]
    out = tmp_path / "rows.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out
