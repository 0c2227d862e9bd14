"""The command line's vocabulary and manners (issue 45, item 6): every --help shows its defaults, one flag
name per concept (old names still parse, with a note), and a bad flag value is one line, not the usage."""

from __future__ import annotations

import argparse

import pytest

from moetrain.cli import COMMANDS, build_parser, main
from moetrain.config import TrainingConfig

PARSER = build_parser()


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


def _shows_a_default(action: argparse.Action) -> bool:
    """Whether argparse holds a default that a reader needs told (not "not given", not an off switch)."""
    if not action.option_strings or isinstance(action, argparse._HelpAction) or action.default is argparse.SUPPRESS:
        return False
    return action.default not in (None, "") and (action.default is not False
                                           or isinstance(action, argparse.BooleanOptionalAction))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_with_a_default_shows_it_in_help(command):
    parser = PARSER.commands[command]
    missing = [action.option_strings[0] for action in parser._actions
               if _shows_a_default(action) and "default" not in _help_of(parser, action)]
    assert missing == []


def test_train_help_shows_the_run_spec_defaults_its_flags_stand_for():
    parser = PARSER.commands["train"]
    helps = {action.option_strings[0]: _help_of(parser, action) for action in parser._actions if action.option_strings}
    defaults = TrainingConfig()
    assert helps["--steps"].endswith(f"(default: {defaults.steps})") and defaults.steps == 200
    assert helps["--global-batch"].endswith("(default: 16)")
    assert helps["--micro-batch"].endswith("(default: 4)")
    assert helps["--seq-len"].endswith("(default: 128)")
    assert helps["--dtype"].endswith("(default: auto)")
    assert helps["--model"].endswith("(default: tiny-pangu)")
    assert helps["--zero"].endswith("(default: 1)")
    assert helps["--policy"].endswith("(default: none)")
    assert "(default: off)" in _help_of(PARSER.commands["simulate"], _action(PARSER.commands["simulate"], "--overlap"))


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return parser._option_string_actions[flag]


@pytest.mark.parametrize(
    ("command", "new", "old", "value", "dest", "parsed"),
    [
        (["simulate", "--model", "m", "--cluster", "c", "--devices", "1"], "--dtype", "--precision", "fp8", "dtype",
         "fp8"),
        (["plan", "--model", "m", "--cluster", "c", "--devices", "1", "--seq-len", "8", "--global-batch", "8"],
         "--dtype", "--precision", "fp32", "dtype", "fp32"),
        (["balance", "--ep", "2"], "--trace-routing", "--trace", "t.jsonl", "trace_routing", "t.jsonl"),
        (["balance", "--ep", "2", "--trace-routing", "t"], "--balance-interval", "--interval", "7",
         "balance_interval", 7),
        (["balance", "--ep", "2", "--trace-routing", "t"], "--balance-horizon", "--horizon", "9", "balance_horizon", 9),
        (["convert", "--to-hf", "ckpt", "--out", "hf"], "--max-shard-gib", "--max-shard-gb", "0.5", "max_shard_gib",
         0.5),
    ],
)
def test_a_renamed_flag_still_parses_to_the_same_value_with_a_note(command, new, old, value, dest, parsed, capsys):
    by_new = build_parser().parse_args([*command, new, value])
    assert capsys.readouterr().err == ""
    by_old = build_parser().parse_args([*command, old, value])
    assert getattr(by_old, dest) == getattr(by_new, dest) == parsed
    assert vars(by_old) == vars(by_new)
    assert capsys.readouterr().err == f"moetrain {command[0]}: note: {old} is deprecated; use {new} (same meaning)\n"
    help_text = build_parser().commands[command[0]].format_help()
    assert f"formerly {old}, still accepted" in " ".join(help_text.split())
    assert not any(line.strip().startswith(old + " ") for line in help_text.splitlines())  # listed by its new name


def test_a_required_flag_given_by_its_old_name_counts_as_given(capsys):
    args = build_parser().parse_args(["balance", "--trace", "t.jsonl", "--ep", "2"])
    assert args.trace_routing == "t.jsonl"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--steps", "abc"], "--steps 'abc' is not an integer"),
        (["train", "--lr", "fast"], "--lr 'fast' is not a finite number"),
        (["train", "--lr", "nan"], "--lr 'nan' is not a finite number"),
        (["convert", "--max-shard-gib", "inf"], "--max-shard-gib 'inf' is not a finite number"),
        (["train", "--stepz", "3"], "unknown flag --stepz (did you mean --steps?)"),
        (["simulate", "--model", "m", "--cluster", "c", "--devices", "2", "--dtype", "fp4"],
         "--dtype 'fp4': choose one of bf16, fp16, fp8, fp32"),
        (["balance", "--ep", "2"], "missing --trace-routing"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"moetrain {argv[0]}: error: {message}; see moetrain {argv[0]} --help\n"


def _float_flags() -> list[tuple[str, str]]:
    return [(name, action.option_strings[0]) for name, parser in PARSER.commands.items()
            for action in parser._actions if action.type is float]


def test_every_float_flag_of_every_command_refuses_nan_and_infinity(capsys):
    flags = _float_flags()
    assert len(flags) > 20  # the sweep reaches the commands' float flags, not an empty list
    for command, flag in flags:
        for text in ("nan", "inf", "1e999"):
            with pytest.raises(SystemExit) as exit_info:
                PARSER.commands[command].parse_args([flag, text])
            assert exit_info.value.code == 2
            assert capsys.readouterr().err == (f"moetrain {command}: error: {flag} '{text}' is not a finite "
                                               f"number; see moetrain {command} --help\n")


def test_a_float_flag_takes_an_ordinary_number():
    assert PARSER.commands["train"].parse_args(["--lr", "3e-4"]).lr == 3e-4


def test_an_unknown_command_lists_the_commands(capsys):
    assert main(["trian"]) == 2
    commands = ", ".join(COMMANDS)
    assert capsys.readouterr().err == f"moetrain: error: unknown command 'trian'; choose one of {commands}; " \
                                      "see moetrain --help\n"


def test_top_level_help_does_not_call_rl_one_process():
    rl_line = next(line for line in PARSER.format_help().splitlines() if line.strip().startswith("rl "))
    assert "one process" not in rl_line and "--nproc" in PARSER.commands["rl"].description


def test_simulate_usage_says_seq_len_and_batch_are_required_without_rl():
    usage = PARSER.commands["simulate"].format_usage()
    assert "(--seq-len L --global-batch B | --rl" in usage and "[--seq-len" not in usage
