"""Status lines for the phases that take seconds (a corpus download, tokenizer training, rendering a chart,
ranks starting), so that nothing runs silently.

``phase(console, "training the tokenizer")`` shows a spinner with the text on a terminal, or prints the text
as a plain line elsewhere (a log file, a cluster job), and after the phase a line with the time it took.
``console`` None (a quiet run, or a rank that does not report) prints nothing. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console


def status_console(quiet: bool = False, stderr: bool = False) -> Console | None:
    """The console status lines go to (None when the run is quiet); ``stderr`` for commands whose stdout
    is data (``--json``)."""
    return None if quiet else Console(stderr=stderr, highlight=False)


def say(console: Console | None, text: str) -> None:
    """One plain status line (no spinner): what is about to happen. Written to the console's file itself, so
    that a reader closing the pipe (``moetrain plan | head``) ends the command as any other write does."""
    if console is not None and not console.quiet:
        console.file.write(text + "\n")
        console.file.flush()


@contextmanager
def phase(console: Console | None, doing: str, done: str | None = None) -> Iterator[None]:
    """``doing…`` while the phase runs, then ``done in 12.3 s`` (``done`` defaults to ``doing``)."""
    if console is None or console.quiet:
        yield
        return
    start = time.monotonic()
    if console.is_terminal and not console.is_dumb_terminal:
        with console.status(f"{doing}…"):
            yield
    else:
        say(console, f"{doing}…")
        yield
    say(console, f"{done or doing}: {time.monotonic() - start:.1f} s")
