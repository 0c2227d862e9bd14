"""Tasks from ``reasoning-gym`` (optional: ``pip install reasoning-gym``), named ``rg:<dataset>``.

reasoning-gym generates its problems procedurally from a seed (no download) and scores answers with each
dataset's own ``score_answer``. A problem here is one entry of the dataset, drawn with a seed taken from
the caller's ``random.Random`` (so ``tasks.problem_at`` keeps problems a function of (seed, purpose,
index)); its text is lower-cased and whitespace-collapsed for the character tokenizer, and an entry whose
prompt or answer is longer than the task's limits, or holds a character outside the tokenizer's alphabet,
is drawn again. Dataset options go after the name: ``rg:chain_sum:min_terms=2,max_terms=3``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from moetrain.errors import UserError
from moetrain.rl.problem import Problem
from moetrain.rl.tokenizer import ALPHABET

PREFIX = "rg:"
DRAWS = 200
"""Entries tried per problem before the limits are called too tight."""


def _options(text: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = int(value)
        except ValueError:
            options[key] = value
    return options


@dataclass(frozen=True)
class GymTask:
    dataset: str
    options: tuple[tuple[str, Any], ...] = ()
    max_prompt_chars: int = 96
    max_answer_chars: int = 12
    entries: dict[str, dict] = field(default_factory=dict, compare=False, repr=False)
    """The reasoning-gym entry of every prompt drawn so far (its scorer needs the entry)."""

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.dataset}" + (":" + ",".join(f"{k}={v}" for k, v in self.options) if self.options else "")

    def _entry(self, seed: int) -> dict:
        import reasoning_gym  # optional dependency: only an rg: task needs it (gym_task refuses its absence)

        return reasoning_gym.create_dataset(self.dataset, size=1, seed=seed, **dict(self.options))[0]

    def sample(self, rng: random.Random) -> Problem:
        for _ in range(DRAWS):
            entry = self._entry(rng.randrange(2**31))
            prompt = " ".join(str(entry["question"]).lower().split())
            answer = str(entry["answer"]).strip().lower()
            if (len(prompt) <= self.max_prompt_chars and len(answer) <= self.max_answer_chars
                    and set(prompt + answer) <= set(ALPHABET)):
                self.entries[prompt] = entry
                return Problem(prompt, answer)
        raise UserError(f"{self.name}: no problem within {self.max_prompt_chars} prompt and {self.max_answer_chars} "
                        f"answer characters of the task alphabet in {DRAWS} draws; pick simpler dataset options")

    def score(self, problem: Problem, completion: str) -> float:
        entry = self.entries.get(problem.prompt)
        if entry is None:  # a problem made elsewhere: exact match against the reference answer
            return float(completion.strip() == problem.answer)
        import reasoning_gym  # optional dependency (as above)

        scorer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
        return float(scorer(completion.strip(), entry) >= 1.0)


def gym_task(name: str) -> GymTask:
    """``rg:<dataset>[:key=value,...]`` → the task; refuses a missing package or an unknown dataset."""
    dataset, _, options = name.removeprefix(PREFIX).partition(":")
    try:
        import reasoning_gym  # optional dependency: refused here in one line when it is missing
    except ImportError:
        raise UserError(f"task {name!r} needs reasoning-gym: pip install reasoning-gym") from None
    if dataset not in reasoning_gym.factory.DATASETS:
        raise UserError(f"unknown reasoning-gym dataset {dataset!r}; see reasoning_gym.factory.DATASETS "
                        "(e.g. rg:basic_arithmetic, rg:chain_sum)")
    task = GymTask(dataset, tuple(sorted(_options(options).items())))
    try:
        task._entry(0)
    except Exception as exc:  # the dataset's own config validation
        raise UserError(f"task {name!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return task
