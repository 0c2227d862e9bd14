"""The cost model's predictions, held to what they were before its refactor into typed functions.

``data/reference_predictions.json`` was written by ``data/make_reference.py`` at commit 3e5f929, while
``costmodel.evaluate`` still returned a dict of string keys: the 89 predictions of ``moetrain validate``
on calibration.csv and the five best layouts of five ``moetrain plan`` searches. A change to the cost
model that moves any of them has changed a prediction, not only the code's shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain.cli import build_parser

REFERENCE = json.loads((Path(__file__).parent / "data" / "reference_predictions.json").read_text())
SMALL_SEARCHES = ("tiny-pangu-cpu4", "mixtral-h100-64-fp8", "qwen3-30b-a100-32-any")


def test_every_calibration_prediction_is_unchanged(calibration_csv: Path) -> None:
    from moetrain.cli.validate import validate

    result = validate(build_parser().parse_args(["validate", str(calibration_csv)]))
    got = {row["id"]: row["predicted"] for row in result["rows"]}
    assert len(got) == len(REFERENCE["validate"]) == 89
    for row_id, want in REFERENCE["validate"].items():
        assert got[row_id] == pytest.approx(want, rel=1e-9, abs=0.0), row_id


def _check_search(name: str, tmp_path: Path) -> None:
    from moetrain.cli.plan import plan_layouts

    want = REFERENCE["plan"][name]
    args = build_parser().parse_args(["plan", *want["flags"], "--top", "5", "--out", str(tmp_path / "plan.yaml")])
    summary, _ = plan_layouts(args)
    assert [row["parallel"] for row in summary["top"]] == [row["parallel"] for row in want["top"]]
    for got, ref in zip(summary["top"], want["top"], strict=True):
        for key in ("step_time_s", "mfu", "memory_gib"):
            assert got[key] == pytest.approx(ref[key], rel=1e-9, abs=0.0), (name, key)


@pytest.mark.parametrize("name", SMALL_SEARCHES)
def test_small_searches_pick_the_same_layouts(name: str, tmp_path: Path) -> None:
    _check_search(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(REFERENCE["plan"]) - set(SMALL_SEARCHES)))
def test_large_searches_pick_the_same_layouts(name: str, tmp_path: Path) -> None:
    _check_search(name, tmp_path)
