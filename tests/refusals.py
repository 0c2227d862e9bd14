"""Helpers for the tests of bad input: the CLI refuses in one line, exit code 2, and leaves files as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetrain.cli import main


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    """Run ``moetrain argv`` in this process; assert exit code 2 and a stderr of one to three lines, the last
    ``moetrain <command>: error: ...``, without a traceback, holding every ``expected`` piece. Returns the error."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, err
    assert lines[-1].startswith(f"moetrain {argv[0]}: error: "), err
    for piece in expected:
        assert piece in lines[-1], f"{piece!r} not in {lines[-1]!r}"
    return lines[-1]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (or the file itself) with its bytes, to check that nothing changed."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused_within(capsys: pytest.CaptureFixture[str], argv: list[str], message: str, seconds: float = 1.0) -> None:
    """``refused`` with the whole message: ``moetrain <command>: error: <message>`` exactly, returned within
    ``seconds`` of wall time (the check runs before any corpus, model or search work)."""
    import time

    start = time.monotonic()
    line = refused(capsys, argv)
    elapsed = time.monotonic() - start
    assert line == f"moetrain {argv[0]}: error: {message}", line
    assert elapsed < seconds, f"refused after {elapsed:.2f} s"
