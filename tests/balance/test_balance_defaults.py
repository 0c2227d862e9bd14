"""The defaults a user gets (``BALANCE_DEFAULTS``) are the best of the defaults sweep (issue #43), and every entry
point reads them from that one object."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from moetrain.balance.online import BALANCE_DEFAULTS, PAYBACK_HORIZON, REPLAN_INTERVAL, default_slots_per_rank
from moetrain.balance.predict import AdaptivePredictor

SWEEP = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "balance_defaults.json"


def test_the_entry_points_read_the_one_defaults_object():
    import argparse
    import inspect

    from moetrain.balance.replay import replay
    from moetrain.balance.schedule import ReplanRule
    from moetrain.cli.balance import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace-routing", "t.jsonl", "--ep", "8"])
    assert (args.balance_interval, args.balance_horizon, args.predictor, args.solver) == (
        BALANCE_DEFAULTS.interval, BALANCE_DEFAULTS.horizon, BALANCE_DEFAULTS.predictor, BALANCE_DEFAULTS.solver)
    assert (BALANCE_DEFAULTS.interval, BALANCE_DEFAULTS.horizon) == (REPLAN_INTERVAL, PAYBACK_HORIZON)
    assert default_slots_per_rank(256, 8) == 32 + BALANCE_DEFAULTS.spare_slots_per_rank
    assert isinstance(BALANCE_DEFAULTS.build_predictor(), AdaptivePredictor)
    fields = ("interval", "horizon", "solver", "trigger_margin")
    assert {f: ReplanRule.__dataclass_fields__[f].default for f in fields} == {
        f: getattr(BALANCE_DEFAULTS, f) for f in fields}
    parameters = inspect.signature(replay).parameters
    assert (parameters["interval"].default, parameters["horizon"].default, parameters["solver"].default) == (
        BALANCE_DEFAULTS.interval, BALANCE_DEFAULTS.horizon, BALANCE_DEFAULTS.solver)


@pytest.mark.skipif(not SWEEP.exists(), reason="benchmarks/balance_defaults.py has not written its results")
def test_the_defaults_are_the_sweeps_best():
    sweep = json.loads(SWEEP.read_text())
    assert sweep["best"] == asdict(BALANCE_DEFAULTS), "rerun benchmarks/balance_defaults.py or change the defaults"
