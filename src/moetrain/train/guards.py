"""Bad-step guards: what the trainer does after a step whose loss is not finite or spikes.

``train_step`` already refuses to update on a step whose loss or gradient norm is not finite (its
``skipped``). ``BadStepGuard`` judges the sequence of steps: a skipped step is counted, and
``max_bad_steps`` of them in a row, or a finite loss above ``spike_factor`` × the median of the last
``spike_window`` finite losses, asks for a rollback to the last checkpoint (``Trainer.roll_back``).

Every rank judges the same losses (the step's metrics are all-reduced) with the same state, so the
ranks agree without exchanging anything more.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.run import GuardOptions


@dataclass(frozen=True)
class Verdict:
    """What to do after one step."""

    action: Literal["keep", "skipped", "roll_back"]
    reason: str = ""
    """Why a step was skipped or the run rolls back, for the console line and the metrics row."""


@dataclass
class BadStepGuard:
    options: GuardOptions
    recent: deque[tuple[int, float]] = field(default_factory=deque)
    """(step, loss) of the latest finite steps, at most ``spike_window`` of them."""
    bad_in_a_row: int = 0
    skipped_steps: int = 0
    """Steps skipped so far by this process."""

    def judge(self, step: int, loss: float, grad_norm: float, skipped: bool) -> Verdict:
        """The verdict on completed step ``step`` (its metrics row's step)."""
        if skipped:
            self.skipped_steps += 1
            self.bad_in_a_row += 1
            reason = f"loss {loss}, gradient norm {grad_norm}"
            if self.bad_in_a_row >= self.options.max_bad_steps:
                return Verdict("roll_back", f"{self.bad_in_a_row} bad steps in a row ({reason})")
            return Verdict("skipped", reason)
        self.bad_in_a_row = 0
        factor, window = self.options.spike_factor, self.options.spike_window
        if factor is not None and len(self.recent) == window:
            median = statistics.median(value for _, value in self.recent)
            if loss > factor * median:
                return Verdict("roll_back", f"loss {loss:.4f} above {factor:g} × {median:.4f}, the median of "
                                            f"the last {window} steps")
        self.recent.append((step, loss))
        if len(self.recent) > window:
            self.recent.popleft()
        return Verdict("keep")

    def rolled_back(self, to_step: int) -> None:
        """Forget what the rollback to ``to_step`` completed steps undid: the later losses and the bad run."""
        self.recent = deque((step, loss) for step, loss in self.recent if step <= to_step)
        self.bad_in_a_row = 0
