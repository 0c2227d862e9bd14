"""The recovery and checkpoint flags of ``moetrain train`` (issue 40, items 1 and 2): bad values are refused in
one line, exit 2, before anything runs; good ones reach the run spec."""

from __future__ import annotations

import argparse

import pytest

from moetrain.cli.train import add_arguments, build_spec
from refusals import refused, refused_within


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-restarts", "-1"], "--max-restarts: Input should be greater than or equal to 0, got -1"),
    (["--keep-last", "0"], "--keep-last: Input should be greater than or equal to 1, got 0"),
    (["--max-restarts", "100000", "--save-dir", "ckpt"],
     "--max-restarts: Input should be less than or equal to 10000, got 100000"),
])
def test_bad_values_are_refused_in_one_line(flags, message, capsys):
    refused_within(capsys, ["train", *flags], message)


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-restarts", "2"], "--max-restarts 2 needs --save-dir (each restart resumes from the newest checkpoint "
                              "there; add --save-every K to lose at most K steps)"),
    (["--async-save"], "--async-save needs --save-dir (the folder holding the checkpoints)"),
    (["--async-save", "--keep-last", "2"], "--async-save and --keep-last need --save-dir"),
])
def test_recovery_and_checkpoint_flags_need_a_save_dir(flags, message, capsys, tmp_path):
    refused(capsys, ["train", "--synthetic-data", *flags], message)


def test_an_unknown_save_error_choice_is_one_line(capsys):
    refused(capsys, ["train", "--on-save-error", "retry"], "--on-save-error 'retry': choose one of continue, stop")


def test_flags_set_the_run_spec(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run = build_spec(parser.parse_args(["--max-restarts", "3", "--async-save", "--keep-last", "2",
                                        "--on-save-error", "continue", "--save-dir", str(tmp_path)])).run
    assert (run.max_restarts, run.async_save, run.keep_last, run.on_save_error) == (3, True, 2, "continue")
    defaults = build_spec(parser.parse_args([])).run
    assert (defaults.max_restarts, defaults.async_save, defaults.keep_last, defaults.on_save_error) == \
        (0, False, None, "stop")
