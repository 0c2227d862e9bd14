"""Injected faults, to test and rehearse what a run does when a rank fails or a step goes bad.

``MOETRAIN_FAULT`` holds one fault or several, comma-separated, each ``RANK:STEP:KIND[:PHASE][@ATTEMPT]``:

- ``RANK``: the rank (in the world) it strikes, or ``*`` for every rank;
- ``STEP``: the completed steps at that moment, as ``--stop-at`` counts them: ``0:5:nan`` poisons the
  sixth step, whose metrics row is step 6;
- ``KIND``: ``raise`` (a ``RuntimeError``), ``kill`` (SIGKILL), ``exit`` (or ``exit=C``: the process
  ends at once with code 3, or C, as one killed by its library or the system would) or ``hang`` (or
  ``hang=S``: the rank sleeps an hour, or S seconds, while its peers wait on it until the collective
  timeout) before the step, with ``PHASE`` ``save`` as it saves the checkpoint after it, or with ``PHASE``
  ``load`` as it loads the checkpoint of step ``STEP`` (a resume, a restart, a rollback); ``nan``
  makes the step's loss, and so its gradient, NaN on that rank; ``spike`` (or ``spike=F``) multiplies
  them by 1000 (or F); ``save_error`` makes that rank's write of the checkpoint after the step fail as
  a full disk does (``OSError`` ENOSPC), to rehearse ``--on-save-error``;
- ``ATTEMPT``: under ``--max-restarts``, the attempt it strikes (torchrun's restart count, 0 the first)
  or ``*`` for every one; by default the first only, so a restarted group replays the step unharmed.

The trainer asks at each step (``Faults.__call__`` before it, ``Faults.loss_scale`` for it,
``Faults.save_error`` as it saves), so the faults strike the loop every layout runs. Unset: no fault,
and no cost.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from moetrain.errors import UserError
from moetrain.runtime_base.recovery import attempt

ENV = "MOETRAIN_FAULT"
DEFAULT_SPIKE = 1000.0
"""``spike`` without a factor: far above any healthy step's loss, whatever the run."""
DEFAULT_EXIT_CODE = 3
DEFAULT_HANG_S = 3600.0
"""``hang`` without a duration: past any collective timeout."""
_KINDS = ("raise", "kill", "exit", "hang", "nan", "spike", "save_error")
_VALUED = {"spike": DEFAULT_SPIKE, "exit": DEFAULT_EXIT_CODE, "hang": DEFAULT_HANG_S}
"""The kinds that take ``=VALUE``, and its default."""
_PHASES = ("step", "save", "load")


@dataclass(frozen=True)
class Fault:
    rank: int | None
    """None: every rank."""
    step: int
    kind: str
    phase: str = "step"
    factor: float = 1.0
    """The loss multiplier of a ``nan`` (NaN) or ``spike`` fault, an ``exit`` fault's code, a ``hang``'s
    seconds."""
    attempt: int | None = 0
    """The attempt it strikes (``attempt()``); None: every one."""


@dataclass(frozen=True)
class Faults:
    """The faults of ``MOETRAIN_FAULT`` that strike one rank."""

    rank: int
    faults: tuple[Fault, ...] = ()
    attempt: int = 0

    def _matching(self, step: int, phase: str) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.phase == phase and f.rank in (None, self.rank)
                and f.attempt in (None, self.attempt)]

    def __call__(self, step: int, phase: str) -> None:
        """Fail here when a ``raise``, ``kill``, ``exit`` or ``hang`` fault is set for this rank, step and
        phase."""
        for fault in self._matching(step, phase):
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "exit":
                os._exit(int(fault.factor))  # no report, no teardown: as a process the system ends
            if fault.kind == "hang":
                time.sleep(fault.factor)
            if fault.kind == "raise":
                raise RuntimeError(f"injected fault at step {step}")

    def save_error(self, step: int) -> bool:
        """Whether this rank's write of the checkpoint after ``step`` completed steps is to fail."""
        return any(f.kind == "save_error" for f in self._matching(step, "save"))

    def loss_scale(self, step: int) -> float:
        """What this rank's loss is multiplied by in the step after ``step`` completed ones (1: no fault)."""
        scale = 1.0
        for fault in self._matching(step, "step"):
            if fault.kind in ("nan", "spike"):
                scale *= fault.factor
        return scale


def parse_fault(text: str) -> Fault:
    """One ``RANK:STEP:KIND[:PHASE][@ATTEMPT]``; a ``UserError`` naming what is wrong."""
    body, at, attempt_text = text.strip().partition("@")
    parts = body.split(":")
    if len(parts) not in (3, 4):
        raise UserError(f"{ENV}={text}: give RANK:STEP:KIND[:PHASE][@ATTEMPT], e.g. 1:5:nan")
    rank_text, step_text, kind_text, *phase = parts
    kind, _, value_text = kind_text.partition("=")
    if kind not in _KINDS or (value_text and kind not in _VALUED):
        raise UserError(f"{ENV}={text}: KIND is one of {', '.join(_KINDS)} (spike=F, exit=C, hang=S for a value)")
    try:
        rank = None if rank_text == "*" else int(rank_text)
        step = int(step_text)
        value = float(value_text) if value_text else _VALUED.get(kind, 1.0)
        attempt_number = None if attempt_text == "*" else int(attempt_text) if at else 0
    except ValueError:
        raise UserError(f"{ENV}={text}: RANK (or *), STEP and ATTEMPT (or *) are integers, a kind's value a "
                        "number") from None
    phase_name = phase[0] if phase else ("save" if kind == "save_error" else "step")
    if phase_name not in _PHASES or (phase_name != "step" and kind in ("nan", "spike")) or \
            (kind == "save_error" and phase_name != "save"):
        raise UserError(f"{ENV}={text}: PHASE is step, save (raise, kill, exit, hang, save_error) or load "
                        "(raise, kill, exit, hang)")
    scale = {"nan": float("nan")}.get(kind, value)
    return Fault(rank, step, kind, phase_name, scale, attempt_number)


def injected_faults(rank: int, spec: str | None = None) -> Faults:
    """The faults ``MOETRAIN_FAULT`` (or ``spec``) sets for ``rank`` in this attempt."""
    spec = os.environ.get(ENV) if spec is None else spec
    if not spec:
        return Faults(rank, attempt=attempt())
    return Faults(rank, tuple(parse_fault(part) for part in spec.split(",")), attempt())
