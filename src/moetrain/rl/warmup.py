"""When the SFT warm-up stops: on measured validation accuracy, not on a step count.

The warm-up's held-out accuracy rises through a sharp transition (addition on tiny-pangu: from under 5 %
to over 60 % within some 100 steps, after 150–250 steps near 0; docs/rl.md). A fixed step count that lands
inside it gives a starting policy that depends on the machine's floating-point path (threads, kernels):
the same 350 steps gave 20 % on one machine and 46 % on another. So the warm-up measures instead: every
``check_every`` steps, greedy accuracy on a validation set, and it stops at the first check that reaches
``target``, or at the step cap (``--sft-steps``).

The target sits where GRPO has signal: its advantages are zero in a group whose samples all score the
same, and below about 30 % most groups are all wrong. Rounding can move *when* the target is reached,
not *what* is reached: the start lands between the target and the target plus one interval's rise.
There is no plateau rule: before the transition accuracy stays flat near 0 for a hundred steps and more,
so "no rise for a while" cannot tell "not yet" from "never"; the cap bounds a task that never gets there.
The validation problems are held out from training (the hashed split of ``tasks``) and distinct from
the evaluation set, so the accuracy GRPO is judged by is not the one that picked the starting point.

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.rl.config import WarmupCriterion
from moetrain.rl.tasks import Problem, Task, distinct_problems, heldout_problems

StopReason = Literal["target", "cap"]


@dataclass(frozen=True)
class WarmupCheck:
    step: int
    """SFT steps done when measured."""
    accuracy: float
    """Greedy validation accuracy."""


@dataclass(frozen=True)
class WarmupDecision:
    """Where the warm-up stopped and why (the run's status line; ``warmup.json`` beside its checkpoint)."""

    step: int
    accuracy: float
    reason: StopReason
    target: float
    cap: int
    check_every: int

    def describe(self) -> str:
        why = {"target": f"validation accuracy {self.accuracy:.1%} reached the target {self.target:.0%}",
               "cap": f"the step cap (validation accuracy {self.accuracy:.1%}, target {self.target:.0%})"}[self.reason]
        return (f"SFT warm-up stopped at step {self.step} of at most {self.cap}: {why}; "
                f"checked every {self.check_every} steps")


def decide(check: WarmupCheck, criterion: WarmupCriterion, cap: int) -> WarmupDecision | None:
    """The decision after ``check`` (None: train on)."""
    reason: StopReason | None = ("target" if check.accuracy >= criterion.target else
                                 "cap" if check.step >= cap else None)
    if reason is None:
        return None
    return WarmupDecision(check.step, check.accuracy, reason, criterion.target, cap, criterion.check_every)


def validation_problems(task: Task, seed: int, count: int, evaluation: list[Problem]) -> list[Problem]:
    """Up to ``count`` distinct held-out problems of their own stream, none of them in ``evaluation`` (fewer
    where the task runs out of them: countdown's 256-problem evaluation set leaves about 220; the warm-up says
    how many it checks on)."""
    return distinct_problems(task, seed, "validation", count, frozenset(p.prompt for p in evaluation))


def warmup_validation(task: Task, seed: int, criterion: WarmupCriterion, eval_size: int) -> list[Problem]:
    """The validation set of a run whose held-out evaluation set has ``eval_size`` problems."""
    return validation_problems(task, seed, criterion.val_size, heldout_problems(task, seed, eval_size))
