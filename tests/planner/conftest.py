from __future__ import annotations

import csv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# shared/ lies beside the checkout (as in CI), or inside it
CANDIDATES = [root / "shared" / "validation" / "calibration.csv" for root in (REPO_ROOT.parent, REPO_ROOT)]


def _calibration_csv() -> Path | None:
    for path in CANDIDATES:
        if path.is_file():
            return path
    return None


@pytest.fixture
def calibration_csv() -> Path:
    path = _calibration_csv()
    if path is None:
        pytest.skip("shared/validation/calibration.csv not present")
    return path


@pytest.fixture
def published_rows(calibration_csv: Path) -> list[dict]:
    with calibration_csv.open(newline="") as f:
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
