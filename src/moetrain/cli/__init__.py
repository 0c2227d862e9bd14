"""The ``moetrain`` command line.

Each subcommand lives in its own module of this package with three names: ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Command modules import torch (and anything
heavy) inside ``run`` only, so ``moetrain plan`` starts in milliseconds on a machine without torch.
Bad input raises ``UserError`` (or ``ValueError`` from a config); ``main`` prints it as one line and
returns exit code 2, with no traceback. A flag argparse itself refuses (``--steps abc``, an unknown flag)
gets the same one line (``CommandParser``), and every ``--help`` shows each option's default
(``DefaultsFormatter``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moetrain.cli.parsing import CommandParser, DefaultsFormatter
from moetrain.errors import UserError

# name on the command line → module under moetrain.cli
COMMANDS: dict[str, str] = {
    "train": "train",
    "model-info": "model_info",
    "simulate": "simulate",
    "plan": "plan",
    "validate": "validate",
    "profile": "profile",
    "memory": "memory",
    "balance": "balance",
    "convert": "convert",
    "rl": "rl",
}


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="moetrain", description="Train large mixture-of-experts models.",
                           formatter_class=DefaultsFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.commands = {}
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(f"moetrain.cli.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"moetrain.cli.{module_name}":
                raise
            continue
        command = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=DefaultsFormatter)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
        parser.commands[name] = command
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error already printed as one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a reader that closed the pipe shows here, not at interpreter exit
        return code
    except UserError as exc:
        print(f"moetrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moetrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader closed the pipe (`moetrain plan ... | head`): stop quietly, as other Unix tools do.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
