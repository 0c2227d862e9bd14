"""A problem and the task protocol every RL task implements: the built-in tasks (``moetrain.rl.tasks``) and
the reasoning-gym ones (``moetrain.rl.gym_tasks``) both build on this module, never on each other.
Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal, Protocol

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """A reference answer: the SFT target (countdown accepts any correct expression)."""
    numbers: tuple[int, ...] = ()
    """The given numbers (countdown)."""
    target: int = 0
    """The number to reach (countdown)."""


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 for a correct completion, else 0.0 (the completion is the text before EOS)."""
        ...

    @property
    def max_prompt_chars(self) -> int: ...

    @property
    def max_answer_chars(self) -> int: ...
