"""Automatic recovery: which attempt this process is, and what a restarted group lost.

``moetrain train --max-restarts N`` runs the ranks under torchrun with ``--max-restarts N``: when a rank
fails, torchrun's elastic agent stops the others and starts the whole group again, up to N times, with
``TORCHELASTIC_RESTART_COUNT`` telling each process its attempt. An attempt after the first resumes every
rank from the newest complete checkpoint (``moetrain.train.rank``), and the reporting rank drops
the failed attempt's metrics rows after it, so the metrics file stays one curve.

The steps lost to a failure are those the failed attempt completed after that checkpoint. The reporting
rank records each completed step in ``progress.json`` of the run's folder (``MOETRAIN_RECOVERY_DIR``,
set by the launcher only when restarts are allowed: one small file write per step); a restarted attempt
reads it, says what it lost in one line and appends the record to ``restarts.jsonl``, which the launcher
sums up at the end.

A rank that fails writes one line naming itself and the cause (``failure_line``, ``report_failure``) and
exits non-zero (``USER_ERROR_EXIT`` for a user error): ``moetrain train``'s ranks and ``moetrain rl``'s.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from moetrain.errors import UserError

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of the group's restarts, in every rank's environment."""
RECOVERY_ENV = "MOETRAIN_RECOVERY_DIR"
PROGRESS_FILE = "progress.json"
RESTARTS_FILE = "restarts.jsonl"
USER_ERROR_EXIT = 2
"""A rank's exit code when it stopped on a user error (1 otherwise)."""


class PeerLost(RuntimeError):
    """A collective of this rank failed because another rank stopped or fell past the timeout: neither this
    rank's fault nor its input's. The rank exits 1 (torchrun may restart the group), and its one line, which
    keeps the library's words, reads as a peer's loss (``peer_lost``)."""


def attempt() -> int:
    """This process's attempt: 0 the first, n after torchrun restarted the group n times."""
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def recovery_dir() -> Path | None:
    folder = os.environ.get(RECOVERY_ENV)
    return Path(folder) if folder else None


def record_progress(step: int) -> None:
    """The reporting rank's completed steps, after each step (atomic: a rename)."""
    folder = recovery_dir()
    if folder is None:
        return
    tmp = folder / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps({"attempt": attempt(), "step": step}))
    tmp.replace(folder / PROGRESS_FILE)


def last_progress() -> int | None:
    """The completed steps of the previous attempt (None: unknown)."""
    folder = recovery_dir()
    try:
        return int(json.loads((folder / PROGRESS_FILE).read_text())["step"]) if folder else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Restart:
    """One restart: the attempt, the checkpoint step it resumed from, the step the failed attempt reached."""

    attempt: int
    resumed_at: int
    failed_at: int | None
    cause: str

    @property
    def lost(self) -> int | None:
        return None if self.failed_at is None else max(self.failed_at - self.resumed_at, 0)

    def line(self, max_restarts: int) -> str:
        if self.lost is None:
            lost = "steps lost: unknown"
        elif self.lost == 0:
            lost = "no step lost"
        elif self.lost == 1:
            lost = f"1 step lost (step {self.failed_at} is trained again)"
        else:
            lost = f"{self.lost} steps lost (steps {self.resumed_at + 1}–{self.failed_at} are trained again)"
        return (f"restart {self.attempt} of {max_restarts} after {self.cause}: resumed from step {self.resumed_at}; "
                f"{lost}")


def previous_failure(error_dir: Path | None, failed_attempt: int, world_size: int) -> str:
    """The failed attempt's cause: a rank's own report that is not merely the loss of a peer, else the
    ranks that left no report (killed by a signal, or gone with an exit code), else a peer's report."""
    reports: dict[int, str] = {}
    if error_dir is not None:
        for path in error_dir.glob(report_name("*", failed_attempt)):
            match = re.match(r"rank(\d+)(\.restart(\d+))?\.txt$", path.name)
            if match and int(match.group(3) or 0) == failed_attempt:
                reports[int(match.group(1))] = path.read_text().strip()
    causes = [line for _, line in sorted(reports.items()) if not peer_lost(line)]
    if causes:
        return causes[0]
    silent = [rank for rank in range(world_size) if rank not in reports]
    if len(silent) > 1:  # the peers torchrun stopped said nothing either: the rank its agent saw fail first
        first = _first_failed_rank()
        silent = [rank for rank in silent if rank == first] or silent
    if silent:
        ranks = ", ".join(str(rank) for rank in silent)
        return f"rank{'s' * (len(silent) > 1)} {ranks} stopped without a report (a signal, or an exit)"
    return next(iter(reports.values()), "a rank failed")


def _first_failed_rank() -> int | None:
    """The rank torchrun's agent reported failed in the latest failure of this one-node run (its log, in the
    recovery folder: ``failed (exitcode: -9) local_rank: 0``); None: not known."""
    folder = recovery_dir()
    try:
        log = (folder / "torchrun.log").read_text(errors="replace") if folder else ""
    except OSError:
        return None
    found = re.findall(r"failed \(exitcode: -?\d+\) local_rank: (\d+)", log)
    return int(found[-1]) if found else None


def report_name(rank: int | str, attempt_number: int) -> str:
    """A rank's error report in the run's errors folder: ``rank1.txt``, ``rank1.restart2.txt`` after restarts."""
    return f"rank{rank}.txt" if attempt_number == 0 else f"rank{rank}.restart{attempt_number}.txt"


def peer_lost(line: str) -> bool:
    """A report that only says a peer went away (the survivors' view of another rank's failure)."""
    return re.search(r"Connection (reset|closed) by peer|Socket Timeout|timed out", line, re.I) is not None


def note_restart(restart: Restart) -> None:
    folder = recovery_dir()
    if folder is not None:
        with (folder / RESTARTS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(restart)) + "\n")


def restarts_summary(folder: Path) -> str | None:
    """One line on the restarts a run went through (None: none)."""
    try:
        records = [json.loads(line) for line in (folder / RESTARTS_FILE).read_text().splitlines() if line.strip()]
    except OSError:
        return None
    if not records:
        return None
    restarts = [Restart(**record) for record in records]
    known = [r.lost for r in restarts if r.lost is not None]
    lost = f"{sum(known)} step{'s' * (sum(known) != 1)} trained again" + (
        "" if len(known) == len(restarts) else " (some unknown)")
    at = ", ".join(f"step {r.resumed_at}" for r in restarts)
    return f"recovered from {len(restarts)} failure{'s' * (len(restarts) > 1)} (resumed at {at}); {lost}"


def failure_line(rank: int, exc: BaseException) -> str:
    """``rank R failed: cause``: the one line a failed rank reports (a user error without its type)."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    cause = first if isinstance(exc, UserError | PeerLost) else f"{type(exc).__name__}: {first}"
    return f"rank {rank} failed: {cause}"


def report_failure(rank: int, exc: BaseException) -> None:
    """Print the failure line, and write it to ``$MOETRAIN_ERROR_DIR`` where the launcher reads it."""
    message = failure_line(rank, exc)
    error_dir = os.environ.get("MOETRAIN_ERROR_DIR")
    if error_dir:
        Path(error_dir, report_name(rank, attempt())).write_text(message + "\n")
    print(message, file=sys.stderr, flush=True)
