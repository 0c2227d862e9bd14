"""Injected faults, to test and rehearse what a run does when a rank fails or a step goes bad.

``MOETRAIN_FAULT`` holds one fault or several, comma-separated, each ``RANK:STEP:KIND[:PHASE]``:

- ``RANK``: the rank (in the world) it strikes, or ``*`` for every rank;
- ``STEP``: the completed steps at that moment, as ``--stop-at`` counts them: ``0:5:nan`` poisons the
  sixth step, whose metrics row is step 6;
- ``KIND``: ``raise`` (a ``RuntimeError``) or ``kill`` (SIGKILL) before the step, or with ``PHASE``
  ``save`` as it saves the checkpoint after it; ``nan`` makes the step's loss, and so its gradient, NaN
  on that rank; ``spike`` (or ``spike=F``) multiplies them by 1000 (or F).

The trainer asks at each step (``Faults.__call__`` before it, ``Faults.loss_scale`` for it), so the
faults strike the loop every layout runs. Unset: no fault, and no cost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from moetrain.errors import UserError

ENV = "MOETRAIN_FAULT"
DEFAULT_SPIKE = 1000.0
"""``spike`` without a factor: far above any healthy step's loss, whatever the run."""
_KINDS = ("raise", "kill", "nan", "spike")
_PHASES = ("step", "save")


@dataclass(frozen=True)
class Fault:
    rank: int | None
    """None: every rank."""
    step: int
    kind: str
    phase: str = "step"
    factor: float = 1.0
    """The loss multiplier of a ``nan`` (NaN) or ``spike`` fault."""


@dataclass(frozen=True)
class Faults:
    """The faults of ``MOETRAIN_FAULT`` that strike one rank."""

    rank: int
    faults: tuple[Fault, ...] = ()

    def _matching(self, step: int, phase: str) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.phase == phase and f.rank in (None, self.rank)]

    def __call__(self, step: int, phase: str) -> None:
        """Fail here when a ``raise`` or ``kill`` fault is set for this rank, step and phase."""
        for fault in self._matching(step, phase):
            if fault.kind == "kill":
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "raise":
                raise RuntimeError(f"injected fault at step {step}")

    def loss_scale(self, step: int) -> float:
        """What this rank's loss is multiplied by in the step after ``step`` completed ones (1: no fault)."""
        scale = 1.0
        for fault in self._matching(step, "step"):
            scale *= fault.factor
        return scale


def parse_fault(text: str) -> Fault:
    """One ``RANK:STEP:KIND[:PHASE]``; a ``UserError`` naming what is wrong."""
    parts = text.strip().split(":")
    if len(parts) not in (3, 4):
        raise UserError(f"{ENV}={text}: give RANK:STEP:KIND[:PHASE], e.g. 1:5:nan")
    rank_text, step_text, kind_text, *phase = parts
    phase_name = phase[0] if phase else "step"
    kind, _, factor_text = kind_text.partition("=")
    try:
        rank = None if rank_text == "*" else int(rank_text)
        step = int(step_text)
        factor = float(factor_text) if factor_text else DEFAULT_SPIKE
    except ValueError:
        raise UserError(f"{ENV}={text}: RANK (or *) and STEP are integers, a spike factor a number") from None
    if kind not in _KINDS or (factor_text and kind != "spike"):
        raise UserError(f"{ENV}={text}: KIND is one of {', '.join(_KINDS)} (spike=F for a factor)")
    if phase_name not in _PHASES or (phase_name == "save" and kind not in ("raise", "kill")):
        raise UserError(f"{ENV}={text}: PHASE is step, or save for raise and kill")
    scale = {"nan": float("nan"), "spike": factor}.get(kind, 1.0)
    return Fault(rank, step, kind, phase_name, scale)


def injected_faults(rank: int, spec: str | None = None) -> Faults:
    """The faults ``MOETRAIN_FAULT`` (or ``spec``) sets for ``rank``."""
    spec = os.environ.get(ENV) if spec is None else spec
    if not spec:
        return Faults(rank)
    return Faults(rank, tuple(parse_fault(part) for part in spec.split(",")))
