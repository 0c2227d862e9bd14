"""How the command line parses and explains itself: one-line usage errors, defaults in every ``--help``,
and renamed flags that keep working under their old name for a release.

argparse answers a bad value (``--steps abc``) with the whole usage block, a screenful for ``moetrain
train``; ``CommandParser`` answers with the one line every other refusal gets (``moetrain train: error:
--steps 'abc' is not an integer; see moetrain train --help``, exit 2), and names a close match for an
unknown flag. ``DefaultsFormatter`` appends ``(default: X)`` to each option whose default is a value,
so no command hides its defaults. ``add_renamed_flag`` keeps an old flag name parsing to the new one's
field, with a one-line note on stderr.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import re
import sys
from typing import Any, NoReturn

_TYPE_NAMES = {"int": "an integer", "float": "a finite number"}
_INVALID_VALUE = re.compile(r"^argument (?P<flag>[^:]+): invalid (?P<type>\w+) value: (?P<value>.*)$")
_INVALID_CHOICE = re.compile(
    r"^argument (?P<flag>[^:]+): invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)$")


def _first_flag(flags: str) -> str:
    """argparse names an option by all its strings (``--overlap/--no-overlap``); the first is the one typed."""
    return flags.split("/")[0]


def one_line(message: str) -> str:
    """argparse's message in the project's words: the flag first, what is wrong with its value."""
    if match := _INVALID_VALUE.match(message):
        kind = _TYPE_NAMES.get(match["type"], f"a valid {match['type']}")
        return f"{_first_flag(match['flag'])} {match['value']} is not {kind}"
    if match := _INVALID_CHOICE.match(message):
        choices = match["choices"].replace("'", "")
        if match["flag"] == "COMMAND":
            return f"unknown command {match['value']}; choose one of {choices}"
        return f"{_first_flag(match['flag'])} {match['value']}: choose one of {choices}"
    if message.startswith("the following arguments are required: "):
        names = message.removeprefix("the following arguments are required: ").split(", ")
        return "missing " + ", ".join(_first_flag(name) for name in names)
    if message.startswith("argument ") and message.endswith(": expected one argument"):
        return f"{_first_flag(message.removeprefix('argument ').split(':')[0])} needs a value"
    return message.removeprefix("argument ")


def finite_float(text: str) -> float:
    """``float`` that refuses ``nan`` and ``inf``: no flag of a training run means either, and either passed on
    turns into a NaN loss, a hang or a traceback far from the typo."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit 2) instead of the usage block,
    and whose ``type=float`` options take finite numbers only."""

    commands: dict[str, argparse.ArgumentParser]
    """The subcommands' parsers by name (top-level parser only), to blame a stray flag on its command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse looks every ``type`` up in this registry before calling it, and argument groups share it,
        # so every ``type=float`` flag of every command parses through ``finite_float`` (and argparse still
        # names the type "float" in its error, which ``one_line`` words as "a finite number").
        self.register("type", float, finite_float)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}; see {self.prog} --help\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            owner.error(unknown_arguments(owner, extras))
        return parsed


def unknown_arguments(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unknown flag --stepz (did you mean --steps?)``, or the stray values."""
    flags = [x for x in extras if x.startswith("-")]
    if not flags:
        return f"unexpected argument{'s' * (len(extras) > 1)} {' '.join(extras)}"
    flag = flags[0].split("=")[0]
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    more = f" (and {' '.join(flags[1:])})" if len(flags) > 1 else ""
    return f"unknown flag {flag}{hint}{more}"


def format_default(value: Any) -> str:
    """How a default reads in help: booleans as on/off, lists comma-separated."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose default is a value and whose help does not state it.

    Flags whose default lives elsewhere (``moetrain train``'s flags default to "not given" so a config file
    can set the field) write their real default into their help themselves."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default in (None, "") or default is argparse.SUPPRESS
                or (default is False and not isinstance(action, argparse.BooleanOptionalAction))
                or isinstance(action, argparse._HelpAction | argparse._VersionAction)):
            return text
        return f"{text} (default: {format_default(default).replace('%', '%%')})"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        hidden = getattr(action, "renamed_from", ())
        if not hidden:
            return super()._format_action_invocation(action)
        shown = copy.copy(action)
        shown.option_strings = [s for s in action.option_strings if s not in hidden]
        return super()._format_action_invocation(shown)


def add_renamed_flag(container: argparse._ActionsContainer, old: str, new: argparse.Action) -> None:
    """Keep ``old`` working as a deprecated spelling of the option ``new``: the same action (so a required
    flag given by its old name counts as given), a one-line note on stderr when it is used, and only the new
    name in ``--help``, whose text says the old one is still accepted."""
    if old in container._option_string_actions:
        raise ValueError(f"{old} is already a flag")
    new.option_strings.append(old)
    container._option_string_actions[old] = new
    base = type(new)

    def call(self: argparse.Action, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
             option_string: str | None = None) -> None:
        if option_string == old:
            print(f"{parser.prog}: note: {old} is deprecated; use {self.option_strings[0]} (same meaning)",
                  file=sys.stderr)
        base.__call__(self, parser, namespace, values, option_string)

    new.__class__ = type(f"Renamed{base.__name__}", (base,), {"__call__": call})
    new.renamed_from = (*getattr(new, "renamed_from", ()), old)  # type: ignore[attr-defined]
    new.help = f"{new.help or ''} (formerly {old}, still accepted)".strip()
