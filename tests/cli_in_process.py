"""Helper for the launch and recovery tests: ``moetrain`` run in the test process, with a fault planted.

The launcher runs here (one Python and torch start-up fewer per run); torchrun and the ranks inherit the
environment and print to the file descriptors ``capfd`` reads, so a run's output includes its ranks'.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moetrain.cli import main


@dataclass
class Finished:
    """What ``moetrain`` returned and printed (its ranks' output included)."""

    returncode: int
    stdout: str
    stderr: str


class InProcessCli:
    """``moetrain *argv`` with ``MOETRAIN_FAULT=fault`` (none by default), one intra-op thread per process
    and unwrapped console lines."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
        self.monkeypatch, self.capfd = monkeypatch, capfd
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("COLUMNS", "400")

    def __call__(self, argv: list[str], fault: str | None = None) -> Finished:
        if fault:
            self.monkeypatch.setenv("MOETRAIN_FAULT", fault)
        else:
            self.monkeypatch.delenv("MOETRAIN_FAULT", raising=False)
        self.capfd.readouterr()
        code = main(argv)
        printed = self.capfd.readouterr()
        return Finished(code, printed.out, printed.err)
