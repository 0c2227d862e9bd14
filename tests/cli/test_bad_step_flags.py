"""The bad-step guard flags of ``moetrain train`` (issue 40, item 3): bad values are refused in one line,
exit 2, before anything runs; good ones reach the run spec."""

from __future__ import annotations

import argparse

import pytest

from moetrain.cli.train import add_arguments, build_spec
from refusals import refused_within


@pytest.mark.parametrize(("flags", "message"), [
    (["--spike-factor", "1"], "--spike-factor: Input should be greater than 1, got 1.0"),
    (["--spike-factor", "0.5"], "--spike-factor: Input should be greater than 1, got 0.5"),
    (["--max-bad-steps", "0"], "--max-bad-steps: Input should be greater than or equal to 1, got 0"),
    (["--spike-window", "0"], "--spike-window: Input should be greater than or equal to 1, got 0"),
])
def test_bad_guard_values_are_refused_in_one_line(flags, message, capsys):
    refused_within(capsys, ["train", *flags], message)


def test_guard_flags_set_the_run_spec():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = build_spec(parser.parse_args(["--spike-factor", "2.5", "--max-bad-steps", "3", "--spike-window", "7"]))
    assert (spec.guards.spike_factor, spec.guards.max_bad_steps, spec.guards.spike_window) == (2.5, 3, 7)
    defaults = build_spec(parser.parse_args([])).guards
    assert defaults.spike_factor is None and defaults.max_bad_steps == 5
