"""What the planner's validation benchmarks share: the published-runs file and the error summaries."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetrain.planner.validation import PreparedRow, prepare_all, summarize

THRESHOLD_PCT = 12.0
_ROOT = Path(__file__).resolve().parents[1]
# The published runs: ../shared beside the checkout (CI, development), or a shared/ folder inside it.
CALIBRATION_CSV = next((p for p in (_ROOT.parent / "shared/validation/calibration.csv",
                                    _ROOT / "shared/validation/calibration.csv") if p.is_file()),
                       _ROOT.parent / "shared/validation/calibration.csv")


def prepared_rows(raw: list[dict]) -> list[PreparedRow]:
    """The rows ready to simulate; a held-out file has no row the simulator cannot take."""
    rows, unsimulable = prepare_all(raw)
    assert not unsimulable, [u.reason for u in unsimulable]
    return rows


def signed_pct_errors(rows: list[PreparedRow], predicted: np.ndarray) -> np.ndarray:
    """100·(predicted − measured)/measured per row."""
    measured = np.array([r.measured for r in rows])
    return 100.0 * (predicted - measured) / measured


def summary(signed_pct: np.ndarray) -> dict[str, float]:
    """``moetrain validate``'s summary (median, 90th percentile, n) plus the mean, the median signed error
    and the rows above 12 %."""
    errors = np.abs(signed_pct)
    return summarize(list(errors)) | {
        "mean_abs_pct_error": float(np.mean(errors)),
        "median_signed_pct_error": float(np.median(signed_pct)),
        "rows_above_12_pct": int(np.sum(errors > THRESHOLD_PCT)),
    }


def print_summaries(summaries: dict[str, dict[str, float]]) -> None:
    for name, s in summaries.items():
        print(f"{name:40s} median {s['median_abs_pct_error']:5.1f} %  p90 {s['p90_abs_pct_error']:5.1f} %  "
              f"mean {s['mean_abs_pct_error']:5.1f} %  above 12 %: {s['rows_above_12_pct']}/{s['n']}")
